"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM`` (``oxibonsai serve``).

``api_server`` holds the app, its routes and lifespan; ``http`` the plumbing under them (body limits,
disconnects, SSE, auth and metrics middleware); ``state`` what routes and launcher share; ``protocol``
the request models with OpenAI's and vLLM's field names (validated at the edge); ``serving_completion``
/ ``serving_chat`` translate a request into engine calls (``generation``) and engine outputs into
OpenAI responses and SSE chunks (``openai_format``, ``streaming``, ``tool_parser``); ``metrics`` the
vLLM-named series; ``launcher`` runs uvicorn with draining on SIGTERM; ``cli_args`` holds the flags.
Importing ``oxibonsai`` never imports this package, and importing this package imports FastAPI only
when ``build_app`` is first used (the ``server`` extra: fastapi, uvicorn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oxibonsai.server.config import ServerConfig

if TYPE_CHECKING:
    from oxibonsai.server.api_server import build_app

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from oxibonsai.server.api_server import build_app

        return build_app
    raise AttributeError(f"module 'oxibonsai.server' has no attribute {name!r}")

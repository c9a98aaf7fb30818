"""What a stream has already sent of each choice, and how an error after the header is reported.

Engine outputs are cumulative; ``ChoiceCursor`` turns them into deltas (new text, new tokens and their
logprobs). The engine holds back text that may start a stop string, so a delta never contains one. An
error after the 200 header cannot change the status: it is sent as one ``data: {"error": ...}`` event
(the ``openai`` client raises ``APIError`` on it) before ``[DONE]``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from oxibonsai.outputs import Logprob
from oxibonsai.server.errors import error_from_exception
from oxibonsai.server.openai_format import sse

log = logging.getLogger("oxibonsai.server")


class ChoiceCursor:
    """How much of one choice's text and tokens has been sent."""

    def __init__(self) -> None:
        self.started = False
        self._chars = 0
        self._tokens = 0
        self._offset = 0

    def new_text(self, text: str) -> str:
        delta = text[self._chars :]
        self._chars = len(text)
        return delta

    def new_tokens(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]] | None
    ) -> tuple[list[int], list[dict[int, Logprob]] | None]:
        start, self._tokens = self._tokens, len(token_ids)
        entries = list(logprobs[start:]) if logprobs is not None else None
        return list(token_ids[start:]), entries

    def take_offset(self, text: str) -> int:
        """The text offset of this delta's first token; advances past the delta."""
        offset, self._offset = self._offset, self._offset + len(text)
        return offset


def error_event(error: BaseException) -> bytes:
    api_error = error_from_exception(error)
    if api_error.status >= 500:
        log.error("stream failed after its header was sent: %r", error)
    return sse(api_error.body())

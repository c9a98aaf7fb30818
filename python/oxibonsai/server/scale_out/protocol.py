"""What the ingress sends an engine replica and what comes back: a ``ReplicaRequest`` (the prompt dict,
sampling parameters, request id and priority, with the prompt's token ids where the router reads them),
then ``ACCEPTED`` once the replica's ``AsyncLLM`` has queued it (so refusals such as a full queue reach
the client before any response byte), then ``RequestOutput``s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oxibonsai.sampling_params import SamplingParams

ACCEPTED = "oxibonsai:accepted"


@dataclass(frozen=True)
class ReplicaRequest:
    prompt: dict[str, Any]
    params: SamplingParams
    request_id: str
    priority: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.prompt.get("prompt_token_ids") or [])

    @property
    def cache_salt(self) -> str | None:
        salt = self.prompt.get("cache_salt")
        return salt if isinstance(salt, str) else None

"""Engine outputs in OpenAI's response shapes: usage, logprobs (the chat and the legacy completions
forms), finish reasons and SSE events. Pure functions over ``RequestOutput`` data; no engine calls."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from oxibonsai.outputs import Logprob, RequestOutput
from oxibonsai.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"
KEEPALIVE_EVENT = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
ChoiceBuilder = Callable[[int, RequestOutput], dict[str, Any]]


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class UsageCounter:
    """Usage of a request with ``n`` samples per prompt: each prompt counted once (with the cached
    tokens of its first sample), completion tokens summed over every choice."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._prompt: dict[int, tuple[int, int]] = {}
        self._completion: dict[int, int] = {}

    def update(self, choice: int, out: RequestOutput) -> None:
        prompt = choice // self._n
        if choice % self._n == 0 or prompt not in self._prompt:
            self._prompt[prompt] = (len(out.prompt_token_ids), out.num_cached_tokens)
        self._completion[choice] = len(out.outputs[0].token_ids)

    def usage(self) -> dict[str, Any]:
        prompt = sum(p for p, _ in self._prompt.values())
        cached = sum(c for _, c in self._prompt.values())
        return usage(prompt, sum(self._completion.values()), cached)


def full_response(
    id_prefix: str, kind: str, model: str, n: int, finals: Sequence[RequestOutput], choice: ChoiceBuilder
) -> dict[str, Any]:
    """A non-streaming response: one choice per final output (``choice(index, output)``) and the usage."""
    counter = UsageCounter(n)
    for i, out in enumerate(finals):
        counter.update(i, out)
    return {
        "id": response_id(id_prefix),
        "object": kind,
        "created": created(),
        "model": model,
        "choices": [choice(i, out) for i, out in enumerate(finals)],
        "usage": counter.usage(),
    }


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    return list(tokenizer.token_pieces.token_bytes(token_id))


def _text(entry: Logprob, tokenizer: Tokenizer, token_id: int) -> str:
    if entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _ranked(entries: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(
        ((t, lp) for t, lp in entries.items() if lp.rank is not None), key=lambda x: x[1].rank or 0
    )
    return ranked[:limit]


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top: int
) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`` for the given tokens."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token]
        content.append(
            {
                "token": _text(chosen, tokenizer, token),
                "logprob": chosen.logprob,
                "bytes": _token_bytes(tokenizer, token),
                "top_logprobs": [
                    {
                        "token": _text(lp, tokenizer, t),
                        "logprob": lp.logprob,
                        "bytes": _token_bytes(tokenizer, t),
                    }
                    for t, lp in _ranked(entry, top)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    top: int,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy form: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token: logprob}`` per position) and ``text_offset`` (starting at ``text_offset``). An entry of
    None (an echoed prompt's first token, which nothing scores) gives null logprobs."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            text = tokenizer.decode([token], skip_special_tokens=False)
            logprobs.append(None)
            tops.append(None)
        else:
            text = _text(entry[token], tokenizer, token)
            logprobs.append(entry[token].logprob)
            best = {_text(lp, tokenizer, t): lp.logprob for t, lp in _ranked(entry, top)} if top else None
            tops.append(best)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(
    prompt_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None] | None, top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id: {logprob, rank,
    decoded_token}}`` with the ``top`` best ids and the prompt's own token (entries scored with more
    top ids, for ``echo``, are cut to ``top``)."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in entry.items()
                if t == token or (lp.rank is not None and lp.rank <= top)
            }
        )
    return out


def joined_logprobs(*parts: dict[str, Any]) -> dict[str, Any]:
    """Legacy logprobs of consecutive spans (an echoed prompt's, then the completion's) as one."""
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}

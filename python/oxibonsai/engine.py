"""The step loop: requests wait, are admitted when their KV blocks fit, and every ``step()`` runs one
batched forward pass (prefills and decodes together) through the native model, samples one token per
request with that request's own seeded sampler, detokenizes incrementally and applies stop tokens and
stop strings. It never loops over layers or tokens in Python; one step is one native call.

With prefix caching on, a request starts on the cached blocks of its prompt's longest cached prefix
(separated per ``cache_salt``) and its first step sends only the uncached rest. Admission counts a
request's worst-case new blocks plus the cached blocks it takes out of the evictable pool."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from oxibonsai import _core
from oxibonsai.detokenizer import IncrementalDetokenizer, StopStringMatcher
from oxibonsai.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.tokenizer import Tokenizer

_MASK64 = (1 << 64) - 1


def request_seed(engine_seed: int, index: int) -> int:
    """A per-request seed from the engine seed and the request's arrival index (SplitMix64 finalizer)."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sampler: _core.Sampler
    max_new: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    metrics: RequestMetrics
    streamed: bool = False
    cache_salt: str | None = None
    seq: int | None = None
    num_cached_tokens: int = 0
    prefilled: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def snapshot(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            outputs=[completion],
            finished=self.finish_reason is not None,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class Engine:
    """Runs requests to completion over one native ``Model``; not thread-safe (``AsyncLLM`` wraps it)."""

    def __init__(self, model: _core.Model, tokenizer: Tokenizer, *, seed: int, max_num_seqs: int) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._seed = seed
        self._max_num_seqs = max_num_seqs
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._arrivals = 0

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request after checking it can ever run (length against the context and the cache).
        A streamed request reports its output after every step; others only when they finish.
        Requests share cached prompt blocks only with requests of the same ``cache_salt``."""
        limit = self._model.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt is {len(prompt_ids)} tokens, but the context (max_model_len={limit}) "
                "must also leave room for at least one generated token"
            )
        vocab = self._model.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab}")
        room = limit - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if self._blocks_for(len(prompt_ids) + max_new) > self._model.num_blocks:
            raise ValueError(
                f"the request needs {self._blocks_for(len(prompt_ids) + max_new)} KV blocks but the cache "
                f"has {self._model.num_blocks}; raise kv_cache_blocks or lower max_tokens"
            )
        self._arrivals += 1
        request = _Request(
            request_id=request_id,
            prompt=prompt,
            prompt_ids=list(prompt_ids),
            params=params,
            sampler=params.sampler(request_seed(self._seed, self._arrivals)),
            max_new=max_new,
            detok=IncrementalDetokenizer(self._tokenizer, prompt_ids, params.skip_special_tokens),
            stops=StopStringMatcher(params.stop or [], params.include_stop_str_in_output),
            metrics=RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids)),
            logprobs=[] if params.logprobs is not None else None,
            streamed=stream,
            cache_salt=cache_salt,
        )
        self._waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def abort(self, request_id: str) -> bool:
        """Drops a waiting or running request and frees its KV blocks; False if it is unknown."""
        for r in list(self._waiting):
            if r.request_id == request_id:
                self._waiting.remove(r)
                return True
        for r in list(self._running):
            if r.request_id == request_id:
                self._finish(r, "abort")
                return True
        return False

    def abort_all(self) -> None:
        self._waiting.clear()
        for r in list(self._running):
            self._finish(r, "abort")

    def step(self) -> list[RequestOutput]:
        """One batched forward pass over every running request; returns the outputs of requests that
        finished and of streamed ones (a snapshot copies the output so far, so others are not copied)."""
        self._admit()
        running = list(self._running)
        if not running:
            return []
        now = time.perf_counter()
        items = []
        for r in running:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            tokens = r.output_ids[-1:] if r.prefilled else r.prompt_ids[r.num_cached_tokens :]
            items.append((r.seq, tokens, "last"))
        logits = self._model.step(items)
        outputs = []
        for r, row in zip(running, logits, strict=True):
            r.prefilled = True
            self._advance(r, row)
            if r.streamed or r.finish_reason is not None:
                outputs.append(r.snapshot())
        return outputs

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._model.block_tokens)

    def _reservation(self, r: _Request) -> int:
        return self._blocks_for(len(r.prompt_ids) + r.max_new)

    def _blocks_to_come(self, r: _Request) -> int:
        """Blocks a running request may still allocate: its worst case less the blocks it holds."""
        in_cache = len(r.prompt_ids) + len(r.output_ids) - 1 if r.prefilled else r.num_cached_tokens
        return self._reservation(r) - self._blocks_for(in_cache)

    def _admit(self) -> None:
        """Starts waiting requests, in arrival order, while their worst-case KV blocks fit: the blocks
        running requests may still allocate, plus the newcomer's uncached blocks and the idle cached
        blocks it takes, must fit in the free and evictable blocks."""
        while self._waiting and len(self._running) < self._max_num_seqs:
            r = self._waiting[0]
            cached, idle = self._model.cached_prefix(r.prompt_ids, r.cache_salt)
            need = self._reservation(r) - cached // self._model.block_tokens + idle
            promised = sum(self._blocks_to_come(q) for q in self._running)
            if promised + need > self._model.num_available_blocks:
                break
            self._waiting.popleft()
            r.seq, r.num_cached_tokens = self._model.add_sequence_cached(r.prompt_ids, r.cache_salt)
            self._running.append(r)

    def _banned(self, r: _Request) -> list[int]:
        if len(r.output_ids) >= r.params.min_tokens:
            return []
        return sorted(self._tokenizer.stop_token_ids | set(r.params.stop_token_ids or []))

    def _advance(self, r: _Request, logits: object) -> None:
        n_logprobs = r.params.logprobs or 0
        token, logprob, top = r.sampler.sample(
            logits, r.prompt_ids, r.output_ids, self._banned(r), n_logprobs
        )
        now = time.perf_counter()
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = now
        r.output_ids.append(token)
        r.metrics.num_generated_tokens = len(r.output_ids)
        self._record_logprobs(r, token, logprob, top)
        if self._is_stop_token(r, token):
            r.stop_reason = None if token in self._tokenizer.stop_token_ids else token
            self._finish(r, "stop", flush=True)
            return
        emitted, stopped = r.stops.feed(r.detok.add(token))
        r.text += emitted
        if stopped:
            r.stop_reason = r.stops.matched
            self._finish(r, "stop")
        elif len(r.output_ids) >= r.max_new:
            self._finish(r, "length", flush=True)

    def _is_stop_token(self, r: _Request, token: int) -> bool:
        if token in (r.params.stop_token_ids or []):
            return True
        return not r.params.ignore_eos and token in self._tokenizer.stop_token_ids

    def _record_logprobs(self, r: _Request, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        if r.logprobs is None:
            return
        r.cumulative_logprob += logprob
        entry = {
            t: Logprob(lp, rank, self._tokenizer.decode([t], skip_special_tokens=False))
            for rank, (t, lp) in enumerate(top, 1)
        }
        if token not in entry:
            entry[token] = Logprob(logprob, None, self._tokenizer.decode([token], skip_special_tokens=False))
        r.logprobs.append(entry)

    def _finish(self, r: _Request, reason: str, *, flush: bool = False) -> None:
        if flush:
            # Generation ended for another reason: emit held-back bytes and text (decode's U+FFFD for
            # an unfinished character included), unless they complete a stop string.
            emitted, stopped = r.stops.feed(r.detok.finish())
            r.text += emitted if stopped else emitted + r.stops.flush()
        r.finish_reason = reason
        r.metrics.finished_time = time.perf_counter()
        if r in self._running:
            self._running.remove(r)
            if r.seq is not None:
                self._model.free_sequence(r.seq)

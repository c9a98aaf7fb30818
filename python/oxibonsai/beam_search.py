"""Beam search (vLLM's ``LLM.beam_search`` and ``BeamSearchParams``): the ``beam_width`` most likely
continuations of each prompt by cumulative log-probability, scored with a length penalty.

Each step takes the ``2 * beam_width`` best next tokens of every live beam. Every beam's candidates
are pooled per prompt: one that ends on a stop token (unless ``ignore_eos``) is complete, the
``beam_width`` best of the others by cumulative logprob live on (ties to the earlier beam, then the
lower id). After ``max_tokens`` steps the live beams are complete too, and the ``beam_width`` best of
all complete ones by score are returned, best first. On the native runner the beams live on KV
sequences that fork as beams branch (``NativeBeams``: one batched decode per step); elsewhere they
run as one-token engine requests over the prefix cache (``EngineBeams``).

The score is vLLM's: ``cum_logprob / length ** length_penalty``, the length counting the prompt and
the generated tokens but not a final stop token. ``BeamSearchSequence.tokens`` holds the prompt and
the generated ids, as vLLM's does; ``text`` decodes the generated ones (without the stop token)."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oxibonsai.outputs import RequestOutput
from oxibonsai.runner import blocks_for
from oxibonsai.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam's step asks for 2 * beam_width logprobs


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """``beam_width`` beams kept per prompt, up to ``max_tokens`` generated tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be <= {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's and the generated token ids, each generated token's raw logprob, their
    sum, and (once complete) the generated text and why it ended (``"stop"`` or ``"length"``)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


StepFn = Callable[[list[dict[str, Any]], SamplingParams], list[RequestOutput]]  # prompt dicts
Candidates = list[tuple[int, float]]  # (token, raw logprob) pairs of one beam's next token


def one_token_params(width: int) -> SamplingParams:
    """A beam's step as an engine request: one token, with the ``2 * width`` top raw logprobs."""
    return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * width, ignore_eos=True)


def candidates_of(out: RequestOutput) -> Candidates:
    """The (token, raw logprob) candidates of a one-token request's output."""
    return [(token, entry.logprob) for token, entry in (out.outputs[0].logprobs or [{}])[0].items()]


def beam_prompt(tokens: list[int], salt: str | None) -> dict[str, Any]:
    """A beam's tokens as an engine prompt, under its prompt's cache salt."""
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def check_fits(prompts: Sequence[list[int]], params: BeamSearchParams, max_model_len: int) -> None:
    """ValueError for a prompt whose beams could outgrow the context."""
    for ids in prompts:
        if len(ids) + params.max_tokens > max_model_len:
            raise ValueError(
                f"a prompt of {len(ids)} tokens and max_tokens={params.max_tokens} exceed the context "
                f"(max_model_len={max_model_len})"
            )


class EngineBeams:
    """Beams run as one-token requests of the engine (``step``: ``LLM.generate``): each step is a batch
    of every live beam's tokens (under its prompt's cache salt, ``salts``), with the ``2 * beam_width``
    top raw logprobs; the prefix cache holds their full blocks, so each recomputes at most a block and
    a token. Any runner."""

    def __init__(self, step: StepFn, width: int, salts: Sequence[str | None] = ()) -> None:
        self._step = step
        self._one_token = one_token_params(width)
        self._salts = list(salts)

    def candidates(self, beams: list[BeamSearchSequence], owners: list[int]) -> list[Candidates]:
        prompts = [
            beam_prompt(beam.tokens, self._salts[k] if self._salts else None)
            for beam, k in zip(beams, owners, strict=True)
        ]
        return [candidates_of(out) for out in self._step(prompts, self._one_token)]


class NativeBeams:
    """Beams on sequences of the native model's KV cache: a beam that branches forks its parent's
    sequence (``Model.fork_sequence``: cached blocks shared, the partial one copied), so each step is
    one batched decode of every live beam; logprobs are the float64 log-softmax of its logits row.
    ``prefill`` starts them; ``close`` frees every sequence they hold."""

    def __init__(self, model: Any, width: int) -> None:
        self._model = model
        self._top = 2 * width
        self._seqs: list[int] = []
        self._rows: list[np.ndarray] = []

    def prefill(
        self, prompts: Sequence[list[int]], salts: Sequence[str | None], chunk_tokens: int | None = None
    ) -> Generator[int, None, None]:
        """A sequence per prompt on its cached prefix (under its cache salt), the rest computed
        ``chunk_tokens`` at a time (None: at once; the same bits either way); yields before each chunk
        the blocks it takes."""
        for prompt, salt in zip(prompts, salts, strict=True):
            seq, cached = self._model.add_sequence_cached(prompt, salt)
            self._seqs.append(seq)
            rest = prompt[cached:]
            chunk = len(rest) if chunk_tokens is None else max(1, chunk_tokens)
            for start in range(0, len(rest), chunk):
                piece = rest[start : start + chunk]
                done = cached + start
                yield blocks_for(done + len(piece)) - blocks_for(done)
                last = start + chunk >= len(rest)
                rows = self._model.step([(seq, piece, "last" if last else "none")])
            self._rows.append(rows[0])

    def candidates(self, beams: list[BeamSearchSequence]) -> list[Candidates]:
        assert len(beams) == len(self._rows)
        return [top_logprobs(row, self._top) for row in self._rows]

    def advance(self, parents: list[int], tokens: list[int]) -> None:
        """The live beams are now ``parents[i]``'s sequence plus ``tokens[i]``: forks for a parent's
        second and later children (before the parent steps on), frees for parents left childless,
        then one step of every beam's new token. A failure leaves every sequence to ``close``."""
        seqs: list[int] = []
        forks: list[int] = []
        try:
            for parent in parents:
                if parent in parents[: len(seqs)]:
                    forks.append(self._model.fork_sequence(self._seqs[parent]))
                    seqs.append(forks[-1])
                else:
                    seqs.append(self._seqs[parent])
        except BaseException:
            for seq in forks:
                self._model.free_sequence(seq)
            raise
        kept = set(parents)
        for i, seq in enumerate(self._seqs):
            if i not in kept:
                self._model.free_sequence(seq)
        self._seqs = seqs
        items = [(seq, [token], "last") for seq, token in zip(seqs, tokens, strict=True)]
        self._rows = list(self._model.step(items))

    def close(self) -> None:
        for seq in self._seqs:
            self._model.free_sequence(seq)
        self._seqs = []


def native_beam_steps(
    model: Any,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
    *,
    salts: Sequence[str | None] | None = None,
    chunk_tokens: int | None = None,
) -> Generator[int, None, list[BeamSearchOutput]]:
    """Beam search on ``NativeBeams`` as a generator (``AsyncLLM``'s loop runs it a piece at a time):
    it yields the KV blocks its next piece may take (a prompt chunk; then, per step, at most one new
    block per live beam: a fork's copied partial block, or a block its token starts) and returns the
    outputs. Closing it frees its sequences."""
    search = BeamSearch(prompts, params, stop_ids, decode)
    beams = NativeBeams(model, params.beam_width)
    try:
        yield from beams.prefill(prompts, salts or [None] * len(prompts), chunk_tokens)
        while True:
            parents, tokens = search.step(beams.candidates(search.beams))
            if search.finished:
                break
            yield len(tokens)
            beams.advance(parents, tokens)
    finally:
        beams.close()
    return search.outputs()


def top_logprobs(row: np.ndarray, k: int) -> Candidates:
    """The ``k`` largest log-softmax values of a logits row (float64), best first, ties to the lower id."""
    x = row.astype(np.float64)
    peak = x.max()
    logp = x - (peak + np.log(np.exp(x - peak).sum()))
    k = min(k, len(logp))
    ids = np.argpartition(-logp, k - 1)[:k]
    return sorted(((int(i), float(logp[i])) for i in ids), key=lambda c: (-c[1], c[0]))


def score(beam: BeamSearchSequence, stop_ids: set[int], length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over the length (prompt included, a final stop token
    not) to the power ``length_penalty``."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in stop_ids else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """The search's state over steps: ``beams`` are the live beams (every prompt's, in order), ``step``
    takes each one's candidate next tokens and says which beams live on, ``outputs`` ranks the end."""

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        stop_ids: set[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self._prompts = [list(p) for p in prompts]
        self._params = params
        self._stop_ids = stop_ids
        self._decode = decode
        self._live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    @property
    def beams(self) -> list[BeamSearchSequence]:
        return [beam for beams in self._live for beam in beams]

    @property
    def owners(self) -> list[int]:
        """The prompt index of each beam of ``beams``."""
        return [k for k, beams in enumerate(self._live) for _ in beams]

    @property
    def width(self) -> int:
        return self._params.beam_width

    @property
    def finished(self) -> bool:
        return self._steps >= self._params.max_tokens or not any(self._live)

    def step(self, candidates: list[Candidates]) -> tuple[list[int], list[int]]:
        """Grows the beams by ``candidates`` (one list per beam of ``beams``); the live beams' parents
        (indices into the old ``beams``) and new tokens."""
        assert len(candidates) == len(self.beams) and not self.finished
        per_beam = iter(candidates)
        parents: list[int] = []
        tokens: list[int] = []
        offset = 0
        for k, beams in enumerate(self._live):
            pool = [
                (beam.cum_logprob + logprob, i, token, logprob)
                for i, beam in enumerate(beams)
                for token, logprob in next(per_beam)
            ]
            pool.sort(key=lambda c: (-c[0], c[1], c[2]))
            self._live[k] = []
            for cum, i, token, logprob in pool:
                grown = _grown(beams[i], token, logprob, cum)
                if token in self._stop_ids and not self._params.ignore_eos:
                    self._done[k].append(self._finished(grown, "stop", k))
                elif len(self._live[k]) < self._params.beam_width:
                    self._live[k].append(grown)
                    parents.append(offset + i)
                    tokens.append(token)
            offset += len(beams)
            # Completed beams past the best beam_width can never be returned: keep the pool small.
            self._done[k] = _best(self._done[k], self._params, self._stop_ids)
        self._steps += 1
        return parents, tokens

    def outputs(self) -> list[BeamSearchOutput]:
        """Every prompt's ``beam_width`` best complete beams (the live ones complete by length)."""
        outputs = []
        for k, beams in enumerate(self._live):
            complete = self._done[k] + [self._finished(b, "length", k) for b in beams]
            outputs.append(BeamSearchOutput(_best(complete, self._params, self._stop_ids)))
        return outputs

    def _finished(self, beam: BeamSearchSequence, reason: str, k: int) -> BeamSearchSequence:
        generated = beam.tokens[len(self._prompts[k]) :]
        if reason == "stop" and generated and generated[-1] in self._stop_ids:
            generated = generated[:-1]
        beam.text, beam.finish_reason = self._decode(generated), reason
        return beam


def beam_search(
    beams_of: Callable[[], EngineBeams],
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[BeamSearchOutput]:
    """Beam search over the one-token requests of the ``EngineBeams`` ``beams_of`` starts."""
    search = BeamSearch(prompts, params, stop_ids, decode)
    beams = beams_of()  # nothing to free: each step starts from the beams' tokens
    while not search.finished:
        search.step(beams.candidates(search.beams, search.owners))
    return search.outputs()


def _grown(beam: BeamSearchSequence, token: int, logprob: float, cum: float) -> BeamSearchSequence:
    tokens, logprobs = [*beam.tokens, token], [*beam.logprobs, logprob]
    return BeamSearchSequence(tokens=tokens, logprobs=logprobs, cum_logprob=cum)


def _best(
    beams: list[BeamSearchSequence], params: BeamSearchParams, stop_ids: set[int]
) -> list[BeamSearchSequence]:
    ranked = sorted(beams, key=lambda b: -score(b, stop_ids, params.length_penalty))  # stable: first kept
    return ranked[: params.beam_width]

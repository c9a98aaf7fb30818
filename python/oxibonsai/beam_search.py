"""Beam search (vLLM's ``LLM.beam_search`` and ``BeamSearchParams``): the ``beam_width`` most likely
continuations of each prompt by cumulative log-probability, scored with a length penalty.

Each step asks the engine for one token of every live beam of every prompt, with the ``2 *
beam_width`` top raw logprobs (the beams run as one batch; each is a prompt that the prefix cache
finds computed up to its last full block, so a step recomputes at most a block and a token per beam).
Every beam's candidates are pooled per prompt: one that ends on a stop token (unless ``ignore_eos``)
is complete, the ``beam_width`` best of the others by cumulative logprob live on (ties to the earlier
beam, then the lower id). After ``max_tokens`` steps the live beams are complete too, and the
``beam_width`` best of all complete ones by score are returned, best first.

The score is vLLM's: ``cum_logprob / length ** length_penalty``, the length counting the prompt and
the generated tokens but not a final stop token. ``BeamSearchSequence.tokens`` holds the prompt and
the generated ids, as vLLM's does; ``text`` decodes the generated ones (without the stop token)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from oxibonsai.outputs import RequestOutput
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


StepFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


def score(beam: BeamSearchSequence, stop_ids: set[int], length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over the length (prompt included, a final stop token
    not) to the power ``length_penalty``."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in stop_ids else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


def beam_search(
    step: StepFn,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[BeamSearchOutput]:
    """Beam search over ``step`` (one token of each given prompt, with top logprobs: ``LLM.generate``)."""
    one_token = SamplingParams(max_tokens=1, temperature=0, logprobs=2 * params.beam_width, ignore_eos=True)
    live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        batch = [beam for beams in live for beam in beams]
        if not batch:
            break
        outs = iter(step([beam.tokens for beam in batch], one_token))
        for k, beams in enumerate(live):
            candidates = []
            for i, beam in enumerate(beams):
                top = next(outs).outputs[0].logprobs
                assert top, "each step asks for logprobs"
                for token, entry in top[0].items():
                    candidates.append((beam.cum_logprob + entry.logprob, i, token, entry.logprob))
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            live[k] = []
            for cum, i, token, logprob in candidates:
                grown = _grown(beams[i], token, logprob, cum)
                if token in stop_ids and not params.ignore_eos:
                    done[k].append(_finished(grown, "stop", len(prompts[k]), stop_ids, decode))
                elif len(live[k]) < params.beam_width:
                    live[k].append(grown)
            # Completed beams past the best beam_width can never be returned: keep the pool small.
            done[k] = _best(done[k], params, stop_ids)
    outputs = []
    for k, beams in enumerate(live):
        complete = done[k] + [_finished(b, "length", len(prompts[k]), stop_ids, decode) for b in beams]
        outputs.append(BeamSearchOutput(_best(complete, params, stop_ids)))
    return outputs


def _grown(beam: BeamSearchSequence, token: int, logprob: float, cum: float) -> BeamSearchSequence:
    tokens, logprobs = [*beam.tokens, token], [*beam.logprobs, logprob]
    return BeamSearchSequence(tokens=tokens, logprobs=logprobs, cum_logprob=cum)


def _finished(
    beam: BeamSearchSequence,
    reason: str,
    prompt_len: int,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
) -> BeamSearchSequence:
    generated = beam.tokens[prompt_len:]
    if reason == "stop" and generated and generated[-1] in stop_ids:
        generated = generated[:-1]
    beam.text, beam.finish_reason = decode(generated), reason
    return beam


def _best(
    beams: list[BeamSearchSequence], params: BeamSearchParams, stop_ids: set[int]
) -> list[BeamSearchSequence]:
    ranked = sorted(beams, key=lambda b: -score(b, stop_ids, params.length_penalty))  # stable: first kept
    return ranked[: params.beam_width]

"""Speculative decoding with n-gram drafts (vLLM's ``speculative_config={"method": "ngram", ...}``):
while a request decodes, the native scheduler looks for the request's last ``prompt_lookup_min`` to
``prompt_lookup_max`` tokens earlier in its prompt and output, and drafts the
``num_speculative_tokens`` tokens that followed there. One forward pass computes the request's next
token and the drafts together, so each draft's row holds the logits of the token after it; the
engine then samples the rows in order with the request's own sampler and keeps each draft its draw
equals, up to and including the first draw that differs (or one more after the last draft).

Every token is thus drawn from the distribution, with the penalties, masks, bans, grammar and
logits processors, that decoding it alone would use, by the same seeded sampler in the same order:
the output is the tokens decoding one at a time gives (for a draft that is one token, the rejection
sampling of speculative decoding reduces to this), greedy or sampled. The native forward pass
computes a row with the same bits whether it runs alone or beside others, so the tokens are
identical, not just alike. What speculation changes is how many tokens one step yields.

Drafts come only from what a step leaves over (``oxibonsai_core::sched::drafts``): they never
preempt, delay a decode or take a prompt chunk's budget, and blocks that only rejected drafts took are
given back in the same step. A draft costs a row of the forward pass: on a CPU a 1-bit model's
batched rows are cheap next to a step's weight reads, so accepted drafts make decoding faster and
rejected ones cost a little (``benches/bench_speculative.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oxibonsai.json_arg import json_mapping
from oxibonsai.runner import DraftedDraws, Draw, SampleRow, sample_on_host

if TYPE_CHECKING:
    from oxibonsai.engine import _Request

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 64  # the core's MAX_DRAFT_TOKENS
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (prompt lookup; the only one). ``num_speculative_tokens``: most tokens
    drafted per decode (1..64). ``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and
    shortest suffix of the request's tokens looked up (defaults 4 and 2, the minimum capped by the
    maximum); the longest that occurred before wins, its latest occurrence first. ``adaptive``
    (oxibonsai's own key, default True): draft only as many tokens as the request's acceptance so
    far says will pay for their rows in the step (``oxibonsai_core::spec::acceptance``); False drafts
    ``num_speculative_tokens`` whenever a match is found, as vLLM does."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported: only 'ngram' (prompt "
                "lookup) is; draft models, EAGLE and MTP heads are not"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            top = MAX_SPECULATIVE_TOKENS
            raise ValueError(f"num_speculative_tokens must be an int in 1..={top}, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) must be <= prompt_lookup_max ({self.max_n})")

    @property
    def max_n(self) -> int:
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return max(DEFAULT_LOOKUP_MAX, self.prompt_lookup_min or 1)

    @property
    def min_n(self) -> int:
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return min(DEFAULT_LOOKUP_MIN, self.max_n)

    def core(self) -> tuple[int, int, int, bool]:
        """What ``_core.Scheduler(speculation=...)`` takes: ``(num_tokens, min_n, max_n, adaptive)``."""
        return self.num_speculative_tokens, self.min_n, self.max_n, self.adaptive

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, vLLM's dict, or that dict as JSON (``--speculative-config``); None
        stays None. Unknown keys are a ``ValueError`` naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_mapping(value, "speculative_config")
        fields = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; it takes {sorted(fields)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


def verify(
    sampling: Sequence[_Request],
    step: DraftedDraws,
    first: Sequence[Draw],
    take: Callable[[_Request, Draw], bool],
    row_of: Callable[[_Request], SampleRow],
) -> list[list[int]]:
    """Takes each sampling item's tokens in order: its first draw (``first``), then, while the last
    draw equals the next draft and the request goes on, a draw from the next draft's row. Each round
    samples the items still going together, each with the row ``row_of`` gives after the tokens
    taken so far. ``take`` takes a draw (False if it failed: the request is gone). Returns every
    item's drawn tokens (kept drafts, then the last draw); an item whose request had ended before
    gets its first draw, untaken."""
    tokens = [[int(d[0])] for d in first]
    going = [i for i, (r, d) in enumerate(zip(sampling, first, strict=True)) if _took(r, d, take)]
    j = 0
    while going := [i for i in going if _agrees(sampling[i], tokens[i][-1], step.drafts[i], j)]:
        j += 1
        rows = step.logits[step.first_rows[going] + j]
        draws = sample_on_host(rows, [row_of(sampling[i]) for i in going])
        for i, draw in zip(going, draws, strict=True):
            tokens[i].append(int(draw[0]))
        going = [i for i, d in zip(going, draws, strict=True) if take(sampling[i], d)]
    return tokens


def _took(r: _Request, draw: Draw, take: Callable[[_Request, Draw], bool]) -> bool:
    return r.finish_reason is None and take(r, draw)


def _agrees(r: _Request, token: int, drafts: list[int], j: int) -> bool:
    """Whether the request goes on to draft ``j + 1``: it has not ended and its last draw is draft ``j``."""
    return r.finish_reason is None and j < len(drafts) and token == drafts[j]

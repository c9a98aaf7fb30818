"""Runners: what computes the steps the native scheduler plans and samples their tokens. The engine
talks to a runner, never to a model. ``NativeRunner`` is the Rust forward pass on the CPU (the
scheduler runs it in one native call, GIL released) with each request's Rust sampler;
``oxibonsai.torch_backend.runner.TorchRunner`` computes the same plans with torch on a CUDA, MPS or CPU
device, over a device KV pool with a host-memory warm tier, and on a GPU samples there too.

A step's sampling rows come as ``SampleRow``s (parameters, seed, the request's Rust sampler, its
histories and the ids it may not sample now); ``launch`` starts the step and returns its ``StepDraws``,
whose ``draws()`` gives one ``Draw`` per row, in order: ``(token, raw logprob or None, [(id, raw
logprob)] * n)``, what ``_core.Sampler.sample`` returns.

``choose(device, runner)`` turns the user's ``device`` / ``runner`` arguments into a concrete pair, with
clear errors for impossible ones before any work. It imports torch only where a GPU may exist (a
machine with an NVIDIA driver, or an Apple Silicon Mac) or when the torch runner is asked for, so a
CPU-only ``LLM()`` never pays for importing torch."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from oxibonsai import _core
from oxibonsai.logits_processors import FailedDraw, processed

if TYPE_CHECKING:
    from oxibonsai.sampling_params import SamplingParams

RUNNERS = ("auto", "native", "torch")
T = TypeVar("T")

BLOCK_TOKENS = 16  # tokens per KV block: the Rust core's BLOCK_TOKENS
DEFAULT_MAX_MODEL_LEN = 4096  # the context when none is asked for: the model's, capped (as the core's)
TORCH_MISSING = "torch is not installed: pip install 'oxibonsai[torch]'"


Draw = tuple[int, float | None, list[tuple[int, float]]]
PromptScores = list[tuple[int, int, list[tuple[float, int, list[tuple[int, float]]]]]]
"""Prompt logprobs of some steps: ``(request key, start, scores)``, where ``scores[j]`` is the raw
logprob, the rank and the top ``(id, logprob)`` pairs of prompt token ``start + j + 1`` (what
``_core.Scheduler.take_prompt_logprobs`` returns)."""


@dataclass(frozen=True)
class SampleRow:
    """What sampling one request's next token needs: its parameters, its seed (the request's, or the
    engine's for it), its stateful Rust sampler (built from both), its prompt and output so far, the
    ids it may not sample now (stop ids before ``min_tokens``), a key naming the request while it
    runs (what a runner keeps for it across steps is keyed by it; ``Runner.forget`` drops it), and for
    structured output the ids its grammar allows now (an int32 allow-bitmask, bit ``i % 32`` of word
    ``i // 32`` per id; None: all)."""

    params: SamplingParams
    seed: int
    sampler: _core.Sampler
    prompt_ids: list[int]
    output_ids: list[int]
    banned: list[int]
    key: int = -1
    # params.is_plain_greedy, worked out once per request by the engine (None: read from params)
    plain_greedy: bool | None = None
    allowed: np.ndarray | None = None


class Feed(NamedTuple):
    """The token ids of a step planned ahead (``Scheduler.schedule_ahead``): the step before it samples
    them, so they are not known on the host when it is launched. Row ``i`` of the step takes
    ``draws``' token ``rows[i]``, on the runner's device."""

    draws: StepDraws
    rows: list[int]


class StepDraws(Protocol):
    """A launched step's draws, one per sampling row in order; ``draws`` waits for the step if it still
    runs (a runner on an asynchronous device returns from ``launch`` before the step has run)."""

    def draws(self) -> list[Draw]: ...


class HostSampling:
    """A step's draws by each row's Rust sampler, made when read; ``logits`` gives the float32 rows
    (a runner whose logits are on their way from a device waits for them there)."""

    def __init__(self, logits: Callable[[], np.ndarray], rows: Sequence[SampleRow]) -> None:
        self._logits = logits
        self._rows = rows

    def draws(self) -> list[Draw]:
        return sample_on_host(self._logits(), self._rows)


class DraftedDraws:
    """A step with drafts (speculative decoding), as the native runner returns it: ``logits`` holds
    each sampling item's rows in item order (its token's, then one per draft of ``drafts``);
    ``draws`` samples every item's first row, as a step without drafts would, and the engine samples
    the drafts' rows from ``logits`` (``oxibonsai.speculative.verify``)."""

    def __init__(self, logits: np.ndarray, rows: Sequence[SampleRow], drafts: list[list[int]]) -> None:
        self.logits = logits
        self.drafts = drafts
        self._rows = rows
        self.first_rows = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]], dtype=np.int64)

    def draws(self) -> list[Draw]:
        return sample_on_host(self.logits[self.first_rows], self._rows)


def sample_on_host(logits: np.ndarray, rows: Sequence[SampleRow]) -> list[Draw]:
    """Each row of float32 ``logits`` through its request's logits processors, if any, then every
    row's Rust sampler at once, the rows in parallel (``_core.sample_rows``); no logprobs are computed
    for requests that did not ask (the normalizer is most of a greedy draw's cost), and the prompt and
    output ids are read only by samplers with penalties (their conversion is O(prompt length) a
    token). A row whose processor raises gets a ``FailedDraw``."""
    draws: list[Draw | None] = [None] * len(rows)
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if any(r.params.logits_processors for r in rows):
        logits = logits.copy()
        for i, r in enumerate(rows):
            if r.params.logits_processors:
                try:
                    logits[i] = processed(r.params.logits_processors, r.prompt_ids, r.output_ids, logits[i])
                except Exception as error:  # the request's own error, not the step's
                    draws[i] = FailedDraw(error)
    live = [i for i, d in enumerate(draws) if d is None]
    if not live:
        return draws  # type: ignore[return-value]
    rs = [rows[i] for i in live]
    drawn = _core.sample_rows(
        [r.sampler for r in rs],
        logits if len(live) == len(rows) else np.ascontiguousarray(logits[live]),
        [r.prompt_ids for r in rs],
        [r.output_ids for r in rs],
        [r.banned for r in rs],
        [r.params.logprobs for r in rs],
        [r.allowed for r in rs],
    )
    for i, draw in zip(live, drawn, strict=True):
        draws[i] = draw
    return draws  # type: ignore[return-value]


HiddenSteps = Generator[int, None, np.ndarray]
"""``hidden_states`` computed a chunk at a time: before each chunk the generator yields the KV blocks
the chunk will take from the runner's pool (0 for a runner that computes it elsewhere) and runs the
chunk when resumed; it returns the hidden states. Closing it early frees what it holds."""


def run_steps(steps: Generator[int, None, T]) -> T:
    """Runs every piece of ``steps`` (a generator yielding the KV blocks its next piece takes, such
    as ``hidden_state_steps``) at once and returns its result."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


class Runner(Protocol):
    """What the engine needs from a runner. ``async_output``: whether ``launch`` returns before the
    step has run (a GPU's queue), so the engine launches the next step before it does the last one's
    output work (see ``Engine.step``). ``async_scheduling``: whether ``launch`` takes a ``Feed``, so
    the engine launches a step of decodes before the step before it has sampled their tokens."""

    kind: str
    device: str
    async_output: bool
    async_scheduling: bool
    samples_on_host: bool  # draws made by ``sample_on_host`` (where logits processors can run)
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_tokens: int

    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def prefix_caching(self) -> bool: ...
    def make_scheduler(self, **options: Any) -> _core.Scheduler: ...
    def launch(
        self,
        sched: _core.Scheduler,
        out: _core.SchedulerOutput,
        rows: Sequence[SampleRow],
        feed: Feed | None = None,
    ) -> StepDraws: ...
    def cache_stats(self) -> dict[str, Any]: ...
    def reset_prefix_cache(self) -> int: ...
    def save_prefix_cache(self, path: str) -> int: ...
    def load_prefix_cache(self, path: str) -> int: ...
    def logits(self, token_ids: list[int]) -> np.ndarray: ...
    def hidden_states(self, token_ids: list[int], rows: str = "all") -> np.ndarray: ...
    def hidden_state_steps(
        self, token_ids: list[int], rows: str = "all", chunk_tokens: int | None = None
    ) -> HiddenSteps: ...
    def forget(self, key: int) -> None: ...
    def take_prompt_logprobs(self) -> PromptScores: ...


class NativeRunner:
    """The Rust forward pass over a native ``Model`` and its KV cache (CPU only)."""

    kind = "native"
    device = "cpu"
    async_output = False  # the step runs inside launch
    async_scheduling = False
    samples_on_host = True

    def __init__(self, model: _core.Model) -> None:
        self._model = model
        # Read once: the native getters take the model's lock, which a running step holds.
        self.max_model_len = int(model.max_model_len)
        self.vocab_size = int(model.vocab_size)
        self.num_blocks = int(model.num_blocks)
        self.block_tokens = int(model.block_tokens)
        self._sched: _core.Scheduler | None = None

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._model.config)

    @property
    def prefix_caching(self) -> bool:
        return bool(self._model.prefix_caching)

    def make_scheduler(self, **options: Any) -> _core.Scheduler:
        self._sched = _core.Scheduler(self._model, **options)
        return self._sched

    def launch(
        self,
        sched: _core.Scheduler,
        out: _core.SchedulerOutput,
        rows: Sequence[SampleRow],
        feed: Feed | None = None,
    ) -> StepDraws:
        """Runs the step (one native call, GIL released); its rows are sampled when read."""
        if feed is not None:
            raise ValueError("the native runner runs each step inside launch: it plans none ahead")
        logits = sched.execute(out)
        assert logits is not None, "a model's scheduler returns logits"
        if out.num_draft_tokens:
            return DraftedDraws(logits, rows, sched.drafts(out))
        return HostSampling(lambda: logits, rows)

    def cache_stats(self) -> dict[str, Any]:
        return dict(self._model.cache_stats())

    def reset_prefix_cache(self) -> int:
        return self._model.reset_prefix_cache()

    def save_prefix_cache(self, path: str) -> int:
        return self._model.save_prefix_cache(path)

    def load_prefix_cache(self, path: str) -> int:
        return self._model.load_prefix_cache(path)

    def forget(self, key: int) -> None:
        """Nothing to drop: each request's Rust sampler holds its own state."""

    def take_prompt_logprobs(self) -> PromptScores:
        """The prompt logprobs the steps run since the last call scored (in the native step)."""
        return self._sched.take_prompt_logprobs() if self._sched is not None else []

    def logits(self, token_ids: list[int]) -> np.ndarray:
        seq = self._model.add_sequence()
        try:
            return self._model.step([(seq, token_ids, "all")])
        finally:
            self._model.free_sequence(seq)

    def hidden_states(self, token_ids: list[int], rows: str = "all") -> np.ndarray:
        """The final-normed hidden states after every position (``rows="all"``) or the last."""
        return run_steps(self.hidden_state_steps(token_ids, rows))

    def hidden_state_steps(
        self, token_ids: list[int], rows: str = "all", chunk_tokens: int | None = None
    ) -> HiddenSteps:
        """``hidden_states`` in chunks of ``chunk_tokens`` (None: one) on a sequence of its own, which
        holds its blocks from the first chunk until the last; the rows are the same bits whatever the
        chunks (each row's arithmetic does not depend on the rows beside it)."""
        chunk = len(token_ids) if chunk_tokens is None else max(1, chunk_tokens)
        starts = range(0, len(token_ids), chunk)
        seq: int | None = None
        pieces: list[np.ndarray] = []
        try:
            for start in starts:
                piece = token_ids[start : start + chunk]
                yield blocks_for(start + len(piece)) - blocks_for(start)
                if seq is None:
                    seq = self._model.add_sequence()
                last = start + chunk >= len(token_ids)
                want = "all" if rows != "last" else "last" if last else "none"
                pieces.append(self._model.hidden_states([(seq, piece, want)]))
        finally:
            if seq is not None:
                self._model.free_sequence(seq)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def blocks_for(tokens: int) -> int:
    """KV blocks that ``tokens`` positions occupy."""
    return -(-tokens // BLOCK_TOKENS)


@dataclass(frozen=True)
class Placement:
    """Where a model runs: a torch device string ("cpu", "cuda:0", "mps") and the runner kind."""

    device: str
    runner: str


def choose(device: str = "auto", runner: str = "auto") -> Placement:
    """Resolves ``device`` ("auto", "cpu", "cuda", "cuda:N", "mps") and ``runner`` ("auto",
    "native", "torch"). ``device="auto"`` picks CUDA, then MPS, then the CPU; ``runner="auto"`` is
    native on the CPU and torch elsewhere. Raises ``ValueError`` for an impossible choice and
    ``ImportError`` when it needs torch and torch is missing."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {runner!r}")
    if not isinstance(device, str):
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    device = _auto_device(runner) if device == "auto" else _checked_device(device)
    if runner == "auto":
        runner = "native" if device == "cpu" else "torch"
    if runner == "native" and device != "cpu":
        raise ValueError(f"the native runner runs on the CPU only; use runner='torch' for device={device!r}")
    if runner == "torch" and not torch_installed():
        raise ImportError(TORCH_MISSING)
    return Placement(device, runner)


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _may_have_gpu() -> bool:
    """Cheap signs of a GPU torch could use, read without importing torch."""
    if sys.platform == "darwin":
        return platform.machine() == "arm64"
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _auto_device(runner: str) -> str:
    if not torch_installed() or (runner != "torch" and not _may_have_gpu()):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    if _mps_available(torch):
        return "mps"
    return "cpu"


def _mps_available(torch: Any) -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _checked_device(device: str) -> str:
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind not in ("cuda", "mps") or (index and not index.isdigit()) or (kind == "mps" and index):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    if not torch_installed():
        raise ImportError(f"device={device!r} needs torch. {TORCH_MISSING}")
    import torch

    if kind == "mps":
        if not _mps_available(torch):
            raise ValueError("device='mps' needs MPS (an Apple Silicon Mac); choose device='cpu' or 'cuda'")
        return "mps"
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: CUDA is not available here (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}); choose device='cpu'"
        )
    n = torch.cuda.device_count()
    i = int(index) if index else torch.cuda.current_device()
    if i >= n:
        raise ValueError(f"device={device!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return f"cuda:{i}"

"""Type stubs for the native module ``oxibonsai._core`` (built from ``rust/py``)."""

import os
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

from oxibonsai.rope_scaling import RopeScaling

__version__: str

__all__ = [
    "GGUFError",
    "GGUFFile",
    "Model",
    "OxiBonsaiError",
    "PrefixCache",
    "Q1Matrix",
    "QueueFull",
    "Sampler",
    "Scheduler",
    "SchedulerOutput",
    "StepPlan",
    "__version__",
    "block_hashes",
    "get_num_threads",
    "gguf_rope_scaling",
    "kernel_info",
    "quantize_activations",
    "rope_frequencies",
    "sample_rows",
    "set_num_threads",
]

_Kernel = Literal[
    "auto", "lut", "gemm", "lut-gemm", "vnni-gemm", "perm-gemm", "amx-gemm", "signflip", "reference"
]
_Isa = Literal["scalar", "avx2", "avx512", "neon"]
_Tokens = Sequence[int] | npt.NDArray[np.uint32]

class OxiBonsaiError(Exception):
    """Base class of every oxibonsai-specific error."""

class GGUFError(OxiBonsaiError):
    """A GGUF file is malformed, truncated, or not a model oxibonsai can run."""

class QueueFull(OxiBonsaiError):
    """The engine's waiting queue is full (max_waiting requests wait): retry later (HTTP 429)."""

class _TensorInfo(TypedDict):
    name: str
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    type: str
    offset: int
    nbytes: int

@final
class GGUFFile:
    """A GGUF file, memory-mapped read-only and validated on open."""

    def __new__(cls, path: str | os.PathLike[str]) -> GGUFFile: ...
    @property
    def version(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    def tensor_names(self) -> list[str]: ...
    def tensor_info(self, name: str) -> _TensorInfo: ...
    def tensors(self) -> list[_TensorInfo]: ...
    def tensor_bytes(self, name: str) -> npt.NDArray[np.uint8]: ...

@final
class Model:
    """A Qwen3 model loaded from GGUF, its paged KV cache, and the sequences being generated."""

    def __new__(
        cls,
        path: str | os.PathLike[str],
        *,
        max_model_len: int | None = None,
        kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 1,
        kernel: str = "auto",
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        rope_scaling: RopeScaling | None = None,
        rope_theta: float | None = None,
    ) -> Model: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    @property
    def prefix_caching(self) -> bool: ...
    def add_sequence(self) -> int: ...
    def cached_prefix(self, prompt: _Tokens, salt: str | None = None) -> tuple[int, int]:
        """``(cached tokens, idle blocks)`` ``add_sequence_cached`` would start this prompt on."""
    def add_sequence_cached(self, prompt: _Tokens, salt: str | None = None) -> tuple[int, int]:
        """Starts a sequence on the prompt's cached prefix: ``(sequence id, cached tokens)``."""
    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Writes every cached block to ``path`` (atomically); how many."""
    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Caches the blocks of a file ``save_prefix_cache`` wrote for this model; how many."""
    def cache_stats(self) -> _CacheStats: ...
    def reset_prefix_cache(self) -> int: ...
    def fork_sequence(self, seq: int) -> int: ...
    def free_sequence(self, seq: int) -> None: ...
    def sequence_len(self, seq: int) -> int: ...
    def step(
        self, items: list[tuple[int, list[int], Literal["none", "last", "all"]]]
    ) -> npt.NDArray[np.float32]: ...
    def hidden_states(
        self, items: list[tuple[int, list[int], Literal["none", "last", "all"]]]
    ) -> npt.NDArray[np.float32]:
        """``step``, returning the final RMS-normed hidden states of the wanted rows (``rows x
        hidden``) instead of their logits."""

class _CacheStats(TypedDict, total=False):
    queries: int
    hits: int
    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    inserted_blocks: int
    evictions: int
    cached_blocks: int
    idle_blocks: int
    free_blocks: int
    capacity_blocks: int
    bytes_in_use: int
    capacity_bytes: int
    host_capacity_blocks: int
    host_cached_blocks: int
    host_free_blocks: int
    host_hit_tokens: int
    demotions: int
    promotions: int
    prefetched_blocks: int
    host_evictions: int
    computed_tokens: int

@final
class PrefixCache:
    """A pool of KV blocks and the trie of cached full blocks, without KV storage."""

    def __new__(cls, num_blocks: int, block_bytes: int = 0) -> PrefixCache: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_idle(self) -> int: ...
    @property
    def num_available(self) -> int: ...
    def match(self, tokens: _Tokens, salt: str | None = None, max_blocks: int | None = None) -> int: ...
    def acquire(
        self, tokens: _Tokens, salt: str | None = None, max_blocks: int | None = None
    ) -> list[int]: ...
    def allocate(self) -> int | None: ...
    def insert(self, tokens: _Tokens, blocks: _Tokens, salt: str | None = None) -> list[int]: ...
    def release(self, blocks: _Tokens) -> None: ...
    def evict(self, n: int = 1) -> list[int]: ...
    def reset(self) -> int: ...
    def users(self, block: int) -> int: ...
    def is_cached(self, block: int) -> bool: ...
    def stats(self) -> _CacheStats: ...
    def check(self) -> None: ...

class _SchedulerStats(TypedDict):
    steps: int
    admitted: int
    preemptions: int
    finished: int
    aborted: int
    scheduled_tokens: int
    prefill_tokens: int
    decode_tokens: int
    draft_tokens: int

@final
class SchedulerOutput:
    """One step's plan: ``items`` are ``(request_id, num_tokens, sample)``."""

    @property
    def items(self) -> list[tuple[int, int, bool]]: ...
    @property
    def preempted(self) -> list[int]: ...
    @property
    def num_batched_tokens(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_sample(self) -> int: ...
    @property
    def num_draft_tokens(self) -> int: ...
    @property
    def step(self) -> int: ...
    def __len__(self) -> int: ...

@final
class StepPlan:
    """What one step computes and where its KV goes (see ``Scheduler.prepare``)."""

    @property
    def input_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def positions(self) -> npt.NDArray[np.int32]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...
    @property
    def logits_indices(self) -> npt.NDArray[np.int32]: ...
    @property
    def decode_from(self) -> npt.NDArray[np.int32]:
        """Per sequence, its request's prompt length: rows at or past it are sampled tokens."""
    @property
    def demote(self) -> npt.NDArray[np.int32]: ...
    @property
    def promote(self) -> npt.NDArray[np.int32]:
        """``[host block, device block]`` copies this step's forward pass needs first."""
    @property
    def prefetch(self) -> npt.NDArray[np.int32]:
        """``[host block, device block]`` copies for waiting requests: only the next step needs them."""
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...

@final
class Scheduler:
    """The continuous-batching scheduler (priorities with aging, chunked prefill, preemption)."""

    def __new__(
        cls,
        kv: Model | int,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_waiting: int | None = None,
        priority_aging_steps: int = 256,
        enable_chunked_prefill: bool = True,
        policy: Literal["priority", "longest_prefix"] = "priority",
        enable_prefix_caching: bool = False,
        host_blocks: int = 0,
        block_bytes: int = 0,
        host_prefetch: bool = True,
        speculation: tuple[int, int, int, bool] | None = None,
    ) -> Scheduler: ...
    def add(
        self,
        request_id: int,
        prompt: _Tokens,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
        draft_limit: int | None = None,
    ) -> None: ...
    def drafts(self, out: SchedulerOutput) -> list[list[int]]: ...
    def schedule(self) -> SchedulerOutput: ...
    def execute(self, out: SchedulerOutput) -> npt.NDArray[np.float32] | None: ...
    def take_prompt_logprobs(
        self,
    ) -> list[tuple[int, int, list[tuple[float, int, list[tuple[int, float]]]]]]: ...
    def logit_rows(
        self, out: SchedulerOutput
    ) -> tuple[list[int], list[tuple[int, int, int, list[int], int]]]: ...
    def prepare(self, out: SchedulerOutput) -> StepPlan: ...
    def schedule_ahead(self, out: SchedulerOutput, skip: Sequence[int] = ...) -> SchedulerOutput | None: ...
    def cache_stats(self) -> _CacheStats: ...
    def reset_prefix_cache(self) -> int: ...
    def update(
        self,
        out: SchedulerOutput,
        sampled: Sequence[int] | npt.NDArray[np.uint32],
        accepted: Sequence[int] | None = None,
    ) -> None: ...
    def finish(self, request_id: int) -> bool: ...
    def abort(self, request_id: int) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    def running_ids(self) -> list[int]: ...
    def waiting_ids(self) -> list[int]: ...
    def request_state(self, request_id: int) -> tuple[list[int], int] | None: ...
    def stats(self) -> _SchedulerStats: ...
    def check(self) -> None: ...

@final
class Q1Matrix:
    """A Q1_0 weight matrix: 128 weights per block, one fp16 scale, one sign bit per weight."""

    @staticmethod
    def quantize(w: npt.NDArray[np.float32]) -> Q1Matrix: ...
    @staticmethod
    def from_bytes(buf: Any, rows: int, cols: int) -> Q1Matrix: ...
    def to_bytes(self) -> bytes: ...
    def dequantize(self) -> npt.NDArray[np.float32]: ...
    def matmul(
        self, x: npt.NDArray[np.float32], kernel: _Kernel = "auto", isa: _Isa | None = None
    ) -> npt.NDArray[np.float32]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int]: ...

@final
class Sampler:
    """A token sampler with its own random stream: the same seed, logits and history give the same token."""

    def __new__(
        cls,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int = 0,
        logit_bias: Sequence[tuple[int, float]] | None = None,
    ) -> Sampler:
        """``logit_bias``: ``(token id, amount in [-100, 100])`` pairs added to the raw logits before the
        penalties, each id once."""
    def sample(
        self,
        logits: npt.NDArray[np.float32],
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        banned: Sequence[int] | None = None,
        logprobs: int | None = 0,
        allowed: npt.NDArray[np.int32] | npt.NDArray[np.uint32] | None = None,
    ) -> tuple[int, float | None, list[tuple[int, float]]]:
        """Samples one token: ``(token, raw logprob, [(id, raw logprob)] * logprobs, descending)``;
        ``logprobs=None`` computes no logprob (``(token, None, [])``). ``allowed``: a structured-output
        allow-bitmask (bit ``i % 32`` of word ``i // 32`` set where id ``i`` may be sampled), or None."""
    def probabilities(
        self,
        logits: npt.NDArray[np.float32],
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        banned: Sequence[int] | None = None,
        allowed: npt.NDArray[np.int32] | npt.NDArray[np.uint32] | None = None,
    ) -> npt.NDArray[np.float32]:
        """The float32 distribution ``sample`` draws from (zero outside the candidates; one-hot if greedy)."""

def sample_rows(
    samplers: Sequence[Sampler],
    logits: npt.NDArray[np.float32],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    banned: Sequence[Sequence[int] | None],
    logprobs: Sequence[int | None],
    allowed: Sequence[npt.NDArray[np.int32] | npt.NDArray[np.uint32] | None],
) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
    """Row ``i`` of the 2-D ``logits`` drawn by ``samplers[i]`` with the ``i``-th of every other
    argument, as ``Sampler.sample`` takes them (the prompt and output ids read only for a sampler
    with penalties), the rows in parallel on the kernels' threads; the first row's error is raised
    once every row has drawn."""

def quantize_activations(
    x: npt.NDArray[np.float32], isa: _Isa | None = None
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.float32]]: ...
def block_hashes(tokens: _Tokens, *, salt: str | None = None, seed: int = 0) -> list[int]: ...
def rope_frequencies(
    head_dim: int, base: float, scaling: RopeScaling | None = None, context_length: int = 0
) -> tuple[npt.NDArray[np.float64], float]:
    """``head_dim / 2`` float64 inverse wavelengths and the cos/sin multiplier."""

def gguf_rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    """The file's ``qwen3.rope.scaling.*`` keys as Hugging Face's ``rope_scaling`` dict."""

def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def kernel_info() -> dict[str, Any]: ...

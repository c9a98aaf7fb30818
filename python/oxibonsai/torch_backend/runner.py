"""``TorchRunner``: computes the native scheduler's step plans with the torch Qwen3 model on one device.

It owns the device KV pool and the host-memory warm tier (their bytes; the Rust core owns every block's
id, tier, reference count and LRU place) and, per step: asks the scheduler for the plan
(``Scheduler.prepare``), runs the plan's tier copies (demotions to the host, then promotions back; on
CUDA on a side stream, ``kv_pool.TierCopier``, which the forward pass waits for, the demotions'
transfers to the host and the prefetches of waiting requests' host-tier prefixes overlapping it), runs
the forward pass (a plain decode step as a CUDA graph replay on CUDA, ``graphs.DecodeGraphs``, unless
``enforce_eager``), and samples: on the device (``sampling.start_sampling``: only token ids and
requested logprobs come to the host) where ``sample_on_device`` is set, the default off the CPU, else
with each request's Rust sampler on the logits brought to the host. ``launch`` only queues all this: the
results cross to the host through ``pending.HostCopy``, so on CUDA it returns while the device works, and
the engine does the previous step's output work meanwhile (``async_output``, on by default on CUDA),
and a step of decodes can be launched before the step before it has sampled their tokens, which it then
takes on the device (``async_scheduling``, on by default on CUDA with device sampling: ``Engine.step``).
``OXIBONSAI_DEVICE_SAMPLING=0`` or ``1`` overrides the sampling default; ``OXIBONSAI_ASYNC_OUTPUT=0`` or
``1`` the overlap's; ``OXIBONSAI_ASYNC_SCHEDULING=0`` or ``1`` the steps planned ahead;
``OXIBONSAI_HOST_PREFETCH=0`` turns off the prefetching of waiting requests' host-tier prefixes (on by
default). The switches are for comparisons. Sizes are checked at load, so a
model or pool that does not fit fails with the sizes named, never in the middle of a step."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from oxibonsai import _core
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.runner import (
    BLOCK_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    Feed,
    HiddenSteps,
    HostSampling,
    PromptScores,
    SampleRow,
    StepDraws,
    blocks_for,
)
from oxibonsai.torch_backend.batch import StepBatch
from oxibonsai.torch_backend.graphs import DecodeGraphs
from oxibonsai.torch_backend.histories import DeviceHistories
from oxibonsai.torch_backend.kv_pool import KvPool, TierCopier
from oxibonsai.torch_backend.model import TorchQwen3
from oxibonsai.torch_backend.pending import HostCopy, fed_ids
from oxibonsai.torch_backend.prompt_scores import score_prompt_rows
from oxibonsai.torch_backend.sampling import start_sampling

HOST_TIER_FRACTION = 0.25  # of the available host memory, at most, for a default host tier
ACTIVATION_HEADROOM = 1 << 30  # device memory kept free for activations and kernels on CUDA


def kv_dtype(name: str) -> torch.dtype:
    if name in ("auto", "f16", "float16"):
        return torch.float16
    if name in ("f32", "float32"):
        return torch.float32
    if name == "int8":
        raise ValueError(
            "kv_cache_dtype 'int8' is the native runner's; the torch runner takes 'f16' or 'f32'"
        )
    raise ValueError(f"kv_cache_dtype must be 'auto', 'f16' or 'f32', got {name!r}")


@dataclasses.dataclass(frozen=True)
class KvSizes:
    """The device and host pools in blocks, and one block's bytes."""

    device_blocks: int
    host_blocks: int
    block_bytes: int


class TorchRunner:
    """The torch runner on ``device`` (see ``oxibonsai.LLM`` for the arguments)."""

    kind = "torch"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str,
        max_model_len: int | None,
        kv_cache_blocks: int | None,
        kv_cache_bytes: int | None,
        max_num_seqs: int,
        kv_cache_dtype: str,
        enable_prefix_caching: bool,
        host_kv_cache_blocks: int | None,
        host_kv_cache_bytes: int | None,
        gpu_memory_utilization: float,
        enforce_eager: bool = False,
        rope_scaling: RopeScaling | None = None,
        rope_theta: float | None = None,
    ) -> None:
        self.device = device
        self._device = torch.device(device)
        dtype = kv_dtype(kv_cache_dtype)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        budget = _DeviceBudget.probe(self._device, gpu_memory_utilization)
        budget.check_weights(os.path.getsize(path))
        self.model = TorchQwen3.from_gguf(
            path, self._device, rope_scaling=rope_scaling, rope_theta=rope_theta
        )
        budget.weights_loaded(self.model.weights.nbytes)
        c = self.model.config
        self.max_model_len = _max_model_len(max_model_len, c.max_positions, c.rope_scaling is not None)
        self.vocab_size = c.vocab
        self.block_tokens = BLOCK_TOKENS
        self.prefix_caching = enable_prefix_caching
        block_bytes = KvPool.bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, dtype)
        device_blocks = budget.device_blocks(
            kv_cache_blocks, kv_cache_bytes, block_bytes, self.max_model_len, max_num_seqs
        )
        host_blocks = _host_blocks(
            host_kv_cache_blocks, host_kv_cache_bytes, block_bytes, device_blocks, budget
        )
        self.sizes = KvSizes(device_blocks, host_blocks, block_bytes)
        self.num_blocks = device_blocks
        self.kv = self.model.new_kv_pool(device_blocks, dtype)
        cuda = self._device.type == "cuda"
        self.host = (
            KvPool(
                c.n_layers, host_blocks, c.n_kv_heads, c.head_dim, dtype, "cpu", pin=cuda, block_major=True
            )
            if host_blocks
            else None
        )
        self.tiers = TierCopier(self.kv, self.host) if self.host is not None else None
        self._kv_dtype_name = "f32" if dtype == torch.float32 else "f16"
        self.sample_on_device = _device_sampling(self._device)
        self.samples_on_host = not self.sample_on_device
        self.host_prefetch = _env_flag("OXIBONSAI_HOST_PREFETCH", default=True)
        self.async_output = _env_flag("OXIBONSAI_ASYNC_OUTPUT", default=cuda)
        # a step planned ahead takes its ids from the step before on the device: device sampling only
        self.async_scheduling = (
            _env_flag("OXIBONSAI_ASYNC_SCHEDULING", default=cuda) and self.sample_on_device
        )
        self.histories: DeviceHistories | None = DeviceHistories(c.vocab, self._device)  # None: rebuilt
        self.graphs = (
            DecodeGraphs(
                self.model, self.kv, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, capture=True
            )
            if cuda and not enforce_eager
            else None
        )
        self._sched: _core.Scheduler | None = None
        self._computed_tokens = 0
        self._prompt_scores: PromptScores = []

    @property
    def config(self) -> dict[str, Any]:
        c = self.model.config
        config = dataclasses.asdict(c)
        config["rope_scaling"] = None if c.rope_scaling is None else c.rope_scaling.as_dict()
        config["max_positions"] = c.max_positions
        config["tied_output"] = self.model.weights.output is None
        config["kv_cache_dtype"] = self._kv_dtype_name
        return config

    def make_scheduler(self, **options: Any) -> _core.Scheduler:
        """The scheduler over this runner's blocks (one per runner: it owns their bookkeeping)."""
        if self._sched is not None:
            raise RuntimeError("a TorchRunner serves one scheduler")
        self._sched = _core.Scheduler(
            self.sizes.device_blocks,
            host_blocks=self.sizes.host_blocks,
            block_bytes=self.sizes.block_bytes,
            enable_prefix_caching=self.prefix_caching,
            host_prefetch=self.host_prefetch,
            **options,
        )
        return self._sched

    def launch(
        self,
        sched: _core.Scheduler,
        out: _core.SchedulerOutput,
        rows: Sequence[SampleRow],
        feed: Feed | None = None,
    ) -> StepDraws:
        """Queues one planned step: tier copies, the forward pass, the sampling rows' draws (in item
        order) or their logits, and the copy of either to the host; on CUDA it returns before the device
        has run it (``StepDraws.draws`` waits). A step planned ahead (``feed``) takes its token ids from
        the draws of the step before it, on the device, behind that step."""
        plan = sched.prepare(out)
        self._copy_tiers(plan)
        fed = fed_ids(feed) if feed is not None else None
        logits = self._forward(StepBatch.from_plan(plan), fed)
        self._computed_tokens += plan.num_tokens
        if plan.logits_indices.shape[0] != len(rows):  # prompt rows to score, then the sampling rows
            sample_rows, prompt = sched.logit_rows(out)
            self._prompt_scores.extend(score_prompt_rows(logits, prompt))
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)]
        if self.sample_on_device:
            return start_sampling(logits, rows, self.vocab_size, self.histories, fed)
        copy = HostCopy([logits.float()])
        return HostSampling(lambda: _only(copy.wait()).numpy(), rows)

    def _forward(self, batch: StepBatch, fed: torch.Tensor | None) -> torch.Tensor:
        """The step's logits; ``fed``: the ids of a step planned ahead, in place of the plan's."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch, fed)
        inputs = batch.to_device(self._device)
        if fed is not None:
            inputs.input_ids.copy_(fed)
        return self.model.forward(inputs, self.kv)

    def _copy_tiers(self, plan: _core.StepPlan) -> None:
        """Demotions first (their device blocks may be rewritten by this step), then promotions, then
        prefetches for waiting requests; on CUDA on the tier copier's side stream, the prefetches
        beside the forward pass (see ``kv_pool.TierCopier``). Called every step: a step without
        copies still waits for the last step's prefetches."""
        if self.tiers is not None:
            self.tiers.run(plan.demote, plan.promote, plan.prefetch)
        elif plan.demote.shape[0] or plan.promote.shape[0] or plan.prefetch.shape[0]:
            raise AssertionError("tier copies come only from a host tier")

    def cache_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self._scheduler().cache_stats())
        stats["computed_tokens"] = self._computed_tokens
        stats["host_bytes_in_use"] = (
            stats["host_capacity_blocks"] - stats["host_free_blocks"]
        ) * self.sizes.block_bytes
        stats["host_capacity_bytes"] = stats["host_capacity_blocks"] * self.sizes.block_bytes
        stats["bytes_demoted"] = stats["demotions"] * self.sizes.block_bytes
        stats["bytes_promoted"] = stats["promotions"] * self.sizes.block_bytes
        return stats

    def reset_prefix_cache(self) -> int:
        return self._scheduler().reset_prefix_cache()

    def save_prefix_cache(self, path: str) -> int:
        raise NotImplementedError(_NO_CACHE_FILES)

    def load_prefix_cache(self, path: str) -> int:
        raise NotImplementedError(_NO_CACHE_FILES)

    def take_prompt_logprobs(self) -> PromptScores:
        """The prompt logprobs the steps launched since the last call scored (at their launch)."""
        scores, self._prompt_scores = self._prompt_scores, []
        return scores

    def forget(self, key: int) -> None:
        """Frees the device history rows of a finished request."""
        if self.histories is not None:
            self.histories.forget(key)

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits after every position, computed in a private pool (the cache is untouched)."""
        blocks = blocks_for(len(token_ids))
        pool = self.model.new_kv_pool(blocks, self.kv.dtype)
        batch = StepBatch.for_sequences([(list(range(blocks)), 0, token_ids, True)])
        return self.model.forward(batch.to_device(self._device), pool).to("cpu", torch.float32).numpy()

    def hidden_states(self, token_ids: list[int], rows: str = "all") -> np.ndarray:
        """The final-normed hidden states after every position (``rows="all"``) or the last, computed
        in a private pool like ``logits``."""
        blocks = blocks_for(len(token_ids))
        pool = self.model.new_kv_pool(blocks, self.kv.dtype)
        want: bool | str = True if rows == "all" else "last"
        batch = StepBatch.for_sequences([(list(range(blocks)), 0, token_ids, want)])
        return self.model.hidden(batch.to_device(self._device), pool).to("cpu", torch.float32).numpy()

    def hidden_state_steps(
        self, token_ids: list[int], rows: str = "all", chunk_tokens: int | None = None
    ) -> HiddenSteps:
        """``hidden_states`` as one chunk whatever ``chunk_tokens``: it runs in a private pool, so it
        takes no blocks from the cache (a device prefill is short next to a step's wait)."""
        yield 0
        return self.hidden_states(token_ids, rows)

    def _scheduler(self) -> _core.Scheduler:
        if self._sched is None:
            raise RuntimeError("the runner has no scheduler yet")
        return self._sched


def _only(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    (tensor,) = tensors
    assert tensor is not None
    return tensor


def _device_sampling(device: torch.device) -> bool:
    """Whether to sample on ``device``: ``OXIBONSAI_DEVICE_SAMPLING`` ("0" or "1") if set, else off the
    CPU only (on the CPU the Rust sampler is faster and the logits are already in host memory)."""
    return _env_flag("OXIBONSAI_DEVICE_SAMPLING", default=device.type != "cpu")


def _env_flag(name: str, *, default: bool) -> bool:
    """An on/off override from the environment: "0" or "1", unset or empty for ``default``."""
    asked = os.environ.get(name)
    if asked is None or asked == "":
        return default
    if asked not in ("0", "1"):
        raise ValueError(f"{name} must be '0' or '1', got {asked!r}")
    return asked == "1"


_NO_CACHE_FILES = (
    "prefix-cache files are written and read by the native (CPU) runner only, not the torch runner yet"
)


def _max_model_len(asked: int | None, longest: int, scaled: bool) -> int:
    if asked is None:
        return min(longest, DEFAULT_MAX_MODEL_LEN)
    if not 1 <= asked <= longest:
        context = "the model's context length" + (", with its rope scaling" if scaled else "")
        raise ValueError(f"max_model_len must be in 1..={longest} ({context}), got {asked}")
    return asked


class _DeviceBudget:
    """What the device can hold: on CUDA its memory times ``gpu_memory_utilization``, less what is in
    use and headroom for activations (``free``); elsewhere nothing is checked (``free`` is None) and
    the default pool is sized from host memory as the native runner's is."""

    def __init__(self, device: torch.device, free: int | None) -> None:
        self.device = device
        self.free = free

    @classmethod
    def probe(cls, device: torch.device, utilization: float) -> _DeviceBudget:
        if device.type != "cuda":
            return cls(device, None)
        free, total = torch.cuda.mem_get_info(device)
        return cls(device, max(0, int(total * utilization) - (total - free) - ACTIVATION_HEADROOM))

    def check_weights(self, nbytes: int) -> None:
        if self.free is not None and nbytes > self.free:
            raise ValueError(
                f"{self.device} cannot hold the model's weights: {nbytes} bytes, with {self.free} bytes "
                "usable (gpu_memory_utilization of its memory, less what is in use and 1 GiB of headroom)"
            )

    def weights_loaded(self, nbytes: int) -> None:
        if self.free is not None:
            self.free = max(0, self.free - nbytes)

    def device_blocks(
        self, blocks: int | None, nbytes: int | None, block_bytes: int, max_model_len: int, max_num_seqs: int
    ) -> int:
        """The pool: ``blocks`` if given, else as many as ``max_num_seqs`` full sequences need within
        ``nbytes`` (default: what the device has left), never fewer than one full sequence needs."""
        per_seq = blocks_for(max_model_len)
        if blocks is None:
            budget = nbytes if nbytes is not None else self.default_bytes()
            blocks = max(per_seq, min(per_seq * max_num_seqs, budget // block_bytes))
        if blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got kv_cache_blocks={blocks}")
        if self.free is not None and blocks * block_bytes > self.free:
            raise ValueError(
                f"{self.device} cannot hold {blocks} KV blocks ({blocks * block_bytes} bytes; one sequence "
                f"of max_model_len={max_model_len} tokens needs {per_seq}) beside the weights: {self.free} "
                "bytes are left; lower kv_cache_blocks or max_model_len, or raise gpu_memory_utilization"
            )
        return blocks

    def default_bytes(self) -> int:
        if self.free is not None:
            return self.free
        from oxibonsai.llm import default_kv_cache_bytes

        return default_kv_cache_bytes()


def _host_blocks(
    blocks: int | None, nbytes: int | None, block_bytes: int, device_blocks: int, budget: _DeviceBudget
) -> int:
    if blocks is not None:
        if blocks < 0:
            raise ValueError(f"host_kv_cache_blocks must be >= 0, got {blocks}")
        return blocks
    if nbytes is not None:
        if nbytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {nbytes}")
        return nbytes // block_bytes
    if budget.device.type != "cuda":
        return 0  # the CPU and MPS's unified memory: a host copy of host memory buys nothing
    from oxibonsai.llm import available_memory_bytes

    available = available_memory_bytes() or 0
    return min(device_blocks, int(available * HOST_TIER_FRACTION) // block_bytes)

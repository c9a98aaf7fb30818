"""``LLM``: the synchronous facade. Loads a GGUF model (or the embedded default), builds its tokenizer
and chat template from the file, and runs ``generate`` / ``chat`` / ``stream`` / ``logits`` through
the engine's step loop."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from oxibonsai import _core
from oxibonsai.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    EngineBeams,
    beam_search,
    check_fits,
    native_beam_steps,
)
from oxibonsai.embedding import check_pooling, model_pooling, pooled
from oxibonsai.engine import Engine, SchedulerConfig
from oxibonsai.generation_config import model_sampling_defaults
from oxibonsai.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from oxibonsai.progress import PROGRESS_MIN_PROMPTS, Progress
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.runner import NativeRunner, Runner, choose, run_steps
from oxibonsai.sampling_params import SamplingParams, truncated
from oxibonsai.speculative import SpeculativeConfig
from oxibonsai.tokenizer import Tokenizer

PromptType = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


KV_MEMORY_FRACTION = 0.25  # of the memory available when the LLM is built
FALLBACK_KV_CACHE_BYTES = 2 << 30  # where available memory cannot be read


def available_memory_bytes() -> int | None:
    """Memory available to new allocations: Linux's MemAvailable, else free pages by sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_cache_bytes() -> int:
    """The KV budget when neither ``kv_cache_blocks`` nor ``kv_cache_bytes`` is given: a quarter of
    the available memory (2 GiB where that cannot be read)."""
    available = available_memory_bytes()
    if available is None:
        return FALLBACK_KV_CACHE_BYTES
    return max(1, int(available * KV_MEMORY_FRACTION))


def default_model_path() -> Path:
    """The embedded default model shipped inside the package."""
    models = Path(__file__).parent / "models"
    found = sorted(models.glob("*.gguf")) if models.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no embedded default model under {models}; pass a .gguf path to LLM()")
    return found[0]


class LLM:
    """A Bonsai (Qwen3, Q1_0) model ready to generate.

    ``model``: path to a ``.gguf`` (``None``: the embedded default model). ``num_threads`` sets the
    process-wide kernel thread count. ``max_model_len`` bounds prompt plus output (default: the
    model's context, at most 4096). ``seed`` seeds requests whose ``SamplingParams.seed`` is None.
    ``kv_cache_blocks``: 16-token KV blocks to reserve; by default as many as ``max_num_seqs`` full
    sequences need within ``kv_cache_bytes`` (default: a quarter of the available memory, see
    ``default_kv_cache_bytes``), never fewer than one sequence needs; blocks are committed lazily.
    ``max_num_seqs``: most requests running (decoded together) per step. ``max_num_batched_tokens``:
    most tokens per step, decodes and prompt chunks together (default 256, at least ``max_num_seqs``;
    the whole context without chunked prefill). ``enable_chunked_prefill``: split long prompts across
    steps so running requests keep decoding. ``max_waiting``: most requests waiting (``None``: no
    limit); ``generate`` then feeds its prompts as room frees up, ``AsyncLLM`` raises ``QueueFull``.
    ``priority_aging_steps``: a waiting request gains one priority level per this many steps, so low
    priorities never starve. ``scheduling_policy``: ``"priority"`` (priority, then arrival) or
    ``"longest_prefix"`` (among the first waiting requests, the one with the most cached tokens).
    ``kernel``: the Q1 matmul kernel family
    (``"auto"``; ``"reference"`` runs the exact f32 kernel, for checking).
    ``kv_cache_dtype``: ``"auto"``/``"f16"`` (half the memory and bandwidth), ``"f32"`` (exact) or,
    on the native runner, ``"int8"`` (a quarter of f32's: each token's keys and values of one head as
    integers over one f32 scale, ``absmax / 127``).
    ``enable_prefix_caching``: reuse the KV of prompt prefixes computed before (full 16-token blocks,
    kept until evicted, least recently used first); a prompt dict's ``"cache_salt"`` keeps tenants apart.
    ``device``: ``"auto"`` (CUDA, then MPS, then the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or
    ``"mps"``. ``runner``: ``"auto"`` (native on the CPU, torch elsewhere), ``"native"`` (the Rust
    forward pass, CPU only) or ``"torch"`` (the torch runner on ``device``; needs ``oxibonsai[torch]``).
    On the torch runner ``kv_cache_blocks`` / ``kv_cache_bytes`` size the device KV pool (on CUDA by
    default ``gpu_memory_utilization`` of the GPU's memory, less the weights), and
    ``host_kv_cache_blocks`` / ``host_kv_cache_bytes`` the host-memory tier that idle cached blocks are
    demoted to instead of dropped (0 turns it off; by default as large as the device pool on CUDA, off
    elsewhere). On CUDA, decode steps run as CUDA graphs captured per batch-size bucket;
    ``enforce_eager=True`` runs every step eagerly. ``kernel`` applies to the native runner only.
    ``reasoning_parser``: ``"qwen3"`` lets a request with structured output think first (its grammar
    starts after ``</think>``); None (default) constrains from the first token.
    ``rope_scaling`` (a ``RopeScaling`` or its Hugging Face dict, e.g. ``{"rope_type": "yarn",
    "factor": 4.0, "original_max_position_embeddings": 32768}``) and ``rope_theta`` replace the
    file's; a scaling lets ``max_model_len`` reach ``factor`` x the original context.
    ``generation_config``: ``"auto"`` takes the sampling defaults the GGUF recommends (its
    ``general.sampling.*`` keys: ``default_sampling_fields``) for calls without ``SamplingParams``;
    ``"vllm"`` ignores them (``oxibonsai.generation_config``).
    ``speculative_config``: vLLM's n-gram speculative decoding, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` (or a ``SpeculativeConfig``, or the dict
    as JSON): each decode also checks up to that many tokens copied from where the request's last
    tokens occurred before; the tokens are the same as without it (``oxibonsai.speculative``).
    Native runner only.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        num_threads: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 8,
        kernel: str = "auto",
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        max_waiting: int | None = None,
        enable_chunked_prefill: bool = True,
        priority_aging_steps: int = 256,
        scheduling_policy: str = "priority",
        device: str = "auto",
        runner: str = "auto",
        host_kv_cache_blocks: int | None = None,
        host_kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        reasoning_parser: str | None = None,
        rope_scaling: RopeScaling | Mapping[str, Any] | str | None = None,
        rope_theta: float | None = None,
        generation_config: str = "auto",
        speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None,
    ) -> None:
        path = Path(model) if model is not None else default_model_path()
        if not path.exists():
            raise FileNotFoundError(f"no such model file: {path}")
        placement = choose(device, runner)
        speculation = SpeculativeConfig.parse(speculative_config)
        if num_threads is not None:
            _core.set_num_threads(num_threads)
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model_path = path
        self.metadata: dict[str, Any] = _core.GGUFFile(path).metadata
        self.tokenizer = Tokenizer.from_gguf_metadata(self.metadata)
        self.default_sampling_fields = model_sampling_defaults(self.metadata, generation_config)
        kv = {
            "max_model_len": max_model_len,
            "kv_cache_blocks": kv_cache_blocks,
            "kv_cache_bytes": kv_cache_bytes,
            "max_num_seqs": max_num_seqs,
            "kv_cache_dtype": kv_cache_dtype,
            "enable_prefix_caching": enable_prefix_caching,
            "rope_scaling": RopeScaling.parse(rope_scaling),
            "rope_theta": _rope_theta(rope_theta),
        }
        if placement.runner == "native":
            self._runner: Runner = _native_runner(path, kernel=kernel, **kv)
        else:
            from oxibonsai.torch_backend.runner import TorchRunner

            self._runner = TorchRunner(
                path,
                device=placement.device,
                host_kv_cache_blocks=host_kv_cache_blocks,
                host_kv_cache_bytes=host_kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                **kv,
            )
        if self._runner.vocab_size < self.tokenizer.vocab_size:
            raise _core.GGUFError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but token_embd.weight only "
                f"{self._runner.vocab_size} rows"
            )
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_waiting=max_waiting,
            enable_chunked_prefill=enable_chunked_prefill,
            priority_aging_steps=priority_aging_steps,
            scheduling_policy=scheduling_policy,
        )
        self._engine = Engine(
            self._runner,
            self.tokenizer,
            seed=seed,
            config=config,
            reasoning_parser=reasoning_parser,
            speculative_config=speculation,
        )
        self._ids = itertools.count()

    @property
    def config(self) -> dict[str, Any]:
        return self._runner.config

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without ``sampling_params`` samples with (vLLM's name): ``SamplingParams()``
        with the model's recommended fields (``default_sampling_fields``) in place of the library's."""
        return SamplingParams(**self.default_sampling_fields)

    @property
    def device(self) -> str:
        """The device the model runs on ("cpu", "cuda:0", "mps")."""
        return self._runner.device

    @property
    def runner(self) -> str:
        """``"native"`` (the Rust forward pass) or ``"torch"``."""
        return self._runner.kind

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def model_name(self) -> str:
        """The GGUF's ``general.name``, else its file name without the extension."""
        name = self.metadata.get("general.name")
        return name if isinstance(name, str) and name else self.model_path.stem

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the prefix cache shares whole blocks)."""
        return self._engine.block_tokens

    # -- prefix cache -----------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache statistics: ``queries`` (prompts looked up), ``hits`` (those with a cached
        block), ``queried_tokens``, ``hit_tokens``, ``hit_rate``, ``inserted_blocks``, ``evictions``,
        ``cached_blocks``, ``idle_blocks`` (cached, unused, evictable), ``free_blocks``,
        ``capacity_blocks``, ``bytes_in_use``, ``capacity_bytes``, ``computed_tokens`` (tokens the
        model has run, prefill and decode) and ``enabled``; the host tier's ``host_capacity_blocks``,
        ``host_cached_blocks``, ``host_free_blocks``, ``host_hit_tokens`` (prompt tokens a starting
        request found there), ``demotions``, ``promotions``, ``prefetched_blocks`` (those promoted
        while their request still waited) and ``host_evictions`` (all 0 without one), and on the torch
        runner ``host_bytes_in_use``, ``host_capacity_bytes``, ``bytes_demoted`` and ``bytes_promoted``."""
        stats: dict[str, Any] = self._runner.cache_stats()
        stats["enabled"] = self._runner.prefix_caching
        return stats

    def metrics(self) -> dict[str, Any]:
        """Engine metrics: counters (requests finished by reason, prompt and generation tokens,
        preemptions), gauges (running, waiting, KV blocks in use, prefix hit rate) and histograms
        (queue time, time to first token, time per output token, end-to-end latency), as a plain dict;
        ``metrics_text()`` gives the same in Prometheus' text format."""
        self._engine.refresh_gauges()
        return {**self._engine.metrics.snapshot(), "scheduler": self._engine.scheduler_stats()}

    def metrics_text(self, prefix: str = "oxibonsai") -> str:
        self._engine.refresh_gauges()
        return self._engine.metrics.to_prometheus(prefix)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block no running request uses; returns how many were dropped."""
        return self._runner.reset_prefix_cache()

    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Writes every cached prompt block (its KV, tokens and cache salt) to ``path`` for
        ``load_prefix_cache`` in a later process or another replica; returns how many blocks. The file
        is written beside ``path`` and renamed over it, so a reader never sees half of one."""
        return self._runner.save_prefix_cache(os.fspath(path))

    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Caches the blocks of a file ``save_prefix_cache`` wrote, in free KV blocks (never evicting);
        returns how many are cached. The file must come from the same model file with the same
        ``kv_cache_dtype`` and rope settings (``ValueError`` otherwise, as for a corrupt or truncated
        file, which is checked before anything is cached; each block's KV is checksummed)."""
        return self._runner.load_prefix_cache(os.fspath(path))

    # -- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for one prompt or a list (strings, token id lists, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}`` dicts, optionally with ``"cache_salt": str``); returns one
        finished ``RequestOutput`` per prompt, in order, holding ``n`` completions (index 0 to n - 1)
        for ``SamplingParams(n=...)``: the first sample computes the prompt and the others start from
        its cached blocks once it has. All prompts are checked before any runs.
        ``priority``: one per prompt, lower first. ``use_tqdm``: a progress bar on stderr (default:
        for 16 prompts or more)."""
        batch = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(batch))
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        requests = [self._prepare(p) for p in batch]
        for (_, ids, _), sp in zip(requests, params, strict=True):
            self._engine.check_prompt(ids, sp.for_sample(0))
        show = use_tqdm if use_tqdm is not None else len(batch) >= PROGRESS_MIN_PROMPTS
        bar = Progress(sum(sp.n for sp in params)) if show else None
        finished: dict[str, RequestOutput] = {}
        samples: list[list[str]] = [[] for _ in batch]  # each prompt's request ids, by sample
        pending = [(k, 0) for k in reversed(range(len(batch)))]  # (prompt, sample), popped from the end
        siblings: dict[str, int] = {}  # a first sample whose prompt's other samples wait -> its prompt
        try:
            while pending or self._engine.has_unfinished():
                while pending and self._has_room():
                    k, i = pending.pop()
                    text, token_ids, salt = requests[k]
                    sp = params[k].for_sample(i)
                    samples[k].append(self._submit(text, token_ids, salt, sp, priority=priorities[k]))
                    if i == 0 and params[k].n > 1:
                        siblings[samples[k][0]] = k
                for out in self._engine.step():
                    if out.finished:
                        _raise_error(self._engine, out)
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(out)
                pending += _started_siblings(self._engine, siblings, params)
        except BaseException:
            self._engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [_merge_samples([finished[i] for i in ids]) for ids in samples]

    def _has_room(self) -> bool:
        limit = self._engine.config.max_waiting
        return limit is None or self._engine.num_waiting < limit

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``beam_width`` most likely continuations
        (``oxibonsai.beam_search``): on the native runner on forked KV sequences, elsewhere as
        one-token requests over the prefix cache; a prompt whose beams could outgrow the context is a
        ``ValueError`` before any work."""
        batch = self._prompt_list(prompts)
        token_lists = [self._tokenize(p)[1] for p in batch]
        check_fits(token_lists, params, self.max_model_len)

        def step(prompts: list[dict[str, Any]], one_token: SamplingParams) -> list[RequestOutput]:
            return self.generate(prompts, one_token, use_tqdm=False)

        stop_ids, decode = set(self.tokenizer.stop_token_ids), self.tokenizer.decode
        salts = [_cache_salt(p) for p in batch]
        if isinstance(self._runner, NativeRunner):
            steps = native_beam_steps(self._runner._model, token_lists, params, stop_ids, decode, salts=salts)
            return run_steps(steps)
        beams = lambda: EngineBeams(step, params.beam_width, salts)  # noqa: E731
        return beam_search(beams, token_lists, params, stop_ids, decode)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (or a list) and generates;
        ``continue_final_message`` (with ``add_generation_prompt=False``) continues the last message."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = [
            self.chat_prompt(conv, add_generation_prompt=add_generation_prompt, **kwargs)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the request's cumulative output after every step (one token, or more with accepted
        drafts); the last one is finished.
        Closing the iterator early aborts the request and frees its KV blocks."""
        request_id = self._add(
            self._prompt_list(prompt)[0], sampling_params or self.get_default_sampling_params(), stream=True
        )
        try:
            while self._engine.has_unfinished():
                for out in self._engine.step():
                    if out.request_id == request_id:
                        if out.finished:
                            _raise_error(self._engine, out)
                        yield out
                        if out.finished:
                            return
        finally:
            self._engine.abort(request_id)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (``self.tokenizer``), by vLLM's name for it."""
        return self.tokenizer

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 ``(len(token_ids), vocab)``: the logits after every position (one prefill pass)."""
        ids = [int(t) for t in token_ids]
        self._check_ids(ids)
        return self._runner.logits(ids)

    def _check_ids(self, ids: list[int]) -> None:
        """A one-off forward pass's tokens: some, within the context and the vocabulary."""
        if not ids:
            raise ValueError("token_ids is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context (max_model_len={self.max_model_len})")
        vocab = self._runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # checked here for every runner: a GPU kernel would read past the table
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab}")

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling: str | None = None,
        normalize: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): its final hidden states pooled (``"last"``,
        ``"mean"`` or ``"cls"``; None: the model's, see ``embedding``), L2-normalized unless
        ``normalize=False``. Each prompt runs alone, outside the scheduler, on a sequence of its own
        (its KV blocks are freed at once); a prompt longer than the context is a ``ValueError``, unless
        ``truncate_prompt_tokens`` keeps only its last tokens (-1: the context's length)."""
        pooling, prompt_ids = self._embedding_inputs(prompts, pooling, truncate_prompt_tokens)
        return [run_steps(self._embedding_steps(ids, pooling, normalize)) for ids in prompt_ids]

    def _embedding_inputs(
        self, prompts: PromptType | Sequence[PromptType], pooling: str | None, keep: int | None = None
    ) -> tuple[str, list[list[int]]]:
        """The pooling to use and each prompt's token ids, cut to their last ``keep`` and checked
        (``ValueError`` before any work)."""
        pooling = check_pooling(pooling if pooling is not None else model_pooling(self.metadata))
        prompt_ids = []
        for prompt in self._prompt_list(prompts):
            _, ids = self._tokenize(prompt)
            ids = truncated(ids, keep, self.max_model_len)
            self._check_ids(ids)
            prompt_ids.append(ids)
        return pooling, prompt_ids

    def _embedding_steps(
        self, ids: list[int], pooling: str, normalize: bool, chunk_tokens: int | None = None
    ) -> Generator[int, None, EmbeddingRequestOutput]:
        """One prompt's embedding as the runner's ``hidden_state_steps`` (what they yield, then the
        output); ``AsyncLLM`` runs a chunk between two engine steps."""
        rows = "last" if pooling == "last" else "all"
        hidden = yield from self._runner.hidden_state_steps(ids, rows, chunk_tokens)
        vector = pooled(hidden, pooling, normalize)
        return EmbeddingRequestOutput(str(next(self._ids)), ids, EmbeddingOutput(vector.tolist()))

    def chat_prompt(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> dict[str, Any]:
        """A conversation rendered with the model's chat template, as a prompt dict for ``generate`` /
        ``stream``: the text and its token ids (special tokens in the text map to their ids)."""
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        assert isinstance(text, str)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    # -- helpers ----------------------------------------------------------------------------------

    def _add(
        self, prompt: PromptType, params: SamplingParams, *, stream: bool = False, priority: int = 0
    ) -> str:
        text, ids, salt = self._prepare(prompt)
        return self._submit(text, ids, salt, params, stream=stream, priority=priority)

    def _prepare(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """The prompt's text (if any), token ids and cache salt."""
        text, ids = self._tokenize(prompt)
        return text, ids, _cache_salt(prompt)

    def _submit(
        self,
        text: str | None,
        ids: list[int],
        salt: str | None,
        params: SamplingParams,
        *,
        stream: bool = False,
        priority: int = 0,
    ) -> str:
        request_id = str(next(self._ids))
        self._engine.add_request(
            request_id, text, ids, params, stream=stream, cache_salt=salt, priority=priority
        )
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' string or 'prompt_token_ids'")
        return None, _token_list(prompt)

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(p, (int, np.integer)) for p in items):
            return [items]
        return items

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        out = list(params)
        if len(out) != n:
            raise ValueError(f"got {len(out)} SamplingParams for {n} prompts")
        return out


def _started_siblings(
    engine: Engine, siblings: dict[str, int], params: list[SamplingParams]
) -> list[tuple[int, int]]:
    """The (prompt, sample) pairs of the later samples of every first sample that has started, last
    sample first (``generate`` pops its queue from the end): they start from its cached prompt blocks
    instead of computing the prompt again beside it, as the server's ``n`` does."""
    release = []
    for rid in [rid for rid in siblings if engine.has_started(rid)]:
        k = siblings.pop(rid)
        release += [(k, i) for i in reversed(range(1, params[k].n))]
    return release


def _merge_samples(outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples as one ``RequestOutput`` (the first's id, prompt and metrics) holding each
    sample's completion with its index, as vLLM returns ``n`` samples."""
    if len(outputs) == 1:
        return outputs[0]
    merged = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)]
    return dataclasses.replace(outputs[0], outputs=merged)


def _cache_salt(prompt: PromptType) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
    return salt


def _token_list(ids: Any) -> list[int]:
    try:
        out = [int(t) for t in ids]
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"a prompt must be a string, a list of token ids or a prompt dict, got {ids!r:.80}"
        ) from e
    if any(isinstance(t, bool) for t in ids):
        raise TypeError("token ids must be integers, not booleans")
    return out


def _raise_error(engine: Engine, out: RequestOutput) -> None:
    """Raises the error that ended a finished request (its logits processor's), if one did."""
    error = engine.take_error(out.request_id)
    if error is not None:
        raise error


def _native_runner(path: Path, *, kernel: str, kv_cache_bytes: int | None, **kv: Any) -> NativeRunner:
    model = _core.Model(
        path,
        max_model_len=kv["max_model_len"],
        kv_blocks=kv["kv_cache_blocks"],
        kv_cache_bytes=kv_cache_bytes if kv_cache_bytes is not None else default_kv_cache_bytes(),
        max_num_seqs=kv["max_num_seqs"],
        kernel=kernel,
        kv_cache_dtype=kv["kv_cache_dtype"],
        enable_prefix_caching=kv["enable_prefix_caching"],
        rope_scaling=kv["rope_scaling"],
        rope_theta=kv["rope_theta"],
    )
    return NativeRunner(model)


def _rope_theta(theta: float | None) -> float | None:
    if theta is not None and (
        isinstance(theta, bool)
        or not isinstance(theta, (int, float))
        or not math.isfinite(theta)
        or theta <= 1.0
    ):
        raise ValueError(f"rope_theta must be a finite number > 1, got {theta!r}")
    return None if theta is None else float(theta)

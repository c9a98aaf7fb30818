"""The step loop over the native continuous-batching scheduler: ``schedule()`` picks this step's work
(decodes first, then prefill chunks, then admissions, preempting when KV blocks run out), the runner
computes it as a single batched forward pass (the native one in one call with the GIL released; the
torch one from the step's plan arrays), each request that
completed its known tokens samples one token (the runner samples: with the request's seeded Rust
sampler on the host, or on the GPU), ``update()`` records them,
and the engine detokenizes incrementally, applies stop tokens, stop strings and length limits, and
finishes requests (freeing their blocks). Python never loops over layers or tokens.

Requests are validated before they enter the queue (length against the context and the cache,
token ids, sampling parameters); a full waiting queue raises ``QueueFull``. With prefix caching on, a
request starts on the cached blocks of its longest cached prefix (per ``cache_salt``) and computes only
the rest; a preempted request keeps its output and is recomputed, mostly from the cache, when readmitted.
A request with ``prompt_logprobs`` computes its whole prompt (it starts without the cache) and the
runner scores each prompt token from the row before it; its ``RequestOutput.prompt_logprobs`` is set
once the prompt is computed (a prefill preempted and recomputed is not scored twice).
A request with ``structured_outputs`` compiles its grammar when it is added (an invalid one is a
``ValueError`` then); each of its sampling rows carries the grammar's mask of allowed ids, each token
taken advances the grammar, and the request ends (``"stop"``) once the grammar is complete. Its steps
are never planned ahead of the tokens they follow (the mask needs them). With a ``reasoning_parser``
the grammar waits while the model reasons (``structured_output``). ``allowed_token_ids`` and
``bad_words`` (``token_constraints``) narrow each row's mask and bans; a step is not planned ahead of
a token that a bad word's ban depends on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from oxibonsai import _core
from oxibonsai.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextBuffer
from oxibonsai.logits_processors import FailedDraw
from oxibonsai.metrics import EngineMetrics
from oxibonsai.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from oxibonsai.runner import DraftedDraws, Draw, Feed, Runner, SampleRow, StepDraws
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.speculative import SpeculativeConfig, verify
from oxibonsai.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from oxibonsai.thinking_budget import ThinkingBudget
from oxibonsai.token_constraints import BadWords, allowed_mask, both, leaves_a_token
from oxibonsai.tokenizer import Tokenizer

_MASK64 = (1 << 64) - 1

_Launched = tuple[_core.SchedulerOutput, list["_Request"], StepDraws]
"""A launched step: its plan, the requests that sample in it (in item order), their draws to come."""


def request_seed(engine_seed: int, index: int) -> int:
    """A per-request seed from the engine seed and the request's arrival index (SplitMix64 finalizer)."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class _Request:
    request_id: str
    handle: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    sampler: _core.Sampler
    max_new: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    metrics: RequestMetrics
    streamed: bool = False
    num_cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text_buffer: TextBuffer = field(default_factory=TextBuffer)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    plain_greedy: bool = False  # params.is_plain_greedy, read once
    row: SampleRow | None = None  # the sampling row of every step with nothing banned
    prompt_scored: dict[int, dict[int, Logprob]] | None = None  # prompt position -> its logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # set once every position is
    grammar: GrammarState | None = None  # structured output: the grammar's state after output_ids
    ended_on_stop_token: bool = False  # its last token is a stop id (whose text is not output)
    allowed: np.ndarray | None = None  # allowed_token_ids as an allow-bitmask
    bad_words: BadWords | None = None
    budget: ThinkingBudget | None = None  # thinking_token_budget's count

    def prompt_logprobs_done(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs once every position after the first is scored, else None."""
        scored = self.prompt_scored
        if self.prompt_logprobs is None and scored is not None and len(scored) == len(self.prompt_ids) - 1:
            first: list[dict[int, Logprob] | None] = [None]
            self.prompt_logprobs = first + [scored[p] for p in range(1, len(self.prompt_ids))]
        return self.prompt_logprobs

    def snapshot(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text_buffer.value(),
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
            prompt_logprobs=self.prompt_logprobs_done(),
            num_cached_tokens=self.num_cached_tokens,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine arguments of the scheduler (shared by ``LLM`` and ``AsyncLLM``). ``None`` for
    ``max_num_batched_tokens`` picks a default: 256 tokens per step (at least ``max_num_seqs``), or
    the whole context when chunked prefill is off."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    max_waiting: int | None = None
    enable_chunked_prefill: bool = True
    priority_aging_steps: int = 256
    scheduling_policy: str = "priority"

    def batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            return max(max_model_len, self.max_num_seqs)
        return max(DEFAULT_BATCHED_TOKENS, self.max_num_seqs)


DEFAULT_BATCHED_TOKENS = 256


class Engine:
    """Runs requests to completion over one runner; not thread-safe (``AsyncLLM`` wraps it)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        *,
        seed: int,
        config: SchedulerConfig | None = None,
        reasoning_parser: str | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        config = config or SchedulerConfig()
        if speculative_config is not None and runner.kind != "native":
            raise ValueError(
                f"speculative decoding runs on the native runner; the {runner.kind} runner does not "
                "verify drafts"
            )
        budget = config.batched_tokens(runner.max_model_len)
        if not config.enable_chunked_prefill and budget < runner.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({budget}) must be >= max_model_len "
                f"({runner.max_model_len}), or long prompts could never run"
            )
        if config.max_waiting is not None and config.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {config.max_waiting}")
        self._runner = runner
        # The runner's constants, plain attributes: check_prompt runs outside AsyncLLM's step lock.
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.num_blocks = runner.num_blocks
        self.block_tokens = runner.block_tokens
        self._tokenizer = tokenizer
        self._seed = seed
        self.config = config
        self._sched = runner.make_scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_waiting=config.max_waiting,
            priority_aging_steps=config.priority_aging_steps,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            **({"speculation": speculative_config.core()} if speculative_config is not None else {}),
        )
        self.speculative_config = speculative_config
        self._requests: dict[int, _Request] = {}
        self._handles: dict[str, int] = {}
        self._arrivals = 0
        self._launched: _Launched | None = None  # a step the runner runs whose tokens are not taken yet
        self._launch_error: Exception | None = None
        self._grammars = GrammarCompiler(tokenizer, runner.vocab_size, reasoning_parser)
        self._errors: dict[str, BaseException] = {}  # request id -> its logits processor's error
        self.metrics = EngineMetrics()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request after checking it can ever run (length against the context and the cache).
        ``arrival_time`` (``time.perf_counter``; default now) is when the request reached the engine's
        owner, so queueing before this call counts in its time to first token.
        A streamed request reports its output after every step; others only when they finish.
        Requests share cached prompt blocks only with requests of the same ``cache_salt``; a lower
        ``priority`` runs first. Raises ``QueueFull`` when ``max_waiting`` requests already wait."""
        if request_id in self._handles:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt_ids = params.truncated_prompt(prompt_ids, self.max_model_len)
        max_new = self.check_prompt(prompt_ids, params)
        spec = params.structured_outputs
        grammar = self._grammars.compile(spec, prompt_ids) if spec is not None else None
        allowed, bad_words = self._token_constraints(params)
        handle = self._arrivals
        default_seed = request_seed(self._seed, handle + 1)
        request = _Request(
            request_id=request_id,
            handle=handle,
            prompt=prompt,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=params.effective_seed(default_seed),
            sampler=params.sampler(default_seed),
            plain_greedy=params.is_plain_greedy,
            max_new=max_new,
            detok=IncrementalDetokenizer(self._tokenizer, prompt_ids, params.skip_special_tokens),
            stops=StopStringMatcher(params.stop or [], params.include_stop_str_in_output),
            metrics=RequestMetrics(
                arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                num_prompt_tokens=len(prompt_ids),
            ),
            logprobs=[] if params.logprobs is not None else None,
            streamed=stream,
            prompt_scored={} if params.prompt_logprobs is not None else None,
            grammar=grammar,
            allowed=allowed,
            bad_words=bad_words,
            budget=self._thinking_budget(params, prompt_ids),
        )
        self._sched.add(
            handle,
            request.prompt_ids,
            priority=priority,
            cache_salt=cache_salt,
            prompt_logprobs=params.prompt_logprobs,
            **({"draft_limit": len(prompt_ids) + max_new} if self.speculative_config is not None else {}),
        )
        self._arrivals += 1
        self._requests[handle] = request
        self._handles[request_id] = handle

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validates a prompt (and compiles its grammar, if any: thread-safe); returns how many tokens
        the request may generate. ``prompt_ids`` are checked as ``truncate_prompt_tokens`` leaves them."""
        prompt_ids = params.truncated_prompt(prompt_ids, self.max_model_len)
        if params.n != 1:
            raise ValueError(
                f"a request generates one sample, got n={params.n}: LLM.generate and the server run n "
                "samples as n requests (SamplingParams.for_sample)"
            )
        limit = self.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt is {len(prompt_ids)} tokens, but the context (max_model_len={limit}) "
                "must also leave room for at least one generated token"
            )
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab}")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is out of range for a vocabulary of {vocab}")
        self._token_constraints(params)
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)  # kept compiled for add_request
        if params.thinking_token_budget is not None:
            self._grammars.budget_reasoning()
        if params.logits_processors and not self._runner.samples_on_host:
            raise ValueError(
                "logits_processors run on the host, but this runner samples on the device; "
                "set OXIBONSAI_DEVICE_SAMPLING=0 or use the native runner"
            )
        room = limit - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if self._blocks_for(len(prompt_ids) + max_new) > self.num_blocks:
            raise ValueError(
                f"the request needs {self._blocks_for(len(prompt_ids) + max_new)} KV blocks but the cache "
                f"has {self.num_blocks}; raise kv_cache_blocks or lower max_tokens"
            )
        return max_new

    def _token_constraints(self, params: SamplingParams) -> tuple[np.ndarray | None, BadWords | None]:
        """The request's ``allowed_token_ids`` mask and ``bad_words`` bans; ValueError if an id is out
        of the vocabulary or the bad words ban every allowed id."""
        vocab = self.vocab_size
        allowed = params.allowed_token_ids
        if allowed is not None and allowed[-1] >= vocab:
            raise ValueError(
                f"allowed_token_ids id {allowed[-1]} is out of range for a vocabulary of {vocab}"
            )
        bad_words = BadWords.of(params.bad_words, self._tokenizer) if params.bad_words else None
        if bad_words is not None:
            bad = next((t for t in bad_words.token_ids() if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"bad_words token id {bad} is out of range for a vocabulary of {vocab}")
            if allowed is not None and set(allowed) <= set(bad_words.always):
                raise ValueError("bad_words ban every id of allowed_token_ids: no token could be sampled")
        return (None if allowed is None else allowed_mask(allowed, vocab)), bad_words

    def _thinking_budget(self, params: SamplingParams, prompt_ids: list[int]) -> ThinkingBudget | None:
        if params.thinking_token_budget is None:
            return None
        reasoning = self._grammars.budget_reasoning()
        return ThinkingBudget(
            reasoning,
            params.thinking_token_budget,
            opened=reasoning.opened_by(prompt_ids),
            vocab_size=self.vocab_size,
        )

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compiles ``spec`` into the grammar cache (thread-safe); ValueError if it does not compile."""
        self._grammars.prepare(spec)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return self._sched.num_waiting

    @property
    def num_running(self) -> int:
        return self._sched.num_running

    def refresh_gauges(self) -> None:
        """Sets the metrics' gauges: running and waiting requests, KV blocks in use, prefix hit rate."""
        cache = self._runner.cache_stats()
        self.metrics.set_gauges(
            num_requests_running=self.num_running,
            num_requests_waiting=self.num_waiting,
            kv_blocks_used=cache["capacity_blocks"] - cache["free_blocks"] - cache["idle_blocks"],
            prefix_cache_hit_rate=cache["hit_rate"],
        )

    def available_blocks(self) -> int:
        """KV blocks a step or a sequence outside the scheduler can take now: free or evictable."""
        cache = self._runner.cache_stats()
        return int(cache["free_blocks"] + cache["idle_blocks"])

    def take_error(self, request_id: str) -> BaseException | None:
        """The error that ended a finished request (its logits processor raised), once; else None."""
        return self._errors.pop(request_id, None)

    def scheduler_stats(self) -> dict[str, int]:
        """The scheduler's counters: steps, admitted, preemptions, finished, aborted, tokens."""
        return cast(dict[str, int], dict(self._sched.stats()))

    def has_started(self, request_id: str) -> bool:
        """Whether the request has sampled a token (its prompt is computed, and its full blocks are in
        the prefix cache) or has ended."""
        handle = self._handles.get(request_id)
        return handle is None or bool(self._requests[handle].output_ids)

    def abort(self, request_id: str) -> bool:
        """Drops a waiting or running request and frees its KV blocks; False if it is unknown."""
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        self._finish(self._requests[handle], "abort")
        self._settle_if_idle()
        return True

    def abort_all(self) -> None:
        for r in list(self._requests.values()):
            self._finish(r, "abort")
        self._settle_if_idle()

    def _settle_if_idle(self) -> None:
        """Once no request is left, takes a step still in flight (its draws all dropped) and forgets a
        failed launch: the scheduler records the step (its tier copies complete, so no block stays
        held) now rather than at a next call that may never come. A step that fails now is dropped,
        as the step after it would have been."""
        if self._requests:
            return
        self._launch_error = None
        launched, self._launched = self._launched, None
        if launched is None:
            return
        plan, _, pending = launched
        try:
            self._sched.update(plan, [token for token, _, _ in pending.draws()])
        except Exception:  # nothing is left that it could affect; the next step is planned afresh
            pass

    def step(self) -> list[RequestOutput]:
        """Runs one step and takes its tokens; returns the outputs of requests that finished and of
        streamed ones (a snapshot copies the output so far, so others are not copied).

        Taking a token has two halves: appending it and deciding whether its request ends (a stop
        token or the length; with stop strings, whose text is needed to tell, all of the second half
        too), then the output work (text, logprobs, snapshots). Where the runner's ``launch`` returns
        before the device has run the step (``async_output``), the next step is launched between the
        halves, so the device computes it while the host does this step's output work; the requests
        that ended are out of it, so it computes nothing that is thrown away. A request added after
        that then starts a step later, and a failure of that launch is raised by the next call (or
        forgotten, with the step in flight taken, once the last request is aborted).

        Where the runner takes a ``Feed`` (``async_scheduling``), the next step is even launched before
        this one's tokens are waited for, when it is one decode of every running request
        (``_launch_ahead``): the device then goes from one step to the next without waiting for the
        host, a request that this step's token ends has computed one more token, which is dropped, and
        a waiting request that the slot of a request ending now lets start starts a step later."""
        if self._launch_error is not None:
            error, self._launch_error = self._launch_error, None
            raise error
        launched = self._launched or self._launch()
        self._launched = None
        if launched is None:
            return []
        plan, sampling, pending = launched
        # A failure to read the draws drops a step launched ahead with them (the caller aborts).
        ahead = self._launch_ahead(launched) if self._runner.async_scheduling else None
        draws = pending.draws()
        if isinstance(pending, DraftedDraws):
            return self._take_drafted(plan, sampling, pending, draws)
        self._sched.update(plan, [token for token, _, _ in draws])
        self._take_prompt_scores()
        failed = [self._fail(r, draw.error) for r, draw in zip(sampling, draws, strict=True)
                  if isinstance(draw, FailedDraw) and r.finish_reason is None]  # fmt: skip
        # Requests aborted while the step ran (between two calls), or ended by the step before it when
        # it was launched ahead, are gone: their draws are dropped (and not counted as generated).
        taken = [(r, draw, self._take(r, draw)) for r, draw in zip(sampling, draws, strict=True)
                 if r.finish_reason is None]  # fmt: skip
        self.metrics.on_step(plan.num_prefill_tokens, len(taken), len(plan.preempted))
        if ahead is not None:
            self._launched = ahead
        elif self._runner.async_output:
            try:
                self._launched = self._launch()
            except Exception as error:  # this step's outputs still go out; the error with the next
                self._launch_error = error
        outputs = failed
        for r, draw, text_left in taken:
            if text_left:
                self._finish_output(r, *draw)
            if r.streamed or r.finish_reason is not None:
                outputs.append(r.snapshot())
        return outputs

    def _take_drafted(
        self, plan: _core.SchedulerOutput, sampling: list[_Request], step: DraftedDraws, draws: list[Draw]
    ) -> list[RequestOutput]:
        """``step``'s second half for a step with drafts (speculative decoding, native runner only):
        each request's draws taken in order, draft after draft while they agree (``verify``), then
        the step recorded with the drafts kept."""
        failed: list[RequestOutput] = []
        gone: set[int] = set()  # the requests whose logits processor raised

        def take(r: _Request, draw: Draw) -> bool:
            if isinstance(draw, FailedDraw):
                failed.append(self._fail(r, draw.error))
                gone.add(r.handle)
                return False
            if self._take(r, draw):
                self._finish_output(r, *draw)
            return True

        running = [r.finish_reason is None for r in sampling]
        tokens = verify(sampling, step, draws, take, self._sample_row)
        accepted = [len(t) - 1 for t in tokens]
        self._sched.update(plan, [t for ts in tokens for t in ts], accepted)
        self._take_prompt_scores()
        taken = [r for r, ran in zip(sampling, running, strict=True) if ran]
        generated = sum(len(t) for t, ran in zip(tokens, running, strict=True) if ran)
        self.metrics.on_step(plan.num_prefill_tokens, generated, len(plan.preempted))
        self.metrics.on_drafts(
            [(len(d), a) for d, a, ran in zip(step.drafts, accepted, running, strict=True) if ran and d]
        )
        report = [r for r in taken if (r.streamed or r.finish_reason is not None) and r.handle not in gone]
        return failed + [r.snapshot() for r in report]

    def _launch(self) -> _Launched | None:
        """Schedules the next step and has the runner start it; None when there is nothing to run."""
        if not self._requests:
            return None
        plan = self._sched.schedule()
        if not len(plan):
            return None
        now = time.perf_counter()
        sampling = []
        for handle, _, sample in plan.items:
            r = self._requests[handle]
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
                state = self._sched.request_state(handle)
                r.num_cached_tokens = state[1] if state is not None else 0
            if sample:
                sampling.append(r)
        pending = self._runner.launch(self._sched, plan, [self._sample_row(r) for r in sampling])
        return plan, sampling, pending

    def _launch_ahead(self, launched: _Launched) -> _Launched | None:
        """The step after ``launched``, planned and launched before ``launched``'s tokens are known, if
        it is one decode of each running request of the token it samples in ``launched``
        (``Scheduler.schedule_ahead``; those whose length that token reaches are left out); None
        otherwise. The runner feeds each row its request's token from ``launched``'s draws on its
        device (and the penalties count it there)."""
        plan, sampling, pending = launched
        if any(_follows_output(r) for r in sampling):
            return None  # the next row needs the token in flight
        ending = [
            r.handle for r in sampling if r.finish_reason is None and len(r.output_ids) + 1 >= r.max_new
        ]
        out = self._sched.schedule_ahead(plan, ending)
        if out is None:
            return None
        row_of = {r.handle: i for i, r in enumerate(sampling)}
        ahead = [self._requests[handle] for handle, _, _ in out.items]
        rows = [self._sample_row(r, pending=1) for r in ahead]  # min_tokens counts the token in flight
        feed = Feed(pending, [row_of[r.handle] for r in ahead])
        return out, ahead, self._runner.launch(self._sched, out, rows, feed)

    def _take_prompt_scores(self) -> None:
        """Records the prompt logprobs the runner scored, by position; a position scored again (its
        prefill was preempted and recomputed) keeps its first score."""
        for key, start, scores in self._runner.take_prompt_logprobs():
            r = self._requests.get(key)
            if r is None or r.prompt_scored is None:
                continue  # ended since
            for pos, (logprob, rank, top) in enumerate(scores, start + 1):
                if pos not in r.prompt_scored:
                    r.prompt_scored[pos] = self._logprob_entry(r.prompt_ids[pos], logprob, rank, top)

    def _logprob_entry(
        self, token: int, logprob: float, rank: int | None, top: list[tuple[int, float]]
    ) -> dict[int, Logprob]:
        """The top logprobs (ranked 1..) and ``token``'s own, each with its text."""
        decode = self._tokenizer.decode
        entry = {
            t: Logprob(lp, i, decode([t], skip_special_tokens=False)) for i, (t, lp) in enumerate(top, 1)
        }
        if token not in entry:
            entry[token] = Logprob(logprob, rank, decode([token], skip_special_tokens=False))
        return entry

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _banned(self, r: _Request, pending: int) -> list[int]:
        if len(r.output_ids) + pending >= r.params.min_tokens:
            return []
        return sorted(self._tokenizer.stop_token_ids | set(r.params.stop_token_ids or []))

    def _sample_row(self, r: _Request, pending: int = 0) -> SampleRow:
        """The request's sampling row, for its token after ``pending`` ones it has sampled but not
        taken yet (1 in a step launched ahead); one kept for every step while its bans and mask stay
        the same (its histories are the request's own lists, which grow in place). Bans yield where
        they would leave its mask no id: to a grammar that allows only stop ids before ``min_tokens``,
        or ``allowed_token_ids`` that a bad word's ban would empty. A request whose thinking budget
        is spent gets a row that allows the reasoning end token alone."""
        if r.budget is not None and r.budget.forcing:
            return _new_row(r, [], r.budget.end_only())
        banned = self._banned(r, pending)
        follows_output = r.grammar is not None or _bans_follow_output(r)
        static = r.bad_words.always if r.bad_words is not None else []
        if not follows_output and not banned:
            if r.row is None:
                r.row = _new_row(r, static, r.allowed)
            return r.row
        if r.bad_words is not None:
            banned = sorted(set(banned).union(r.bad_words.banned_after(r.output_ids)))
        mask = both(r.allowed, r.grammar.mask()) if r.grammar is not None else r.allowed
        if mask is not None and banned and not leaves_a_token(mask, banned):
            banned = []
        return _new_row(r, banned, mask)

    def _take(self, r: _Request, draw: Draw) -> bool:
        """Appends a sampled token and decides whether its request ends: on a stop token or at its
        length, or, for a request watching for stop strings, on one (its output is then done at once);
        returns whether the output work (``_finish_output``) is left to do."""
        if r.stops.watching:
            self._accept(r, *draw)
            return False
        token = draw[0]
        self._append(r, token)
        if self._stops_on_token(r, token):
            self._finish(r, "stop")
        elif r.grammar is not None and r.grammar.done:
            self._finish(r, "stop")
        elif len(r.output_ids) >= r.max_new:
            self._finish(r, "length")
        return True

    def _finish_output(
        self, r: _Request, token: int, logprob: float | None, top: list[tuple[int, float]]
    ) -> None:
        """The rest of taking a token ``_take`` left: its logprobs and text (none for a stop token),
        and the text held back from a request that just ended. No stop strings are watched here."""
        self._record_logprobs(r, token, logprob, top)
        if not r.ended_on_stop_token:
            r.text_buffer.append(r.detok.add(token))
        if r.finish_reason is not None:
            r.text_buffer.append(r.detok.finish())

    def _append(self, r: _Request, token: int) -> None:
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = time.perf_counter()
        r.output_ids.append(token)
        r.metrics.num_generated_tokens = len(r.output_ids)
        if r.budget is not None:
            r.budget.accept(token)
        if r.grammar is not None and not self._is_stop_id(r, token):
            r.grammar.accept((token,))

    def _accept(self, r: _Request, token: int, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """Appends a sampled token and finishes the request on a stop token, stop string or length."""
        self._append(r, token)
        self._record_logprobs(r, token, logprob, top)
        if self._stops_on_token(r, token):
            self._finish(r, "stop", flush=True)
            return
        emitted, stopped = r.stops.feed(r.detok.add(token))
        r.text_buffer.append(emitted)
        if stopped:
            r.stop_reason = r.stops.matched
            self._finish(r, "stop")
        elif r.grammar is not None and r.grammar.done:
            self._finish(r, "stop", flush=True)
        elif len(r.output_ids) >= r.max_new:
            self._finish(r, "length", flush=True)

    def _stops_on_token(self, r: _Request, token: int) -> bool:
        """Whether ``token`` ends the request (its stop ids, or the tokenizer's unless ``ignore_eos``);
        if so, records its ``stop_reason`` (None for the tokenizer's)."""
        if not self._is_stop_id(r, token):
            return False
        own = token in (r.params.stop_token_ids or []) and token not in self._tokenizer.stop_token_ids
        r.stop_reason = token if own else None
        r.ended_on_stop_token = True
        return True

    def _is_stop_id(self, r: _Request, token: int) -> bool:
        """Whether ``token`` is one of the request's stop ids, or the tokenizer's unless ``ignore_eos``."""
        if token in (r.params.stop_token_ids or []):
            return True
        return not r.params.ignore_eos and token in self._tokenizer.stop_token_ids

    def _record_logprobs(
        self, r: _Request, token: int, logprob: float | None, top: list[tuple[int, float]]
    ) -> None:
        if r.logprobs is None:
            return
        assert logprob is not None, "the sampler computes logprobs whenever the request asks for them"
        r.cumulative_logprob += logprob
        r.logprobs.append(self._logprob_entry(token, logprob, None, top))

    def _fail(self, r: _Request, error: BaseException) -> RequestOutput:
        """Ends a request whose logits processor raised (``"abort"``), keeping the error for its caller."""
        self._errors[r.request_id] = error
        self._finish(r, "abort")
        return r.snapshot()

    def _finish(self, r: _Request, reason: str, *, flush: bool = False) -> None:
        if flush:
            # Generation ended for another reason: emit held-back bytes and text (decode's U+FFFD for
            # an unfinished character included), unless they complete a stop string.
            emitted, stopped = r.stops.feed(r.detok.finish())
            r.text_buffer.append(emitted if stopped else emitted + r.stops.flush())
        r.finish_reason = reason
        r.metrics.finished_time = time.perf_counter()
        self.metrics.on_request_finished(r.metrics, reason)
        self._runner.forget(r.handle)
        if reason == "abort":
            self._sched.abort(r.handle)
        else:
            self._sched.finish(r.handle)
        del self._requests[r.handle]
        del self._handles[r.request_id]


def _bans_follow_output(r: _Request) -> bool:
    """Whether the request's bans depend on its last tokens (a bad word of two or more tokens)."""
    return r.bad_words is not None and r.bad_words.depends_on_output


def _follows_output(r: _Request) -> bool:
    """Whether the request's next row depends on the token in flight: a grammar's mask, a bad word's
    ban, or a thinking budget that may force ``</think>``. (Logits processors read the output too, but
    they run only where steps are never planned ahead: host sampling.)"""
    budget = r.budget is not None and r.budget.watching
    return r.grammar is not None or _bans_follow_output(r) or budget


def _new_row(r: _Request, banned: list[int], allowed: np.ndarray | None = None) -> SampleRow:
    return SampleRow(
        r.params, r.seed, r.sampler, r.prompt_ids, r.output_ids, banned, r.handle, r.plain_greedy, allowed
    )

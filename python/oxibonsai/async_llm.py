"""``AsyncLLM``: the engine's step loop on a background thread, with one asyncio stream per request.

It owns the thread, the lock and the hand-off of outputs to asyncio; loading, tokenizing and scheduling
stay in the ``LLM`` it builds and that ``LLM``'s engine. Every engine call happens under one lock, which
the step loop holds for one step at a time (the native step releases the GIL). ``generate`` never
waits for that lock, since a step can take a second and the caller is usually an event loop serving
other streams: it validates the request against the engine's constants, checks the waiting limit
(``max_waiting``, which ``AsyncLLM`` enforces itself: queued submissions plus the engine's waiting
requests) and puts the request in an inbox that the loop moves into the engine before its next step. So
a submission error (``ValueError``, ``QueueFull``) still reaches the caller of ``generate`` before
anything is queued. After a step the loop hands each request's output to its event loop with
``call_soon_threadsafe``; it never calls back into user code and never busy-waits (it sleeps on a
condition while there is no work).
A consumer that stops listening (``break``, ``aclose``, cancellation) aborts its request, which frees
its KV blocks. A failing step ends the engine: every waiting consumer gets ``EngineDeadError``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from oxibonsai._core import OxiBonsaiError, QueueFull
from oxibonsai.async_beam_search import AsyncEngineBeams
from oxibonsai.async_jobs import LoopJob
from oxibonsai.async_samples import SampleGroupStream
from oxibonsai.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    check_fits,
    native_beam_steps,
)
from oxibonsai.llm import LLM, Message, PromptType, _cache_salt
from oxibonsai.metrics import EngineMetrics
from oxibonsai.outputs import CompletionOutput, EmbeddingRequestOutput, RequestMetrics, RequestOutput
from oxibonsai.runner import NativeRunner
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.tokenizer import Tokenizer


class EngineDeadError(OxiBonsaiError):
    """The step loop failed (the cause is chained) or the engine was shut down; it takes no requests."""


_ABORTED = object()  # mailbox item: the request was aborted by someone other than its consumer


@dataclasses.dataclass(frozen=True)
class _Submission:
    """A validated request waiting in the inbox for the step loop to move it into the engine."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int
    arrival_time: float


class _Mailbox:
    """The engine thread's side of one stream: puts items on the consumer's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: object) -> bool:
        """False when the consumer's event loop is closed (nobody will ever read)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class RequestStream:
    """The async iterator ``AsyncLLM.generate`` returns: one cumulative ``RequestOutput`` per step, the
    last one finished (``finish_reason`` ``"abort"`` if the request was aborted or the engine shut
    down). Leaving it early (``break``, ``aclose()``, cancelling the task) aborts the request."""

    def __init__(self, owner: AsyncLLM, request_id: str, mailbox: _Mailbox, first: RequestOutput) -> None:
        self.request_id = request_id
        self._owner = owner
        self._mailbox = mailbox
        self._last = first  # what the consumer has seen; the base of a final "abort" output
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    @property
    def done(self) -> bool:
        """Whether the last output was delivered or the stream was closed."""
        return self._done

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._mailbox.queue.get()
        except BaseException:  # cancelled while waiting: nobody will read the rest
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        out: RequestOutput = _aborted(self._last) if item is _ABORTED else item
        self._last = out
        self._done = out.finished
        return out

    async def aclose(self) -> None:
        """Stops listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            self._owner._drop(self.request_id)

    def __del__(self) -> None:
        # Left without aclose (``break`` out of ``async for``). A finalizer may run on any thread, even
        # one inside an engine call, so it only leaves a note for the step loop.
        if not getattr(self, "_done", True):
            self._owner._dropped.append(self.request_id)


def _aborted(last: RequestOutput) -> RequestOutput:
    completion = dataclasses.replace(last.outputs[0], finish_reason="abort", stop_reason=None)
    return dataclasses.replace(last, outputs=[completion], finished=True)


class AsyncLLM:
    """An ``LLM`` served from a background thread to asyncio code; safe to use from any thread.

    Takes ``LLM``'s arguments (``model``, ``max_model_len``, ``max_num_seqs``, ``kv_cache_bytes``,
    ``enable_prefix_caching``, ``seed``, ...). ``generate`` must be called from a running event loop.
    Use it as ``async with AsyncLLM(...) as engine:`` or call ``shutdown()``; a forgotten engine keeps
    its (daemon) thread until the interpreter exits."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **engine_args: Any) -> None:
        self._max_waiting: int | None = engine_args.pop("max_waiting", None)
        if self._max_waiting is not None and self._max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self._max_waiting}")
        self._llm = LLM(model, **engine_args)
        self._engine = self._llm._engine
        self._lock = threading.Lock()  # every engine call; held by the loop for a whole step
        self._wake = threading.Condition(self._lock)
        self._work = threading.Condition()  # the idle loop sleeps here; submitters notify without waiting
        self._inbox: deque[_Submission] = deque()  # guarded by _work's lock
        self._waiting_after_step = 0  # the engine's waiting requests when the loop last looked
        self._control_waiting = 0  # callers waiting for the lock; the loop lets them go first
        self._mailboxes: dict[str, _Mailbox] = {}
        self._dropped: deque[str] = deque()  # appended by finalizers without the lock
        self._jobs: deque[LoopJob] = deque()  # appended under _work's lock, run by the loop
        self._jobs_waited = 0  # turns in a row in which a job found no room for its piece
        self._dead: BaseException | None = None
        self._closed = False
        self._metrics: EngineMetrics = self._engine.metrics
        self._thread = threading.Thread(target=self._run, name="oxibonsai-step-loop", daemon=True)
        self._thread.start()

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        """The sampling fields the model recommends (``LLM.default_sampling_fields``)."""
        return self._llm.default_sampling_fields

    def get_default_sampling_params(self) -> SamplingParams:
        return self._llm.get_default_sampling_params()

    # -- requests ---------------------------------------------------------------------------------

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream | SampleGroupStream:
        """Submits one prompt (a string, token ids, or a prompt dict as in ``LLM.generate``) and returns
        its stream: ``async for out in engine.generate(...)``. Raises at once, with nothing queued, on
        invalid arguments (``TypeError``, ``ValueError``), a full queue (``QueueFull``), a duplicate
        ``request_id``, or an engine that is shut down or failed (``EngineDeadError``). With
        ``n > 1`` the stream is a ``SampleGroupStream``: each output holds all ``n`` completions so far
        (the later samples start from the first one's cached prompt, ``oxibonsai.async_samples``)."""
        params = self._llm.get_default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n > 1:
            return self._generate_samples(prompt, params, request_id, priority)
        loop = asyncio.get_running_loop()
        arrival = time.perf_counter()
        text, ids = self._llm._tokenize(prompt)
        ids = params.truncated_prompt(ids, self._engine.max_model_len)
        salt = _cache_salt(prompt)
        self._engine.check_prompt(ids, params)  # the engine's constants only: no lock needed
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        mailbox = _Mailbox(loop)
        with self._work:
            self._check_alive()
            if rid in self._mailboxes:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._check_room()
            self._inbox.append(_Submission(rid, text, ids, params, salt, priority, arrival))
            self._mailboxes[rid] = mailbox
            self._work.notify()
        return RequestStream(self, rid, mailbox, _empty_output(rid, text, ids))

    def _generate_samples(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None, priority: int
    ) -> SampleGroupStream:
        rid = uuid.uuid4().hex if request_id is None else str(request_id)

        def submit(i: int) -> RequestStream:
            return self.generate(prompt, params.for_sample(i), request_id=f"{rid}-{i}", priority=priority)

        return SampleGroupStream(submit, params, submit(0), rid)

    def prepare_structured_output(self, params: SamplingParams) -> None:
        """Compiles the grammar of ``params.structured_outputs`` into the engine's cache, so that
        ``generate`` (which compiles it on the caller's thread, an event loop's) finds it compiled; a
        server calls it in a worker thread first. ValueError for one that does not compile."""
        if params.structured_outputs is not None:
            self._engine.compile_grammar(params.structured_outputs)

    def abort(self, request_id: str) -> bool:
        """Aborts a waiting or running request (its stream ends with a ``"abort"`` output) and frees
        its KV blocks; False if no such request is in the engine."""
        with self._control():
            found = self._abort_locked(request_id)
            mailbox = self._mailboxes.pop(request_id, None)
        if mailbox is not None:
            mailbox.put(_ABORTED)
        return found

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """The engine lock for anyone but the step loop (abort, metrics, shutdown...), with priority:
        the loop does not start another step while a caller waits, so a caller waits for at most the
        step that is running, never for a stream of them (threading.Lock is not fair). Applies the
        aborts left by consumers first."""
        with self._work:
            self._control_waiting += 1
        try:
            with self._lock:
                with self._work:
                    self._control_waiting -= 1
                self._apply_drops_locked()
                yield
        finally:
            with self._work:
                self._work.notify_all()

    def _drop(self, request_id: str) -> None:
        """A consumer stopped listening: abort without telling it. Never waits for a running step: if
        one holds the lock, the abort is left for the loop, which applies it before its next step (and
        so does anyone else who takes the lock first, so no reader sees the request as still alive)."""
        self._mailboxes.pop(request_id, None)
        if self._lock.acquire(blocking=False):
            try:
                self._abort_locked(request_id)
            finally:
                self._lock.release()
            return
        self._dropped.append(request_id)
        with self._work:
            self._work.notify()

    def _apply_drops_locked(self) -> None:
        while self._dropped:
            rid = self._dropped.popleft()
            self._mailboxes.pop(rid, None)
            self._abort_locked(rid)

    def _abort_locked(self, request_id: str) -> bool:
        with self._work:
            queued = next((s for s in self._inbox if s.request_id == request_id), None)
            if queued is not None:
                self._inbox.remove(queued)
                return True
        if self._dead is not None or not self._engine.abort(request_id):
            return False
        self._waiting_after_step = self._engine.num_waiting  # no step may come to recount it
        return True

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine's step loop failed") from self._dead
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    # -- the step loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while self._step_once():
            pass

    def _step_once(self) -> bool:
        """Waits for work, runs one step and delivers its outputs; False when the loop must end."""
        with self._work:
            while not self._closed and (self._control_waiting or not self._has_work()):
                self._work.wait()
        with self._lock:
            if self._closed:
                return False
            self._apply_drops_locked()
            try:
                self._admit_inbox()
                self._deliver(self._engine.step() if self._engine.has_unfinished() else [])
                self._waiting_after_step = self._engine.num_waiting
            except BaseException as error:  # delivered to every consumer, not swallowed
                self._fail(error)
                return False
            self._advance_job()
        return True

    def _has_work(self) -> bool:
        return bool(self._engine.has_unfinished() or self._dropped or self._inbox or self._jobs)

    def _advance_job(self) -> None:
        """One piece of the job at the front, after the step, which then goes to the back (jobs take
        turns); a job's error is its caller's only."""
        while self._jobs and self._jobs[0].cancelled:
            self._jobs.popleft().close()
            self._jobs_waited = 0  # its blocks are free now
        if not self._jobs:
            return
        job = self._jobs.popleft()
        # Every other job waited its turn since a piece last ran: none of them will free blocks.
        others_stuck = self._jobs_waited >= len(self._jobs)
        pieces = job.pieces_run
        try:
            done = job.advance(
                self._engine.available_blocks(),
                nothing_frees_blocks=self._engine.num_running == 0 and others_stuck,
            )
        except Exception as error:
            self._jobs_waited = 0  # its blocks are free now
            job.fail(error)
            return
        self._jobs_waited = self._jobs_waited + 1 if job.pieces_run == pieces and not done else 0
        if done:
            job.resolve()
        else:
            self._jobs.append(job)

    def _fail_jobs(self, error: BaseException) -> None:
        while self._jobs:
            self._jobs.popleft().fail(error)

    def _check_room(self) -> None:
        """QueueFull when ``max_waiting`` requests (or loop jobs, which count as requests) wait;
        call under ``_work``'s lock."""
        waiting = self._waiting_after_step + len(self._inbox) + len(self._jobs)
        if self._max_waiting is not None and waiting >= self._max_waiting:
            raise QueueFull(f"{waiting} requests are waiting (max_waiting={self._max_waiting})")

    async def _run_job(self, job: LoopJob) -> list[Any]:
        """Queues ``job`` for the step loop (QueueFull and EngineDeadError before its first wait) and
        waits for its results; cancelling drops it (the loop closes it before its next piece)."""
        with self._work:
            self._check_alive()
            self._check_room()
            self._jobs.append(job)
            self._work.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            with self._work:
                self._work.notify()
            raise

    def _admit_inbox(self) -> None:
        """Moves the submitted requests into the engine, in arrival order."""
        with self._work:
            batch = list(self._inbox)
            self._inbox.clear()
            self._waiting_after_step += len(batch)  # until the step's own count replaces it
        for sub in batch:
            try:
                self._engine.add_request(
                    sub.request_id, sub.prompt, sub.token_ids, sub.params, stream=True,
                    cache_salt=sub.cache_salt, priority=sub.priority, arrival_time=sub.arrival_time,
                )  # fmt: skip
            except Exception as error:  # validated at submission; reported to its consumer if not
                mailbox = self._mailboxes.pop(sub.request_id, None)
                if mailbox is not None:
                    mailbox.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            error = self._engine.take_error(out.request_id) if out.finished else None
            mailbox = self._mailboxes.get(out.request_id)
            if mailbox is None:
                continue
            if out.finished:
                del self._mailboxes[out.request_id]
            if not mailbox.put(out if error is None else error):  # its event loop is gone
                self._mailboxes.pop(out.request_id, None)
                self._abort_locked(out.request_id)

    def _fail(self, error: BaseException) -> None:
        self._dead = error
        with self._work:
            self._inbox.clear()
        try:
            self._engine.abort_all()
        except Exception:  # the engine is already broken; the consumers hear about the first error
            pass
        dead = EngineDeadError(f"the engine's step loop failed: {error!r}")
        dead.__cause__ = error
        for mailbox in self._mailboxes.values():
            mailbox.put(dead)
        self._mailboxes.clear()
        self._fail_jobs(dead)

    # -- lifecycle --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Aborts every request (their streams end with an ``"abort"`` output), stops the step loop
        and waits for its thread. Idempotent."""
        with self._control():
            if not self._closed:
                with self._work:
                    self._closed = True
                    self._inbox.clear()
                    self._work.notify_all()
                if self._dead is None:
                    self._engine.abort_all()
                for mailbox in self._mailboxes.values():
                    mailbox.put(_ABORTED)
                self._mailboxes.clear()
                self._fail_jobs(EngineDeadError("the engine is shut down"))
                self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    @property
    def is_running(self) -> bool:
        """Whether the step loop is alive (not shut down, not failed). False from the moment a step
        fails or shutdown begins, before the thread has ended: a consumer that got
        ``EngineDeadError`` never sees the engine as running."""
        return self._dead is None and not self._closed and self._thread.is_alive()

    # -- state and helpers ------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """The engine metrics (``EngineMetrics.snapshot()``) plus ``num_running`` and ``num_waiting``."""
        with self._control():
            running, waiting = self._engine.num_running, self._engine.num_waiting + len(self._inbox)
            self._engine.refresh_gauges()
            snapshot = self._metrics.snapshot()
        return {**snapshot, "num_running": running, "num_waiting": waiting}

    def prometheus_metrics(self, prefix: str = "oxibonsai") -> str:
        """The metrics in Prometheus' text format, for a ``/metrics`` endpoint."""
        self.metrics()  # refreshes the queue gauges
        return self._metrics.to_prometheus(prefix)

    async def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (``self.tokenizer``), awaited as vLLM's ``AsyncLLM.get_tokenizer``."""
        return self._llm.tokenizer

    @property
    def tokenizer(self) -> Tokenizer:
        return self._llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    @property
    def model_name(self) -> str:
        """The GGUF's ``general.name``, else its file name without the extension."""
        return self._llm.model_name

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the prefix cache shares whole blocks)."""
        return self._llm.block_size

    def chat_prompt(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> dict[str, Any]:
        """A conversation as a prompt dict for ``generate`` (see ``LLM.chat_prompt``)."""
        return self._llm.chat_prompt(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    async def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling: str | None = None,
        normalize: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """``LLM.embed`` run by the step loop a chunk at a time (``max_num_batched_tokens`` tokens of
        one prompt between two engine steps, ``async_jobs``), so running requests keep decoding; the
        same vectors as ``LLM.embed``. Invalid prompts raise before any work; cancelling the call
        drops the job and frees its blocks."""
        inputs = self._llm._embedding_inputs
        pooling, prompt_ids = await asyncio.to_thread(inputs, prompts, pooling, truncate_prompt_tokens)
        engine = self._engine
        chunk = engine.config.batched_tokens(engine.max_model_len)
        steps = [self._llm._embedding_steps(ids, pooling, normalize, chunk) for ids in prompt_ids]
        return await self._run_job(LoopJob(asyncio.get_running_loop(), steps, "embedding prompt"))

    async def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[BeamSearchOutput]:
        """``LLM.beam_search``, the same beams, batched with whatever else runs. On the native runner
        the step loop runs it a piece at a time between engine steps, as ``embed`` (``async_jobs``:
        prompt chunks of ``max_num_batched_tokens``, then one batched decode of the live beams, on
        forked KV sequences); elsewhere its steps are concurrent one-token requests of this engine
        (``async_beam_search``, vLLM's server form). Before its first wait it raises ``ValueError`` for
        a prompt whose beams could outgrow the context, ``QueueFull`` where ``max_waiting`` requests
        wait, ``EngineDeadError`` for an engine shut down or failed; cancelling the call frees what it
        holds."""
        batch = self._llm._prompt_list(prompts)
        token_lists = [self._llm._tokenize(p)[1] for p in batch]
        check_fits(token_lists, params, self.max_model_len)
        stop_ids, decode = set(self.tokenizer.stop_token_ids), self.tokenizer.decode
        salts = [_cache_salt(p) for p in batch]
        runner = self._llm._runner
        if isinstance(runner, NativeRunner):
            chunk = self._engine.config.batched_tokens(self._engine.max_model_len)
            steps = native_beam_steps(
                runner._model, token_lists, params, stop_ids, decode, salts=salts, chunk_tokens=chunk
            )
            (outputs,) = await self._run_job(LoopJob(asyncio.get_running_loop(), [steps], "beam search"))
            return outputs  # type: ignore[no-any-return]
        search = BeamSearch(token_lists, params, stop_ids, decode)
        beams = AsyncEngineBeams(self.generate, search, salts, request_id=request_id, priority=priority)
        await beams.run()
        return search.outputs()

    def cache_stats(self) -> dict[str, Any]:
        with self._control():
            return self._llm.cache_stats()

    def reset_prefix_cache(self) -> int:
        with self._control():
            return self._llm.reset_prefix_cache()

    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """``LLM.save_prefix_cache`` between two steps (blocks being filled are not cached yet)."""
        with self._control():
            return self._llm.save_prefix_cache(path)

    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """``LLM.load_prefix_cache`` between two steps."""
        with self._control():
            return self._llm.load_prefix_cache(path)


def _empty_output(request_id: str, prompt: str | None, ids: list[int]) -> RequestOutput:
    """What a request looks like before its first token (the base of an early "abort" output)."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=list(ids),
        outputs=[CompletionOutput(index=0, text="", token_ids=[])],
        finished=False,
        metrics=RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(ids)),
    )

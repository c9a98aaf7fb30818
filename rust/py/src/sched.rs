//! `Scheduler`: the continuous-batching scheduler over a `Model`'s KV cache (the engine's step:
//! `schedule`, `execute`, `update`), or over a model-free block table: a ledger for tests and
//! benchmarks (`execute` grows it), or the cache of a runner outside Rust (`prepare` hands it the
//! step as a `StepPlan`, tier copies included). `execute` releases the GIL for the forward pass.

use std::sync::Mutex;

use numpy::PyArray2;
use oxibonsai_core::kv::{SequenceTable, GENERATION_ROOM};
use oxibonsai_core::pool;
use oxibonsai_core::sched::{Policy, Scheduler as CoreScheduler, SchedulerConfig, SchedulerOutput as CoreOutput};
use oxibonsai_core::spec::NgramConfig;
use oxibonsai_core::Error;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::gil::without_gil;
use crate::logits;
use crate::model::Model;
use crate::plan::StepPlan;
use crate::prefix::stats_dict;
use crate::prompt_scores::{self, PromptScores};
use crate::token_ids::{token_ids, token_ids_with_room};

/// Where the scheduler's blocks live.
enum Backend {
    /// A model's KV cache: `execute` runs the forward pass.
    Model(Py<Model>),
    /// Block accounting alone: `execute` only grows the block tables.
    Ledger(Box<SequenceTable>),
}

struct State {
    sched: CoreScheduler,
    backend: Backend,
    /// The step `execute` last ran: `update` must record that one, or the blocks and the scheduler
    /// would disagree.
    executed: Option<u64>,
    /// The step `prepare` last planned (a table's runner computes it; `update` commits it).
    prepared: Option<u64>,
    /// A step planned ahead of `prepared` and prepared too: `update` of `prepared` makes it `prepared`.
    prepared_ahead: Option<u64>,
    /// The prompt logprobs `execute` scored and `take_prompt_logprobs` has not taken yet.
    prompt_scores: Vec<PromptScores>,
}

impl State {
    fn with_table<R>(&mut self, f: impl FnOnce(&mut CoreScheduler, &mut SequenceTable) -> R) -> R {
        match &mut self.backend {
            Backend::Ledger(table) => f(&mut self.sched, table),
            Backend::Model(model) => f(&mut self.sched, model.get().lock().table_mut()),
        }
    }
}

/// The continuous-batching scheduler (priorities with aging, chunked prefill, preemption).
#[pyclass(frozen, module = "oxibonsai._core")]
pub struct Scheduler {
    state: Mutex<State>,
}

/// One step's plan: `items` are `(request_id, num_tokens, sample)`.
#[pyclass(frozen, module = "oxibonsai._core")]
pub struct SchedulerOutput {
    inner: CoreOutput,
}

#[pymethods]
impl SchedulerOutput {
    #[getter]
    fn items(&self) -> Vec<(u64, usize, bool)> {
        self.inner.items.iter().map(|i| (i.request, i.num_tokens, i.sample)).collect()
    }

    #[getter]
    fn preempted(&self) -> Vec<u64> {
        self.inner.preempted.clone()
    }

    #[getter]
    fn num_batched_tokens(&self) -> usize {
        self.inner.num_batched_tokens()
    }

    /// Scheduled tokens that are not decodes (prompt chunks, recomputation after preemption).
    #[getter]
    fn num_prefill_tokens(&self) -> usize {
        self.inner.num_prefill_tokens
    }

    #[getter]
    fn num_sample(&self) -> usize {
        self.inner.num_sample()
    }

    /// Drafted tokens among the scheduled ones (speculative decoding).
    #[getter]
    fn num_draft_tokens(&self) -> usize {
        self.inner.num_draft_tokens
    }

    #[getter]
    fn step(&self) -> u64 {
        self.inner.step
    }

    fn __len__(&self) -> usize {
        self.inner.items.len()
    }
}

impl Scheduler {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[pymethods]
impl Scheduler {
    /// `kv`: a `Model` (scheduling over its KV cache) or a number of 16-token device blocks (a
    /// model-free table; `enable_prefix_caching`, `host_blocks` and `block_bytes` apply to it alone:
    /// `host_blocks` > 0 adds a host tier that idle cached blocks are demoted to). `policy`:
    /// 'priority' or 'longest_prefix'. `host_prefetch`: with a host tier, promote the host-tier
    /// prefixes of the requests next in line during the step before the one that starts them (the
    /// plan's `prefetch` copies). `speculation`: `(num_tokens, min_n, max_n, adaptive)`, n-gram
    /// drafting (prompt lookup) for the requests added with a `draft_limit`: each of their decodes
    /// also computes up to `num_tokens` tokens that followed an earlier occurrence of their last
    /// `min_n..=max_n` tokens, from what the step leaves (`adaptive`: only as many as the request's
    /// acceptance so far says pay for their rows); `drafts` names them and `update` takes how many
    /// each kept.
    #[new]
    #[pyo3(signature = (
        kv, *, max_num_seqs=8, max_num_batched_tokens=256, max_waiting=None, priority_aging_steps=256,
        enable_chunked_prefill=true, policy="priority", enable_prefix_caching=false, host_blocks=0,
        block_bytes=0, host_prefetch=true, speculation=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        kv: &Bound<'_, PyAny>,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_waiting: Option<usize>,
        priority_aging_steps: u64,
        enable_chunked_prefill: bool,
        policy: &str,
        enable_prefix_caching: bool,
        host_blocks: usize,
        block_bytes: usize,
        host_prefetch: bool,
        speculation: Option<(usize, usize, usize, bool)>,
    ) -> PyResult<Scheduler> {
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_waiting,
            priority_aging_steps,
            chunked_prefill: enable_chunked_prefill,
            policy: Policy::parse(policy).map_err(to_py)?,
            host_prefetch,
            speculation: speculation.map(|(num_tokens, min_n, max_n, adaptive)| NgramConfig {
                num_tokens,
                min_n,
                max_n,
                adaptive,
            }),
        };
        let sched = CoreScheduler::new(config).map_err(to_py)?;
        let backend = match kv.cast::<Model>() {
            Ok(model) => Backend::Model(model.clone().unbind()),
            Err(_) => {
                let blocks: usize = kv.extract()?;
                if blocks == 0 {
                    return Err(PyValueError::new_err("a ledger needs at least one block"));
                }
                let table = SequenceTable::with_host_tier(blocks, host_blocks, block_bytes, enable_prefix_caching);
                Backend::Ledger(Box::new(table))
            }
        };
        Ok(Scheduler {
            state: Mutex::new(State {
                sched,
                backend,
                executed: None,
                prepared: None,
                prepared_ahead: None,
                prompt_scores: Vec::new(),
            }),
        })
    }

    /// Queues a request. Raises `QueueFull` when `max_waiting` requests wait, `ValueError` for a
    /// known id or an empty prompt; nothing changes then. `prompt_logprobs`: score every prompt token
    /// with that many top logprobs (the request then starts without the prefix cache; `execute`
    /// scores them, `take_prompt_logprobs` hands them over, or a table's runner scores the rows
    /// `logit_rows` names).
    /// `draft_limit`: with `speculation`, the request may be drafted for, never past this many
    /// tokens (prompt and output).
    #[pyo3(signature = (request_id, prompt, *, priority=0, cache_salt=None, prompt_logprobs=None, draft_limit=None))]
    #[allow(clippy::too_many_arguments)]
    fn add(
        &self,
        request_id: u64,
        prompt: &Bound<'_, PyAny>,
        priority: i32,
        cache_salt: Option<String>,
        prompt_logprobs: Option<usize>,
        draft_limit: Option<usize>,
    ) -> PyResult<()> {
        let prompt = token_ids_with_room(prompt, GENERATION_ROOM)?;
        let mut state = self.lock();
        state.sched.add(request_id, prompt, priority, cache_salt).map_err(to_py)?;
        if let Some(top) = prompt_logprobs {
            state.sched.want_prompt_logprobs(request_id, top).map_err(to_py)?;
        }
        if let Some(limit) = draft_limit {
            state.sched.allow_drafts(request_id, limit).map_err(to_py)?;
        }
        Ok(())
    }

    /// The drafted tokens of `out`'s sampling items, in item order (empty for one without drafts):
    /// item `i`'s rows of `execute`'s logits are its token's, then one per draft.
    fn drafts(&self, out: &SchedulerOutput) -> Vec<Vec<u32>> {
        self.lock().sched.drafts_of(&out.inner).into_iter().map(<[u32]>::to_vec).collect()
    }

    /// The prompt scores of the steps executed since the last call: `(request_id, start, scores)`,
    /// where `scores[j]` is `(logprob, rank, [(id, logprob)] * top)` of prompt token `start + j + 1`
    /// (raw logprobs; rank 1 is the most likely). A request preempted in its prefill is scored again
    /// from its start.
    fn take_prompt_logprobs(&self) -> Vec<PromptScores> {
        std::mem::take(&mut self.lock().prompt_scores)
    }

    /// Where the logits rows of `out`'s step sit (before its `update`): the sampling rows in item
    /// order, and `(request_id, start, first_row, targets, top)` per run of prompt rows: row
    /// `first_row + j` scores prompt token `targets[j]` (position `start + j + 1`) with `top`
    /// logprobs. For a runner outside Rust, whose `logits_indices` return these rows.
    #[allow(clippy::type_complexity)]
    fn logit_rows(&self, out: &SchedulerOutput) -> (Vec<usize>, Vec<(u64, usize, usize, Vec<u32>, usize)>) {
        let rows = self.lock().sched.logit_rows(&out.inner);
        let prompt = rows.prompt.into_iter().map(|p| (p.request, p.start, p.first_row, p.targets, p.top)).collect();
        (rows.sample, prompt)
    }

    /// Plans the next step.
    fn schedule(&self) -> SchedulerOutput {
        SchedulerOutput { inner: self.lock().with_table(|s, t| s.schedule(t)) }
    }

    /// Plans the step after `out` (prepared, not yet updated) before `out`'s tokens are known, when
    /// it would be one decode of each running request: of the token each samples in `out`, except
    /// the requests in `skip` (those `out`'s token ends). None when it would be anything else (a
    /// waiting request could start, one is in prefill, the blocks are short). The runner feeds the tokens on its
    /// device (item `i` takes `out`'s sampled token `i`, skipped requests left out): the plan holds
    /// 0 for them. `update(out)` comes first, then this step's. A table scheduler only.
    #[pyo3(signature = (out, skip=Vec::new()))]
    fn schedule_ahead(&self, out: &SchedulerOutput, skip: Vec<u64>) -> PyResult<Option<SchedulerOutput>> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Backend::Ledger(table) = &mut state.backend else {
            return Err(PyValueError::new_err("schedule_ahead() plans for a block table's runner"));
        };
        if state.prepared != Some(out.inner.step) {
            return Err(PyValueError::new_err(format!(
                "schedule_ahead() needs step {} prepared and not yet updated",
                out.inner.step
            )));
        }
        Ok(state.sched.schedule_ahead(&out.inner, table, &skip).map(|inner| SchedulerOutput { inner }))
    }

    /// Runs a planned step: with a model, one batched forward pass (GIL released) returning float32
    /// `(num_sample + num_draft_tokens, vocab)` logits of the sampling items in order (a drafted
    /// item's token's row, then one per draft); with a ledger, block growth only
    /// (microseconds of work: the GIL stays held).
    fn execute<'py>(&self, py: Python<'py>, out: &SchedulerOutput) -> PyResult<Option<Bound<'py, PyArray2<f32>>>> {
        {
            let mut guard = self.lock();
            let state = &mut *guard;
            if let Backend::Ledger(table) = &mut state.backend {
                let done = state.executed.or(state.prepared).filter(|&s| s == out.inner.step);
                done.map_or(Ok(()), already_executed).map_err(to_py)?;
                state.sched.advance_ledger(&out.inner, table).map_err(to_py)?;
                state.executed = Some(out.inner.step);
                return Ok(None);
            }
        }
        let (logits, vocab) = without_gil(py, || {
            let mut guard = self.lock();
            let state = &mut *guard;
            state.executed.filter(|&s| s == out.inner.step).map_or(Ok(()), already_executed)?;
            let Backend::Model(model) = &state.backend else { unreachable!("checked above") };
            let items = state.sched.step_items(&out.inner)?;
            // Only a step with prompt rows lays its rows out: the others return just their sampling rows.
            let scored = out.inner.items.iter().any(|it| it.prompt_logits);
            let rows = scored.then(|| state.sched.logit_rows(&out.inner));
            let mut runner = model.get().lock();
            let vocab = runner.model().config.vocab;
            let mut logits = logits::buffer();
            runner.step_into(&items, &pool::global(), &mut logits)?;
            drop(runner);
            if let Some(rows) = rows.filter(|rows| !rows.prompt.is_empty()) {
                state.prompt_scores.extend(prompt_scores::score(&rows, &logits, vocab, &pool::global()));
                prompt_scores::keep_sample_rows(&rows, &mut logits, vocab);
            }
            state.executed = Some(out.inner.step);
            Ok::<_, Error>((logits, vocab))
        })
        .map_err(to_py)?;
        Ok(Some(logits::into_array(py, logits, vocab)?))
    }

    /// Plans a step for a runner outside Rust (a table scheduler only): grows the block tables for
    /// the step's tokens and returns the `StepPlan`, whose tier copies must run before the forward
    /// pass. `update` then records the step.
    fn prepare(&self, py: Python<'_>, out: &SchedulerOutput) -> PyResult<StepPlan> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Backend::Ledger(table) = &mut state.backend else {
            return Err(PyValueError::new_err("prepare() plans for a block table; a Model's scheduler runs execute()"));
        };
        let step = out.inner.step;
        if [state.prepared, state.prepared_ahead, state.executed].contains(&Some(step)) {
            return Err(to_py(already_executed(step).unwrap_err()));
        }
        let plan = state.sched.plan(&out.inner, table).map_err(to_py)?;
        if state.sched.ahead() == Some(step) {
            state.prepared_ahead = Some(step);
        } else {
            // A step of `schedule`: any step planned ahead before it was dropped with its requests.
            state.prepared = Some(step);
            state.prepared_ahead = None;
        }
        StepPlan::from_core(py, plan)
    }

    /// Records a step `execute` ran (or `prepare` planned and its runner computed): one sampled token
    /// per sampling item, in item order (a sequence of ints or a uint32 array). A step with drafts
    /// takes `accepted`, per sampling item how many of its drafts it keeps, and `sampled` then holds
    /// each item's kept drafts followed by the token drawn after them.
    #[pyo3(signature = (out, sampled, accepted=None))]
    fn update(&self, out: &SchedulerOutput, sampled: &Bound<'_, PyAny>, accepted: Option<Vec<usize>>) -> PyResult<()> {
        let sampled = token_ids(sampled)?;
        if let Some(accepted) = accepted {
            return self.update_drafted(&out.inner, &sampled, &accepted);
        }
        let mut guard = self.lock();
        let state = &mut *guard;
        let step = out.inner.step;
        if state.prepared == Some(step) {
            if sampled.len() != out.inner.num_sample() {
                return state.sched.update(&out.inner, &sampled).map_err(to_py);
            }
            let Backend::Ledger(table) = &mut state.backend else { unreachable!("only tables are prepared") };
            state.sched.commit_plan(&out.inner, table).map_err(to_py)?;
            state.prepared = state.prepared_ahead.take();
            state.executed = Some(step);
        } else if state.executed != Some(step) {
            return Err(PyValueError::new_err(format!(
                "update() needs execute() (or prepare()) of step {step} first: the step's tokens must run \
                 (or, for a ledger, take their blocks) before they are recorded"
            )));
        }
        state.sched.update(&out.inner, &sampled).map_err(to_py)
    }

    /// Prefix-cache statistics of the scheduler's blocks (both tiers).
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.lock().with_table(|_, t| t.cache_stats());
        stats_dict(py, &stats)
    }

    /// Drops every cached block no sequence uses, on both tiers; returns how many.
    fn reset_prefix_cache(&self) -> usize {
        self.lock().with_table(|_, t| t.reset_prefix_cache())
    }

    /// Ends a request (stop or length) and frees its blocks; False if unknown.
    fn finish(&self, request_id: u64) -> bool {
        self.lock().with_table(|s, t| s.finish(request_id, t))
    }

    /// Drops a waiting or running request and frees its blocks; False if unknown.
    fn abort(&self, request_id: u64) -> bool {
        self.lock().with_table(|s, t| s.abort(request_id, t))
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.lock().sched.num_waiting()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.lock().sched.num_running()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.lock().with_table(|_, t| t.num_blocks())
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.lock().with_table(|_, t| t.num_free_blocks())
    }

    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.lock().with_table(|_, t| t.num_available_blocks())
    }

    /// Running request ids in admission order.
    fn running_ids(&self) -> Vec<u64> {
        self.lock().sched.running_ids()
    }

    /// Waiting request ids, best first.
    fn waiting_ids(&self) -> Vec<u64> {
        self.lock().sched.waiting_ids()
    }

    /// A request's tokens (prompt, then generated) and how many hold KV; None if unknown.
    fn request_state(&self, request_id: u64) -> Option<(Vec<u32>, usize)> {
        self.lock().sched.request(request_id).map(|r| (r.tokens.clone(), r.num_computed))
    }

    /// Counters: steps, admitted, preemptions, finished, aborted, scheduled/prefill/decode/draft tokens.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock().sched.stats();
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("admitted", s.admitted)?;
        d.set_item("preemptions", s.preemptions)?;
        d.set_item("finished", s.finished)?;
        d.set_item("aborted", s.aborted)?;
        d.set_item("scheduled_tokens", s.scheduled_tokens)?;
        d.set_item("prefill_tokens", s.prefill_tokens)?;
        d.set_item("decode_tokens", s.decode_tokens)?;
        d.set_item("draft_tokens", s.draft_tokens)?;
        Ok(d)
    }

    /// Raises `ValueError` if an invariant of the scheduler or its blocks is broken.
    fn check(&self) -> PyResult<()> {
        self.lock().with_table(|s, t| s.check(t)).map_err(to_py)
    }
}

impl Scheduler {
    /// `update` of a step with drafts: the sequences record the kept drafts' KV.
    fn update_drafted(&self, out: &CoreOutput, sampled: &[u32], accepted: &[usize]) -> PyResult<()> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let step = out.step;
        if state.prepared == Some(step) {
            let Backend::Ledger(table) = &mut state.backend else { unreachable!("only tables are prepared") };
            state.sched.commit_plan(out, table).map_err(to_py)?;
            state.prepared = state.prepared_ahead.take();
            state.executed = Some(step);
        } else if state.executed != Some(step) {
            return Err(PyValueError::new_err(format!("update() needs execute() (or prepare()) of step {step} first")));
        }
        state.with_table(|s, t| s.update_drafted(out, sampled, accepted, t)).map_err(to_py)
    }
}

fn already_executed(step: u64) -> oxibonsai_core::Result<()> {
    Err(Error::Value(format!("step {step} was already executed")))
}

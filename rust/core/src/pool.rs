//! A persistent worker pool for the kernels: `threads - 1` workers plus the calling thread.
//!
//! Work is a list of independent tasks (the kernels make one task per range of row tiles), handed out
//! through an atomic counter. Each output element is computed by exactly one task with the same code,
//! so results are bit-identical for any thread count. Workers spin briefly after a job (a GEMV is tens
//! of microseconds, about one sleep/wake) and then sleep on a condition variable.
//!
//! One job runs at a time; a second caller that finds the pool busy runs its tasks inline instead of
//! waiting, which gives the same results.
//!
//! A job ends when its tasks are done, not when every worker has seen it: a worker that wakes late
//! (descheduled on a busy machine) finds the job closed and skips it. Workers announce themselves
//! (`active`) before reading `closed`, and the caller sets `closed` before waiting for `active` to
//! drain, so with sequentially consistent atomics no worker can touch a finished job's closure.

use std::cell::Cell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_micros(200);

type TaskFn = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct Job {
    /// Lifetime-erased pointer to the caller's closure; valid until the caller's `run` returns,
    /// which waits until the job is closed and no worker is inside it.
    f: *const TaskFn,
    tasks: usize,
}

// SAFETY: the closure behind `f` is `Sync`, and `run` keeps it alive while any worker can call it.
unsafe impl Send for Job {}

struct Shared {
    epoch: AtomicU64,
    job: Mutex<Option<Job>>,
    next: AtomicUsize,
    /// Tasks of the current job that have finished.
    finished: AtomicUsize,
    /// Workers between announcing themselves and leaving the current job.
    active: AtomicUsize,
    /// Set once a job's tasks are all finished; late workers skip a closed job.
    closed: AtomicBool,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    /// Workers asleep on `wake` (or about to be: counted under `wake_lock` before their last look at
    /// `epoch`). A job wakes the condition variable only when this is non-zero: between the steps of
    /// a forward pass the workers are still spinning, and a notify is a system call.
    sleepers: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
}

/// A fixed set of worker threads that run parallel loops for the kernels.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
}

thread_local! {
    static IN_POOL_TASK: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    /// A pool that runs jobs on `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            closed: AtomicBool::new(true),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("oxibonsai-worker-{i}"))
                    .spawn(move || worker_loop(&shared))
                    .expect("failed to spawn a kernel worker thread")
            })
            .collect();
        Pool { shared, workers, busy: Mutex::new(()) }
    }

    /// Threads that run a job, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0), ..., f(tasks - 1)`, each exactly once, across the pool; returns when all are done.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let nested = IN_POOL_TASK.with(Cell::get);
        let guard = if self.workers.is_empty() || tasks <= 1 || nested { None } else { self.busy.try_lock().ok() };
        let Some(_guard) = guard else {
            (0..tasks).for_each(f);
            return;
        };
        // SAFETY: only the lifetime is erased; we wait below until no worker can still call `f`.
        let f: *const TaskFn = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static TaskFn>(f) };
        let sh = &*self.shared;
        *sh.job.lock().unwrap() = Some(Job { f, tasks });
        sh.next.store(0, Ordering::SeqCst);
        sh.finished.store(0, Ordering::SeqCst);
        sh.closed.store(false, Ordering::SeqCst);
        sh.epoch.fetch_add(1, Ordering::SeqCst);
        // A worker about to sleep counts itself before it looks at the epoch one last time (both
        // sequentially consistent): either it sees the new epoch, or we see it counted and notify
        // under the lock it holds until it waits, so no wake-up is lost.
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = sh.wake_lock.lock().unwrap();
            sh.wake.notify_all();
        }
        // SAFETY: `f` is alive for the whole of this call.
        run_tasks(sh, unsafe { &*f }, tasks);
        spin_until(|| sh.finished.load(Ordering::SeqCst) == tasks);
        sh.closed.store(true, Ordering::SeqCst);
        spin_until(|| sh.active.load(Ordering::SeqCst) == 0);
        *sh.job.lock().unwrap() = None;
        if sh.panicked.swap(false, Ordering::SeqCst) {
            panic!("a kernel task panicked on a worker thread");
        }
    }

    /// Splits `0..items` into contiguous ranges (at least `min_chunk` long, shrinking towards the end:
    /// see [`guided_bounds`]) and runs `f` on each. The split never affects results: each item is
    /// handled by one call.
    pub fn for_each_range(&self, items: usize, min_chunk: usize, f: impl Fn(Range<usize>) + Sync) {
        let bounds = guided_bounds(items, self.threads(), min_chunk);
        self.run(bounds.len() - 1, &|t| f(bounds[t]..bounds[t + 1]));
    }
}

/// Task boundaries for `items` over `threads` (`0 = b_0 < b_1 < ... = items`): each task takes
/// `1 / (2 * threads)` of what is left, and at least `min_chunk` items. Big tasks first keep each
/// thread's memory stream long; small ones last leave little for one thread to finish while the others
/// wait (with equal tasks, the wait at the end of a GEMV was up to one task: ~5 us on two threads).
fn guided_bounds(items: usize, threads: usize, min_chunk: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut start = 0;
    while start < items {
        let rest = items - start;
        start += rest.div_ceil(2 * threads).max(min_chunk).clamp(1, rest);
        bounds.push(start);
    }
    bounds
}

/// A raw pointer that pool tasks may share because each task touches a disjoint part of the buffer.
struct RowsPtr<T>(*mut T);

// SAFETY: only used by `for_each_row_mut`, whose tasks write disjoint rows.
unsafe impl<T: Send> Send for RowsPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for RowsPtr<T> {}

impl Pool {
    /// Runs `f(row, row_slice)` for every `row_len`-long row of `buf`, rows split across the pool in
    /// contiguous ranges. Each row is handed to exactly one call, so results never depend on the split.
    pub fn for_each_row_mut<T: Send>(
        &self,
        buf: &mut [T],
        row_len: usize,
        min_rows: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        assert!(row_len > 0 && buf.len().is_multiple_of(row_len), "buffer is not a whole number of rows");
        let rows = buf.len() / row_len;
        let base = RowsPtr(buf.as_mut_ptr());
        let base = &base;
        self.for_each_range(rows, min_rows, |range| {
            for row in range {
                // SAFETY: `row < rows`, so the slice is inside `buf`; each row index is handed to exactly
                // one call of this closure, so no two tasks alias a row, and `buf` is mutably borrowed
                // for the whole call.
                let slice = unsafe { std::slice::from_raw_parts_mut(base.0.add(row * row_len), row_len) };
                f(row, slice);
            }
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        {
            let _lock = self.shared.wake_lock.lock().unwrap();
            self.shared.shutdown.store(true, Ordering::SeqCst);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn run_tasks(sh: &Shared, f: &TaskFn, tasks: usize) {
    IN_POOL_TASK.with(|c| c.set(true));
    loop {
        let i = sh.next.fetch_add(1, Ordering::SeqCst);
        if i >= tasks {
            break;
        }
        if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
            sh.panicked.store(true, Ordering::SeqCst);
        }
        sh.finished.fetch_add(1, Ordering::SeqCst);
    }
    IN_POOL_TASK.with(|c| c.set(false));
}

/// Spins on `done`, yielding the CPU after a short while (the tasks still running belong to threads
/// that may be descheduled).
fn spin_until(done: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        // Reading the clock costs more than a spin: look at it every 64 spins only.
        if spins.is_multiple_of(64) && start.elapsed() > SPIN {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn worker_loop(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        if !wait_for_epoch(sh, seen) {
            return;
        }
        seen = sh.epoch.load(Ordering::SeqCst);
        sh.active.fetch_add(1, Ordering::SeqCst);
        if !sh.closed.load(Ordering::SeqCst) {
            let job = *sh.job.lock().unwrap();
            if let Some(job) = job {
                // SAFETY: the job is open and this worker is counted in `active`, so the caller of
                // `run` is still waiting and keeps the closure alive.
                run_tasks(sh, unsafe { &*job.f }, job.tasks);
            }
        }
        sh.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits until the epoch moves past `seen`; false on shutdown.
fn wait_for_epoch(sh: &Shared, seen: u64) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    // The clock is read every 64 spins: reading it costs more than a spin.
    while !spins.is_multiple_of(64) || start.elapsed() < SPIN {
        spins = spins.wrapping_add(1);
        if sh.shutdown.load(Ordering::Relaxed) {
            return false;
        }
        if sh.epoch.load(Ordering::SeqCst) != seen {
            return true;
        }
        std::hint::spin_loop();
    }
    let mut lock = sh.wake_lock.lock().unwrap();
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    let woken = loop {
        if sh.shutdown.load(Ordering::SeqCst) {
            break false;
        }
        if sh.epoch.load(Ordering::SeqCst) != seen {
            break true;
        }
        lock = sh.wake.wait(lock).unwrap();
    };
    sh.sleepers.fetch_sub(1, Ordering::SeqCst);
    woken
}

static GLOBAL: RwLock<Option<Arc<Pool>>> = RwLock::new(None);

fn default_threads() -> usize {
    std::env::var("OXIBONSAI_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The process-wide pool the kernels use (created on first use).
pub fn global() -> Arc<Pool> {
    if let Some(pool) = GLOBAL.read().unwrap().as_ref() {
        return Arc::clone(pool);
    }
    let mut slot = GLOBAL.write().unwrap();
    Arc::clone(slot.get_or_insert_with(|| Arc::new(Pool::new(default_threads()))))
}

/// Replaces the global pool with one of `threads` threads (`threads >= 1`).
pub fn set_num_threads(threads: usize) {
    assert!(threads >= 1, "threads must be >= 1");
    let old = GLOBAL.write().unwrap().replace(Arc::new(Pool::new(threads)));
    drop(old);
}

/// Threads the global pool runs on.
pub fn num_threads() -> usize {
    global().threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_for_any_thread_count() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads);
            for tasks in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
            }
        }
    }

    #[test]
    fn guided_bounds_shrink_and_cover_the_items() {
        for threads in [1, 2, 3, 8] {
            for min_chunk in [0, 1, 3, 16] {
                for items in (0..300).chain([4096, 151_936 / 32]) {
                    let b = guided_bounds(items, threads, min_chunk);
                    assert_eq!((b[0], *b.last().unwrap()), (0, items));
                    let sizes: Vec<usize> = b.windows(2).map(|w| w[1] - w[0]).collect();
                    assert!(sizes.iter().all(|&s| s >= 1), "{items}/{threads}: {sizes:?}");
                    assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{items}/{threads}: {sizes:?}");
                    // Only the last task may be shorter than `min_chunk` (when too few items are left).
                    let all_but_last = &sizes[..sizes.len().saturating_sub(1)];
                    assert!(all_but_last.iter().all(|&s| s >= min_chunk), "{items}/{threads}: {sizes:?}");
                    if items >= 4 * threads * min_chunk.max(1) {
                        assert!(sizes.len() >= 2 * threads, "{items}/{threads}: {sizes:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn ranges_cover_items_exactly() {
        let pool = Pool::new(3);
        for items in [0, 1, 5, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each_range(items, 3, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::SeqCst);
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
        }
    }

    #[test]
    fn concurrent_callers_and_nested_runs_complete() {
        let pool = Arc::new(Pool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (Arc::clone(&pool), Arc::clone(&total));
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        pool.run(4, &|_| {
                            pool.run(2, &|_| {
                                total.fetch_add(1, Ordering::SeqCst);
                            });
                        });
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(total.load(Ordering::SeqCst), 4 * 50 * 4 * 2);
    }

    /// Each task waits (up to a few seconds) for the other one to start: the job finishes quickly only
    /// if the worker, asleep after the pause, was woken for it.
    #[test]
    fn sleeping_workers_are_woken_for_the_next_job() {
        let pool = Pool::new(2);
        for _ in 0..10 {
            std::thread::sleep(SPIN * 3);
            let started = AtomicUsize::new(0);
            let met = AtomicUsize::new(0);
            pool.run(2, &|_| {
                started.fetch_add(1, Ordering::SeqCst);
                let deadline = Instant::now() + Duration::from_secs(5);
                while started.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
                    std::hint::spin_loop();
                }
                if started.load(Ordering::SeqCst) == 2 {
                    met.fetch_add(1, Ordering::SeqCst);
                }
            });
            assert_eq!(met.load(Ordering::SeqCst), 2, "the sleeping worker was not woken");
        }
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_survives() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(8, &|i| assert!(i != 5))));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(count.load(Ordering::SeqCst), 8);
    }
}

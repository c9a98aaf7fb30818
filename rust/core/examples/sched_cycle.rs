//! Times one scheduler cycle of the "mixed" workload of `benches/bench_scheduler.py` in Rust alone
//! (schedule, ledger execute, update, two finishes, two 64-token adds at 64 running requests), to
//! split the benchmark's Rust-side time into the core and the Python calls around it.
//!
//!     cargo run --release -p oxibonsai-core --example sched_cycle

use std::collections::VecDeque;
use std::time::Instant;

use oxibonsai_core::kv::SequenceTable;
use oxibonsai_core::sched::{Scheduler, SchedulerConfig};

const RUNNING: usize = 64;
const ROUNDS: usize = 100_000;
const WARMUP: usize = 100;

fn main() {
    // Each request lives about 32 steps (two finish per step), so the ledger never runs out.
    let mut table = SequenceTable::new(RUNNING * (64 + 2 * 5_000) / 16, 0, false);
    let config = SchedulerConfig { max_num_seqs: RUNNING, max_num_batched_tokens: 256, ..Default::default() };
    let mut sched = Scheduler::new(config).expect("a valid config");
    let prompt: Vec<u32> = (1000..1064).collect();
    let sampled = vec![7u32; RUNNING];
    let (mut live, mut next) = (VecDeque::new(), 0u64);
    let mut add = |sched: &mut Scheduler, live: &mut VecDeque<u64>| {
        sched.add(next, prompt.clone(), 0, None).expect("a new id");
        live.push_back(next);
        next += 1;
    };
    for _ in 0..RUNNING {
        add(&mut sched, &mut live);
    }
    // Optional: KiB of memory to stream through between cycles, standing in for the Python work
    // that runs between the benchmark's calls and leaves the scheduler's data out of L1/L2.
    let thrash_kib: usize = std::env::args().nth(1).map_or(0, |a| a.parse().expect("KiB to thrash"));
    let mut thrash = vec![0u64; thrash_kib * 128];
    let mut times = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        for (i, word) in thrash.iter_mut().enumerate().step_by(8) {
            *word = word.wrapping_add(i as u64);
        }
        let start = Instant::now();
        let out = sched.schedule(&mut table);
        sched.advance_ledger(&out, &mut table).expect("room");
        sched.update(&out, &sampled[..out.num_sample()]).expect("this step");
        for _ in 0..2 {
            sched.finish(live.pop_front().expect("running"), &mut table);
        }
        for _ in 0..2 {
            add(&mut sched, &mut live);
        }
        if round >= WARMUP {
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "mixed-{RUNNING} cycle ({thrash_kib} KiB thrashed between cycles): best {:.3} us, median {:.3} us, mean {mean:.3} us",
        times[0],
        times[times.len() / 2]
    );
}

//! Times one `Sampler::sample` call at Bonsai's vocabulary (151,936 ids) for the common parameter
//! sets: logits `scale * N(0, 1)` (default 3, a flat distribution: the most candidates after the
//! cut), best of `runs` runs of 100 calls each, no logprobs.
//!
//!     cargo run --release -p oxibonsai-core --example sample_speed -- [runs] [scale]

use std::time::Instant;

use oxibonsai_core::sample::{History, Rng, Sampler, SamplingConfig};

const VOCAB: usize = 151_936;
const CALLS: usize = 100;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs: usize = args.first().map_or(5, |a| a.parse().expect("runs"));
    let scale: f64 = args.get(1).map_or(3.0, |a| a.parse().expect("scale"));
    let logits = normal_logits(scale);
    let cases = [
        ("temperature 0.8", SamplingConfig { temperature: 0.8, ..SamplingConfig::default() }),
        ("temperature 0.8, top-p 0.9", SamplingConfig { temperature: 0.8, top_p: 0.9, ..SamplingConfig::default() }),
        (
            "temperature 0.6, top-p 0.95, top-k 20",
            SamplingConfig { temperature: 0.6, top_p: 0.95, top_k: 20, ..SamplingConfig::default() },
        ),
        ("temperature 1, top-k 40", SamplingConfig { top_k: 40, ..SamplingConfig::default() }),
        ("temperature 0.8, min-p 0.05", SamplingConfig { temperature: 0.8, min_p: 0.05, ..SamplingConfig::default() }),
    ];
    println!("logits {scale} * N(0, 1) over {VOCAB} ids; best of {runs} runs of {CALLS} calls");
    for (name, config) in cases {
        let mut sampler = Sampler::new(config, 7).expect("a valid config");
        let history = History::new(&[], &[]);
        let best = (0..runs)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..CALLS {
                    std::hint::black_box(sampler.sample(&logits, &history, &[], None).expect("a token"));
                }
                start.elapsed().as_secs_f64() / CALLS as f64
            })
            .fold(f64::INFINITY, f64::min);
        println!("{name:40} {:8.1} us", best * 1e6);
    }
}

/// Box-Muller normals times `scale`, from a fixed seed.
fn normal_logits(scale: f64) -> Vec<f32> {
    let mut rng = Rng::new(1);
    (0..VOCAB)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(f64::MIN_POSITIVE), rng.next_f64());
            (scale * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

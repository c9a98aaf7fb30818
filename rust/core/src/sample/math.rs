//! The exponential the sampler's softmaxes run on: `exp` for non-positive arguments (every softmax
//! here subtracts its maximum first), written with plain float and integer operations so that loops
//! over it vectorize on any target. A libm `expf` call per token was most of the cost of a sampling
//! step at a 152k vocabulary.

/// `1.5 * 2^23`: adding it rounds a small float to the nearest integer, kept in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// Below this `exp` is subnormal; the sampler treats it as zero.
const FLOOR: f32 = -87.0;

/// `exp(x)` for `x <= 0`, relative error below 3e-7; exactly 1 at 0 and 0 below -87 (and at `-inf`).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    let xc = x.max(FLOOR);
    // x = n ln2 + r with integer n and |r| <= ln2 / 2 (ln2 split in two for an exact n ln2).
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (xc - n * 0.693_359_4) + n * 2.121_944_4e-4;
    // Cephes' minimax polynomial for exp(r) on that interval.
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes' 5.0000001201e-1, as an f32
    p = p * r * r + r + 1.0;
    // 2^n from the integer that `shifted` carries in its low bits (n in [-126, 0]).
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < FLOOR {
        0.0
    } else {
        p * scale
    }
}

/// `x = exp((x - max) / t)` for every element (`max` at least every element, `t > 0`), the division a
/// multiplication by `1 / t` (a vector division was a third of the pass) unless that overflows.
pub(crate) fn exp_in_place(xs: &mut [f32], max: f32, t: f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { avx2::exp_in_place(xs, max, t) };
    }
    exp_in_place_body(xs, max, t)
}

/// `sum(exp(x - shift))` over `xs` (every `x <= shift`) without writing to `xs`, summed in f64.
pub(crate) fn sum_exp(xs: &[f32], shift: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { avx2::sum_exp(xs, shift) };
    }
    sum_exp_body(xs, shift)
}

/// The largest element of `xs` (`-inf` if there is none), and whether any element is NaN or `+inf`
/// (the maximum is then meaningless). One pass in sixteen lanes: a compare-and-select instead of
/// `f32::max`, whose NaN rule keeps the loop from vectorizing, which made it the slowest pass of a
/// greedy draw.
pub(crate) fn max_and_bad(xs: &[f32]) -> (f32, bool) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { avx2::max_and_bad(xs) };
    }
    max_and_bad_body(xs)
}

#[inline(always)]
fn max_and_bad_body(xs: &[f32]) -> (f32, bool) {
    const LANES: usize = 16;
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut bad = [0u32; LANES];
    let whole = xs.len() / LANES * LANES;
    for chunk in xs[..whole].chunks_exact(LANES) {
        for j in 0..LANES {
            let v = chunk[j];
            max[j] = if v > max[j] { v } else { max[j] };
            bad[j] |= u32::from(v.is_nan() | (v == f32::INFINITY));
        }
    }
    let (mut m, mut any) = (f32::NEG_INFINITY, false);
    for &v in xs[whole..].iter().chain(&max) {
        m = if v > m { v } else { m };
        any |= v.is_nan() || v == f32::INFINITY;
    }
    (m, any || bad.iter().any(|&b| b != 0))
}

/// The sum of `xs` in eight f64 lanes (independent chains; the order is fixed, so the result is too),
/// in AVX2 where the CPU has it (the same bits).
pub(crate) fn sum(xs: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { avx2::sum(xs) };
    }
    sum_body(xs)
}

/// [`sum`]'s loops: plain, no iterator adapters, so that they inline into the AVX2 copies below.
#[inline(always)]
pub(crate) fn sum_body(xs: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let whole = xs.len() / 8 * 8;
    for chunk in xs[..whole].chunks_exact(8) {
        for j in 0..8 {
            lanes[j] += chunk[j] as f64;
        }
    }
    let mut total = 0.0;
    for &v in &xs[whole..] {
        total += v as f64;
    }
    for lane in lanes {
        total += lane;
    }
    total
}

#[inline(always)]
fn exp_in_place_body(xs: &mut [f32], max: f32, t: f32) {
    let scale = 1.0 / t;
    if !scale.is_finite() {
        // A temperature so small that its reciprocal overflows: divide (0 / t stays 0).
        for x in xs {
            *x = exp_nonpositive((*x - max) / t);
        }
        return;
    }
    for x in xs {
        *x = exp_nonpositive((*x - max) * scale);
    }
}

/// Exponentials go through a stack block, the loop that vectorizes, and are then summed.
#[inline(always)]
fn sum_exp_body(xs: &[f32], shift: f32) -> f64 {
    const BLOCK: usize = 256;
    let mut block = [0f32; BLOCK];
    let mut total = 0.0;
    for src in xs.chunks(BLOCK) {
        let dst = &mut block[..src.len()];
        dst.copy_from_slice(src);
        exp_in_place_body(dst, shift, 1.0);
        total += sum_body(dst);
    }
    total
}

/// The same loops compiled for AVX2: wider vectors, identical results (Rust never fuses or
/// reorders float operations, so every lane computes exactly what the portable code does).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2")]
    pub(super) fn exp_in_place(xs: &mut [f32], max: f32, t: f32) {
        super::exp_in_place_body(xs, max, t)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn sum_exp(xs: &[f32], shift: f32) -> f64 {
        super::sum_exp_body(xs, shift)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn max_and_bad(xs: &[f32]) -> (f32, bool) {
        super::max_and_bad_body(xs)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn sum(xs: &[f32]) -> f64 {
        super::sum_body(xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_std_exp_over_the_whole_range() {
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 * i as f32 / 2_000_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp_nonpositive(x) as f64) - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
    }

    #[test]
    fn edges_are_exact() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-f32::MAX), 0.0);
    }

    #[test]
    fn max_and_bad_is_the_maximum_and_flags_nan_and_plus_inf() {
        let mut rng = crate::sample::Rng::new(9);
        for len in [0, 1, 15, 16, 17, 100, 1000] {
            let mut xs: Vec<f32> = (0..len).map(|_| (rng.next_f64() * 200.0 - 100.0) as f32).collect();
            let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_and_bad(&xs), (want, false));
            assert_eq!(max_and_bad_body(&xs), (want, false));
            if len > 0 {
                let at = (rng.next_u64() % len as u64) as usize;
                xs[at] = f32::NEG_INFINITY;
                assert!(!max_and_bad(&xs).1);
                for poison in [f32::NAN, f32::INFINITY] {
                    let mut ys = xs.clone();
                    ys[at] = poison;
                    assert!(max_and_bad(&ys).1, "len {len} at {at}: {poison}");
                }
            }
        }
        assert_eq!(max_and_bad(&[f32::NEG_INFINITY; 20]), (f32::NEG_INFINITY, false));
    }

    #[test]
    fn dispatched_loops_equal_the_portable_ones_bit_for_bit() {
        let mut rng = crate::sample::Rng::new(5);
        let xs: Vec<f32> = (0..10_007).map(|_| (rng.next_f64() * 120.0 - 100.0) as f32).collect();
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (mut a, mut b) = (xs.clone(), xs.clone());
        exp_in_place(&mut a, max, 0.7);
        exp_in_place_body(&mut b, max, 0.7);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(sum_exp(&xs, max).to_bits(), sum_exp_body(&xs, max).to_bits());
        assert_eq!(sum(&xs).to_bits(), sum_body(&xs).to_bits());
    }

    #[test]
    fn a_temperature_whose_reciprocal_overflows_still_gives_weights() {
        let mut xs = [2.0f32, 1.0, 2.0];
        exp_in_place(&mut xs, 2.0, 1e-40);
        assert_eq!(xs, [1.0, 0.0, 1.0]);
    }

    #[test]
    fn exp_in_place_scales_by_the_temperature() {
        let mut xs = [2.0f32, 1.0, f32::NEG_INFINITY];
        exp_in_place(&mut xs, 2.0, 0.5);
        assert_eq!(xs[0], 1.0);
        assert!((xs[1] - (-2f32).exp()).abs() < 1e-7);
        assert_eq!(xs[2], 0.0);
    }

    #[test]
    fn sum_exp_matches_a_plain_sum() {
        let xs: Vec<f32> = (0..1001).map(|i| -(i as f32) * 0.013).collect();
        let want: f64 = xs.iter().map(|&x| ((x - 0.5) as f64).exp()).sum();
        assert!((sum_exp(&xs, 0.5) - want).abs() / want < 1e-6);
    }
}

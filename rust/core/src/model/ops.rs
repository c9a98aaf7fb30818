//! The element-wise pieces of the forward pass: a vector dot (with an AVX2 build of the same code),
//! RMSNorm and SwiGLU (RoPE is [`super::rope`]). Sums accumulate in a fixed order (32 lanes, then a fixed
//! reduction), so results do not depend on the instruction set or thread count.

use crate::sample::math::exp_nonpositive;

const LANES: usize = 32;

/// `sum(a[i] * b[i])`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_lanes(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    reduce_lanes(acc) + tail
}

/// Pairwise, in a fixed order: lanes `i` and `i + half` first, halving until one is left.
#[inline(always)]
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for i in 0..half {
            acc[i] += acc[i + half];
        }
        half /= 2;
    }
    acc[0]
}

/// `1 / sqrt(mean(x^2) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// `out = x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, xi), w) in out.iter_mut().zip(x).zip(weight) {
        *o = xi * inv * w;
    }
}

/// RMSNorm in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (xi, w) in x.iter_mut().zip(weight) {
        *xi = *xi * inv * w;
    }
}

/// SwiGLU: `gate[i] = silu(gate[i]) * up[i]`, with the AVX2 build of the same loop where available.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { swiglu_avx2(gate, up) };
    }
    swiglu_body(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    swiglu_body(gate, up)
}

/// `silu(x) = x / (1 + e^-x)`, written with `e = exp(-|x|) <= 1` so the polynomial exp applies and
/// nothing overflows: `x / (1 + e)` for `x >= 0`, `x e / (1 + e)` below. Branch-free, so it vectorizes.
#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let e = exp_nonpositive(-x.abs());
        let numerator = if x >= 0.0 { x } else { x * e };
        *g = numerator / (1.0 + e) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_sum_and_is_isa_independent() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let plain: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64) * (*y as f64)).sum();
        assert!((dot(&a, &b) as f64 - plain).abs() < 1e-5);
        assert_eq!(dot(&a, &b).to_bits(), dot_lanes(&a, &b).to_bits());
    }

    #[test]
    fn swiglu_matches_the_plain_formula() {
        let gate: Vec<f32> = (-400..400).map(|i| i as f32 * 0.05).chain([-100.0, 100.0, 0.0, -0.0]).collect();
        let up: Vec<f32> = gate.iter().map(|x| 1.0 + x.sin()).collect();
        let mut got = gate.clone();
        swiglu_in_place(&mut got, &up);
        for ((g, x), u) in got.iter().zip(&gate).zip(&up) {
            let want = (*x as f64) / (1.0 + (-(*x as f64)).exp()) * (*u as f64);
            assert!((*g as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "silu({x}) = {g}, want {want}");
        }
    }
}

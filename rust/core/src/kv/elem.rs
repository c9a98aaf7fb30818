//! `KvElem`: how one element type of the KV cache is stored and read. `f32` keeps keys and values
//! exactly; `F16` (IEEE half, as llama.cpp and vLLM store KV by default) halves the memory and the
//! bandwidth attention needs; `I8` halves them again: each token's keys (and values) of one head are
//! stored as integers over one f32 scale, `absmax / 127` of that row ([`KvElem::row_scale`]), so a
//! stored value is `to_f32() * scale`. Reads widen to f32 exactly, and axpy (`out = fma(w, v, out)`,
//! one rounding per element, as every attention kernel adds values) is the same arithmetic for every
//! type (`inline(always)`, so an AVX2 + FMA caller vectorizes it in place); a scaled type's scale is
//! folded into the caller's per-token factors, never applied per element.

use crate::fused::MulAdd;
use crate::huge::Plain;

/// An element type of the KV cache (a [`Plain`] number: the cache starts as zeroed memory).
pub trait KvElem: Plain + Default {
    /// Name for messages and stats ("f32", "f16", "int8").
    const NAME: &'static str;
    /// Whether each (token, head) row is stored over a scale ([`row_scale`](Self::row_scale)).
    const SCALED: bool = false;
    /// The scale the row `src` is stored over (1 for an unscaled type).
    fn row_scale(_src: &[f32]) -> f32 {
        1.0
    }
    /// `x` stored over a row scale whose inverse is `inverse` (ignored by an unscaled type).
    fn encode(x: f32, inverse: f32) -> Self;
    /// The stored number (times the row scale, for a scaled type, is the value).
    fn to_f32(self) -> f32;
    /// `out[i] = w * v[i] + out[i]` rounded once (by `F`), so every build gives the same bits.
    fn axpy<F: MulAdd>(out: &mut [f32], w: f32, v: &[Self]);
}

impl KvElem for f32 {
    const NAME: &'static str = "f32";

    fn encode(x: f32, _inverse: f32) -> f32 {
        x
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn axpy<F: MulAdd>(out: &mut [f32], w: f32, v: &[f32]) {
        axpy_lanes::<F>(out, w, v)
    }
}

/// An IEEE binary16 value, stored as its bits.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

const CHUNK: usize = 32;

// SAFETY: a transparent `u16`: every bit pattern is a half (all-zero is +0.0).
unsafe impl Plain for F16 {}

impl KvElem for F16 {
    const NAME: &'static str = "f16";

    fn encode(x: f32, _inverse: f32) -> F16 {
        F16(half::f16::from_f32(x).to_bits())
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        widen(self)
    }

    #[inline(always)]
    fn axpy<F: MulAdd>(out: &mut [f32], w: f32, v: &[F16]) {
        let mut wide = [0.0f32; CHUNK];
        let mut o32 = out.chunks_exact_mut(CHUNK);
        let mut v32 = v.chunks_exact(CHUNK);
        for (oc, vc) in (&mut o32).zip(&mut v32) {
            widen_chunk(vc, &mut wide);
            for l in 0..CHUNK {
                oc[l] = F::mul_add(w, wide[l], oc[l]);
            }
        }
        for (o, x) in o32.into_remainder().iter_mut().zip(v32.remainder()) {
            *o = F::mul_add(w, widen(*x), *o);
        }
    }
}

/// A signed byte of a scaled row: the value is `self.0 * scale`, `|self.0| <= 127`.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct I8(pub i8);

// SAFETY: a transparent `i8`: every bit pattern is a number (all-zero is 0).
unsafe impl Plain for I8 {}

impl KvElem for I8 {
    const NAME: &'static str = "int8";
    const SCALED: bool = true;

    /// `absmax / 127`, so the largest magnitude maps to 127; 0 for a row of zeros.
    fn row_scale(src: &[f32]) -> f32 {
        src.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0
    }

    /// `x / scale` rounded to the nearest integer (ties away from zero), clamped to +-127; an
    /// `inverse` of 0 (a zero row) stores 0.
    fn encode(x: f32, inverse: f32) -> I8 {
        I8((x * inverse).round().clamp(-127.0, 127.0) as i8)
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.0 as f32
    }

    #[inline(always)]
    fn axpy<F: MulAdd>(out: &mut [f32], w: f32, v: &[I8]) {
        assert_eq!(out.len(), v.len());
        for (o, x) in out.iter_mut().zip(v) {
            *o = F::mul_add(w, x.0 as f32, *o);
        }
    }
}

/// The inverse of a row scale as [`KvElem::encode`] takes it: 0 for a zero (or non-finite) scale.
pub fn inverse_scale(scale: f32) -> f32 {
    if scale > 0.0 && scale.is_finite() {
        1.0 / scale
    } else {
        0.0
    }
}

#[inline(always)]
fn widen_chunk(src: &[F16], dst: &mut [f32; CHUNK]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = widen(*s);
    }
}

/// Exact binary16 -> binary32, branch-free so it vectorizes: shift the exponent and mantissa into
/// place and rescale by 2^112 (exact, subnormals included); infinities and NaNs keep an all-ones exponent.
#[inline(always)]
pub fn widen(h: F16) -> f32 {
    let bits = h.0 as u32;
    let sign = (bits & 0x8000) << 16;
    let magnitude = bits & 0x7fff;
    let scaled = (f32::from_bits(magnitude << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let special = (magnitude << 13) | 0x7f80_0000;
    f32::from_bits(if magnitude >= 0x7c00 { special } else { scaled } | sign)
}

/// `y += alpha * x`, element by element in order (the compiler vectorizes it in the caller).
#[inline(always)]
pub(crate) fn axpy_lanes<F: MulAdd>(y: &mut [f32], alpha: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = F::mul_add(alpha, *xi, *yi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::Portable;

    #[test]
    fn widening_is_exact_for_every_half() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = widen(F16(bits));
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{bits:#06x}");
        }
    }

    #[test]
    fn f16_axpy_equals_f32_on_widened_values() {
        let q: Vec<f32> = (0..160).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<F16> = q.iter().map(|x| F16::encode(x * 0.5, 1.0)).collect();
        let wide: Vec<f32> = k.iter().map(|h| widen(*h)).collect();
        let (mut a, mut b) = (q.clone(), q.clone());
        F16::axpy::<Portable>(&mut a, 0.3, &k);
        f32::axpy::<Portable>(&mut b, 0.3, &wide);
        assert_eq!(a, b);
    }

    #[test]
    fn int8_rows_round_within_half_a_step_of_their_scale() {
        for seed in 0..50u32 {
            let row: Vec<f32> =
                (0..128).map(|i| ((i as f32 + seed as f32 * 7.1) * 0.618).sin() * (seed + 1) as f32).collect();
            let scale = I8::row_scale(&row);
            let stored: Vec<I8> = row.iter().map(|&x| I8::encode(x, inverse_scale(scale))).collect();
            assert!(stored.iter().any(|q| q.0.abs() == 127), "seed {seed}: the largest magnitude maps to 127");
            for (x, q) in row.iter().zip(&stored) {
                assert!((q.to_f32() * scale - x).abs() <= scale * (0.5 + 1e-3), "seed {seed}: {x} vs {q:?}");
            }
        }
        let zeros = [0.0f32; 16];
        assert_eq!(I8::row_scale(&zeros), 0.0);
        assert_eq!(I8::encode(0.0, inverse_scale(0.0)), I8(0));
    }
}

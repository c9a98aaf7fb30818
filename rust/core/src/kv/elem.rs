//! `KvElem`: how one element type of the KV cache is stored and read. `f32` keeps keys and values
//! exactly; `F16` (IEEE half, as llama.cpp and vLLM store KV by default) halves the memory and the
//! bandwidth attention needs. Reads widen to f32 exactly, and axpy (`out = fma(w, v, out)`, one rounding per
//! element, as every attention kernel adds values) is the same arithmetic for both types
//! (`inline(always)`, so an AVX2 + FMA caller vectorizes it in place).

use crate::fused::MulAdd;
use crate::huge::Plain;

/// An element type of the KV cache (a [`Plain`] number: the cache starts as zeroed memory).
pub trait KvElem: Plain + Default {
    /// Name for messages and stats ("f32", "f16").
    const NAME: &'static str;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn store(src: &[f32], dst: &mut [Self]);
    /// `out[i] = w * v[i] + out[i]` rounded once (by `F`), so every build gives the same bits.
    fn axpy<F: MulAdd>(out: &mut [f32], w: f32, v: &[Self]);
}

impl KvElem for f32 {
    const NAME: &'static str = "f32";

    fn from_f32(x: f32) -> f32 {
        x
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
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

    fn from_f32(x: f32) -> F16 {
        F16(half::f16::from_f32(x).to_bits())
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        widen(self)
    }

    fn store(src: &[f32], dst: &mut [F16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = F16::from_f32(*s);
        }
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
        let mut k = vec![F16::default(); 160];
        F16::store(&q.iter().map(|x| x * 0.5).collect::<Vec<_>>(), &mut k);
        let wide: Vec<f32> = k.iter().map(|h| widen(*h)).collect();
        let (mut a, mut b) = (q.clone(), q.clone());
        F16::axpy::<Portable>(&mut a, 0.3, &k);
        f32::axpy::<Portable>(&mut b, 0.3, &wide);
        assert_eq!(a, b);
    }
}

//! [`fused`]: `a * b + c` rounded once, the value `f32::mul_add` returns, and fast on every build.
//! Where the build has a fused multiply-add instruction (aarch64; x86-64 code compiled with FMA) it
//! is that instruction. The baseline x86-64 build, which must run on CPUs without FMA, gets it from
//! f64 arithmetic instead: libm's `fmaf` there switches the rounding mode on every call, which made
//! the generic attention loop 7x slower. Attention adds through it so that every build, on every CPU,
//! gives the same bits.

/// A way to compute `a * b + c` rounded once, picked by the caller's build.
pub trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// The fused multiply-add instruction, for code built with it (a `target_feature = "fma"` function).
pub struct Instruction;

impl MulAdd for Instruction {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// [`fused`]: what the crate's own build can do fast.
pub struct Portable;

impl MulAdd for Portable {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        fused(a, b, c)
    }
}

/// `a * b + c` with a single rounding.
#[inline(always)]
pub fn fused(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(any(target_arch = "aarch64", target_feature = "fma"))]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(any(target_arch = "aarch64", target_feature = "fma")))]
    {
        fused_in_f64(a, b, c)
    }
}

/// `a * b + c` rounded once, from f64 operations: the product is exact in f64 (48 significant bits),
/// the sum is rounded to odd (Boldo and Melquiond: an inexact sum whose last bit is even moves one
/// ulp towards the exact value), and with 53 >= 2 * 24 + 2 bits, rounding that to f32 rounds the
/// exact value once. Knuth's two-sum gives the sum's rounding error exactly.
#[inline(always)]
pub fn fused_in_f64(a: f32, b: f32, c: f32) -> f32 {
    let p = a as f64 * b as f64;
    let c = c as f64;
    let s = p + c;
    let c_part = s - p;
    let err = (p - (s - c_part)) + (c - c_part);
    let bits = s.to_bits();
    // an infinite or NaN sum has a NaN error, and stays as it is
    let nudge = match (err.abs() > 0.0 && bits & 1 == 0, (err > 0.0) == (s > 0.0)) {
        (false, _) => 0,
        (true, true) => 1,         // the exact value is further from zero
        (true, false) => u64::MAX, // closer to zero: one less (a wrapping -1)
    };
    f64::from_bits(bits.wrapping_add(nudge)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A float with random sign and mantissa and an exponent within `spread` of 2^0.
    fn float(seed: &mut u64, spread: u32) -> f32 {
        let r = rng(seed);
        let exponent = 127 + (r >> 32) as u32 % (2 * spread + 1) - spread;
        f32::from_bits(((r as u32) & 0x807f_ffff) | (exponent << 23))
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn agrees_with_mul_add_bit_for_bit() {
        let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        println!("seed {seed}");
        for spread in [0, 4, 30, 126] {
            for _ in 0..200_000 {
                let (a, b) = (float(&mut seed, spread), float(&mut seed, spread));
                // c near -a*b too, where the sum cancels and the product's low bits decide
                let c = if rng(&mut seed).is_multiple_of(2) {
                    float(&mut seed, spread)
                } else {
                    -(a * b) * (1.0 + f32::EPSILON * (rng(&mut seed) % 5) as f32)
                };
                let (want, got) = (a.mul_add(b, c), fused_in_f64(a, b, c));
                assert!(same(want, got), "{a:e} * {b:e} + {c:e}: {want:e} vs {got:e}");
            }
        }
    }

    #[test]
    fn halfway_cases_and_specials_round_once() {
        // (1 - 2^-23)(1 + 2^-23) 2^-14 + (1024 + 2^-13) = 1024 + 1.5 * 2^-13 - 2^-60: just below the
        // midpoint of two floats 2^-13 apart, so it rounds down; rounded to f64 first it would be the
        // midpoint itself, which ties to the even neighbour, up.
        let (a, b, c) = (1.0 - f32::EPSILON, (1.0 + f32::EPSILON) / 16384.0, 1024.0 + 1.0 / 8192.0);
        let naive = (a as f64 * b as f64 + c as f64) as f32;
        assert_eq!(fused_in_f64(a, b, c), c);
        assert_eq!(a.mul_add(b, c), c);
        assert_ne!(naive, c, "the case must be one that rounding twice gets wrong");
        let tiny = f32::from_bits(1);
        for (a, b, c) in [
            (0.0, 0.0, -0.0),
            (-0.0, 1.0, 0.0),
            (tiny, 0.5, 0.0),
            (tiny, tiny, tiny),
            (f32::MAX, 2.0, -f32::MAX),
            (f32::MAX, 2.0, 0.0),
            (f32::INFINITY, 1.0, -f32::INFINITY),
            (f32::NAN, 1.0, 1.0),
            (3.0, f32::INFINITY, 1.0),
        ] {
            assert!(same(a.mul_add(b, c), fused_in_f64(a, b, c)), "{a:e} * {b:e} + {c:e}");
        }
    }
}

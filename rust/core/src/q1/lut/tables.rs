//! Lookup tables for 4 activations at a time.
//!
//! For group `g` (activations `a[4g..4g+4]`), entry `c` (bit `i` of `c` = sign of weight `4g+i`,
//! set = +) is `sum_i (bit_i(c) ? a_i : -a_i)`, an int16 in [-508, 508]. A group's table is 32
//! bytes: the 16 low bytes of the entries, then the 16 high bytes.

use super::super::Isa;

/// Bytes of one group's table.
pub const TABLE_BYTES: usize = 32;

/// The 16 exact entries of one group.
#[inline]
pub fn group_entries(a: &[i8]) -> [i16; 16] {
    let mut t = [0i16; 16];
    for (c, e) in t.iter_mut().enumerate() {
        *e = a
            .iter()
            .take(4)
            .enumerate()
            .map(|(i, &v)| if c >> i & 1 == 1 { i16::from(v) } else { -i16::from(v) })
            .sum();
    }
    t
}

/// Builds the tables of every group of `q` (`q.len() % 4 == 0`) into `out` (`q.len() / 4 * 32` bytes).
pub fn build_tables(q: &[i8], out: &mut [u8], isa: Isa) {
    assert_eq!(out.len(), q.len() / 4 * TABLE_BYTES);
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 is present (checked by `has_avx2`).
        return unsafe { x86::build_tables(q, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        // SAFETY: NEON is present (checked by `has_neon`).
        return unsafe { neon::build_tables(q, out) };
    }
    let _ = isa;
    build_tables_scalar(q, out)
}

/// [`build_tables`] in the AVX-512 GEMV's layout (`q.len() % 16 == 0`, `out`: `q.len() / 4 * 64`
/// bytes), on CPUs with AVX2 (every AVX-512 one).
#[cfg(target_arch = "x86_64")]
pub fn build_arranged_tables(q: &[i8], out: &mut [u8], isa: Isa) {
    assert!(q.len().is_multiple_of(16) && out.len() == q.len() / 4 * 2 * TABLE_BYTES);
    assert!(isa.has_avx2(), "the arranged tables need AVX2");
    // SAFETY: AVX2 is present (checked by `has_avx2`).
    unsafe { x86::build_arranged_tables(q, out) }
}

fn build_tables_scalar(q: &[i8], out: &mut [u8]) {
    for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
        for (c, e) in group_entries(a).iter().enumerate() {
            let [lo, hi] = e.to_le_bytes();
            table[c] = lo;
            table[16 + c] = hi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::TABLE_BYTES;

    /// Lane `c` of mask `i` is all ones when bit `i` of `c` is set (c = 0..16 across the two halves).
    #[inline(always)]
    unsafe fn bit_masks() -> [__m256i; 4] {
        let bit = |i: i32| {
            let lane = |c: i32| if c >> i & 1 == 1 { -1i16 } else { 0 };
            _mm256_setr_epi16(
                lane(0),
                lane(1),
                lane(2),
                lane(3),
                lane(4),
                lane(5),
                lane(6),
                lane(7),
                lane(8),
                lane(9),
                lane(10),
                lane(11),
                lane(12),
                lane(13),
                lane(14),
                lane(15),
            )
        };
        [bit(0), bit(1), bit(2), bit(3)]
    }

    /// One group's table (`a`: its 4 activations) as [16 low bytes | 16 high bytes]: entry `c` =
    /// `2 * sum_{i: bit i of c} a_i - sum_i a_i`.
    #[inline(always)]
    unsafe fn group_planes(a: &[i8], masks: &[__m256i; 4]) -> __m256i {
        let mut set = _mm256_setzero_si256();
        for (m, &v) in masks.iter().zip(a) {
            set = _mm256_add_epi16(set, _mm256_and_si256(*m, _mm256_set1_epi16(i16::from(v))));
        }
        let all = _mm256_set1_epi16(a.iter().map(|&v| i16::from(v)).sum());
        let t = _mm256_sub_epi16(_mm256_add_epi16(set, set), all);
        let lo = _mm256_and_si256(t, _mm256_set1_epi16(0xff));
        let hi = _mm256_srli_epi16::<8>(t);
        // packus works per 128-bit half: [lo 0..8, hi 0..8 | lo 8..16, hi 8..16].
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(lo, hi))
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn build_tables(q: &[i8], out: &mut [u8]) {
        let masks = bit_masks();
        for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
            _mm256_storeu_si256(table.as_mut_ptr().cast(), group_planes(a, &masks));
        }
    }

    /// The tables of `q` straight in the AVX-512 GEMV's layout (see `avx512::arrange_tables`): per 4
    /// groups, 4 vectors of 64 bytes, vector `2 * (j % 2) + plane` holding group `j`'s plane twice at
    /// byte `32 * (j / 2)`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn build_arranged_tables(q: &[i8], out: &mut [u8]) {
        let masks = bit_masks();
        for (a, dst) in q.chunks_exact(16).zip(out.chunks_exact_mut(4 * 2 * TABLE_BYTES)) {
            for (j, a) in a.chunks_exact(4).enumerate() {
                let planes = group_planes(a, &masks);
                let at = dst.as_mut_ptr().add(2 * (j % 2) * 64 + 32 * (j / 2));
                _mm256_storeu_si256(at.cast(), _mm256_permute4x64_epi64::<0b01_00_01_00>(planes));
                _mm256_storeu_si256(at.add(64).cast(), _mm256_permute4x64_epi64::<0b11_10_11_10>(planes));
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::TABLE_BYTES;

    /// Lane `c` of `SIGNS[i]` is the sign of activation `i` in entry `c`: +1 when bit `i` of `c` is set.
    const SIGNS: [[i16; 16]; 4] = {
        let mut s = [[0i16; 16]; 4];
        let mut i = 0;
        while i < 4 {
            let mut c = 0;
            while c < 16 {
                s[i][c] = if c >> i & 1 == 1 { 1 } else { -1 };
                c += 1;
            }
            i += 1;
        }
        s
    };

    /// Entry `c` = `sum_i sign_i(c) * a_i` (exact in int16), entries 0..8 and 8..16 in two vectors;
    /// `vuzp1q_u8` / `vuzp2q_u8` split them into the low-byte and high-byte planes.
    #[target_feature(enable = "neon")]
    pub unsafe fn build_tables(q: &[i8], out: &mut [u8]) {
        let signs = SIGNS.map(|s| [vld1q_s16(s.as_ptr()), vld1q_s16(s.as_ptr().add(8))]);
        for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
            let mut t = [vdupq_n_s16(0); 2];
            for (s, &v) in signs.iter().zip(a) {
                t[0] = vmlaq_n_s16(t[0], s[0], i16::from(v));
                t[1] = vmlaq_n_s16(t[1], s[1], i16::from(v));
            }
            let (b0, b1) = (vreinterpretq_u8_s16(t[0]), vreinterpretq_u8_s16(t[1]));
            vst1q_u8(table.as_mut_ptr(), vuzp1q_u8(b0, b1));
            vst1q_u8(table.as_mut_ptr().add(16), vuzp2q_u8(b0, b1));
        }
    }
}

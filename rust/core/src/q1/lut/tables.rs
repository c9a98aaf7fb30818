//! Lookup tables for 4 activations at a time.
//!
//! For group `g` (activations `a[4g..4g+4]`), entry `c` (bit `i` of `c` = sign of weight `4g+i`,
//! set = +) is `sum_i (bit_i(c) ? a_i : -a_i)`, exact in int16 because its magnitude is at most the
//! block's L1 norm (`act::L1_MAX`). A group's table is 32 bytes: the 16 low bytes of the entries,
//! then the 16 high bytes. Builders may overflow int16 on the way (wrapping); an entry is then still
//! exact, being its true value modulo 2^16 and within int16.

use super::super::Isa;

/// Bytes of one group's table.
pub const TABLE_BYTES: usize = 32;

/// The 16 exact entries of one group.
#[inline]
pub fn group_entries(a: &[i16]) -> [i16; 16] {
    std::array::from_fn(|c| {
        let signed =
            a.iter().take(4).enumerate().map(|(i, &v)| if c >> i & 1 == 1 { i32::from(v) } else { -i32::from(v) });
        signed.sum::<i32>() as i16
    })
}

/// Builds the tables of every group of `q` (`q.len() % 4 == 0`) into `out` (`q.len() / 4 * 32` bytes).
pub fn build_tables(q: &[i16], out: &mut [u8], isa: Isa) {
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
/// bytes), for CPUs with AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
pub fn build_arranged_tables(q: &[i16], out: &mut [u8], isa: Isa) {
    assert!(q.len().is_multiple_of(16) && out.len() == q.len() / 4 * 2 * TABLE_BYTES);
    assert!(isa.has_avx512(), "the arranged tables need AVX-512 F/BW");
    // SAFETY: AVX-512 F/BW are present (checked by `has_avx512`).
    unsafe { x86::build_arranged_tables(q, out) }
}

fn build_tables_scalar(q: &[i16], out: &mut [u8]) {
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

    /// Entry `c` = `2 * sum_{i: bit i of c} a_i - sum_i a_i` (wrapping), eight entries per 128-bit half.
    #[target_feature(enable = "avx2")]
    pub unsafe fn build_tables(q: &[i16], out: &mut [u8]) {
        // Lane c of mask i is all ones when bit i of c is set (c = 0..16 across the two halves).
        let bit = |i: usize| {
            let lanes: [i16; 16] = std::array::from_fn(|c| if c >> i & 1 == 1 { -1 } else { 0 });
            _mm256_loadu_si256(lanes.as_ptr().cast())
        };
        let masks = [bit(0), bit(1), bit(2), bit(3)];
        let low_byte = _mm256_set1_epi16(0xff);
        for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
            let mut set = _mm256_setzero_si256();
            for (m, &v) in masks.iter().zip(a) {
                set = _mm256_add_epi16(set, _mm256_and_si256(*m, _mm256_set1_epi16(v)));
            }
            let all = _mm256_set1_epi16(a.iter().fold(0i16, |s, &v| s.wrapping_add(v)));
            let t = _mm256_sub_epi16(_mm256_add_epi16(set, set), all);
            let lo = _mm256_and_si256(t, low_byte);
            let hi = _mm256_srli_epi16::<8>(t);
            // packus/packs work per 128-bit half: [lo 0..8, hi 0..8 | lo 8..16, hi 8..16].
            let lo = _mm256_packus_epi16(lo, hi);
            let planes = _mm256_permute4x64_epi64::<0b11_01_10_00>(lo);
            _mm256_storeu_si256(table.as_mut_ptr().cast(), planes);
        }
    }

    /// Bit `w` of `BIT_LANES[i]` is bit `i` of entry `w % 16` (lanes 0..16 hold group 0's entries,
    /// 16..32 group 1's).
    const BIT_LANES: [u32; 4] = [0xaaaa_aaaa, 0xcccc_cccc, 0xf0f0_f0f0, 0xff00_ff00];

    /// Lane `w` of `pick(i)` selects activation `i` of the pair's group `w / 16` (of the 8 loaded).
    fn pick(i: usize) -> [u16; 32] {
        std::array::from_fn(|w| (4 * (w / 16) + i) as u16)
    }

    /// The entries of two groups (`pair`: their 8 activations) as int16: lanes 0..16 group 0, 16..32
    /// group 1. `P_c = sum_{bit i of c} a_i` by four masked adds, then `T_c = 2 P_c - P_15`
    /// (wrapping: exact, see the module doc).
    #[inline(always)]
    unsafe fn pair_entries(pair: &[i16], picks: &[__m512i; 4], last: __m512i) -> __m512i {
        let a = _mm512_castsi128_si512(_mm_loadu_si128(pair.as_ptr().cast()));
        let mut p = _mm512_setzero_si512();
        for (&lanes, pick) in BIT_LANES.iter().zip(picks) {
            p = _mm512_mask_add_epi16(p, lanes, p, _mm512_permutexvar_epi16(*pick, a));
        }
        _mm512_sub_epi16(_mm512_add_epi16(p, p), _mm512_permutexvar_epi16(last, p))
    }

    /// The tables of `q` straight in the AVX-512 GEMV's layout (see `avx512::arrange_tables`): per 4
    /// groups, 4 vectors of 64 bytes, vector `2 * (j % 2) + plane` holding group `j`'s plane twice at
    /// byte `32 * (j / 2)`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn build_arranged_tables(q: &[i16], out: &mut [u8]) {
        let load = |w: [u16; 32]| _mm512_loadu_si512(w.as_ptr().cast());
        let picks = [load(pick(0)), load(pick(1)), load(pick(2)), load(pick(3))];
        let last = load(std::array::from_fn(|w| (16 * (w / 16) + 15) as u16));
        for (a, dst) in q.chunks_exact(16).zip(out.chunks_exact_mut(4 * 2 * TABLE_BYTES)) {
            let (t01, t23) = (pair_entries(&a[..8], &picks, last), pair_entries(&a[8..], &picks, last));
            let planes = |t01: __m512i, t23: __m512i| {
                // [g0, g1, g2, g3] (16 bytes each), then [g0, g0, g2, g2] and [g1, g1, g3, g3].
                let z = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm512_cvtepi16_epi8(t01)),
                    _mm512_cvtepi16_epi8(t23),
                );
                (_mm512_shuffle_i64x2::<0b10_10_00_00>(z, z), _mm512_shuffle_i64x2::<0b11_11_01_01>(z, z))
            };
            let (lo02, lo13) = planes(t01, t23);
            let (hi02, hi13) = planes(_mm512_srai_epi16::<8>(t01), _mm512_srai_epi16::<8>(t23));
            let d = dst.as_mut_ptr();
            _mm512_storeu_si512(d.cast(), lo02);
            _mm512_storeu_si512(d.add(64).cast(), hi02);
            _mm512_storeu_si512(d.add(128).cast(), lo13);
            _mm512_storeu_si512(d.add(192).cast(), hi13);
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

    /// Entry `c` = `sum_i sign_i(c) * a_i` (wrapping, exact: see the module doc), entries 0..8 and 8..16 in two vectors;
    /// `vuzp1q_u8` / `vuzp2q_u8` split them into the low-byte and high-byte planes.
    #[target_feature(enable = "neon")]
    pub unsafe fn build_tables(q: &[i16], out: &mut [u8]) {
        let signs = SIGNS.map(|s| [vld1q_s16(s.as_ptr()), vld1q_s16(s.as_ptr().add(8))]);
        for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
            let mut t = [vdupq_n_s16(0); 2];
            for (s, &v) in signs.iter().zip(a) {
                t[0] = vmlaq_n_s16(t[0], s[0], v);
                t[1] = vmlaq_n_s16(t[1], s[1], v);
            }
            let (b0, b1) = (vreinterpretq_u8_s16(t[0]), vreinterpretq_u8_s16(t[1]));
            vst1q_u8(table.as_mut_ptr(), vuzp1q_u8(b0, b1));
            vst1q_u8(table.as_mut_ptr().add(16), vuzp2q_u8(b0, b1));
        }
    }
}

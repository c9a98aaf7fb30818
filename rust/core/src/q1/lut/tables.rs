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
/// bytes), for CPUs with AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
pub fn build_arranged_tables(q: &[i8], out: &mut [u8], isa: Isa) {
    assert!(q.len().is_multiple_of(16) && out.len() == q.len() / 4 * 2 * TABLE_BYTES);
    assert!(isa.has_avx512(), "the arranged tables need AVX-512 F/BW");
    // SAFETY: AVX-512 F/BW are present (checked by `has_avx512`).
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

    /// Entry `c` = `2 * sum_{i: bit i of c} a_i - sum_i a_i`, eight entries per 128-bit half.
    #[target_feature(enable = "avx2")]
    pub unsafe fn build_tables(q: &[i8], out: &mut [u8]) {
        // Lane c of mask i is all ones when bit i of c is set (c = 0..16 across the two halves).
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
        let masks = [bit(0), bit(1), bit(2), bit(3)];
        let low_byte = _mm256_set1_epi16(0xff);
        for (a, table) in q.chunks_exact(4).zip(out.chunks_exact_mut(TABLE_BYTES)) {
            let mut set = _mm256_setzero_si256();
            for (m, &v) in masks.iter().zip(a) {
                set = _mm256_add_epi16(set, _mm256_and_si256(*m, _mm256_set1_epi16(i16::from(v))));
            }
            let all = _mm256_set1_epi16(a.iter().map(|&v| i16::from(v)).sum());
            let t = _mm256_sub_epi16(_mm256_add_epi16(set, set), all);
            let lo = _mm256_and_si256(t, low_byte);
            let hi = _mm256_srli_epi16::<8>(t);
            // packus/packs work per 128-bit half: [lo 0..8, hi 0..8 | lo 8..16, hi 8..16].
            let lo = _mm256_packus_epi16(lo, hi);
            let planes = _mm256_permute4x64_epi64::<0b11_01_10_00>(lo);
            _mm256_storeu_si256(table.as_mut_ptr().cast(), planes);
        }
    }

    /// Byte `2w + j` (`j` = 0, 1) of `bits(i)`: bit `i + j` of entry `w % 16`, as 0 or 1: the
    /// unsigned side of `vpmaddubsw` picking activations `i` and `i + 1` of each entry.
    fn bits(i: usize) -> [u8; 64] {
        std::array::from_fn(|b| ((b / 2 % 16) >> (i + b % 2) & 1) as u8)
    }

    /// Byte control of `vpshufb` giving each 16-bit lane of 128-bit lane `l` the activations `i, i + 1`
    /// of group `l / 2` of a pair (bytes `4 (l / 2) + i` and `+ 1` of the broadcast 8 bytes).
    fn pick(i: usize) -> [u8; 64] {
        std::array::from_fn(|b| (4 * (b / 32) + i + b % 2) as u8)
    }

    /// The entries of two groups (`pair`: their 8 activations) as int16: lanes 0..16 group 0, 16..32
    /// group 1. `P_c = sum_{bit i of c} a_i` by two `vpmaddubsw` (0/1 times int8: exact), then
    /// `T_c = 2 P_c - P_15`.
    #[inline(always)]
    unsafe fn pair_entries(pair: &[i8], k: &[__m512i; 5]) -> __m512i {
        let a = _mm512_set1_epi64(i64::from_le_bytes(std::array::from_fn(|i| pair[i] as u8)));
        let p01 = _mm512_maddubs_epi16(k[0], _mm512_shuffle_epi8(a, k[2]));
        let p23 = _mm512_maddubs_epi16(k[1], _mm512_shuffle_epi8(a, k[3]));
        let p = _mm512_add_epi16(p01, p23);
        _mm512_sub_epi16(_mm512_add_epi16(p, p), _mm512_permutexvar_epi16(k[4], p))
    }

    /// The tables of `q` straight in the AVX-512 GEMV's layout (see `avx512::arrange_tables`): per 4
    /// groups, 4 vectors of 64 bytes, vector `2 * (j % 2) + plane` holding group `j`'s plane twice at
    /// byte `32 * (j / 2)`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn build_arranged_tables(q: &[i8], out: &mut [u8]) {
        let load = |b: [u8; 64]| _mm512_loadu_si512(b.as_ptr().cast());
        let last: [u16; 32] = std::array::from_fn(|w| (16 * (w / 16) + 15) as u16);
        let k = [load(bits(0)), load(bits(2)), load(pick(0)), load(pick(2)), _mm512_loadu_si512(last.as_ptr().cast())];
        for (a, dst) in q.chunks_exact(16).zip(out.chunks_exact_mut(4 * 2 * TABLE_BYTES)) {
            let (t01, t23) = (pair_entries(&a[..8], &k), pair_entries(&a[8..], &k));
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

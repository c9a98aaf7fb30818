//! AVX-512 (BW) LUT GEMV. One 64-byte load covers two chunks of the packed layout (32 rows x 4
//! weight groups); `vpshufb` on 512 bits looks up per 128-bit lane, so the tables are arranged per
//! load as [group 4m, 4m, 4m+2, 4m+2] for the low nibbles and [4m+1, 4m+1, 4m+3, 4m+3] for the high
//! nibbles, low-byte and high-byte planes each (256 bytes per 4 groups).
//!
//! After a block, the two 256-bit halves of each accumulator hold the same rows (different groups)
//! and are added, giving exactly the AVX2 accumulator; each int16 lane sums at most 32 groups.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{prefetch_ahead, scale_block};
use super::{LutPacked, TABLE_BYTES, TILE_BLOCK_BYTES, TILE_ROWS};

/// Bytes of arranged tables per group.
pub const ARRANGED_BYTES: usize = 2 * TABLE_BYTES;

/// Rearranges generic tables (see `tables.rs`) into this kernel's layout: the definition of the
/// layout, against which `tables::build_arranged_tables` (what the GEMV runs) is tested.
#[cfg(test)]
fn arrange_tables(generic: &[u8], out: &mut Vec<u8>) {
    let groups = generic.len() / TABLE_BYTES;
    assert_eq!(groups % 4, 0);
    // Every byte is written below: a reused buffer of the right size needs no clearing.
    out.resize(groups * ARRANGED_BYTES, 0);
    for (src, dst) in generic.chunks_exact(4 * TABLE_BYTES).zip(out.chunks_exact_mut(4 * ARRANGED_BYTES)) {
        let plane = |g: usize, p: usize| &src[g * TABLE_BYTES + 16 * p..][..16];
        // dst vector v (64 bytes) = [nibble (v/2: 0 low, 1 high)], [plane v%2]; lanes 0,1 from group
        // `nib`, lanes 2,3 from group `nib + 2`.
        for v in 0..4 {
            let (nib, p) = (v / 2, v % 2);
            for lane in 0..4 {
                let g = nib + if lane < 2 { 0 } else { 2 };
                dst[v * 64 + lane * 16..][..16].copy_from_slice(plane(g, p));
            }
        }
    }
}

/// Adds the entries of the four groups of chunks `2m, 2m + 1` (indices `i0`, `i1`) to `lo`/`hi`.
#[inline(always)]
unsafe fn accumulate_pair(i0: __m512i, i1: __m512i, tt: *const u8, acc: &mut [__m512i; 2]) {
    let l0 = _mm512_shuffle_epi8(_mm512_loadu_si512(tt.cast()), i0);
    let h0 = _mm512_shuffle_epi8(_mm512_loadu_si512(tt.add(64).cast()), i0);
    let l1 = _mm512_shuffle_epi8(_mm512_loadu_si512(tt.add(128).cast()), i1);
    let h1 = _mm512_shuffle_epi8(_mm512_loadu_si512(tt.add(192).cast()), i1);
    acc[0] = _mm512_add_epi16(acc[0], _mm512_add_epi16(_mm512_unpacklo_epi8(l0, h0), _mm512_unpacklo_epi8(l1, h1)));
    acc[1] = _mm512_add_epi16(acc[1], _mm512_add_epi16(_mm512_unpackhi_epi8(l0, h0), _mm512_unpackhi_epi8(l1, h1)));
}

#[inline(always)]
unsafe fn indices(bits: *const u8, m: usize) -> (__m512i, __m512i) {
    let nibble = _mm512_set1_epi8(0x0f);
    let v = _mm512_loadu_si512(bits.add(64 * m).cast());
    (_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble))
}

/// Both 256-bit halves hold the same rows: their sum is the AVX2 accumulator.
#[inline(always)]
unsafe fn fold(acc: &[__m512i; 2]) -> [__m256i; 2] {
    let f = |v: __m512i| _mm256_add_epi16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    [f(acc[0]), f(acc[1])]
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn gemv_tile(p: &LutPacked, t: usize, tables: *const u8, scales: &[f32], out: &mut [f32]) {
    let mut facc = [_mm256_setzero_ps(); 4];
    for (b, &da) in scales.iter().enumerate() {
        let bits = p.bits.as_ptr().add((t * p.kb + b) * TILE_BLOCK_BYTES);
        prefetch_ahead(p, t, b);
        let mut acc = [_mm512_setzero_si512(); 2];
        for m in 0..8 {
            let (i0, i1) = indices(bits, m);
            accumulate_pair(i0, i1, tables.add((b * 8 + m) * 4 * ARRANGED_BYTES), &mut acc);
        }
        scale_block(&fold(&acc), p.tile_block_scales(t, b).as_ptr(), da, &mut facc);
    }
    for (q, f) in facc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * q), *f);
    }
}

/// Rows of `tiles` against one activation row's arranged tables.
pub fn gemv_tiles(p: &LutPacked, tiles: Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32]) {
    assert!(tables.len() >= p.kb * 32 * ARRANGED_BYTES && scales.len() >= p.kb);
    assert!(out.len() >= tiles.len() * TILE_ROWS && tiles.end <= p.tiles);
    for (ti, t) in tiles.enumerate() {
        // SAFETY: the caller checked AVX-512 F/BW and AVX2/FMA/F16C; reads are within the asserted lengths.
        unsafe { gemv_tile(p, t, tables.as_ptr(), &scales[..p.kb], &mut out[ti * TILE_ROWS..][..TILE_ROWS]) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::tables::{build_arranged_tables, build_tables};
    use super::*;
    use crate::kv::hash::random_seed;
    use crate::q1::Isa;
    use crate::sample::Rng;

    #[test]
    fn arranged_tables_are_the_generic_ones_rearranged() {
        let isa = Isa::detect();
        if !isa.has_avx512() {
            return;
        }
        let mut rng = Rng::new(random_seed());
        for k in [16usize, 128, 2048] {
            // Any int16 values: both builders wrap alike (the quantizer's L1 bound makes them exact).
            let mut q: Vec<i16> = (0..k).map(|_| rng.next_u64() as i16).collect();
            q[0] = i16::MAX;
            q[k - 1] = i16::MIN;
            let mut generic = vec![0u8; k / 4 * TABLE_BYTES];
            build_tables(&q, &mut generic, Isa::Scalar);
            let mut want = Vec::new();
            arrange_tables(&generic, &mut want);
            let mut got = vec![0u8; k / 4 * ARRANGED_BYTES];
            build_arranged_tables(&q, &mut got, isa);
            assert!(got == want, "k = {k}");
        }
    }
}

//! Quantized activations rearranged once per GEMM into the tile unit's layout: activation rows in
//! groups of 16 (the last group padded with zero rows); each Q1 block's 128 int16 values as two
//! signed byte planes (`q = 256 * high + low`, `act::byte_planes`), each plane two 1 KiB tiles where
//! byte `64 * (k / 4) + 4 * n + k % 4` is value `k` of row `n`; and each block's 16 scales side by
//! side. The bytes live in a buffer each thread keeps for its next GEMM (prefill's run to megabytes,
//! and a fresh allocation that size costs its page faults every call).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::unit::TILE_BYTES;
use crate::pool::Pool;
use crate::q1::act::QuantizedActs;
use crate::q1::BLOCK_WEIGHTS;

/// Activation rows per tile.
pub const TILE_COLS: usize = 16;

/// Bytes of one block of one group: two planes (high, then low) of two tiles.
pub const BLOCK_BYTES: usize = 2 * 2 * TILE_BYTES;

thread_local! {
    /// The tile bytes of this thread's last GEMM, kept for its next one.
    static SPARE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

pub struct ActTiles {
    /// Groups of 16 activation rows.
    pub groups: usize,
    /// Activation rows in all (the last group may hold fewer than 16).
    pub n: usize,
    kb: usize,
    /// At least `groups * kb * BLOCK_BYTES` bytes (the thread's spare buffer; the rest is unused).
    bytes: Vec<u8>,
    scales: Vec<f32>,
}

impl ActTiles {
    /// Rearranges `acts`, a group of 16 rows per pool task (prefill runs hundreds of rows).
    ///
    /// # Panics
    /// Without AVX-512 (F, BW).
    pub fn new(acts: &QuantizedActs, pool: &Pool) -> ActTiles {
        assert!(
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"),
            "the AMX GEMM's activation layout needs AVX-512"
        );
        let kb = acts.blocks_per_row();
        debug_assert_eq!(acts.k, kb * BLOCK_WEIGHTS);
        let groups = acts.n.div_ceil(TILE_COLS);
        let len = groups * kb * BLOCK_BYTES;
        let mut bytes = SPARE.with_borrow_mut(std::mem::take);
        if bytes.len() < len {
            bytes.resize(len, 0);
        }
        pool.for_each_row_mut(&mut bytes[..len], kb * BLOCK_BYTES, 1, |g, group| {
            let rows = g * TILE_COLS..((g + 1) * TILE_COLS).min(acts.n);
            if rows.len() < TILE_COLS {
                group.fill(0); // the padding rows' products must be zero
            }
            for i in rows {
                // SAFETY: AVX-512 F and BW were checked above.
                unsafe { place_row(acts.row(i), i % TILE_COLS, group) };
            }
        });
        let mut scales = vec![0f32; groups * kb * TILE_COLS];
        for i in 0..acts.n {
            let (g, n) = (i / TILE_COLS, i % TILE_COLS);
            for b in 0..kb {
                scales[(g * kb + b) * TILE_COLS + n] = acts.scale[i * kb + b];
            }
        }
        ActTiles { groups, n: acts.n, kb, bytes, scales }
    }

    /// The four tiles of block `b` of group `g` (4 KiB: the high plane's two, then the low one's).
    pub fn block(&self, g: usize, b: usize) -> *const u8 {
        self.bytes[(g * self.kb + b) * BLOCK_BYTES..][..BLOCK_BYTES].as_ptr()
    }

    /// The scales of block `b` for the 16 rows of group `g` (zero for padding rows).
    pub fn scales(&self, g: usize, b: usize) -> &[f32; TILE_COLS] {
        self.scales[(g * self.kb + b) * TILE_COLS..][..TILE_COLS].try_into().expect("16 scales")
    }

    /// Real activation rows in group `g`.
    pub fn rows_in(&self, g: usize) -> usize {
        (self.n - g * TILE_COLS).min(TILE_COLS)
    }
}

impl Drop for ActTiles {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        SPARE.with_borrow_mut(|spare| {
            if bytes.len() > spare.len() {
                *spare = bytes;
            }
        });
    }
}

/// Copies one activation row into column `n` of its group's tiles, 64 values (one tile) at a time:
/// value `k` of a tile goes to byte `64 * (k / 4) + 4 * n + k % 4` of that tile in each plane, so
/// each plane's 16 four-byte pieces are scattered 64 bytes apart.
///
/// # Safety
/// AVX-512 F and BW are available.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn place_row(row: &[i16], n: usize, group: &mut [u8]) {
    assert!(n < TILE_COLS && row.len().is_multiple_of(BLOCK_WEIGHTS));
    assert_eq!(group.len(), TILE_COLS * 2 * row.len(), "a group holds 16 rows' two planes");
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(64),
    );
    for (t, values) in row.chunks_exact(64).enumerate() {
        let (b, tile) = (t / 2, t % 2);
        let (high, low) = tile_planes(values);
        let at = group.as_mut_ptr().add(b * BLOCK_BYTES + tile * TILE_BYTES + 4 * n);
        _mm512_i32scatter_epi32::<1>(at.cast(), offsets, high);
        _mm512_i32scatter_epi32::<1>(at.add(2 * TILE_BYTES).cast(), offsets, low);
    }
}

/// The high and low byte planes of 64 int16 values (as `act::byte_planes`: `low = q as i8`,
/// `high = (q - low) >> 8`), each as 64 bytes in order.
#[inline(always)]
unsafe fn tile_planes(values: &[i16]) -> (__m512i, __m512i) {
    let halves = [0, 32].map(|i| {
        let q = _mm512_loadu_si512(values[i..i + 32].as_ptr().cast());
        let low = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(q));
        let high = _mm512_srai_epi16::<8>(_mm512_sub_epi16(q, low));
        (_mm512_cvtepi16_epi8(high), _mm512_cvtepi16_epi8(low))
    });
    let join = |a: __m256i, b: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    (join(halves[0].0, halves[1].0), join(halves[0].1, halves[1].1))
}

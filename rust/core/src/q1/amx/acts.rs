//! Quantized activations rearranged once per GEMM into the tile unit's layout: activation rows in
//! groups of 16 (the last group padded with zero rows), each Q1 block's 128 values as two 1 KiB
//! tiles where byte `64 * (k / 4) + 4 * n + k % 4` is value `k` of row `n`; and each block's 16
//! scales side by side.

use super::unit::TILE_BYTES;
use crate::pool::Pool;
use crate::q1::act::QuantizedActs;
use crate::q1::BLOCK_WEIGHTS;

/// Activation rows per tile.
pub const TILE_COLS: usize = 16;

pub struct ActTiles {
    /// Groups of 16 activation rows.
    pub groups: usize,
    /// Activation rows in all (the last group may hold fewer than 16).
    pub n: usize,
    kb: usize,
    bytes: Vec<u8>,
    scales: Vec<f32>,
}

impl ActTiles {
    /// Rearranges `acts`, a group of 16 rows per pool task (prefill runs hundreds of rows).
    pub fn new(acts: &QuantizedActs, pool: &Pool) -> ActTiles {
        let kb = acts.blocks_per_row();
        debug_assert_eq!(acts.k, kb * BLOCK_WEIGHTS);
        let groups = acts.n.div_ceil(TILE_COLS);
        let mut bytes = vec![0u8; groups * kb * 2 * TILE_BYTES];
        pool.for_each_row_mut(&mut bytes, kb * 2 * TILE_BYTES, 1, |g, group| {
            for i in g * TILE_COLS..((g + 1) * TILE_COLS).min(acts.n) {
                place_row(acts.row(i), i % TILE_COLS, group);
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

    /// The two tiles of block `b` of group `g` (2 KiB).
    pub fn block(&self, g: usize, b: usize) -> *const u8 {
        self.bytes[(g * self.kb + b) * 2 * TILE_BYTES..][..2 * TILE_BYTES].as_ptr()
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

/// Copies one activation row into column `n` of its group's tiles, four values (one tile-row
/// entry) at a time: values `4q..4q + 4` go to tile `q / 16`, row `q % 16`.
fn place_row(row: &[i8], n: usize, group: &mut [u8]) {
    assert!(n < TILE_COLS && row.len().is_multiple_of(64));
    assert_eq!(group.len(), TILE_COLS * row.len(), "a group holds 16 rows' values");
    let (src, dst) = (row.as_ptr(), group.as_mut_ptr());
    for q in 0..row.len() / 4 {
        let at = (q / 16) * TILE_BYTES + 64 * (q % 16) + 4 * n;
        // SAFETY: `4q + 4 <= row.len()`; `at + 4 <= 16 * row.len()` (tile `q / 16` of `row.len() / 64`,
        // row 15 and column 15 at most), which is `group.len()`.
        unsafe { dst.add(at).cast::<u32>().write_unaligned(src.add(4 * q).cast::<u32>().read_unaligned()) }
    }
}

//! Quantized activations rearranged once per GEMM into the tile unit's layout: activation rows in
//! groups of 16 (the last group padded with zero rows); each Q1 block's 128 int16 values as two
//! signed byte planes (`q = 256 * high + low`, `act::byte_planes`), each plane two 1 KiB tiles where
//! byte `64 * (k / 4) + 4 * n + k % 4` is value `k` of row `n`; and each block's 16 scales side by
//! side.

use super::unit::TILE_BYTES;
use crate::pool::Pool;
use crate::q1::act::{byte_planes, QuantizedActs};
use crate::q1::BLOCK_WEIGHTS;

/// Activation rows per tile.
pub const TILE_COLS: usize = 16;

/// The byte planes of a block, in the order [`ActTiles::block`] stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plane {
    High = 0,
    Low = 1,
}

/// Bytes of one block of one group: two planes of two tiles.
const BLOCK_BYTES: usize = 2 * 2 * TILE_BYTES;

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
        let mut bytes = vec![0u8; groups * kb * BLOCK_BYTES];
        pool.for_each_row_mut(&mut bytes, kb * BLOCK_BYTES, 1, |g, group| {
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

    /// The two tiles of `plane` of block `b` of group `g` (2 KiB).
    pub fn block(&self, g: usize, b: usize, plane: Plane) -> *const u8 {
        self.bytes[(g * self.kb + b) * BLOCK_BYTES + plane as usize * 2 * TILE_BYTES..][..2 * TILE_BYTES].as_ptr()
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
/// entry) at a time: values `4q..4q + 4` of block `q / 32` go to tile `q / 16 % 2` of each plane,
/// row `q % 16`.
fn place_row(row: &[i16], n: usize, group: &mut [u8]) {
    assert!(n < TILE_COLS && row.len().is_multiple_of(BLOCK_WEIGHTS));
    assert_eq!(group.len(), TILE_COLS * 2 * row.len(), "a group holds 16 rows' two planes");
    for (q, four) in row.chunks_exact(4).enumerate() {
        let (b, tile) = (q / 32, q / 16 % 2);
        let at = b * BLOCK_BYTES + tile * TILE_BYTES + 64 * (q % 16) + 4 * n;
        for (i, &v) in four.iter().enumerate() {
            let (high, low) = byte_planes(v);
            group[at + i] = high as u8;
            group[at + 2 * TILE_BYTES + i] = low as u8;
        }
    }
}

//! The lookup-table (LUT) kernels: T-MAC / BitNet-TL style GEMV and small GEMM.
//!
//! Weights are repacked once into tiles of 32 rows ([`LutPacked`]). For every group of 4 int16
//! activations the kernels build the exact 16-entry table of `±a0 ±a1 ±a2 ±a3` (int16, stored as a
//! low-byte plane and a high-byte plane); one byte shuffle then looks up 4 weights of many rows at
//! once. Within a 128-block the int16 sums are exact: any partial signed sum of a block's values is
//! at most its L1 norm, which the quantizer bounds by `act::L1_MAX` = 32639 (and the int16 adds
//! wrap, so only the final sum needs the bound). Each block's exact integer sum is scaled as
//! `acc = fma(isum, d_w * d_a, acc)`, the same operation in the same order as every other kernel, so
//! all of them agree bit for bit.
//!
//! On AVX-512 CPUs the small GEMM is [`perm`]'s instead: 64-entry int16 tables of 6 activations, one
//! `vpermt2w` looking up 6 weights of 32 rows, over the same packed bits (measured 1.2-1.6x the VNNI
//! GEMM on Zen 4 at every n >= 2). [`vnni`]'s kernel (`vpdpbusd` on decoded 0/2 weights, no tables)
//! stays reachable as [`vnni_gemm`]. All of them give the same bits.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pack;
#[cfg(target_arch = "x86_64")]
mod perm;
mod scalar;
mod tables;
#[cfg(target_arch = "x86_64")]
mod vnni;

pub use pack::{LutPacked, TILE_BLOCK_BYTES, TILE_ROWS};
pub use tables::{build_tables, TABLE_BYTES};

use super::act::QuantizedActs;
use super::par::SharedOut;
use super::Isa;
use crate::pool::Pool;
use std::ops::Range;

/// Columns of activations one GEMM pass handles together.
pub const GEMM_MAX_COLS: usize = 64;

/// `out[i, r] = sum_k w[r, k] * x[i, k]` for every activation row `i` separately (GEMV per row).
pub fn gemv(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    gemv_shared(&[p], acts, &mut [out], isa, pool)
}

/// [`gemv`] of several matrices with the same columns against the same activations (a layer's q, k
/// and v projections, say): one pool job per activation row covers the tiles of every matrix, and
/// each thread that takes a task builds the row's tables once for all of its tasks. Each output is
/// exactly what [`gemv`] gives alone.
///
/// Per thread, not once on the caller: tables built by one core and read by the other had to be
/// invalidated in the reader's cache line by line before the next build could write them, which made
/// the caller's build ~5% of a 2-thread decode step with the worker waiting on it.
pub fn gemv_shared(ps: &[&LutPacked], acts: &QuantizedActs, outs: &mut [&mut [f32]], isa: Isa, pool: &Pool) {
    assert_eq!(ps.len(), outs.len());
    assert!(ps.iter().all(|p| p.kb == acts.blocks_per_row()), "matrices of different widths");
    // Tile `first_tile[m] + t` of the job is tile `t` of matrix `m`.
    let first_tile: Vec<usize> = ps.iter().scan(0, |n, p| Some(std::mem::replace(n, *n + p.tiles))).collect();
    let total = ps.iter().map(|p| p.tiles).sum();
    for i in 0..acts.n {
        let run = next_table_run();
        let scales = &acts.scale[i * acts.blocks_per_row()..(i + 1) * acts.blocks_per_row()];
        let rows: Vec<SharedOut> =
            ps.iter().zip(outs.iter_mut()).map(|(p, o)| SharedOut::new(&mut o[i * p.rows..][..p.rows])).collect();
        pool.for_each_range(total, 1, |tiles| {
            TABLES.with_borrow_mut(|(built, buf)| {
                let tables = gemv_tables(acts.row(i), buf, isa, *built == run);
                *built = run;
                for (m, p) in ps.iter().enumerate() {
                    let local = tiles.start.max(first_tile[m])..tiles.end.min(first_tile[m] + p.tiles);
                    if !local.is_empty() {
                        let local = local.start - first_tile[m]..local.end - first_tile[m];
                        gemv_tiles_into(p, local, tables, scales, &rows[m], isa);
                    }
                }
            })
        });
    }
}

thread_local! {
    /// This thread's GEMV tables, reused across calls, and the run (see [`next_table_run`]) they were
    /// built for. They are rebuilt in full for every activation row, so only growing them writes
    /// zeros: fresh zeroed buffers per call were ~25 MB of memset per token of a 1.7B model.
    static TABLES: std::cell::RefCell<(u64, Vec<u8>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// [`perm`]'s GEMM tables of this thread, reused across calls like [`TABLES`]: which run of
    /// activation rows (see [`perm_gemm_shared`]) they hold, and how many halves.
    static PERM_TABLES: std::cell::RefCell<(u64, usize, Vec<perm::Half>)> =
        const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

/// Numbers the activation rows (GEMV) and runs of rows (perm GEMM) that threads build tables for,
/// so a thread knows whether the tables it holds are the current ones (0: none yet).
static TABLE_RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_table_run() -> u64 {
    TABLE_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Tiles `tiles` of `p` into their rows of `out_row` (one activation row's output): whole tiles in
/// place, a last tile with fewer real rows through a stack buffer. (A copy per tile, a `memcpy` call
/// each, was ~3% of a decode step: ~23k tiles per token of a 1.7B model.)
fn gemv_tiles_into(p: &LutPacked, tiles: Range<usize>, tables: &[u8], scales: &[f32], out_row: &SharedOut, isa: Isa) {
    let whole = tiles.start..tiles.end.min(p.rows / TILE_ROWS).max(tiles.start);
    if !whole.is_empty() {
        // SAFETY: each task owns the rows of its own tiles.
        let out = unsafe { out_row.slice_mut(whole.start * TILE_ROWS..whole.end * TILE_ROWS) };
        gemv_tiles(p, whole.clone(), tables, scales, out, isa);
    }
    for t in whole.end..tiles.end {
        let mut buf = [0f32; TILE_ROWS];
        gemv_tiles(p, t..t + 1, tables, scales, &mut buf, isa);
        // SAFETY: as above.
        unsafe { out_row.write(t * TILE_ROWS, &buf[..p.rows - t * TILE_ROWS]) };
    }
}

/// The tables of one activation row `q` in the layout the GEMV kernel of `isa` reads, in `buf`:
/// built there unless `built` says `buf` already holds them.
fn gemv_tables<'a>(q: &[i16], buf: &'a mut Vec<u8>, isa: Isa, built: bool) -> &'a [u8] {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() {
        let len = q.len() / 4 * avx512::ARRANGED_BYTES;
        buf.resize(buf.len().max(len), 0);
        if !built {
            tables::build_arranged_tables(q, &mut buf[..len], isa);
        }
        return &buf[..len];
    }
    let len = q.len() / 4 * TABLE_BYTES;
    buf.resize(buf.len().max(len), 0);
    if !built {
        build_tables(q, &mut buf[..len], isa);
    }
    &buf[..len]
}

fn gemv_tiles(p: &LutPacked, tiles: std::ops::Range<usize>, tables: &[u8], scales: &[f32], out: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() {
            return avx512::gemv_tiles(p, tiles, tables, scales, out);
        }
        if isa.has_avx2() {
            return avx2::gemv_tiles(p, tiles, tables, scales, out);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        return neon::gemv_tiles(p, tiles, tables, scales, out);
    }
    let _ = isa;
    scalar::gemv_tiles(p, tiles, tables, scales, out)
}

/// Small GEMM: like [`gemv`], but each tile of weights is decoded once for many activation rows:
/// [`perm`]'s 6-bit lookup kernel where the CPU has AVX-512, else [`lut_gemm`].
pub fn gemm(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    gemm_shared(&[p], acts, &mut [out], isa, pool)
}

/// [`gemm`] of several matrices with the same columns against the same activations (a layer's q, k
/// and v projections, say): on AVX-512 the lookup tables are built once per call for all of them.
/// Each output is exactly what [`gemm`] gives alone.
pub fn gemm_shared(ps: &[&LutPacked], acts: &QuantizedActs, outs: &mut [&mut [f32]], isa: Isa, pool: &Pool) {
    assert_eq!(ps.len(), outs.len());
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() {
        return perm_gemm_shared(ps, acts, outs, pool);
    }
    for (p, out) in ps.iter().zip(outs.iter_mut()) {
        lut_gemm(p, acts, out, isa, pool);
    }
}

/// The VNNI small GEMM ([`vnni`]) where the CPU has AVX-512 VNNI, else [`lut_gemm`].
pub fn vnni_gemm(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512_vnni() {
        for (cols, out) in column_chunks(p.rows, acts.n, out) {
            let chunk = vnni::BlockMajorActs::new(acts, cols.clone());
            split_tiles(p, cols.len(), out, pool, |tiles, buf| vnni::gemm_tiles(p, tiles, &chunk, buf));
        }
        return;
    }
    lut_gemm(p, acts, out, isa, pool)
}

/// Activation rows one run of [`perm`]'s GEMM takes. Each run streams the weights again, but at 16
/// rows its accumulators (16 tiles x 16 rows x 32 floats) and a pass's table reads stay close to L1;
/// runs of 64 kept 128 KiB of accumulators and read 180 KB of tables per block. Zen 4, 2 threads
/// unless said, runs of 16 against 64 (a throwaway env switch, alternated): memory-resident
/// `gemm_speed` at n = 64, 12288x2048 2541-2762 against 2856-2969 µs, 4096x2048 on 1 thread
/// 1766-1787 against 1992-2074; prefill of 512 tokens (`benches/step_speed.py --contexts 512`)
/// 299.9-300.3 against 266.4-269.1 tokens/s (1 thread: 164.8-170.2 against 156.1-156.2); 64
/// concurrent decodes 264-272 against 228-244 tokens/s. Runs of 12 to 24 measured alike
/// (BENCHMARKS.md, session 13).
#[cfg(target_arch = "x86_64")]
const PERM_RUN_COLS: usize = 16;

/// [`perm`]'s GEMM of every matrix of `ps`, in the fewest runs of at most [`PERM_RUN_COLS`]
/// activation rows, as equal as possible (17 rows are runs of 9 and 8, not 16 and 1). Every
/// thread that takes a task builds the run's tables itself, once, and keeps them for its other
/// tasks of the run (all matrices of `ps`): the tables are then written and read by one core. Built
/// by rows across the threads and read by all, they cost a cross-core transfer per line, which
/// made the build a tenth of a 16-row decode step. The caller checked AVX-512 (`Isa::has_avx512`).
#[cfg(target_arch = "x86_64")]
fn perm_gemm_shared(ps: &[&LutPacked], acts: &QuantizedActs, outs: &mut [&mut [f32]], pool: &Pool) {
    for cols in balanced_runs(acts.n, PERM_RUN_COLS) {
        let run = next_table_run();
        for (p, out) in ps.iter().zip(outs.iter_mut()) {
            let out = SharedOut::new(&mut out[cols.start * p.rows..cols.end * p.rows]);
            for_each_task_tiles(p, pool, |tiles| {
                PERM_TABLES.with_borrow_mut(|(built, len, halves)| {
                    if *built != run {
                        *len = perm::PermTables::fill(acts, cols.clone(), halves);
                        *built = run;
                    }
                    let tables = perm::PermTables::view(acts, cols.clone(), &halves[..*len]);
                    // SAFETY: the tasks' tile ranges are disjoint.
                    unsafe { perm::gemm_tiles(p, tiles, &tables, &out) }
                })
            });
        }
    }
}

/// The LUT small GEMM: like [`gemv`], but each tile of weights is decoded once for up to
/// [`GEMM_MAX_COLS`] activation rows.
pub fn lut_gemm(p: &LutPacked, acts: &QuantizedActs, out: &mut [f32], isa: Isa, pool: &Pool) {
    let groups = acts.k / 4;
    for (cols, out) in column_chunks(p.rows, acts.n, out) {
        let n = cols.len();
        let mut tables = vec![0u8; n * groups * TABLE_BYTES];
        for (j, t) in tables.chunks_exact_mut(groups * TABLE_BYTES).enumerate() {
            build_tables(acts.row(cols.start + j), t, isa);
        }
        let scales = &acts.scale[cols.start * p.kb..cols.end * p.kb];
        split_tiles(p, n, out, pool, |tiles, buf| gemm_tiles(p, tiles, n, &tables, scales, buf, isa));
    }
}

/// Splits `0..n` into the fewest runs of at most `most`, as equal as possible (the GEMM kernels' passes
/// over activation rows: balanced, so no pass is left with one row).
#[cfg(target_arch = "x86_64")]
fn balanced_runs(n: usize, most: usize) -> impl Iterator<Item = Range<usize>> {
    let count = n.div_ceil(most);
    (0..count).map(move |i| i * n / count..(i + 1) * n / count)
}

/// Runs of at most [`GEMM_MAX_COLS`] activation rows and their part of `out` (`rows` per row).
fn column_chunks(rows: usize, n: usize, out: &mut [f32]) -> impl Iterator<Item = (std::ops::Range<usize>, &mut [f32])> {
    out[..n * rows].chunks_mut(GEMM_MAX_COLS * rows).enumerate().map(move |(i, out)| {
        let first = i * GEMM_MAX_COLS;
        (first..first + out.len() / rows, out)
    })
}

/// Tiles per unit of the GEMMs' task split.
const TASK_UNIT_TILES: usize = 4;

/// The GEMMs' task split: `task(tiles)` for contiguous tile ranges covering all of `p`'s tiles.
/// Tasks take whole groups of `TASK_UNIT_TILES` tiles (the GEMMs' passes hold 4: a task ending
/// inside a group would run its last tiles in a narrower, slower pass), and every task streams all
/// of the activation rows' tables (perm-gemm: 22 bytes per activation per row), so a task is never
/// shorter than 2 groups (256 weight rows).
fn for_each_task_tiles(p: &LutPacked, pool: &Pool, task: impl Fn(std::ops::Range<usize>) + Sync) {
    let units = p.tiles.div_ceil(TASK_UNIT_TILES);
    pool.for_each_range(units, 2, |units| {
        task(units.start * TASK_UNIT_TILES..(units.end * TASK_UNIT_TILES).min(p.tiles));
    });
}

/// Splits the tiles across the pool for `n` activation rows: `kernel(tiles, buf)` fills
/// `buf[j * (tiles.len() * 32) + row]`, whose real rows are copied to `out[j * p.rows + row]`.
fn split_tiles(
    p: &LutPacked,
    n: usize,
    out: &mut [f32],
    pool: &Pool,
    kernel: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    let shared = SharedOut::new(out);
    for_each_task_tiles(p, pool, |tiles| {
        let rows = tiles.len() * TILE_ROWS;
        let mut buf = vec![0f32; n * rows];
        kernel(tiles.clone(), &mut buf);
        let r0 = tiles.start * TILE_ROWS;
        let valid = (tiles.end * TILE_ROWS).min(p.rows) - r0;
        for j in 0..n {
            // SAFETY: each task owns the rows of its own tiles, in every column.
            unsafe { shared.write(j * p.rows + r0, &buf[j * rows..j * rows + valid]) };
        }
    });
}

/// Writes `out[j * (tiles.len() * 32) + row]` for the `n` activation rows `j`.
fn gemm_tiles(
    p: &LutPacked,
    tiles: std::ops::Range<usize>,
    n: usize,
    tables: &[u8],
    scales: &[f32],
    out: &mut [f32],
    isa: Isa,
) {
    // The AVX2 GEMM also serves AVX-512 machines: a 512-bit version of it measured 20-40% slower
    // on Zen 4 (double-pumped 512-bit shuffles, twice the table bytes per column).
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        return avx2::gemm_tiles(p, tiles, n, tables, scales, out);
    }
    #[cfg(target_arch = "aarch64")]
    if isa.has_neon() {
        return neon::gemm_tiles(p, tiles, n, tables, scales, out);
    }
    let _ = isa;
    scalar::gemm_tiles(p, tiles, n, tables, scales, out)
}

/// The GEMV kernel that runs for `isa`, e.g. `"lut-avx512"`.
pub fn gemv_name(isa: Isa) -> String {
    format!("lut-{isa}")
}

/// The LUT family's small GEMM for `isa` ([`gemm_shared`]), e.g. `"perm-gemm-avx512"`: what
/// `Kernel::Gemm` runs where AMX does not (`matrix::gemm_name` names the one that runs).
pub fn gemm_name(isa: Isa) -> String {
    if isa.has_avx512() {
        return format!("perm-gemm-{isa}");
    }
    lut_gemm_name(isa)
}

/// The LUT small GEMM that runs for `isa` ([`lut_gemm`]).
pub fn lut_gemm_name(isa: Isa) -> String {
    let code = if isa == Isa::Avx512 { Isa::Avx2 } else { isa };
    format!("lut-gemm-{code}")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::balanced_runs;

    #[test]
    fn balanced_runs_cover_the_range_in_near_equal_runs_of_at_most_most() {
        for most in [4, 16] {
            for n in 1..=70 {
                let runs: Vec<_> = balanced_runs(n, most).collect();
                assert_eq!(runs.len(), n.div_ceil(most));
                assert_eq!(runs.first().unwrap().start, 0);
                assert_eq!(runs.last().unwrap().end, n);
                assert!(runs.windows(2).all(|w| w[0].end == w[1].start));
                let (min, max) = (runs.iter().map(|r| r.len()).min(), runs.iter().map(|r| r.len()).max());
                assert!(max.unwrap() <= most && max.unwrap() - min.unwrap() <= 1, "{n}/{most}: {runs:?}");
            }
        }
    }
}

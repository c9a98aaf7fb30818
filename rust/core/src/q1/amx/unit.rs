//! The tile products the AMX GEMM needs, behind a trait: [`Amx`] runs them on the CPU's tile unit;
//! the tests' `Emulated` computes the same thing with plain loops, so every other part of the kernel
//! (sign expansion, activation layout, scaling, the task split) is tested on any AVX-512 machine.
//!
//! One product is one Q1 block (128 weights) of 16 weight rows against 16 activation rows, for both
//! byte planes of the activations: `c[p][m][n] = sum_k a[m][k] * b[p][k][n]` over k < 128, where the
//! weights come as two row-major 16 x 64 int8 tiles (`a`, 2 KiB: k < 64, then k >= 64) and each plane
//! `p` of the activations as two tiles in the tile unit's "VNNI" layout (`b`, 4 KiB: the high plane's
//! 2 KiB, then the low plane's; byte `64 * (k / 4) + 4 * n + k % 4` of each half).

/// Bytes of one 16 x 64 int8 tile.
pub const TILE_BYTES: usize = 1024;
/// Bytes per tile row, which is also every tile's stride in memory.
pub const TILE_STRIDE: usize = 64;

/// Computes blocks' 16 x 16 products (see the module doc).
pub trait TileUnit {
    /// Prepares this thread to run the products; paired with [`TileUnit::end`].
    ///
    /// # Safety
    /// The unit must be usable on this CPU (for [`Amx`]: [`super::available`]).
    unsafe fn begin(&mut self);

    /// Holds one block's activation tiles `b` (both planes, 4 KiB) for the following
    /// [`TileUnit::product`]s.
    ///
    /// # Safety
    /// `b` points at 4 KiB, and `begin` ran on this thread.
    unsafe fn load_acts(&mut self, b: *const u8);

    /// `c[p] = a0 * b[p][0] + a1 * b[p][1]` in int32 for both planes `p` (high, then low), with the
    /// activations of the last `load_acts`.
    ///
    /// # Safety
    /// `a` points at 2 KiB, `c` at 512 int32 values, and `load_acts` ran on this thread.
    unsafe fn product(&mut self, a: *const u8, c: *mut i32);

    /// Releases what `begin` set up.
    ///
    /// # Safety
    /// `begin` ran on this thread.
    unsafe fn end(&mut self);
}

/// The CPU's AMX tile unit: tiles 2-3 hold the activations' high plane and 4-5 the low one, 0-1 the
/// weights, 6 and 7 the two planes' products.
pub struct Amx;

/// `ldtilecfg`'s 64-byte configuration: palette 1, all eight tiles 16 rows x 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn full_tiles() -> TileConfig {
        let mut cfg = [0u8; 64];
        cfg[0] = 1; // palette 1
        for t in 0..8 {
            cfg[16 + 2 * t..18 + 2 * t].copy_from_slice(&(TILE_STRIDE as u16).to_le_bytes()); // bytes per row
            cfg[48 + t] = 16; // rows
        }
        TileConfig(cfg)
    }
}

#[cfg(target_arch = "x86_64")]
impl TileUnit for Amx {
    unsafe fn begin(&mut self) {
        let cfg = TileConfig::full_tiles();
        std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    }

    unsafe fn load_acts(&mut self, b: *const u8) {
        std::arch::asm!(
            "tileloadd tmm2, [{b} + {s}*1]",
            "tileloadd tmm3, [{b} + {s}*1 + 1024]",
            "tileloadd tmm4, [{b} + {s}*1 + 2048]",
            "tileloadd tmm5, [{b} + {s}*1 + 3072]",
            b = in(reg) b,
            s = in(reg) TILE_STRIDE,
            options(nostack, readonly),
        );
    }

    unsafe fn product(&mut self, a: *const u8, c: *mut i32) {
        std::arch::asm!(
            "tileloadd tmm0, [{a} + {s}*1]",
            "tileloadd tmm1, [{a} + {s}*1 + 1024]",
            "tilezero tmm6",
            "tilezero tmm7",
            "tdpbssd tmm6, tmm0, tmm2",
            "tdpbssd tmm7, tmm0, tmm4",
            "tdpbssd tmm6, tmm1, tmm3",
            "tdpbssd tmm7, tmm1, tmm5",
            "tilestored [{c} + {s}*1], tmm6",
            "tilestored [{c} + {s}*1 + 1024], tmm7",
            a = in(reg) a,
            c = in(reg) c,
            s = in(reg) TILE_STRIDE,
            options(nostack),
        );
    }

    unsafe fn end(&mut self) {
        std::arch::asm!("tilerelease", options(nostack, nomem));
    }
}

/// The tile products with plain loops: what `tdpbssd` computes, for tests on machines without AMX.
#[cfg(test)]
pub struct Emulated {
    acts: Vec<i8>,
}

#[cfg(test)]
impl Emulated {
    pub fn new() -> Emulated {
        Emulated { acts: vec![0; 4 * TILE_BYTES] }
    }
}

#[cfg(test)]
impl TileUnit for Emulated {
    unsafe fn begin(&mut self) {}

    unsafe fn load_acts(&mut self, b: *const u8) {
        self.acts.copy_from_slice(std::slice::from_raw_parts(b.cast::<i8>(), 4 * TILE_BYTES));
    }

    unsafe fn product(&mut self, a: *const u8, c: *mut i32) {
        let a = std::slice::from_raw_parts(a.cast::<i8>(), 2 * TILE_BYTES);
        let c = std::slice::from_raw_parts_mut(c, 512);
        for (plane, c) in c.chunks_exact_mut(256).enumerate() {
            let b = &self.acts[plane * 2 * TILE_BYTES..][..2 * TILE_BYTES];
            for m in 0..16 {
                for n in 0..16 {
                    let mut sum = 0i32;
                    for half in 0..2 {
                        for k in 0..64 {
                            let w = a[half * TILE_BYTES + m * TILE_STRIDE + k];
                            let x = b[half * TILE_BYTES + TILE_STRIDE * (k / 4) + 4 * n + k % 4];
                            sum += i32::from(w) * i32::from(x);
                        }
                    }
                    c[16 * m + n] = sum;
                }
            }
        }
    }

    unsafe fn end(&mut self) {}
}

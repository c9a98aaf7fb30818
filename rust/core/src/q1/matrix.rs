//! `Q1Matrix`: a validated Q1_0 weight matrix and the entry point of every matmul kernel.
//!
//! It keeps the GGUF bytes (for `to_bytes`, dequantization and the sign-flip baseline) and builds the
//! LUT repacking once, on first use. `matmul` validates shapes and values, quantizes activations,
//! and dispatches to the chosen kernel family on the chosen (or detected) instruction set.

use std::sync::OnceLock;

use super::act::quantize_acts_on;
use super::block::{as_blocks, BlockQ1, BLOCK_BYTES, BLOCK_WEIGHTS};
use super::format::{dequantize, quantize, validate};
use super::lut::{self, LutPacked};
use super::{reference, signflip, Isa};
use crate::bytes::SharedBytes;
use crate::error::{Error, Result};
use crate::pool::Pool;

/// Which kernel family computes a matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// LUT GEMV for one activation row, small GEMM ([`Kernel::Gemm`]) for several.
    Auto,
    /// The portable f32 kernel (activations are not quantized).
    Reference,
    /// The int8 sign-flip kernel over the GGUF layout (the llama.cpp-style baseline).
    SignFlip,
    /// The LUT GEMV, once per activation row.
    Lut,
    /// The small GEMM: each weight tile decoded once for many activation rows (the AMX kernel where
    /// the CPU has AMX-INT8 and there are 8 rows or more, else the 6-bit lookup kernel where it has
    /// AVX-512, else the LUT one).
    Gemm,
    /// The LUT small GEMM on every ISA (kept for comparison).
    LutGemm,
    /// The VNNI small GEMM where the CPU has AVX-512 VNNI, else the LUT one (AVX-512 machines'
    /// previous GEMM, kept for comparison).
    VnniGemm,
    /// The 6-bit lookup (`vpermt2w`) small GEMM where the CPU has AVX-512, else the LUT one: what
    /// `Gemm` runs without AMX, named so an A/B keeps meaning the same kernel whatever `Gemm` picks.
    PermGemm,
    /// The AMX-INT8 small GEMM where the CPU has it (and Linux grants it), else what `PermGemm` runs.
    AmxGemm,
}

impl Kernel {
    pub fn parse(name: &str) -> Result<Kernel> {
        Ok(match name {
            "auto" => Kernel::Auto,
            "reference" => Kernel::Reference,
            "signflip" => Kernel::SignFlip,
            "lut" => Kernel::Lut,
            "gemm" => Kernel::Gemm,
            "lut-gemm" => Kernel::LutGemm,
            "vnni-gemm" => Kernel::VnniGemm,
            "perm-gemm" => Kernel::PermGemm,
            "amx-gemm" => Kernel::AmxGemm,
            _ => {
                return Err(Error::Value(format!(
                    "unknown kernel {name:?}; expected one of 'auto', 'reference', 'signflip', 'lut', 'gemm', \
                     'lut-gemm', 'vnni-gemm', 'perm-gemm', 'amx-gemm'"
                )))
            }
        })
    }
}

/// A `rows x cols` Q1_0 matrix (GGUF layout, row-major blocks).
pub struct Q1Matrix {
    rows: usize,
    cols: usize,
    bytes: SharedBytes,
    packed: OnceLock<LutPacked>,
}

impl Q1Matrix {
    /// Quantizes a row-major f32 matrix with ggml's reference rules.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Q1Matrix> {
        Ok(Self::new_unchecked(SharedBytes::from_vec(quantize(w, rows, cols)?), rows, cols))
    }

    /// Takes raw GGUF Q1_0 bytes after validating their length and scales.
    pub fn from_bytes(bytes: Vec<u8>, rows: usize, cols: usize) -> Result<Q1Matrix> {
        Self::from_shared(SharedBytes::from_vec(bytes), rows, cols)
    }

    /// Borrows raw GGUF Q1_0 bytes (for example a tensor of a memory-mapped file) without copying,
    /// after validating their length and scales.
    pub fn from_shared(bytes: SharedBytes, rows: usize, cols: usize) -> Result<Q1Matrix> {
        validate(&bytes, rows, cols)?;
        Ok(Self::new_unchecked(bytes, rows, cols))
    }

    fn new_unchecked(bytes: SharedBytes, rows: usize, cols: usize) -> Q1Matrix {
        Q1Matrix { rows, cols, bytes, packed: OnceLock::new() }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGUF bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn blocks(&self) -> &[BlockQ1] {
        as_blocks(&self.bytes)
    }

    /// The LUT repacking, built on first use.
    pub fn packed(&self) -> &LutPacked {
        self.packed.get_or_init(|| LutPacked::pack(self.blocks(), self.rows, self.cols))
    }

    /// Row-major f32 weights into `out` (`rows * cols` values).
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        expect_len("output", out.len(), self.rows * self.cols)?;
        dequantize(&self.bytes, out);
        Ok(())
    }

    /// Row `r` as f32 (`cols` values), e.g. one token's embedding.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row {r} out of range or wrong output length");
        let per_row = self.cols / BLOCK_WEIGHTS;
        let row_bytes = &self.bytes[r * per_row * BLOCK_BYTES..(r + 1) * per_row * BLOCK_BYTES];
        dequantize(row_bytes, out);
    }

    /// `out[i, r] = sum_k w[r, k] * x[i, k]` for `n` activation rows `x` (`n * cols` values) into
    /// `out` (`n * rows` values).
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32], kernel: Kernel, isa: Isa, pool: &Pool) -> Result<()> {
        Q1Matrix::matmul_shared(&[self], x, n, &mut [out], kernel, isa, pool)
    }

    /// [`Q1Matrix::matmul`] of several matrices with the same columns against the same activations
    /// (a layer's q, k and v projections, say), each into its own output: the activations are
    /// quantized once; for one row the GEMV's tables are built once and one pool job runs every
    /// matrix, for several rows (`Gemm`, `Auto`) the small GEMM's lookup tables are built once. Each
    /// output is exactly what `matmul` gives alone.
    pub fn matmul_shared(
        mats: &[&Q1Matrix],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        kernel: Kernel,
        isa: Isa,
        pool: &Pool,
    ) -> Result<()> {
        let cols = mats.first().map_or(0, |m| m.cols);
        if mats.len() != outs.len() || mats.iter().any(|m| m.cols != cols) {
            return Err(Error::Shape("shared matmul: one output per matrix, all of the same columns".into()));
        }
        expect_len("activations", x.len(), n * cols)?;
        for (m, out) in mats.iter().zip(outs.iter()) {
            expect_len("output", out.len(), n * m.rows)?;
        }
        if !Isa::available().contains(&isa) {
            return Err(Error::Unsupported(format!("this CPU does not support the {isa} kernels")));
        }
        if n == 0 || mats.is_empty() {
            return Ok(());
        }
        if kernel == Kernel::Reference {
            check_finite(x, cols)?;
            for (m, out) in mats.iter().zip(outs.iter_mut()) {
                reference::gemv_f32(m.blocks(), m.rows, cols, x, n, out, pool);
            }
            return Ok(());
        }
        let acts = quantize_acts_on(x, n, cols, isa, pool)?;
        let packed = || mats.iter().map(|m| m.packed()).collect::<Vec<&LutPacked>>();
        if matches!(kernel, Kernel::Lut) || (kernel == Kernel::Auto && n == 1) {
            lut::gemv_shared(&packed(), &acts, outs, isa, pool);
            return Ok(());
        }
        let gemm = matches!(kernel, Kernel::Gemm | Kernel::Auto | Kernel::AmxGemm);
        #[cfg(target_arch = "x86_64")]
        if gemm && (kernel == Kernel::AmxGemm || n >= AMX_MIN_ROWS) && amx_runs(isa) {
            let mats: Vec<_> = mats.iter().map(|m| (m.blocks(), m.packed())).collect();
            super::amx::gemm_shared(&mats, &acts, outs, pool);
            return Ok(());
        }
        if gemm || kernel == Kernel::PermGemm {
            lut::gemm_shared(&packed(), &acts, outs, isa, pool);
            return Ok(());
        }
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            match kernel {
                Kernel::SignFlip => signflip::gemv(m.blocks(), m.rows, &acts, out, isa, pool),
                Kernel::LutGemm => lut::lut_gemm(m.packed(), &acts, out, isa, pool),
                Kernel::VnniGemm => lut::vnni_gemm(m.packed(), &acts, out, isa, pool),
                Kernel::Reference | Kernel::Lut | Kernel::Gemm | Kernel::Auto | Kernel::PermGemm | Kernel::AmxGemm => {
                    unreachable!("handled above")
                }
            }
        }
        Ok(())
    }
}

/// Activation rows from which `Gemm` and `Auto` take the AMX GEMM: below, the 6-bit lookup GEMM is
/// faster (Emerald Rapids Xeon, 2048x2048 and 6144x2048, 1 and 2 threads: the lookup GEMM 1.03-1.16x
/// faster at 10 rows, AMX 1.03-1.13x faster at 12; BENCHMARKS.md, session 32).
#[cfg(target_arch = "x86_64")]
const AMX_MIN_ROWS: usize = 12;

/// True when the AMX GEMM runs for `isa`: an AVX-512 plan on a CPU with AMX-INT8.
#[cfg(target_arch = "x86_64")]
fn amx_runs(isa: Isa) -> bool {
    isa.has_avx512() && super::amx::available()
}

/// The small-GEMM kernel that [`Kernel::Gemm`] runs for `isa` (with AMX: from 12 activation rows),
/// e.g. `"amx-gemm"` or `"perm-gemm-avx512"`.
pub fn gemm_name(isa: Isa) -> String {
    #[cfg(target_arch = "x86_64")]
    if amx_runs(isa) {
        return "amx-gemm".into();
    }
    lut::gemm_name(isa)
}

fn expect_len(what: &str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(Error::Shape(format!("{what} must hold {expected} values, got {got}")));
    }
    Ok(())
}

fn check_finite(x: &[f32], cols: usize) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => {
            Err(Error::Value(format!("activations must be finite, found {} at ({}, {})", x[i], i / cols, i % cols)))
        }
        None => Ok(()),
    }
}

const _: () = assert!(BLOCK_WEIGHTS == 128);

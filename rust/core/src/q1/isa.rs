//! Instruction sets the kernels are written for, detected at run time.
//!
//! Dispatch order: AVX-512 (F, BW, VL) -> AVX2 (with FMA and F16C) -> scalar on x86-64; NEON on
//! aarch64. The scalar path always compiles and is what every fast path is tested against.
//! Within AVX-512, VNNI (`vpdpbusd`) is an extension the VNNI small GEMM (`Kernel::VnniGemm`) needs
//! ([`Isa::has_avx512_vnni`]); choosing among the GEMMs goes through `Kernel`, not an ISA.
//!
//! `OXIBONSAI_ISA=avx2` (any name of [`Isa::available`]) makes [`Isa::detect`] return that one instead
//! of the fastest, so the matmul and attention kernels of a slower instruction set run, and can be
//! tested, on a faster CPU. A name the CPU lacks, or no name, leaves the fastest.

use std::fmt;

use crate::error::{Error, Result};

/// One instruction set a kernel family is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Isa {
    /// The fastest instruction set this CPU supports, or the one `OXIBONSAI_ISA` names if the CPU has
    /// it; read once.
    pub fn detect() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let requested = std::env::var("OXIBONSAI_ISA").ok().and_then(|name| Self::parse_available(&name).ok());
            requested.unwrap_or_else(|| *Self::available().last().expect("scalar is always available"))
        })
    }

    /// Every instruction set this CPU supports, slowest first (scalar is always first).
    pub fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if avx2 {
                isas.push(Isa::Avx2);
                let avx512 = is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl");
                if avx512 {
                    isas.push(Isa::Avx512);
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            isas.push(Isa::Neon);
        }
        isas
    }

    /// Parses a name from [`Isa::name`], failing if this CPU lacks it.
    pub fn parse_available(name: &str) -> Result<Isa> {
        let isa = match name {
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512" => Isa::Avx512,
            "neon" => Isa::Neon,
            _ => {
                return Err(Error::Value(format!(
                    "unknown instruction set {name:?}; expected one of 'scalar', 'avx2', 'avx512', 'neon'"
                )))
            }
        };
        if !Self::available().contains(&isa) {
            return Err(Error::Unsupported(format!("this CPU does not support the {name} kernels")));
        }
        Ok(isa)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// True when this ISA is AVX2 or AVX-512 *and* the CPU really has AVX2, FMA and F16C, so AVX2
    /// code may run. The check is a cached atomic load, so an `Isa` value built by hand can never
    /// make an unsupported instruction run.
    pub fn has_avx2(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx2 | Isa::Avx512)
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// True when this ISA is AVX-512 and the CPU has AVX-512 F, BW and VL (plus the AVX2 set).
    pub fn has_avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Isa::Avx512
                && self.has_avx2()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// True when this ISA is AVX-512 and the CPU also has AVX-512 VNNI.
    pub fn has_avx512_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.has_avx512() && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// True when this ISA is NEON and the CPU has it.
    pub fn has_neon(self) -> bool {
        #[cfg(target_arch = "aarch64")]
        {
            self == Isa::Neon && std::arch::is_aarch64_feature_detected!("neon")
        }
        #[cfg(not(target_arch = "aarch64"))]
        false
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

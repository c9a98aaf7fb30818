//! Whether this process may run AMX-INT8: the CPU says so (CPUID) and Linux grants the tile data
//! state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked once per process; a kernel
//! without AMX support refuses it). Stable Rust cannot detect AMX with `is_x86_feature_detected!`.

use std::sync::OnceLock;

/// True when AMX-TILE and AMX-INT8 may be used by every thread of this process.
pub fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_amx_int8() && std::env::var_os("OXIBONSAI_NO_AMX").is_none() && request_tiles())
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_int8() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID.(EAX=7, ECX=0): EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
    // The kernels around the tile products are AVX-512 (BW) code.
    tile && int8 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_amx_int8() -> bool {
    false
}

/// Asks Linux for permission to use the tile data state in this process (all threads).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tiles() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain arch_prctl system call with integer arguments; it touches no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tiles() -> bool {
    false
}

// portable.h: what differs between CUDA (NVRTC) and HIP (hipcc / hiprtc) for tprun's kernels.
//
// Owns: fixed-width integer names, the wavefront size, shuffles, f16/bf16 <-> f32 conversion
// done on bits (no vendor headers: cuda_fp16.h is not on NVRTC's default include path and
// Debian's HIP 5.2 has no hip_bf16.h), memory-ordering primitives at the scopes the flag
// protocols need, and a nanosecond clock for bounded waits.
// Must not: hold kernels or any layout of tprun's buffers (those live in the *.cu files).
//
// The Rust side inlines this file where a source says #include "portable.h" before handing it
// to NVRTC, so it may include nothing that NVRTC cannot find on its own.

#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define TP_HIP 1
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#else
#define TP_CUDA 1
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TP_DEV __device__ __forceinline__

// Kernel launch bounds: at most `threads` per block and, on CUDA, registers capped so that at
// least `min_blocks` blocks fit on one SM. HIP's second argument means something else (minimum
// waves per execution unit), so only the thread bound is passed there.
#if defined(TP_HIP)
#define TP_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads)
#else
#define TP_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#endif

// ---- wavefront --------------------------------------------------------------------------
// 32 lanes on every NVIDIA GPU; 64 on gfx9 (gfx906, gfx90a, gfx942), 32 on RDNA in wave32
// mode. clang defines __AMDGCN_WAVEFRONT_SIZE per target, so never hard-code 32.
#if defined(TP_HIP)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define TP_WAVE __AMDGCN_WAVEFRONT_SIZE
#else
#define TP_WAVE 64
#endif
#else
#define TP_WAVE 32
#endif

// XOR shuffle of a 32-bit value across the wavefront (all lanes active).
TP_DEV float tp_shfl_xor(float v, int mask) {
#if defined(TP_HIP)
    return __shfl_xor(v, mask, TP_WAVE);
#else
    return __shfl_xor_sync(0xffffffffu, v, mask, TP_WAVE);
#endif
}

// Sum of v over the wavefront, the same value in every lane. Adds in butterfly order, which is
// deterministic but not rank order: use it for statistics, never where bits must match the CPU.
TP_DEV float tp_wave_sum(float v) {
#pragma unroll
    for (int m = TP_WAVE / 2; m > 0; m /= 2) v += tp_shfl_xor(v, m);
    return v;
}

// ---- bits <-> f32 -----------------------------------------------------------------------
TP_DEV float tp_f32_from_bits(u32 b) { return __uint_as_float(b); }
TP_DEV u32 tp_f32_bits(float f) { return __float_as_uint(f); }

// acc + Σ_i a_i · b_i over the four bytes of a (unsigned) and b (signed), wrapping as two's
// complement: dp4a.u32.s32 on NVIDIA (sm_61+); v_dot4_i32_i8 on gfx906 / gfx90a, which reads
// a's bytes as signed too, so there they must be below 128.
TP_DEV int tp_dot4_u8s8(u32 a, u32 b, int acc) {
#if defined(TP_HIP)
    return __builtin_amdgcn_sdot4((int)a, (int)b, acc, false);
#else
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(acc));
    return d;
#endif
}

// f16 (IEEE binary16) -> f32: exact. On CUDA the hardware conversion (one instruction,
// exact for every finite value and infinity) takes everything but NaN, whose payload the
// software path below keeps the way the CPU twin does.
TP_DEV float tp_f16_to_f32(u16 h) {
#if defined(TP_CUDA)
    // NaN as below, in three bit operations; the rest (the subnormal loop included) is one
    // instruction. Keeping the software path out of CUDA builds keeps f16 kernels as small
    // as bf16 ones.
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0)
        return tp_f32_from_bits(((u32)(h & 0x8000u) << 16) | 0x7f800000u | ((u32)(h & 0x3ffu) << 13));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    if (exp == 0x1fu) {  // inf / NaN: keep the payload in the top mantissa bits
        return tp_f32_from_bits(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0) {
        if (man == 0) return tp_f32_from_bits(sign);  // +-0
        // Subnormal: normalise. Value = man * 2^-24.
        int e = -1;
        do { man <<= 1; e++; } while ((man & 0x400u) == 0);
        man &= 0x3ffu;
        return tp_f32_from_bits(sign | ((u32)(127 - 15 - e) << 23) | (man << 13));
    }
    return tp_f32_from_bits(sign | ((exp + (127 - 15)) << 23) | (man << 13));
#endif
}

// f32 -> f16, round to nearest even. The same case split as the `half` crate's portable
// fallback (and as x86 F16C, which `half` uses when present), so results match bit for bit:
// NaN stays NaN with the quiet bit set, overflow goes to inf, tiny values to (signed) zero.
TP_DEV u16 tp_f32_to_f16(float f) {
    u32 x = tp_f32_bits(f);
#if defined(TP_CUDA)
    // Round-to-nearest-even in hardware for everything but NaN: IEEE rounding, with overflow
    // to infinity and correctly rounded subnormals (no .ftz), which is the case split below.
    // NaN as below (quiet bit set, top payload bits kept).
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (u16)(((x & 0x80000000u) >> 16) | 0x7c00u | 0x0200u | ((x & 0x007fffffu) >> 13));
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 sign = (x & 0x80000000u) >> 16;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        if (man != 0) return (u16)(sign | 0x7c00u | 0x0200u | (man >> 13));
        return (u16)(sign | 0x7c00u);
    }
    int he = (int)(exp >> 23) - 127 + 15;  // biased f16 exponent
    if (he >= 0x1f) return (u16)(sign | 0x7c00u);
    if (he <= 0) {
        if (14 - he > 24) return (u16)sign;  // below half the smallest subnormal
        man |= 0x00800000u;                  // implicit bit
        u32 shift = (u32)(14 - he);
        u32 hm = man >> shift;
        u32 round = 1u << (shift - 1);
        // Round up when the dropped bits are > half, or == half and hm is odd (ties to even).
        if ((man & round) != 0 && (man & (3u * round - 1u)) != 0) hm += 1;
        return (u16)(sign | hm);
    }
    u32 h = sign | ((u32)he << 10) | (man >> 13);
    // A carry out of the mantissa correctly bumps the exponent (up to inf).
    if ((man & 0x1000u) != 0 && (man & (3u * 0x1000u - 1u)) != 0) h += 1;
    return (u16)h;
#endif
}

// bf16 -> f32: exact (bf16 is the top half of an f32).
TP_DEV float tp_bf16_to_f32(u16 b) { return tp_f32_from_bits((u32)b << 16); }

// f32 -> bf16, round to nearest even, NaN kept quiet: the `half` crate's rule.
TP_DEV u16 tp_f32_to_bf16(float f) {
    u32 x = tp_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    u32 round = 0x8000u;
    if ((x & round) != 0 && (x & (3u * round - 1u)) != 0) return (u16)((x >> 16) + 1);
    return (u16)(x >> 16);
}

// ---- memory ordering --------------------------------------------------------------------
// Cross-process flags live in peers' memory (IPC-mapped device memory, possibly over NVLink /
// xGMI / PCIe), so publication must be at SYSTEM scope: a GPU-scope release only orders our
// writes for observers on this device.

// Store `v` to *p with release semantics at system scope: every write this thread made before
// (and, through a preceding __syncthreads, every write of its block; PTX causality order is
// transitive through bar.sync) is visible to a thread that reads `v` with tp_ld_acquire_sys.
TP_DEV void tp_st_release_sys(u64* p, u64 v) {
#if defined(TP_HIP)
    // clang's __atomic builtins default to system scope on amdgcn.
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Load *p with acquire semantics at system scope: pairs with tp_st_release_sys.
TP_DEV u64 tp_ld_acquire_sys(const u64* p) {
#if defined(TP_HIP)
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#endif
}

// Relaxed (volatile, never cached in registers) load and store: for words that publish
// nothing but themselves.
TP_DEV u64 tp_ld_relaxed(const u64* p) { return *(const volatile u64*)p; }
TP_DEV void tp_st_relaxed(u64* p, u64 v) { *(volatile u64*)p = v; }

// Low-latency lines: 16 bytes stored and loaded as two 8-byte words, each of which is
// single-copy atomic (naturally aligned 64-bit accesses; PTX memory consistency model, and
// what NVLink and PCIe peers see too), while the pair as a whole is not. Relaxed at system
// scope (volatile), so the load never hits a stale L1 line and the store is not held back.
TP_DEV void tp_st_ll(u64* p, u64 a, u64 b) {
#if defined(TP_HIP)
    __atomic_store_n(p, a, __ATOMIC_RELAXED);
    __atomic_store_n(p + 1, b, __ATOMIC_RELAXED);
#else
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
#endif
}
TP_DEV void tp_ld_ll(const u64* p, u64& a, u64& b) {
#if defined(TP_HIP)
    a = __atomic_load_n(p, __ATOMIC_RELAXED);
    b = __atomic_load_n(p + 1, __ATOMIC_RELAXED);
#else
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
#endif
}

// Makes this thread's earlier writes visible system-wide before its later writes (used before
// reporting an error through host-mapped memory).
TP_DEV void tp_fence_sys() { __threadfence_system(); }

// ---- time -------------------------------------------------------------------------------
// Nanoseconds from a clock that runs at a constant rate whatever the SM clock does.
TP_DEV u64 tp_time_ns() {
#if defined(TP_HIP)
    // s_memrealtime counts at 100 MHz on gfx9 (HIP's hipDeviceAttributeWallClockRate).
    return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
    // %globaltimer: a nanosecond counter (PTX ISA, "Special Registers"; updates every ~1 us).
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

// ---- programmatic dependent launch ------------------------------------------------------
// A decode kernel launched with programmatic stream serialization (the host's launch_fn on
// sm_90 with PDL on) may start while the kernel before it on the stream is still finishing;
// tp_pdl_wait() blocks until that kernel has completed and its writes are visible (PTX
// griddepcontrol.wait), so every read of that kernel's output must come after it. Kernels
// before that one have all completed when this one launches (each lets its dependents launch
// only once past its own wait, below), so what only they wrote may be read before the wait:
// weights, and step state written by earlier steps (the KV cache rows before the position, in
// attention's one-query path; the DeltaNet conv window and recurrent state, written by the
// same kernel a token earlier). That is the overlap. The ops that do so say, in ops.rs, which
// inputs the op queued just before them must not write. Without the launch attribute, and on
// HIP, it is a no-op.
//
// Once past the wait, the block also lets the next kernel launch (griddepcontrol.
// launch_dependents: the next grid starts when every block of this one has said so or
// exited). Without it the next kernel would launch only as this one's last block exits, and
// its weight loads would start from an idle memory system; with it, the next kernel's blocks
// take the SM room this one leaves and issue their first weight loads while this one runs.
// After the wait, not before: then at most two kernels of the chain are in flight, the
// running one and the next one prefetching, and a waiting block never holds room that an
// earlier kernel still needs (every block of the kernel it waits on is already resident).
TP_DEV void tp_pdl_wait() {
#if defined(TP_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A host stand-in for kernels/src/gpu/portable.h, enough to run gemv_q4.cu's kernels
// (scripts/emulate_gemv_q4.sh) and gemv.cu's q|k|v kernels (scripts/emulate_gemv_rope.sh) on a
// CPU: one std::thread per thread of a block, one block at a time; wave sums and shuffles through a barrier per wave, __syncthreads through one per block,
// __shared__ arrays static (blocks run one after another). Only for checking a kernel's
// arithmetic and indexing without a GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TP_DEV inline
#define TP_LAUNCH_BOUNDS(threads, min_blocks)
#define TP_WAVE 32
#define __global__
#define __shared__ static
// CUDA's reading of the nibbles (subnormals); -DEMU_MAGIC checks HIP's (2^23 + q − 2^23).
#if !defined(EMU_MAGIC)
#define TP_Q4_SUBNORMAL 1
#endif

struct EmuDim {
    u32 x = 0, y = 0, z = 0;
};
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim blockDim, gridDim;

inline float tp_f32_from_bits(u32 b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
inline float __uint_as_float(u32 b) { return tp_f32_from_bits(b); }
inline u32 tp_f32_bits(float f) {
    u32 b;
    std::memcpy(&b, &f, 4);
    return b;
}
// CUDA's dp4a.u32.s32 (a's bytes unsigned, b's signed), or with TP_Q4K_ODD_SHIFT 0 HIP's
// sdot4 (both signed); wraps as two's complement.
inline int tp_dot4_u8s8(u32 a, u32 b, int acc) {
    u32 s = (u32)acc;
    for (int i = 0; i < 4; ++i) {
        const u32 ab = (a >> (8 * i)) & 0xffu;
#if defined(TP_Q4K_ODD_SHIFT) && TP_Q4K_ODD_SHIFT == 0
        const int av = (int)(int8_t)ab;
#else
        const int av = (int)ab;
#endif
        s += (u32)(av * (int)(int8_t)(b >> (8 * i)));
    }
    return (int)s;
}
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float tp_f16_to_f32(u16 h) { return (float)*(const _Float16*)&h; }
// Round to nearest even, as portable.h (NaN payloads aside: the emulators feed no NaN here).
inline u16 tp_f32_to_f16(float f) {
    const _Float16 h = (_Float16)f;
    u16 b;
    std::memcpy(&b, &h, 2);
    return b;
}
inline float tp_bf16_to_f32(u16 b) { return tp_f32_from_bits((u32)b << 16); }
inline u16 tp_f32_to_bf16(float f) {
    const u32 x = tp_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    const u32 round = 0x8000u;
    if ((x & round) != 0 && (x & (3u * round - 1u)) != 0) return (u16)((x >> 16) + 1);
    return (u16)(x >> 16);
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void tp_pdl_wait() {}

// One barrier per wave (emu_waves[threadIdx.x / TP_WAVE]) and one per block; the launcher
// (emulate_gemv_q4.cpp) makes them for each block size.
inline std::vector<std::unique_ptr<std::barrier<>>> emu_waves;
inline std::unique_ptr<std::barrier<>> emu_block;
inline float emu_slot[1024];
inline void __syncthreads() { emu_block->arrive_and_wait(); }
// __shfl_xor_sync over the whole wave: every lane writes its value, waits for the others, reads
// its partner's.
inline float tp_shfl_xor(float v, int off) {
    const u32 t = threadIdx.x;
    emu_slot[t] = v;
    emu_waves[t / TP_WAVE]->arrive_and_wait();
    const float o = emu_slot[t ^ (u32)off];
    emu_waves[t / TP_WAVE]->arrive_and_wait();
    return o;
}
// The wave sum by the same butterfly as portable.h's (so in the GPU's order).
inline float tp_wave_sum(float v) {
    for (int m = TP_WAVE / 2; m > 0; m /= 2) v += tp_shfl_xor(v, m);
    return v;
}

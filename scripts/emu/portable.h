// A host stand-in for kernels/src/gpu/portable.h, enough to run gemv_q4.cu's kernels on a CPU
// (scripts/emulate_gemv_q4.sh): one std::thread per lane of a 32-lane wave, the wave sum
// through a barrier. Only for checking a kernel's arithmetic and indexing without a GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TP_DEV inline
#define TP_LAUNCH_BOUNDS(threads, min_blocks)
#define TP_WAVE 32
#define __global__
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
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float tp_f16_to_f32(u16 h) { return (float)*(const _Float16*)&h; }
inline void tp_pdl_wait() {}

// The wave sum: every lane writes its value, waits for the others, reads all 32.
inline std::barrier<>* emu_wave;
inline float emu_slot[TP_WAVE];
inline float tp_wave_sum(float v) {
    emu_slot[threadIdx.x % TP_WAVE] = v;
    emu_wave->arrive_and_wait();
    float s = 0.0f;
    for (int i = 0; i < TP_WAVE; ++i) s += emu_slot[i];
    emu_wave->arrive_and_wait();
    return s;
}

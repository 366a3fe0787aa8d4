// reduce.cu: the data-movement ops, `Op::Copy` (with dtype conversion) and `Op::ReduceSum`.
//
// CPU twins: kernels/src/cpu/reduce.rs (copy, reduce_sum). Parameter structs are passed by
// value (kernel parameter space), so a launch needs no scratch allocation and can be captured
// in a graph; their Rust mirrors are in kernels/src/cuda/launch.rs and assert the same size.

#include "elem.h"

// Threads per block of the grid-stride kernels here: 256 (8 warps / 4 wave64s) keeps enough
// loads in flight per SM at any occupancy (a common choice; nothing tuned).
#define TP_THREADS 256
// Most inputs one ReduceSum launch takes (= comm.rs MAX_WORLD: the communicator reduces at
// most one input per rank).
#define TP_MAX_INPUTS 64

// Arguments of reduce_sum_*. 64 * 8 + 8 + 8 + 4 + 4 = 536 bytes.
struct ReduceParams {
    u64 in[TP_MAX_INPUTS];  // device addresses of the inputs, summed in this order
    u64 out;                // device address of the output (may equal an input)
    u64 n;                  // elements
    u32 nin;                // inputs used, 1..=TP_MAX_INPUTS
    u32 vec;                // 1 when every address is 16-byte aligned
};

template <class D>
TP_DEV void reduce_sum(const ReduceParams& p) {
    const u64 packs = tp_packs(p.n, D::V);
    const u64 step = (u64)gridDim.x * blockDim.x;
    auto src = [&](int i) { return (const u8*)p.in[i]; };
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < packs; k += step) {
        if (p.vec) {
            sum_pack<D, true>(src, (int)p.nin, (u8*)p.out, (u8*)0, k, p.n);
        } else {
            sum_pack<D, false>(src, (int)p.nin, (u8*)p.out, (u8*)0, k, p.n);
        }
    }
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) reduce_sum_f32(ReduceParams p) {
    reduce_sum<F32>(p);
}
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) reduce_sum_f16(ReduceParams p) {
    reduce_sum<F16>(p);
}
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) reduce_sum_bf16(ReduceParams p) {
    reduce_sum<BF16>(p);
}

// Arguments of copy_*_*: dst[i] = convert(src[i]). 24 bytes.
struct CopyParams {
    u64 src;
    u64 dst;
    u64 n;
};

// Same-dtype copy of n bytes. The host uses it for small copies instead of a device memcpy:
// one kernel launch reaches the GPU sooner than a copy-engine transfer (the `host`
// allreduce's copy-in is on its critical path).
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) copy_bytes(CopyParams p) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u8* src = (const u8*)p.src;
    u8* dst = (u8*)p.dst;
    u64 done = 0;
    if (((p.src | p.dst) & 15u) == 0) {
        done = p.n / 16 * 16;
        for (u64 i = first; i < p.n / 16; i += step) ((V16*)dst)[i] = ((const V16*)src)[i];
    }
    for (u64 i = done + first; i < p.n; i += step) dst[i] = src[i];
}

// Element-wise conversion through f32 (exact widening, one rounding to the destination), as
// the CPU twin does. Same-dtype copies do not come here: the host uses copy_bytes (up to
// 1 MiB) or a device memcpy.
template <class S, class D>
TP_DEV void convert(const CopyParams& p) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += step) {
        D::put((u8*)p.dst, i, S::get((const u8*)p.src, i));
    }
}

#define TP_COPY(sn, S, dn, D)                                                          \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) copy_##sn##_##dn(CopyParams p) { \
        convert<S, D>(p);                                                              \
    }
TP_COPY(f32, F32, f16, F16)
TP_COPY(f32, F32, bf16, BF16)
TP_COPY(f16, F16, f32, F32)
TP_COPY(f16, F16, bf16, BF16)
TP_COPY(bf16, BF16, f32, F32)
TP_COPY(bf16, BF16, f16, F16)

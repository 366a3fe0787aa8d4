// elem.h: element types, 16-byte packs, and the per-pack copy and rank-order sum every kernel
// shares.
//
// Owns: how an f32 / f16 / bf16 element is loaded, widened, rounded and stored, and the one
// summation order (accumulator starts at input 0, f32 adds in input order, rounded once),
// which is the CPU twin's order (kernels/src/cpu/reduce.rs, sum_range): that is what makes
// every rank and every backend produce the same bits.
// Must not: know about buffers, ranks or flags.
//
// Work is split in "packs" of 16 bytes (4 f32 or 8 f16/bf16 elements). The split is the same
// whether or not the pointers allow 16-byte accesses (VEC): a rank with misaligned data and
// a rank with aligned data agree on who handles which element. Only the last pack may be
// partial; it always goes through the scalar path.

#pragma once
#include "portable.h"

struct alignas(16) V16 {
    u32 w[4];
};

// One element type: V elements per pack, SIZE bytes each.
struct F32 {
    static constexpr int V = 4;
    static constexpr int SIZE = 4;
    static constexpr int PER_WORD = 1;  // elements in one 32-bit word
    TP_DEV static void unword(u32 w, float* f) { f[0] = tp_f32_from_bits(w); }
    TP_DEV static u32 word(const float* f) { return tp_f32_bits(f[0]); }
    TP_DEV static float get(const u8* base, u64 i) { return *(const float*)(base + i * 4); }
    TP_DEV static void put(u8* base, u64 i, float v) { *(float*)(base + i * 4) = v; }
    TP_DEV static void unpack(const V16& p, float* f) {
#pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = tp_f32_from_bits(p.w[j]);
    }
    TP_DEV static V16 pack(const float* f) {
        V16 p;
#pragma unroll
        for (int j = 0; j < 4; ++j) p.w[j] = tp_f32_bits(f[j]);
        return p;
    }
};

// A 16-bit float type; element 2j is the low half of word j (little endian, as on the host).
// C supplies the conversions: static float to(u16) and static u16 from(float).
template <class C>
struct Half16 {
    static constexpr int V = 8;
    static constexpr int SIZE = 2;
    static constexpr int PER_WORD = 2;  // element 2j in the low half, as in a pack
    TP_DEV static void unword(u32 w, float* f) {
        f[0] = C::to((u16)(w & 0xffffu));
        f[1] = C::to((u16)(w >> 16));
    }
    TP_DEV static u32 word(const float* f) { return (u32)C::from(f[0]) | ((u32)C::from(f[1]) << 16); }
    TP_DEV static float get(const u8* base, u64 i) { return C::to(*(const u16*)(base + i * 2)); }
    TP_DEV static void put(u8* base, u64 i, float v) { *(u16*)(base + i * 2) = C::from(v); }
    TP_DEV static void unpack(const V16& p, float* f) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            f[2 * j] = C::to((u16)(p.w[j] & 0xffffu));
            f[2 * j + 1] = C::to((u16)(p.w[j] >> 16));
        }
    }
    TP_DEV static V16 pack(const float* f) {
        V16 p;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            p.w[j] = (u32)C::from(f[2 * j]) | ((u32)C::from(f[2 * j + 1]) << 16);
        }
        return p;
    }
};
struct F16Conv {
    TP_DEV static float to(u16 h) { return tp_f16_to_f32(h); }
    TP_DEV static u16 from(float f) { return tp_f32_to_f16(f); }
};
struct BF16Conv {
    TP_DEV static float to(u16 h) { return tp_bf16_to_f32(h); }
    TP_DEV static u16 from(float f) { return tp_f32_to_bf16(f); }
};
typedef Half16<F16Conv> F16;
typedef Half16<BF16Conv> BF16;

// Element i of a float array whose dtype is only known at run time (0 f32, 1 f16, 2 bf16):
// the per-head norm weights, which may differ in dtype from each other and from the cache;
// and the store of one such element (a KV cache row written by a GEMV's epilogue).
TP_DEV float ld_any(const u8* base, u64 i, u32 dtype) {
    if (dtype == 0) return F32::get(base, i);
    if (dtype == 1) return F16::get(base, i);
    return BF16::get(base, i);
}
TP_DEV void put_any(u8* base, u64 i, u32 dtype, float v) {
    if (dtype == 0) {
        F32::put(base, i, v);
    } else if (dtype == 1) {
        F16::put(base, i, v);
    } else {
        BF16::put(base, i, v);
    }
}

// RoPE: the rotation of one pair (x1, x2) = (x[i], x[i + half]) by angle pos · inv_freq[i],
// the angle rounded to f32 as transformers does (and the CPU twin). sincosf is the precise
// library function (CUDA: ≤ 2 ulp over the whole range, Payne–Hanek reduction for large
// angles; not the __sinf/__cosf intrinsics, which lose accuracy as |angle| grows); the CPU
// rounds f64 sin/cos, so the two differ by at most ~2.5 ulp of values ≤ 1. Shared by
// decode.cu's rope kernels and gemv.cu's q|k|v epilogue, which must agree.
TP_DEV void rope_pair(float pos, float inv_freq, float x1, float x2, float& o1, float& o2) {
    float s, c;
    sincosf(pos * inv_freq, &s, &c);
    o1 = x1 * c - x2 * s;
    o2 = x2 * c + x1 * s;
}

TP_DEV u64 tp_packs(u64 n, int v) { return (n + (u64)v - 1) / (u64)v; }

// The elements of pack k: [k*V, min(k*V + V, n)).
// Copies pack k from src to dst unchanged (same dtype).
template <class D, bool VEC>
TP_DEV void copy_pack(const u8* src, u8* dst, u64 k, u64 n) {
    const u64 i0 = k * D::V;
    if (VEC && i0 + D::V <= n) {
        *(V16*)(dst + i0 * D::SIZE) = *(const V16*)(src + i0 * D::SIZE);
        return;
    }
    const u64 end = i0 + D::V < n ? i0 + D::V : n;
    for (u64 i = i0; i < end; ++i) {
        if (D::SIZE == 4) {
            *(u32*)(dst + i * 4) = *(const u32*)(src + i * 4);
        } else {
            *(u16*)(dst + i * 2) = *(const u16*)(src + i * 2);
        }
    }
}

// out[i] = ((src(0)[i] + src(1)[i]) + ...) + src(nsrc-1)[i] in f32, rounded once, for the
// elements of pack k; also written to out2 when it is not null. Each element is read from
// every source before it is written, by the same thread, so an output may be one of the
// sources.
template <class D, bool VEC, class Src>
TP_DEV void sum_pack(Src src, int nsrc, u8* out, u8* out2, u64 k, u64 n) {
    const u64 i0 = k * D::V;
    if (VEC && i0 + D::V <= n) {
        const u64 off = i0 * D::SIZE;
        float acc[D::V];
        D::unpack(*(const V16*)(src(0) + off), acc);
        // Sources in groups of 4, loaded before any is converted, so that up to four loads are
        // in flight whatever the conversion code does to the compiler's unrolling (ptxas had
        // left f16's loop one load at a time).
        for (int p0 = 1; p0 < nsrc; p0 += 4) {
            V16 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (p0 + j < nsrc) v[j] = *(const V16*)(src(p0 + j) + off);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (p0 + j < nsrc) {
                    float x[D::V];
                    D::unpack(v[j], x);
#pragma unroll
                    for (int k = 0; k < D::V; ++k) acc[k] += x[k];
                }
            }
        }
        const V16 r = D::pack(acc);
        *(V16*)(out + off) = r;
        if (out2) *(V16*)(out2 + off) = r;
        return;
    }
    const u64 end = i0 + D::V < n ? i0 + D::V : n;
    for (u64 i = i0; i < end; ++i) {
        float acc = D::get(src(0), i);
        for (int p = 1; p < nsrc; ++p) acc += D::get(src(p), i);
        D::put(out, i, acc);
        if (out2) D::put(out2, i, acc);
    }
}

// [start, end) of part `i` of `len` items split in `parts`: contiguous, as even as possible,
// the first len % parts parts one item longer (kernels/src/comm.rs, shard_range).
struct TpRange {
    u64 start, end;
};
TP_DEV TpRange tp_split(u64 len, u64 parts, u64 i) {
    const u64 base = len / parts, extra = len % parts;
    const u64 start = i * base + (i < extra ? i : extra);
    TpRange r;
    r.start = start;
    r.end = start + base + (i < extra ? 1 : 0);
    return r;
}

// decode.cu: the small per-token ops of the decode step: `Op::Fill`, `Op::Embedding`,
// `Op::RmsNorm`, `Op::AddRmsNorm`, `Op::Rope`, `Op::QkvRope` (the q|k|v epilogue), `Op::SiluMul`
// and `Op::Add`.
//
// Owns: these kernels and their parameter structs. Must not: allocate, synchronise with the
// host, or take per-token values (token ids, positions) as parameters: those are read from
// device memory (u32 views), so one captured graph replays for every token.
//
// CPU twins: kernels/src/cpu/ops/{elementwise,embedding,norm,rope,decode}.rs. Launchers and the
// Rust mirrors of the parameter structs (same sizes, asserted): kernels/src/cuda/ops_decode.rs.
//
// Each of these runs a few times per layer inside the decode graph at rows = 1, where it moves
// tens of kilobytes: what it costs is launch and one trip to memory, not bandwidth. So every op
// is one launch of one small kernel, reads each input once, and uses 16-byte accesses where
// the addresses allow (the launcher checks and passes `vec`; otherwise a scalar path with the
// same work split).
//
// Floating point: the runtime compiles with --fmad=false --ftz=false and no fast math, so
// sqrtf, division, expf and sincosf are the precise library versions (not __expf, __sinf,
// rsqrtf); the tolerances of the twin cases in ops_decode.rs say how far those may be from the
// CPU's.

#include "portable.h"
#include "elem.h"

// Most threads of a norm block (= the launcher's NORM_THREADS): one block per row, so at
// rows = 1 the whole row is in flight at once (4096 f32 = 1024 threads × one 16-byte pack).
#define TP_NORM_THREADS 1024
// Packs of 4 elements a norm thread keeps in registers between the sum of squares and the
// scaling: with 1024 threads, rows up to 16384 are read once; longer rows re-read x (L2 hits).
#define TP_NORM_CACHE 4
// Most threads of a RoPE / q|k|v block (= the launcher's PAIR_THREADS): one thread per
// rotated pair, head_dim ≤ 512 in one pass.
#define TP_PAIR_THREADS 256
// Threads of the streaming kernels (fill, embedding, silu_mul, add): 256, as reduce.cu's
// grid-stride kernels (8 warps / 4 wave64s per block; a common choice, not tuned).
#define TP_THREADS 256

// 4 elements of a 16-bit dtype: one 8-byte access.
struct alignas(8) V8 {
    u32 w[2];
};

// Elements [i, i + 4) of the array of n elements of D at `base`, widened to f32. VEC: the
// caller guarantees i + 4 <= n and an address aligned to 4 elements (one 16- or 8-byte load);
// otherwise each element is loaded alone and those at or past n read as 0.
template <class D>
TP_DEV void ld4(const u8* base, u64 i, u64 n, bool vec, float* f) {
    if (vec) {
        if constexpr (D::SIZE == 4) {
            D::unpack(*(const V16*)(base + i * 4), f);
        } else {
            const V8 p = *(const V8*)(base + i * 2);
            D::unword(p.w[0], f);
            D::unword(p.w[1], f + 2);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = i + j < n ? D::get(base, i + j) : 0.0f;
}

// Stores f32 elements [i, i + 4) of an array of n (those below n), under ld4's VEC contract.
TP_DEV void st4(float* base, u64 i, u64 n, bool vec, const float* f) {
    if (vec) {
        *(V16*)(base + i) = F32::pack(f);
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (i + j < n) base[i + j] = f[j];
}

// Sum of v over the block, returned to every thread. blockDim.x must be a multiple of TP_WAVE
// and at most 1024 (the launchers use multiples of 64, a whole number of waves on every
// target). Fixed order (butterfly within each wave, then the wave sums in wave order), so it is
// deterministic, but it is not the CPU's order: norms match the twin within a tolerance.
// Every thread of the block must call it (it holds two barriers).
TP_DEV float tp_block_sum(float v) {
    __shared__ float part[1024 / TP_WAVE];
    v = tp_wave_sum(v);
    if (threadIdx.x % TP_WAVE == 0) part[threadIdx.x / TP_WAVE] = v;
    __syncthreads();
    float t = 0.0f;
    const u32 waves = blockDim.x / TP_WAVE;
    for (u32 i = 0; i < waves; ++i) t += part[i];
    // The next call may overwrite `part`: every thread must have read it first.
    __syncthreads();
    return t;
}

// ---- Fill -------------------------------------------------------------------------------

// Arguments of fill. 24 bytes.
struct FillParams {
    u64 dst;    // device address, aligned to esize
    u64 n;      // elements
    u32 word;   // the bits of one element (16-bit dtypes: twice, in both halves)
    u32 esize;  // 4 or 2 bytes
};

// dst[i] = value for every element; the host encodes the value into `word` (rounding it to
// f16/bf16, or `value as u32`, as the CPU twin does), so the kernel only stores bits.
// Grid: 1-D grid-stride over 16-byte packs (when dst is 16-byte aligned) then single
// elements; TP_THREADS per block. Bytes: n·esize written, nothing read: ~90 % of the write
// bandwidth for large n, launch-bound at decode sizes.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) fill(FillParams p) { tp_pdl_wait();
    const u64 step = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 done = 0;  // elements stored by the 16-byte loop
    if ((p.dst & 15u) == 0) {
        const u64 packs = p.n * p.esize / 16;
        V16 v;
        v.w[0] = v.w[1] = v.w[2] = v.w[3] = p.word;
        for (u64 k = first; k < packs; k += step) ((V16*)p.dst)[k] = v;
        done = packs * 16 / p.esize;
    }
    for (u64 i = done + first; i < p.n; i += step) {
        if (p.esize == 4) {
            ((u32*)p.dst)[i] = p.word;
        } else {
            ((u16*)p.dst)[i] = (u16)p.word;
        }
    }
}

// ---- Embedding --------------------------------------------------------------------------

// Arguments of embedding_*. 56 bytes.
struct EmbParams {
    u64 table;        // [table_rows, hidden] of D: vocab ids vocab_start..vocab_start + table_rows
    u64 ids;          // [m] u32
    u64 out;          // [m, hidden] f32
    u64 vocab_start;
    u64 table_rows;
    u64 hidden;
    u32 m;
    u32 vec;  // 1: hidden % 4 == 0, table aligned to 4 elements, out to 16 bytes
};

// out[i] = table[ids[i] - vocab_start] widened to f32 (exact), or zeros when the id lies
// outside this shard. Grid: x over packs of 4 elements of a row (TP_THREADS per block, with a
// stride loop), y over ids (stride loop past 65535). Bytes: m·hidden·sizeof(D) read +
// m·hidden·4 written; at decode (m = 1, hidden 4096–8192) a few blocks, launch-bound.
template <class D>
TP_DEV void embedding(const EmbParams& p) {
    const u64 packs = (p.hidden + 3) / 4;
    const u64 step = (u64)gridDim.x * blockDim.x;
    const bool vec = p.vec != 0;
    for (u64 i = blockIdx.y; i < p.m; i += gridDim.y) {
        const u64 id = ((const u32*)p.ids)[i];
        const bool mine = id >= p.vocab_start && id - p.vocab_start < p.table_rows;
        const u8* row = (const u8*)p.table + (mine ? (id - p.vocab_start) * p.hidden * D::SIZE : 0);
        float* out = (float*)p.out + i * p.hidden;
        for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < packs; k += step) {
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (mine) ld4<D>(row, k * 4, p.hidden, vec, v);
            st4(out, k * 4, p.hidden, vec, v);
        }
    }
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) embedding_f32(EmbParams p) { tp_pdl_wait(); embedding<F32>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) embedding_f16(EmbParams p) { tp_pdl_wait(); embedding<F16>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) embedding_bf16(EmbParams p) { tp_pdl_wait(); embedding<BF16>(p); }

// ---- RmsNorm and AddRmsNorm ---------------------------------------------------------------

// Arguments of rms_norm_* and add_rms_norm_*. 56 bytes.
struct NormParams {
    u64 x;      // [rows, dim] f32; add_rms_norm writes x + delta back here
    u64 delta;  // [rows, dim] f32 (add_rms_norm only)
    u64 w;      // [dim] of W
    u64 out;    // [rows, dim] f32; may be x (rms_norm) or delta (add_rms_norm)
    u64 dim;
    u32 rows;
    float eps;
    u32 vec;  // 1: dim % 4 == 0, x, delta, out 16-byte aligned, w aligned to 4 elements
    u32 pad;
};

// Pass 1 for pack k of a row: a = x (ADD: x + delta, stored back to x); ss += Σ a².
template <bool ADD>
TP_DEV void norm_load(float* x, const float* delta, u64 k, u64 dim, bool vec, float* a, float& ss) {
    ld4<F32>((const u8*)x, k * 4, dim, vec, a);
    if (ADD) {
        float b[4];
        ld4<F32>((const u8*)delta, k * 4, dim, vec, b);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] += b[j];
        st4(x, k * 4, dim, vec, a);
    }
    // Elements past dim were loaded as 0 and add nothing.
#pragma unroll
    for (int j = 0; j < 4; ++j) ss += a[j] * a[j];
}

// Pass 2 for pack k: out = (a · inv) · w (wk: the pack's weights), the CPU twin's order of
// the two products.
TP_DEV void norm_store(float* out, u64 k, u64 dim, bool vec, const float* a, const float* wk, float inv) {
    float o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = (a[j] * inv) * wk[j];
    st4(out, k * 4, dim, vec, o);
}

// RMSNorm of each row, optionally after the residual add (ADD): x ← x + delta, then
// out = x / sqrt(mean(x²) + eps) · w, with the sum of squares in f32 and 1/sqrtf (correctly
// rounded, the CPU twin's expression; rsqrtf would be up to 2 ulp off and saves nothing here,
// it runs once per row).
// Grid: one block per row (x, stride loop over rows); block: a multiple of 64 threads
// ≤ TP_NORM_THREADS, chosen by the launcher (norm_threads) so that each thread has the same
// number of 4-element packs (thread t takes packs t, t + T, ...). Each thread reads its x (and delta) packs once,
// keeps up to TP_NORM_CACHE of them in registers across the block reduction, then reads its w
// packs and writes out. Every element is read and written by one thread only, so out may be
// x (rms_norm) or delta (add_rms_norm): each is read before the same thread writes it.
// Bytes per row: rms_norm reads dim·4 + dim·sizeof(W), writes dim·4; add_rms_norm reads
// 2·dim·4 + dim·sizeof(W), writes 2·dim·4. At rows = 1 (decode) one block: latency-bound
// (~1 % of HBM bandwidth, a few µs); at thousands of rows (prefill) ~70–80 % expected.
//
// The weights of the register-cached packs are loaded before tp_pdl_wait(): no kernel of the
// step writes them, so under programmatic dependent launch their latency overlaps the kernel
// before (at rows = 1 this kernel is a chain of dependent memory round trips).
template <class W, bool ADD>
TP_DEV void norm_rows(const NormParams& p) {
    const u64 dim = p.dim;
    const u64 packs = (dim + 3) / 4;
    const u32 T = blockDim.x;
    const bool vec = p.vec != 0;
    const u8* w = (const u8*)p.w;
    float wkeep[TP_NORM_CACHE][4];
#pragma unroll
    for (int j = 0; j < TP_NORM_CACHE; ++j) {
        const u64 k = threadIdx.x + (u64)j * T;
        if (k < packs) ld4<W>(w, k * 4, dim, vec, wkeep[j]);
    }
    tp_pdl_wait();
    for (u64 r = blockIdx.x; r < p.rows; r += gridDim.x) {
        float* x = (float*)p.x + r * dim;
        const float* delta = ADD ? (const float*)p.delta + r * dim : (const float*)0;
        float* out = (float*)p.out + r * dim;
        float keep[TP_NORM_CACHE][4];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < TP_NORM_CACHE; ++j) {
            const u64 k = threadIdx.x + (u64)j * T;
            if (k < packs) norm_load<ADD>(x, delta, k, dim, vec, keep[j], ss);
        }
        for (u64 k = threadIdx.x + (u64)TP_NORM_CACHE * T; k < packs; k += T) {
            float a[4];
            norm_load<ADD>(x, delta, k, dim, vec, a, ss);
        }
        const float inv = 1.0f / sqrtf(tp_block_sum(ss) / (float)dim + p.eps);
#pragma unroll
        for (int j = 0; j < TP_NORM_CACHE; ++j) {
            const u64 k = threadIdx.x + (u64)j * T;
            if (k < packs) norm_store(out, k, dim, vec, keep[j], wkeep[j], inv);
        }
        // Packs past the register cache: x again (this thread's own earlier store when ADD).
        for (u64 k = threadIdx.x + (u64)TP_NORM_CACHE * T; k < packs; k += T) {
            float a[4], wk[4];
            ld4<F32>((const u8*)x, k * 4, dim, vec, a);
            ld4<W>(w, k * 4, dim, vec, wk);
            norm_store(out, k, dim, vec, a, wk, inv);
        }
    }
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) rms_norm_f32(NormParams p) { norm_rows<F32, false>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) rms_norm_f16(NormParams p) { norm_rows<F16, false>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) rms_norm_bf16(NormParams p) { norm_rows<BF16, false>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) add_rms_norm_f32(NormParams p) { norm_rows<F32, true>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) add_rms_norm_f16(NormParams p) { norm_rows<F16, true>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_NORM_THREADS, 1) add_rms_norm_bf16(NormParams p) { norm_rows<BF16, true>(p); }

// ---- RoPE -------------------------------------------------------------------------------

// Arguments of rope. 40 bytes.
struct RopeParams {
    u64 x;         // [rows, heads, 2·half] f32, rotated in place
    u64 inv_freq;  // [half] f32
    u64 pos;       // [rows] u32
    u32 rows;
    u32 heads;
    u32 half;  // head_dim / 2
    u32 pad;
};

// Grid: x = head, y = row (stride loop past 65535 rows); block: one thread per pair (i,
// i + half), a multiple of 64 threads ≤ TP_PAIR_THREADS, stride loop for longer heads. Each
// element is read and written once by one thread. Bytes: 2·rows·heads·head_dim·4 (+ the small
// inv_freq and pos, L2 hits after the first block); launch-bound at decode.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_PAIR_THREADS, 1) rope(RopeParams p) { tp_pdl_wait();
    const u32 half = p.half;
    const float* inv_freq = (const float*)p.inv_freq;
    for (u64 r = blockIdx.y; r < p.rows; r += gridDim.y) {
        const float pos = (float)((const u32*)p.pos)[r];
        float* v = (float*)p.x + (r * p.heads + blockIdx.x) * 2 * half;
        for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
            float o1, o2;
            rope_pair(pos, inv_freq[i], v[i], v[i + half], o1, o2);
            v[i] = o1;
            v[i + half] = o2;
        }
    }
}

// ---- The q|k|v epilogue -------------------------------------------------------------------

// Arguments of qkv_rope_*. 120 bytes.
struct QkvParams {
    u64 qkv;       // [rows, (heads + 2·kv_heads)·d] f32: q heads, k heads, v heads
    u64 q;         // [rows, heads·d] f32
    u64 k_cache;   // [cap, kv_heads·d] of KV
    u64 v_cache;   // [cap, kv_heads·d] of KV
    u64 pos;       // [rows] u32
    u64 inv_freq;  // [d/2] f32
    u64 q_norm;    // [d] (dtype qn_dtype) when norm, else 0
    u64 k_norm;    // [d] (dtype kn_dtype) when norm, else 0
    u64 cap;       // rows of each cache (of each slot, with slots)
    u32 rows;
    u32 heads;
    u32 kv_heads;
    u32 half;  // d / 2
    float eps;
    u32 norm;      // 1: per-head RMSNorm of q and k (Qwen3) before RoPE
    u32 qn_dtype;  // 0 f32, 1 f16, 2 bf16
    u32 kn_dtype;
    u32 rhalf;     // rotary_dim / 2 (= half but for partial RoPE: Qwen3.5)
    u32 nslots;    // slots in the cache (with slots)
    u64 slots;     // [rows] u32 cache slot of each row (ops::CacheSlots), or 0: one sequence
};

// Everything between the q|k|v GEMV and attention, for all heads in one launch. Block (h, r)
// takes head h of row r: a q head (h < heads) is optionally RMS-normed over its d elements,
// rotated at pos[r] and written to q; a k head the same, rounded once to KV and written to row
// pos[r] of k_cache; a v head is rounded and written to row pos[r] of v_cache. Rows with
// pos[r] ≥ cap store nothing in the caches (q is still written), exactly as the CPU twin.
// Grid: x = heads + 2·kv_heads, y = rows (stride loop past 65535); block: one thread per pair,
// a multiple of 64 ≤ TP_PAIR_THREADS (so d ≤ 512 in one pass; longer heads loop). With the
// norm, each thread reads its pairs twice (sum of squares, then the rotation; the second read
// hits L1). Bytes: rows·(heads + 2·kv_heads)·d·4 read, rows·heads·d·4 + 2·rows·kv_heads·d·
// sizeof(KV) written: ~45 KB at decode for Llama-3-8B on one rank (32 + 2·8 heads of 128,
// bf16 cache), launch-bound.
template <class KV>
TP_DEV void qkv_rope(const QkvParams& p) {
    const u32 h = blockIdx.x;
    const u32 half = p.half;
    const u64 d = 2 * (u64)half;
    const u64 width = (u64)(p.heads + 2 * p.kv_heads) * d;
    const u64 kv_width = (u64)p.kv_heads * d;
    const float* inv_freq = (const float*)p.inv_freq;
    const bool is_q = h < p.heads;
    const u8* wn = (const u8*)(is_q ? p.q_norm : p.k_norm);
    const u32 wdt = is_q ? p.qn_dtype : p.kn_dtype;
    const u32 rh = p.rhalf;
    // Before the wait, what no kernel of the step writes: the first row's position (step
    // state, written before the step) and this thread's first pair's inverse frequency and
    // norm weights (HBM misses, the weights having streamed through L2 since the last layer).
    // After it only the q|k|v row's loads (L2 hits) stay on the chain.
    const u32 i0 = threadIdx.x;
    const u32 pos0 = blockIdx.y < p.rows ? ((const u32*)p.pos)[blockIdx.y] : 0;
    const float f0 = i0 < rh ? inv_freq[i0] : 0.0f;
    const bool normed = p.norm && h < p.heads + p.kv_heads && i0 < rh;
    const float w1 = normed ? ld_any(wn, i0, wdt) : 1.0f;
    const float w2 = normed ? ld_any(wn, i0 + rh, wdt) : 1.0f;
    tp_pdl_wait();
    for (u64 r = blockIdx.y; r < p.rows; r += gridDim.y) {
        // pos, h and so every branch below are the same for the whole block, so a block either
        // reaches tp_block_sum's barriers with all its threads or not at all.
        const u32 pos = r == blockIdx.y ? pos0 : ((const u32*)p.pos)[r];
        const bool stored = (u64)pos < p.cap;
        // The row's place in the cache: its position within its slot (ids clamped).
        u64 at = pos;
        if (p.slots) {
            const u32 s = ((const u32*)p.slots)[r];
            at += (u64)(s < p.nslots ? s : p.nslots - 1) * p.cap;
        }
        const float* src = (const float*)p.qkv + r * width + h * d;
        if (h >= p.heads + p.kv_heads) {
            // A v head: only rounded and stored.
            if (stored) {
                u8* dst = (u8*)p.v_cache + (at * kv_width + (h - p.heads - p.kv_heads) * d) * KV::SIZE;
                for (u64 e = threadIdx.x; e < d; e += blockDim.x) KV::put(dst, e, src[e]);
            }
            continue;
        }
        if (!is_q && !stored) continue;  // a k head past the cache: nothing to write
        float inv = 1.0f;
        if (p.norm) {
            float ss = 0.0f;
            for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
                const float x1 = src[i], x2 = src[i + half];
                ss += x1 * x1;
                ss += x2 * x2;
            }
            // As norm_rows: the twin's 1 / sqrt(mean + eps).
            inv = 1.0f / sqrtf(tp_block_sum(ss) / (float)d + p.eps);
        }
        const float fpos = (float)pos;
        float* qdst = (float*)p.q + (r * p.heads + h) * d;
        u8* kdst = (u8*)p.k_cache + (at * kv_width + (is_q ? 0 : h - p.heads) * d) * KV::SIZE;
        // The rotated pairs (i, i + rhalf) of the first 2·rhalf dims, then the dims past them
        // (partial RoPE: normed, not rotated).
        for (u32 i = threadIdx.x; i < rh; i += blockDim.x) {
            float x1 = src[i], x2 = src[i + rh];
            if (p.norm) {
                x1 = (x1 * inv) * (i == i0 ? w1 : ld_any(wn, i, wdt));
                x2 = (x2 * inv) * (i == i0 ? w2 : ld_any(wn, i + rh, wdt));
            }
            float o1, o2;
            rope_pair(fpos, i == i0 ? f0 : inv_freq[i], x1, x2, o1, o2);
            if (is_q) {
                qdst[i] = o1;
                qdst[i + rh] = o2;
            } else {
                KV::put(kdst, i, o1);
                KV::put(kdst, i + rh, o2);
            }
        }
        for (u64 e = 2 * (u64)rh + threadIdx.x; e < d; e += blockDim.x) {
            float x = src[e];
            if (p.norm) x = (x * inv) * ld_any(wn, e, wdt);
            if (is_q) {
                qdst[e] = x;
            } else {
                KV::put(kdst, e, x);
            }
        }
    }
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_PAIR_THREADS, 1) qkv_rope_f32(QkvParams p) { qkv_rope<F32>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_PAIR_THREADS, 1) qkv_rope_f16(QkvParams p) { qkv_rope<F16>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_PAIR_THREADS, 1) qkv_rope_bf16(QkvParams p) { qkv_rope<BF16>(p); }

// ---- SiluMul and Add --------------------------------------------------------------------

// Arguments of silu_mul and add. 40 bytes.
struct BinParams {
    u64 a;    // [n] f32 (silu_mul: gate)
    u64 b;    // [n] f32 (silu_mul: up)
    u64 out;  // [n] f32; may be a or b (the same elements), not a partial overlap
    u64 n;
    u32 vec;  // 1: a, b and out 16-byte aligned
    u32 pad;
};

struct AddOp {
    TP_DEV static float f(float a, float b) { return a + b; }
};
// silu(g) · u = g / (1 + e^−g) · u, the twin's expression and order; expf is the precise one
// (≤ 2 ulp), e^−g overflowing to inf gives ±0 as on the CPU.
struct SiluMulOp {
    TP_DEV static float f(float g, float u) { return g / (1.0f + expf(-g)) * u; }
};
// x · σ(g) = x / (1 + e^−g) (Qwen3.5's attention output gate), the twin's expression.
struct SigmoidMulOp {
    TP_DEV static float f(float x, float g) { return x / (1.0f + expf(-g)); }
};

// out[i] = F(a[i], b[i]). Grid: 1-D grid-stride over packs of 4 elements, TP_THREADS per
// block; each element is read and written by one thread, so out may alias an input.
// Bytes: 8n read, 4n written: ~90 % of HBM bandwidth for large n, launch-bound at decode.
template <class F>
TP_DEV void binary(const BinParams& p) {
    const u64 packs = (p.n + 3) / 4;
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < packs; k += step) {
        const bool vec = p.vec != 0 && k * 4 + 4 <= p.n;
        float a[4], b[4], o[4];
        ld4<F32>((const u8*)p.a, k * 4, p.n, vec, a);
        ld4<F32>((const u8*)p.b, k * 4, p.n, vec, b);
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = F::f(a[j], b[j]);
        st4((float*)p.out, k * 4, p.n, vec, o);
    }
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) silu_mul(BinParams p) { tp_pdl_wait(); binary<SiluMulOp>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) add(BinParams p) { tp_pdl_wait(); binary<AddOp>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_THREADS, 1) sigmoid_mul(BinParams p) { tp_pdl_wait(); binary<SigmoidMulOp>(p); }

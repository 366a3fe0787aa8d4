// gemv.cu: Matmul, y[m, n] = f(x)[m, k] · w[n, k]ᵀ (+ bias[n]) (kernels/src/ops.rs `Matmul`;
// CPU twin kernels/src/cpu/ops/matmul.rs and decode.rs). x, y, bias f32; w f32, f16 or bf16;
// f32 accumulation. f is the identity (Prologue::None, x is [m, k]) or silu(gate) · up
// (Prologue::SiluMul, x is [m, 2k], each row [gate | up]), computed as x is read. With the
// SiluMul epilogue (Epilogue::SiluMul, the fused gate|up projection: w's rows [gate | up]) y is
// [m, n/2] = silu(gate) · up, computed by the wave that holds both sums (see gemv()).
//
// Owns: the matrix–vector product of decode (m = 1) and the token-tiled product of prefill.
// Also AddNormMatmul (ops.rs; CPU twin decode.rs `add_norm_matmul`): the residual seam of a
// world-1 decoder folded into the projection that reads it. f(x) = (x + delta) · norm_w and
// each wave also sums (x + delta)² over the elements it reads; since every wave reads the
// whole row, that is the row's full square sum, so no block-wide pass is needed: the wave
// multiplies its finished dot products by 1/rms = rsqrt(Σ/k + eps). The wave of row group 0
// also writes x + delta to x_out (the next residual; another buffer, since every wave reads
// x). That saves the separate add + norm kernel and its launch tail between two GEMVs.
//
// And QkvMatmul (ops.rs; CPU twin: the product, then decode.rs `qkv_rope`): one token's q|k|v
// product with QkvRope's work in its epilogue, where that work needs nothing across a head (no
// q/k norm, RoPE over whole heads: Llama, Mistral, Qwen2). Each row group is R/2 pairs of rows
// (i, i + d/2) of a head, so the lane that writes a pair holds both of its sums: it adds the
// bias, rotates a q or k pair at the token's position, and writes q (f32) or the k or v pair
// into the cache row (rounded once), instead of y. That saves qkv_rope's launch per layer.
//
// Must not: write anything but y and x_out, or q and the position's cache rows (no scratch,
// no second pass: one launch per matmul).
//
// Mapping. Each wave (TP_WAVE lanes) owns R consecutive output features ("a row group"; R is
// TP_GEMV_ROWS, or TP_GEMV_ROWS_SILU with the prologue) and streams those R weight rows once,
// lane l reading the 16-byte packs l, l + TP_WAVE, l + 2·TP_WAVE, ... of each row (8 bf16/f16
// or 4 f32 per pack), so that one wave-wide load covers TP_WAVE · 16 contiguous bytes of a
// row. U packs per row are loaded before any is used: U · R (TP_GEMV_UNROLL, or
// TP_GEMV_UNROLL_SILU) independent 16-byte loads in flight per lane to cover HBM latency. Each loaded pack is multiplied by the
// matching f32 elements of x (read through L1/L2 with plain loads: x is at most 2 · 14336 f32
// = 112 KiB and every wave reads all of it) with fmaf into one accumulator per (row, token);
// the lanes' partial sums are then added with a butterfly over the wave, and lane r·MT + t
// writes y[t, row r] (+ bias). Grid (m = 1): blockIdx.x · (blockDim.x / TP_WAVE) + wave
// indexes row groups (grid-stride loop over the rest, if any); m > 1: blockIdx.x indexes
// token tiles of MT and blockIdx.y the row groups' blocks (see gemv()).
// The launcher (kernels/src/cuda/ops_gemv.rs) gives every row group its own wave, with 4
// waves per block, or fewer while that leaves fewer than 2 blocks per SM.
//
// m = 1 (decode): MT = 1. Reads n·k weight elements once (the whole cost: [4096, 4096] bf16
// is 32 MiB), x (k or 2k f32) once per wave from L1/L2, writes n f32. m > 1 (a decode batch,
// prefill): tiles of MT tokens (TP_GEMV_TOKENS_SMALL for m <= 4, else TP_GEMV_TOKENS); each
// weight pack, loaded once per tile, is used for all MT tokens of the tile, so weights are
// read ceil(m / MT) times, the tiles of a row group side by side so that all but the first
// find them in L2. Correctness first there: the last tile's missing tokens repeat the tile's
// last token (computed, never written) instead of branching.
//
// Prologue SiluMul: silu(g) · u = g / (1 + e^−g) · u per element, as the CPU twin
// (elementwise.rs), with the fast __expf and __fdividef: both go to the special-function
// unit, and at one exp and one reciprocal per x element the exact expf and IEEE division
// would make the kernel issue-bound (H200 by the datasheet figures: 132 SMs · 16 SFU
// ops/clock ≈ 4.2 T ops/s against 2.1 T bf16 weights/s at 4.2 TB/s); their relative error is
// a few 1e-7 per element (CUDA programming guide, intrinsic functions), far inside the twin's
// 1e-4. With R rows per wave the activation of each x element is computed once per R rows,
// hence R = 4 there (and U · R = 16 loads in flight, as n = 4096 leaves only ~8 waves per SM).
//
// Alignment. The 16-byte path (p.vec, decided by the launcher) needs x and w 16-byte aligned
// and k a whole number of packs (then every row of x, gate, up and w starts aligned too).
// Otherwise every load is a scalar one (k = 4101, an odd view offset): slow but right.
//
// Expected bandwidth, m = 1, bf16 (f16 the same within noise, f32 higher): weight bytes over
// kernel time, back-to-back launches in a CUDA graph rotating through 1 GiB of weights (so
// nothing is served from the 60 MB L2), one H200, 2026-12-03; the copy ceiling is 4.25 TB/s
// (read + written, 1 GiB device copy), and a read-only stream reaches ~4.5 TB/s:
//
//     [n, k]              µs      TB/s   % of 4.2 TB/s
//     [6144, 4096]       13.9     3.63    86
//     [4096, 4096]       10.1     3.32    79
//     [28672, 4096]      54.5     4.31   103
//     [4096, 14336]      28.0     4.19   100    (with the SiluMul prologue: 30.3–31.0 µs, 90–92 %)
//     [128256, 4096]    234.7     4.48   107
//
// Why: nothing but the weights comes from HBM (x is L1/L2-resident, y is n·4 bytes); every
// weight byte is read once with fully coalesced 16-byte loads; the smallest shape still has
// 2048 waves (~16 per SM) with 8 loads of 16 bytes in flight per lane, ~64 KiB per SM against
// the ~25 KiB per SM Little's law asks (4.2 TB/s · ~0.8 µs / 132 SMs); the arithmetic (one
// fmaf and one conversion per weight element, x loads amortised over R rows) is well under
// the issue rate. What is lost is a fixed ~2 µs per launch (a linear fit over n = 1024..8192
// gives 2.2 µs + bytes / 4.24 TB/s; an empty kernel in a graph costs 0.57 µs): the unloaded
// HBM latency at the start and the drain at the end of a kernel that fits in one wave of
// blocks. It caps the two small shapes below 90 %; no in-kernel change moved it (R, U,
// block size, load flavour, L2 prefetch under programmatic dependent launch: all within
// ±3 %). Only overlapping a kernel's start with the previous kernel's end (fusing
// neighbours) would recover it.

#include "portable.h"
#include "elem.h"

// Tuned on one H200 (bf16, m = 1, the decode shapes of the table above). Without prologue,
// R = 1, 2, 4 and U · R = 4, 8, 16 were all within ±3 % of each other: R = 2, U · R = 8 has
// the fewest registers among the best. With the prologue ([4096, 14336]), R = 2 reached 69 %,
// R = 8 63–76 % and R = 4 90–92 %, with U · R = 16 a point or two above U · R = 8. The Rust
// side mirrors R and MT (kernels/src/cuda/ops_gemv.rs; a test compares them).
#define TP_GEMV_ROWS 2           // R without prologue: output rows per wave
#define TP_GEMV_ROWS_SILU 4      // R with the SiluMul prologue (amortises the exp)
#define TP_GEMV_TOKENS 8         // MT: tokens per tile when m > 4
#define TP_GEMV_TOKENS_SMALL 4   // MT when 2 <= m <= 4 (a small decode batch)
#define TP_GEMM_ROWS 4           // R when m > 1: each x element loaded serves 4 rows
#define TP_GEMM_UNROLL 8         // U · R when m > 1
#define TP_GEMV_UNROLL 8         // U · R: 16-byte weight loads in flight per lane (m = 1)
#define TP_GEMV_UNROLL_SILU 16   // the same with the prologue
// With the AddNorm prologue (H200, Llama-3-8B TP=1, device time per call under --profile):
// q|k|v [6144, 4096] 18.3 µs at R = 4, 18.6 at R = 8 (U · R = 16), against 17.4 plain + the
// separate add + norm; gate|up [28672, 4096] 63.2 at R = 4, 63.1 at R = 8, against 58.8
// plain: the x, delta and norm-weight reads of every wave cost more than the launch they save
// there, so the model folds only into q|k|v.
#define TP_GEMV_ROWS_NORM 4      // R with the AddNorm prologue (amortises its two extra loads)
// With the SiluMul epilogue (gate|up): R rows are R/2 gate rows and the R/2 up rows that pair
// with them, so the wave that finishes a gate row also holds its up row. Llama-3-8B TP=1
// decode on an H200 (graph + PDL, two rounds each, 2026-12-04): R = 4 with U · R = 16 gave
// 237.6–237.8 tok/s, U · R = 8 235.7–235.8, R = 8 (U · R = 16) 230.9–231.0.
#define TP_GEMV_ROWS_GLU 4
#define TP_GEMV_UNROLL_GLU 16    // U · R with the epilogue

// kernels/src/cuda/ops_gemv.rs `GemvParams`, passed by value.
struct GemvParams {
    u64 x;      // f32 [m, k], or [m, 2k] with the SiluMul prologue
    u64 w;      // [n, k], the kernel's dtype
    u64 bias;   // f32 [n], or 0 for none
    u64 y;      // f32 [m, n]
    u32 m, k, n;
    u32 vec;    // 1: x, w (and delta, norm_w, x_out) 16-byte aligned, k whole packs
    u64 delta;  // AddNorm: f32 [m, k], added to x
    u64 norm_w; // AddNorm: f32 [k]
    u64 x_out;  // AddNorm: f32 [m, k] gets x + delta, or 0
    float eps;  // AddNorm: the RMSNorm epsilon
    u32 pad;
};

// The q|k|v epilogue (ops::QkvMatmul, the gemv_rope_* and gemv_norm_rope_* kernels): where the
// product's rows go instead of y. kernels/src/cuda/ops_gemv.rs `GemvRope`.
struct GemvRope {
    u64 q;         // [heads·d] f32
    u64 k_cache;   // [nslots·cap, kv_heads·d], dtype kv_dtype
    u64 v_cache;   // the same
    u64 pos;       // [1] u32: the token's position (step state)
    u64 slots;     // [1] u32: its cache slot, or 0 for one sequence
    u64 inv_freq;  // [half] f32
    u64 cap;       // rows of each slot
    u32 heads, kv_heads;
    u32 half;      // d / 2
    u32 nslots;
    u32 kv_dtype;  // 0 f32, 1 f16, 2 bf16
    u32 pad;
};

// Both, as the rope kernels take them (one parameter struct per kernel).
struct GemvRopeParams {
    GemvParams g;
    GemvRope r;
};

// What f does to x (the op's Prologue, or AddNormMatmul).
#define TP_ACT_NONE 0
#define TP_ACT_SILU 1
#define TP_ACT_NORM 2
// Not a prologue: x is used as it is, and the epilogue writes silu(gate) · up (Epilogue::SiluMul).
#define TP_ACT_GLU 3

// The input rows of one token tile, and the AddNorm prologue's running state.
template <int MT>
struct GemvRows {
    const float* x[MT];  // x rows ([gate | up] with SiluMul)
    const float* d[MT];  // AddNorm: delta rows
    float* out[MT];      // AddNorm: where this wave stores x + delta, or null
    const float* nw;     // AddNorm: norm weights [k]
    float ss[MT];        // AddNorm: this lane's share of Σ (x + delta)²
};

TP_DEV u32 gemv_min(u32 a, u32 b) { return a < b ? a : b; }

// One 16-byte pack of weights: read once, so on CUDA it bypasses L1 (no_allocate) to leave L1
// to x, which every wave re-reads. (On the H200, within 2 % of a plain load and of
// no_allocate with the L2::256B prefetch hint, and never slower on these shapes.)
TP_DEV V16 gemv_ld_w(const u8* p) {
#if defined(TP_CUDA)
    V16 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
        : "l"(p));
    return v;
#else
    return *(const V16*)p;
#endif
}

// f16 weights widened by the hardware conversion alone. portable.h's tp_f16_to_f32 adds a
// NaN test to keep the payload bit-exact, which made the f16 kernels issue-bound (69 % of
// the bf16 speed on [4096, 4096], 85 % on [4096, 14336], H200); a product with a NaN weight
// is NaN whatever the payload, and every other value (subnormals, infinities) converts
// exactly either way.
struct GemvF16Conv {
    TP_DEV static float to(u16 h) {
#if defined(TP_CUDA)
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        return tp_f16_to_f32(h);
#endif
    }
    TP_DEV static u16 from(float f) { return tp_f32_to_f16(f); }
};
typedef Half16<GemvF16Conv> GemvF16;

// silu(g) · u, in the CPU twin's order: g / (1 + e^−g), then · u. For g below about −87 the
// denominator is huge or infinite and __fdividef returns ±0, where the exact quotient is
// below 1e-36: the same to any tolerance.
TP_DEV float gemv_silu_mul(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

// Elements i .. i + V of an f32 row (i a multiple of V; 16-byte aligned on the vector path).
template <int V>
TP_DEV void gemv_ld_x(const float* row, u64 i, float* out) {
#pragma unroll
    for (int q = 0; q < V / 4; ++q) {
        const V16 v = *(const V16*)(row + i + 4 * q);
#pragma unroll
        for (int j = 0; j < 4; ++j) out[4 * q + j] = tp_f32_from_bits(v.w[j]);
    }
}

// The input elements i .. i + V of token t: x itself, silu(gate) · up, or (x + delta) ·
// norm_w, whose square sum the lane accumulates (the 1/rms scales the finished dot products)
// and which the storing wave writes out.
template <int V, int ACT, int MT>
TP_DEV void gemv_act(GemvRows<MT>& in, int t, u32 k, u64 i, float* a) {
    gemv_ld_x<V>(in.x[t], i, a);
    if (ACT == TP_ACT_SILU) {
        float u[V];
        gemv_ld_x<V>(in.x[t] + k, i, u);
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] = gemv_silu_mul(a[e], u[e]);
    }
    if (ACT == TP_ACT_NORM) {
        float d[V], g[V];
        gemv_ld_x<V>(in.d[t], i, d);
        gemv_ld_x<V>(in.nw, i, g);
#pragma unroll
        for (int e = 0; e < V; ++e) {
            a[e] += d[e];
            in.ss[t] = fmaf(a[e], a[e], in.ss[t]);
        }
        if (in.out[t]) {
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                V16 v;
#pragma unroll
                for (int j = 0; j < 4; ++j) v.w[j] = tp_f32_bits(a[4 * q + j]);
                *(V16*)(in.out[t] + i + 4 * q) = v;
            }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] *= g[e];
    }
}

// The scalar path's one element j of token t (as gemv_act).
template <int ACT, int MT>
TP_DEV float gemv_act1(GemvRows<MT>& in, int t, u32 k, u32 j) {
    float a = in.x[t][j];
    if (ACT == TP_ACT_SILU) a = gemv_silu_mul(a, in.x[t][k + j]);
    if (ACT == TP_ACT_NORM) {
        a += in.d[t][j];
        in.ss[t] = fmaf(a, a, in.ss[t]);
        if (in.out[t]) in.out[t][j] = a;
        a *= in.nw[j];
    }
    return a;
}

// acc[r][t] += Σ_e f(x)[t][i + e] · w[r][i + e] over the one pack i of each of the R rows.
template <class W, int R, int MT, int ACT>
TP_DEV void gemv_pack(const V16 (&wv)[R], GemvRows<MT>& in, u32 k, u64 i,
                      float (&acc)[R][MT]) {
    float wf[R][W::V];
#pragma unroll
    for (int r = 0; r < R; ++r) W::unpack(wv[r], wf[r]);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        float a[W::V];
        gemv_act<W::V, ACT, MT>(in, t, k, i, a);
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int e = 0; e < W::V; ++e) acc[r][t] = fmaf(a[e], wf[r][e], acc[r][t]);
        }
    }
}

// tp_pdl_wait() once per thread: `waited` says whether this thread has passed it.
TP_DEV void gemv_wait_once(bool& waited) {
    if (!waited) {
        tp_pdl_wait();
        waited = true;
    }
}

// The 16-byte path: this lane's packs lane, lane + TP_WAVE, ... of k / V, U at a time while
// all U exist for this lane, then one at a time.
//
// `waited`: whether this thread has passed tp_pdl_wait(). The first weight loads are issued
// before it (weights are written by no kernel of the step), so under programmatic dependent
// launch they overlap the end of the kernel before; x, its output, is read only after.
template <class W, int R, int MT, int U, int ACT>
TP_DEV void gemv_dot_vec(const u8* const (&wr)[R], GemvRows<MT>& in, u32 k, u32 lane,
                         float (&acc)[R][MT], bool& waited) {
    const u32 packs = k / W::V;
    u32 c = lane;
    for (; c + (U - 1) * TP_WAVE < packs; c += U * TP_WAVE) {
        V16 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int r = 0; r < R; ++r) wv[u][r] = gemv_ld_w(wr[r] + (u64)(c + u * TP_WAVE) * 16);
        }
        gemv_wait_once(waited);
#pragma unroll
        for (int u = 0; u < U; ++u)
            gemv_pack<W, R, MT, ACT>(wv[u], in, k, (u64)(c + u * TP_WAVE) * W::V, acc);
    }
    gemv_wait_once(waited);
    for (; c < packs; c += TP_WAVE) {
        V16 wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = gemv_ld_w(wr[r] + (u64)c * 16);
        gemv_pack<W, R, MT, ACT>(wv, in, k, (u64)c * W::V, acc);
    }
}

// The scalar path: element j = lane, lane + TP_WAVE, ... of every row, any alignment.
template <class W, int R, int MT, int ACT>
TP_DEV void gemv_dot_scalar(const u8* const (&wr)[R], GemvRows<MT>& in, u32 k, u32 lane,
                            float (&acc)[R][MT]) {
    for (u32 j = lane; j < k; j += TP_WAVE) {
        float wf[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wf[r] = W::get(wr[r], j);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const float a = gemv_act1<ACT, MT>(in, t, k, j);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][t] = fmaf(a, wf[r], acc[r][t]);
        }
    }
}

// The q|k|v epilogue's row of pair `pr` (rows i and i + half of head pr / half, i = pr % half;
// `second`: the latter).
TP_DEV u32 gemv_rope_row(const GemvRope& r, u32 pr, bool second) {
    return (pr / r.half) * 2 * r.half + pr % r.half + (second ? r.half : 0u);
}

// The q|k|v epilogue of pair `pr`, sums a and b (rows i and i + half of head pr / half), by
// the one lane that holds them: QkvRope's work on that pair (kernels/src/gpu/decode.cu
// qkv_rope without the q/k norm, which needs a whole head): bias, then the rotation of q and k
// pairs at pos, then q to r.q, k and v rounded once to row pos of the cache's slot `slot`
// (clamped to the last; nothing stored at a position past the cache, as qkv_rope).
TP_DEV void gemv_rope_put(const GemvRope& r, const float* bias, u32 pr, float a, float b, u32 pos,
                          u32 slot) {
    const u32 half = r.half, head = pr / half, i = pr % half;
    const u64 d = 2 * (u64)half;
    const u32 row = gemv_rope_row(r, pr, false);
    if (bias) {
        a += bias[row];
        b += bias[row + half];
    }
    if (head < r.heads + r.kv_heads) rope_pair((float)pos, ((const float*)r.inv_freq)[i], a, b, a, b);
    if (head < r.heads) {
        float* q = (float*)r.q + head * d;
        q[i] = a;
        q[i + half] = b;
    } else if ((u64)pos < r.cap) {
        const u64 at = (u64)gemv_min(slot, r.nslots - 1) * r.cap + pos;
        const bool is_k = head < r.heads + r.kv_heads;
        u8* c = (u8*)(is_k ? r.k_cache : r.v_cache);
        const u64 e = at * r.kv_heads * d + (head - r.heads - (is_k ? 0u : r.kv_heads)) * d + i;
        put_any(c, e, r.kv_dtype, a);
        put_any(c, e + half, r.kv_dtype, b);
    }
}

// ROPE (m = 1 only): the q|k|v epilogue instead of y, `rp` its arguments; a row group is then
// H = R/2 pairs (i, i + half) of heads, both rows of a pair summed by the same wave.
template <class W, int R, int MT, int U, int ACT, bool ROPE = false>
TP_DEV void gemv(const GemvParams& p, const GemvRope* rp = nullptr) {
    static_assert(R * MT <= TP_WAVE, "one writing lane per (row, token)");
    // The SiluMul epilogue: w's rows are [gate (n/2) | up (n/2)]; a row group is H = R/2 gate
    // rows j .. j + H and the up rows n/2 + j .. n/2 + j + H, and y has n/2 columns.
    constexpr bool GLU = ACT == TP_ACT_GLU;
    static_assert(!GLU || R % 2 == 0, "gate and up rows in pairs");
    static_assert(!ROPE || (R % 2 == 0 && MT == 1 && !GLU), "rope pairs, one token");
    constexpr int H = GLU || ROPE ? R / 2 : R;  // outputs (pairs) per row group
    const u32 nout = GLU || ROPE ? p.n / 2 : p.n;
    // ROPE: the token's position and cache slot are step state, written before the step by
    // the host or the last step's sampler, never by a kernel of it: loaded before the wait,
    // and first used in the epilogue, so that the weight loads issue without waiting on them.
    // (What this needs is that neither the kernel just before nor any still running wrote
    // them: under PDL every kernel before that one has completed when this one launches.)
    u32 pos = 0, slot = 0;
    if (ROPE) {
        pos = *(const u32*)rp->pos;
        if (rp->slots) slot = *(const u32*)rp->slots;
    }
    const u32 lane = threadIdx.x % TP_WAVE;
    const u32 waves = blockDim.x / TP_WAVE;
    // m = 1: row groups along grid x. m > 1: token tiles along grid x and row groups along y,
    // so that the tiles of one row group are launched side by side: its weights come from HBM
    // once and from L2 for the other tiles (tiles along y re-read every weight from HBM once
    // per tile: a batch of 16 cost two full weight passes).
    const u32 tile0 = MT > 1 ? blockIdx.x : blockIdx.y, tiles_step = MT > 1 ? gridDim.x : gridDim.y;
    const u32 group0 = MT > 1 ? blockIdx.y : blockIdx.x, groups_step = MT > 1 ? gridDim.y : gridDim.x;
    const u32 groups = (nout + H - 1) / H;
    const u32 tiles = (p.m + MT - 1) / MT;
    const u64 xk = ACT == TP_ACT_SILU ? 2ull * p.k : (u64)p.k;
    const float* x = (const float*)p.x;
    const u8* w = (const u8*)p.w;
    float* y = (float*)p.y;
    const float* bias = (const float*)p.bias;
    // A thread with no rows to compute exits without waiting: it reads and writes nothing.
    bool waited = false;
    for (u32 tile = tile0; tile < tiles; tile += tiles_step) {
        const u32 t0 = tile * MT;
        // Tokens past m repeat the last one: computed like the others, never written.
        GemvRows<MT> in;
        in.nw = (const float*)p.norm_w;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const u64 row = gemv_min(t0 + t, p.m - 1);
            in.x[t] = x + row * xk;
            in.d[t] = (const float*)p.delta + row * p.k;
        }
        // g is the same in every lane of a wave, so whole waves take the loops and shuffles.
        for (u32 g = group0 * waves + threadIdx.x / TP_WAVE; g < groups;
             g += groups_step * waves) {
            // Rows past n (past each half with the epilogue) repeat the last one, likewise.
            const u8* wr[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                u32 row;
                if (GLU) {
                    row = (r < H ? 0u : nout) + gemv_min(g * H + r % H, nout - 1);
                } else if (ROPE) {
                    row = gemv_rope_row(*rp, gemv_min(g * H + r % H, nout - 1), r >= H);
                } else {
                    row = gemv_min(g * R + r, p.n - 1);
                }
                wr[r] = w + (u64)row * p.k * W::SIZE;
            }
            float acc[R][MT];
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;
            }
            // AddNorm: the first row group's wave stores x + delta of the tile's real tokens.
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                in.ss[t] = 0.0f;
                in.out[t] = ACT == TP_ACT_NORM && p.x_out && g == 0 && t0 + t < p.m
                                ? (float*)p.x_out + (u64)(t0 + t) * p.k
                                : nullptr;
            }
            if (p.vec) {
                gemv_dot_vec<W, R, MT, U, ACT>(wr, in, p.k, lane, acc, waited);
            } else {
                gemv_wait_once(waited);
                gemv_dot_scalar<W, R, MT, ACT>(wr, in, p.k, lane, acc);
            }
            // AddNorm: every lane's share of every element seen, the row's 1/rms.
            float rs[MT];
#pragma unroll
            for (int t = 0; t < MT; ++t)
                rs[t] = ACT == TP_ACT_NORM ? rsqrtf(tp_wave_sum(in.ss[t]) / (float)p.k + p.eps)
                                           : 1.0f;
            if (ROPE) {
                // Lane r holds pair g·H + r's two sums (every lane has them after the butterfly).
#pragma unroll
                for (int r = 0; r < H; ++r) {
                    const float a = tp_wave_sum(acc[r][0]) * rs[0];
                    const float b = tp_wave_sum(acc[r + H][0]) * rs[0];
                    const u32 pr = g * H + r;
                    if (lane == (u32)r && pr < nout) gemv_rope_put(*rp, bias, pr, a, b, pos, slot);
                }
            } else if (GLU) {
                // Every lane holds every sum after the butterfly; lane r·MT + t writes
                // y[t, j] = silu(gate_j) · up_j for the group's output j = g·H + r.
#pragma unroll
                for (int r = 0; r < H; ++r) {
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        float a = tp_wave_sum(acc[r][t]), b = tp_wave_sum(acc[r + H][t]);
                        const u32 j = g * H + r, tok = t0 + t;
                        if (lane == (u32)(r * MT + t) && j < nout && tok < p.m) {
                            if (bias) {
                                a += bias[j];
                                b += bias[nout + j];
                            }
                            y[(u64)tok * nout + j] = gemv_silu_mul(a, b);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int r = 0; r < R; ++r) {
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        float s = tp_wave_sum(acc[r][t]) * rs[t];
                        const u32 row = g * R + r, tok = t0 + t;
                        if (lane == (u32)(r * MT + t) && row < p.n && tok < p.m) {
                            if (bias) s += bias[row];
                            y[(u64)tok * p.n + row] = s;
                        }
                    }
                }
            }
        }
    }
}

// Kernel names: gemv_* (m = 1), gemm4_* (2 <= m <= 4) and gemm_* (m > 4), plain, _silu,
// _norm and _glu (the SiluMul epilogue), per weight dtype; the order of kernels/src/cuda/ops_gemv.rs NAMES. The tiled kernels
// take R = 4 rows per wave (each x element loaded serves 4 rows: with R = 2 and one load in
// flight per row, a tile of 8 cost 4 single-token passes, H200) and U · R = 8 weight loads in
// flight per lane.
#define TP_GEMV_KERNEL(name, W, R, MT, U, ACT)                                          \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(256, 1) name(const GemvParams p) {      \
        gemv<W, R, MT, U, ACT>(p); /* waits for the kernel before once its loads are out */ \
    }
#define TP_GEMV_DTYPE(d, W)                                                                  \
    TP_GEMV_KERNEL(gemv_##d, W, TP_GEMV_ROWS, 1, TP_GEMV_UNROLL / TP_GEMV_ROWS, TP_ACT_NONE) \
    TP_GEMV_KERNEL(gemv_silu_##d, W, TP_GEMV_ROWS_SILU, 1,                                   \
                   TP_GEMV_UNROLL_SILU / TP_GEMV_ROWS_SILU, TP_ACT_SILU)                     \
    TP_GEMV_KERNEL(gemv_norm_##d, W, TP_GEMV_ROWS_NORM, 1,                                   \
                   TP_GEMV_UNROLL / TP_GEMV_ROWS_NORM, TP_ACT_NORM)                          \
    TP_GEMV_KERNEL(gemv_glu_##d, W, TP_GEMV_ROWS_GLU, 1,                                     \
                   TP_GEMV_UNROLL_GLU / TP_GEMV_ROWS_GLU, TP_ACT_GLU)                        \
    TP_GEMV_KERNEL(gemm4_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS_SMALL,                         \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_NONE)                               \
    TP_GEMV_KERNEL(gemm4_silu_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS_SMALL,                    \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_SILU)                               \
    TP_GEMV_KERNEL(gemm4_norm_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS_SMALL,                    \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_NORM)                               \
    TP_GEMV_KERNEL(gemm4_glu_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS_SMALL,                     \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_GLU)                                \
    TP_GEMV_KERNEL(gemm_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS, TP_GEMM_UNROLL / TP_GEMM_ROWS,  \
                   TP_ACT_NONE)                                                              \
    TP_GEMV_KERNEL(gemm_silu_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS,                           \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_SILU)                               \
    TP_GEMV_KERNEL(gemm_norm_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS,                           \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_NORM)                               \
    TP_GEMV_KERNEL(gemm_glu_##d, W, TP_GEMM_ROWS, TP_GEMV_TOKENS,                            \
                   TP_GEMM_UNROLL / TP_GEMM_ROWS, TP_ACT_GLU)

TP_GEMV_DTYPE(f32, F32)
TP_GEMV_DTYPE(f16, GemvF16)
TP_GEMV_DTYPE(bf16, BF16)

// gemv_rope_* and gemv_norm_rope_* (ops::QkvMatmul: m = 1, the q|k|v epilogue), after the
// kernels above in ops_gemv.rs NAMES. R and U as gemv_* and gemv_norm_*.
#define TP_GEMV_ROPE_KERNEL(name, W, R, U, ACT)                                         \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(256, 1) name(const GemvRopeParams p) {  \
        gemv<W, R, 1, U, ACT, true>(p.g, &p.r);                                         \
    }
#define TP_GEMV_ROPE_DTYPE(d, W)                                                              \
    TP_GEMV_ROPE_KERNEL(gemv_rope_##d, W, TP_GEMV_ROWS, TP_GEMV_UNROLL / TP_GEMV_ROWS,        \
                        TP_ACT_NONE)                                                          \
    TP_GEMV_ROPE_KERNEL(gemv_norm_rope_##d, W, TP_GEMV_ROWS_NORM,                             \
                        TP_GEMV_UNROLL / TP_GEMV_ROWS_NORM, TP_ACT_NORM)
TP_GEMV_ROPE_DTYPE(f32, F32)
TP_GEMV_ROPE_DTYPE(f16, GemvF16)
TP_GEMV_ROPE_DTYPE(bf16, BF16)

// ---------------------------------------------------------------------------------------------
// The tensor-core product of a batch (m > 4; decode batches of `tprun serve`, prefill), bf16
// weights on the 16-byte path, sm_80+ (kernels/src/cuda/ops_gemv.rs picks it; everywhere else
// the tiled kernels above run, and on other targets these kernels are empty and never chosen).
//
// Why: the tiled SIMT kernels above spend one fmaf per weight element per token, so a batch of
// 16 is issue-bound (a product of 16 tokens cost ~3.6 single-token passes, H200). mma.sync
// m16n8k16 does 2048 multiply-adds per instruction, so the batch costs about one weight pass.
//
// Mapping. A block of TP_TC_WARPS warps owns TP_TC_TILES tiles of 16 weight rows (with the
// SiluMul epilogue a tile is 8 gate rows and their 8 up rows, 8 outputs) and MT = 8 · TG
// tokens; its warps split k. Lane (g = lane / 4, c = lane % 4) loads 16 bytes (8 bf16) of
// weight rows g and g + 8 of each tile at element 8 · (4s + c) for the warp's steps s, and the
// 8 f32 of x (token g of each group of 8 tokens) at the same elements. A dot product does not
// depend on the order of k, so the mma's k index is permuted the same way on both sides: the
// words 0 and 1 of the lane's pack are its fragment's k pairs (2c, 2c + 1) and (2c + 8, 2c + 9)
// of one mma, words 2 and 3 those of a second: both operands are then loaded in 16-byte packs
// with no shuffle or shared-memory staging.
//
// Precision. x is f32; the weights are bf16 and exact in the mma. x is split into three bf16
// planes, x = a + b + c, each the nearest bf16 of what is left (the subtractions are exact), so
// the split loses at most 2^-24 · |x|, like an f32 rounding, and the product is three mmas.
// The tensor core's f32 accumulation may truncate, so each warp's sums start from zero for
// every U steps (at most 12 mmas) and are added to the running f32 sums with ordinary adds.
// The warps' partial sums meet in shared memory; warp 0 adds them and writes y.
//
// Measured: see docs/perf-notes.md (Continuous batching: tensor cores).
#define TP_TC_WARPS 8    // warps per block, splitting k
#define TP_TC_TILES 2    // 16-row mma tiles per block
#define TP_TC_UNROLL 2   // steps (32 elements of k per row) loaded before any is used

#if defined(TP_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TP_TC 1
#endif

#if defined(TP_TC)
// Two f32 as bf16x2, each rounded to nearest: `lo` in the low half (the lower k index).
TP_DEV u32 tc_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// x0, x1 as three bf16x2 planes whose sum is x0, x1 within 2^-24 relative.
TP_DEV void tc_split(float x0, float x1, u32 (&s)[3]) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        s[i] = tc_bf16x2(x0, x1);
        x0 -= tp_f32_from_bits(s[i] << 16);
        x1 -= tp_f32_from_bits(s[i] & 0xffff0000u);
    }
}

// c += a · b: a 16 × 16 bf16 tile (4 words per lane), b 16 × 8 (2 words), c 16 × 8 f32.
TP_DEV void tc_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

template <int TG, int ACT>
TP_DEV void gemm_tc(const GemvParams& p) {
#if defined(TP_TC)
    constexpr int RT = TP_TC_TILES, NW = TP_TC_WARPS, U = TP_TC_UNROLL, MT = 8 * TG;
    constexpr bool GLU = ACT == TP_ACT_GLU, NORM = ACT == TP_ACT_NORM;
    constexpr u32 OUT = GLU ? 8 : 16;  // outputs per tile
    static_assert(ACT != TP_ACT_SILU, "the prologue stays on the SIMT kernels");
    __shared__ float part[NW - 1][RT][TG][4][32];
    __shared__ float sq[NW][MT];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 g = lane / 4, c = lane % 4;
    const u32 nout = GLU ? p.n / 2 : p.n;
    const u32 packs = p.k / 8, steps = (packs + 3) / 4;
    const u32 blocks = (nout + RT * OUT - 1) / (RT * OUT);
    const u32 t0 = blockIdx.x * MT;
    const float* x = (const float*)p.x;
    const float* bias = (const float*)p.bias;
    float* y = (float*)p.y;
    // The lane's token of each group; tokens past m repeat the last (computed, never written).
    const float* xr[TG];
    const float* dr[TG];
    float* outr[TG];
#pragma unroll
    for (int t = 0; t < TG; ++t) {
        const u32 tok = t0 + 8 * t + g;
        const u64 row = gemv_min(tok, p.m - 1);
        xr[t] = x + row * p.k;
        dr[t] = (const float*)p.delta + row * p.k;
        outr[t] = NORM && p.x_out && blockIdx.y == 0 && tok < p.m ? (float*)p.x_out + row * p.k
                                                                   : nullptr;
    }
    bool waited = false;
    for (u32 b = blockIdx.y; b < blocks; b += gridDim.y) {
        // Weight rows g and g + 8 of each tile (past n, or past each half: the last one).
        const u8* wa[RT];
        const u8* wb[RT];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            const u32 o = (b * RT + r) * OUT + g;
            u32 ra, rb;
            if (GLU) {
                ra = gemv_min(o, nout - 1);
                rb = nout + ra;
            } else {
                ra = gemv_min(o, p.n - 1);
                rb = gemv_min(o + 8, p.n - 1);
            }
            wa[r] = (const u8*)p.w + (u64)ra * p.k * 2;
            wb[r] = (const u8*)p.w + (u64)rb * p.k * 2;
        }
        float acc[RT][TG][4];
        float ss[TG];
#pragma unroll
        for (int t = 0; t < TG; ++t) {
            ss[t] = 0.0f;
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.0f;
            }
        }
        for (u32 s0 = warp * U; s0 < steps; s0 += NW * U) {
            V16 wv[U][RT][2];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 q = 4 * (s0 + u) + c;
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    if (q < packs) {
                        wv[u][r][0] = gemv_ld_w(wa[r] + (u64)q * 16);
                        wv[u][r][1] = gemv_ld_w(wb[r] + (u64)q * 16);
                    } else {
                        wv[u][r][0] = wv[u][r][1] = V16{};
                    }
                }
            }
            gemv_wait_once(waited);
            float cc[RT][TG][4];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int t = 0; t < TG; ++t) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) cc[r][t][i] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (s0 + u >= steps) break;  // the same for the whole warp
                const u32 q = 4 * (s0 + u) + c;
#pragma unroll
                for (int t = 0; t < TG; ++t) {
                    float a[8];
                    if (q < packs) {
                        gemv_ld_x<8>(xr[t], (u64)q * 8, a);
                        if (NORM) {
                            float d[8], nw[8];
                            gemv_ld_x<8>(dr[t], (u64)q * 8, d);
                            gemv_ld_x<8>((const float*)p.norm_w, (u64)q * 8, nw);
#pragma unroll
                            for (int e = 0; e < 8; ++e) {
                                a[e] += d[e];
                                ss[t] = fmaf(a[e], a[e], ss[t]);
                            }
                            if (outr[t] && b == blockIdx.y) {
#pragma unroll
                                for (int h = 0; h < 2; ++h) {
                                    V16 v;
#pragma unroll
                                    for (int j = 0; j < 4; ++j) v.w[j] = tp_f32_bits(a[4 * h + j]);
                                    *(V16*)(outr[t] + (u64)q * 8 + 4 * h) = v;
                                }
                            }
#pragma unroll
                            for (int e = 0; e < 8; ++e) a[e] *= nw[e];
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) a[e] = 0.0f;
                    }
                    u32 s[4][3];
#pragma unroll
                    for (int j = 0; j < 4; ++j) tc_split(a[2 * j], a[2 * j + 1], s[j]);
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        const V16& lo = wv[u][r][0];
                        const V16& hi = wv[u][r][1];
#pragma unroll
                        for (int pl = 0; pl < 3; ++pl) {
                            tc_mma(cc[r][t], lo.w[0], hi.w[0], lo.w[1], hi.w[1], s[0][pl], s[1][pl]);
                            tc_mma(cc[r][t], lo.w[2], hi.w[2], lo.w[3], hi.w[3], s[2][pl], s[3][pl]);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int t = 0; t < TG; ++t) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[r][t][i] += cc[r][t][i];
                }
            }
        }
        // y is written below: not before the kernel before has finished with it.
        gemv_wait_once(waited);
        // The warps' partial sums (and square sums) meet in shared memory.
        if (NORM) {
#pragma unroll
            for (int t = 0; t < TG; ++t) {
                float v = ss[t];
                v += tp_shfl_xor(v, 1);
                v += tp_shfl_xor(v, 2);
                if (c == 0) sq[warp][8 * t + g] = v;
            }
        }
        if (warp > 0) {
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int t = 0; t < TG; ++t) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) part[warp - 1][r][t][i][lane] = acc[r][t][i];
                }
            }
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int w = 0; w < NW - 1; ++w) {
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int t = 0; t < TG; ++t) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[r][t][i] += part[w][r][t][i][lane];
                    }
                }
            }
            // Lane (g, c) holds tokens 2c and 2c + 1 of each group: rows g and g + 8 of each
            // tile (with the epilogue: gate and up of output g).
#pragma unroll
            for (int t = 0; t < TG; ++t) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 slot = 8 * t + 2 * c + h, tok = t0 + slot;
                    float rs = 1.0f;
                    if (NORM) {
                        float tot = 0.0f;
#pragma unroll
                        for (int w = 0; w < NW; ++w) tot += sq[w][slot];
                        rs = rsqrtf(tot / (float)p.k + p.eps);
                    }
                    if (tok >= p.m) continue;
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        const u32 o = (b * RT + r) * OUT + g;
                        if (GLU) {
                            if (o < nout) {
                                float a = acc[r][t][h], u = acc[r][t][2 + h];
                                if (bias) {
                                    a += bias[o];
                                    u += bias[nout + o];
                                }
                                y[(u64)tok * nout + o] = gemv_silu_mul(a, u);
                            }
                        } else {
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const u32 row = o + 8 * e;
                                if (row < p.n) {
                                    float s = acc[r][t][2 * e + h] * rs;
                                    if (bias) s += bias[row];
                                    y[(u64)tok * p.n + row] = s;
                                }
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();  // shared memory is reused by the next row block
    }
#endif
}

// gemm{16,32}_tc_{plain,norm,glu}_bf16: 16 or 32 tokens per tile; ops_gemv.rs NAMES order.
#define TP_TC_KERNEL(name, TG, ACT)                                                        \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_TC_WARPS * 32, 1) name(const GemvParams p) { \
        gemm_tc<TG, ACT>(p);                                                               \
    }
TP_TC_KERNEL(gemm16_tc_bf16, 2, TP_ACT_NONE)
TP_TC_KERNEL(gemm16_tc_norm_bf16, 2, TP_ACT_NORM)
TP_TC_KERNEL(gemm16_tc_glu_bf16, 2, TP_ACT_GLU)
TP_TC_KERNEL(gemm32_tc_bf16, 4, TP_ACT_NONE)
TP_TC_KERNEL(gemm32_tc_norm_bf16, 4, TP_ACT_NORM)
TP_TC_KERNEL(gemm32_tc_glu_bf16, 4, TP_ACT_GLU)

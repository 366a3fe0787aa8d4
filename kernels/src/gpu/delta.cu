// delta.cu: the three ops of a Gated DeltaNet layer (Qwen3.5's `linear_attention`):
// `Op::CausalConv` (the short depthwise convolution + SiLU), `Op::GatedDelta` (the gated delta
// rule through one sequence's recurrent state) and `Op::GatedRmsNorm` (the closing norm, gated
// by SiLU(z)). The exact math and shapes are the op structs' docs in kernels/src/ops.rs.
//
// Owns: these kernels and their parameter structs. Must not: allocate, synchronise with the
// host, or keep anything between launches (the conv window and the state live in the
// caller's buffers, so one captured graph replays for every token).
//
// CPU twins: kernels/src/cpu/ops/delta.rs. Launchers and the Rust mirrors of the parameter
// structs (same sizes, asserted): kernels/src/cuda/ops_delta.rs.
//
// Where the time goes at decode (rows = 1), Qwen3.5-27B (16 key heads, 48 value heads, dk = dv
// = 128, conv channels 2·16·128 + 48·128 = 10240; a TP rank holds 1/world of each):
// - gated_delta moves the recurrent state, 64 KiB of f32 per value head, read once and
//   written once per token: 2 · 48 · 64 KiB = 6 MiB per layer at TP = 1 (1.5 MiB per rank at
//   TP = 4). Everything else it touches (one qkv row, b, a: ~40 KiB) is noise. That is
//   ~1.5 µs at the H200's measured 4.26 TB/s copy rate (kernels/src/cuda/NOTES.md), so this
//   is the one kernel here whose bandwidth matters; its mapping is below.
// - causal_conv moves 48 bytes per channel (x and out 4 each, 4 taps 16, the 3-float window
//   12 read and 12 written): 480 KiB at TP = 1; gated_rms_norm reads x and z and writes out,
//   12 bytes per element: 48 · 128 · 12 B = 72 KiB. Both are one launch and one memory round
//   trip (launch-bound, a few µs), as decode.cu's small ops.
//
// Floating point: the runtime compiles with --fmad=false --ftz=false and no fast math (see
// decode.cu), so expf, log1pf, sqrtf and divisions are the precise library versions. The conv
// and the norm keep the twin's order of operations (the conv's sum is bit-exact; only expf
// differs, by ≤ 2 ulp); gated_delta sums its dot products in another order, with explicit
// fused multiply-adds (fmaf): the tolerances in ops_delta.rs say how far that may go.

#include "portable.h"

// Threads of a causal_conv block: one channel per thread (8 warps / 4 wave64s; a common
// choice, not tuned: at 2560–10240 channels that is 10–40 blocks, launch-bound either way).
#define TP_CONV_THREADS 256
// Largest conv kernel (taps): the window and the taps live in registers, unrolled to this.
// Qwen3.5 uses 4 (`linear_conv_kernel_dim`); the launcher refuses more.
#define TP_CONV_KMAX 8
// Value columns of S per gated_delta block: 16 f32 = 64 bytes of a state row, two full 32-byte
// sectors, so a wave's loads are whole sectors (a 32-lane warp reads two rows' 64 bytes, a
// wave64 four).
#define TP_DELTA_COLS 16
// Row groups of a gated_delta block: thread (c, g) holds rows g, g + 16, g + 32, ... of column
// c. 16 × 16 = 256 threads.
#define TP_DELTA_GROUPS 16
#define TP_DELTA_THREADS 256
// Largest dk: a thread keeps dk / TP_DELTA_GROUPS state values in registers (two kernels: up to
// 8 or up to 16), and a block's TP_DELTA_THREADS threads load one q and one k element each.
#define TP_DELTA_DKMAX 256
// ε of the q and k L2 norms (ops::DELTA_L2_EPS, transformers' `l2norm`).
#define TP_DELTA_L2_EPS 1e-6f
// Most threads of a gated_rms_norm block (heads of 128: 128 threads, one element each).
#define TP_GNORM_THREADS 256

// silu(x) = x / (1 + e^−x): the twin's expression (cpu/ops/delta.rs, as elementwise.rs);
// e^−x overflowing to inf gives ±0 as on the CPU.
TP_DEV float dn_silu(float x) { return x / (1.0f + expf(-x)); }

// ---- CausalConv -------------------------------------------------------------------------

// Arguments of causal_conv. 48 bytes.
struct ConvParams {
    u64 x;       // [rows, channels] f32
    u64 w;       // [channels, kernel] f32
    u64 state;   // [channels, kernel - 1] f32, oldest first; read and written
    u64 out;     // [rows, channels] f32 (not overlapping x)
    u32 rows;
    u32 channels;
    u32 kernel;  // 2 ..= TP_CONV_KMAX
    u32 pad;
};

// Per channel c, rows in order: out[r, c] = silu(Σ_{j < K−1} w[c, j] · win[j] + w[c, K−1] ·
// x[r, c]), then the window slides (win ← win[1..] ++ x[r, c]); the window is written back
// once at the end. The sum runs in the twin's order from 0, with separate products and adds
// (--fmad=false), so it is bit-exact; only expf differs.
// Grid: 1-D, ceil(channels / TP_CONV_THREADS) blocks, one thread per channel. x and out are
// read and written coalesced (consecutive threads, consecutive channels); w and the window
// are K and K − 1 floats per thread (16 B stride at K = 4: each warp load touches 512
// contiguous bytes, the rest of each line used by the next tap's load, L1 hits).
// The taps are weights and the window was written by earlier steps (this kernel at the
// previous token, or the fill that starts a sequence, many kernels back): no kernel of this
// step writes either before this one, so both are loaded before tp_pdl_wait(), and the
// window's HBM round trip (120 KiB at TP = 1, long evicted by the weights between two
// tokens) overlaps the kernel before. Only x, that kernel's output, is read after it.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_CONV_THREADS, 1) causal_conv(ConvParams p) {
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    const bool mine = c < p.channels;
    const u32 kn = p.kernel;
    const float* w = (const float*)p.w + (u64)c * kn;
    float* state = (float*)p.state + (u64)c * (kn - 1);
    // Taps 0 .. K − 2 against the window; `last` against the new input.
    float taps[TP_CONV_KMAX - 1], win[TP_CONV_KMAX - 1];
#pragma unroll
    for (u32 j = 0; j < TP_CONV_KMAX - 1; ++j) {
        taps[j] = mine && j + 1 < kn ? w[j] : 0.0f;
        win[j] = mine && j + 1 < kn ? state[j] : 0.0f;
    }
    const float last = mine ? w[kn - 1] : 0.0f;
    tp_pdl_wait();
    if (!mine) return;  // no barrier below: idle threads may leave
    const float* x = (const float*)p.x + c;
    float* out = (float*)p.out + c;
    for (u32 r = 0; r < p.rows; ++r) {
        const float nx = x[(u64)r * p.channels];
        float acc = 0.0f;
#pragma unroll
        for (u32 j = 0; j < TP_CONV_KMAX - 1; ++j)
            if (j + 1 < kn) acc += taps[j] * win[j];
        acc += last * nx;
        out[(u64)r * p.channels] = dn_silu(acc);
        // Slide: win[j] ← win[j + 1] for j < K − 2, win[K − 2] ← the new input (unrolled with
        // compile-time indices, so the window stays in registers).
#pragma unroll
        for (u32 j = 0; j < TP_CONV_KMAX - 1; ++j) {
            if (j + 2 < kn) {
                win[j] = win[j + 1];
            } else if (j + 2 == kn) {
                win[j] = nx;
            }
        }
    }
#pragma unroll
    for (u32 j = 0; j < TP_CONV_KMAX - 1; ++j)
        if (j + 1 < kn) state[j] = win[j];
}

// ---- GatedDelta -------------------------------------------------------------------------

// Arguments of gated_delta. 80 bytes.
struct DeltaParams {
    u64 qkv;      // [rows, 2·k_heads·dk + v_heads·dv] f32, each row [q | k | v]
    u64 b;        // [rows, v_heads] f32
    u64 a;        // [rows, v_heads] f32
    u64 a_log;    // [v_heads] f32
    u64 dt_bias;  // [v_heads] f32
    u64 state;    // [v_heads, dk, dv] f32, S_h[i][j] at (h·dk + i)·dv + j; read and written
    u64 out;      // [rows, v_heads, dv] f32
    u32 rows;
    u32 k_heads;
    u32 v_heads;
    u32 dk;       // ≤ TP_DELTA_DKMAX
    u32 dv;
    float scale;  // 1/√dk, rounded to f32 on the host as the twin does
};

// Σ of a and of b over the block, returned to every thread: each wave adds in butterfly order
// (tp_wave_sum), then every thread adds the wave sums in wave order (deterministic, not the
// twin's sequential order). Every thread must call it; it holds one barrier, and `red` must
// not be written again until every thread has read it (gated_delta's later barriers in the
// same row see to that).
TP_DEV void dn_block_sum2(float& a, float& b, float* red) {
    constexpr u32 waves = TP_DELTA_THREADS / TP_WAVE;
    a = tp_wave_sum(a);
    b = tp_wave_sum(b);
    const u32 w = threadIdx.x / TP_WAVE;
    if (threadIdx.x % TP_WAVE == 0) {
        red[w] = a;
        red[waves + w] = b;
    }
    __syncthreads();
    a = 0.0f;
    b = 0.0f;
    for (u32 i = 0; i < waves; ++i) {
        a += red[i];
        b += red[waves + i];
    }
}

// One row's inputs of one thread: its element of the key head's q and k (threads < dk), the
// value of its column, and the value head's b and a.
struct DeltaIn {
    float q, k, v, b, a;
};

TP_DEV DeltaIn dn_load(const DeltaParams& p, u32 row, u32 key, u32 h, u32 j) {
    const u64 width = 2 * (u64)p.k_heads * p.dk + (u64)p.v_heads * p.dv;
    const float* in = (const float*)p.qkv + row * width;
    const u32 t = threadIdx.x;
    DeltaIn d;
    d.q = t < p.dk ? in[(u64)key * p.dk + t] : 0.0f;
    d.k = t < p.dk ? in[((u64)p.k_heads + key) * p.dk + t] : 0.0f;
    d.v = j < p.dv ? in[2 * (u64)p.k_heads * p.dk + (u64)h * p.dv + j] : 0.0f;
    d.b = ((const float*)p.b)[(u64)row * p.v_heads + h];
    d.a = ((const float*)p.a)[(u64)row * p.v_heads + h];
    return d;
}

// softplus(x) = ln(1 + eˣ), linear above 20: the twin's (and torch's F.softplus) threshold.
TP_DEV float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The gated delta rule of one value head h over a slice of its value columns, rows in order.
// Per row (key head key = h / (v_heads / k_heads)):
//     q̂ = q_key / √(Σq² + ε) · scale,  k̂ = k_key / √(Σk² + ε)
//     β = σ(b),  g = −exp(a_log) · softplus(a + dt_bias)
//     S ← e^g · S;  δ_j = β (v_j − Σ_i S_ij k̂_i);  S_ij += k̂_i δ_j;  o_j = Σ_i S_ij q̂_i
// Each column j of S evolves on its own given (q̂, k̂, β, g): columns need no communication,
// only the sums over i within a column do.
//
// Grid: x = ceil(dv / TP_DELTA_COLS) column slices, y = v_heads. Block: TP_DELTA_THREADS =
// TP_DELTA_COLS columns × TP_DELTA_GROUPS row groups; thread (c = t % 16, g = t / 16) keeps
// S[i][j] for j = slice·16 + c and i = g, g + 16, ... < dk in registers (8 values at dk = 128)
// for all rows of the launch: S is read from memory once and written once per launch, however
// many rows (tokens) it runs. The two column sums per row (Sᵀk̂ and Sᵀq̂) are a thread's
// partial over its rows, then the 16 groups' partials added in group order through shared
// memory. The q/k norms of the key head are recomputed by each of its blocks (a 1 KiB read
// from L2); threads t < dk load q[t] and k[t].
//
// Bandwidth at decode: 2 · v_heads · dk · dv · 4 bytes of state, every load and store a
// whole 64-byte run of a state row (two sectors), so every byte fetched is used. All of a
// thread's state loads are independent and issued back to back, so a block has its whole
// 8 KiB tile (dk = 128) in flight at once: at v_heads = 48 (27B, TP = 1), 384 blocks of 256
// threads, all resident at once on an H200's 132 SMs (4 blocks per SM, see the instantiations
// below), issue the whole 3 MiB read in one wave; the write back is the same. So the kernel
// costs what a 6 MiB device copy costs (3 MiB read, 3 MiB written: 1.5 µs of transfer at
// 4.26 TB/s) plus what lies between its reads and its writes (a memory round trip, the four
// barriers, ~1 µs): expected ~2.5–3.5 µs, 50–60 % of the large-copy rate and close to a copy
// of the same size, which pays the same fixed costs. At v_heads = 12 (TP = 4) 96 blocks move
// 1.5 MiB: latency-bound (one round trip to HBM and back, a few µs with the launch). Not yet
// measured: the `#[ignore]`d timing test in ops_delta.rs prints it beside a same-size copy.
//
// Prefill (rows > 1) runs the recurrence row by row inside the block (four barriers a row);
// the next row's q, k, v, b and a are loaded while the current row computes.
//
// Floating point: the sums over i are in another order than the twin's (a thread's rows in
// order, then the groups), with fused multiply-adds, and the q/k sums of squares are block
// tree sums; β, softplus, e^g as the twin's expressions with precise expf / log1pf.
//
// RPT: state rows per thread (the register array), ≥ ceil(dk / TP_DELTA_GROUPS).
template <u32 RPT>
TP_DEV void gated_delta(const DeltaParams& p) {
    __shared__ float qh[TP_DELTA_DKMAX];
    __shared__ float kh[TP_DELTA_DKMAX];
    __shared__ float red[2 * (TP_DELTA_THREADS / TP_WAVE)];
    __shared__ float pk[TP_DELTA_GROUPS][TP_DELTA_COLS];
    __shared__ float po[TP_DELTA_GROUPS][TP_DELTA_COLS];

    const u32 c = threadIdx.x % TP_DELTA_COLS;
    const u32 g = threadIdx.x / TP_DELTA_COLS;
    const u32 h = blockIdx.y;
    const u32 j = blockIdx.x * TP_DELTA_COLS + c;
    const u32 dk = p.dk, dv = p.dv;
    const bool col = j < dv;
    const u32 key = h / (p.v_heads / p.k_heads);
    // Read before tp_pdl_wait(), as written by no kernel of this step before this one: the
    // weights, and the state S (this kernel's output at the previous token, or the fill that
    // starts a sequence, many kernels back), so that its 3 MiB HBM read (27B, TP = 1)
    // overlaps the convolution before instead of following it. q, k, v (the convolution's
    // output), b and a are read after it.
    const float neg_a = -expf(((const float*)p.a_log)[h]);
    const float dt_bias = ((const float*)p.dt_bias)[h];
    // This thread's column of S: rows g + TP_DELTA_GROUPS · r. Rows past dk and columns past dv
    // hold 0 and are never stored.
    float* S = (float*)p.state + (u64)h * dk * dv + j;
    float s[RPT];
#pragma unroll
    for (u32 r = 0; r < RPT; ++r) {
        const u32 i = g + TP_DELTA_GROUPS * r;
        s[r] = col && i < dk ? S[(u64)i * dv] : 0.0f;
    }
    tp_pdl_wait();

    DeltaIn next = dn_load(p, 0, key, h, j);
    for (u32 row = 0; row < p.rows; ++row) {
        const DeltaIn in = next;
        if (row + 1 < p.rows) next = dn_load(p, row + 1, key, h, j);

        // q̂ and k̂ into shared memory (the twin's (x · inv) · scale; k's scale is 1).
        float ssq = in.q * in.q, ssk = in.k * in.k;
        dn_block_sum2(ssq, ssk, red);
        const float iq = 1.0f / sqrtf(ssq + TP_DELTA_L2_EPS);
        const float ik = 1.0f / sqrtf(ssk + TP_DELTA_L2_EPS);
        if (threadIdx.x < dk) {
            qh[threadIdx.x] = in.q * iq * p.scale;
            kh[threadIdx.x] = in.k * ik;
        }
        // The gates, the twin's expressions (every thread computes the same values).
        const float beta = 1.0f / (1.0f + expf(-in.b));
        const float decay = expf(neg_a * dn_softplus(in.a + dt_bias));
        __syncthreads();  // qh, kh written

        // S ← e^g S, and this thread's part of (Sᵀk̂)_j.
        float kv = 0.0f;
#pragma unroll
        for (u32 r = 0; r < RPT; ++r) {
            const u32 i = g + TP_DELTA_GROUPS * r;
            if (i < dk) {
                s[r] *= decay;
                kv = fmaf(s[r], kh[i], kv);
            }
        }
        pk[g][c] = kv;
        __syncthreads();  // pk written
        float mem = 0.0f;
#pragma unroll
        for (u32 q = 0; q < TP_DELTA_GROUPS; ++q) mem += pk[q][c];
        const float delta = (in.v - mem) * beta;

        // S += k̂ δᵀ, and this thread's part of (Sᵀq̂)_j.
        float o = 0.0f;
#pragma unroll
        for (u32 r = 0; r < RPT; ++r) {
            const u32 i = g + TP_DELTA_GROUPS * r;
            if (i < dk) {
                s[r] = fmaf(kh[i], delta, s[r]);
                o = fmaf(s[r], qh[i], o);
            }
        }
        po[g][c] = o;
        __syncthreads();  // po written
        if (g == 0 && col) {
            float sum = 0.0f;
#pragma unroll
            for (u32 q = 0; q < TP_DELTA_GROUPS; ++q) sum += po[q][c];
            ((float*)p.out)[((u64)row * p.v_heads + h) * dv + j] = sum;
        }
        // No barrier needed before the next row: it writes red (read above, before the qh
        // barrier), qh/kh (read above, before the po barrier) and pk/po only after barriers
        // that every thread reaches after its reads of this row.
    }

#pragma unroll
    for (u32 r = 0; r < RPT; ++r) {
        const u32 i = g + TP_DELTA_GROUPS * r;
        if (col && i < dk) S[(u64)i * dv] = s[r];
    }
}

// The two instantiations, by the rows a thread holds: dk ≤ 128 (Qwen3.5, Qwen3-Next) keeps 8
// state values per thread and fits 64 registers with no spills (ptxas, sm_90, NVRTC 13), so
// 4 blocks per SM: 528 on an H200, enough for every block of 48 value heads at once (384);
// dk ≤ 256 keeps 16 (88 registers, 2 blocks per SM).
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_DELTA_THREADS, 4) gated_delta_dk128(DeltaParams p) { gated_delta<128 / TP_DELTA_GROUPS>(p); }
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_DELTA_THREADS, 2) gated_delta_dk256(DeltaParams p) { gated_delta<TP_DELTA_DKMAX / TP_DELTA_GROUPS>(p); }

// ---- GatedRmsNorm -----------------------------------------------------------------------

// Arguments of gated_rms_norm. 48 bytes.
struct GnormParams {
    u64 x;    // [rows, dim] f32
    u64 z;    // [rows, dim] f32
    u64 w;    // [dim] f32
    u64 out;  // [rows, dim] f32; may be x (the same elements), not a partial overlap
    u32 rows;
    u32 dim;
    float eps;
    u32 pad;
};

// Sum of v over the block, to every thread (blockDim.x a multiple of TP_WAVE, ≤ 1024): as
// decode.cu's tp_block_sum, waves in butterfly order then the wave sums in wave order. Every
// thread must call it; two barriers.
TP_DEV float dn_block_sum(float v) {
    __shared__ float part[1024 / TP_WAVE];
    v = tp_wave_sum(v);
    if (threadIdx.x % TP_WAVE == 0) part[threadIdx.x / TP_WAVE] = v;
    __syncthreads();
    float t = 0.0f;
    for (u32 i = 0; i < blockDim.x / TP_WAVE; ++i) t += part[i];
    __syncthreads();  // the next call may overwrite `part`
    return t;
}

// Per row (a head of a token): out = (x · 1/√(mean(x²) + eps)) · w · silu(z), the twin's
// order of the products; the sum of squares is a block tree sum.
// Grid: one block per row (x, stride loop over rows); block: a multiple of 64 threads
// ≤ TP_GNORM_THREADS (the launcher: one element per thread for heads up to 256), thread t
// taking elements t, t + T, ...; each reads its x twice (the second an L1 hit) and its z and w
// once. Every element is read and written by one thread, so out may be x.
// Bytes per row: 3 · dim · 4 read (+ w, an L2 hit after the first rows), dim · 4 written; at
// decode a few dozen blocks: launch-bound. A thread's first weight (its only one at head dims
// up to the block size) is a weight, written by no kernel of the step: it is loaded before
// tp_pdl_wait(), so that the second pass waits on z, an L2 hit, and not on an HBM miss (the
// layer's weights were last read a token ago).
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_GNORM_THREADS, 1) gated_rms_norm(GnormParams p) {
    const u32 dim = p.dim, T = blockDim.x;
    const float* w = (const float*)p.w;
    const float w0 = threadIdx.x < dim ? w[threadIdx.x] : 0.0f;
    tp_pdl_wait();
    for (u64 r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const float* x = (const float*)p.x + r * dim;
        const float* z = (const float*)p.z + r * dim;
        float* out = (float*)p.out + r * dim;
        float ss = 0.0f;
        for (u32 e = threadIdx.x; e < dim; e += T) ss += x[e] * x[e];
        const float inv = 1.0f / sqrtf(dn_block_sum(ss) / (float)dim + p.eps);
        for (u32 e = threadIdx.x; e < dim; e += T)
            out[e] = x[e] * inv * (e == threadIdx.x ? w0 : w[e]) * dn_silu(z[e]);
    }
}

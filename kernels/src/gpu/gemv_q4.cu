// gemv_q4.cu: MatmulInt4, y[m, n] = f(x)[m, k] · wᵀ over GPTQ int4 weights (kernels/src/ops.rs
// `MatmulInt4`; layout kernels/src/int4.rs; CPU twin kernels/src/cpu/ops/int4.rs). x, y f32;
// f32 accumulation; f the identity or silu(gate) · up (Prologue::SiluMul, x [m, 2k]), as in
// gemv.cu; or the SiluMul epilogue (the `_e` kernels: w's rows are gate rows then up rows, y
// [m, n/2] gets silu(gate) · up: a wave or batch takes half its rows from each half, so the
// lane or thread that writes a row holds both sums). Decode uses the epilogue on gate|up and
// a plain down_proj: the prologue made every block of down_proj read 2k inputs and take an exp
// per input (H200 lab, 2026-12-06: down 26.0 µs with the prologue, 23.4 plain; gate|up 34.8
// µs with or without the epilogue).
//
// Owns: the int4 matrix–vector product of decode (m = 1) and a token-tiled product for
// prefill. Must not: write anything but y (one launch, no scratch).
//
// Layout, and why N-major. The weights arrive as GPTQ's qweight [K/8, N] (8 nibbles along K
// per u32). Kept that way, a 16-byte load would give 4 columns × 8 inputs, and a wave would
// cover 128 columns × 8 inputs: every output would then be summed across the waves (and
// blocks) that split K, through shared memory and, for N = 5120 (40 such column tiles, fewer
// than the 132 SMs), a split-K across blocks with atomics or a second pass. Transposed to
// N-major at load ([n, kq/8] u32, kernels/src/int4.rs), each output row is K/2 contiguous
// bytes that one wave streams exactly as gemv.cu streams a bf16 row: lane l loads 16 bytes
// (32 consecutive inputs, one group since groups are multiples of 32 on this path) at
// l, l + TP_WAVE, ..., a wave-wide load is 512 contiguous bytes, the sum over K is a
// butterfly inside the wave, and there is work for every SM whatever n (5120 rows / R = 8 is
// 640 waves; 34816 / 4 is 8704). The price is that every wave reads all of x (32 f32 per 16
// bytes of weights, 8× the weight bytes per row), through L1: each activation is reused for R
// rows, which caps its share (below).
//
// Dequantising for the cost of one AND per weight. The sum over one group is
// s · (Σ a_i q_i − z · Σ a_i): the zero is folded into a per-(chunk, token) Σ a shared by the
// R rows, so each weight needs only q as a float. On CUDA a nibble masked in place, bits
// q · 2^(4j) below 2^24, read as an f32 is q · 2^(4j) · 2^-149 exactly (a subnormal, or
// exponent field 1, which continues the same scale), so `fmaf(a', tp_f32_from_bits(w & mask),
// acc_j)` is one AND and one FMA. The activations are pre-scaled by 2^64 (a' = a · 2^64, one
// multiply per activation per wave, shared by R rows) so that the products a·q·2^(4j−85) are
// normal for |a| between 2^−40 and 2^60; the fma rounds once, as a plain f32 FMA would. Four
// accumulators, one per shift j (nibbles j and j + 4 of a word, the latter after one shift by
// 16 per word), are brought back by exact powers of two. Subnormal FMA operands run at full
// speed on NVIDIA GPUs (the kernels compile with --ftz=false). On HIP, whose f32 denormal
// mode varies by target and flags, a nibble is OR-ed into the mantissa of 2^23 and 2^23 is
// subtracted (exact; one FADD more per weight) and nothing is pre-scaled.
//
// Instruction budget (H200: 132 SMs · 4 issue/clock · 1.98 GHz; at 4.2 TB/s an SM must
// consume 32 weights, one warp-instruction's worth, per clock, so 100 % of bandwidth allows
// 4 warp-instructions per weight): AND + FMA + 1/8 shift per weight, plus per 32 · R
// weights: 8 x loads, 32 pre-scales and 31 adds for Σ a per token (R = 4: ~0.6 per weight),
// and per row and 32 weights a scale, a zero and the combine (~0.3): ~3 per weight, ~75 % of
// issue at full bandwidth. With the prologue each activation also costs ~7 (exp, reciprocal,
// two multiplies), hence R = 8 there (~3.3 per weight).
//
// Grid (kernels/src/cuda/ops_gemv_q4.rs): one wave per R rows, 4 waves per block (fewer while
// that leaves under 2 blocks per SM), grid.y the token tiles of MT when m > 1. U chunks per
// row, U · R = TP_Q4_LOADS (TP_Q4_LOADS_SILU) 16-byte loads, are in flight per lane before any
// is used; the first U of a lane are issued before tp_pdl_wait() (weights, scales and zeros
// are written by no kernel of the step), x only after it.
//
// Registers (ptxas -v, sm_90, NVRTC 13): gemv_q4 fits 128 (two 256-thread blocks per SM, 16
// waves: gate|up has 66 waves per SM to run) with U · R = 8 loads in flight, no spills (16
// loads needed 238); gemv_q4_silu takes 255 without spills, which is fine because down_proj
// has only ~5 waves per SM (640 in all) and 8 fit; the prefill kernels take 255 (gemm_q4
// spills 4 bytes).
//
// Other paths: a scalar path (one u32 word = 8 inputs per lane step, plain loads, any
// group multiple of 8, any alignment) when kq or the group is not a multiple of 32 or a view
// is not 16-byte aligned; desc_act (`perm` given) gathers each activation through perm
// (perm loaded 16 bytes at a time), which costs one dependent load per activation: correct,
// not tuned. Prefill (m > 1): R = 2 rows and MT = 8 tokens per wave, weights loaded once per
// tile and dequantised per token; correctness first, as in gemv.cu.
//
// Expected: the bytes read are qweight (n · kq / 2) + scales (2 · n · groups) + zeros; for the
// 27B shapes at group 128, [34816, 5120] is 89.1 + 2.9 MB and [5120, 17408] with the prologue
// 44.6 + 1.5 MB. Target ≥ 75 % of the 4.2 TB/s copy ceiling (`tprun bench gemv --quant
// int4`). Measured (H200, 2026-12-03): these row-group kernels 1.50 and 0.96 TB/s, ~4.7
// issued instructions per weight (the budget above missed the per-chunk address and x work);
// decode now takes the by-chunk kernels below where they apply (2.81 and 1.78 TB/s), and
// these serve prefill, the word path and kq > 20480. Arithmetic and indexing were checked on
// a CPU by scripts/emulate_gemv_q4.sh (both nibble readings), and on a GPU `tprun selftest`
// compares every path with the CPU twin.

#include "portable.h"
#include "elem.h"

// The Rust side mirrors these (kernels/src/cuda/ops_gemv_q4.rs; a test compares them).
#define TP_Q4_ROWS 4         // R without prologue (decode): output rows per wave
#define TP_Q4_ROWS_SILU 8    // R with the SiluMul prologue (amortises exp and reciprocal)
#define TP_Q4_ROWS_TILE 2    // R of the prefill kernels
#define TP_Q4_TOKENS 8       // MT: tokens per tile when m > 1
#define TP_Q4_LOADS 8        // U · R: weight loads in flight per lane (gemv_q4)
#define TP_Q4_LOADS_SILU 16  // the same for gemv_q4_silu

// kernels/src/cuda/ops_gemv_q4.rs `GemvQ4Params`, passed by value.
struct GemvQ4Params {
    u64 x;        // f32 [m, k], or [m, 2k] with the prologue
    u64 qweight;  // u32 [n, kq / 8]
    u64 scales;   // f16 [n, groups]
    u64 zeros;    // u32 [n, ceil(groups / 8)], 4 bits per group
    u64 perm;     // u32 [kq], or 0: stored input j is input j
    u64 y;        // f32 [m, n]
    u32 m, k, n, kq;
    u32 group, groups;
    u32 vec;      // 1: the 16-byte path (see Other paths)
    u32 pad;
};

// The subnormal reading on CUDA (and in scripts/emulate_gemv_q4.sh's host build, which
// checks it on a CPU); the 2^23 one elsewhere.
#if defined(TP_CUDA) && !defined(TP_Q4_SUBNORMAL)
#define TP_Q4_SUBNORMAL 1
#endif
#if defined(TP_Q4_SUBNORMAL)
#define TP_Q4_XSCALE 0x1p64f  // a' = a · 2^64
#define TP_Q4_DSCALE 0x1p85f  // Σ a q = acc_0 · 2^85 (acc_j · 2^(85 − 4j))
// q · 2^(4j) · 2^-149, exactly: `bits` (a nibble masked in place, below 2^16) as an f32.
TP_DEV float q4_nib(u32 bits) { return tp_f32_from_bits(bits); }
#else
#define TP_Q4_XSCALE 1.0f
#define TP_Q4_DSCALE 1.0f
// q · 2^(4j), exactly: 2^23 + bits − 2^23.
TP_DEV float q4_nib(u32 bits) { return tp_f32_from_bits(bits | 0x4b000000u) - 8388608.0f; }
#endif

TP_DEV u32 q4_min(u32 a, u32 b) { return a < b ? a : b; }

// WPL words (8 · WPL inputs) of one row: one 16-byte load that bypasses L1 (read once; L1 is
// left to x, as in gemv.cu), or one plain word.
template <int WPL>
struct Q4Words {
    u32 w[WPL];
};

template <int WPL>
TP_DEV Q4Words<WPL> q4_ld(const u32* p) {
    Q4Words<WPL> v;
#if defined(TP_CUDA)
    if constexpr (WPL == 4) {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
            : "l"(p));
        return v;
    }
#endif
    if constexpr (WPL == 4) {
        const V16 t = *(const V16*)p;
#pragma unroll
        for (int i = 0; i < WPL; ++i) v.w[i] = t.w[i];
    } else {
#pragma unroll
        for (int i = 0; i < WPL; ++i) v.w[i] = p[i];
    }
    return v;
}

// The scale (f16 bits) as f32: the hardware conversion on CUDA (a NaN scale gives NaN
// whatever its payload), portable.h's elsewhere.
TP_DEV float q4_scale(u16 h) {
#if defined(TP_CUDA)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return tp_f16_to_f32(h);
#endif
}

// silu(g) · u as gemv.cu computes it (its comment gives the error of the fast intrinsics).
TP_DEV float q4_silu_mul(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

// The E = 8 · WPL activations of stored inputs j0 .. j0 + E of one token, pre-scaled for
// q4_nib unless PRESCALE is false, and their (unscaled) sum. `row`: the token's row of x.
template <int WPL, bool SILU, bool PRESCALE = true>
TP_DEV float q4_act(const float* row, u32 k, const u32* perm, u32 j0, float (&a)[8 * WPL]) {
    constexpr int E = 8 * WPL;
    if (perm) {
        // Four indices at a time (16-byte loads on the vector path), each gathered at once,
        // so that only four are live.
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
            u32 idx[4];
            if (WPL == 4) {
                const V16 v = *(const V16*)(perm + j0 + 4 * q);
#pragma unroll
                for (int i = 0; i < 4; ++i) idx[i] = v.w[i];
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) idx[i] = perm[j0 + 4 * q + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
                a[4 * q + i] = SILU ? q4_silu_mul(row[idx[i]], row[k + idx[i]]) : row[idx[i]];
        }
    } else if (WPL == 4) {
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
            const V16 g = *(const V16*)(row + j0 + 4 * q);
            if (SILU) {
                const V16 u = *(const V16*)(row + k + j0 + 4 * q);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    a[4 * q + i] = q4_silu_mul(tp_f32_from_bits(g.w[i]), tp_f32_from_bits(u.w[i]));
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[4 * q + i] = tp_f32_from_bits(g.w[i]);
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) a[e] = SILU ? q4_silu_mul(row[j0 + e], row[k + j0 + e]) : row[j0 + e];
    }
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        s += a[e];
        if (PRESCALE) a[e] *= TP_Q4_XSCALE;
    }
    return s;
}

// Σ_i a_i · q_i over one row's WPL words (input 8·i + j of the chunk is nibble j of word i).
template <int WPL>
TP_DEV float q4_dot(const Q4Words<WPL>& wv, const float (&a)[8 * WPL]) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < WPL; ++i) {
        const u32 lo = wv.w[i], hi = wv.w[i] >> 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[j] = fmaf(a[8 * i + j], q4_nib(lo & (0xfu << (4 * j))), acc[j]);
            acc[j] = fmaf(a[8 * i + 4 + j], q4_nib(hi & (0xfu << (4 * j))), acc[j]);
        }
    }
    // Exact powers of two bring each shift's accumulator to the scale of q.
    float d = acc[3] * (TP_Q4_DSCALE * 0x1p-12f);
    d = fmaf(acc[2], TP_Q4_DSCALE * 0x1p-8f, d);
    d = fmaf(acc[1], TP_Q4_DSCALE * 0x1p-4f, d);
    return fmaf(acc[0], TP_Q4_DSCALE, d);
}

// One row's scale and zero for group g.
struct Q4Group {
    u16 s;
    u32 zw;  // the zeros word holding this group's nibble
};

// One row's scales [groups] and zeros words [ceil(groups / 8)].
struct Q4Row {
    const u32* w;
    const u16* s;
    const u32* z;
};

TP_DEV Q4Group q4_ld_group(const Q4Row& row, u32 g) {
    Q4Group r;
    r.s = row.s[g];
    r.zw = row.z[g / 8];
    return r;
}

// Row r of batch b (r < RB). Plain: rows b·RB .. b·RB + RB − 1. With the SiluMul epilogue
// (EPI) the rows are the gate rows then the up rows of the product's n, and a batch takes RB/2
// gate rows and the RB/2 up rows that pair with them: b·RB/2 + r and n/2 + b·RB/2 + r. Rows
// past their half repeat its last (computed, not written).
template <int RB, bool EPI>
TP_DEV u32 q4k_row(u32 b, int r, u32 n) {
    if (!EPI) return q4_min(b * RB + r, n - 1);
    constexpr int H = RB / 2;
    const u32 half = n / 2, i = q4_min(b * H + (r % H), half - 1);
    return r < H ? i : half + i;
}

// acc[r][t] += s · (Σ a q − z · Σ a) for chunk j0 (in group g) of every row and token.
template <int WPL, int R, int MT, bool SILU>
TP_DEV void q4_chunk(const GemvQ4Params& p, const Q4Words<WPL> (&wv)[R], const Q4Group (&gr)[R],
                     const float* const (&xr)[MT], u32 j0, u32 g, float (&acc)[R][MT]) {
    float s[R], z[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        s[r] = q4_scale(gr[r].s);
        z[r] = (float)((gr[r].zw >> (4 * (g % 8))) & 0xfu);
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        float a[8 * WPL];
        const float sx = q4_act<WPL, SILU>(xr[t], p.k, (const u32*)p.perm, j0, a);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float d = q4_dot<WPL>(wv[r], a);
            acc[r][t] = fmaf(s[r], fmaf(-z[r], sx, d), acc[r][t]);
        }
    }
}

// tp_pdl_wait() once per thread: `waited` says whether this thread has passed it.
TP_DEV void q4_wait_once(bool& waited) {
    if (!waited) {
        tp_pdl_wait();
        waited = true;
    }
}

// This lane's chunks (8 · WPL stored inputs each) lane, lane + TP_WAVE, ... of every row of
// the group, U at a time while all U exist, then one at a time.
template <int WPL, int R, int MT, int U, bool SILU>
TP_DEV void q4_rows(const GemvQ4Params& p, const Q4Row (&rows)[R], const float* const (&xr)[MT],
                    u32 lane, float (&acc)[R][MT], bool& waited) {
    constexpr u32 E = 8 * WPL;
    const u32 chunks = p.kq / E;
    u32 c = lane;
    for (; c + (U - 1) * TP_WAVE < chunks; c += U * TP_WAVE) {
        Q4Words<WPL> wv[U][R];
        Q4Group gr[U][R];
        u32 g[U];  // one division per chunk, shared by the R rows
#pragma unroll
        for (int u = 0; u < U; ++u) {
            g[u] = (c + u * TP_WAVE) * E / p.group;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                wv[u][r] = q4_ld<WPL>(rows[r].w + (c + u * TP_WAVE) * WPL);
                gr[u][r] = q4_ld_group(rows[r], g[u]);
            }
        }
        q4_wait_once(waited);
#pragma unroll
        for (int u = 0; u < U; ++u)
            q4_chunk<WPL, R, MT, SILU>(p, wv[u], gr[u], xr, (c + u * TP_WAVE) * E, g[u], acc);
    }
    q4_wait_once(waited);
    for (; c < chunks; c += TP_WAVE) {
        Q4Words<WPL> wv[R];
        Q4Group gr[R];
        const u32 g = c * E / p.group;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            wv[r] = q4_ld<WPL>(rows[r].w + c * WPL);
            gr[r] = q4_ld_group(rows[r], g);
        }
        q4_chunk<WPL, R, MT, SILU>(p, wv, gr, xr, c * E, g, acc);
    }
}

// EPI: the SiluMul epilogue. A wave's R rows are R/2 gate rows and the R/2 up rows that pair
// with them (as in the `_k` kernels' q4k_row), y: [m, n/2] gets silu(gate) · up.
template <int R, int MT, int U, bool SILU, bool EPI>
TP_DEV void gemv_q4_body(const GemvQ4Params& p) {
    static_assert(R * MT <= TP_WAVE, "one writing lane per (row, token)");
    static_assert(!(SILU && EPI) && (!EPI || R % 2 == 0), "one of prologue and epilogue; pairs");
    constexpr u32 YR = EPI ? R / 2 : R;  // y rows per wave
    const u32 lane = threadIdx.x % TP_WAVE;
    const u32 waves = blockDim.x / TP_WAVE;
    const u32 yn = EPI ? p.n / 2 : p.n;
    const u32 rgroups = (yn + YR - 1) / YR;
    const u32 tiles = (p.m + MT - 1) / MT;
    const u64 xk = SILU ? 2ull * p.k : (u64)p.k;
    const float* x = (const float*)p.x;
    const u32* w = (const u32*)p.qweight;
    const u64 zw = (p.groups + 7) / 8;
    float* y = (float*)p.y;
    // A thread with no rows to compute exits without waiting: it reads and writes nothing.
    bool waited = false;
    for (u32 tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
        const u32 t0 = tile * MT;
        // Tokens past m repeat the last one: computed, never written.
        const float* xr[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) xr[t] = x + (u64)q4_min(t0 + t, p.m - 1) * xk;
        // rg is the same in every lane of a wave, so whole waves take the loops and shuffles.
        for (u32 rg = blockIdx.x * waves + threadIdx.x / TP_WAVE; rg < rgroups;
             rg += gridDim.x * waves) {
            // Rows past n repeat the last one, likewise.
            Q4Row rows[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u64 row = q4k_row<R, EPI>(rg, r, p.n);
                rows[r].w = w + row * (p.kq / 8);
                rows[r].s = (const u16*)p.scales + row * p.groups;
                rows[r].z = (const u32*)p.zeros + row * zw;
            }
            float acc[R][MT];
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;
            }
            if (p.vec) {
                q4_rows<4, R, MT, U, SILU>(p, rows, xr, lane, acc, waited);
            } else {
                q4_rows<1, R, MT, 1, SILU>(p, rows, xr, lane, acc, waited);
            }
            // Σ a was unscaled per chunk; the dot's scale is undone there too. Every lane
            // ends with every sum.
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int t = 0; t < MT; ++t) acc[r][t] = tp_wave_sum(acc[r][t]);
            }
#pragma unroll
            for (int r = 0; r < (int)YR; ++r) {
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    const u32 row = rg * YR + r, tok = t0 + t;
                    if (lane == (u32)(r * MT + t) && row < yn && tok < p.m)
                        y[(u64)tok * yn + row] = EPI ? q4_silu_mul(acc[r][t], acc[r + YR][t]) : acc[r][t];
                }
            }
        }
    }
}

// ---- decode by input chunks (the `_k` kernels) ------------------------------------------------
// The m = 1 path the launcher prefers when kq / 32 ≤ 640 and the 16-byte path applies. The kernels
// above read all of x once per R rows in every wave (prescale, Σ a and, with the prologue, an exp
// per activation: ~4.7 issued instructions per weight in ptxas's SASS) and were issue-bound at 1.5
// TB/s (gate|up) and 0.96 TB/s (down + silu) on an H200. Here a block of ceil(kq / 32) threads
// covers every stored input once: thread c holds chunk c's 32 activations (f(x), through perm when
// given) in registers for the whole kernel, as exact signed-byte limbs for dp4a (Q4KDot), and its
// group, scale and zero offsets are fixed; only row pointers move. The block walks batches of RB
// rows (b, b + gridDim.x, ...: a persistent grid, sized by the launcher from the occupancy), per
// row one 16-byte weight load, one scale and one zero word per thread, each row's registers
// refilled with the batch D ahead as soon as its dot is taken (D register sets used in rotation,
// so nothing is copied). Each wave reduces its RB partial sums with a transposed butterfly (log2
// RB exchanges of half the values, then plain xor steps: lane group r ends with row r), the
// waves' sums meet in shared memory, and after one barrier per F batches lanes of wave 0 add them
// in wave order (deterministic) and write y. Until 2026-12-06 the dot was f32 (a mask and an FFMA
// per nibble, ~3.3 instructions per weight in all); the dp4a form issues ~1 per weight for the
// dot and measured 1.7 % (gate|up) and 1.9 % (down) faster in production on an H100 (34.8 → 34.2
// µs, 21.1 → 20.7 µs), as accurate as the f32 form on the 27B shapes (the lab's f64 check: 1.5e-7
// against 1.7e-7).
// H200, 27B MLP shapes at group 128, f32 form (scripts/device/q4lab.cu, 2026-12-03): gate|up
// [34816, 5120] 2.61 TB/s with RB = 4 (160 threads, 3 blocks per SM), down + silu [5120, 17408]
// 1.79 TB/s with RB = 2 (544 threads, 1 block per SM: the registers cap it), against 4.4 TB/s for a
// plain read. Integer tensor cores (weights as u8, x as four exact signed bytes per 128-input
// slice, m16n8k32) reach ~1.8 instructions per weight and were exact to 1e-7, but stalled on their
// dependent MMA chain at 2.2 TB/s: the lab file keeps them (lab_m, lab_m2) for the next round.
// Tried since (lab, H200, 2026-12-06; ncu: the 544-thread blocks stall on memory latency, long
// scoreboard 1.6–3.5 cycles per issued instruction, and issue ~0.47 per scheduler per cycle): K
// split over a cluster of 2 blocks with one cluster barrier at the end (down 21.8 µs against 23.4
// in the lab; in production on an H100, graph + PDL, 21.75 µs against 21.12: left in the lab), and
// the weights staged through shared memory by cp.async 4–6 batches deep (down 32–36 µs, gate|up 52
// µs: worse; the shared-memory round trip costs more than it hides), and bulk L2 prefetches
// (cp.async.bulk.prefetch.L2) of the batches 1–4 ahead of the register loads by one thread per
// block (down 26.3–26.6 µs, gate|up 38.9–40.2: worse too), and (2026-12-06 afternoon, H100) whole
// batches streamed by bulk copies (TMA) into 4–12 shared-memory stages (production 41.2 and 24.8
// µs against 34.3 and 20.7; lab TT). D and F (lab T2, H100, 2026-12-06; both
// kernels take the same time on an H100 and an H200, so they wait on latency in SM cycles, not on
// DRAM): down (544 threads, 1 block per SM) 27.0 µs at D 2, F 1 (as before), 24.2 at D 3, F 8, 25.1
// at D 2, F 8, 26.1 at D 4 (spills); in production 23.4 → 21.4 µs. gate|up (160 threads, 3 blocks
// per SM at 126 registers) gains from neither: D 3 costs a block per SM (40.8 µs against 37.9), F 8
// costs 1.2 µs (one wave's 32 serial sums per phase), L2 prefetches (`prefetch.global.L2`, 3–5
// batches ahead) nothing. Down again (H100, 2026-12-06 evening): RB 4 at D 2 (the same two rows
// of loads in flight per thread as RB 2 at D 3, in fewer, wider batches: half the barriers and
// wave-0 sums per row; 96 registers and 16 bytes of stack) 22.2 µs in the lab against 22.8, in
// production (`bench gemv --quant int4`, graph + PDL) 20.48 against 20.72 µs, decode level (94.2
// against 94.3 tok/s). Rows by waves over x's limbs staged in shared memory (lab TR) and the
// barrier-free sums (lab TB) lost on both shapes.
#define TP_Q4K_ROWS 4        // RB of gemv_q4_k* (blocks of at most 256 threads)
#define TP_Q4K_ROWS_BIG 4    // RB of gemv_q4_kb* (up to 640 threads)
#define TP_Q4K_SETS 2        // D of gemv_q4_k*: register sets of batch loads (D ahead)
#define TP_Q4K_SETS_BIG 2    // D of gemv_q4_kb*
#define TP_Q4K_FLUSH 1       // F of gemv_q4_k*: batches per barrier
#define TP_Q4K_FLUSH_BIG 8   // F of gemv_q4_kb*

template <int RB>
struct Q4KBatch {
    Q4Words<4> w[RB];
    u16 s[RB];
    u32 z[RB];
};

// log2 of a batch's rows (RB a power of two up to 16; the bodies assert it).
TP_DEV constexpr int q4k_log2(int rb) { return rb <= 1 ? 0 : 1 + q4k_log2(rb / 2); }

// Where the thread of 32-input chunk c reads in every row: its weight words, its group's scale
// and zero word (row 0 here, a row's stride apart), and the zero's shift within its word.
struct Q4KPlace {
    const u32* wp;
    const u16* sp;
    const u32* zp;
    u32 wstride, sstride, zstride, zshift;

    TP_DEV Q4KPlace(const GemvQ4Params& p, u32 c) {
        const u32 g = c * 32 / p.group;
        wp = (const u32*)p.qweight + c * 4;
        sp = (const u16*)p.scales + g;
        zp = (const u32*)p.zeros + g / 8;
        wstride = p.kq / 8;
        sstride = p.groups;
        zstride = (p.groups + 7) / 8;
        zshift = 4 * (g % 8);
    }

    // This thread's chunk of batch b's rows.
    template <int RB, bool EPI>
    TP_DEV void load(u32 b, u32 n, Q4KBatch<RB>& bt) const {
#pragma unroll
        for (int r = 0; r < RB; ++r) load_row<RB, EPI>(b, r, n, bt);
    }

    // Row r of batch b alone.
    template <int RB, bool EPI>
    TP_DEV void load_row(u32 b, int r, u32 n, Q4KBatch<RB>& bt) const {
        const u64 row = q4k_row<RB, EPI>(b, r, n);
        bt.w[r] = q4_ld<4>(wp + row * wstride);
        bt.s[r] = sp[row * sstride];
        bt.z[r] = zp[row * zstride];
    }
};

// Chunk c's 32 activations f(x) as integers in three signed-byte limbs, for dp4a. X_j =
// rint(a_j · 2^e) with e per thread, the power of two that brings the chunk's largest below
// 2^22 (|X| ≤ 2^22 after rounding): exact scaling, and a rounding of at most half a step,
// 2^-22 of the chunk's largest (f32's own is 2^-24 of each element: with an outlier in the
// chunk the products lose more, measured ~2–3× the f32 form's error on such chunks). X = 2^16
// h + 2^8 m + l with l, m in [−128, 127] and h in [−64, 64]. The limbs are packed four to a
// register in the order of a weight word's nibbles: word i's even nibbles (inputs 8i, 8i + 2,
// 8i + 4, 8i + 6) and its odd ones. A non-finite activation makes the thread's sums NaN (an
// infinite one too, where the CPU twin may give ±inf: both are non-finite).
struct Q4KActs {
    u32 e[3][4], o[3][4];  // [limb: h, m, l][word]
    u32 sum;               // Σ_j X_j (|Σ| ≤ 2^27)
    float unscale;         // 2^-e, or NaN
};

// A weight word's odd nibbles for dp4a: on CUDA read in place (w & 0xf0f0f0f0, bytes 16 q,
// unsigned: dp4a.u32.s32), so their sums are 16 times theirs; on HIP, whose dot4 reads both
// operands as signed, shifted down first (one more instruction per word). (Predefined by
// scripts/emulate_gemv_q4.sh, which checks both forms on a CPU.)
#if !defined(TP_Q4K_ODD_SHIFT) && defined(TP_CUDA)
#define TP_Q4K_ODD_SHIFT 4
#elif !defined(TP_Q4K_ODD_SHIFT)
#define TP_Q4K_ODD_SHIFT 0
#endif

// The `_k` body's dot, as a policy (Acts: what a thread keeps of x; acts() makes it once,
// dot() takes one row of a batch), so that scripts/device/q4lab.cu times other forms in the same
// loop.
struct Q4KDot {
    typedef Q4KActs Acts;

    template <bool SILU>
    static TP_DEV void acts(const GemvQ4Params& p, u32 c, bool active, Acts& t) {
        float a[32];
        (void)q4_act<4, SILU, false>((const float*)p.x, p.k, (const u32*)p.perm, c * 32, a);
        float mx = 0.0f;
        bool finite = true;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            if (!active) a[j] = 0.0f;
            finite = finite && fabsf(a[j]) <= 3.402823466e38f;
            mx = fmaxf(mx, fabsf(a[j]));
        }
        // mx < 2^(x − 126) for its biased exponent x, so a · 2^(148 − x) < 2^22. x ≤ 255 keeps
        // k ≥ −107; k is capped at 126 to keep the factor a normal float (a chunk below 2^-104
        // keeps 2^-126 steps: nothing in decode).
        const int x = (int)((tp_f32_bits(mx) >> 23) & 0xffu);
        const int k = 148 - x < 126 ? 148 - x : 126;
        const float f = tp_f32_from_bits((u32)(127 + k) << 23);
        t.unscale = finite ? tp_f32_from_bits((u32)(127 - k) << 23) : tp_f32_from_bits(0x7fc00000u);
        u32 sum = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int L = 0; L < 3; ++L) t.e[L][i] = t.o[L][i] = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int X = finite ? (int)rintf(a[8 * i + j] * f) : 0;
                const int l = (int)((u32)X << 24) >> 24, r = (X - l) >> 8;
                const int m = (int)((u32)r << 24) >> 24, h = (r - m) >> 8;
                sum += (u32)X;
                const u32 sh = 8 * (j / 2);
                u32(&dst)[3][4] = j % 2 == 0 ? t.e : t.o;
                dst[0][i] |= ((u32)h & 0xffu) << sh;
                dst[1][i] |= ((u32)m & 0xffu) << sh;
                dst[2][i] |= ((u32)l & 0xffu) << sh;
            }
        }
        t.sum = sum;
    }

    // This thread's partial sum of row r of a batch: s · Σ (q − z) · a over its chunk (one row at
    // a time: the body refills a row's registers as soon as its sum is taken). Per word two masks
    // and six dp4a (one per limb and nibble parity; on CUDA ~1 instruction per weight, against
    // 2.1 for a mask and an FFMA per nibble). The limbs' sums (each below 2^20 in magnitude) meet
    // as Σ (q − z) X in u32: intermediate wrap-around cancels, since the result's magnitude is at
    // most 32 · 15 · 2^22 < 2^31. One rounding to f32 after that; the scale is applied before
    // 2^-e, so that large activations meet a small scale before they could overflow.
    template <int RB>
    static TP_DEV float dot(const Q4KBatch<RB>& cur, int r, const Acts& t, u32 zshift) {
        constexpr int S = TP_Q4K_ODD_SHIFT;
        int ae[3] = {0, 0, 0}, ao[3] = {0, 0, 0};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 w = cur.w[r].w[i];
            const u32 we = w & 0x0f0f0f0fu, wo = S ? w & 0xf0f0f0f0u : (w >> 4) & 0x0f0f0f0fu;
#pragma unroll
            for (int L = 0; L < 3; ++L) {
                ae[L] = tp_dot4_u8s8(we, t.e[L][i], ae[L]);
                ao[L] = tp_dot4_u8s8(wo, t.o[L][i], ao[L]);
            }
        }
        const u32 z = (cur.z[r] >> zshift) & 0xfu;
        // Σ q X = Σ_limbs 2^(16, 8, 0) · (even + odd / 2^S); odd sums are multiples of 2^S.
        const u32 d = ((u32)ae[0] << 16) + ((u32)ae[1] << 8) + (u32)ae[2] +
                      ((u32)ao[0] << (16 - S)) + ((u32)ao[1] << (8 - S)) + (u32)(ao[2] >> S) -
                      z * t.sum;
        return (q4_scale(cur.s[r]) * (float)(int)d) * t.unscale;
    }
};

// The wave's sums of RB = 2^L rows by a transposed butterfly: L exchanges of half the values,
// then plain xor steps; lane group r (lanes r · (TP_WAVE >> L) ..) ends with row r's sum.
template <int RB, int L>
TP_DEV float q4k_wave_sums(float (&v)[RB], u32 lane) {
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int off = (TP_WAVE / 2) >> i, half = RB >> (i + 1);
        const bool up = (lane & off) != 0;
#pragma unroll
        for (int j = 0; j < half; ++j) {
            const float send = up ? v[j] : v[j + half];
            const float keep = up ? v[j + half] : v[j];
            v[j] = keep + tp_shfl_xor(send, off);
        }
    }
#pragma unroll
    for (int off = (TP_WAVE / 2) >> L; off > 0; off /= 2) v[0] += tp_shfl_xor(v[0], off);
    return v[0];
}

// blockDim.x is a whole number of waves (the launcher rounds kq / 32 up to one): `waves`
// below counts them, and every wave takes part in the shuffles and barriers.
//
// D register sets of batch loads, used in rotation (the loop is unrolled D times so that each
// stays in registers): while batch i is computed, the loads of batches i + 1 .. i + D − 1 are
// in flight, and once a row of batch i has its dot, the same row of batch i + D goes out into its
// registers, so through the sums and the barrier D batches are in flight (D − 1 before
// 2026-12-07; in gate|up's kernel ptxas had even placed the next batch's loads after the dots, so
// with D = 2 one batch was in flight at a time: latency-bound, the same µs on an H100 and an
// H200). F: the waves' sums of F batches gather in shared memory (a ring of 2F slots, so one
// barrier per F batches suffices: a half is rewritten only after the next barrier, which
// every reader of it has passed) and after each barrier thread j · RB + r adds row r of the
// phase's batch j over the waves, in wave order (deterministic). With the epilogue the up sum
// of a batch (row r + YB) reaches its gate row's thread by one shuffle (lane xor YB).
template <int RB, bool SILU, bool EPI, int D, int F, class Dot = Q4KDot>
TP_DEV void gemv_q4_k_body(const GemvQ4Params& p) {
    static_assert(!(SILU && EPI) && (!EPI || RB >= 2), "one of prologue and epilogue; pairs");
    constexpr int L = q4k_log2(RB);
    static_assert((1 << L) == RB && RB <= 16, "RB a power of two up to 16");
    static_assert(D >= 2 && F >= 1 && F * RB <= TP_WAVE, "sets; one wave does a phase's sums");
    __shared__ float red[2 * F][1024 / TP_WAVE][RB];  // [slot][wave][row]
    const u32 t = threadIdx.x, lane = t % TP_WAVE, wave = t / TP_WAVE, waves = blockDim.x / TP_WAVE;
    const bool active = t < p.kq / 32;
    const u32 c = active ? t : 0;  // an idle thread reads chunk 0 and weighs it by zero
    const Q4KPlace at(p, c);
    // With the epilogue, y's rows are n / 2 and a batch writes RB / 2 of them.
    constexpr u32 YB = EPI ? RB / 2 : RB;
    const u32 yn = EPI ? p.n / 2 : p.n;
    const u32 batches = (yn + YB - 1) / YB, G = gridDim.x;
    u32 b = blockIdx.x;
    if (b >= batches) return;  // the whole block: it reads and writes nothing
    Q4KBatch<RB> set[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
        if (b + d * G < batches)
            at.load<RB, EPI>(b + d * G, p.n, set[d]);
    }
    tp_pdl_wait();
    typename Dot::Acts acts;
    Dot::template acts<SILU>(p, c, active, acts);
    u32 i = 0;  // batches this block has computed
    bool done = false;
    while (!done) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (!done) {
                // Each row's registers take the same row of the batch D ahead as soon as its sum
                // is taken, so those loads are in flight through the sums and the barrier.
                const u32 ahead = b + D * G;
                float v[RB];
#pragma unroll
                for (int r = 0; r < RB; ++r) {
                    v[r] = Dot::template dot<RB>(set[d], r, acts, at.zshift);
                    if (ahead < batches) at.load_row<RB, EPI>(ahead, r, p.n, set[d]);
                }
                const float sum = q4k_wave_sums<RB, L>(v, lane);
                if (lane % (TP_WAVE >> L) == 0) red[i % (2 * F)][wave][lane / (TP_WAVE >> L)] = sum;
                ++i;
                b += G;
                done = b >= batches;  // the same in every thread: the barrier below is uniform
                if (done || i % F == 0) {
                    __syncthreads();
                    if (wave == 0) {
                        const u32 i0 = (i - 1) / F * F, j = lane / RB, r = lane % RB;
                        float s = 0.0f;
                        if (i0 + j < i) {
                            for (u32 w = 0; w < waves; ++w) s += red[(i0 + j) % (2 * F)][w][r];
                        }
                        if (EPI) s = q4_silu_mul(s, tp_shfl_xor(s, YB));
                        const u32 row = (blockIdx.x + (i0 + j) * G) * YB + r;
                        if (i0 + j < i && r < YB && row < yn) ((float*)p.y)[row] = s;
                    }
                }
            }
        }
    }
}

// MINB 2 on the `_k` kernels caps them at 128 registers (3 blocks of 160 threads per SM for the
// 27B's gate|up); unbounded, ptxas takes ~160 for the refills in flight and costs a block per SM.
#define TP_GEMV_Q4K_KERNEL(name, RB, SILU, EPI, MAXT, MINB, D, F)                             \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(MAXT, MINB) name(const GemvQ4Params p) { \
        gemv_q4_k_body<RB, SILU, EPI, D, F>(p);                                        \
    }

// Kernel names, in the order of kernels/src/cuda/ops_gemv_q4.rs NAMES.
// MINB: blocks of 256 threads per SM the registers must allow (see Registers).
#define TP_GEMV_Q4_KERNEL(name, R, MT, U, SILU, EPI, MINB)                          \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(256, MINB) name(const GemvQ4Params p) { \
        gemv_q4_body<R, MT, U, SILU, EPI>(p); /* waits for the kernel before once its loads are out */ \
    }

TP_GEMV_Q4_KERNEL(gemv_q4, TP_Q4_ROWS, 1, TP_Q4_LOADS / TP_Q4_ROWS, false, false, 2)
TP_GEMV_Q4_KERNEL(gemv_q4_silu, TP_Q4_ROWS_SILU, 1, TP_Q4_LOADS_SILU / TP_Q4_ROWS_SILU, true, false, 1)
TP_GEMV_Q4_KERNEL(gemm_q4, TP_Q4_ROWS_TILE, TP_Q4_TOKENS, 1, false, false, 1)
TP_GEMV_Q4_KERNEL(gemm_q4_silu, TP_Q4_ROWS_TILE, TP_Q4_TOKENS, 1, true, false, 1)
TP_GEMV_Q4K_KERNEL(gemv_q4_k, TP_Q4K_ROWS, false, false, 256, 2, TP_Q4K_SETS, TP_Q4K_FLUSH)
TP_GEMV_Q4K_KERNEL(gemv_q4_k_silu, TP_Q4K_ROWS, true, false, 256, 2, TP_Q4K_SETS, TP_Q4K_FLUSH)
TP_GEMV_Q4K_KERNEL(gemv_q4_kb, TP_Q4K_ROWS_BIG, false, false, 640, 1, TP_Q4K_SETS_BIG, TP_Q4K_FLUSH_BIG)
TP_GEMV_Q4K_KERNEL(gemv_q4_kb_silu, TP_Q4K_ROWS_BIG, true, false, 640, 1, TP_Q4K_SETS_BIG, TP_Q4K_FLUSH_BIG)
// The SiluMul epilogue (gate|up writing silu(gate) · up), one per path.
TP_GEMV_Q4_KERNEL(gemv_q4_e, TP_Q4_ROWS, 1, TP_Q4_LOADS / TP_Q4_ROWS, false, true, 2)
TP_GEMV_Q4_KERNEL(gemm_q4_e, TP_Q4_ROWS_TILE, TP_Q4_TOKENS, 1, false, true, 1)
TP_GEMV_Q4K_KERNEL(gemv_q4_k_e, TP_Q4K_ROWS, false, true, 256, 2, TP_Q4K_SETS, TP_Q4K_FLUSH)
TP_GEMV_Q4K_KERNEL(gemv_q4_kb_e, TP_Q4K_ROWS_BIG, false, true, 640, 1, TP_Q4K_SETS_BIG, TP_Q4K_FLUSH_BIG)

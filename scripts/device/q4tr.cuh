// Candidate TR of the int4 decode GEMV, for scripts/device/q4lab.cu (timed on the GPU) and
// scripts/emu/emulate_q4tr.cpp (checked on a CPU); include after gemv_q4.cu.
//
// Why: the `_k` kernels (a thread per 32-input chunk, the block walking batches of rows) keep
// each thread's activations in registers as dp4a limbs (24 registers), which leaves room for
// one or two batches of weight loads in flight (~30 KB per SM against ~60 KB for the bf16
// GEMV), and every batch ends in a block barrier on which all waves wait for wave 0's serial
// sums (ncu, H100: barrier stalls 1–2 cycles per instruction). TR goes back to rows by waves,
// as gemv.cu streams bf16 rows, but with x prepared once per block: the block first writes
// Q4KDot's limbs of every chunk of x to shared memory (one chunk per thread at a time), then
// each wave owns R rows ("a row group") and streams them chunk by chunk, lane l taking chunks
// l, l + 32, ...: per chunk six 16-byte shared loads of limbs serve R rows, the dot is
// Q4KDot's (dp4a), each lane accumulates its chunks' f32 partials per row, and a wave
// butterfly ends the row group. No block barrier after the staging, no activation registers
// held across rows, and the loads of the next D − 1 (row group, chunk) units are in flight
// while one is computed. A wave takes row groups gw, gw + GW, ... (GW waves in the grid), so
// the same body runs persistent (few blocks) or one row group per wave.
//
// Shared memory for C = kq / 32 chunks: limbs [6][C] of 16 bytes (h, m, l of the even
// nibbles' inputs, then of the odd ones; chunk-major per part so that a wave's 16-byte loads
// are contiguous), then Σ X [C] u32 and 2^-e [C] f32: 104 · C bytes.
#pragma once

#define Q4TR_SMEM_BYTES(kq) ((kq) / 32 * (6 * 16 + 8))  // host and device

template <int R, bool EPI, int D>
TP_DEV void gemv_q4_tr_body(const GemvQ4Params& p, V16* sm) {
    constexpr int L = q4k_log2(R);
    static_assert((1 << L) == R && R <= 16 && D >= 2 && (!EPI || R >= 2), "R a power of two; pairs");
    const u32 C = p.kq / 32, S = (C + TP_WAVE - 1) / TP_WAVE;
    V16* lim = sm;
    u32* csum = (u32*)(sm + 6 * C);
    float* cun = (float*)(csum + C);
    const u32 t = threadIdx.x, lane = t % TP_WAVE, NW = blockDim.x / TP_WAVE;
    const u32 gw = blockIdx.x * NW + t / TP_WAVE, GW = gridDim.x * NW;
    constexpr u32 YB = EPI ? R / 2 : R;  // y rows per row group
    const u32 yn = EPI ? p.n / 2 : p.n, nb = (yn + YB - 1) / YB;
    const u32 nj = gw < nb ? (nb - gw + GW - 1) / GW : 0;  // this wave's row groups
    const u32 wstride = p.kq / 8, zstride = (p.groups + 7) / 8;
    // The group of chunk c: a shift for a power-of-two group (the usual), else a division.
    u32 gsh = 0;
    while ((1u << gsh) < p.group) ++gsh;
    const bool gpow = (1u << gsh) == p.group;
    auto group_of = [&](u32 c) { return gpow ? (c * 32) >> gsh : c * 32 / p.group; };
    // Unit (j, s): row group gw + j · GW, chunk s · TP_WAVE + lane (chunk 0, weighed by nothing,
    // past the last).
    auto load = [&](u32 j, u32 s, Q4KBatch<R>& bt) {
        u32 c = s * TP_WAVE + lane;
        if (c >= C) c = 0;
        const u32 g = group_of(c), b = gw + j * GW;
        const u32* wp = (const u32*)p.qweight + c * 4;
        const u16* sp = (const u16*)p.scales + g;
        const u32* zp = (const u32*)p.zeros + g / 8;
        // 32-bit offsets (the lab's matrices have under 2^32 words of qweight): one IMAD each
        // instead of a 64-bit product.
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 row = q4k_row<R, EPI>(b, r, p.n);
            bt.w[r] = q4_ld<4>(wp + row * wstride);
            bt.s[r] = sp[row * p.groups];
            bt.z[r] = zp[row * zstride];
        }
    };
    Q4KBatch<R> set[D];
    u32 ja = 0, sa = 0;  // the next unit to load
#pragma unroll
    for (int d = 0; d < D - 1; ++d) {
        if (ja < nj) {
            load(ja, sa, set[d]);
            if (++sa == S) sa = 0, ++ja;
        }
    }
    tp_pdl_wait();
    for (u32 c = t; c < C; c += blockDim.x) {
        Q4KActs a;
        Q4KDot::acts<false>(p, c, true, a);
#pragma unroll
        for (int l = 0; l < 3; ++l) {
            V16 e, o;
#pragma unroll
            for (int i = 0; i < 4; ++i) e.w[i] = a.e[l][i], o.w[i] = a.o[l][i];
            lim[l * C + c] = e;
            lim[(3 + l) * C + c] = o;
        }
        csum[c] = a.sum;
        cun[c] = a.unscale;
    }
    __syncthreads();
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    u32 j = 0, s = 0;  // the unit computed next
    while (j < nj) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (j < nj) {  // the same in every lane: the shuffles below are uniform
                if (ja < nj) {
                    load(ja, sa, set[(d + D - 1) % D]);
                    if (++sa == S) sa = 0, ++ja;
                }
                const u32 c = s * TP_WAVE + lane;
                if (c < C) {
                    Q4KActs a;
#pragma unroll
                    for (int l = 0; l < 3; ++l) {
                        const V16 e = lim[l * C + c], o = lim[(3 + l) * C + c];
#pragma unroll
                        for (int i = 0; i < 4; ++i) a.e[l][i] = e.w[i], a.o[l][i] = o.w[i];
                    }
                    a.sum = csum[c];
                    a.unscale = cun[c];
                    float v[R];
                    Q4KDot::dots<R>(set[d], a, 4 * (group_of(c) % 8), v);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += v[r];
                }
                if (s == S - 1) {
                    float v[R];
#pragma unroll
                    for (int r = 0; r < R; ++r) v[r] = acc[r], acc[r] = 0.0f;
                    float sum = q4k_wave_sums<R, L>(v, lane);
                    // Lane group r holds row r; with the epilogue, gate row r's up row is r + YB.
                    if (EPI) sum = q4_silu_mul(sum, tp_shfl_xor(sum, (int)(YB * (TP_WAVE >> L))));
                    const u32 r = lane / (TP_WAVE >> L), row = (gw + j * GW) * YB + r;
                    if (lane % (TP_WAVE >> L) == 0 && r < YB && row < yn) ((float*)p.y)[row] = sum;
                }
                if (++s == S) s = 0, ++j;
            }
        }
    }
}

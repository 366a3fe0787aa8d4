// Runs gemv.cu's q|k|v epilogue kernels (gemv_rope_*, gemv_norm_rope_*: ops::QkvMatmul) on the
// CPU (portable.h stand-in beside this file, kernels/src/gpu/elem.h itself) and compares q and
// both caches with an f64 reference of the product followed by QkvRope: head layouts with one
// pair per head, odd head counts, Llama-3-8B's; the 16-byte and the scalar path; the seam
// folded in or not; bias; a slot past the last (clamped); a position past the cache (nothing
// stored). Exit 1 on any mismatch, or on a cache element written where nothing should be.
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
#include "gemv.cu"

static std::mt19937_64 rng(11);

// Runs `kern` over `grid` blocks of `block` threads, one block at a time.
static void launch(void (*kern)(const GemvRopeParams), const GemvRopeParams& p, u32 grid, u32 block) {
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    emu_waves.clear();
    for (u32 w = 0; w < block / TP_WAVE; ++w) emu_waves.push_back(std::make_unique<std::barrier<>>(TP_WAVE));
    emu_block = std::make_unique<std::barrier<>>((std::ptrdiff_t)block);
    for (u32 bx = 0; bx < grid; ++bx) {
        std::vector<std::thread> threads;
        for (u32 l = 0; l < block; ++l)
            threads.emplace_back([&, l] {
                threadIdx = {l, 0, 0};
                blockIdx = {bx, 0, 0};
                kern(p);
            });
        for (auto& t : threads) t.join();
    }
}

struct Case {
    u32 heads, kv_heads, d, k, cap, pos;
    u32 slot, nslots;  // nslots 0: one sequence
    bool seam, bias, vec;
    u32 grid, block;   // a grid smaller than the row groups runs the grid-stride loop
};

static int run(const Case& c) {
    const u32 n = (c.heads + 2 * c.kv_heads) * c.d, half = c.d / 2, kvw = c.kv_heads * c.d;
    const u32 slots = c.nslots ? c.nslots : 1;
    std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
    std::vector<u16> w((size_t)n * c.k);
    std::vector<float> x(c.k), delta(c.k), nw(c.k), bias(n), q((size_t)c.heads * c.d, NAN),
        x_out(c.k, NAN), inv(half);
    for (auto& v : w) v = tp_f32_to_bf16(ud(rng) * 0.25f);
    for (auto& v : x) v = ud(rng) * 2;
    for (auto& v : delta) v = ud(rng);
    for (auto& v : nw) v = 1 + ud(rng) * 0.5f;
    for (auto& v : bias) v = ud(rng);
    for (u32 i = 0; i < half; ++i) inv[i] = (float)std::pow(500000.0, -2.0 * i / c.d);
    // The caches hold a marker everywhere: only row pos of the slot may change.
    const size_t clen = (size_t)slots * c.cap * kvw;
    const u16 mark = tp_f32_to_bf16(12345.0f);
    std::vector<u16> kc(clen, mark), vc(clen, mark);
    const u32 pos = c.pos, slot = c.slot;
    GemvRopeParams p{};
    p.g = GemvParams{(u64)x.data(), (u64)w.data(), c.bias ? (u64)bias.data() : 0, 0, 1, c.k, n,
                     c.vec ? 1u : 0u, c.seam ? (u64)delta.data() : 0, c.seam ? (u64)nw.data() : 0,
                     c.seam ? (u64)x_out.data() : 0, 1e-5f, 0};
    p.r = GemvRope{(u64)q.data(), (u64)kc.data(), (u64)vc.data(), (u64)&pos, c.nslots ? (u64)&slot : 0,
                   (u64)inv.data(), c.cap, c.heads, c.kv_heads, half, slots, 2, 0};
    launch(c.seam ? gemv_norm_rope_bf16 : gemv_rope_bf16, p, c.grid, c.block);

    // f64 reference: the product (after the seam), bias, rotation, rounding to bf16.
    std::vector<double> a(c.k);
    double ss = 0;
    for (u32 j = 0; j < c.k; ++j) {
        a[j] = c.seam ? (double)x[j] + delta[j] : x[j];
        ss += a[j] * a[j];
    }
    if (c.seam) {
        const double r = 1 / std::sqrt(ss / c.k + 1e-5);
        for (u32 j = 0; j < c.k; ++j) a[j] *= r * nw[j];
    }
    std::vector<double> y(n);
    for (u32 r = 0; r < n; ++r) {
        double s = 0;
        for (u32 j = 0; j < c.k; ++j) s += a[j] * tp_bf16_to_f32(w[(size_t)r * c.k + j]);
        y[r] = s + (c.bias ? bias[r] : 0.0);
    }
    int bad = 0;
    auto check = [&](const char* what, double got, double want, double mag, double tol) {
        if (!(std::fabs(got - want) <= tol * mag)) {
            if (bad++ < 5) std::printf("FAIL %s: got %.9g want %.9g\n", what, got, want);
        }
    };
    const bool stored = pos < c.cap;
    const size_t at = ((size_t)std::min(slot, slots - 1) * c.cap + pos) * kvw;
    for (u32 h = 0; h < c.heads + 2 * c.kv_heads; ++h)
        for (u32 i = 0; i < half; ++i) {
            const double y1 = y[h * c.d + i], y2 = y[h * c.d + i + half];
            double o1 = y1, o2 = y2;
            if (h < c.heads + c.kv_heads) {
                const double ang = (double)((float)pos * inv[i]);
                o1 = y1 * std::cos(ang) - y2 * std::sin(ang);
                o2 = y2 * std::cos(ang) + y1 * std::sin(ang);
            }
            const double mag = 1 + std::fabs(y1) + std::fabs(y2);
            if (h < c.heads) {
                check("q", q[h * c.d + i], o1, mag, 1e-5);
                check("q", q[h * c.d + i + half], o2, mag, 1e-5);
            } else if (stored) {
                const bool is_k = h < c.heads + c.kv_heads;
                const auto& cc = is_k ? kc : vc;
                const size_t e = at + (h - c.heads - (is_k ? 0 : c.kv_heads)) * c.d + i;
                check(is_k ? "k" : "v", tp_bf16_to_f32(cc[e]), o1, mag, 1.0 / 128);
                check(is_k ? "k" : "v", tp_bf16_to_f32(cc[e + half]), o2, mag, 1.0 / 128);
            }
        }
    // Nothing else in the caches changed.
    for (size_t e = 0; e < clen; ++e) {
        const bool row = stored && e >= at && e < at + kvw;
        if (!row && (kc[e] != mark || vc[e] != mark)) {
            if (bad++ < 5) std::printf("FAIL cache element %zu written\n", e);
        }
    }
    if (c.seam)
        for (u32 j = 0; j < c.k; ++j) check("x_out", x_out[j], (double)x[j] + delta[j], 1, 1e-6);
    std::printf("%s heads %u/%u d %u k %u cap %u pos %u slot %u/%u%s%s%s grid %u block %u\n",
                bad ? "FAIL" : "ok", c.heads, c.kv_heads, c.d, c.k, c.cap, pos, slot, c.nslots,
                c.seam ? " seam" : "", c.bias ? " bias" : "", c.vec ? " vec" : " scalar", c.grid, c.block);
    return bad ? 1 : 0;
}

int main() {
    int fails = 0;
    // (heads, kv_heads, d, k, cap, pos, slot, nslots, seam, bias, vec, grid, block)
    const Case cases[] = {
        {4, 2, 8, 64, 10, 5, 0, 0, false, false, true, 2, 64},
        {4, 2, 8, 64, 10, 5, 0, 0, true, true, true, 2, 64},
        {3, 1, 2, 37, 4, 3, 0, 0, false, true, false, 1, 32},
        {3, 1, 2, 37, 4, 3, 0, 0, true, false, false, 1, 32},
        {2, 2, 6, 96, 4, 100000, 0, 0, true, true, true, 3, 32},
        {4, 2, 8, 64, 5, 2, 9, 3, false, true, true, 1, 128},
        {1, 1, 64, 256, 6, 1, 1, 2, true, false, true, 4, 128},
        {8, 2, 128, 512, 4, 3, 0, 0, true, false, true, 16, 128},
        {8, 2, 128, 512, 4, 3, 0, 0, false, true, true, 16, 128},
    };
    for (const Case& c : cases) fails += run(c);
    std::printf("%d of %zu cases failed\n", fails, sizeof(cases) / sizeof(cases[0]));
    return fails ? 1 : 0;
}

// Runs gemv_q4.cu's kernels on the CPU (portable.h stand-in beside this file) over random
// int4 layers in the layout of kernels/src/int4.rs and compares y with an f64 reference:
// group sizes 32/64/128/k, with and without perm (desc_act), both prologues and the
// epilogue, decode (the row-group and the by-chunk `_k` kernels) and prefill, the 16-byte and
// the word path. Exit 1 on any mismatch.
#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
#include "gemv_q4.cu"

static std::mt19937_64 rng(7);

struct Case {
    u32 m, k, n, group;
    bool perm, silu;
    bool epi = false;  // the SiluMul epilogue: y[j] = silu(row j) · row (j + n/2), j < n/2
    bool chunks = false;  // the by-chunk kernels (`_k`, `_kb`), m = 1
    // x: 0 uniform in [−2, 2]; 1 each 32-input chunk scaled by its own 2^[−20, 20] and one
    // input in 8 made 1000× larger (an outlier per chunk); 2 as 0 with x[5] = +inf.
    int xdist = 0;
};

// Runs `kern` over a grid of `grid` blocks of `block` threads, one block at a time.
static void launch(void (*kern)(const GemvQ4Params), const GemvQ4Params& p, EmuDim grid, u32 block) {
    blockDim = {block, 1, 1};
    gridDim = grid;
    emu_waves.clear();
    for (u32 w = 0; w < block / TP_WAVE; ++w) emu_waves.push_back(std::make_unique<std::barrier<>>(TP_WAVE));
    emu_block = std::make_unique<std::barrier<>>((std::ptrdiff_t)block);
    for (u32 by = 0; by < grid.y; ++by)
        for (u32 bx = 0; bx < grid.x; ++bx) {
            std::vector<std::thread> threads;
            for (u32 l = 0; l < block; ++l)
                threads.emplace_back([&, l] {
                    threadIdx = {l, 0, 0};
                    blockIdx = {bx, by, 0};
                    kern(p);
                });
            for (auto& t : threads) t.join();
        }
}

static int run(const Case& c, bool vec) {
    const u32 kq = c.k, groups = kq / c.group, zw = (groups + 7) / 8;
    std::vector<u32> qw((size_t)c.n * kq / 8), zeros((size_t)c.n * zw, 0), perm(kq);
    std::vector<u16> scales((size_t)c.n * groups);
    for (auto& w : qw) w = (u32)rng();
    for (auto& z : zeros) z = (u32)rng();
    std::uniform_real_distribution<float> sd(0.01f, 0.1f), xd(-2.0f, 2.0f);
    for (auto& s : scales) {
        _Float16 h = (_Float16)sd(rng);
        std::memcpy(&s, &h, 2);
    }
    for (u32 j = 0; j < kq; ++j) perm[j] = j;
    if (c.perm) std::shuffle(perm.begin(), perm.end(), rng);
    const u32 xk = c.silu ? 2 * c.k : c.k;
    std::vector<float> x((size_t)c.m * xk), y((size_t)c.m * c.n, NAN);
    std::uniform_int_distribution<int> ed(-20, 20), od(0, 7);
    for (size_t j = 0; j < x.size(); ++j) {
        x[j] = xd(rng);
        if (c.xdist == 1 && j % 32 == 0) {
            const float f = std::ldexp(1.0f, ed(rng));
            for (size_t i = j; i < std::min(j + 32, x.size()); ++i) x[i] = xd(rng) * f * (od(rng) ? 1.0f : 1000.0f);
            j += 31;
        }
    }
    if (c.xdist == 2) x[5] = INFINITY;
    GemvQ4Params p{(u64)x.data(), (u64)qw.data(), (u64)scales.data(), (u64)zeros.data(),
                   c.perm ? (u64)perm.data() : 0, (u64)y.data(), c.m, c.k, c.n, kq, c.group,
                   groups, vec ? 1u : 0u, 0};
    const bool tile = c.m > 1;
    if (c.chunks) {
        // As ops_gemv_q4.rs k_plan: kq / 32 threads rounded up to waves, `_kb` above 256; a
        // grid of 3 blocks, so that each walks several batches.
        const u32 block = (kq / 32 + TP_WAVE - 1) / TP_WAVE * TP_WAVE;
        const bool big = block > 256;
        void (*kern)(const GemvQ4Params) =
            c.epi ? (big ? gemv_q4_kb_e : gemv_q4_k_e)
                  : c.silu ? (big ? gemv_q4_kb_silu : gemv_q4_k_silu) : (big ? gemv_q4_kb : gemv_q4_k);
        launch(kern, p, {3, 1, 1}, block);
    } else {
        void (*kern)(const GemvQ4Params) =
            c.epi ? (tile ? gemm_q4_e : gemv_q4_e)
                  : tile ? (c.silu ? gemm_q4_silu : gemm_q4) : (c.silu ? gemv_q4_silu : gemv_q4);
        // Few blocks, so that the grid-stride loops run; one wave per block.
        launch(kern, p, {3, 2, 1}, TP_WAVE);
    }
    // Σ a (q − z) s in f64, and Σ |a (q − z) s|: the error is judged against the latter (what
    // f32 accumulation and x's rounding scale with), not against the sum, which may cancel.
    auto dot = [&](u32 t, u32 r, double& mag) {
        double want = 0;
        mag = 0;
        for (u32 j = 0; j < kq; ++j) {
            const u32 g = j / c.group, i = perm[j];
            const double q = (qw[(size_t)r * kq / 8 + j / 8] >> (4 * (j % 8))) & 15;
            const double z = (zeros[(size_t)r * zw + g / 8] >> (4 * (g % 8))) & 15;
            _Float16 h;
            std::memcpy(&h, &scales[(size_t)r * groups + g], 2);
            double a = x[(size_t)t * xk + i];
            if (c.silu) a = a / (1 + std::exp(-a)) * x[(size_t)t * xk + c.k + i];
            want += a * (q - z) * (double)(float)h;
            mag += std::fabs(a * (q - z) * (double)(float)h);
        }
        return want;
    };
    const u32 yn = c.epi ? c.n / 2 : c.n;
    double worst = 0;
    for (u32 t = 0; t < c.m; ++t)
        for (u32 r = 0; r < yn; ++r) {
            double mag, mag2 = 0;
            double want = dot(t, r, mag);
            if (c.epi) {
                // silu(g) · u: the relative errors of g and u add (silu's derivative is ≤ 1.1).
                const double u = dot(t, r + yn, mag2), sg = 1 / (1 + std::exp(-want));
                mag = std::fabs(want * sg * u) * (mag / (std::fabs(want) + 1e-300) + mag2 / (std::fabs(u) + 1e-300));
                want = want * sg * u;
            }
            const double got = y[(size_t)t * yn + r];
            double e;
            if (!std::isfinite(want))
                e = std::isfinite(got) ? INFINITY : 0;  // non-finite in, non-finite out
            else
                e = std::fabs(got - want) / (mag + 1e-30);  // f32 has nothing below ~1e-38
            if (!(e <= worst)) worst = e;  // NaN (unwritten) counts as worst
        }
    const bool ok = worst < 4e-6;
    std::printf("%s m %u k %u n %u group %u%s%s%s%s%s: max rel err %.2e\n", ok ? "ok  " : "FAIL", c.m,
                c.k, c.n, c.group, c.perm ? " perm" : "", c.silu ? " silu" : "", c.epi ? " epi" : "",
                c.chunks ? " chunks" : "", vec ? " vec" : " word", worst);
    return ok ? 0 : 1;
}

int main() {
    int bad = 0;
    for (u32 group : {32u, 64u, 128u, 512u})
        for (bool perm : {false, true})
            for (bool silu : {false, true})
                for (u32 m : {1u, 3u, 9u}) bad += run({m, 512, 37, group, perm, silu}, true);
    for (u32 group : {8u, 40u, 200u})
        for (bool silu : {false, true}) {
            bad += run({1, 200, 21, group, false, silu}, false);
            bad += run({4, 200, 21, group, true, silu}, false);
        }
    bad += run({1, 256, 19, 64, false, false}, false);
    bad += run({1, 512, 38, 64, false, false, true}, true);
    bad += run({3, 512, 38, 64, true, false, true}, true);
    // The by-chunk kernels: `_k` (16 and 160 chunks), `_kb` (384), each group size, perm, both
    // prologues, the epilogue; rows not a whole number of batches.
    for (u32 group : {32u, 64u, 128u, 512u})
        for (bool perm : {false, true})
            for (bool silu : {false, true}) bad += run({1, 512, 37, group, perm, silu, false, true}, true);
    for (bool silu : {false, true}) bad += run({1, 5120, 41, 128, false, silu, false, true}, true);
    for (bool perm : {false, true}) bad += run({1, 12288, 23, 128, perm, false, false, true}, true);
    bad += run({1, 12288, 13, 128, false, true, false, true}, true);
    for (u32 n : {38u, 2u, 46u}) bad += run({1, 512, n, 128, false, false, true, true}, true);
    bad += run({1, 5120, 58, 128, true, false, true, true}, true);
    bad += run({1, 12288, 30, 128, false, false, true, true}, true);
    // `_kb` with 17–22 batches per block: flushes every 8 (F) and the ring's wrap.
    bad += run({1, 12288, 101, 128, false, false, false, true}, true);
    bad += run({1, 12288, 101, 64, true, true, false, true}, true);
    bad += run({1, 12288, 130, 128, false, false, true, true}, true);
    // Wide-ranging x with outliers, and an infinite input, on every path.
    for (bool chunks : {false, true})
        for (int xdist : {1, 2}) {
            bad += run({1, 512, 37, 64, false, false, false, chunks, xdist}, true);
            bad += run({1, 512, 37, 128, true, true, false, chunks, xdist}, true);
            bad += run({1, 512, 38, 128, false, false, true, chunks, xdist}, true);
            bad += run({1, 12288, 23, 128, false, false, false, chunks, xdist}, true);
        }
    bad += run({3, 512, 37, 64, true, false, false, false, 1}, true);
    std::printf("%d failed\n", bad);
    return bad ? 1 : 0;
}

// Runs gemv_q4.cu's kernels on the CPU (portable.h stand-in beside this file) over random
// int4 layers in the layout of kernels/src/int4.rs and compares y with an f64 reference:
// group sizes 32/64/128/k, with and without perm (desc_act), both prologues, decode and
// prefill, the 16-byte and the word path. Exit 1 on any mismatch.
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
};

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
    for (auto& v : x) v = xd(rng);
    GemvQ4Params p{(u64)x.data(), (u64)qw.data(), (u64)scales.data(), (u64)zeros.data(),
                   c.perm ? (u64)perm.data() : 0, (u64)y.data(), c.m, c.k, c.n, kq, c.group,
                   groups, vec ? 1u : 0u, 0};
    const bool tile = c.m > 1;
    void (*kern)(const GemvQ4Params) =
        tile ? (c.silu ? gemm_q4_silu : gemm_q4) : (c.silu ? gemv_q4_silu : gemv_q4);
    // Few blocks, so that the grid-stride loops run; one wave per block.
    blockDim = {TP_WAVE, 1, 1};
    gridDim = {3, 2, 1};
    std::barrier<> wave(TP_WAVE);
    emu_wave = &wave;
    for (u32 by = 0; by < gridDim.y; ++by)
        for (u32 bx = 0; bx < gridDim.x; ++bx) {
            std::vector<std::thread> lanes;
            for (u32 l = 0; l < TP_WAVE; ++l)
                lanes.emplace_back([&, l] {
                    threadIdx = {l, 0, 0};
                    blockIdx = {bx, by, 0};
                    kern(p);
                });
            for (auto& t : lanes) t.join();
        }
    double worst = 0;
    for (u32 t = 0; t < c.m; ++t)
        for (u32 r = 0; r < c.n; ++r) {
            double want = 0;
            for (u32 j = 0; j < kq; ++j) {
                const u32 g = j / c.group, i = perm[j];
                const double q = (qw[(size_t)r * kq / 8 + j / 8] >> (4 * (j % 8))) & 15;
                const double z = (zeros[(size_t)r * zw + g / 8] >> (4 * (g % 8))) & 15;
                _Float16 h;
                std::memcpy(&h, &scales[(size_t)r * groups + g], 2);
                double a = x[(size_t)t * xk + i];
                if (c.silu) a = a / (1 + std::exp(-a)) * x[(size_t)t * xk + c.k + i];
                want += a * (q - z) * (double)(float)h;
            }
            const double got = y[(size_t)t * c.n + r];
            const double e = std::fabs(got - want) / (1 + std::fabs(want));
            if (!(e <= worst)) worst = e;  // NaN (unwritten) counts as worst
        }
    const bool ok = worst < 1e-4;
    std::printf("%s m %u k %u n %u group %u%s%s%s: max rel err %.2e\n", ok ? "ok  " : "FAIL", c.m,
                c.k, c.n, c.group, c.perm ? " perm" : "", c.silu ? " silu" : "",
                vec ? " vec" : " word", worst);
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
    std::printf("%d failed\n", bad);
    return bad ? 1 : 0;
}

// attention.cu: `Op::Attention`, causal grouped-query attention of `rows` queries over a KV
// cache of `cap` rows, f32 scores and softmax.
//
// CPU twin: kernels/src/cpu/ops/decode.rs `attention` (over cpu/ops/attention.rs). Rust
// mirrors of the parameter struct and the constants: kernels/src/cuda/ops_attention.rs.
//
// The sequence length lives on the device (query r sees cache rows 0..=pos[r], pos clamped to
// cap - 1), because the launch is captured once into a graph and replayed for every token. So
// the grid is fixed at launch and the work adapts inside it ("flash-decoding", as
// FlashInfer's and FlashAttention's decode kernels do, with the split length chosen on the
// device): each row's pos + 1 positions are cut into `parts` parts (attn_part_len, at least
// TP_ATTN_PART_MIN positions each), one block per (KV head, part, row) writes the partial
// softmax state of its part into the workspace, and attn_merge combines the partials. A part
// past pos[r] writes an empty partial and exits at once. A block walks its part in chunks of
// TP_ATTN_SPLIT positions (the shared-memory score rows), merging as it goes; without a
// workspace, attn_single_* walk all positions of a row in one block per (KV head, row).
// (Until 2026-12-03 the parts were fixed 256-position splits of the cache: a 256-token
// sequence then ran on 8 blocks of 132 SMs, and a 32K one on 1024.)
//
// With one row (the decode step) and a short part (at most 64 keys of head_dim 128, f16/bf16),
// the split kernel loads the part's K and V rows into registers before its PDL wait, while the
// KV append before it runs: those rows were written by earlier steps, only row pos by that
// kernel (reloaded after the wait, with q). Synth Llama-3-8B at 384 positions on an H100:
// +1.6 % per token (docs/perf-notes.md, 2026-12-06 night).
//
// GQA: a block serves the query heads of one KV head together (up to TP_ATTN_GMAX of them;
// larger groups are cut into head chunks of TP_ATTN_GMAX), so every K and V row is read from
// memory once per KV head, not once per query head. The kernels are instantiated for
// G = 1, 2, 4, 8 heads per block; a group of 3 runs in the G = 4 kernel with one head idle.
//
// The partial softmax state of part (or chunk) i over its keys T_i, per query head:
//     m_i = max_{t in T_i} s_t,   l_i = sum_t e^(s_t - m_i),   o_i = sum_t e^(s_t - m_i) v_t
// and the merge (exact in real arithmetic, whatever the split boundaries):
//     m = max_i m_i,   out = sum_i e^(m_i - m) o_i / sum_i e^(m_i - m) l_i
// Workspace layout (ops::Attention::workspace_len, sized for ceil(cap / TP_ATTN_SPLIT) parts,
// the most the launcher uses): partial (row r, query head h, part i) is (head_dim + 2) f32 at
// ((r * heads + h) * parts + i) * (head_dim + 2): [m, l, o[0..d)]. An empty part is
// (m, l) = (-inf, 0) with o unwritten; the merge never reads it (it reads only the parts up
// to pos[r]'s).

#include "elem.h"

// Cache positions per split: ops::ATTN_SPLIT (the workspace size depends on it).
#define TP_ATTN_SPLIT 256
// Threads per attention block: one per position of a split in the score phase's widest
// mapping; 8 warps (4 wave64s), enough 16-byte loads in flight per block (see attn_split)
// with two blocks per SM.
#define TP_ATTN_THREADS 256
// Largest head_dim (shared memory rows are this long; the launcher refuses larger).
#define TP_ATTN_DMAX 256
// Most query heads one block serves (registers: G * 8 accumulators per thread, see phase 3).
#define TP_ATTN_GMAX 8
// Fewest positions per part (attn_part_len), a multiple of the wavefront.
#define TP_ATTN_PART_MIN 32
// Threads of attn_merge: one per output element (head_dim <= TP_ATTN_DMAX).
#define TP_ATTN_MERGE_THREADS 256

// Arguments of every kernel here, by value. 8 * 8 + 12 * 4 = 112 bytes.
struct AttnParams {
    u64 q;         // [rows, heads, head_dim] f32
    u64 k;         // [cap, kv_heads, head_dim] KV dtype
    u64 v;         // [cap, kv_heads, head_dim] KV dtype
    u64 out;       // [rows, heads, head_dim] f32
    u64 pos;       // [rows] u32
    u64 ws;        // f32 workspace (split kernels and attn_merge only)
    u64 slots;     // [rows] u32 cache slot of each row (ops::CacheSlots), or 0: one sequence
    u64 gate;      // [rows, heads, head_dim] f32 output gate (ops::Attention::gate), or 0
    u32 rows;
    u32 heads;
    u32 kv_heads;
    u32 head_dim;
    u32 cap;       // cache rows
    u32 parts;     // grid y of the split kernel: parts each row's positions are cut into
    u32 group;     // heads / kv_heads
    u32 chunks;    // ceil(group / TP_ATTN_GMAX): blocks per KV head along grid x
    u32 vec;       // 1 when K and V rows allow 16-byte loads (addresses and head_dim * size)
    float scale;   // score = (q . k) * scale
    u32 nslots;    // slots in the cache (with slots; each of cap rows)
    u32 pad;
};

TP_DEV float attn_neg_inf() { return tp_f32_from_bits(0xff800000u); }

// Element i of out: o, or with the output gate o · σ(gate[i]) in decode.cu sigmoid_mul's
// expression (the CPU twin is the SigmoidMul op on the attention's output).
TP_DEV void attn_put(const AttnParams& p, u64 i, float o) {
    if (p.gate) o = o / (1.0f + expf(-((const float*)p.gate)[i]));
    ((float*)p.out)[i] = o;
}

// Largest v over the wavefront, the same value in every lane. fmaxf drops a NaN operand, as
// the CPU twin's f32::max does.
TP_DEV float attn_wave_max(float v) {
#pragma unroll
    for (int m = TP_WAVE / 2; m > 0; m /= 2) v = fmaxf(v, tp_shfl_xor(v, m));
    return v;
}

// pos[row], clamped to the cache (ops::Attention).
TP_DEV u32 attn_pos(const AttnParams& p, u32 row) {
    const u32 x = ((const u32*)p.pos)[row];
    return x < p.cap ? x : p.cap - 1;
}

// Bytes from the cache's start to row `row`'s slot (ops::CacheSlots; ids clamped to the
// last slot), 0 without slots.
TP_DEV u64 attn_slot_off(const AttnParams& p, u32 row, u32 size) {
    if (!p.slots) return 0;
    const u32 s = ((const u32*)p.slots)[row];
    return (u64)(s < p.nslots ? s : p.nslots - 1) * p.cap * p.kv_heads * p.head_dim * size;
}

// Positions per part for a query at `pos` (split kernel and merge agree through this): the
// pos + 1 positions cut into p.parts parts, rounded up to TP_ATTN_PART_MIN so that a short
// sequence uses a few blocks of a useful size rather than all of them with a key or two.
// Part i covers [i * len, min((i + 1) * len, pos + 1)); parts past pos are empty.
TP_DEV u32 attn_part_len(const AttnParams& p, u32 pos) {
    const u32 len = (pos + p.parts) / p.parts;  // ceil((pos + 1) / parts)
    return (len + TP_ATTN_PART_MIN - 1) / TP_ATTN_PART_MIN * TP_ATTN_PART_MIN;
}

// What one block keeps in shared memory: the queries of its G heads (zero past head_dim), the
// split's scores (then e^(s - m)), and the split's partial state. G = 8: 24 KiB.
template <int G>
struct AttnSmem {
    alignas(16) float q[G][TP_ATTN_DMAX];
    float s[G][TP_ATTN_SPLIT];
    float o[G][TP_ATTN_DMAX];
    float m[G];
    float l[G];
};

// The score phase's loads per lane and step: TP_ATTN_KPL keys, 4 packs of each (attn_split).
#define TP_ATTN_KPL 2

// The value phase's mapping for element type D: CPL packs of a V row per lane, U keys per step
// (U * CPL = 8 loads of 16 bytes in flight per thread).
template <class D>
struct AttnVMap {
    static constexpr int CPL = D::V == 4 ? 2 : 1;  // f32: up to 64 packs; f16/bf16: up to 32
    static constexpr int U = 8 / CPL;
};

// The K and V packs of one lane for a part that is one step of each phase with a single key
// per lane in the score phase and TP_ATTN_PRE_U in the value phase (attn_pre_fits: f16/bf16
// rows of at most 128 elements, at most 64 keys at head_dim 128), loaded before the step's
// inputs are ready (attn_split_kernel's early path). Half a full step's registers: the full
// one spilled next to G = 4's accumulators.
#define TP_ATTN_PRE_U 4
template <class D>
struct AttnPre {
    V16 k[1][4];
    V16 v[TP_ATTN_PRE_U][AttnVMap<D>::CPL];
};

// Elements c*V .. c*V + V of a row through the scalar path (any alignment the element size
// allows), zeros past head_dim d.
template <class D>
TP_DEV void attn_load_scalar(const u8* row, u32 c, u32 d, float* f) {
#pragma unroll
    for (int j = 0; j < D::V; ++j) {
        const u32 e = c * D::V + (u32)j;
        f[j] = e < d ? D::get(row, e) : 0.0f;
    }
}

// dot[g] += q[g][c*V ..] . kf for every head of the block (q read as 16-byte words of shared
// memory, the same address in all lanes of a key group: a broadcast).
//
// Fused multiply-adds, written out: the modules compile with --fmad=false (other kernels
// must match their CPU twins bit for bit), which would make every product here a multiply
// and an add, and this kernel does G of them per K and V element it reads, enough to make
// the instruction count rather than memory its limit at G = 4 and 8. The twin's tolerance
// covers the (smaller) rounding of a fused multiply-add.
template <class D, int G>
TP_DEV void attn_dot_pack(const AttnSmem<G>& sm, u32 c, const float* kf, float* dot) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qg = &sm.q[g][c * D::V];
        float acc = dot[g];
#pragma unroll
        for (int j4 = 0; j4 < D::V; j4 += 4) {
            const V16 qq = *(const V16*)(qg + j4);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc = fmaf(tp_f32_from_bits(qq.w[j]), kf[j4 + j], acc);
        }
        dot[g] = acc;
    }
}

// The score phase's mapping: `kl` adjacent lanes share a key (16 * kl contiguous bytes per load
// instruction and key, so a warp touches 32 / kl rows instead of 32), each summing the packs
// c = sub, sub + kl, ...; then a butterfly over the kl lanes. More lanes per key would cost G
// shuffles per key and halving; fewer would scatter a warp's loads over more rows. Each lane
// takes TP_ATTN_KPL keys per step (lane_keys apart), all their loads issued before any is used.
struct AttnKMap {
    u32 kl, sub, lane_keys;
};
TP_DEV AttnKMap attn_kmap(u32 npacks) {
    AttnKMap m;
    m.kl = npacks >= 4 ? 4u : (npacks >= 2 ? 2u : 1u);
    m.sub = threadIdx.x % m.kl;
    m.lane_keys = TP_ATTN_THREADS / m.kl;
    return m;
}

// The value phase's mapping: `np` adjacent lanes read one V row (all of it when it has at most
// TP_WAVE packs, else CPL packs each: f32 rows of more than 128 elements on a 32-wide wave);
// the block's TP_ATTN_THREADS / np row slices take every nslices-th key, U keys per step.
struct AttnVLanes {
    u32 np, col, slice, nslices;
};
TP_DEV AttnVLanes attn_vmap(u32 npacks) {
    AttnVLanes m;
    m.np = 1;
    while (m.np < npacks && m.np < (u32)TP_WAVE) m.np *= 2;
    m.col = threadIdx.x % m.np;
    m.slice = threadIdx.x / m.np;
    m.nslices = TP_ATTN_THREADS / m.np;
    return m;
}

// A 16-byte load that skips L1 (PTX ld.global.cg): the early path's reload of row pos after
// the PDL wait must not hit a sector that a load before the wait brought into L1 while the KV
// append was still writing it (rows of under 32 bytes share sectors). HIP runs kernels one
// after another (no PDL): a plain load there.
TP_DEV V16 attn_ld_l2(const u8* p) {
#if defined(TP_CUDA)
    V16 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
                 : "l"(p)
                 : "memory");
    return v;
#else
    return *(const V16*)p;
#endif
}

// A 16-byte pack of the cache: through L1, or from L2 (attn_ld_l2) with CG.
template <bool CG>
TP_DEV V16 attn_ld_pack(const u8* p) {
    if constexpr (CG) {
        return attn_ld_l2(p);
    } else {
        return *(const V16*)p;
    }
}

// This lane's K packs of the score step at keys `base` and packs `c0` into raw: keys
// ki = base + tid / kl + u * lane_keys (u < KPL) with ki < n and t0 + ki in [lo, hi), packs
// c0 + x * kl (x < 4) below npacks; other entries untouched.
template <int KP, bool CG = false>
TP_DEV void attn_k_load(const u8* kh, u64 stride, const AttnKMap& km, u32 t0, u32 n, u32 npacks, u32 base, u32 c0,
                        u32 lo, u32 hi, V16 (&raw)[KP][4]) {
#pragma unroll
    for (int u = 0; u < KP; ++u) {
        const u32 ki = base + threadIdx.x / km.kl + (u32)u * km.lane_keys;
        if (ki >= n || t0 + ki < lo || t0 + ki >= hi) continue;
        const u8* row = kh + (u64)(t0 + ki) * stride;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const u32 c = c0 + (u32)x * km.kl;
            if (c < npacks) raw[u][x] = attn_ld_pack<CG>(row + (u64)c * 16);
        }
    }
}

// dot[u][g] += the score step's packs in raw (attn_k_load's layout) . q[g].
template <class D, int G, int KP>
TP_DEV void attn_k_dot(const AttnSmem<G>& sm, const AttnKMap& km, u32 n, u32 npacks, u32 base, u32 c0,
                       const V16 (&raw)[KP][4], float (&dot)[TP_ATTN_KPL][G]) {
#pragma unroll
    for (int u = 0; u < KP; ++u) {
        const u32 ki = base + threadIdx.x / km.kl + (u32)u * km.lane_keys;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const u32 c = c0 + (u32)x * km.kl;
            if (ki < n && c < npacks) {
                float kf[D::V];
                D::unpack(raw[u][x], kf);
                attn_dot_pack<D, G>(sm, c, kf, dot[u]);
            }
        }
    }
}

// This lane's V packs of the value step at key i0 into raw: keys i = i0 + u * nslices (u < UV)
// with i < n and t0 + i in [lo, hi), packs col + cc * np (cc < CPL) below npacks.
template <class D, int UV, bool CG = false>
TP_DEV void attn_v_load(const u8* vh, u64 stride, const AttnVLanes& vm, u32 t0, u32 n, u32 npacks, u32 i0, u32 lo,
                        u32 hi, V16 (&raw)[UV][AttnVMap<D>::CPL]) {
#pragma unroll
    for (int u = 0; u < UV; ++u) {
        const u32 i = i0 + (u32)u * vm.nslices;
        if (i >= n || t0 + i < lo || t0 + i >= hi) continue;
#pragma unroll
        for (int cc = 0; cc < AttnVMap<D>::CPL; ++cc) {
            const u32 c = vm.col + (u32)cc * vm.np;
            if (c < npacks) raw[u][cc] = attn_ld_pack<CG>(vh + (u64)(t0 + i) * stride + (u64)c * 16);
        }
    }
}

// acc[cc][g] += e_i[g] * v_i for the value step's packs in raw (attn_v_load's layout).
template <class D, int G, int UV>
TP_DEV void attn_v_acc(const AttnSmem<G>& sm, const AttnVLanes& vm, u32 n, u32 npacks, u32 i0,
                       const V16 (&raw)[UV][AttnVMap<D>::CPL], float (&acc)[AttnVMap<D>::CPL][G][D::V]) {
#pragma unroll
    for (int u = 0; u < UV; ++u) {
        const u32 i = i0 + (u32)u * vm.nslices;
        if (i < n) {
#pragma unroll
            for (int cc = 0; cc < AttnVMap<D>::CPL; ++cc) {
                if (vm.col + (u32)cc * vm.np < npacks) {
                    float vf[D::V];
                    D::unpack(raw[u][cc], vf);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const float e = sm.s[g][i];
#pragma unroll
                        for (int j = 0; j < D::V; ++j) acc[cc][g][j] = fmaf(e, vf[j], acc[cc][g][j]);
                    }
                }
            }
        }
    }
}

// Whether n keys fit AttnPre (attn_split with PRE): the 16-byte path over f16/bf16 rows whose
// packs one score step covers, one key per lane there and TP_ATTN_PRE_U in the value phase.
template <class D>
TP_DEV bool attn_pre_fits(u32 npacks, u32 n) {
    const AttnKMap km = attn_kmap(npacks);
    const AttnVLanes vm = attn_vmap(npacks);
    return D::V == 8 && npacks <= 4 * km.kl && n <= km.lane_keys && n <= (u32)TP_ATTN_PRE_U * vm.nslices;
}

// This lane's K and V packs of keys t0 .. t0 + n with t0 + key in [lo, hi) into pre (keys
// t0 .. t0 + n must be attn_pre_fits); from L2 with CG.
template <class D, bool CG>
TP_DEV void attn_preload(const AttnParams& p, const u8* kh, const u8* vh, u32 t0, u32 n, u32 lo, u32 hi,
                         AttnPre<D>& pre) {
    const u32 npacks = p.head_dim / D::V;
    const u64 stride = (u64)p.kv_heads * p.head_dim * D::SIZE;
    const AttnKMap km = attn_kmap(npacks);
    const AttnVLanes vm = attn_vmap(npacks);
    attn_k_load<1, CG>(kh, stride, km, t0, n, npacks, 0, km.sub, lo, hi, pre.k);
    attn_v_load<D, TP_ATTN_PRE_U, CG>(vh, stride, vm, t0, n, npacks, vm.slice, lo, hi, pre.v);
}

// The partial state of keys t0 .. t0 + n (1 <= n <= TP_ATTN_SPLIT) for the block's G heads:
// sm.m[g], sm.l[g], sm.o[g][0..d). `kh`, `vh`: this KV head's slice of cache row 0; rows are
// kv_heads * d elements apart. Needs sm.q loaded and a barrier after it; ends with a barrier.
// With PRE the K and V packs are already in `pre` (attn_preload; the keys are attn_pre_fits),
// else they are loaded here, step by step.
//
// Memory: every K and V element of the split once (2 * n * d * size bytes), in 16-byte loads
// when VEC, eight per thread in flight (32 KiB per block, 64 KiB per SM at two blocks): a
// block is a chain of dependent load rounds, and with a small grid (short sequences, few KV
// heads per rank) its latency is the kernel's.
template <class D, int G, bool VEC, bool PRE>
TP_DEV void attn_split(const AttnParams& p, AttnSmem<G>& sm, const u8* kh, const u8* vh, u32 t0, u32 n,
                       const AttnPre<D>& pre) {
    const u32 d = p.head_dim;
    const u32 npacks = (d + D::V - 1) / D::V;  // packs of V elements per row
    const u64 stride = (u64)p.kv_heads * d * D::SIZE;
    const u32 tid = threadIdx.x;

    // 1. Scores.
    const AttnKMap km = attn_kmap(npacks);
    for (u32 base = 0; base < n; base += TP_ATTN_KPL * km.lane_keys) {
        float dot[TP_ATTN_KPL][G];
#pragma unroll
        for (int u = 0; u < TP_ATTN_KPL; ++u)
#pragma unroll
            for (int g = 0; g < G; ++g) dot[u][g] = 0.0f;
        if constexpr (PRE) {
            attn_k_dot<D, G, 1>(sm, km, n, npacks, base, km.sub, pre.k, dot);
        } else if constexpr (VEC) {
            for (u32 c0 = km.sub; c0 < npacks; c0 += 4 * km.kl) {
                V16 raw[TP_ATTN_KPL][4] = {};
                attn_k_load<TP_ATTN_KPL>(kh, stride, km, t0, n, npacks, base, c0, 0u, 0xffffffffu, raw);
                attn_k_dot<D, G, TP_ATTN_KPL>(sm, km, n, npacks, base, c0, raw, dot);
            }
        } else {
#pragma unroll
            for (int u = 0; u < TP_ATTN_KPL; ++u) {
                const u32 ki = base + tid / km.kl + (u32)u * km.lane_keys;
                if (ki < n) {
                    const u8* row = kh + (u64)(t0 + ki) * stride;
                    for (u32 c = km.sub; c < npacks; c += km.kl) {
                        float kf[D::V];
                        attn_load_scalar<D>(row, c, d, kf);
                        attn_dot_pack<D, G>(sm, c, kf, dot[u]);
                    }
                }
            }
        }
        // kl divides the wavefront and the key groups are aligned, so the butterfly stays
        // inside a group; every lane takes part (kl is the same in the whole block).
        for (u32 m = 1; m < km.kl; m *= 2) {
#pragma unroll
            for (int u = 0; u < TP_ATTN_KPL; ++u)
#pragma unroll
                for (int g = 0; g < G; ++g) dot[u][g] += tp_shfl_xor(dot[u][g], (int)m);
        }
        if (km.sub == 0) {
#pragma unroll
            for (int u = 0; u < TP_ATTN_KPL; ++u) {
                const u32 ki = base + tid / km.kl + (u32)u * km.lane_keys;
                if (ki < n) {
#pragma unroll
                    for (int g = 0; g < G; ++g) sm.s[g][ki] = dot[u][g] * p.scale;
                }
            }
        }
    }
    __syncthreads();

    // 2. Softmax statistics, one wavefront per head: m = max s, s <- e^(s - m), l = sum.
    const u32 lane = tid % TP_WAVE, wave = tid / TP_WAVE;
    const u32 nwaves = TP_ATTN_THREADS / TP_WAVE;
    for (u32 g = wave; g < (u32)G; g += nwaves) {
        float m = attn_neg_inf();
        for (u32 i = lane; i < n; i += TP_WAVE) m = fmaxf(m, sm.s[g][i]);
        m = attn_wave_max(m);
        float l = 0.0f;
        for (u32 i = lane; i < n; i += TP_WAVE) {
            const float e = expf(sm.s[g][i] - m);
            sm.s[g][i] = e;
            l += e;
        }
        l = tp_wave_sum(l);
        if (lane == 0) {
            sm.m[g] = m;
            sm.l[g] = l;
        }
    }
    __syncthreads();

    // 3. o[g] = sum_i e_i v_i (more loads in flight would not fit two blocks' registers per SM
    // next to G = 8's 64 accumulators).
    constexpr int CPL = AttnVMap<D>::CPL;
    constexpr int U = AttnVMap<D>::U;
    const AttnVLanes vm = attn_vmap(npacks);
    const u32 np = vm.np, col = vm.col;
    float acc[CPL][G][D::V];
#pragma unroll
    for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int j = 0; j < D::V; ++j) acc[cc][g][j] = 0.0f;
    for (u32 i0 = vm.slice; i0 < n; i0 += (u32)U * vm.nslices) {
        if constexpr (PRE) {
            attn_v_acc<D, G, TP_ATTN_PRE_U>(sm, vm, n, npacks, i0, pre.v, acc);
        } else if constexpr (VEC) {
            V16 raw[U][CPL] = {};
            attn_v_load<D, U>(vh, stride, vm, t0, n, npacks, i0, 0u, 0xffffffffu, raw);
            attn_v_acc<D, G, U>(sm, vm, n, npacks, i0, raw, acc);
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = i0 + (u32)u * vm.nslices;
                if (i < n) {
#pragma unroll
                    for (int cc = 0; cc < CPL; ++cc) {
                        const u32 c = col + (u32)cc * np;
                        if (c < npacks) {
                            float vf[D::V];
                            attn_load_scalar<D>(vh + (u64)(t0 + i) * stride, c, d, vf);
#pragma unroll
                            for (int g = 0; g < G; ++g) {
                                const float e = sm.s[g][i];
#pragma unroll
                                for (int j = 0; j < D::V; ++j) acc[cc][g][j] = fmaf(e, vf[j], acc[cc][g][j]);
                            }
                        }
                    }
                }
            }
        }
    }
    // Sum the slices of a wavefront (lanes np apart hold the same columns), then the
    // wavefronts in order through shared memory: deterministic, no atomics.
    for (u32 m = np; m < (u32)TP_WAVE; m *= 2) {
#pragma unroll
        for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int j = 0; j < D::V; ++j) acc[cc][g][j] += tp_shfl_xor(acc[cc][g][j], (int)m);
    }
    for (u32 w = 0; w < nwaves; ++w) {
        if (wave == w && lane < np) {
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
                const u32 c = col + (u32)cc * np;
#pragma unroll
                for (int j = 0; j < D::V; ++j) {
                    const u32 e = c * D::V + (u32)j;
                    if (c < npacks && e < d) {
#pragma unroll
                        for (int g = 0; g < G; ++g) sm.o[g][e] = w == 0 ? acc[cc][g][j] : sm.o[g][e] + acc[cc][g][j];
                    }
                }
            }
        }
        __syncthreads();
    }
}

// The queries of heads h0 .. h0 + gcount of `row` into sm.q, zeros elsewhere.
template <int G>
TP_DEV void attn_load_q(const AttnParams& p, AttnSmem<G>& sm, u32 row, u32 h0, u32 gcount) {
    const float* q = (const float*)p.q;
    for (u32 i = threadIdx.x; i < (u32)G * TP_ATTN_DMAX; i += TP_ATTN_THREADS) {
        const u32 g = i / TP_ATTN_DMAX, j = i % TP_ATTN_DMAX;
        sm.q[g][j] = (g < gcount && j < p.head_dim) ? q[((u64)row * p.heads + h0 + g) * p.head_dim + j] : 0.0f;
    }
}

// Which query heads block x serves: h0 .. h0 + gcount, all reading KV head `kvh`.
struct AttnHeads {
    u32 kvh, h0, gcount;
};
TP_DEV AttnHeads attn_heads(const AttnParams& p) {
    AttnHeads a;
    a.kvh = blockIdx.x / p.chunks;
    const u32 chunk = blockIdx.x % p.chunks;
    a.h0 = a.kvh * p.group + chunk * TP_ATTN_GMAX;
    const u32 left = p.group - chunk * TP_ATTN_GMAX;
    a.gcount = left < TP_ATTN_GMAX ? left : TP_ATTN_GMAX;
    return a;
}

// The running state of a block that walks more than one TP_ATTN_SPLIT chunk of keys.
template <int G>
struct AttnRun {
    float o[G][TP_ATTN_DMAX];
    float m[G], l[G], fa[G], fb[G];
};

// The unnormalised state of keys [b, e) (b < e) for the block's heads: in sm.m/l/o when the
// range is one chunk (then `run` is untouched), else merged chunk by chunk into run.m/l/o
// with the rule at the top of this file. Returns whether the state is in `run`. Needs sm.q
// loaded and a barrier after it; ends with a barrier.
template <class D, int G>
TP_DEV bool attn_range(const AttnParams& p, AttnSmem<G>& sm, AttnRun<G>& run, const u8* kh, const u8* vh,
                       u32 b, u32 e) {
    const u32 tid = threadIdx.x, d = p.head_dim;
    const AttnPre<D> pre = {};  // unused (PRE = false)
    if (e - b <= TP_ATTN_SPLIT) {
        if (p.vec) {
            attn_split<D, G, true, false>(p, sm, kh, vh, b, e - b, pre);
        } else {
            attn_split<D, G, false, false>(p, sm, kh, vh, b, e - b, pre);
        }
        return false;
    }
    for (u32 i = tid; i < (u32)G * TP_ATTN_DMAX; i += TP_ATTN_THREADS) run.o[i / TP_ATTN_DMAX][i % TP_ATTN_DMAX] = 0.0f;
    if (tid < (u32)G) {
        run.m[tid] = attn_neg_inf();
        run.l[tid] = 0.0f;
    }
    __syncthreads();
    for (u32 t0 = b; t0 < e; t0 += TP_ATTN_SPLIT) {
        const u32 n = e - t0 < TP_ATTN_SPLIT ? e - t0 : TP_ATTN_SPLIT;
        if (p.vec) {
            attn_split<D, G, true, false>(p, sm, kh, vh, t0, n, pre);
        } else {
            attn_split<D, G, false, false>(p, sm, kh, vh, t0, n, pre);
        }
        // First chunk: run.m = -inf, so fa = e^-inf = 0 and the state becomes the chunk's.
        if (tid < (u32)G) {
            const float mn = fmaxf(run.m[tid], sm.m[tid]);
            run.fa[tid] = expf(run.m[tid] - mn);
            run.fb[tid] = expf(sm.m[tid] - mn);
            run.l[tid] = run.fa[tid] * run.l[tid] + run.fb[tid] * sm.l[tid];
            run.m[tid] = mn;
        }
        __syncthreads();
        for (u32 i = tid; i < (u32)G * d; i += TP_ATTN_THREADS) {
            const u32 g = i / d, j = i % d;
            run.o[g][j] = run.fa[g] * run.o[g][j] + run.fb[g] * sm.o[g][j];
        }
        __syncthreads();
    }
    return true;
}

// Where the partial (m, l, o: d + 2 floats) of query head h, part `part` of row `row` starts in
// the workspace ([rows, heads, parts, d + 2]).
TP_DEV u64 attn_partial_at(const AttnParams& p, u32 h, u32 part, u32 row) {
    return (((u64)row * p.heads + h) * p.parts + part) * ((u64)p.head_dim + 2);
}

// The block's partial states (sm, or run when in_run) into the workspace.
template <int G>
TP_DEV void attn_write_partial(const AttnParams& p, const AttnSmem<G>& sm, const AttnRun<G>& run, const AttnHeads& hd,
                               u32 part, u32 row, bool in_run) {
    float* ws = (float*)p.ws;
    const u32 stride = p.head_dim + 2;
    const float* m = in_run ? run.m : sm.m;
    const float* l = in_run ? run.l : sm.l;
    for (u32 i = threadIdx.x; i < hd.gcount * stride; i += TP_ATTN_THREADS) {
        const u32 g = i / stride, j = i % stride;
        ws[attn_partial_at(p, hd.h0 + g, part, row) + j] =
            j == 0 ? m[g] : (j == 1 ? l[g] : (in_run ? run.o[g][j - 2] : sm.o[g][j - 2]));
    }
}

// Grid (kv_heads * chunks, parts, rows), TP_ATTN_THREADS threads: the partial state of one
// part of a row's positions (attn_part_len) for one head chunk, into the workspace. The
// number of parts is the launcher's (about two blocks per SM over the grid's x and z, at most
// one per TP_ATTN_SPLIT positions of the cache), and the part length follows the position on
// the device: 256 positions over 8 KV heads are 8 parts of 32 keys, 32K positions 33 parts of
// ~1K keys, so short and long sequences both spread over the SMs. Reads the part's K and V
// rows of one KV head once and writes G * (d + 2) f32.
template <class D, int G>
TP_DEV void attn_split_kernel(const AttnParams& p, AttnSmem<G>& sm, AttnRun<G>& run) {
    const AttnHeads hd = attn_heads(p);
    const u32 part = blockIdx.y, row = blockIdx.z;
    const u32 d = p.head_dim;
    // One query (the decode step): cache rows 0 .. pos - 1 were written by earlier steps and
    // only row pos by the kernel before this one (the KV append); the position and the slot
    // were written before the step (by the host, or by the sampler of the step before). So a
    // part that fits AttnPre (attn_pre_fits) loads its other K and V rows into
    // registers before the wait, while that kernel runs, and row pos and q after it: the two
    // dependent HBM round trips (keys, then values) leave the chain of a short sequence. Not
    // with several rows: a prompt's rows are all appended by the kernel before.
    if constexpr (D::V == 8 && G <= 4) {
        if (p.rows == 1 && p.vec) {
            const u32 pos = attn_pos(p, row);
            const u32 len = attn_part_len(p, pos);
            const u32 b = part * len;
            const u32 e = pos + 1 - b < len ? pos + 1 : b + len;
            if (b <= pos && attn_pre_fits<D>(d / D::V, e - b)) {
                const u64 hoff = (u64)hd.kvh * d * D::SIZE + attn_slot_off(p, row, D::SIZE);
                const u8* kh = (const u8*)p.k + hoff;
                const u8* vh = (const u8*)p.v + hoff;
                AttnPre<D> pre = {};
                attn_preload<D, false>(p, kh, vh, b, e - b, 0u, pos, pre);
                tp_pdl_wait();
                attn_preload<D, true>(p, kh, vh, b, e - b, pos, pos + 1, pre);
                attn_load_q<G>(p, sm, row, hd.h0, hd.gcount);
                __syncthreads();
                attn_split<D, G, true, true>(p, sm, kh, vh, b, e - b, pre);
                attn_write_partial<G>(p, sm, run, hd, part, row, false);
                return;
            }
        }
    }
    tp_pdl_wait();
    const u32 pos = attn_pos(p, row);
    const u32 len = attn_part_len(p, pos);
    const u32 b = part * len;
    if (b > pos) {
        // Nothing to see here (the whole block takes this branch): an empty partial.
        if (threadIdx.x < hd.gcount) {
            float* w = (float*)p.ws + attn_partial_at(p, hd.h0 + threadIdx.x, part, row);
            w[0] = attn_neg_inf();
            w[1] = 0.0f;
        }
        return;
    }
    const u32 e = pos + 1 - b < len ? pos + 1 : b + len;
    attn_load_q<G>(p, sm, row, hd.h0, hd.gcount);
    __syncthreads();
    const u64 hoff = (u64)hd.kvh * d * D::SIZE + attn_slot_off(p, row, D::SIZE);
    const bool in_run = attn_range<D, G>(p, sm, run, (const u8*)p.k + hoff, (const u8*)p.v + hoff, b, e);
    attn_write_partial<G>(p, sm, run, hd, part, row, in_run);
}

// Grid (heads, rows), TP_ATTN_MERGE_THREADS threads: out[row, h] from the partials of the
// parts that hold positions 0 ..= pos[row] (the merge rule at the top of this file). Thread j
// owns output element j; the weights e^(m_i - m) of up to TP_ATTN_MERGE_THREADS parts at a
// time are computed once into shared memory. Reads used * (d + 2) f32, writes d f32: small
// next to the split kernel's K/V traffic.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_ATTN_MERGE_THREADS, 1) attn_merge(AttnParams p) {
    __shared__ float wt[TP_ATTN_MERGE_THREADS];
    __shared__ float red[TP_ATTN_MERGE_THREADS / TP_WAVE];
    const u32 h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const u32 d = p.head_dim;
    const u64 stride = (u64)d + 2;
    // The position is step state, written before the step: read before the wait, so that
    // the partials' loads are the only round trip after it.
    const u32 pos = attn_pos(p, row);
    const u32 used = pos / attn_part_len(p, pos) + 1;
    tp_pdl_wait();
    const float* part = (const float*)p.ws + attn_partial_at(p, h, 0, row);
    float m = attn_neg_inf();
    for (u32 i = tid; i < used; i += TP_ATTN_MERGE_THREADS) m = fmaxf(m, part[i * stride]);
    m = attn_wave_max(m);
    if (tid % TP_WAVE == 0) red[tid / TP_WAVE] = m;
    __syncthreads();
    m = red[0];
    for (u32 w = 1; w < TP_ATTN_MERGE_THREADS / TP_WAVE; ++w) m = fmaxf(m, red[w]);
    float o = 0.0f, l = 0.0f;
    for (u32 c0 = 0; c0 < used; c0 += TP_ATTN_MERGE_THREADS) {
        const u32 cn = used - c0 < TP_ATTN_MERGE_THREADS ? used - c0 : TP_ATTN_MERGE_THREADS;
        if (tid < cn) wt[tid] = expf(part[(c0 + tid) * stride] - m);
        __syncthreads();
        for (u32 i = 0; i < cn; ++i) {
            const float* pi = part + (c0 + i) * stride;
            const float w = wt[i];
            l += w * pi[1];  // every thread sums l the same way, in part order
            if (tid < d) o += w * pi[2 + tid];
        }
        __syncthreads();
    }
    if (tid < d) attn_put(p, ((u64)row * p.heads + h) * d + tid, o / l);
}

// Grid (kv_heads * chunks, rows), TP_ATTN_THREADS threads, no workspace: one block walks all
// of its row's positions (attn_range). Reads the same bytes as the split kernel, but with
// rows * kv_heads * chunks blocks only: for prefill and tests, not for long decode.
template <class D, int G>
TP_DEV void attn_single_kernel(const AttnParams& p, AttnSmem<G>& sm, AttnRun<G>& run) {
    const AttnHeads hd = attn_heads(p);
    const u32 row = blockIdx.y, tid = threadIdx.x;
    const u32 pos = attn_pos(p, row);
    const u32 d = p.head_dim;
    attn_load_q<G>(p, sm, row, hd.h0, hd.gcount);
    __syncthreads();
    const u64 hoff = (u64)hd.kvh * d * D::SIZE + attn_slot_off(p, row, D::SIZE);
    const bool in_run = attn_range<D, G>(p, sm, run, (const u8*)p.k + hoff, (const u8*)p.v + hoff, 0, pos + 1);
    const float* l = in_run ? run.l : sm.l;
    for (u32 i = tid; i < hd.gcount * d; i += TP_ATTN_THREADS) {
        const u32 g = i / d, j = i % d;
        attn_put(p, ((u64)row * p.heads + hd.h0 + g) * d + j, (in_run ? run.o[g][j] : sm.o[g][j]) / l[g]);
    }
}

// The kernels, one per (kind, heads per block G, KV dtype); names spelled out so that the
// Rust table (ops_attention.rs NAMES) can be checked against this file. Two blocks per SM:
// registers capped at 128 per thread.
#define TP_ATTN_SPLIT_KERNEL(NAME, D, G)                                                       \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_ATTN_THREADS, 2) NAME(AttnParams p) {       \
        __shared__ AttnSmem<G> sm;                                                             \
        __shared__ AttnRun<G> run;                                                             \
        attn_split_kernel<D, G>(p, sm, run); /* calls tp_pdl_wait */                           \
    }
#define TP_ATTN_SINGLE_KERNEL(NAME, D, G)                                                      \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_ATTN_THREADS, 2) NAME(AttnParams p) { tp_pdl_wait();       \
        __shared__ AttnSmem<G> sm;                                                             \
        __shared__ AttnRun<G> run;                                                             \
        attn_single_kernel<D, G>(p, sm, run);                                                  \
    }

TP_ATTN_SPLIT_KERNEL(attn_split_g1_f32, F32, 1)
TP_ATTN_SPLIT_KERNEL(attn_split_g1_f16, F16, 1)
TP_ATTN_SPLIT_KERNEL(attn_split_g1_bf16, BF16, 1)
TP_ATTN_SPLIT_KERNEL(attn_split_g2_f32, F32, 2)
TP_ATTN_SPLIT_KERNEL(attn_split_g2_f16, F16, 2)
TP_ATTN_SPLIT_KERNEL(attn_split_g2_bf16, BF16, 2)
TP_ATTN_SPLIT_KERNEL(attn_split_g4_f32, F32, 4)
TP_ATTN_SPLIT_KERNEL(attn_split_g4_f16, F16, 4)
TP_ATTN_SPLIT_KERNEL(attn_split_g4_bf16, BF16, 4)
TP_ATTN_SPLIT_KERNEL(attn_split_g8_f32, F32, 8)
TP_ATTN_SPLIT_KERNEL(attn_split_g8_f16, F16, 8)
TP_ATTN_SPLIT_KERNEL(attn_split_g8_bf16, BF16, 8)
TP_ATTN_SINGLE_KERNEL(attn_single_g1_f32, F32, 1)
TP_ATTN_SINGLE_KERNEL(attn_single_g1_f16, F16, 1)
TP_ATTN_SINGLE_KERNEL(attn_single_g1_bf16, BF16, 1)
TP_ATTN_SINGLE_KERNEL(attn_single_g2_f32, F32, 2)
TP_ATTN_SINGLE_KERNEL(attn_single_g2_f16, F16, 2)
TP_ATTN_SINGLE_KERNEL(attn_single_g2_bf16, BF16, 2)
TP_ATTN_SINGLE_KERNEL(attn_single_g4_f32, F32, 4)
TP_ATTN_SINGLE_KERNEL(attn_single_g4_f16, F16, 4)
TP_ATTN_SINGLE_KERNEL(attn_single_g4_bf16, BF16, 4)
TP_ATTN_SINGLE_KERNEL(attn_single_g8_f32, F32, 8)
TP_ATTN_SINGLE_KERNEL(attn_single_g8_f16, F16, 8)
TP_ATTN_SINGLE_KERNEL(attn_single_g8_bf16, BF16, 8)

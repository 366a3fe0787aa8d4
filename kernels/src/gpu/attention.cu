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

// Arguments of every kernel here, by value. 7 * 8 + 12 * 4 = 104 bytes.
struct AttnParams {
    u64 q;         // [rows, heads, head_dim] f32
    u64 k;         // [cap, kv_heads, head_dim] KV dtype
    u64 v;         // [cap, kv_heads, head_dim] KV dtype
    u64 out;       // [rows, heads, head_dim] f32
    u64 pos;       // [rows] u32
    u64 ws;        // f32 workspace (split kernels and attn_merge only)
    u64 slots;     // [rows] u32 cache slot of each row (ops::CacheSlots), or 0: one sequence
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

// The partial state of keys t0 .. t0 + n (1 <= n <= TP_ATTN_SPLIT) for the block's G heads:
// sm.m[g], sm.l[g], sm.o[g][0..d). `kh`, `vh`: this KV head's slice of cache row 0; rows are
// kv_heads * d elements apart. Needs sm.q loaded and a barrier after it; ends with a barrier.
//
// Memory: every K and V element of the split once (2 * n * d * size bytes), in 16-byte loads
// when VEC, eight per thread in flight (32 KiB per block, 64 KiB per SM at two blocks).
template <class D, int G, bool VEC>
TP_DEV void attn_split(const AttnParams& p, AttnSmem<G>& sm, const u8* kh, const u8* vh, u32 t0, u32 n) {
    const u32 d = p.head_dim;
    const u32 npacks = (d + D::V - 1) / D::V;  // packs of V elements per row
    const u64 stride = (u64)p.kv_heads * d * D::SIZE;
    const u32 tid = threadIdx.x;

    // 1. Scores. `kl` lanes share a key (adjacent lanes, 16 * kl contiguous bytes per load
    // instruction and key, so a warp touches 32 / kl rows instead of 32), each summing the
    // packs c = sub, sub + kl, ...; then a butterfly over the kl lanes. More lanes per key
    // would cost G shuffles per key and halving; fewer would scatter a warp's loads over more
    // rows. Each lane takes KPL keys per step, all their loads issued before any is used:
    // a block is a chain of dependent load rounds, and with a small grid (short sequences,
    // few KV heads per rank) its latency is the kernel's.
    constexpr int KPL = 2;
    const u32 kl = npacks >= 4 ? 4u : (npacks >= 2 ? 2u : 1u);
    const u32 sub = tid % kl;
    const u32 lane_keys = TP_ATTN_THREADS / kl;  // keys per step and u
    for (u32 base = 0; base < n; base += KPL * lane_keys) {
        u32 ki[KPL];
        float dot[KPL][G];
#pragma unroll
        for (int u = 0; u < KPL; ++u) {
            ki[u] = base + tid / kl + (u32)u * lane_keys;
#pragma unroll
            for (int g = 0; g < G; ++g) dot[u][g] = 0.0f;
        }
        if constexpr (VEC) {
            for (u32 c0 = sub; c0 < npacks; c0 += 4 * kl) {
                V16 raw[KPL][4] = {};
#pragma unroll
                for (int u = 0; u < KPL; ++u) {
                    const u8* row = kh + (u64)(t0 + ki[u]) * stride;
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const u32 c = c0 + (u32)x * kl;
                        if (ki[u] < n && c < npacks) raw[u][x] = *(const V16*)(row + (u64)c * 16);
                    }
                }
#pragma unroll
                for (int u = 0; u < KPL; ++u) {
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const u32 c = c0 + (u32)x * kl;
                        if (ki[u] < n && c < npacks) {
                            float kf[D::V];
                            D::unpack(raw[u][x], kf);
                            attn_dot_pack<D, G>(sm, c, kf, dot[u]);
                        }
                    }
                }
            }
        } else {
#pragma unroll
            for (int u = 0; u < KPL; ++u) {
                if (ki[u] < n) {
                    const u8* row = kh + (u64)(t0 + ki[u]) * stride;
                    for (u32 c = sub; c < npacks; c += kl) {
                        float kf[D::V];
                        attn_load_scalar<D>(row, c, d, kf);
                        attn_dot_pack<D, G>(sm, c, kf, dot[u]);
                    }
                }
            }
        }
        // kl divides the wavefront and the key groups are aligned, so the butterfly stays
        // inside a group; every lane takes part (kl is the same in the whole block).
        for (u32 m = 1; m < kl; m *= 2) {
#pragma unroll
            for (int u = 0; u < KPL; ++u)
#pragma unroll
                for (int g = 0; g < G; ++g) dot[u][g] += tp_shfl_xor(dot[u][g], (int)m);
        }
        if (sub == 0) {
#pragma unroll
            for (int u = 0; u < KPL; ++u) {
                if (ki[u] < n) {
#pragma unroll
                    for (int g = 0; g < G; ++g) sm.s[g][ki[u]] = dot[u][g] * p.scale;
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

    // 3. o[g] = sum_i e_i v_i. `np` adjacent lanes read one V row (all of it when it has at
    // most TP_WAVE packs, else CPL packs each: f32 rows of more than 128 elements on a
    // 32-wide wave); the block's TP_ATTN_THREADS / np row slices take every nslices-th key,
    // U keys per step with their loads issued first (U * CPL = 8 loads of 16 bytes in flight
    // per thread; more would not fit two blocks' registers per SM next to G = 8's 64
    // accumulators).
    constexpr int CPL = D::V == 4 ? 2 : 1;  // f32: up to 64 packs; f16/bf16: up to 32
    constexpr int U = 8 / CPL;
    u32 np = 1;
    while (np < npacks && np < (u32)TP_WAVE) np *= 2;
    const u32 col = tid % np, slice = tid / np, nslices = TP_ATTN_THREADS / np;
    float acc[CPL][G][D::V];
#pragma unroll
    for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int j = 0; j < D::V; ++j) acc[cc][g][j] = 0.0f;
    for (u32 i0 = slice; i0 < n; i0 += (u32)U * nslices) {
        if constexpr (VEC) {
            V16 raw[U][CPL] = {};
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = i0 + (u32)u * nslices;
#pragma unroll
                for (int cc = 0; cc < CPL; ++cc) {
                    const u32 c = col + (u32)cc * np;
                    if (i < n && c < npacks) raw[u][cc] = *(const V16*)(vh + (u64)(t0 + i) * stride + (u64)c * 16);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = i0 + (u32)u * nslices;
                if (i < n) {
#pragma unroll
                    for (int cc = 0; cc < CPL; ++cc) {
                        if (col + (u32)cc * np < npacks) {
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
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = i0 + (u32)u * nslices;
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
    if (e - b <= TP_ATTN_SPLIT) {
        if (p.vec) {
            attn_split<D, G, true>(p, sm, kh, vh, b, e - b);
        } else {
            attn_split<D, G, false>(p, sm, kh, vh, b, e - b);
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
            attn_split<D, G, true>(p, sm, kh, vh, t0, n);
        } else {
            attn_split<D, G, false>(p, sm, kh, vh, t0, n);
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
    const u32 pos = attn_pos(p, row);
    const u32 len = attn_part_len(p, pos);
    const u32 b = part * len;
    const u32 d = p.head_dim;
    float* ws = (float*)p.ws;
    const u64 stride = (u64)d + 2;
    const u64 first = (((u64)row * p.heads + hd.h0) * p.parts + part) * stride;
    const u64 head_step = (u64)p.parts * stride;  // from head h to h + 1
    if (b > pos) {
        // Nothing to see here (the whole block takes this branch): an empty partial.
        if (threadIdx.x < hd.gcount) {
            float* w = ws + first + threadIdx.x * head_step;
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
    const float* m = in_run ? run.m : sm.m;
    const float* l = in_run ? run.l : sm.l;
    for (u32 i = threadIdx.x; i < hd.gcount * (u32)stride; i += TP_ATTN_THREADS) {
        const u32 g = i / (u32)stride, j = i % (u32)stride;
        ws[first + g * head_step + j] = j == 0 ? m[g] : (j == 1 ? l[g] : (in_run ? run.o[g][j - 2] : sm.o[g][j - 2]));
    }
}

// Grid (heads, rows), TP_ATTN_MERGE_THREADS threads: out[row, h] from the partials of the
// parts that hold positions 0 ..= pos[row] (the merge rule at the top of this file). Thread j
// owns output element j; the weights e^(m_i - m) of up to TP_ATTN_MERGE_THREADS parts at a
// time are computed once into shared memory. Reads used * (d + 2) f32, writes d f32: small
// next to the split kernel's K/V traffic.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_ATTN_MERGE_THREADS, 1) attn_merge(AttnParams p) { tp_pdl_wait();
    __shared__ float wt[TP_ATTN_MERGE_THREADS];
    __shared__ float red[TP_ATTN_MERGE_THREADS / TP_WAVE];
    const u32 h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const u32 d = p.head_dim;
    const u64 stride = (u64)d + 2;
    const u32 pos = attn_pos(p, row);
    const u32 used = pos / attn_part_len(p, pos) + 1;
    const float* part = (const float*)p.ws + ((u64)row * p.heads + h) * p.parts * stride;
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
    if (tid < d) ((float*)p.out)[((u64)row * p.heads + h) * d + tid] = o / l;
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
    float* out = (float*)p.out;
    for (u32 i = tid; i < hd.gcount * d; i += TP_ATTN_THREADS) {
        const u32 g = i / d, j = i % d;
        out[((u64)row * p.heads + hd.h0 + g) * d + j] = (in_run ? run.o[g][j] : sm.o[g][j]) / l[g];
    }
}

// The kernels, one per (kind, heads per block G, KV dtype); names spelled out so that the
// Rust table (ops_attention.rs NAMES) can be checked against this file. Two blocks per SM:
// registers capped at 128 per thread.
#define TP_ATTN_SPLIT_KERNEL(NAME, D, G)                                                       \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_ATTN_THREADS, 2) NAME(AttnParams p) { tp_pdl_wait();       \
        __shared__ AttnSmem<G> sm;                                                             \
        __shared__ AttnRun<G> run;                                                             \
        attn_split_kernel<D, G>(p, sm, run);                                                   \
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

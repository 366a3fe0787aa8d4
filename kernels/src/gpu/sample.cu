// sample.cu: on-device sampling, the last two ops of the captured decode step:
// `Op::ShardTopK` (this rank's best k logits as (logit, id) pairs) and `Op::Sample` (the next
// token from every shard's pairs; advances the step state).
//
// CPU twins: kernels/src/cpu/ops/decode.rs `shard_topk`, `pick`, `sample`; `pick` is mirrored
// here step by step (same f32 operations in the same order), so greedy picks are bit-identical
// and sampled picks differ only where expf's last bit differs from the host's and moves a
// boundary past the uniform draw. Rust mirrors of the parameter structs and constants:
// kernels/src/cuda/ops_sample.rs.
//
// Both kernels order candidates by one u64 key (topk_key) whose integer order is decode.rs's
// `better` order, so ties, signed zeros and NaN need no special cases past the key.

#include "elem.h"

// Threads of shard_topk and sample: one block of the largest size every target allows
// (1024 on NVIDIA and AMD), since each op is a single block (the shard's scan must end in one
// place, and launches must need no scratch memory).
#define TP_TOPK_THREADS 1024
// ops::TOPK_MAX: most pairs per shard, and most candidates sampling considers.
#define TP_TOPK_MAX 64
// Candidates shard_topk's k > 1 path gathers in shared memory (16 KiB of keys); more, and it
// falls back to k argmax passes. Typical logits need about k (see shard_topk).
#define TP_TOPK_CAP 2048
// Most pairs Sample reads: ops::TOPK_MAX * comm::MAX_WORLD (32 KiB of keys).
#define TP_SAMPLE_MAX_CANDS 4096

// shard_topk's arguments. 32 bytes.
struct TopkParams {
    u64 logits;       // [n] f32
    u64 out;          // [2k] f32 pairs
    u32 n;
    u32 vocab_start;  // id of logits[0]
    u32 k;            // 1 ..= TP_TOPK_MAX
    u32 vec;          // 1 when `logits` is 16-byte aligned
};

// sample's arguments. 56 bytes.
struct SampleParams {
    u64 cands;        // [2 * ncands] f32 pairs
    u64 state;        // [2] u32 (token, position)
    u64 tokens;       // [tokens_len] u32
    u64 tokens_len;
    u64 seed;
    u32 ncands;       // pairs, <= TP_SAMPLE_MAX_CANDS
    float temperature;
    u32 top_k;
    float top_p;
};

// ---- keys -------------------------------------------------------------------------------
// (logit, id) as a u64 whose integer order is decode.rs's `better` (larger logit, then lower
// id): the high word is the logit's bits made monotonic (negative values bit-flipped, the sign
// bit set on the others; -0 taken as +0, since `better`'s == treats them alike), the low word
// ~id. NaN is key 0, below every real key (ord(-inf) << 32 > 0), so it is never chosen.
TP_DEV u64 topk_key(float l, u32 id) {
    if (l != l) return 0;
    const u32 b = l == 0.0f ? 0u : tp_f32_bits(l);
    const u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(~id);
}
TP_DEV u32 topk_key_id(u64 key) { return ~(u32)key; }
// The logit of a key (a zero comes back as +0).
TP_DEV float topk_key_logit(u64 key) {
    const u32 o = (u32)(key >> 32);
    return tp_f32_from_bits((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// A u64 through the float shuffle: shuffles move 32-bit registers bit for bit, so the float
// view of a word (a NaN pattern included) comes back unchanged.
TP_DEV u64 topk_shfl_xor(u64 v, int m) {
    const u32 lo = tp_f32_bits(tp_shfl_xor(tp_f32_from_bits((u32)v), m));
    const u32 hi = tp_f32_bits(tp_shfl_xor(tp_f32_from_bits((u32)(v >> 32)), m));
    return ((u64)hi << 32) | lo;
}

// Largest v over the block (every thread gets it). `red`: blockDim / TP_WAVE words of shared
// memory, free on entry; the barrier in front keeps a previous call's readers safe.
TP_DEV u64 topk_block_max(u64 v, u64* red) {
#pragma unroll
    for (int m = TP_WAVE / 2; m > 0; m /= 2) {
        const u64 o = topk_shfl_xor(v, m);
        v = o > v ? o : v;
    }
    __syncthreads();
    if (threadIdx.x % TP_WAVE == 0) red[threadIdx.x / TP_WAVE] = v;
    __syncthreads();
    u64 r = 0;
    for (u32 w = 0; w < blockDim.x / TP_WAVE; ++w) r = red[w] > r ? red[w] : r;
    return r;
}

// Sorts a[0 .. size) descending (size a power of two) with a bitonic network, every thread of
// the block taking the compare-exchanges i < i ^ j of each stage. Barriers before and after.
TP_DEV void topk_sort_desc(u64* a, u32 size) {
    __syncthreads();
    for (u32 k = 2; k <= size; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < size; i += blockDim.x) {
                const u32 x = i ^ j;
                if (x > i) {
                    const u64 ai = a[i], ax = a[x];
                    // Runs with (i & k) == 0 come out descending, the others ascending, so that
                    // the next merge sees bitonic sequences; k == size sorts it all descending.
                    const bool desc = (i & k) == 0;
                    if (desc ? ai < ax : ai > ax) {
                        a[i] = ax;
                        a[x] = ai;
                    }
                }
            }
            __syncthreads();
        }
    }
}

TP_DEV u32 topk_pow2(u32 n) {
    u32 s = 1;
    while (s < n) s <<= 1;
    return s;
}

// ---- shard_topk -------------------------------------------------------------------------
// Calls f(i, logits[i]) for this thread's elements: with 16-byte loads, packs t, t + T, ...
// (T threads), eight in flight per thread, then the tail one by one. Each thread sees its
// elements in increasing i.
template <class F>
TP_DEV void topk_scan(const TopkParams& p, F f) {
    const float* x = (const float*)p.logits;
    const u32 t = blockDim.x;
    u32 done = 0;
    if (p.vec) {
        const u32 packs = p.n / 4;
        for (u32 k0 = threadIdx.x; k0 < packs; k0 += 8 * t) {
            V16 v[8] = {};
#pragma unroll
            for (u32 u = 0; u < 8; ++u)
                if (k0 + u * t < packs) v[u] = ((const V16*)x)[k0 + u * t];
#pragma unroll
            for (u32 u = 0; u < 8; ++u) {
                if (k0 + u * t < packs) {
#pragma unroll
                    for (u32 j = 0; j < 4; ++j) f((k0 + u * t) * 4 + j, tp_f32_from_bits(v[u].w[j]));
                }
            }
        }
        done = packs * 4;
    }
    for (u32 i = done + threadIdx.x; i < p.n; i += t) f(i, x[i]);
}

// ops::NO_TOKEN: Sample's token when a candidate logit is NaN (a row that was not finite).
#define TP_NO_TOKEN 0xffffffffu
// ops::NAN_BITS: the NaN shard_topk writes as pair 0's logit of a row that is not finite.
#define TP_NAN_BITS 0x7fc00000u

// True for NaN and ±inf: the floats whose exponent bits are all ones.
TP_DEV bool topk_not_finite(float l) { return (tp_f32_bits(l) & 0x7f800000u) == 0x7f800000u; }

// Writes pair r of `out`: (the logit as stored, id) for a key, (-inf, 0) for key 0. The logit
// is read back from `logits` so that its bits (a -0 included) are the input's.
TP_DEV void topk_write(const TopkParams& p, u32 r, u64 key) {
    float* out = (float*)p.out;
    if (key == 0) {
        out[2 * r] = tp_f32_from_bits(0xff800000u);
        out[2 * r + 1] = 0.0f;
    } else {
        const u32 id = topk_key_id(key);
        out[2 * r] = ((const float*)p.logits)[id - p.vocab_start];
        out[2 * r + 1] = (float)id;
    }
}

// One block of TP_TOPK_THREADS. Reads the shard's n logits once for k = 1 (128256 f32 = 501
// KiB, just written by the LM head, so mostly from L2; latency-bound in one SM, not a
// bandwidth kernel), twice for k > 1, 1 + k times in the fallback. Measured on an H200 with
// eager launches (host launch time included), n = 128256: 8 us for k = 1, 24-28 us for
// k = 8 and 64, 1.1 ms for the fallback (k = 64 on adversarial logits).
//
// k = 1: each thread keeps its best element (`l > best`: its elements come in increasing
// id order, so the first of equal logits stays, and NaN never compares greater), then a
// block-wide max of the keys.
//
// k > 1: tau = the k-th best of the per-thread bests (a bitonic sort of 1024 keys). At least
// k elements reach tau (those k threads' bests), so the top k are among the elements >= tau;
// they are gathered into shared memory and sorted. How many reach tau depends on the data:
// at most k threads' worth, so about k for logits in no particular order, but a shard whose
// large logits all sit in a few threads' packs can exceed TP_TOPK_CAP; then k block-wide
// argmax passes, each for the best key below the previous pick, do it instead (always
// right, 1 + k reads). When fewer than k threads saw a real logit, tau is 0 and every
// non-NaN logit is gathered.
//
// A row with any NaN or ±inf (seen in the first scan, then one block-wide OR) gets pair 0's
// logit replaced by NaN, written by thread 0 after its own pair-0 write on every path: the
// mark Sample turns into TP_NO_TOKEN (ops::ShardTopK).
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_TOPK_THREADS, 1) shard_topk(TopkParams p) { tp_pdl_wait();
    __shared__ u64 buf[TP_TOPK_CAP];
    __shared__ u64 red[TP_TOPK_THREADS / 32];  // per wavefront; 32 is the narrowest wave
    __shared__ u32 count;
    const u32 tid = threadIdx.x;

    float best = tp_f32_from_bits(0xff800000u);
    u32 at = 0xffffffffu;  // no element > -inf seen yet
    bool bad = false;      // a NaN or ±inf among this thread's elements
    topk_scan(p, [&](u32 i, float l) {
        bad |= topk_not_finite(l);
        if (l > best) {
            best = l;
            at = i;
        }
    });
    // Every thread reaches this barrier (the scan has no early exit).
    const bool row_bad = __syncthreads_or(bad) != 0;
    if (at == 0xffffffffu) {
        // Only -inf and NaN here: the first -inf is this thread's best, if any (rare: a
        // shard of -inf logits).
        topk_scan(p, [&](u32 i, float l) {
            if (at == 0xffffffffu && l == best) at = i;
        });
    }
    const u64 mine = at == 0xffffffffu ? 0 : topk_key(best, p.vocab_start + at);
    if (p.k == 1) {
        const u64 top = topk_block_max(mine, red);
        if (tid == 0) {
            topk_write(p, 0, top);
            if (row_bad) ((float*)p.out)[0] = tp_f32_from_bits(TP_NAN_BITS);
        }
        return;
    }

    // tau: the k-th best thread best (k <= TP_TOPK_MAX < TP_TOPK_THREADS <= TP_TOPK_CAP).
    buf[tid] = mine;
    topk_sort_desc(buf, TP_TOPK_THREADS);
    const u64 tau = buf[p.k - 1];
    if (tid == 0) count = 0;
    __syncthreads();  // tau read by all before buf is reused
    const float tau_l = tau == 0 ? tp_f32_from_bits(0xff800000u) : topk_key_logit(tau);
    topk_scan(p, [&](u32 i, float l) {
        // l >= tau_l first: cheap, and false for NaN.
        if (l >= tau_l) {
            const u64 key = topk_key(l, p.vocab_start + i);
            if (key >= tau) {
                const u32 s = atomicAdd(&count, 1u);
                if (s < TP_TOPK_CAP) buf[s] = key;
            }
        }
    });
    __syncthreads();
    const u32 c = count;
    if (c <= TP_TOPK_CAP) {
        const u32 size = topk_pow2(c == 0 ? 1 : c);
        for (u32 i = c + tid; i < size; i += blockDim.x) buf[i] = 0;
        topk_sort_desc(buf, size);
        for (u32 r = tid; r < p.k; r += blockDim.x) topk_write(p, r, r < c ? buf[r] : 0);
        // Pair 0 is thread 0's own (r = tid = 0 above), so no barrier is needed before this.
        if (tid == 0 && row_bad) ((float*)p.out)[0] = tp_f32_from_bits(TP_NAN_BITS);
        return;
    }
    // Fallback: pick r is the best key below pick r - 1 (keys are distinct: ids differ).
    u64 prev = ~0ull;
    for (u32 r = 0; r < p.k; ++r) {
        u64 b = 0;
        topk_scan(p, [&](u32 i, float l) {
            const u64 key = topk_key(l, p.vocab_start + i);
            if (key < prev && key > b) b = key;
        });
        b = topk_block_max(b, red);
        if (tid == 0) topk_write(p, r, b);
        prev = b;  // 0 once the shard is used up: every later pick is 0 too, a pad
    }
    if (tid == 0 && row_bad) ((float*)p.out)[0] = tp_f32_from_bits(TP_NAN_BITS);
}

// ---- sample -----------------------------------------------------------------------------
// ops::sample_uniform, bit for bit: splitmix64 (Steele, Lea, Flood 2014; the published
// constants) of seed ^ position * phi, top 24 bits scaled to [0, 1) (exact in f32).
TP_DEV float sample_uniform(u64 seed, u32 position) {
    u64 z = seed ^ ((u64)position * 0x9e3779b97f4a7c15ull);
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(u32)(z >> 40) * (1.0f / 16777216.0f);
}

// `pair[1] as u32` (Rust): truncation, saturating at 0 and 2^32 - 1, NaN to 0. Spelled out
// because C++ leaves out-of-range conversions undefined. Ids are whole numbers below 2^24.
TP_DEV u32 sample_id(float f) {
    if (!(f >= 0.0f)) return 0;
    if (f >= 4294967296.0f) return 0xffffffffu;
    return (u32)f;
}

// One block of TP_TOPK_THREADS. Reads at most 4096 pairs (32 KiB), writes three u32.
// The block builds the keys of the valid pairs (logit > -inf: padding dropped, as `pick`
// filters), sorts them best first (bitonic, in shared memory), computes the weights of
// the best TP_TOPK_MAX in parallel, and thread 0 runs the order-dependent rest of `pick`,
// then advances the state. A NaN logit among the pairs (a row that was not finite; one
// block-wide OR) makes the token TP_NO_TOKEN, as `pick` returns.
extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_TOPK_THREADS, 1) sample(SampleParams p) { tp_pdl_wait();
    __shared__ u64 keys[TP_SAMPLE_MAX_CANDS];
    __shared__ float w[TP_TOPK_MAX];
    const float* cands = (const float*)p.cands;
    const u32 size = topk_pow2(p.ncands == 0 ? 1 : p.ncands);
    bool nan = false;
    for (u32 i = threadIdx.x; i < size; i += blockDim.x) {
        u64 key = 0;
        if (i < p.ncands) {
            const float l = cands[2 * i];
            nan |= l != l;
            if (l > tp_f32_from_bits(0xff800000u)) key = topk_key(l, sample_id(cands[2 * i + 1]));
        }
        keys[i] = key;
    }
    // Every thread reaches this barrier (the loop has no early exit).
    const bool any_nan = __syncthreads_or(nan) != 0;
    topk_sort_desc(keys, size);

    // pick(cands, params, next). Thread 0 counts the valid candidates (best first, up to
    // TP_TOPK_MAX) and k; the first k threads compute the weights, each exactly as the
    // CPU's loop body does; thread 0 then runs the order-dependent sums.
    __shared__ u32 shared_k;
    u32 valid = 0, k = 0;
    const bool greedy = p.temperature <= 0.0f || p.top_k == 1;
    if (threadIdx.x == 0) {
        while (valid < TP_TOPK_MAX && valid < size && keys[valid] != 0) ++valid;
        k = p.top_k == 0 ? (u32)TP_TOPK_MAX : (p.top_k < TP_TOPK_MAX ? p.top_k : (u32)TP_TOPK_MAX);
        k = k < valid ? k : valid;
        shared_k = greedy ? 0 : k;
    }
    __syncthreads();
    if (threadIdx.x < shared_k) {
        // Unnormalised probabilities relative to the best.
        w[threadIdx.x] = expf((topk_key_logit(keys[threadIdx.x]) - topk_key_logit(keys[0])) / p.temperature);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;

    u32* state = (u32*)p.state;
    const u32 next = state[1] + 1u;  // wraps as decode.rs's wrapping_add
    u32 token;
    if (any_nan) {
        token = TP_NO_TOKEN;
    } else if (valid == 0) {
        token = 0;
    } else if (greedy) {
        token = topk_key_id(keys[0]);
    } else {
        // Summed in order in f32.
        float total = 0.0f;
        for (u32 i = 0; i < k; ++i) total += w[i];
        // Nucleus: the shortest prefix whose share reaches top_p (at least one).
        u32 kept = 0;
        float mass = 0.0f;
        while (kept < k) {
            mass += w[kept];
            kept += 1;
            if (mass >= p.top_p * total) break;
        }
        const float r = sample_uniform(p.seed, next) * mass;
        float acc = 0.0f;
        token = topk_key_id(keys[kept - 1]);
        for (u32 i = 0; i < kept; ++i) {
            acc += w[i];
            if (r < acc) {
                token = topk_key_id(keys[i]);
                break;
            }
        }
    }
    state[0] = token;
    state[1] = next;
    if ((u64)next < p.tokens_len) ((u32*)p.tokens)[next] = token;
}

// For selftest only: out[i] = sample_uniform(seeds[i], positions[i]), so that the twin test
// can compare the device's splitmix64 with ops::sample_uniform over many inputs at once.
// Grid-stride, any grid. 32 bytes of arguments.
struct UniformProbeParams {
    u64 seeds;      // [n] u64
    u64 positions;  // [n] u32
    u64 out;        // [n] f32
    u64 n;
};
extern "C" __global__ void TP_LAUNCH_BOUNDS(256, 1) sample_uniform_probe(UniformProbeParams p) { tp_pdl_wait();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
        ((float*)p.out)[i] = sample_uniform(((const u64*)p.seeds)[i], ((const u32*)p.positions)[i]);
    }
}

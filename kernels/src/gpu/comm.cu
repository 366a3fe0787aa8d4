// comm.cu: the peer-buffer allreduce kernels, `oneshot` and `twoshot` (Op::Allreduce).
//
// CPU twin: kernels/src/cpu/allreduce.rs. Same buffer layout (kernels/src/comm.rs): a signal
// area, then data slots 0 and 1; call `epoch` uses slot epoch % 2. What the GPU adds, and the
// Rust side mirrors in kernels/src/cuda/launch.rs (with compile-time checks):
//
// Signal area of each rank's comm buffer (GPU backends; the CPU backend's 8 KiB of
// (phase, sender) lines at 0..8192 are left unused so an offset never has two meanings):
//
//   8192            u32 epoch   the last epoch this rank completed (device-resident counter)
//   8192 + 64       u32 done    blocks of the running launch that have finished (own line:
//                               every block hits it with an atomic at its end)
//   8192 + 128 + ((phase * MAX_BLOCKS + block) * MAX_WORLD + sender) * 4
//                   u32 flag    raised by `sender`'s block `block` in this (the receiver's)
//                               area by storing the epoch; 2 * 128 * 64 * 4 = 64 KiB
//
// Flags are per block: block b of every rank handles the same packs in every phase (the
// split depends only on n, world and the grid size, which all ranks compute alike), so block
// b waits only for the peers' blocks b, never for a whole peer grid: no grid-wide barrier.
// A sender's flags for one block sit next to the other senders' (256 bytes per block):
// the receiver's polling threads read one contiguous run, and GPUs write with byte masks,
// so neighbouring senders do not clobber each other (the CPU backend needs 64-byte lines).
//
// Where the epoch comes from (graph capture): the kernel reads it from the device-resident
// counter in its own signal area (counter + 1) and the last block to finish advances the
// counter, so a captured launch replays with a fresh epoch every time. The host still passes
// AllreduceArgs::epoch; when it is non-zero the kernel checks it equals the device epoch and
// reports a mismatch (the host turns that into KernelError::Invalid); the host passes 0 while
// the stream is being captured. The counter starts at 0 because shared buffers are zeroed,
// so the first call is epoch 1, as comm.rs specifies.
//
// Waits are bounded: a thread that polls a flag longer than timeout_ns writes the peer and the
// epoch into the host-mapped error words and stops waiting (the results are then garbage, and
// the host reports KernelError::Timeout after the stream synchronises). Every poller also
// gives up when it sees that another one already reported, so a failed call ends in about one
// timeout, not one per block.

#include "elem.h"

#define TP_SIGNAL_BYTES (256ull * 1024ull)
#define TP_MAX_WORLD 64
// Most blocks one allreduce launch uses: flags for 2 phases x 128 blocks x 64 senders fill
// 64 KiB of the 256 KiB signal area, and 128 is about one block per SM on an H100/H200
// (132 SMs), past which more blocks only add flag traffic.
#define TP_MAX_BLOCKS 128
#define TP_SIG_EPOCH 8192u
#define TP_SIG_DONE (8192u + 64u)
#define TP_SIG_FLAGS (8192u + 128u)
// Threads per allreduce block. Must be >= TP_MAX_WORLD (threads 0..world-1 signal and poll).
// 512: a block then covers 8 KiB of f32 packs per pass; few blocks keep the flag traffic of
// small (decode-sized) messages low while large messages still get 128 * 512 threads.
#define TP_AR_THREADS 512
// Blocks of every allreduce kernel that must fit on one SM at once (registers capped to
// 65536 / (2 * 512) = 64 per thread on sm_90). Ranks sharing a GPU need all their blocks
// resident together (their flag waits spin on each other), and the grid cap the host picks
// (CudaDevice::comm_blocks) is derived from the measured occupancy of the least-occupying
// allreduce kernel. First device run (H200, 2026-12-02): four ranks on one GPU, with the cap
// sized from one kernel's occupancy to fill the GPU exactly, timed out in their flag waits.
#define TP_AR_MIN_BLOCKS 2

// Host-mapped error words (u32 each; the host zeroes them after reading).
#define TP_ERR_CODE 0        // 0 ok, TP_ERR_TIMEOUT or TP_ERR_EPOCH
#define TP_ERR_DEV_EPOCH 1   // the device epoch of the failed call
#define TP_ERR_HOST_EPOCH 2  // the host epoch it was given
#define TP_ERR_PEERS 4       // + p: 1 when a wait on peer p timed out
#define TP_ERR_TIMEOUT 1u
#define TP_ERR_EPOCH 2u

// Arguments of allreduce_*: 64 * 8 + 5 * 8 + 4 * 4 = 568 bytes.
struct ArParams {
    u64 comm[TP_MAX_WORLD];  // every rank's comm buffer, mapped into this process
    u64 data;                // this rank's data (in: partial, out: the sum)
    u64 n;                   // elements
    u64 data_bytes;          // CommLayout::data_bytes (one slot's size)
    u64 timeout_ns;          // longest wait for one flag
    u64 err;                 // device address of the host-mapped error words
    u32 rank;
    u32 world;
    u32 host_epoch;          // AllreduceArgs::epoch, or 0 = do not check (graph capture)
    u32 vec;                 // 1 when data and every comm buffer are 16-byte aligned
};

TP_DEV u32* tp_sig(u64 comm, u64 off) { return (u32*)(comm + off); }

TP_DEV u64 tp_flag_off(u32 phase, u32 block, u32 sender) {
    return TP_SIG_FLAGS + ((u64)(phase * TP_MAX_BLOCKS + block) * TP_MAX_WORLD + sender) * 4;
}

// True once the epoch counter `flag` has reached `epoch`; wraps at 2^32 like the CPU's
// `reached` (peers are at most one call apart).
TP_DEV bool tp_reached(u32 flag, u32 epoch) { return (int)(flag - epoch) >= 0; }

// Reads this call's epoch (thread 0), checks it against the host's, and shares it with the
// block.
TP_DEV u32 tp_begin(const ArParams& a) {
    __shared__ u32 s_epoch;
    if (threadIdx.x == 0) {
        // Relaxed: the counter is written only by the previous launch on this stream, and a
        // kernel boundary orders all of its writes before all of our reads. It publishes
        // nothing else.
        const u32 e = tp_ld_relaxed(tp_sig(a.comm[a.rank], TP_SIG_EPOCH)) + 1;
        if (a.host_epoch != 0 && a.host_epoch != e) {
            volatile u32* err = (volatile u32*)a.err;
            err[TP_ERR_DEV_EPOCH] = e;
            err[TP_ERR_HOST_EPOCH] = a.host_epoch;
            // The code last, after a fence, so a host that sees the code sees the epochs.
            tp_fence_sys();
            err[TP_ERR_CODE] = TP_ERR_EPOCH;
        }
        s_epoch = e;
    }
    __syncthreads();
    return s_epoch;
}

// Counts this block as finished; the last block advances the epoch counter.
TP_DEV void tp_end(const ArParams& a, u32 e) {
    // Every thread of the block is past its last access of this call (and of s_epoch).
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* done = tp_sig(a.comm[a.rank], TP_SIG_DONE);
        // acq_rel, GPU scope: the release orders this block's read of the epoch counter (in
        // tp_begin) before its count; the block that brings the count to gridDim.x acquires
        // every other block's count, so every block has read the counter before it is
        // advanced below. Relaxed could let the advance overtake a slow block's read, which
        // would then use epoch + 1. GPU scope suffices: only this launch's blocks, on this
        // device, touch `done`.
        const u32 prev = tp_atomic_add_acq_rel_gpu(done, 1u);
        if (prev == gridDim.x - 1) {
            // Relaxed: nobody else touches these words in this launch any more; the next
            // launch on this stream sees them through the kernel boundary.
            tp_st_relaxed(done, 0u);
            tp_st_relaxed(tp_sig(a.comm[a.rank], TP_SIG_EPOCH), e);
        }
    }
}

// Block b of this rank meets block b of every peer for `phase` of call `e`.
//
// Before: this block's writes to our own data slot (phase 0) or our reduced shard (phase 1)
// must be visible to the peers' blocks b when they pass this barrier. After: the peers'
// matching writes must be visible to every thread of this block.
TP_DEV void tp_barrier(const ArParams& a, u32 phase, u32 e) {
    // (1) bar.sync orders every thread's earlier slot writes before thread t's release below
    // (PTX memory model: causality order is transitive through the CTA barrier, and a release
    // is cumulative), so one thread's flag publishes the whole block's writes.
    __syncthreads();
    const u32 t = threadIdx.x;
    if (t < a.world && t != a.rank) {
        // Release, system scope: the flag is read by another process's kernel, possibly on
        // another GPU; a GPU-scope release would order our slot writes only for observers on
        // this device, and a relaxed store could let the flag overtake them (vLLM's
        // custom_all_reduce.cuh st_flag_release makes the same argument).
        tp_st_release_sys(tp_sig(a.comm[t], tp_flag_off(phase, blockIdx.x, a.rank)), e);
        const u32* mine = tp_sig(a.comm[a.rank], tp_flag_off(phase, blockIdx.x, t));
        const u64 deadline = tp_time_ns() + a.timeout_ns;
        volatile u32* err = (volatile u32*)a.err;
        u32 spins = 0;
        // Acquire, system scope: pairs with peer t's release of this flag; everything peer t's
        // block b wrote before raising it is visible to this thread once we see `e` (or later:
        // a fast peer may already be one call ahead, which still implies it finished `e`).
        // A relaxed poll would need a fence after the loop; an acquire load says it in place.
        while (!tp_reached(tp_ld_acquire_sys(mine), e)) {
            // Every 256 polls (~tens of microseconds), look at the clock and at the error word.
            if ((++spins & 255u) == 0) {
                // Volatile read of host memory: another poller (any block, any call queued
                // before) already failed, so waiting on is pointless.
                if (err[TP_ERR_CODE] == TP_ERR_TIMEOUT) break;
                if (tp_time_ns() > deadline) {
                    err[TP_ERR_PEERS + t] = 1u;
                    err[TP_ERR_DEV_EPOCH] = e;
                    // The details before the code (host reads after a stream sync anyway).
                    tp_fence_sys();
                    err[TP_ERR_CODE] = TP_ERR_TIMEOUT;
                    break;
                }
            }
        }
    }
    // (2) bar.sync extends the pollers' acquires to the whole block (same transitivity as (1)),
    // so every thread may now read the peers' slots with plain loads.
    __syncthreads();
}

TP_DEV u64 tp_slot(const ArParams& a, u32 e) {
    return TP_SIGNAL_BYTES + (u64)(e & 1u) * a.data_bytes;
}

// oneshot: copy our input into our slot; meet; every rank reduces every element, reading all
// slots in rank order (rank order is never rotated, so every rank gets the same bits).
template <class D, bool VEC>
TP_DEV void oneshot(const ArParams& a) {
    const u32 e = tp_begin(a);
    const u64 slot = tp_slot(a, e);
    const TpRange r = tp_split(tp_packs(a.n, D::V), gridDim.x, blockIdx.x);
    u8* data = (u8*)a.data;
    u8* mine = (u8*)(a.comm[a.rank] + slot);
    // Our slot is free: peers last read it in call e - 2, and each of them raised its flag for
    // call e - 1 (which we waited for) only after finishing e - 2 (comm.rs, two slots).
    for (u64 k = r.start + threadIdx.x; k < r.end; k += blockDim.x)
        copy_pack<D, VEC>(data, mine, k, a.n);
    tp_barrier(a, 0, e);
    auto src = [&](int p) { return (const u8*)(a.comm[p] + slot); };
    for (u64 k = r.start + threadIdx.x; k < r.end; k += blockDim.x)
        sum_pack<D, VEC>(src, (int)a.world, data, (u8*)0, k, a.n);
    tp_end(a, e);
}

// twoshot: reduce-scatter, then all-gather. The packs are split into `world` shards (shard q
// is reduced by rank q) and each shard into gridDim.x parts (part b handled by block b on
// every rank), so block b only ever needs the peers' blocks b.
template <class D, bool VEC>
TP_DEV void twoshot(const ArParams& a) {
    const u32 e = tp_begin(a);
    const u64 slot = tp_slot(a, e);
    const u64 packs = tp_packs(a.n, D::V);
    u8* data = (u8*)a.data;
    u8* mine = (u8*)(a.comm[a.rank] + slot);
    // Publish part b of every shard (the parts the peers' blocks b will read).
    for (u32 q = 0; q < a.world; ++q) {
        const TpRange s = tp_split(packs, a.world, q);
        const TpRange r = tp_split(s.end - s.start, gridDim.x, blockIdx.x);
        for (u64 k = s.start + r.start + threadIdx.x; k < s.start + r.end; k += blockDim.x)
            copy_pack<D, VEC>(data, mine, k, a.n);
    }
    tp_barrier(a, 0, e);
    // Reduce part b of our shard, in place in our slot (peers read our slot only outside our
    // shard until our phase-1 flag) and into our data.
    {
        const TpRange s = tp_split(packs, a.world, a.rank);
        const TpRange r = tp_split(s.end - s.start, gridDim.x, blockIdx.x);
        auto src = [&](int p) { return (const u8*)(a.comm[p] + slot); };
        for (u64 k = s.start + r.start + threadIdx.x; k < s.start + r.end; k += blockDim.x)
            sum_pack<D, VEC>(src, (int)a.world, mine, data, k, a.n);
    }
    tp_barrier(a, 1, e);
    // Gather part b of every other shard from its owner's slot.
    for (u32 q = 0; q < a.world; ++q) {
        if (q == a.rank) continue;
        const TpRange s = tp_split(packs, a.world, q);
        const TpRange r = tp_split(s.end - s.start, gridDim.x, blockIdx.x);
        const u8* theirs = (const u8*)(a.comm[q] + slot);
        for (u64 k = s.start + r.start + threadIdx.x; k < s.start + r.end; k += blockDim.x)
            copy_pack<D, VEC>(theirs, data, k, a.n);
    }
    tp_end(a, e);
}

#define TP_ALLREDUCE(algo, dn, D)                                                      \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_AR_THREADS, TP_AR_MIN_BLOCKS)          \
        allreduce_##algo##_##dn(ArParams a) {                                          \
        if (a.vec) {                                                                   \
            algo<D, true>(a);                                                          \
        } else {                                                                       \
            algo<D, false>(a);                                                         \
        }                                                                              \
    }
TP_ALLREDUCE(oneshot, f32, F32)
TP_ALLREDUCE(oneshot, f16, F16)
TP_ALLREDUCE(oneshot, bf16, BF16)
TP_ALLREDUCE(twoshot, f32, F32)
TP_ALLREDUCE(twoshot, f16, F16)
TP_ALLREDUCE(twoshot, bf16, BF16)

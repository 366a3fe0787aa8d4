// comm.cu: the peer-buffer allreduce kernels (Op::Allreduce): `oneshot` (flag-and-slot, and
// the low-latency one for small messages), `twoshot`, and `host_reduce`, the device half of
// the `host` algorithm.
//
// CPU twin: kernels/src/cpu/allreduce.rs. Same buffer layout (kernels/src/comm.rs): a signal
// area, data slots 0 and 1, low-latency slots 0 and 1; call `epoch` uses slots epoch % 2.
// What the GPU adds, and the
// Rust side mirrors in kernels/src/cuda/launch.rs (with compile-time checks):
//
// Signal area of each rank's comm buffer (GPU backends; the CPU backend's 8 KiB of
// (phase, sender) lines at 0..8192 are left unused so an offset never has two meanings):
//
//   8192 + 8 * b    u64 epoch   per block b < TP_MAX_BLOCKS: the last epoch this rank
//                               completed (device-resident counters, all equal between calls)
//   9216 + ((phase * MAX_BLOCKS + block) * MAX_WORLD + sender) * 8
//                   u64 flag    raised by `sender`'s block `block` in this (the receiver's)
//                               area by storing the epoch; 2 * 128 * 64 * 8 = 128 KiB
//
// Epochs are 64-bit on the device: they never wrap, so a flag left unraised for any number of
// calls (a block beyond a smaller grid, a phase that oneshot, host and the low-latency kernel
// do not use) can never pass for a current one. The host's u32 count is checked against the
// low 32 bits; slots go by parity, the same in both.
//
// Flags are per block: block b of every rank handles the same packs in every phase (the
// split depends only on n, world and the grid size, which all ranks compute alike), so block
// b waits only for the peers' blocks b, never for a whole peer grid: no grid-wide barrier.
// A sender's flags for one block sit next to the other senders' (512 bytes per block):
// the receiver's polling threads read one contiguous run, and GPUs write with byte masks,
// so neighbouring senders do not clobber each other (the CPU backend needs 64-byte lines).
//
// Where the epoch comes from (graph capture): block b reads it from its own counter b in our
// signal area (counter + 1) and advances that counter when it is done, so a captured launch
// replays with a fresh epoch every time, with no atomic and no cross-block step. A launch of
// g blocks must leave all TP_MAX_BLOCKS counters equal (the next launch may use more blocks),
// so block b also advances the counters of the blocks this launch does not run: b + g,
// b + 2g, ... Nobody reads those in this launch. The host still passes
// AllreduceArgs::epoch; when it is non-zero block 0 checks it equals the device epoch and
// reports a mismatch (the host turns that into KernelError::Invalid); the host passes 0 while
// the stream is being captured. The counters start at 0 because shared buffers are zeroed,
// so the first call is epoch 1, as comm.rs specifies.
//
// Low-latency region (CommLayout::ll_offset, after the data slots; two slots by epoch parity,
// one region of ll_stride bytes per sender): the `oneshot` of small messages sends data and
// flag together. A 16-byte line carries 8 bytes of the message as two 8-byte words
// (4 data bytes | flag << 32), stored into the receiver's region by the sender and polled
// there by the receiver: one remote store and one local poll per call, no fence and no
// separate flag (see oneshot_ll for the ordering argument).
//
// Waits are bounded: a thread that polls a flag longer than timeout_ns writes the peer and the
// epoch into the host-mapped error words and stops waiting (the results are then garbage, and
// the host reports KernelError::Timeout after the stream synchronises). Every poller also
// gives up when it sees that another one already reported, so a failed call ends in about one
// timeout, not one per block.

#include "elem.h"

#define TP_SIGNAL_BYTES (256ull * 1024ull)
#define TP_MAX_WORLD 64
// Most blocks one allreduce launch uses: u64 flags for 2 phases x 128 blocks x 64 senders
// fill 128 KiB of the 256 KiB signal area, and 128 is about one block per SM on an H100/H200
// (132 SMs), past which more blocks only add flag traffic.
#define TP_MAX_BLOCKS 128
#define TP_SIG_EPOCHS 8192u
#define TP_SIG_FLAGS (8192u + 1024u)
// Threads per allreduce block. Must be >= TP_MAX_WORLD (threads 0..world-1 signal and poll)
// and >= TP_MAX_BLOCKS (tp_end: one epoch counter per thread).
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

// The residual add + RMSNorm epilogue of allreduce_oneshot_ll_addnorm_f32 (AllreduceArgs::
// add_norm): x <- x + sum, out = x * rsqrt(mean(x^2) + eps) * w, one row of `n` f32.
struct ArNorm {
    u64 x;    // residual [n] f32, read and written
    u64 w;    // norm weight [n] f32
    u64 out;  // normed output [n] f32
    float eps;
    u32 pad;
};

// Arguments of allreduce_*: 64 * 8 + 8 * 8 + 4 * 4 + 32 = 624 bytes.
struct ArParams {
    u64 comm[TP_MAX_WORLD];  // every rank's comm buffer, mapped into this process
    u64 data;                // this rank's data (in: partial, out: the sum)
    u64 n;                   // elements
    u64 data_bytes;          // CommLayout::data_bytes (one slot's size)
    u64 ll;                  // CommLayout::ll_offset(0): low-latency slot 0
    u64 ll_slot_bytes;       // CommLayout::ll_slot_bytes (one low-latency slot)
    u64 ll_stride;           // CommLayout::ll_stride (one sender's region in a slot)
    u64 timeout_ns;          // longest wait for one flag
    u64 err;                 // device address of the host-mapped error words
    u32 rank;
    u32 world;
    u32 host_epoch;          // AllreduceArgs::epoch (the device epoch's low 32 bits), or
                             // 0 = do not check (graph capture, or the host count wrapped)
    u32 vec;                 // 1 when data and every comm buffer are 16-byte aligned
    ArNorm norm;             // the fused epilogue (only allreduce_oneshot_ll_addnorm_f32)
};


TP_DEV u64* tp_flag(u64 comm, u32 phase, u32 block, u32 sender) {
    return (u64*)(comm + TP_SIG_FLAGS +
                  ((u64)(phase * TP_MAX_BLOCKS + block) * TP_MAX_WORLD + sender) * 8);
}

// True once the flag has reached `epoch` (a fast peer may already be one call ahead). 64-bit
// epochs never wrap, so a flag that nobody raised for any number of calls (blocks beyond a
// small grid, phases a call does not use) still reads as old.
TP_DEV bool tp_reached(u64 flag, u64 epoch) { return flag >= epoch; }

TP_DEV u64* tp_epoch_counter(const ArParams& a, u32 block) {
    return (u64*)(a.comm[a.rank] + TP_SIG_EPOCHS + 8u * block);
}

// This call's epoch, read by every thread from its block's counter (one broadcast load per
// warp, no __syncthreads before the first use); block 0 checks it against the host's.
TP_DEV u64 tp_begin(const ArParams& a) {
    // Relaxed: counter b is written only by block b (or a block of a smaller grid standing in
    // for it) of an earlier launch on this stream, and a kernel boundary orders all of that
    // launch's writes before all of ours. It publishes nothing else.
    const u64 e = tp_ld_relaxed(tp_epoch_counter(a, blockIdx.x)) + 1;
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.host_epoch != 0 && a.host_epoch != (u32)e) {
        volatile u32* err = (volatile u32*)a.err;
        err[TP_ERR_DEV_EPOCH] = (u32)e;
        err[TP_ERR_HOST_EPOCH] = a.host_epoch;
        // The code last, after a fence, so a host that sees the code sees the epochs.
        tp_fence_sys();
        err[TP_ERR_CODE] = TP_ERR_EPOCH;
    }
    return e;
}

// Advances this block's counter (and those of the blocks this launch does not run, see the
// top of the file) to `e`: thread t writes counter b + t * gridDim.x, so a small grid's tail
// is one store per thread, not a loop of TP_MAX_BLOCKS stores in one thread.
TP_DEV void tp_end(const ArParams& a, u64 e) {
    // Every thread of the block has loaded counter b (its value was used, so the load is
    // complete) before any thread overwrites it: bar.sync orders the two within the block.
    __syncthreads();
    const u32 b = blockIdx.x + threadIdx.x * gridDim.x;
    // Relaxed: nobody else touches these words in this launch; the next launch on this
    // stream sees them through the kernel boundary.
    if (b < TP_MAX_BLOCKS) tp_st_relaxed(tp_epoch_counter(a, b), e);
}

// Called by a poller every 256 polls: false when it must stop waiting, because another
// poller (any block, any call queued before) already failed, or because its own deadline has
// passed, which it then reports (results are garbage either way; the host fails the call).
TP_DEV bool tp_keep_waiting(const ArParams& a, u32 peer, u64 e, u64 deadline) {
    volatile u32* err = (volatile u32*)a.err;
    // Volatile read of host memory.
    if (err[TP_ERR_CODE] == TP_ERR_TIMEOUT) return false;
    if (tp_time_ns() <= deadline) return true;
    err[TP_ERR_PEERS + peer] = 1u;
    err[TP_ERR_DEV_EPOCH] = (u32)e;
    // The details before the code (host reads after a stream sync anyway).
    tp_fence_sys();
    err[TP_ERR_CODE] = TP_ERR_TIMEOUT;
    return false;
}

// Block b of this rank meets block b of every peer for `phase` of call `e`.
//
// Before: this block's writes to our own data slot (phase 0) or our reduced shard (phase 1)
// must be visible to the peers' blocks b when they pass this barrier. After: the peers'
// matching writes must be visible to every thread of this block.
TP_DEV void tp_barrier(const ArParams& a, u32 phase, u64 e) {
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
        tp_st_release_sys(tp_flag(a.comm[t], phase, blockIdx.x, a.rank), e);
        const u64* mine = tp_flag(a.comm[a.rank], phase, blockIdx.x, t);
        const u64 deadline = tp_time_ns() + a.timeout_ns;
        u32 spins = 0;
        // Acquire, system scope: pairs with peer t's release of this flag; everything peer t's
        // block b wrote before raising it is visible to this thread once we see `e` (or later:
        // a fast peer may already be one call ahead, which still implies it finished `e`).
        // A relaxed poll would need a fence after the loop; an acquire load says it in place.
        while (!tp_reached(tp_ld_acquire_sys(mine), e)) {
            // Every 256 polls (~tens of microseconds), look at the clock and at the error word.
            if ((++spins & 255u) == 0 && !tp_keep_waiting(a, t, e, deadline)) break;
        }
    }
    // (2) bar.sync extends the pollers' acquires to the whole block (same transitivity as (1)),
    // so every thread may now read the peers' slots with plain loads.
    __syncthreads();
}

TP_DEV u64 tp_slot(const ArParams& a, u64 e) {
    return TP_SIGNAL_BYTES + (e & 1u) * a.data_bytes;
}

// oneshot: copy our input into our slot; meet; every rank reduces every element, reading all
// slots in rank order (rank order is never rotated, so every rank gets the same bits).
template <class D, bool VEC>
TP_DEV void oneshot(const ArParams& a) {
    const u64 e = tp_begin(a);
    const u64 slot = tp_slot(a, e);
    const TpRange r = tp_split(tp_packs(a.n, D::V), gridDim.x, blockIdx.x);
    u8* data = (u8*)a.data;
    u8* mine = (u8*)(a.comm[a.rank] + slot);
    // Our slot is free: peers last read it in call e - 2, and each of them signalled call
    // e - 1 (which we waited for) only after finishing e - 2 (comm.rs, two slots).
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
    const u64 e = tp_begin(a);
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

// ---- oneshot, low-latency (small messages) ------------------------------------------------
//
// Every rank stores its message, 8 bytes per 16-byte line with the flag beside each 4 bytes,
// straight into every peer's low-latency slot (region `rank`), then polls its own slot until
// every peer's lines carry this call's flag, and sums in rank order (its own part from its
// registers' source, `data`). No fence, no flag of its own, no __syncthreads on the way:
// one remote store, one local poll.
//
// Ordering argument. The reader needs, for each 8-byte word it reads, the data the sender
// stored in that word for this call. Data and flag travel in the same naturally aligned
// 8-byte store, which is single-copy atomic, and the poll loads that same 8-byte word: a
// load that returns this call's flag returns this call's data with it. Nothing else is
// published, so relaxed (volatile) accesses suffice; both words of a line are checked because
// the 16-byte pair is not atomic as a whole.
//
// Reuse. Line slot e % 2 of receiver q is written by sender r in call e only after r has
// had q's signal for call e - 1 (lines, flags, or the host barrier: every algorithm waits
// for every peer, an empty message included), and q sends that only after its call e - 2,
// which consumed slot e % 2, has ended (stream order).
//
// Stale flags. A consumed line is cleared (flag 0) by its reader, so a line holds either 0 or
// the flag of the call that is now reading it, never a flag left from 2^32 calls ago that
// happens to match after the flag's 32 bits wrap. The clear is a local store of the reader's
// kernel e, which completes (the kernel's stores are performed) before the reader's call
// e + 1 sends the signal (lines, flags, or its host barrier) that lets a sender write this
// slot again in e + 2. (That step rests on kernel completion performing the kernel's stores,
// a guarantee of the hardware and the CUDA programming model, where the flag path's
// release/acquire pairs have a formal one in the PTX memory model.) Flags are never 0: call
// epoch 0 (after a wrap) uses flag 1, which differs from epoch 1's in slot parity.
TP_DEV u32 tp_ll_flag(u64 e) { return (u32)e != 0u ? (u32)e : 1u; }
TP_DEV u64 tp_ll_word(u32 data, u32 flag) { return (u64)data | ((u64)flag << 32); }

// Word w (4 bytes) of a message of `bytes` bytes at `p`, zero past the end. 4-byte loads
// where the address allows; f16/bf16 views may be only 2-byte aligned (f32 always are 4).
TP_DEV u32 tp_ld_msg_word(const u8* p, u64 w, u64 bytes) {
    const u64 b = w * 4;
    if (b >= bytes) return 0u;
    if (((u64)(p + b) & 3u) == 0 && b + 4 <= bytes) return *(const u32*)(p + b);
    const u32 lo = *(const u16*)(p + b);
    const u32 hi = b + 2 < bytes ? (u32)*(const u16*)(p + b + 2) : 0u;
    return lo | (hi << 16);
}
TP_DEV void tp_st_msg_word(u8* p, u64 w, u64 bytes, u32 v) {
    const u64 b = w * 4;
    if (b >= bytes) return;
    if (((u64)(p + b) & 3u) == 0 && b + 4 <= bytes) {
        *(u32*)(p + b) = v;
        return;
    }
    *(u16*)(p + b) = (u16)(v & 0xffffu);
    if (b + 2 < bytes) *(u16*)(p + b + 2) = (u16)(v >> 16);
}

// Waits until line `l` (in our own slot) carries `flag` in both words, returns its data words
// and clears it. A timed-out wait returns garbage (the host fails the call).
TP_DEV void tp_ll_recv(const ArParams& a, u64* l, u32 flag, u32 peer, u64 e, u32& w0, u32& w1) {
    u64 x0, x1;
    tp_ld_ll(l, x0, x1);
    if ((u32)(x0 >> 32) != flag || (u32)(x1 >> 32) != flag) {
        const u64 deadline = tp_time_ns() + a.timeout_ns;
        u32 spins = 0;
        do {
            if ((++spins & 255u) == 0 && !tp_keep_waiting(a, peer, e, deadline)) break;
            tp_ld_ll(l, x0, x1);
        } while ((u32)(x0 >> 32) != flag || (u32)(x1 >> 32) != flag);
    }
    w0 = (u32)x0;
    w1 = (u32)x1;
    tp_st_ll(l, 0ull, 0ull);
}

// Sends lines first, first + step, ... of our message (`bytes` bytes at `data`) to every
// peer's region `rank` of low-latency slot `slot`, data and flag in each 8-byte word.
TP_DEV void tp_ll_send(const ArParams& a, const u8* data, u64 bytes, u64 lines, u64 slot,
                       u32 flag, u64 first, u64 step) {
    for (u64 k = first; k < lines; k += step) {
        const u32 w0 = tp_ld_msg_word(data, 2 * k, bytes);
        const u32 w1 = tp_ld_msg_word(data, 2 * k + 1, bytes);
        for (u32 p = 0; p < a.world; ++p) {
            if (p == a.rank) continue;
            u64* l = (u64*)(a.comm[p] + slot + (u64)a.rank * a.ll_stride + k * 16);
            tp_st_ll(l, tp_ll_word(w0, flag), tp_ll_word(w1, flag));
        }
    }
}

// Line k of rank p's message: our own read again from `data` (the calling thread is the only
// one that writes line k of `data`, and only after its last source), a peer's received from
// our slot (waiting for it, then clearing it).
TP_DEV void tp_ll_line(const ArParams& a, const u8* data, u64 bytes, u64 slot, u32 flag, u64 e,
                       u32 p, u64 k, u32& w0, u32& w1) {
    if (p == a.rank) {
        w0 = tp_ld_msg_word(data, 2 * k, bytes);
        w1 = tp_ld_msg_word(data, 2 * k + 1, bytes);
    } else {
        u64* l = (u64*)(a.comm[a.rank] + slot + (u64)p * a.ll_stride + k * 16);
        tp_ll_recv(a, l, flag, p, e, w0, w1);
    }
}

template <class D>
TP_DEV void oneshot_ll(const ArParams& a) {
    const u64 e = tp_begin(a);
    const u32 flag = tp_ll_flag(e);
    const u64 bytes = a.n * D::SIZE;
    // At least one line, so that even an empty message meets every peer (the reuse argument
    // above needs every call to wait for every peer).
    const u64 lines = bytes == 0 ? 1 : (bytes + 7) / 8;
    const u64 slot = a.ll + (e & 1u) * a.ll_slot_bytes;
    u8* data = (u8*)a.data;
    const u64 step = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    // Send every line we own to every peer first, so that all stores are in flight before
    // the first poll.
    tp_ll_send(a, data, bytes, lines, slot, flag, first, step);
    constexpr int E = 2 * D::PER_WORD;  // elements per line
    for (u64 k = first; k < lines; k += step) {
        float acc[E];
        for (u32 p = 0; p < a.world; ++p) {
            u32 w0, w1;
            tp_ll_line(a, data, bytes, slot, flag, e, p, k, w0, w1);
            float x[E];
            D::unword(w0, x);
            D::unword(w1, x + D::PER_WORD);
            // Rank order, accumulator starting at rank 0's value: elem.h's sum order.
#pragma unroll
            for (int j = 0; j < E; ++j) acc[j] = p == 0 ? x[j] : acc[j] + x[j];
        }
        tp_st_msg_word(data, 2 * k, bytes, D::word(acc));
        tp_st_msg_word(data, 2 * k + 1, bytes, D::word(acc + D::PER_WORD));
    }
    tp_end(a, e);
}

// ---- the device half of `host` ---------------------------------------------------------
//
// The host copied every rank's input into its slot for epoch e, synchronised its stream and
// met the others at a host barrier (a completed, synchronised copy is visible to any later
// launch, on this GPU or a peer), so this kernel only sums the slots in rank order into
// `data` and counts the call on the device, so that all algorithms share one epoch sequence.
template <class D, bool VEC>
TP_DEV void host_reduce(const ArParams& a) {
    const u64 e = tp_begin(a);
    const u64 slot = tp_slot(a, e);
    auto src = [&](int p) { return (const u8*)(a.comm[p] + slot); };
    const u64 packs = tp_packs(a.n, D::V);
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < packs; k += step)
        sum_pack<D, VEC>(src, (int)a.world, (u8*)a.data, (u8*)0, k, a.n);
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
TP_ALLREDUCE(host_reduce, f32, F32)
TP_ALLREDUCE(host_reduce, f16, F16)
TP_ALLREDUCE(host_reduce, bf16, BF16)

#define TP_ALLREDUCE_LL(dn, D)                                                         \
    extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_AR_THREADS, TP_AR_MIN_BLOCKS)          \
        allreduce_oneshot_ll_##dn(ArParams a) {                                        \
        oneshot_ll<D>(a);                                                              \
    }
TP_ALLREDUCE_LL(f32, F32)
TP_ALLREDUCE_LL(f16, F16)
TP_ALLREDUCE_LL(bf16, BF16)

// ---- oneshot, low-latency, with the decode layer's seam fused in -------------------------
//
// allreduce_oneshot_ll_addnorm_f32: one block of TP_AR_THREADS threads, one f32 row of n
// elements (n * 4 <= the low-latency capacity): the low-latency oneshot above, then, in the
// same block, x <- x + sum and out = rms_norm(x) * w. It replaces an allreduce and an
// add_rms_norm launch per seam (two per layer in decode), and the sum never goes back to
// memory: `data` is left as it was (AllreduceArgs::add_norm leaves it unspecified).
// Reads: the peers' lines (n * 2 * (world - 1) bytes of this rank's slot), x and w once;
// writes x and out once. Every rank computes the same sums in the same order, so all ranks
// hold bitwise the same x and out.
#define TP_NORM_MAX_LINES 8  // lines kept in registers per thread: n <= 8 * 2 * 512 = 8192

TP_DEV void oneshot_ll_addnorm(const ArParams& a) {
    const u64 e = tp_begin(a);
    const u32 flag = tp_ll_flag(e);
    const u64 bytes = a.n * 4;
    const u64 lines = bytes == 0 ? 1 : (bytes + 7) / 8;
    const u64 slot = a.ll + (e & 1u) * a.ll_slot_bytes;
    const u8* data = (const u8*)a.data;
    const u32 t = threadIdx.x;
    tp_ll_send(a, data, bytes, lines, slot, flag, t, blockDim.x);
    float* x = (float*)a.norm.x;
    float keep[2 * TP_NORM_MAX_LINES];
    float ss = 0.0f;
    int i = 0;
    for (u64 k = t; k < lines; k += blockDim.x, ++i) {
        float acc[2];
        for (u32 p = 0; p < a.world; ++p) {
            u32 w0, w1;
            tp_ll_line(a, data, bytes, slot, flag, e, p, k, w0, w1);
            // Rank order, accumulator starting at rank 0's value (elem.h's sum order).
            const float v0 = tp_f32_from_bits(w0), v1 = tp_f32_from_bits(w1);
            acc[0] = p == 0 ? v0 : acc[0] + v0;
            acc[1] = p == 0 ? v1 : acc[1] + v1;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u64 idx = 2 * k + j;
            if (idx < a.n) {
                const float r = x[idx] + acc[j];
                x[idx] = r;
                ss += r * r;
                if (i < TP_NORM_MAX_LINES) keep[2 * i + j] = r;
            }
        }
    }
    // Block sum of squares: each wave sums its lanes, then thread 0 adds the waves in order.
    __shared__ float part[TP_AR_THREADS / 32 + 1];
    __shared__ float inv;
    ss = tp_wave_sum(ss);
    if (t % TP_WAVE == 0) part[t / TP_WAVE] = ss;
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (u32 wv = 0; wv < blockDim.x / TP_WAVE; ++wv) s += part[wv];
        inv = 1.0f / sqrtf(s / (float)a.n + a.norm.eps);
    }
    __syncthreads();
    const float* w = (const float*)a.norm.w;
    float* out = (float*)a.norm.out;
    i = 0;
    for (u64 k = t; k < lines; k += blockDim.x, ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u64 idx = 2 * k + j;
            if (idx < a.n) {
                // This thread wrote x[idx] above; registers where they were kept.
                const float r = i < TP_NORM_MAX_LINES ? keep[2 * i + j] : x[idx];
                out[idx] = r * inv * w[idx];
            }
        }
    }
    tp_end(a, e);
}

extern "C" __global__ void TP_LAUNCH_BOUNDS(TP_AR_THREADS, TP_AR_MIN_BLOCKS)
    allreduce_oneshot_ll_addnorm_f32(ArParams a) {
    oneshot_ll_addnorm(a);
}

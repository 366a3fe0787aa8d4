//! CPU `oneshot` and `twoshot` allreduce over peers' shared (memfd) communication buffers.
//!
//! The flag protocol is the one GPU kernels use (see [`crate::comm`] for the layout): a rank
//! raises flag (phase, me) in every peer's signal area by a Release store of the epoch, then
//! waits with Acquire loads until every peer's flag (phase, peer) in its own area has reached
//! the epoch. Release/Acquire is what makes a peer's data-slot writes, which precede its flag
//! store in program order, visible to our reads that follow the wait; with Relaxed a reader
//! could see the flag and still read stale data.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::reduce::{sum_range, SendPtr};
use super::wait::{reached, wait_until, wake_all, WaitError};
use super::{par_ranges, CpuBuf, CpuDevice};
use crate::comm::{shard_range, AllreduceArgs, CommAlgo, CommLayout, PHASES};
use crate::{with_dtype, KernelError, Result};

const MIN_PER_THREAD: usize = 1 << 16;

fn flag(buf: &CpuBuf, phase: usize, sender: usize) -> &AtomicU32 {
    let off = CommLayout::flag_offset(phase, sender);
    debug_assert!(off + 4 <= buf.len());
    // SAFETY: the signal area is inside every comm buffer (layout checked in `allreduce`),
    // the offset is 64-byte aligned, and the word is only ever accessed atomically.
    unsafe { &*(buf.ptr().add(off) as *const AtomicU32) }
}

/// Raises our flag for `phase` in every peer's signal area; wakes sleepers when somebody
/// waits for it in this call (`wake`).
fn signal(a: &AllreduceArgs<'_, CpuBuf>, phase: usize, wake: bool) {
    for (q, peer) in a.comm.iter().enumerate() {
        if q != a.rank {
            // Release: publishes our data-slot writes (and, in phase 1, our reduced slice)
            // to the peer's Acquire load in `wait_all`.
            let f = flag(peer, phase, a.rank);
            f.store(a.epoch, Ordering::Release);
            if wake {
                wake_all(f);
            }
        }
    }
}

/// Raises the flags of the phases this call does not wait on, without waking anyone (nobody
/// waits for them at this epoch): every call moves every flag, so none is ever more than one
/// call old, and the wrapping u32 comparison of `reached` never meets a value 2^31 calls
/// stale (which it would take for current).
fn signal_unused(a: &AllreduceArgs<'_, CpuBuf>, phases: std::ops::Range<usize>) {
    for phase in phases {
        signal(a, phase, false);
    }
}

/// Waits until every peer has raised its flag for `phase` at our epoch (or later).
fn wait_all(
    dev: &CpuDevice,
    a: &AllreduceArgs<'_, CpuBuf>,
    phase: usize,
    deadline: Instant,
) -> Result<()> {
    let own = a.comm[a.rank];
    for q in (0..a.world).filter(|&q| q != a.rank) {
        let f = flag(own, phase, q);
        match wait_until(f, |v| reached(v, a.epoch), dev.spin(), deadline, a.abort) {
            Ok(()) => {}
            Err(WaitError::Aborted) => return Err(KernelError::Aborted { what: "allreduce" }),
            Err(WaitError::TimedOut) => {
                let peers = (0..a.world)
                    .filter(|&p| {
                        p != a.rank
                            && !reached(flag(own, phase, p).load(Ordering::Acquire), a.epoch)
                    })
                    .collect();
                return Err(KernelError::Timeout {
                    what: "allreduce",
                    waited: a.timeout,
                    peers,
                });
            }
        }
    }
    Ok(())
}

pub(crate) fn allreduce(dev: &CpuDevice, a: &AllreduceArgs<'_, CpuBuf>) -> Result<()> {
    a.validate()?;
    for b in a.comm {
        b.check(0, a.layout.total_bytes())?;
    }
    let deadline = Instant::now() + a.timeout;
    let slot = a.layout.slot_offset(a.epoch);
    let n = a.data.len;
    let dtype = a.data.dtype;

    with_dtype!(dtype, T => {
        let data = SendPtr(a.data.buf.typed::<T>(a.data.offset, n, dtype)?);
        let slots = a
            .comm
            .iter()
            .map(|b| b.typed::<T>(slot, n, dtype).map(SendPtr))
            .collect::<Result<Vec<_>>>()?;
        if a.algo == CommAlgo::HostReduce {
            // The rank copied every input into its slot and met the others at a host barrier
            // (whose Release/Acquire chain publishes the copies): only the sum is left.
            par_ranges(dev.threads(), n, MIN_PER_THREAD, |r| {
                // SAFETY: all slots hold n elements; `data` is private to this rank.
                unsafe { sum_range::<T>(&slots, data, r) };
            });
            signal_unused(a, 0..PHASES);
            return Ok(());
        }
        // Publish our input in our own data slot. No peer reads this slot before our phase-0
        // flag for this epoch (see the two-slot argument in `comm`).
        // SAFETY: both ranges bounds-checked by `typed`; distinct buffers.
        unsafe { std::ptr::copy_nonoverlapping(data.get(), slots[a.rank].get(), n) };
        signal(a, 0, true);
        wait_all(dev, a, 0, deadline)?;
        match a.algo {
            CommAlgo::Oneshot => {
                // Every rank reduces everything, in rank order: bitwise identical everywhere.
                par_ranges(dev.threads(), n, MIN_PER_THREAD, |r| {
                    // SAFETY: all slots hold n elements; `data` is private to this rank.
                    unsafe { sum_range::<T>(&slots, data, r) };
                });
                signal_unused(a, 1..PHASES);
            }
            CommAlgo::Twoshot => {
                // Reduce-scatter: we own shard `rank` and write its sum into our own slot in
                // place. Peers read our slot only outside our shard in this phase, and read
                // our shard only after our phase-1 flag.
                let mine = shard_range(n, a.world, a.rank);
                let base = mine.start;
                par_ranges(dev.threads(), mine.len(), MIN_PER_THREAD, |r| {
                    // SAFETY: shard elements are within n; see the comment above for aliasing.
                    unsafe { sum_range::<T>(&slots, slots[a.rank], base + r.start..base + r.end) };
                });
                signal(a, 1, true);
                wait_all(dev, a, 1, deadline)?;
                // All-gather: copy every shard from its owner's slot (ours included).
                for (q, s) in slots.iter().enumerate() {
                    let sh = shard_range(n, a.world, q);
                    // SAFETY: in bounds; peer q finished writing shard q before its phase-1
                    // flag, which we acquired.
                    unsafe { std::ptr::copy_nonoverlapping(s.get().add(sh.start), data.get().add(sh.start), sh.len()) };
                }
            }
            CommAlgo::HostReduce => unreachable!("returned above"),
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CommLayout;
    use crate::device::{Device, Op, View};
    use crate::dtype::{decode, encode};
    use crate::DType;
    use std::time::Duration;

    /// Threads stand in for rank processes: the memory protocol is the same.
    fn run_world(world: usize, n: usize, dtype: DType, algo: CommAlgo) {
        let layout = CommLayout::new(n * dtype.size(), world);
        let devs: Vec<_> = (0..world).map(|r| CpuDevice::new(r, 1, 100)).collect();
        let comm: Vec<CpuBuf> = devs
            .iter()
            .map(|d| d.alloc_shared(layout.total_bytes()).unwrap().0)
            .collect();
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| ((i * 7 + r * 13) % 29) as f32 - 14.0 + r as f32 * 0.25)
                    .collect()
            })
            .collect();
        let expect: Vec<f32> = (0..n)
            .map(|i| {
                let xs: Vec<f32> = inputs
                    .iter()
                    .map(|v| decode(dtype, &encode(dtype, &[v[i]]))[0])
                    .collect();
                let s = xs[1..].iter().fold(xs[0], |a, x| a + x);
                decode(dtype, &encode(dtype, &[s]))[0]
            })
            .collect();
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let (dev, comm, input) = (&devs[r], &comm, &inputs[r]);
                    s.spawn(move || {
                        let data = dev.alloc(n * dtype.size()).unwrap();
                        let refs: Vec<&CpuBuf> = comm.iter().collect();
                        let mut out = Vec::new();
                        for epoch in 1..=3u32 {
                            dev.write(&data, 0, &encode(dtype, input)).unwrap();
                            let args = AllreduceArgs {
                                algo,
                                rank: r,
                                world,
                                epoch,
                                data: View::new(&data, 0, n, dtype),
                                comm: &refs,
                                layout,
                                timeout: Duration::from_secs(10),
                                abort: None,
                                add_norm: None,
                            };
                            dev.run(&Op::Allreduce(args)).unwrap();
                            let mut bytes = vec![0u8; n * dtype.size()];
                            dev.read(&data, 0, &mut bytes).unwrap();
                            out = decode(dtype, &bytes);
                        }
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in results.iter().enumerate() {
            for i in 0..n {
                assert_eq!(
                    res[i].to_bits(),
                    expect[i].to_bits(),
                    "rank {r} elem {i} {algo:?} {dtype}"
                );
            }
        }
    }

    #[test]
    fn oneshot_and_twoshot_match_rank_order_sum() {
        for algo in [CommAlgo::Oneshot, CommAlgo::Twoshot] {
            for dtype in DType::ALL {
                for (world, n) in [(1, 5), (2, 1), (3, 7), (4, 1000), (5, 3)] {
                    run_world(world, n, dtype, algo);
                }
            }
        }
    }

    /// Back-to-back calls that switch algorithm every call, the `host` one composed as the
    /// communicator does it (copy into the slot, barrier, `HostReduce`, no closing barrier),
    /// with message sizes that change too: every result must be the exact rank-order sum.
    #[test]
    fn mixed_algorithms_back_to_back_reuse_slots_safely() {
        let world = 3;
        let max = 5000;
        let layout = CommLayout::new(max * 4, world);
        let devs: Vec<_> = (0..world).map(|r| CpuDevice::new(r, 1, 100)).collect();
        let comm: Vec<CpuBuf> = devs
            .iter()
            .map(|d| d.alloc_shared(layout.total_bytes()).unwrap().0)
            .collect();
        let barrier = std::sync::Barrier::new(world);
        let input = |call: usize, r: usize, i: usize| ((call * 31 + r * 7 + i) % 97) as f32 - 48.0;
        let algos = [CommAlgo::Oneshot, CommAlgo::HostReduce, CommAlgo::Twoshot];
        std::thread::scope(|s| {
            for r in 0..world {
                let (dev, comm, barrier) = (&devs[r], &comm, &barrier);
                s.spawn(move || {
                    let data = dev.alloc(max * 4).unwrap();
                    let refs: Vec<&CpuBuf> = comm.iter().collect();
                    for call in 0..60usize {
                        let epoch = call as u32 + 1;
                        let algo = algos[(call * 7 / 3) % 3];
                        let n = [1, 4999, 17, 2048, 5000][call % 5];
                        let mine: Vec<f32> = (0..n).map(|i| input(call, r, i)).collect();
                        dev.write(&data, 0, &encode(DType::F32, &mine)).unwrap();
                        let view = View::new(&data, 0, n, DType::F32);
                        if algo == CommAlgo::HostReduce {
                            let slot = View::new(refs[r], layout.slot_offset(epoch), n, DType::F32);
                            dev.run(&Op::Copy(crate::ops::Copy {
                                src: view,
                                dst: slot,
                            }))
                            .unwrap();
                            barrier.wait();
                        }
                        let args = AllreduceArgs {
                            algo,
                            rank: r,
                            world,
                            epoch,
                            data: view,
                            comm: &refs,
                            layout,
                            timeout: Duration::from_secs(10),
                            abort: None,
                            add_norm: None,
                        };
                        dev.run(&Op::Allreduce(args)).unwrap();
                        let mut bytes = vec![0u8; n * 4];
                        dev.read(&data, 0, &mut bytes).unwrap();
                        let got = decode(DType::F32, &bytes);
                        for (i, g) in got.iter().enumerate() {
                            let want =
                                (1..world).fold(input(call, 0, i), |a, q| a + input(call, q, i));
                            assert_eq!(
                                *g, want,
                                "rank {r} call {call} ({algo:?}, n {n}) element {i}"
                            );
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_missing_peer_times_out_naming_it() {
        let layout = CommLayout::new(64, 2);
        let dev = CpuDevice::new(0, 1, 10);
        let comm: Vec<CpuBuf> = (0..2)
            .map(|_| dev.alloc_shared(layout.total_bytes()).unwrap().0)
            .collect();
        let refs: Vec<&CpuBuf> = comm.iter().collect();
        let data = dev.alloc(64).unwrap();
        let args = AllreduceArgs {
            algo: CommAlgo::Oneshot,
            rank: 0,
            world: 2,
            epoch: 1,
            data: View::new(&data, 0, 16, DType::F32),
            comm: &refs,
            layout,
            timeout: Duration::from_millis(50),
            abort: None,
            add_norm: None,
        };
        match dev.run(&Op::Allreduce(args)) {
            Err(KernelError::Timeout { peers, .. }) => assert_eq!(peers, vec![1]),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}

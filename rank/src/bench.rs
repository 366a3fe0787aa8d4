//! `bench allreduce` on one rank: runs the spec's rows in order and reports each row's
//! per-iteration times and, with `check`, the number of wrong elements.

use tprun_ipc::{Conn, Msg};
use tprun_kernels::dtype::Elem;
use tprun_kernels::with_dtype;
use tprun_kernels::{DType, Device, View};

use crate::comm::Communicator;
use crate::job::{self, BenchSpec, Report};
use crate::run::RankCtx;
use crate::{Phase, RankError};

/// The input of rank `r` at iteration `it`, element `i`: small multiples of 1/2 in [-4, 4],
/// exact in every dtype, and different for every iteration so that a stale result is caught.
pub fn input_value(i: usize, r: usize, it: u32) -> f32 {
    ((i * 7 + r * 13 + it as usize * 5) % 17) as f32 * 0.5 - 4.0
}

/// This rank's input for iteration `it`, encoded as `dtype` bytes.
pub fn input_bytes(dtype: DType, count: usize, rank: usize, it: u32) -> Vec<u8> {
    with_dtype!(dtype, T => into_bytes::<T>(
        (0..count).map(|i| T::from_f32(input_value(i, rank, it))).collect()
    ))
}

/// The reference: rank-order f32 sum of the dtype-rounded inputs, rounded once to `dtype`
/// (the inputs are exact in every dtype, so this is also the exact sum).
pub fn expected(dtype: DType, count: usize, world: usize, it: u32) -> Vec<u8> {
    with_dtype!(dtype, T => into_bytes::<T>(
        (0..count)
            .map(|i| {
                let v = |r| T::from_f32(input_value(i, r, it)).to_f32();
                T::from_f32((1..world).fold(v(0), |acc, r| acc + v(r)))
            })
            .collect()
    ))
}

/// The bytes of a vector of elements (little endian, as on every target we build for).
fn into_bytes<T: Elem>(v: Vec<T>) -> Vec<u8> {
    // SAFETY: T is f32, f16 or bf16: plain data with no padding; the slice covers exactly the
    // vector's initialised elements and is copied before `v` is dropped.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])) }
        .to_vec()
}

/// Checked calls per row with `--check`, each with its own inputs.
pub const CHECK_ITERS: u32 = 3;

pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    comm: &mut Communicator<D>,
    dev: &D,
    spec: &BenchSpec,
) -> Result<(), RankError> {
    let (rank, world) = (ctx.rank, ctx.world);
    let max_bytes = spec.max_bytes();
    let data = dev.alloc(max_bytes.max(1))?;
    ctx.enter(Phase::Allreduce);
    for (index, row) in spec.rows.iter().enumerate() {
        let bytes = row.count * row.dtype.size();
        let mut times = Vec::with_capacity(row.iters as usize);
        // Timed calls: the same input each time (copied in, not recomputed), so that nothing but
        // the allreduce runs between two calls. Host work between timed calls (recomputing
        // inputs, checking outputs) made 4 ranks on 2 cores 3-4x slower at 64-256 KiB: the
        // scheduler then interleaves ranks mid-call (docs/perf-notes.md).
        let input = input_bytes(row.dtype, row.count, rank, 0);
        for it in 0..row.warmup + row.iters {
            dev.write(&data, 0, &input)?;
            // Start every timed call together, so each rank's time is the call's latency and
            // not the time it waited for a late peer.
            comm.barrier()?;
            let view = View::new(&data, 0, row.count, row.dtype);
            // `Device::time` speaks KernelError; keep the communicator's own (typed) error.
            let mut failure = None;
            let t = dev.time(&mut || {
                comm.allreduce_with(row.algo, view).map_err(|e| {
                    let msg = e.to_string();
                    failure = Some(e);
                    tprun_kernels::KernelError::Backend(msg)
                })
            });
            if let Some(e) = failure {
                return Err(e);
            }
            let t = t?;
            if it >= row.warmup {
                times.push(t.as_secs_f32() * 1e6);
            }
        }
        // The same call replayed from a device graph, where the backend and algorithm allow:
        // what a captured decode step pays per allreduce (no launch gaps).
        dev.write(&data, 0, &input)?;
        comm.barrier()?;
        let graph_us = comm
            .graph_time(
                row.algo,
                View::new(&data, 0, row.count, row.dtype),
                row.iters.max(20),
            )?
            .map(|t| t.as_secs_f32() * 1e6);
        // Checked calls, untimed: fresh inputs every call (a stale result cannot pass), every
        // element compared with the exact reference.
        let mut wrong = 0u64;
        if spec.check {
            let mut out = vec![0u8; bytes];
            for it in 1..=CHECK_ITERS {
                dev.write(&data, 0, &input_bytes(row.dtype, row.count, rank, it))?;
                comm.barrier()?;
                comm.allreduce_with(row.algo, View::new(&data, 0, row.count, row.dtype))?;
                dev.read(&data, 0, &mut out)?;
                let want = expected(row.dtype, row.count, world, it);
                wrong += out
                    .chunks_exact(row.dtype.size())
                    .zip(want.chunks_exact(row.dtype.size()))
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        }
        let report = Report::BenchRow {
            index: index as u32,
            resolved: comm.resolve(row.algo, bytes),
            times_us: times,
            wrong,
            graph_us,
        };
        conn.send(
            &Msg::Report {
                payload: job::encode(&report),
            },
            &[],
        )?;
    }
    comm.close()
}

//! `bench gemv` on one rank: the device copy bandwidth (the ceiling), then each row's
//! matrix–vector product alone, dense (`Matmul`) or GPTQ int4 (`MatmulInt4`), with the bytes
//! it must read, reported to the coordinator.
//!
//! On GPUs a row is timed as graph replays of back-to-back launches that rotate through
//! copies of the weights filling [`ROTATE_BYTES`], so that no call finds its weights in the
//! L2 cache left by the call before (an H200's is 60 MB; the gate|up of a 27B model in int4
//! is 92 MB, the down_proj 46 MB): the method of gemv.cu's table. The CPU backend runs each
//! call directly over one copy (slow: for CI's smoke test).

use tprun_ipc::{Conn, Msg};
use tprun_kernels::ops::{Copy, Epilogue, Fill, Matmul, MatmulInt4, Prologue, ReduceSum};
use tprun_kernels::rng::Rng;
use tprun_kernels::{DType, Device, Op, View};

use crate::job::{self, GemvBenchSpec, GemvQuant, GemvRow, Report};
use crate::run::RankCtx;
use crate::RankError;

/// Bytes of weight copies a GPU row rotates through, and of the device copy that measures the
/// ceiling: 1 GiB, 17× the H200's 60 MB L2 (gemv.cu's method).
pub const ROTATE_BYTES: usize = 1 << 30;
/// The ceiling's copy on the CPU backend: 64 MiB, well beyond a CPU's last-level cache.
const CPU_COPY_BYTES: usize = 64 << 20;
/// At most this many weight copies per row (a small matrix would otherwise need thousands
/// of launches per replay).
const MAX_COPIES: usize = 64;

/// One copy of a row's weights on the device.
struct Weights<B> {
    bufs: Vec<B>,
}

/// The host bytes of a row's weight buffers, in the order of [`op`]'s views, and each
/// buffer's (element count, dtype): random values (the time does not depend on them).
fn host_weights(r: &GemvRow, rng: &mut Rng) -> Vec<(Vec<u8>, usize, DType)> {
    let words = |len: usize, rng: &mut Rng| -> Vec<u8> {
        (0..len)
            .flat_map(|_| (rng.next_u64() as u32).to_le_bytes())
            .collect()
    };
    match r.quant {
        GemvQuant::Dense(dtype) => {
            let v: Vec<f32> = (0..r.n * r.k).map(|_| rng.f32_sym() * 0.05).collect();
            vec![(tprun_kernels::dtype::encode(dtype, &v), r.n * r.k, dtype)]
        }
        GemvQuant::Int4 { group, desc_act } => {
            let groups = r.k / group;
            let scales: Vec<u8> = (0..r.n * groups)
                .flat_map(|_| half::f16::from_f32(0.01 + 0.01 * rng.f32_sym()).to_le_bytes())
                .collect();
            let zw = groups.div_ceil(8);
            let mut out = vec![
                (words(r.n * r.k / 8, rng), r.n * r.k / 8, DType::U32),
                (scales, r.n * groups, DType::F16),
                (words(r.n * zw, rng), r.n * zw, DType::U32),
            ];
            if desc_act {
                let mut perm: Vec<u32> = (0..r.k as u32).collect();
                for i in (1..r.k).rev() {
                    perm.swap(i, rng.next_u64() as usize % (i + 1));
                }
                let bytes = perm.iter().flat_map(|p| p.to_le_bytes()).collect();
                out.push((bytes, r.k, DType::U32));
            }
            out
        }
    }
}

/// The row's prologue and epilogue (its `silu` and `glu` flags).
fn acts(r: &GemvRow) -> (Prologue, Epilogue) {
    let prologue = if r.silu {
        Prologue::SiluMul
    } else {
        Prologue::None
    };
    let epilogue = if r.glu {
        Epilogue::SiluMul
    } else {
        Epilogue::None
    };
    (prologue, epilogue)
}

/// The row's op over one copy of its weights.
fn op<'a, B>(
    r: &GemvRow,
    w: &'a Weights<B>,
    lens: &[(usize, DType)],
    x: View<'a, B>,
    y: View<'a, B>,
) -> Op<'a, B> {
    let v = |i: usize| View::new(&w.bufs[i], 0, lens[i].0, lens[i].1);
    let (prologue, epilogue) = acts(r);
    match r.quant {
        GemvQuant::Dense(_) => Op::Matmul(Matmul {
            x,
            w: v(0),
            bias: None,
            y,
            m: r.m,
            k: r.k,
            n: r.n,
            prologue,
            epilogue,
        }),
        GemvQuant::Int4 { group, desc_act } => Op::MatmulInt4(MatmulInt4 {
            x,
            qweight: v(0),
            scales: v(1),
            zeros: v(2),
            perm: desc_act.then(|| v(3)),
            y,
            m: r.m,
            k: r.k,
            n: r.n,
            group,
            groups: r.k / group,
            prologue,
            epilogue,
        }),
    }
}

/// Seconds per call of `ops` (each run once per pass): per graph replay of all of them where
/// the backend has graphs (and whether it did), else per direct call.
fn time_calls<D: Device>(
    dev: &D,
    ops: &[Op<'_, D::Buf>],
    warmup: u32,
    iters: u32,
) -> Result<(f64, bool), RankError> {
    let mut pass = || -> tprun_kernels::Result<()> {
        for op in ops {
            dev.run(op)?;
        }
        Ok(())
    };
    for _ in 0..warmup {
        pass()?;
    }
    let calls = ops.len().max(1) as f64;
    if let Some(t) = dev.time_graph(iters, &mut pass)? {
        return Ok((t.as_secs_f64() / calls, true));
    }
    let t = dev.time(&mut || {
        for _ in 0..iters {
            pass()?;
        }
        Ok(())
    })?;
    Ok((t.as_secs_f64() / (calls * f64::from(iters.max(1))), false))
}

fn send(conn: &Conn, report: &Report) -> Result<(), RankError> {
    conn.send(
        &Msg::Report {
            payload: job::encode(report),
        },
        &[],
    )?;
    Ok(())
}

pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: &D,
    spec: &GemvBenchSpec,
) -> Result<(), RankError> {
    let gpu = dev.info().backend != "cpu";
    let iters = spec.iters.unwrap_or(if gpu { 50 } else { 2 });
    // The ceiling: one device copy, read + written, by the driver's copy and by a copy kernel
    // (a one-input ReduceSum): on an H100 the driver's copy of 1 GiB reached 2.45 TB/s where
    // a kernel (torch's) reached 3.02, so the faster of the two is the ceiling.
    let cb = if gpu { ROTATE_BYTES } else { CPU_COPY_BYTES };
    let (a, b) = (dev.alloc(cb)?, dev.alloc(cb)?);
    let (src, dst) = (
        View::new(&a, 0, cb / 4, DType::F32),
        View::new(&b, 0, cb / 4, DType::F32),
    );
    // The source is finite f32 (the kernel adds, so no NaN payloads to carry).
    dev.run(&Op::Fill(Fill {
        dst: src,
        value: 1.0,
    }))?;
    let by_memcpy = [Op::Copy(Copy { src, dst })];
    let inputs = [src];
    let by_kernel = [Op::ReduceSum(ReduceSum {
        inputs: &inputs,
        out: dst,
    })];
    let (memcpy, _) = ctx.beating(|| time_calls(dev, &by_memcpy, spec.warmup, iters))?;
    let (kernel, _) = ctx.beating(|| time_calls(dev, &by_kernel, spec.warmup, iters))?;
    drop((a, b));
    send(
        conn,
        &Report::CopyBandwidth {
            bytes: 2 * cb as u64,
            memcpy_us: memcpy * 1e6,
            kernel_us: kernel * 1e6,
        },
    )?;
    let mut rng = Rng::new(0x6265_6e63_6867_656d); // "benchgem"
    for (index, r) in spec.rows.iter().enumerate() {
        let (us, bytes, graph) = ctx.beating(|| -> Result<_, RankError> {
            let host = host_weights(r, &mut rng);
            let lens: Vec<(usize, DType)> = host.iter().map(|h| (h.1, h.2)).collect();
            let bytes: usize = host.iter().map(|h| h.0.len()).sum();
            let copies = if gpu {
                ROTATE_BYTES.div_ceil(bytes.max(1)).clamp(2, MAX_COPIES)
            } else {
                1
            };
            let mut ws = Vec::with_capacity(copies);
            for _ in 0..copies {
                let mut bufs = Vec::with_capacity(host.len());
                for (h, _, _) in &host {
                    let buf = dev.alloc(h.len().max(4))?;
                    dev.write(&buf, 0, h)?;
                    bufs.push(buf);
                }
                ws.push(Weights { bufs });
            }
            let (prologue, epilogue) = acts(r);
            let (xk, yn) = (prologue.x_width(r.k), epilogue.y_width(r.n));
            let x: Vec<f32> = (0..r.m * xk).map(|_| rng.f32_sym()).collect();
            let bx = dev.alloc(x.len() * 4)?;
            dev.write(&bx, 0, &tprun_kernels::dtype::encode(DType::F32, &x))?;
            let by = dev.alloc(r.m * yn * 4)?;
            let (xv, yv) = (
                View::new(&bx, 0, x.len(), DType::F32),
                View::new(&by, 0, r.m * yn, DType::F32),
            );
            let ops: Vec<_> = ws.iter().map(|w| op(r, w, &lens, xv, yv)).collect();
            let (s, graph) = time_calls(dev, &ops, spec.warmup, iters)?;
            Ok((s * 1e6, bytes, graph))
        })?;
        send(
            conn,
            &Report::GemvRow {
                index: index as u32,
                bytes: bytes as u64,
                us,
                graph,
            },
        )?;
    }
    Ok(())
}

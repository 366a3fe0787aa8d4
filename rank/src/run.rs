//! A rank's life: join the job, build the device, set up the communicator, run the task,
//! report. The library entry point for embedding a rank in another program is [`run`].

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tprun_ipc::{Conn, ControlBlock, Msg};
use tprun_kernels::cpu::CpuDevice;
use tprun_kernels::cuda;
use tprun_kernels::Device;

use crate::comm::Communicator;
use crate::job::{self, Backend, JobSpec, Plan, Task};
use crate::{Phase, RankError};

/// How long a rank waits for the coordinator's answer to `Hello`.
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Spin iterations before a wait sleeps. One iteration is a load and a `pause` (~25 ns on the
/// AMD EPYC CI machine; docs/perf-notes.md): ~50 µs of spinning when every rank has a core of
/// its own, ~1 µs when ranks outnumber cores (then the rank we wait for needs our core).
/// 20 000 (0.5 ms) made two ranks on two busy cores take 1 ms per call.
const SPIN_DEDICATED: u32 = 2_000;
const SPIN_OVERSUBSCRIBED: u32 = 50;

pub struct RankOptions {
    /// The coordinator's rendezvous socket.
    pub socket: PathBuf,
    pub rank: usize,
    /// The job token (from `TPRUN_JOB_TOKEN` or a token file).
    pub token: [u8; 16],
}

/// What every part of a running rank shares.
pub struct RankCtx {
    pub rank: usize,
    pub world: usize,
    /// This rank's device as the coordinator assigned it ([`job::Plan::device`]).
    pub device: usize,
    pub control: Arc<ControlBlock>,
}

impl RankCtx {
    /// Records that this rank enters `phase` (and triggers a test fault planned for it).
    pub fn enter(&self, phase: Phase) {
        self.control.set_phase(self.rank, phase.code());
        crate::fault::at(self.rank, phase);
    }

    /// Runs `f`, bumping this rank's heartbeat every 500 ms meanwhile: for long work with no
    /// waits in it (loading weights), which the coordinator must not take for a stall.
    pub fn beating<T>(&self, f: impl FnOnce() -> T) -> T {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                // Ends as soon as `stop` is dropped (Disconnected), not at the next beat.
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(Duration::from_millis(500))
                {
                    self.control.beat(self.rank);
                }
            });
            let out = f();
            drop(stop);
            out
        })
    }
}

/// A job token as `TPRUN_JOB_TOKEN` and token files spell it: 32 hex digits (surrounding
/// white space ignored).
pub fn parse_token(s: &str) -> Option<[u8; 16]> {
    let s = s.trim();
    if s.len() != 32 {
        return None;
    }
    let mut t = [0u8; 16];
    for (i, b) in t.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(t)
}

/// Embeds rank `rank` of a tprun job in this process: connects to the coordinator's
/// rendezvous socket, proves it belongs to the job with `token` (32 hex digits, as the
/// coordinator's `TPRUN_JOB_TOKEN`), takes its plan (the task, the device, every setting the
/// ranks must agree on) and runs its share to the end: the same code as `tprun rank --join`.
/// Returns when the job is done; an error says why (`is_join()`: never admitted, so the
/// coordinator knows nothing of it; `is_abort()`: another part of the job failed first).
///
/// The process should have nothing else on the device the plan names, and must not call this
/// twice at once: a rank uses its device and the job's control block as its own.
///
/// ```
/// // No coordinator listens here: the rank says so as a join error and returns.
/// let err = tprun_rank::join(
///     std::path::Path::new("/nonexistent/tprun-rendezvous"),
///     0,
///     "00112233445566778899aabbccddeeff",
/// )
/// .unwrap_err();
/// assert!(err.is_join(), "{err}");
/// assert!(err.to_string().contains("/nonexistent/tprun-rendezvous"));
/// ```
///
/// Embedded in a server's own binary, given the address and token the coordinator printed:
///
/// ```no_run
/// let socket = std::env::var("TPRUN_JOIN").expect("the coordinator's socket");
/// let token = std::env::var("TPRUN_JOB_TOKEN").expect("the job token");
/// let rank: usize = std::env::var("TPRUN_RANK").map_or(0, |r| r.parse().unwrap());
/// if let Err(e) = tprun_rank::join(std::path::Path::new(&socket), rank, &token) {
///     eprintln!("rank {rank}: {e}");
///     std::process::exit(if e.is_abort() { 3 } else { 1 });
/// }
/// ```
pub fn join_job(socket: &Path, rank: usize, token: &str) -> Result<(), RankError> {
    let token = parse_token(token).ok_or_else(|| {
        RankError::Join(format!(
            "rank {rank}: the job token is not 32 hex digits (joining {})",
            socket.display()
        ))
    })?;
    run(RankOptions {
        socket: socket.to_path_buf(),
        rank,
        token,
    })
}

/// Joins the job at `opts.socket` and runs this rank's share of it to the end.
///
/// Once admitted, a failure is also reported to the coordinator (best effort) before
/// returning; a failure to join ([`RankError::is_join`]) only the caller hears of.
pub fn run(opts: RankOptions) -> Result<(), RankError> {
    crate::fault::at(opts.rank, Phase::Starting);
    let (conn, world, plan, control) = join(&opts)?;
    control.set_pid(opts.rank, std::process::id());
    let spec = plan.job;
    let ctx = RankCtx {
        rank: opts.rank,
        world,
        device: plan.device,
        control,
    };
    ctx.enter(Phase::Setup);
    let result = match &spec.task {
        // The kernel checks open devices of their own.
        Task::Selftest(s) => crate::selftest::run(&ctx, &conn, &spec, s),
        _ => open_and_run(&ctx, &conn, &spec),
    };
    match &result {
        Ok(()) => {
            ctx.control.set_phase(ctx.rank, Phase::Finishing.code());
            conn.send(&Msg::Done, &[])?;
        }
        Err(e) => {
            let failure = e.failure(ctx.control.phase_name(ctx.rank));
            let _ = conn.send(
                &Msg::Failed {
                    payload: job::encode(&failure),
                },
                &[],
            );
        }
    }
    result
}

/// Connects to the coordinator at `opts.socket`, says Hello and takes the Welcome: the job's
/// world, this rank's plan and the control block. Every failure here is a
/// [`RankError::Join`] naming the address: the coordinator has not admitted us, so it reports
/// nothing of ours.
fn join(opts: &RankOptions) -> Result<(Conn, usize, Plan, Arc<ControlBlock>), RankError> {
    let at = opts.socket.display();
    let fail = join_error(opts.rank);
    // The error names the address ("connecting to ...: Connection refused").
    let conn = Conn::connect(&opts.socket).map_err(|e| fail(e.to_string()))?;
    conn.send(
        &Msg::Hello {
            token: opts.token,
            rank: opts.rank as u32,
            pid: std::process::id(),
        },
        &[],
    )
    .map_err(|e| fail(format!("sending Hello to {at}: {e}")))?;
    let (msg, fds) = conn.recv(Some(JOIN_TIMEOUT)).map_err(|e| {
        fail(format!(
            "waiting for the answer of the coordinator at {at}: {e}"
        ))
    })?;
    let (world, plan, control) = admitted(msg, fds, opts)?;
    Ok((conn, world, plan, Arc::new(control)))
}

/// The rank's side of the handshake: the coordinator's answer to `Hello` (a frame and its
/// descriptors) checked and opened into the world size, the plan and the job's control block.
/// Separate from [`join`]'s socket work so that the fuzz target can feed it any frame; every
/// failure is a [`RankError::Join`] naming `opts.socket`, as in [`join`].
pub fn admitted(
    msg: Msg,
    mut fds: Vec<OwnedFd>,
    opts: &RankOptions,
) -> Result<(usize, Plan, ControlBlock), RankError> {
    let at = opts.socket.display();
    let fail = join_error(opts.rank);
    let (world, plan) = match msg {
        Msg::Welcome { world, job } => (
            world as usize,
            job::decode::<Plan>(&job).map_err(|e| fail(format!("the plan from {at}: {e}")))?,
        ),
        Msg::Refused { reason } => {
            return Err(fail(format!(
                "the coordinator at {at} refused it: {reason}"
            )))
        }
        other => return Err(fail(format!("expected Welcome from {at}, got {other:?}"))),
    };
    let cb_fd = fds.pop().ok_or_else(|| {
        fail(format!(
            "the Welcome from {at} came without the control block"
        ))
    })?;
    let control = ControlBlock::open(cb_fd, world, &opts.token)
        .map_err(|e| fail(format!("the control block from {at}: {e}")))?
        .with_phase_names(&Phase::NAMES);
    Ok((world, plan, control))
}

/// The [`RankError::Join`] of rank `rank`, from what went wrong.
fn join_error(rank: usize) -> impl Fn(String) -> RankError {
    move |what| RankError::Join(format!("rank {rank} could not join: {what}"))
}

/// Opens this rank's device with the job's settings and runs the task on it.
fn open_and_run(ctx: &RankCtx, conn: &Conn, spec: &JobSpec) -> Result<(), RankError> {
    let spin = if spec.oversubscribed {
        SPIN_OVERSUBSCRIBED
    } else {
        SPIN_DEDICATED
    };
    match spec.backend {
        Backend::Cpu => {
            let dev = CpuDevice::new(ctx.device, spec.threads, spin);
            run_task(ctx, conn, Arc::new(dev), spec, spin)
        }
        Backend::Cuda => {
            // CUDA_VISIBLE_DEVICES (set by the coordinator) makes our device ordinal 0.
            // Opening compiles every kernel module with NVRTC when the kernel cache is cold
            // (tens of seconds on a new machine, more than a default --timeout): work, not a
            // stall, so the heartbeat goes on meanwhile (an H200's first jobs exited 4).
            let dev = ctx.beating(|| cuda::CudaDevice::open(0, spec.ipc, &spec.comm))?;
            dev.set_pdl(spec.pdl);
            run_task(ctx, conn, Arc::new(dev), spec, spin)
        }
        Backend::Hip => {
            // The same GPU backend over the HIP table; HIP_VISIBLE_DEVICES (set by the
            // coordinator) makes our device ordinal 0, and hiprtc builds the kernels on a cold
            // cache (beat meanwhile, as for CUDA).
            let dev = ctx.beating(|| {
                let driver = cuda::Gpu::Hip.driver()?;
                cuda::CudaDevice::open_with(driver, 0, spec.ipc, &spec.comm)
            })?;
            dev.set_pdl(spec.pdl);
            run_task(ctx, conn, Arc::new(dev), spec, spin)
        }
    }
}

fn run_task<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    spec: &JobSpec,
    spin: u32,
) -> Result<(), RankError> {
    let timeout = Duration::from_millis(spec.timeout_ms);
    match &spec.task {
        Task::Bench(b) => {
            let max = b.max_bytes();
            let mut comm =
                Communicator::establish(dev.clone(), conn, ctx, spec.backend, max, timeout, spin)?;
            crate::bench::run(ctx, conn, &mut comm, &*dev, b)
        }
        Task::Decode(d) => crate::decode::run(ctx, conn, dev, spec.backend, d, timeout, spin),
        Task::BenchGemv(b) => crate::bench_gemv::run(ctx, conn, &*dev, b),
        Task::Serve(s) => crate::serve::run(ctx, conn, dev, spec.backend, s, timeout, spin),
        Task::Selftest(_) => unreachable!("selftest opens its own devices"),
    }
}

//! tprun: the coordinator binary. Glues the crates together: parses the CLI, validates it into
//! [`Settings`], starts and supervises jobs, prints tables and text. It never touches device
//! memory; ranks (re-executions of this binary as `tprun rank`) do.

mod bench;
mod bench_gemv;
mod decode;
mod hostmem;
mod info;
mod launch;
mod serve;

// The parsers live in the library target, where the fuzz targets reach them.
use tprun::{cli, tokenizer};

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};
use cli::{BackendArg, BenchCommand, Cli, Command};
use launch::Launch;
use tprun_ipc::control::MAX_RANKS;
use tprun_kernels::{CommSettings, DType, IpcMode};
use tprun_rank::job::{Backend, JobSpec, Task};

/// Validated global settings.
pub struct Settings {
    /// `--backend` was given (not `auto`).
    pub backend_explicit: bool,
    pub world: usize,
    pub devices: Vec<usize>,
    pub backend: Backend,
    pub ipc: IpcMode,
    /// GPU allreduce kernel settings, from the A/B environment knobs ([`comm_settings`]).
    pub comm: CommSettings,
    /// CUDA decode kernels with programmatic dependent launch (default; `TPRUN_CUDA_PDL=0`
    /// turns it off, an A/B knob).
    pub pdl: bool,
    pub timeout: Duration,
}

impl Settings {
    /// The settings of a job command. `default_world`: ranks when neither --ranks nor
    /// --devices is given. The flags' own bounds were checked as they were parsed (cli.rs);
    /// this checks how they combine.
    fn from_cli(cli: &Cli, default_world: usize) -> Result<Settings, String> {
        let world = match (cli.ranks, &cli.devices) {
            (Some(n), _) => n,
            (None, Some(d)) => d.len(),
            (None, None) => default_world,
        };
        if world == 0 || world > MAX_RANKS {
            return Err(format!(
                "--devices lists {world} device(s); a job has 1 to {MAX_RANKS} ranks"
            ));
        }
        let mut devices = match &cli.devices {
            Some(d) if d.len() != world => {
                return Err(format!(
                    "--devices lists {} device(s) for {world} rank(s); give one per rank",
                    d.len()
                ))
            }
            Some(d) => d.clone(),
            None => (0..world).collect(),
        };
        // A default world of several ranks (selftest's) goes round the visible GPUs: two
        // ranks share the one GPU of a one-GPU machine rather than fall back to the CPU.
        let wrap = |n: usize, devices: &mut Vec<usize>| {
            if cli.ranks.is_none() && cli.devices.is_none() {
                devices.iter_mut().for_each(|d| *d %= n);
            }
        };
        let backend = match cli.backend {
            BackendArg::Cpu => Backend::Cpu,
            BackendArg::Auto => match cuda_devices() {
                Ok(n) if n > 0 => {
                    wrap(n, &mut devices);
                    if devices.iter().all(|&d| d < n) {
                        Backend::Cuda
                    } else {
                        Backend::Cpu
                    }
                }
                _ => Backend::Cpu,
            },
            BackendArg::Cuda | BackendArg::Hip => {
                let backend = match cli.backend {
                    BackendArg::Hip => Backend::Hip,
                    _ => Backend::Cuda,
                };
                // Ranks that join from elsewhere (serve --listen) have GPUs we need not see.
                if !remote_ranks(cli) {
                    let n = explicit_gpu(cli.backend)?;
                    wrap(n, &mut devices);
                    if let Some(&d) = devices.iter().find(|&&d| d >= n) {
                        return Err(format!(
                            "--devices names device {d}, but only {n} {} device(s) are visible",
                            backend.name().to_uppercase()
                        ));
                    }
                }
                backend
            }
        };
        Ok(Settings {
            backend_explicit: cli.backend != BackendArg::Auto,
            world,
            devices,
            backend,
            ipc: cli.ipc,
            comm: comm_settings()?,
            pdl: std::env::var("TPRUN_CUDA_PDL").map_or(true, |v| v != "0"),
            timeout: Duration::from_secs_f64(cli.timeout),
        })
    }

    /// A job of `--ranks` ranks on `--devices`.
    pub fn launch(&self, task: Task) -> Launch {
        self.launch_on(self.devices.clone(), task)
    }

    /// A job of one rank per entry of `devices`.
    pub fn launch_on(&self, devices: Vec<usize>, task: Task) -> Launch {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let world = devices.len();
        Launch {
            world,
            devices,
            timeout: self.timeout,
            listen: None,
            spec: JobSpec {
                backend: self.backend,
                ipc: self.ipc,
                comm: self.comm,
                pdl: self.pdl,
                timeout_ms: self.timeout.as_millis() as u64,
                threads: (cores / world).max(1),
                oversubscribed: world > cores,
                task,
            },
        }
    }
}

/// The GPU allreduce settings of a job: the defaults, changed by the coordinator's A/B knobs
/// (README): `TPRUN_CUDA_LL=0`, `TPRUN_CUDA_MEMCPY=1`, `TPRUN_CUDA_COMM_BLOCKS=N`. Read here,
/// once, and sent to every rank in the job spec, so that all ranks use the same.
fn comm_settings() -> Result<CommSettings, String> {
    let var = |k| std::env::var(k).ok();
    let d = CommSettings::default();
    let comm_blocks = match var("TPRUN_CUDA_COMM_BLOCKS") {
        None => d.comm_blocks,
        Some(v) => Some(v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| {
            format!("TPRUN_CUDA_COMM_BLOCKS='{v}': expected a positive number of blocks")
        })?),
    };
    Ok(CommSettings {
        low_latency: var("TPRUN_CUDA_LL").map_or(d.low_latency, |v| v != "0"),
        small_copy_kernel: var("TPRUN_CUDA_MEMCPY").map_or(d.small_copy_kernel, |v| v != "1"),
        comm_blocks,
    })
}

/// A dtype flag's value: one of [`DType::parse`]'s names, or one of the flag's `keywords`
/// (`auto`, `all`), which gives `None`. Every dtype flag goes through here, so all accept the
/// same names and fail with the same wording.
pub fn dtype_arg(flag: &str, s: &str, keywords: &[&str]) -> Result<Option<DType>, String> {
    if keywords.contains(&s) {
        return Ok(None);
    }
    DType::parse(s).map(Some).ok_or_else(|| {
        let choices: Vec<&str> = keywords
            .iter()
            .copied()
            .chain(DType::ALL.map(DType::name))
            .collect();
        format!("unknown {flag} '{s}' ({})", choices.join(", "))
    })
}

/// Visible CUDA devices, or why the CUDA backend cannot be used (driver or NVRTC missing).
fn cuda_devices() -> Result<usize, String> {
    use tprun_kernels::cuda;
    let devs = cuda::probe().map_err(|e| unusable_why(&e))?;
    if !devs.is_empty() && !cuda::nvrtc_present() {
        return Err(
            "NVRTC (libnvrtc.so) was not found on the library path; it compiles the \
                    kernels at run time (CUDA 13 installs libnvrtc.so.13: link libnvrtc.so to it \
                    or add its folder to LD_LIBRARY_PATH)"
                .into(),
        );
    }
    Ok(devs.len())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TPRUN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .try_init();
}

fn main() -> ExitCode {
    // Like any filter-friendly CLI: when stdout's reader goes away (`tprun ... | head`), die
    // quietly by SIGPIPE instead of panicking in println!. Ranks die with us (PDEATHSIG), and
    // our sockets send with MSG_NOSIGNAL, so only stdout/stderr writes are affected.
    // SAFETY: restoring the default disposition of a signal before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    init_logging();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = check_ignored_globals(&cli, &matches) {
        return ExitCode::from(usage_error(&e) as u8);
    }
    ExitCode::from(run(cli).clamp(0, 255) as u8)
}

/// This rank was spawned by the coordinator that is its parent (see `launch::spawn_rank`),
/// which reports its errors; one started by hand or in a container says them itself.
fn spawned_by_parent() -> bool {
    std::env::var("TPRUN_SPAWNED_BY")
        .is_ok_and(|p| p == std::os::unix::process::parent_id().to_string())
}

/// Why a backend cannot run here: an `Unavailable`'s own line, else the error.
pub(crate) fn unusable_why(e: &tprun_kernels::KernelError) -> String {
    match e {
        tprun_kernels::KernelError::Unavailable { why, .. } => why.clone(),
        e => e.to_string(),
    }
}

/// Visible HIP devices (at least one), or the one line that says why `--backend hip` cannot
/// run here: "hip: runtime not found (libamdhip64.so)", "no HIP device (hipInit: ...)".
fn hip_devices() -> Result<usize, String> {
    let driver = tprun_kernels::cuda::Gpu::Hip
        .driver()
        .map_err(|e| unusable_why(&e))?;
    match driver.device_count() {
        Ok(0) => Err("no HIP device".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no HIP device ({e})")),
    }
}

/// `--backend cuda|hip`: its visible devices (at least one), or the line that says why it
/// cannot run here ("backend 'hip' is not usable: ...").
fn explicit_gpu(backend: BackendArg) -> Result<usize, String> {
    let (name, count) = match backend {
        BackendArg::Hip => ("hip", hip_devices()),
        _ => (
            "cuda",
            cuda_devices().and_then(|n| match n {
                0 => Err("no CUDA device is visible".to_string()),
                n => Ok(n),
            }),
        ),
    };
    count.map_err(|why| format!("backend '{name}' is not usable: {why}"))
}

/// The job's ranks are started elsewhere and join (`serve --listen`).
fn remote_ranks(cli: &Cli) -> bool {
    matches!(&cli.command, Command::Serve(a) if a.listen.is_some())
}

/// Prints a usage error (one line and the hint) and returns its exit code.
fn usage_error(e: &str) -> i32 {
    eprintln!("error: {e}");
    eprintln!("hint: see tprun --help");
    2
}

/// The global flags configure a job of ranks; `synth`, `info` and `rank` start none (a rank
/// takes its settings from the coordinator's plan), so a global flag given to them would be
/// ignored in silence. Refused instead, naming the flag.
fn check_ignored_globals(cli: &Cli, matches: &clap::ArgMatches) -> Result<(), String> {
    let name = match &cli.command {
        Command::Synth(_) => "synth",
        Command::Info(_) => "info",
        Command::Rank(_) => "rank",
        Command::Bench { .. } | Command::Decode(_) | Command::Serve(_) | Command::Selftest(_) => {
            return Ok(())
        }
    };
    // A global flag may stand before or after the subcommand; clap records it in both.
    let sub = matches.subcommand_matches(name);
    let given = |id: &str| {
        [Some(matches), sub].into_iter().flatten().any(|m| {
            m.try_get_raw(id).is_ok_and(|v| v.is_some())
                && m.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
        })
    };
    // `info --backend B` asks whether B is usable here (exit 1 with its reason if not).
    let flags = ["ranks", "backend", "devices", "timeout", "ipc"];
    match flags
        .into_iter()
        .filter(|&f| !(name == "info" && f == "backend"))
        .find(|f| given(f))
    {
        None => Ok(()),
        Some(f) => Err(format!(
            "--{f} has no effect on `tprun {name}`, which starts no job of ranks{}",
            if name == "rank" {
                " (a rank takes its settings from the coordinator's plan)"
            } else {
                ""
            }
        )),
    }
}

fn run(cli: Cli) -> i32 {
    match &cli.command {
        Command::Rank(args) => return run_rank(args),
        Command::Synth(args) => return report(decode::synth_cmd(args)),
        Command::Info(args) => {
            // An explicit GPU backend must be usable: its reason otherwise, one line, exit 1.
            if matches!(cli.backend, BackendArg::Cuda | BackendArg::Hip) {
                if let Err(line) = explicit_gpu(cli.backend) {
                    eprintln!("error: {line}");
                    return 1;
                }
            }
            return report(info::info(args));
        }
        _ => {}
    }
    // selftest's allreduce check is a multi-process check: at least two ranks by default.
    let default_world = if matches!(cli.command, Command::Selftest(_)) {
        2
    } else {
        1
    };
    let settings = match Settings::from_cli(&cli, default_world) {
        Ok(s) => s,
        // Not a usage error: the machine cannot run it (exit 1).
        Err(e) if cli.backend == BackendArg::Hip => {
            eprintln!("error: {e}");
            return 1;
        }
        Err(e) => return usage_error(&e),
    };
    let result = match &cli.command {
        Command::Bench {
            what: BenchCommand::Allreduce(a),
        } => bench::run(&settings, a),
        Command::Bench {
            what: BenchCommand::Gemv(a),
        } => bench_gemv::run(&settings, a),
        Command::Decode(a) => decode::run(&settings, a),
        Command::Serve(a) => serve::run(&settings, a),
        Command::Selftest(a) => info::selftest(&settings, a),
        Command::Rank(_) | Command::Synth(_) | Command::Info(_) => unreachable!("handled above"),
    };
    report(result)
}

/// Prints a job's error (one line, plus a hint where it has one) and returns the exit code.
fn report(result: Result<i32, launch::JobError>) -> i32 {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            if let Some(h) = e.hint() {
                eprintln!("hint: {h}");
            }
            e.exit_code()
        }
    }
}

fn run_rank(args: &cli::RankArgs) -> i32 {
    if let Some(d) = args.device {
        // Set before this process starts any thread (the rank's, the device runtime's).
        std::env::set_var("CUDA_VISIBLE_DEVICES", d.to_string());
        std::env::set_var("HIP_VISIBLE_DEVICES", d.to_string());
    }
    let token = match &args.token_file {
        // 32 hex digits and a newline; a few KiB leaves room for whitespace.
        Some(f) => tprun_rank::files::read_text(f, 4096)
            .map_err(|e| format!("reading token file {}: {e}", f.display())),
        None => std::env::var("TPRUN_JOB_TOKEN")
            .map_err(|_| "no job token: set TPRUN_JOB_TOKEN or pass --token-file".to_string()),
    }
    .and_then(|t| {
        tprun_rank::run::parse_token(&t).ok_or_else(|| "the job token is not 32 hex digits".into())
    });
    let token = match token {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let opts = tprun_rank::run::RankOptions {
        socket: args.join.clone(),
        rank: args.rank,
        token,
    };
    match tprun_rank::run::run(opts) {
        Ok(()) => 0,
        Err(e) if e.is_abort() => {
            if !spawned_by_parent() {
                eprintln!("error: {e}");
            }
            3
        }
        Err(e) => {
            // The coordinator got the same message as `Failed` and reports it; a rank that
            // never joined, or one started by hand, has nobody else to tell.
            tracing::debug!("rank {} failed: {e}", args.rank);
            if e.is_join() {
                eprintln!("error: {e}");
                eprintln!(
                    "hint: --join takes the coordinator's rendezvous address (a path, or @name \
                     for an abstract socket) and TPRUN_JOB_TOKEN or --token-file its job token"
                );
            } else if !spawned_by_parent() {
                eprintln!("error: {e}");
            }
            if e.is_timeout() {
                4
            } else {
                1
            }
        }
    }
}

//! Command-line flags (clap derive). Raw flags only; `main.rs` and the command modules turn
//! them into validated settings and report bad combinations as usage errors (exit 2).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "tprun",
    version,
    about = "A multi-process tensor-parallel runtime for LLM decode",
    long_about = "tprun runs one process (a rank) per device. The coordinator spawns the ranks \
pinned to their devices, passes every shared buffer between them as a file descriptor over a \
private Unix socket, and then stays out of the way: ranks synchronise among themselves through \
a shared-memory control block and peer-buffer flags.",
    after_help = "Exit codes: 0 ok, 1 error, 2 usage, 3 a rank failed, 4 timeout.\n\
Environment: TPRUN_LOG=debug for logs; TPRUN_FAULT=<stall|exit|abort>:<rank>:<phase> injects a \
fault (tests only)."
)]
pub struct Cli {
    /// Number of ranks (processes). Default: one per entry of --devices, else 1.
    #[arg(long, short = 'n', global = true)]
    pub ranks: Option<usize>,

    /// Device layer: auto picks a GPU backend when one is usable, else cpu.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto, global = true)]
    pub backend: BackendArg,

    /// Device of each rank, comma-separated (default 0..N-1). Repeats are allowed:
    /// 0,0,0,0 puts four ranks on one device.
    #[arg(long, value_delimiter = ',', global = true)]
    pub devices: Option<Vec<usize>>,

    /// Seconds any wait may take before the job is declared stalled (exit 4).
    #[arg(long, default_value_t = 60.0, global = true)]
    pub timeout: f64,

    /// How GPU ranks share buffers: fd (VMM + POSIX fds), legacy (cudaIpc handles), auto.
    #[arg(long, value_enum, default_value_t = IpcArg::Auto, global = true)]
    pub ipc: IpcArg,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Auto,
    Cpu,
    Cuda,
    Hip,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum IpcArg {
    Auto,
    Fd,
    Legacy,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Benchmarks (nccl-tests style tables).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Run one rank of a job (started by the coordinator, or by hand inside a container).
    Rank(RankArgs),
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Measure the allreduce alone: time, algbw, busbw and #wrong per size and algorithm.
    Allreduce(BenchAllreduceArgs),
}

#[derive(Args, Debug)]
pub struct BenchAllreduceArgs {
    /// Algorithms, comma-separated: host, oneshot, twoshot, auto, or all.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    pub algo: Vec<String>,

    /// Element types, comma-separated: f32, f16, bf16, or all.
    #[arg(long, default_value = "f32", value_delimiter = ',')]
    pub dtype: Vec<String>,

    /// Message sizes in bytes: MIN:MAX doubling (8:64M), or a comma list (4K,1M). K/M/G are
    /// binary (KiB, MiB, GiB). Rounded down to whole elements.
    #[arg(long, default_value = "8:64M")]
    pub sizes: String,

    /// Message sizes in elements instead of bytes (comma list, e.g. 1,7,1001).
    #[arg(long, value_delimiter = ',', conflicts_with = "sizes")]
    pub counts: Option<Vec<usize>>,

    /// Timed iterations per row (default: from 100 for small messages down to 5 for large).
    #[arg(long)]
    pub iters: Option<u32>,

    /// Untimed iterations before the timed ones (default: a tenth of --iters, at least 2).
    #[arg(long)]
    pub warmup: Option<u32>,

    /// Give every rank known inputs and compare every element on every rank with the exact
    /// reference sum; exit 1 if any differ.
    #[arg(long)]
    pub check: bool,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RankArgs {
    /// The coordinator's rendezvous socket.
    #[arg(long)]
    pub join: PathBuf,

    /// This rank's number (0-based).
    #[arg(long)]
    pub rank: usize,

    /// This rank's device (informational for cpu; GPU ranks see it as device 0 through
    /// CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES).
    #[arg(long, default_value_t = 0)]
    pub device: usize,

    /// File holding the job token (hex). Default: the TPRUN_JOB_TOKEN environment variable.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

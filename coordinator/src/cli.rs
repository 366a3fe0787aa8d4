//! Command-line flags (clap derive). Raw flags only; `main.rs` and the command modules turn
//! them into validated settings and report bad combinations as usage errors (exit 2).

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tprun_kernels::IpcMode;

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
    #[arg(long, default_value = "auto", global = true, value_parser = ipc_mode())]
    pub ipc: IpcMode,

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

/// `--ipc`: the device layer's own [`IpcMode`], its names listed in the help.
fn ipc_mode() -> impl TypedValueParser<Value = IpcMode> {
    PossibleValuesParser::new(IpcMode::ALL.map(IpcMode::name))
        .map(|s| IpcMode::parse(&s).expect("a listed name"))
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Benchmarks (nccl-tests style tables).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Generate text with a model sharded across the ranks (tensor parallel).
    Decode(DecodeArgs),
    /// Write a complete Hugging Face model folder with seeded random weights.
    Synth(SynthArgs),
    /// What this machine offers: backends, devices (name, memory, arch), peer access.
    Info(InfoArgs),
    /// Check every kernel against its CPU twin and every allreduce algorithm and dtype across
    /// real rank processes; exit 1 on any mismatch.
    Selftest(SelftestArgs),
    /// Run one rank of a job (started by the coordinator, or by hand inside a container).
    Rank(RankArgs),
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json). Default: a tiny
    /// synthetic Llama that every rank makes in memory, never on disk (random weights: the
    /// text is noise, but every step of the pipeline runs).
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// The prompt (default: "Once upon a time").
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,

    /// Read the prompt from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,

    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,

    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,

    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,

    /// Keep only the K most likely tokens (1..=64; 0 = all of the 64 candidates the device
    /// sampler gathers: tokens beyond the 64 most likely are never sampled).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,

    /// Seed of the sampler (every rank uses it, so all agree on each token).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Dtype of the weight matrices on the device: auto (as stored), f32, bf16, f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,

    /// Dtype of the KV cache: auto (bf16 for 16-bit weights, f32 for f32 weights), f32,
    /// bf16, f16.
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,

    /// KV-cache length in tokens (prompt + generated); default: the model's context, at most
    /// 4096. Its memory is allocated up front on every rank.
    #[arg(long)]
    pub max_seq: Option<usize>,

    /// Greedy decoding one step at a time, writing every step's full-vocab logits (f32 little
    /// endian, [steps, vocab]) to this file: for comparisons with a reference.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,

    /// Replay the single-token step as one captured CUDA graph per token (on) or launch its
    /// kernels one by one (off). Off by default until graph replay has run on a GPU: its one
    /// H200 run so far stalled (see docs/perf-notes.md).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    pub graph: String,

    /// Do not stop at the model's end-of-sequence ids.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Print one JSON object (token ids, text, statistics) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture: llama, mistral, qwen2, qwen3.
    #[arg(long, default_value = "llama")]
    pub arch: String,

    /// Shapes: tiny (CI), small (40M, CPU demos), llama3-8b, qwen3-32b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,

    /// Output folder (created; files in it are overwritten).
    #[arg(long)]
    pub out: PathBuf,

    /// Dtype of every tensor: f32, bf16, f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,

    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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

    /// After each row's timed calls, run 3 untimed calls with fresh known inputs and compare
    /// every element on every rank with the exact reference sum; exit 1 if any differ.
    #[arg(long)]
    pub check: bool,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Measure oneshot against twoshot (instead of --algo) and report, per dtype, up to which
    /// size oneshot is faster: the crossover `auto` should use on this machine and world.
    #[arg(long, conflicts_with = "algo")]
    pub tune: bool,
}

#[derive(Args, Debug)]
pub struct RankArgs {
    /// The coordinator's rendezvous address: a socket path, or @NAME for an abstract socket
    /// (the coordinator's own, which leaves no file behind).
    #[arg(long)]
    pub join: PathBuf,

    /// This rank's number (0-based). Everything else (its device, the job's settings) comes
    /// from the coordinator's plan; a GPU rank uses the one GPU it sees first (set
    /// CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or give its container one GPU).
    #[arg(long)]
    pub rank: usize,

    /// File holding the job token (hex). Default: the TPRUN_JOB_TOKEN environment variable.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// Seed of the random inputs of the kernel checks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

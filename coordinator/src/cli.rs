//! Command-line flags (clap derive). Every number is bounded here, where it enters, by the
//! value parsers at the end of this file: nothing downstream sees a count that overflows its
//! arithmetic or sizes an absurd allocation, and clap reports a bad value as one `error:` line
//! naming the flag (exit 2). `main.rs` and the command modules check what spans several flags
//! or needs the model (usage errors too).

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tprun_ipc::control::MAX_RANKS;
use tprun_kernels::ops::TOPK_MAX;
use tprun_kernels::IpcMode;

/// The heading the job flags are listed under, in every command's help: they shape the ranks
/// of the commands that start a job (`synth`, `info` and `rank` refuse what does not apply).
const JOB: &str = "Job options (decode, serve, bench, selftest)";

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
    /// Number of ranks (processes), 1 to 64. Default: one per entry of --devices, else 1
    /// (selftest: 2).
    #[arg(long, short = 'n', global = true, help_heading = JOB, allow_hyphen_values = true,
          value_parser = whole::<usize>(1, MAX_RANKS as u64))]
    pub ranks: Option<usize>,

    /// Device layer: auto picks a GPU backend when one is usable, else cpu.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto, global = true, help_heading = JOB)]
    pub backend: BackendArg,

    /// Device of each rank, comma-separated (default 0..N-1). Repeats are allowed:
    /// 0,0,0,0 puts four ranks on one device.
    #[arg(long, value_delimiter = ',', global = true, help_heading = JOB, allow_negative_numbers = true,
          value_parser = whole::<usize>(0, MAX_DEVICE as u64))]
    pub devices: Option<Vec<usize>>,

    /// Seconds any wait may take before the job is declared stalled (exit 4); 0.001 to 86400.
    #[arg(long, default_value_t = 60.0, global = true, help_heading = JOB, allow_hyphen_values = true,
          value_parser = seconds)]
    pub timeout: f64,

    /// How GPU ranks share buffers: fd (VMM + POSIX fds), legacy (cudaIpc handles), auto.
    #[arg(long, default_value = "auto", global = true, help_heading = JOB, value_parser = ipc_mode())]
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
    /// An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming,
    /// /v1/models, /health, /metrics) over the ranks, decoding up to --max-batch requests
    /// together (continuous batching). Ctrl-C stops it.
    Serve(ServeArgs),
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

    /// Most tokens to generate (the KV cache's length caps it too).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true,
          value_parser = whole::<usize>(0, u64::MAX))]
    pub max_new_tokens: usize,

    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_hyphen_values = true, value_parser = temperature)]
    pub temperature: f32,

    /// Nucleus sampling: keep the smallest set of tokens with this much probability (0, 1].
    #[arg(long, default_value_t = 0.95, allow_hyphen_values = true, value_parser = top_p)]
    pub top_p: f32,

    /// Keep only the K most likely tokens (1..=64; 0 = all of the 64 candidates the device
    /// sampler gathers: tokens beyond the 64 most likely are never sampled).
    #[arg(long, default_value_t = 40, allow_hyphen_values = true,
          value_parser = whole::<usize>(0, TOPK_MAX as u64))]
    pub top_k: usize,

    /// Seed of the sampler (every rank uses it, so all agree on each token).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true,
          value_parser = whole::<u64>(0, u64::MAX))]
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
    #[arg(long, allow_hyphen_values = true,
          value_parser = whole::<usize>(1, u32::MAX as u64 - 1))]
    pub max_seq: Option<usize>,

    /// Greedy decoding one step at a time, writing every step's full-vocab logits (f32 little
    /// endian, [steps, vocab]) to this file: for comparisons with a reference.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,

    /// Replay the single-token step as one captured CUDA graph per token (on), or launch its
    /// kernels one by one (off). Backends without graphs (cpu) always launch one by one.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub graph: String,

    /// Time every op of the decode steps on the device and print the device time per op and
    /// token (GPU backends; the steps are then launched one by one, not as a graph, and each
    /// op is bracketed by events, so the total is a little above an unprofiled run's).
    #[arg(long)]
    pub profile: bool,

    /// Do not stop at the model's end-of-sequence ids.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Print one JSON object (token ids, text, statistics) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Hugging Face model folder (as `decode`'s; its tokenizer_config.json's chat_template
    /// renders chat requests). Default: the embedded synthetic model.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0: any free one; the line "listening on ..." says which).
    #[arg(long, default_value_t = 8000, value_parser = whole::<u16>(0, u16::MAX as u64))]
    pub port: u16,

    /// Dtype of the weight matrices on the device: auto (as stored), f32, bf16, f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,

    /// Dtype of the KV cache: auto, f32, bf16, f16 (as `decode`).
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,

    /// KV-cache length in tokens: prompt + completion of one request must fit (default: the
    /// model's context, at most 4096).
    #[arg(long, allow_hyphen_values = true,
          value_parser = whole::<usize>(1, u32::MAX as u64 - 1))]
    pub max_seq: Option<usize>,

    /// Replay the single-token step as one captured graph (on) or launch its kernels one by
    /// one (off), as `decode`.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub graph: String,

    /// Most requests decoding together (continuous batching), 1 to 64; each has its own
    /// KV-cache slot of --max-seq tokens, allocated up front. Default 16; a hybrid (DeltaNet)
    /// model serves one at a time.
    #[arg(long, allow_hyphen_values = true, value_parser = whole::<usize>(1, 64))]
    pub max_batch: Option<usize>,

    /// Do not start the ranks: wait for --ranks of them, started elsewhere on this machine
    /// (other containers or namespaces sharing the socket's folder) with `tprun rank --join
    /// SOCKET --rank I [--device D]`, to join at this socket path. It must not exist; it is
    /// removed once all have joined. The job token comes from TPRUN_JOB_TOKEN (32 hex digits)
    /// or is made up and printed.
    #[arg(long, value_name = "SOCKET")]
    pub listen: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture: llama, mistral, qwen2, qwen3, qwen3_5 (the gated DeltaNet hybrid).
    #[arg(long, default_value = "llama")]
    pub arch: String,

    /// Shapes: tiny (CI), small (40M, CPU demos), llama3-8b, qwen3-32b, 27b (Qwen3.5-27B).
    #[arg(long, default_value = "tiny")]
    pub preset: String,

    /// Output folder (created; files in it are overwritten).
    #[arg(long)]
    pub out: PathBuf,

    /// Dtype of every tensor: f32, bf16, f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,

    /// Seed of the random weights.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true,
          value_parser = whole::<u64>(0, u64::MAX))]
    pub seed: u64,

    /// Quantize the MLP: gptq-int4 (GPTQ int4, symmetric, in the official Qwen3.5 GPTQ
    /// layout: gate/up/down as qweight, qzeros, scales, g_idx; everything else in --dtype).
    #[arg(long)]
    pub quant: Option<String>,

    /// With --quant: input rows per quantization group, dividing the hidden and MLP sizes
    /// (−1: one group over all inputs). Default: 128, or 32 for the tiny preset.
    #[arg(long, allow_hyphen_values = true)]
    pub group_size: Option<i64>,

    /// With --quant: act-order groups (desc_act: g_idx not monotone).
    #[arg(long)]
    pub desc_act: bool,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Measure the allreduce alone: time, algbw, busbw and #wrong per size and algorithm.
    Allreduce(BenchAllreduceArgs),
    /// Measure matrix–vector products alone (dense or GPTQ int4): µs per call and TB/s of the
    /// bytes they read, against the device copy bandwidth measured in the same run.
    Gemv(BenchGemvArgs),
}

#[derive(Args, Debug)]
pub struct BenchGemvArgs {
    /// Weights: int4 (GPTQ, MatmulInt4) or a dense dtype (f32, f16, bf16; Matmul).
    #[arg(long, default_value = "int4")]
    pub quant: String,

    /// Shapes NxK (outputs x inputs), comma-separated; `:silu` adds the SiluMul prologue
    /// (x is [gate | up], activated as read), `:glu` the SiluMul epilogue (the N rows are gate
    /// then up; y gets silu(gate) · up, N/2 wide). Default: the MLP of a 27B Qwen3.5 at TP=1
    /// as decode runs it (gate|up with the epilogue, then a plain down).
    #[arg(
        long,
        default_value = "34816x5120:glu,5120x17408",
        value_delimiter = ','
    )]
    pub shapes: Vec<String>,

    /// int4 group size (inputs per scale), or -1 for one group over all of K.
    #[arg(long, default_value_t = 128, allow_hyphen_values = true)]
    pub group: i64,

    /// int4 with act-order (inputs gathered through a permutation).
    #[arg(long)]
    pub desc_act: bool,

    /// Tokens per call (1 = decode).
    #[arg(long, default_value_t = 1, allow_hyphen_values = true,
          value_parser = whole::<usize>(1, 4096))]
    pub m: usize,

    /// Timed calls per row, 1 to 10^6 (default: 50 graph replays on a GPU, 2 calls on the CPU).
    #[arg(long, allow_hyphen_values = true, value_parser = whole::<u32>(1, 1_000_000))]
    pub iters: Option<u32>,

    /// Untimed calls before the timed ones.
    #[arg(long, default_value_t = 2, allow_hyphen_values = true,
          value_parser = whole::<u32>(0, 1_000_000))]
    pub warmup: u32,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
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
    /// binary (KiB, MiB, GiB); 1 byte to 16G. Rounded down to whole elements.
    #[arg(long, default_value = "8:64M", value_parser = crate::sizes::byte_sizes)]
    pub sizes: crate::sizes::ByteSizes,

    /// Message sizes in elements instead of bytes (comma list, e.g. 1,7,1001; at most 2^32,
    /// 16 GiB of f32).
    #[arg(long, value_delimiter = ',', conflicts_with = "sizes", allow_negative_numbers = true,
          value_parser = whole::<usize>(1, MAX_COUNT as u64))]
    pub counts: Option<Vec<usize>>,

    /// Timed iterations per row, 1 to 10^8 (default: from 100 for small messages down to 5
    /// for large).
    #[arg(long, allow_hyphen_values = true, value_parser = whole::<u32>(1, MAX_ITERS as u64))]
    pub iters: Option<u32>,

    /// Untimed iterations before the timed ones, 0 to 10^8 (default: a tenth of --iters, at
    /// least 2).
    #[arg(long, allow_hyphen_values = true, value_parser = whole::<u32>(0, MAX_ITERS as u64))]
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
    /// from the coordinator's plan; a GPU rank uses the one GPU it sees first (--device, or
    /// CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or a container with one GPU).
    #[arg(long, allow_hyphen_values = true,
          value_parser = whole::<usize>(0, MAX_RANKS as u64 - 1))]
    pub rank: usize,

    /// File holding the job token (hex). Default: the TPRUN_JOB_TOKEN environment variable.
    #[arg(long)]
    pub token_file: Option<PathBuf>,

    /// The GPU this rank uses (sets CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES for this
    /// process): for a rank started by hand on a machine with several GPUs.
    #[arg(long, allow_hyphen_values = true,
          value_parser = whole::<usize>(0, MAX_DEVICE as u64))]
    pub device: Option<usize>,
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
    #[arg(long, default_value_t = 1, allow_hyphen_values = true,
          value_parser = whole::<u64>(0, u64::MAX))]
    pub seed: u64,
}

// ---- bounds and value parsers ----------------------------------------------------------------

/// Largest `--devices` entry. A device number is an ordinal within one host (CUDA numbers its
/// devices from 0); 1023 is far beyond any host's count and keeps CUDA_VISIBLE_DEVICES a small
/// number.
pub const MAX_DEVICE: usize = 1023;

/// Longest `--timeout`, in seconds: one day. Every deadline adds it to an `Instant` and the job
/// spec carries it in milliseconds; a day fits both with room to spare, and a wait longer than
/// a day is a hang, not slowness.
pub const MAX_TIMEOUT_S: f64 = 86_400.0;

/// Shortest `--timeout`: one millisecond, the unit the job spec carries.
pub const MIN_TIMEOUT_S: f64 = 0.001;

/// Largest allreduce message of `bench allreduce`, in bytes: 16 GiB, the top of the largest
/// sweep nccl-tests is commonly run with (`-e 16G`). Bounds every size and count, so that
/// count × element size never overflows and the ranks' buffers stay allocatable.
pub const MAX_MESSAGE_BYTES: usize = 16 << 30;

/// Largest `--counts` entry: [`MAX_MESSAGE_BYTES`] of the widest element (f32).
pub const MAX_COUNT: usize = MAX_MESSAGE_BYTES / 4;

/// Most `--iters` or `--warmup` per row: 10^8, minutes of calls of the smallest message (the
/// fault tests' loop that runs until a rank is killed). Their sum stays far below u32::MAX, the
/// ranks' loop counter, and the f32 time each rank keeps per timed call stays within 400 MB.
pub const MAX_ITERS: u32 = 100_000_000;

/// A whole number in `lo..=hi`, with a message that says so (negative numbers included, which
/// the flags accept as values so that they can be refused here with this message).
fn whole<T>(lo: u64, hi: u64) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<u64>,
{
    move |s: &str| {
        let range = if hi == u64::MAX {
            format!("a whole number >= {lo}")
        } else {
            format!("a whole number from {lo} to {hi}")
        };
        let v: u64 = s.trim().parse().map_err(|_| format!("expected {range}"))?;
        if v < lo || v > hi {
            return Err(format!("out of range: expected {range}"));
        }
        T::try_from(v).map_err(|_| "too large for this machine's word".to_string())
    }
}

/// A finite number (no NaN or infinity).
fn finite(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| "not a number".to_string())?;
    if !v.is_finite() {
        return Err("not a finite number".into());
    }
    Ok(v)
}

/// `--timeout`: seconds in [`MIN_TIMEOUT_S`, `MAX_TIMEOUT_S`].
fn seconds(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if !(MIN_TIMEOUT_S..=MAX_TIMEOUT_S).contains(&v) {
        return Err(format!(
            "out of range: expected seconds from {MIN_TIMEOUT_S} to {MAX_TIMEOUT_S} (a day)"
        ));
    }
    Ok(v)
}

/// `--temperature`: finite and >= 0 (0 = greedy).
fn temperature(s: &str) -> Result<f32, String> {
    let v = finite(s)? as f32;
    if !(v >= 0.0 && v.is_finite()) {
        return Err("out of range: expected a finite number >= 0".into());
    }
    Ok(v)
}

/// `--top-p`: in (0, 1].
fn top_p(s: &str) -> Result<f32, String> {
    let v = finite(s)? as f32;
    if !(v > 0.0 && v <= 1.0) {
        return Err("out of range: expected a number in (0, 1]".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn numbers_are_bounded_where_they_enter() {
        let w = whole::<u32>(1, 10);
        assert_eq!(w("7"), Ok(7));
        for bad in ["0", "11", "-1", "x", "1.5", "99999999999999999999999"] {
            assert!(w(bad).is_err(), "{bad}");
        }
        assert!(whole::<u32>(0, u64::MAX)("4294967296").is_err());
        assert_eq!(seconds("60"), Ok(60.0));
        for bad in ["1e20", "0", "-1", "nan", "inf", "0.0001", "86401"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(temperature("0"), Ok(0.0));
        for bad in ["-1", "nan", "inf", "1e39"] {
            assert!(temperature(bad).is_err(), "{bad}");
        }
        for bad in ["0", "1.5", "-0.5", "nan"] {
            assert!(top_p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn negative_numbers_reach_the_bound_check() {
        let e = Cli::try_parse_from(["tprun", "decode", "--temperature", "-1"]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("--temperature") && text.contains(">= 0"),
            "{text}"
        );
        let e = Cli::try_parse_from(["tprun", "bench", "allreduce", "--counts", "8,-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--counts") && e.contains("whole number"), "{e}");
        let c = Cli::try_parse_from(["tprun", "--ranks", "2", "decode", "--temperature", "0"]);
        assert!(c.is_ok());
    }
}

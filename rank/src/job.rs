//! The plan the coordinator sends each rank in `Welcome` (the job spec, identical on every
//! rank, plus that rank's own part), and the reports ranks send back. Both are
//! postcard-encoded inside the ipc crate's opaque payloads.

use serde::{Deserialize, Serialize};
use tprun_kernels::cuda::SelftestResult;
use tprun_kernels::{CommSettings, DType, IpcMode};

use crate::model::SynthOptions;

/// Which device layer the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    Cpu,
    Cuda,
    Hip,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Hip => "hip",
        }
    }
}

/// Allreduce algorithms, with the names used in the CLI, the code and the tables: the user's
/// choice (`auto` included). The device op an algorithm runs is a `CommAlgo`, mapped in one
/// place (`comm::device_algo`); whether `oneshot` uses the low-latency kernel is a job-wide
/// device setting ([`CommSettings::low_latency`]), not a choice of algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Algo {
    Host,
    Oneshot,
    Twoshot,
    Auto,
}

impl Algo {
    pub const ALL: [Algo; 4] = [Algo::Host, Algo::Oneshot, Algo::Twoshot, Algo::Auto];

    pub fn name(self) -> &'static str {
        match self {
            Algo::Host => "host",
            Algo::Oneshot => "oneshot",
            Algo::Twoshot => "twoshot",
            Algo::Auto => "auto",
        }
    }

    pub fn parse(s: &str) -> Option<Algo> {
        Algo::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// What one rank receives in `Welcome`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The job, the same for every rank.
    pub job: JobSpec,
    /// This rank's device as the coordinator assigned it (`--devices`), used in names and
    /// messages. GPU ranks open ordinal 0: the coordinator's CUDA_VISIBLE_DEVICES (or the
    /// container) makes this device the only one they see.
    pub device: usize,
}

/// Everything about a job that every rank must agree on. Only the coordinator decides it;
/// ranks read no job-wide setting from their own environment, so that a rank started by hand
/// (in a container) cannot disagree with the others.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub backend: Backend,
    /// How GPU ranks share peer buffers (`--ipc`).
    pub ipc: IpcMode,
    /// Allreduce kernel settings of GPU backends, applied when a rank opens its device.
    pub comm: CommSettings,
    /// CUDA decode kernels launched with programmatic dependent launch (on Hopper and newer;
    /// the coordinator's A/B knob `TPRUN_CUDA_PDL=0` turns it off).
    pub pdl: bool,
    /// Deadline of every wait (barriers, flag waits, the token ring), in milliseconds.
    pub timeout_ms: u64,
    /// Host threads each rank may use (cores / ranks, at least 1).
    pub threads: usize,
    /// True when ranks outnumber cores: waits then spin only briefly before sleeping.
    pub oversubscribed: bool,
    pub task: Task,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Task {
    Bench(BenchSpec),
    Decode(DecodeSpec),
    /// `selftest`'s kernel checks, on a job of one rank.
    Selftest(SelftestSpec),
    /// `bench gemv`: matrix–vector products alone, on each rank's device.
    BenchGemv(GemvBenchSpec),
    /// `serve`: load the model, then generate for each [`Work::Generate`] the coordinator
    /// sends (`Msg::Work`), as a continuous batch, until [`Work::Shutdown`].
    Serve(ServeSpec),
}

/// The model of a `serve` job: as a decode job's, without the prompt and sampling (those
/// come with each request).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServeSpec {
    pub model: ModelSpec,
    /// Most sequences decoding together (the KV cache's slots).
    pub max_batch: usize,
}

/// What the coordinator sends a `serve` job's ranks: requests to every rank, in the same
/// order; cancels and the shutdown to rank 0 alone, which decides when each takes effect and
/// tells the others through the control block's step plans.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Work {
    Generate(GenRequest),
    /// End request `id` early (its client went away, or a stop string ended its text).
    Cancel(u64),
    /// Finish the requests already sent, then close the communicator and exit 0.
    Shutdown,
}

/// One sequence to generate: its tokens go through the control block's token ring (rank 0),
/// then rank 0 reports [`Report::Served`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop: Vec<u32>,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
}

/// `bench gemv`: the products to time, in order, and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemvBenchSpec {
    pub rows: Vec<GemvRow>,
    pub warmup: u32,
    /// Timed calls per row (graph replays on GPUs); `None`: the rank's default (50 on a
    /// GPU, 2 on the CPU).
    pub iters: Option<u32>,
}

/// One product of `bench gemv`: `y[m, n] = f(x) · wᵀ` with `w` [n, k].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemvRow {
    pub n: usize,
    pub k: usize,
    pub m: usize,
    /// The SiluMul prologue (down_proj's silu(gate) · up).
    pub silu: bool,
    /// The SiluMul epilogue (gate|up writing silu(gate) · up, [m, n/2]; n even).
    pub glu: bool,
    pub quant: GemvQuant,
}

/// The weights of a [`GemvRow`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum GemvQuant {
    /// `Matmul` over weights of this dtype.
    Dense(DType),
    /// `MatmulInt4` over GPTQ int4 weights in groups of `group` inputs, their order shuffled
    /// (`perm`) with `desc_act`.
    Int4 { group: usize, desc_act: bool },
}

/// `selftest`: every GPU kernel against its CPU twin on the rank's device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelftestSpec {
    /// Seed of the random inputs.
    pub seed: u64,
}

/// `decode`: the model, the prompt (already tokenized by the coordinator) and the sampling
/// settings, identical on every rank so that every rank picks the same tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeSpec {
    pub model: ModelSpec,
    /// Write each step's full-vocab logits (f32, little endian, `[steps, vocab]`) to this
    /// file (rank 0), for comparisons with a reference; steps then run one at a time.
    pub dump_logits: Option<String>,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// Generation stops at these ids (empty with --ignore-eos).
    pub stop: Vec<u32>,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
    /// Measurement only (`TPRUN_BENCH_NO_ALLREDUCE=1`): the step without its allreduces, to
    /// time what they cost per token; the tokens are wrong at world > 1. Every rank must
    /// agree, or the ones that reduce wait for the ones that do not.
    pub no_allreduce: bool,
    /// Time every op of the decode steps on the device (`--profile`; steps launched one by
    /// one) and report the totals per op.
    pub profile: bool,
}

/// The model of a decode or serve job, and how every rank holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub source: ModelSource,
    /// Matrix dtype on the device; `None` = as stored in the checkpoint.
    pub dtype: Option<DType>,
    /// KV-cache dtype.
    pub kv_dtype: DType,
    /// KV-cache length in tokens (`None`: the model's, capped at 4096).
    pub max_seq: Option<usize>,
    /// Replay the single-token step as one captured device graph (`--graph on`).
    pub graph: bool,
}

impl ModelSpec {
    /// How a rank loads it, with `slots` sequences' KV cache.
    pub fn load_options(&self, slots: usize) -> crate::model::LoadOptions {
        crate::model::LoadOptions {
            dtype: self.dtype,
            kv_dtype: self.kv_dtype,
            max_seq: self.max_seq,
            slots,
            ..crate::model::LoadOptions::default()
        }
    }
}

/// Where a decode job's weights come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ModelSource {
    /// A Hugging Face folder, by absolute path; ranks read their slices from it.
    Dir(String),
    /// `synth`'s model for these options, made by every rank in memory
    /// (`model::synth::in_memory`): the embedded default, which never touches the filesystem.
    Synthetic(SynthOptions),
}

/// `bench allreduce`: the rows to run, in order, identical on every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchSpec {
    pub rows: Vec<BenchRow>,
    /// Give each rank known inputs and compare every element with the exact reference.
    pub check: bool,
}

impl BenchSpec {
    /// The largest message of any row, in bytes (sizes the communication buffers).
    pub fn max_bytes(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.count * r.dtype.size())
            .max()
            .unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchRow {
    pub algo: Algo,
    pub dtype: DType,
    /// Elements.
    pub count: usize,
    pub warmup: u32,
    pub iters: u32,
}

/// What a rank reports back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Report {
    /// The kernel checks of `selftest`: how many ran, and the ones that failed.
    Selftest {
        checks: u64,
        failed: Vec<SelftestResult>,
    },
    /// One finished benchmark row: per-iteration times on this rank, and elements that
    /// differed from the reference over all checked iterations.
    BenchRow {
        index: u32,
        /// The algorithm `auto` resolved to (the row's own algorithm otherwise).
        resolved: Algo,
        times_us: Vec<f32>,
        wrong: u64,
        /// Per-call time of the same allreduce replayed from a device graph (GPU backends,
        /// capturable algorithms), µs.
        graph_us: Option<f32>,
    },
    /// `bench gemv`: the device copy that gives the bandwidth ceiling, `bytes` read plus
    /// written per copy, in `memcpy_us` by the driver's copy and in `kernel_us` by a copy
    /// kernel (a one-input ReduceSum); the faster is the ceiling.
    CopyBandwidth {
        bytes: u64,
        memcpy_us: f64,
        kernel_us: f64,
    },
    /// `bench gemv`: row `index` read `bytes` (weights, scales, zeros, perm) in `us` per call;
    /// `graph`: timed as graph replays rotating through copies of the weights larger than
    /// the device's cache (GPUs), else as plain calls.
    GemvRow {
        index: u32,
        bytes: u64,
        us: f64,
        graph: bool,
    },
    /// Rank 0 has moved `done` of its shard's `total` weight bytes to its device.
    LoadProgress { done: u64, total: u64 },
    /// `serve`: rank 0 finished request `id` (every token it generated is already in the
    /// token ring); `stopped`: by a stop id, not the budget.
    Served {
        id: u64,
        prompt_tokens: usize,
        generated: usize,
        stopped: bool,
    },
    /// `serve`: every rank has loaded its shard and joined the communicator: requests may
    /// come.
    Ready,
    /// Rank 0 loaded its shard: seconds, weight bytes, and its device's memory use after
    /// allocating the KV cache and scratch (bytes; 0 where unknown).
    Loaded {
        seconds: f64,
        bytes: u64,
        device_bytes: u64,
    },
    /// Rank 0's decode statistics; the tokens themselves went through the control block's
    /// token ring.
    Decode {
        prompt_tokens: usize,
        generated: usize,
        stopped: bool,
        prefill_s: f64,
        decode_s: f64,
        /// Time between consecutive tokens reaching the host, µs.
        step_us: Vec<f32>,
        /// Weight bytes one step reads on rank 0.
        step_bytes: u64,
        /// Decode steps ran as replays of one captured device graph.
        graph: bool,
        /// Collective calls per decode step.
        allreduces_per_step: u32,
        /// Kernel launches per decode step (GPU backends; 0 on the CPU).
        launches_per_step: u64,
        /// With `--profile`: (op label, calls, device seconds) over the decode steps on rank
        /// 0, largest first; empty otherwise or where the backend cannot profile.
        profile: Vec<(String, u64, f64)>,
    },
}

pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("job specs and reports always encode")
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, crate::RankError> {
    postcard::from_bytes(bytes)
        .map_err(|e| crate::RankError::Other(format!("undecodable job payload: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_carries_the_job_settings_and_the_rank_device() {
        let plan = Plan {
            job: JobSpec {
                backend: Backend::Cuda,
                ipc: IpcMode::Legacy,
                comm: CommSettings {
                    low_latency: false,
                    small_copy_kernel: false,
                    comm_blocks: Some(12),
                },
                pdl: true,
                timeout_ms: 1000,
                threads: 2,
                oversubscribed: false,
                task: Task::Bench(BenchSpec {
                    rows: vec![],
                    check: true,
                }),
            },
            device: 5,
        };
        assert_eq!(decode::<Plan>(&encode(&plan)).unwrap(), plan);
    }
}

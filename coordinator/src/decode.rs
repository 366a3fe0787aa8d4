//! `tprun decode` and `tprun synth`: everything on the coordinator's side of text generation.
//! The coordinator validates the model folder and tokenizes the prompt before any rank starts
//! (so bad input fails fast with one line), streams rank 0's tokens as text, and prints the
//! summary. It never loads weights itself.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tprun_kernels::DType;
use tprun_rank::job::{DecodeSpec, ModelSource, Report, Task};
use tprun_rank::model::forward::{LoadOptions, DEFAULT_MAX_SEQ};
use tprun_rank::model::{synth, Arch, ModelConfig, Preset, ShardPlan, SynthOptions};

use crate::cli::{DecodeArgs, SynthArgs};
use crate::launch::{JobError, Observer};
use crate::tokenizer::{TextStream, Tokenizer};
use crate::{dtype_arg, Settings};

const DEFAULT_PROMPT: &str = "Once upon a time";

fn usage(m: impl Into<String>) -> JobError {
    JobError::Usage(m.into())
}

fn bad(m: impl std::fmt::Display) -> JobError {
    JobError::Setup(anyhow::anyhow!("{m}"))
}

/// The embedded default model: `synth`'s tiny Llama, which every rank makes in memory
/// (`synth::in_memory`), so that it never touches the filesystem.
const DEFAULT_MODEL: SynthOptions = SynthOptions {
    arch: Arch::Llama,
    preset: Preset::Tiny,
    dtype: DType::F32,
    seed: 0,
    tie_embeddings: None,
};

/// The model of a decode job, as the coordinator sees it.
struct ModelInput {
    /// What the ranks are told to load.
    source: ModelSource,
    cfg: ModelConfig,
    tok: Tokenizer,
    /// How messages and the JSON output name it: the folder, or the embedded default.
    name: String,
}

impl ModelInput {
    /// The folder `--model` names (its config, tokenizer and stored dtype read and checked
    /// here), or the embedded default.
    fn open(model: Option<&Path>) -> Result<ModelInput, JobError> {
        let Some(dir) = model else {
            let tok = Tokenizer::from_json(
                "the default model's tokenizer",
                synth::tokenizer_json().to_string().as_bytes(),
            )
            .map_err(bad)?;
            return Ok(ModelInput {
                source: ModelSource::Synthetic(DEFAULT_MODEL),
                cfg: synth::config_for(&DEFAULT_MODEL),
                tok,
                name: "the embedded default (synthetic, in memory)".into(),
            });
        };
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| bad(format!("model folder {}: {e}", dir.display())))?;
        let cfg = ModelConfig::from_dir(&dir).map_err(bad)?;
        let tok = Tokenizer::from_dir(&dir).map_err(bad)?;
        let path = dir
            .to_str()
            .ok_or_else(|| bad(format!("the model path {} is not UTF-8", dir.display())))?
            .to_string();
        Ok(ModelInput {
            source: ModelSource::Dir(path.clone()),
            cfg,
            tok,
            name: path,
        })
    }

    /// The dtype its weights are stored in.
    fn stored_dtype(&self) -> Result<DType, JobError> {
        match &self.source {
            ModelSource::Synthetic(o) => Ok(o.dtype),
            ModelSource::Dir(dir) => {
                tprun_rank::model::safetensors::Checkpoint::open(Path::new(dir))
                    .and_then(|c| c.dtype_of("model.embed_tokens.weight"))
                    .map_err(bad)
            }
        }
    }
}

struct Streamer {
    tok: Tokenizer,
    stream: TextStream,
    ids: Vec<u32>,
    text: String,
    json: bool,
    spinner: Option<ProgressBar>,
    /// The prompt, echoed to stdout once loading is over (not under the progress bar).
    echo: Option<String>,
    loaded_s: Option<f64>,
    load_bytes: u64,
    device_bytes: u64,
    stats: Option<Report>,
    error: Option<String>,
}

impl Streamer {
    /// Loading is over: clear the bar and echo the prompt before the first generated text.
    fn loaded(&mut self) {
        if let Some(s) = self.spinner.take() {
            s.finish_and_clear();
        }
        if let Some(p) = self.echo.take() {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(p.as_bytes());
            let _ = o.flush();
        }
    }
}

impl Observer for Streamer {
    fn report(&mut self, _rank: usize, report: Report) {
        match report {
            Report::LoadProgress { done, total } => {
                if let Some(s) = &self.spinner {
                    s.set_length(total);
                    s.set_position(done);
                }
            }
            Report::Loaded {
                seconds,
                bytes,
                device_bytes,
            } => {
                self.loaded_s = Some(seconds);
                self.load_bytes = bytes;
                self.device_bytes = device_bytes;
                self.loaded();
            }
            r @ Report::Decode { .. } => self.stats = Some(r),
            Report::BenchRow { .. } | Report::Selftest { .. } => {}
        }
    }

    fn tokens(&mut self, tokens: &[u32]) {
        self.loaded();
        for &id in tokens {
            self.ids.push(id);
            match self.stream.push(&self.tok, id) {
                Ok(Some(piece)) => {
                    self.text.push_str(&piece);
                    if !self.json {
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(piece.as_bytes());
                        let _ = o.flush();
                    }
                }
                Ok(None) => {}
                Err(e) => self.error = Some(e.to_string()),
            }
        }
    }
}

fn percentile(sorted: &[f32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

pub fn run(settings: &Settings, args: &DecodeArgs) -> Result<i32, JobError> {
    let dtype = dtype_arg("--dtype", &args.dtype, &["auto"]).map_err(usage)?;
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(usage("--temperature must be a finite number >= 0"));
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return Err(usage("--top-p must be in (0, 1]"));
    }
    if args.top_k > tprun_kernels::ops::TOPK_MAX {
        return Err(usage(format!(
            "--top-k {} is more than the {} candidates the sampler gathers",
            args.top_k,
            tprun_kernels::ops::TOPK_MAX
        )));
    }
    let kv_dtype = dtype_arg("--kv-dtype", &args.kv_dtype, &["auto"]).map_err(usage)?;
    if args.max_seq == Some(0) {
        return Err(usage("--max-seq must be at least 1"));
    }
    let model = ModelInput::open(args.model.as_deref())?;
    let (cfg, name) = (model.cfg.clone(), model.name.clone());
    for r in 0..settings.world {
        ShardPlan::new(&cfg, r, settings.world).map_err(bad)?;
    }
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| bad(format!("prompt file {}: {e}", f.display())))?,
        (None, None) => DEFAULT_PROMPT.to_string(),
    };
    let prompt = model.tok.encode(&text).map_err(bad)?;
    // The ranks size their KV cache the same way (LoadOptions::context).
    let context = LoadOptions {
        max_seq: args.max_seq,
        ..LoadOptions::default()
    }
    .context(&cfg);
    if context >= u32::MAX as usize {
        return Err(usage(format!("--max-seq {context}: positions are 32-bit")));
    }
    if prompt.is_empty() {
        return Err(bad("the prompt encodes to no tokens"));
    }
    if prompt.len() >= context {
        return Err(bad(format!(
            "the prompt is {} tokens; the context holds {context} (--max-seq, or \
             max_position_embeddings {} of {name} capped at {DEFAULT_MAX_SEQ})",
            prompt.len(),
            cfg.max_positions,
        )));
    }
    if !args.json {
        eprintln!(
            "tprun decode: {} rank(s), backend {}; model {} ({}, {} layers, hidden {}, {} heads / {} kv heads)",
            settings.world,
            settings.backend.name(),
            name,
            cfg.arch.hf_name(),
            cfg.layers,
            cfg.hidden,
            cfg.heads,
            cfg.kv_heads
        );
    }
    // Hidden when stderr is not a terminal (indicatif's default draw target).
    let spinner = (!args.json).then(|| {
        let s = ProgressBar::new(0);
        s.set_style(
            ProgressStyle::with_template(
                "loading weights (rank 0) {bar:30} {bytes}/{total_bytes} {bytes_per_sec} {elapsed}",
            )
            .expect("template"),
        );
        s.enable_steady_tick(Duration::from_millis(100));
        s
    });
    // auto: 16-bit weights get a bf16 cache, f32 weights an f32 one.
    let weights_dtype = match dtype {
        Some(d) => d,
        None => model.stored_dtype()?,
    };
    let kv_dtype = kv_dtype.unwrap_or(if weights_dtype == DType::F32 {
        DType::F32
    } else {
        DType::BF16
    });
    let dump_logits = match &args.dump_logits {
        None => None,
        Some(p) => Some(
            p.to_str()
                .ok_or_else(|| bad(format!("the path {} is not UTF-8", p.display())))?
                .to_string(),
        ),
    };
    let spec = DecodeSpec {
        model: model.source,
        dtype,
        kv_dtype,
        max_seq: args.max_seq,
        dump_logits,
        prompt: prompt.clone(),
        max_new_tokens: args.max_new_tokens,
        stop: if args.ignore_eos {
            vec![]
        } else {
            cfg.eos.clone()
        },
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        // A measurement knob (README), read here once so that every rank agrees.
        no_allreduce: std::env::var("TPRUN_BENCH_NO_ALLREDUCE").is_ok_and(|v| v == "1"),
        graph: args.graph == "on",
    };
    let mut st = Streamer {
        tok: model.tok,
        stream: TextStream::new(),
        ids: Vec::new(),
        text: String::new(),
        json: args.json,
        spinner,
        echo: (!args.json).then(|| text.clone()),
        loaded_s: None,
        load_bytes: 0,
        device_bytes: 0,
        stats: None,
        error: None,
    };
    let result = crate::launch::run(settings.launch(Task::Decode(spec)), &mut st);
    if let Some(s) = st.spinner.take() {
        s.finish_and_clear();
    }
    if !args.json && st.echo.is_none() {
        println!();
    }
    result?;
    if let Some(e) = st.error {
        return Err(bad(format!("detokenizing: {e}")));
    }
    let Some(Report::Decode {
        prompt_tokens,
        generated,
        stopped,
        prefill_s,
        decode_s,
        mut step_us,
        step_bytes,
        graph,
        allreduces_per_step,
        launches_per_step,
    }) = st.stats
    else {
        return Err(bad("rank 0 finished without reporting statistics"));
    };
    step_us.sort_by(f32::total_cmp);
    let load_s = st.loaded_s.unwrap_or(f64::NAN);
    let prefill_tps = prompt_tokens as f64 / prefill_s;
    let decode_tps = generated.saturating_sub(1) as f64 / decode_s;
    let load_gbps = st.load_bytes as f64 / load_s / 1e9;
    // Effective weight bandwidth of rank 0: the bytes one step reads over the median step.
    let step_gbps = step_bytes as f64 / (percentile(&step_us, 0.5) / 1e6) / 1e9;
    let (p50, p99) = (
        percentile(&step_us, 0.5) / 1e3,
        percentile(&step_us, 0.99) / 1e3,
    );
    if args.json {
        let v = json!({
            "world": settings.world,
            "backend": settings.backend.name(),
            "model": name,
            "prompt": text,
            "prompt_ids": prompt,
            "token_ids": st.ids,
            "text": st.text,
            "stopped_at_eos": stopped,
            "load_s": load_s,
            "load_bytes_rank0": st.load_bytes,
            "load_gb_per_s": load_gbps,
            "device_bytes_per_rank": st.device_bytes,
            "kv_dtype": kv_dtype.name(),
            "graph": graph,
            "allreduces_per_step": allreduces_per_step,
            "kernel_launches_per_token": launches_per_step,
            "step_weight_bytes_rank0": step_bytes,
            "weight_gb_per_s": step_gbps,
            "prefill_tokens": prompt_tokens,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens": generated,
            "decode_s": decode_s,
            "decode_tokens_per_s": decode_tps,
            "token_latency_p50_ms": p50,
            "token_latency_p99_ms": p99,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        eprintln!(
            "load {load_s:.2} s ({load_gbps:.1} GB/s) · prefill {prompt_tokens} tokens {:.1} ms ({prefill_tps:.0} tok/s) · \
             decode {generated} tokens {:.2} s ({decode_tps:.1} tok/s, {step_gbps:.0} GB/s of weights{}) · per token p50 {p50:.2} ms, p99 {p99:.2} ms{}",
            prefill_s * 1e3,
            decode_s,
            if graph { ", one graph per token" } else { "" },
            if stopped { " · stopped at end of sequence" } else { "" }
        );
    }
    Ok(0)
}

pub fn synth_cmd(args: &SynthArgs) -> Result<i32, JobError> {
    let arch = Arch::parse(&args.arch).ok_or_else(|| {
        usage(format!(
            "unknown --arch '{}' (llama, mistral, qwen2, qwen3)",
            args.arch
        ))
    })?;
    let preset = Preset::parse(&args.preset).ok_or_else(|| {
        let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
        usage(format!(
            "unknown --preset '{}' ({})",
            args.preset,
            names.join(", ")
        ))
    })?;
    let dtype = dtype_arg("--dtype", &args.dtype, &[])
        .map_err(usage)?
        .expect("no keywords");
    let opts = SynthOptions {
        arch,
        preset,
        dtype,
        seed: args.seed,
        tie_embeddings: None,
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("template"),
    );
    let cfg = synth(&args.out, &opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .map_err(bad)?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({}, preset {}, {} layers, hidden {}, vocab {}, {})",
        Path::new(&args.out).display(),
        cfg.arch.hf_name(),
        preset.name(),
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        dtype
    );
    Ok(0)
}

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
use tprun_rank::job::{Backend, DecodeSpec, ModelSource, ModelSpec, Report, Task};
use tprun_rank::model::forward::{LoadOptions, DEFAULT_MAX_SEQ};
use tprun_rank::model::gptq::ZeroFormat;
use tprun_rank::model::synth::config_for;
use tprun_rank::model::{
    synth, Arch, GenerateOptions, ModelConfig, Preset, ShardPlan, SynthOptions, SynthQuant,
};

use crate::cli::{DecodeArgs, SynthArgs};
use crate::launch::{JobError, Observer};
use crate::tokenizer::{TextStream, Tokenizer};
use crate::{dtype_arg, hostmem, Settings};

const DEFAULT_PROMPT: &str = "Once upon a time";
/// The largest --prompt-file read: far more text than any context holds (a token is a few
/// bytes), so an endless source such as /dev/zero stops with an error instead of filling memory.
const PROMPT_FILE_LIMIT: u64 = 16 << 20;

fn usage(m: impl Into<String>) -> JobError {
    JobError::Usage(m.into())
}

fn bad(m: impl std::fmt::Display) -> JobError {
    JobError::Setup(anyhow::anyhow!("{m}"))
}

/// The embedded default model: `synth`'s tiny Llama, which every rank makes in memory
/// (`synth::in_memory`), so that it never touches the filesystem.
pub(crate) const DEFAULT_MODEL: SynthOptions = SynthOptions {
    arch: Arch::Llama,
    preset: Preset::Tiny,
    dtype: DType::F32,
    seed: 0,
    tie_embeddings: None,
    quant: None,
};

/// The model of a decode job, as the coordinator sees it.
pub(crate) struct ModelInput {
    /// What the ranks are told to load.
    pub(crate) source: ModelSource,
    pub(crate) cfg: ModelConfig,
    pub(crate) tok: Tokenizer,
    /// How messages and the JSON output name it: the folder, or the embedded default.
    pub(crate) name: String,
}

impl ModelInput {
    /// The folder `--model` names (its config, tokenizer and stored dtype read and checked
    /// here), or the embedded default.
    pub(crate) fn open(model: Option<&Path>) -> Result<ModelInput, JobError> {
        let Some(dir) = model else {
            let cfg = synth::config_for(&DEFAULT_MODEL);
            let tok = Tokenizer::from_json(
                "the default model's tokenizer",
                synth::tokenizer_json(cfg.vocab).to_string().as_bytes(),
            )
            .map_err(bad)?
            .for_vocab(cfg.vocab);
            return Ok(ModelInput {
                source: ModelSource::Synthetic(DEFAULT_MODEL),
                cfg,
                tok,
                name: "the embedded default (synthetic, in memory)".into(),
            });
        };
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| bad(format!("model folder {}: {e}", dir.display())))?;
        let cfg = ModelConfig::from_dir(&dir).map_err(bad)?;
        let tok = Tokenizer::from_dir(&dir).map_err(bad)?.for_vocab(cfg.vocab);
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

    /// What the ranks are told to load, and the context length they will size the KV cache
    /// for, after checking that `settings.world` ranks can split the model and, on the CPU
    /// backend, that they fit in host memory with `slots` sequences' KV cache. `kv_dtype`
    /// None (auto): bf16 for 16-bit weights, f32 for f32 ones.
    pub(crate) fn spec(
        &self,
        dtype: Option<DType>,
        kv_dtype: Option<DType>,
        max_seq: Option<usize>,
        graph: bool,
        settings: &Settings,
        slots: usize,
    ) -> Result<(ModelSpec, usize), JobError> {
        let world = settings.world;
        for r in 0..world {
            ShardPlan::new(&self.cfg, r, world).map_err(bad)?;
        }
        // The ranks size their KV cache the same way (LoadOptions::context).
        let context = LoadOptions {
            max_seq,
            ..LoadOptions::default()
        }
        .context(&self.cfg);
        let weights = match dtype {
            Some(d) => d,
            None => self.stored_dtype()?,
        };
        let kv_dtype = kv_dtype.unwrap_or(if weights == DType::F32 {
            DType::F32
        } else {
            DType::BF16
        });
        let spec = ModelSpec {
            source: self.source.clone(),
            dtype,
            kv_dtype,
            max_seq,
            graph,
        };
        if settings.backend == Backend::Cpu {
            if let Some(available) = hostmem::available_bytes() {
                let opts = spec.load_options(slots);
                hostmem::check_model(&self.cfg, &opts, weights.size(), world, available)?;
            }
        }
        Ok((spec, context))
    }

    /// The dtype its weights are stored in.
    pub(crate) fn stored_dtype(&self) -> Result<DType, JobError> {
        match &self.source {
            ModelSource::Synthetic(o) => Ok(o.dtype),
            ModelSource::Dir(dir) => {
                // Under model.language_model. in Qwen3.5's multimodal checkpoints.
                let embed = format!(
                    "{}embed_tokens.weight",
                    tprun_rank::model::weights::text_prefix(&self.cfg)
                );
                tprun_rank::model::safetensors::Checkpoint::open(Path::new(dir))
                    .and_then(|c| c.dtype_of(&embed))
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
    /// stdout is a terminal: control characters in the text are shown escaped.
    terminal: bool,
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
            Report::BenchRow { .. }
            | Report::Selftest { .. }
            | Report::CopyBandwidth { .. }
            | Report::GemvRow { .. }
            | Report::Served { .. }
            | Report::Ready => {}
        }
    }

    fn tokens(&mut self, tokens: &[(u32, u32)]) {
        self.loaded();
        for &(_, id) in tokens {
            self.ids.push(id);
            match self.stream.push(&self.tok, id) {
                Ok(Some(piece)) => {
                    self.text.push_str(&piece);
                    if !self.json {
                        let shown = if self.terminal {
                            escape_controls(&piece)
                        } else {
                            piece.as_str().into()
                        };
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(shown.as_bytes());
                        let _ = o.flush();
                    }
                }
                Ok(None) => {}
                Err(e) => self.error = Some(e.to_string()),
            }
        }
    }
}

/// Text for a terminal: control characters other than newline and tab (a token can be a
/// bell, a backspace, an escape that starts a terminal command) as `\xNN`; the rest as is.
/// Generated text is data, and must not drive the terminal it is shown on.
fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let shown = |c: char| !c.is_control() || c == '\n' || c == '\t';
    if text.chars().all(shown) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if shown(c) {
            out.push(c);
        } else {
            // Every control character is below U+00A0: two hex digits hold it.
            out.push_str(&format!("\\x{:02x}", c as u32));
        }
    }
    out.into()
}

/// The `q` quantile of sorted values; `None` when there are none.
fn percentile(sorted: &[f32], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    Some(sorted[(last as f64 * q).round() as usize] as f64)
}

pub fn run(settings: &Settings, args: &DecodeArgs) -> Result<i32, JobError> {
    // The numbers (--temperature, --top-p, --top-k, --max-seq, ...) were bounded as they were
    // parsed (cli.rs); here the names, then what needs the model.
    let dtype = dtype_arg("--dtype", &args.dtype, &["auto"]).map_err(usage)?;
    let kv_dtype = dtype_arg("--kv-dtype", &args.kv_dtype, &["auto"]).map_err(usage)?;
    let model = ModelInput::open(args.model.as_deref())?;
    let (cfg, name) = (model.cfg.clone(), model.name.clone());
    let (model_spec, context) = model.spec(
        dtype,
        kv_dtype,
        args.max_seq,
        args.graph == "on",
        settings,
        1,
    )?;
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => tprun_rank::files::read_text(f, PROMPT_FILE_LIMIT)
            .map_err(|e| bad(format!("prompt file {}: {e}", f.display())))?,
        (None, None) => DEFAULT_PROMPT.to_string(),
    };
    let prompt = model.tok.encode(&text).map_err(bad)?;
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
            cfg.hf_name(),
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
    let kv_dtype = model_spec.kv_dtype;
    let dump_logits = match &args.dump_logits {
        None => None,
        Some(p) => Some(
            p.to_str()
                .ok_or_else(|| bad(format!("the path {} is not UTF-8", p.display())))?
                .to_string(),
        ),
    };
    let spec = DecodeSpec {
        model: model_spec,
        dump_logits,
        // What the context leaves room for, at most: the ranks size their step records by it.
        max_new_tokens: GenerateOptions {
            max_new_tokens: args.max_new_tokens,
            stop: vec![],
        }
        .budget(context, prompt.len()),
        prompt: prompt.clone(),
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
        profile: args.profile,
    };
    let mut st = Streamer {
        tok: model.tok,
        stream: TextStream::after(&prompt),
        ids: Vec::new(),
        text: String::new(),
        json: args.json,
        terminal: std::io::IsTerminal::is_terminal(&std::io::stdout()),
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
        profile,
    }) = st.stats
    else {
        return Err(bad("rank 0 finished without reporting statistics"));
    };
    step_us.sort_by(f32::total_cmp);
    let load_s = st.loaded_s.unwrap_or(f64::NAN);
    // No prefill runs when no token is to be generated (--max-new-tokens 0).
    let prefill_tps = (prefill_s > 0.0).then(|| prompt_tokens as f64 / prefill_s);
    let load_gbps = st.load_bytes as f64 / load_s / 1e9;
    // Per-token figures exist only from the second token on (the time between two tokens):
    // with 0 or 1 generated tokens they are absent (null in JSON, left out of the summary).
    let p50_us = percentile(&step_us, 0.5);
    let decode_tps = (generated > 1).then(|| (generated - 1) as f64 / decode_s);
    // Effective weight bandwidth of rank 0: the bytes one step reads over the median step.
    let step_gbps = p50_us.map(|p| step_bytes as f64 / (p / 1e6) / 1e9);
    let p50 = p50_us.map(|p| p / 1e3);
    let p99 = percentile(&step_us, 0.99).map(|p| p / 1e3);
    if args.json {
        let mut v = json!({
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
        if args.profile {
            v["profile"] = json!(profile
                .iter()
                .map(|(label, calls, s)| json!({
                    "op": label,
                    "calls": calls,
                    "device_s": s,
                    "us_per_token": s * 1e6 / steps_profiled(generated),
                }))
                .collect::<Vec<_>>());
        }
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        let rates = match (decode_tps, step_gbps, p50, p99) {
            (Some(tps), Some(gbps), Some(p50), Some(p99)) => format!(
                " ({tps:.1} tok/s, {gbps:.0} GB/s of weights{}) · per token p50 {p50:.2} ms, \
                 p99 {p99:.2} ms",
                if graph { ", one graph per token" } else { "" }
            ),
            _ => String::new(),
        };
        let prefill = match prefill_tps {
            Some(tps) => format!("{:.1} ms ({tps:.0} tok/s)", prefill_s * 1e3),
            None => "–".into(),
        };
        eprintln!(
            "load {load_s:.2} s ({load_gbps:.1} GB/s) · prefill {prompt_tokens} tokens {prefill} \
             · decode {generated} tokens {:.2} s{rates}{}",
            decode_s,
            if stopped {
                " · stopped at end of sequence"
            } else {
                ""
            }
        );
        if args.profile {
            print_profile(&profile, generated);
        }
    }
    Ok(0)
}

/// Decode steps a profile covers: every token after the prefill's, and the one step that may
/// have been queued past the last (see `Model::decode`) is not counted (a small overestimate
/// per token).
fn steps_profiled(generated: usize) -> f64 {
    generated.saturating_sub(1).max(1) as f64
}

/// The `--profile` table on stderr: device time per op and token, largest first.
fn print_profile(profile: &[(String, u64, f64)], generated: usize) {
    if profile.is_empty() {
        eprintln!("profile: this backend does not time ops (GPU backends only)");
        return;
    }
    let steps = steps_profiled(generated);
    let total: f64 = profile.iter().map(|p| p.2).sum();
    eprintln!(
        "profile over {steps} steps: {:.1} µs of device time per token",
        total * 1e6 / steps
    );
    eprintln!("{:>10} {:>7} {:>10}  op", "µs/token", "share", "calls/tok");
    for (label, calls, s) in profile {
        eprintln!(
            "{:>10.1} {:>6.1}% {:>10.1}  {label}",
            s * 1e6 / steps,
            100.0 * s / total,
            *calls as f64 / steps
        );
    }
}

pub fn synth_cmd(args: &SynthArgs) -> Result<i32, JobError> {
    let arch = Arch::parse(&args.arch).ok_or_else(|| {
        usage(format!(
            "unknown --arch '{}' (llama, mistral, qwen2, qwen3, qwen3_5)",
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
    let quant = match args.quant.as_deref() {
        None if args.group_size.is_some() || args.desc_act => {
            return Err(usage("--group-size and --desc-act need --quant gptq-int4"));
        }
        None => None,
        Some("gptq-int4") => Some(SynthQuant {
            group_size: match args.group_size {
                None => Some(SynthQuant::default_group(preset)),
                Some(-1) => None,
                Some(g) if g > 0 && g % 8 == 0 => Some(g as usize),
                Some(g) => {
                    return Err(usage(format!(
                        "--group-size {g}: a positive multiple of 8, or -1"
                    )))
                }
            },
            desc_act: args.desc_act,
            format: ZeroFormat::V1,
            dequantised: false,
        }),
        Some(q) => return Err(usage(format!("unknown --quant '{q}' (gptq-int4)"))),
    };
    let opts = SynthOptions {
        arch,
        preset,
        dtype,
        seed: args.seed,
        tie_embeddings: None,
        quant,
    };
    let cfg = config_for(&opts);
    if let Some(g) = opts.quant.as_ref().and_then(|q| q.group_size) {
        if !cfg.hidden.is_multiple_of(g) || !cfg.intermediate.is_multiple_of(g) {
            return Err(usage(format!(
                "--group-size {g} does not divide the hidden size {} and the MLP size {} of \
                 preset {}",
                cfg.hidden,
                cfg.intermediate,
                preset.name()
            )));
        }
    }
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
    let quant = match &opts.quant {
        Some(q) => format!(
            ", MLP in GPTQ int4 (group {}{})",
            q.group_size.map_or("-1".into(), |g| g.to_string()),
            if q.desc_act { ", desc_act" } else { "" }
        ),
        None => String::new(),
    };
    eprintln!(
        "wrote {} ({}, preset {}, {} layers, hidden {}, vocab {}, {}{quant})",
        Path::new(&args.out).display(),
        cfg.hf_name(),
        preset.name(),
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        dtype
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_for_a_terminal() {
        assert_eq!(
            escape_controls("plain text\n\tindented"),
            "plain text\n\tindented"
        );
        assert_eq!(
            escape_controls("a\x07b\x08c\x0e\x7f\x1b[2J\r\u{85}é"),
            "a\\x07b\\x08c\\x0e\\x7f\\x1b[2J\\x0d\\x85é"
        );
    }

    #[test]
    fn no_quantile_of_nothing() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.5), Some(2.0));
    }
}

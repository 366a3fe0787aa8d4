//! The model's shape and options, parsed from a Hugging Face `config.json` (and the eos ids
//! from `generation_config.json`). Owns validation: every missing, mistyped or unsupported
//! field becomes a [`ModelError`] naming the file and the field.
//!
//! Supported `architectures`: `LlamaForCausalLM` (Llama 2/3, incl. `rope_scaling` type
//! `llama3`), `MistralForCausalLM`, `Qwen2ForCausalLM` (bias on q/k/v), `Qwen3ForCausalLM`
//! (per-head RMSNorm on q and k, explicit `head_dim`), and the gated DeltaNet hybrid Qwen3.5
//! (`Qwen3_5ForCausalLM`, and the text part of `Qwen3_5ForConditionalGeneration`, whose text
//! settings sit under `text_config`; see [`Hybrid`]). Sliding-window attention (Mistral,
//! Qwen2's `use_sliding_window`) is not implemented: attention is always over the whole
//! context, which is what those models do within their window.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tprun_kernels::DType;

use super::gptq::GptqConfig;
use super::ModelError;

/// Which transformer variant a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Qwen3.5: gated DeltaNet layers with a full-attention layer every few
    /// ([`ModelConfig::hybrid`] holds the rest).
    Qwen3_5,
}

impl Arch {
    pub const ALL: [Arch; 5] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3_5,
    ];

    /// The `architectures[0]` name in config.json (Qwen3.5's text-only class; the multimodal
    /// checkpoints say `Qwen3_5ForConditionalGeneration`, [`Hybrid::multimodal`]).
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen3_5 => "Qwen3_5ForCausalLM",
        }
    }

    /// The `model_type` in config.json (Qwen3.5's multimodal config says `qwen3_5` and its
    /// `text_config` `qwen3_5_text`).
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3_5 => "qwen3_5",
        }
    }
}

/// The token mixer of one decoder layer (Qwen3.5's `layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// `full_attention`: softmax attention over the KV cache.
    Attention,
    /// `linear_attention`: a gated DeltaNet with a recurrent state.
    Delta,
}

/// What a gated DeltaNet hybrid (Qwen3.5) adds to the config, as transformers'
/// `Qwen3_5TextConfig` and `modeling_qwen3_5.py` read it.
#[derive(Clone, Debug, PartialEq)]
pub struct Hybrid {
    /// Each layer's mixer (`layer_types`; else every `full_attention_interval`-th layer,
    /// counting from 1, is attention: layer i is attention when (i + 1) % interval == 0).
    pub kinds: Vec<LayerKind>,
    /// `linear_num_key_heads`: DeltaNet q/k heads.
    pub k_heads: usize,
    /// `linear_num_value_heads`: DeltaNet value heads (a multiple of `k_heads`; value head h
    /// reads key head h / (v_heads / k_heads)).
    pub v_heads: usize,
    /// `linear_key_head_dim`, `linear_value_head_dim`.
    pub dk: usize,
    pub dv: usize,
    /// `linear_conv_kernel_dim`: taps of the causal depthwise conv.
    pub conv_kernel: usize,
    /// Dimensions of each attention head that RoPE rotates: `head_dim · partial_rotary_factor`
    /// (the first ones; rotate-half pairs i with i + rotary_dim / 2).
    pub rotary_dim: usize,
    /// `attn_output_gate`: q_proj gives per head [query | gate], and attention's output is
    /// multiplied by σ(gate) before o_proj.
    pub attn_gate: bool,
    /// `Qwen3_5ForConditionalGeneration`: the text weights are under `model.language_model.`
    /// (else `model.`), beside `model.visual.*` (not read).
    pub multimodal: bool,
}

impl Hybrid {
    /// Width of the DeltaNet q|k|v (the conv's channels): 2·k_heads·dk + v_heads·dv.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }
}

/// `rope_scaling` of type `llama3` (Llama 3.1+): low frequencies are slowed by `factor`, high
/// ones kept, and the band between interpolated (transformers' `_compute_llama3_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// A parsed, validated config.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Width of the MLP (`intermediate_size`).
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`; = heads when absent).
    pub kv_heads: usize,
    /// Per-head width (`head_dim`; hidden / heads when absent).
    pub head_dim: usize,
    pub vocab: usize,
    /// `max_position_embeddings`.
    pub max_positions: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    /// Bias on q/k/v projections (Qwen2; Llama's `attention_bias` is not supported).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The LM head is the embedding table (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// The checkpoint's dtype (`torch_dtype` or `dtype`), when given.
    pub dtype: Option<DType>,
    pub bos: Option<u32>,
    /// Generation stops at any of these (generation_config.json, else config.json).
    pub eos: Vec<u32>,
    /// Qwen3.5's DeltaNet layers and attention extras; `None` for the plain transformers.
    pub hybrid: Option<Hybrid>,
    /// `quantization_config` of a GPTQ checkpoint (top level or under `text_config`):
    /// which linears are stored as int4 and how; `None` for a dense checkpoint.
    pub gptq: Option<GptqConfig>,
}

// ---- bounds ------------------------------------------------------------------------------
// Every dimension is checked against these as config.json is parsed, before anything is sized
// by it: products of two dimensions (tensor shapes, cache rows) then fit 64 bits many times
// over, loops over layers end, and a corrupt or hostile config fails with the field's name
// instead of an allocation of its value. Each bound is several times the largest supported
// checkpoint's value, so no real model comes near.

/// Most `num_hidden_layers`: 8 × Llama 3.1 405B's 126.
pub const MAX_LAYERS: usize = 1024;
/// Widest `hidden_size`, `intermediate_size` and `num_attention_heads · head_dim`: 2^18,
/// about 5 × Llama 3.1 405B's intermediate size (53248), the widest supported.
pub const MAX_WIDTH: usize = 1 << 18;
/// Longest `linear_conv_kernel_dim`: 16 × Qwen3.5's 4.
pub const MAX_CONV_KERNEL: usize = 64;
/// Most `num_attention_heads`: 8 × Llama 3.1 405B's 128.
pub const MAX_HEADS: usize = 1024;
/// Widest `head_dim`: 4 × the widest supported (256).
pub const MAX_HEAD_DIM: usize = 1024;
/// Largest `vocab_size`: 2^24. The sampler carries token ids as f32 (`ops::ShardTopK`),
/// exact below 2^24; the largest supported vocab (Qwen's 151936) is far below.
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest `max_position_embeddings`: positions are u32 on the device, and the token
/// history holds one more than the context.
pub const MAX_POSITIONS: usize = u32::MAX as usize - 1;

/// A JSON object with its file name, so that each accessor can name both in its error.
struct Fields<'a> {
    file: &'a Path,
    obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, field: &str, why: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: self.file.to_path_buf(),
            field: field.into(),
            why: why.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.err(field, format!("expected a non-negative integer, got {v}"))
            }),
        }
    }

    /// An integer in `1..=max`, or `None` when absent.
    fn bounded_opt(&self, field: &str, max: usize) -> Result<Option<usize>, ModelError> {
        match self.usize_opt(field)? {
            Some(v) if v == 0 || v > max => {
                Err(self.err(field, format!("{v} is out of range: expected 1 to {max}")))
            }
            v => Ok(v),
        }
    }

    /// A required integer in `1..=max`.
    fn bounded(&self, field: &str, max: usize) -> Result<usize, ModelError> {
        self.bounded_opt(field, max)?
            .ok_or_else(|| self.err(field, "missing"))
    }

    /// A finite number > 0 (and < `below`, when given), or `default` when absent.
    fn positive_or(
        &self,
        field: &str,
        default: f64,
        below: Option<f64>,
    ) -> Result<f64, ModelError> {
        let v = match self.get(field) {
            None => return Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(field, format!("expected a number, got {v}")))?,
        };
        let ok = v.is_finite() && v > 0.0 && below.is_none_or(|b| v < b);
        if !ok {
            let range = match below {
                Some(b) => format!("a number > 0 and < {b}"),
                None => "a finite number > 0".into(),
            };
            return Err(self.err(field, format!("{v} is out of range: expected {range}")));
        }
        Ok(v)
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&self, field: &str) -> Result<Option<&str>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a string, got {v}"))),
        }
    }

    /// An int or a list of ints (`eos_token_id`).
    fn ids(&self, field: &str) -> Result<Option<Vec<u32>>, ModelError> {
        let bad = |v: &Value| self.err(field, format!("expected an id or a list of ids, got {v}"));
        let one = |v: &Value| {
            v.as_u64()
                .filter(|&x| x <= u32::MAX as u64)
                .map(|x| x as u32)
        };
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| one(v).ok_or_else(|| bad(v)))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => one(v).map(|x| Some(vec![x])).ok_or_else(|| bad(v)),
        }
    }
}

/// `text` (of the file `path`) as a JSON object.
fn json_object(path: &Path, text: &str) -> Result<Map<String, Value>, ModelError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ModelError::Config {
            file: path.into(),
            field: "(top level)".into(),
            why: "expected a JSON object".into(),
        }),
        Err(e) => Err(ModelError::Config {
            file: path.into(),
            field: "(syntax)".into(),
            why: format!("not valid JSON: {e}"),
        }),
    }
}

impl ModelConfig {
    /// Reads `dir/config.json` and, when present, `dir/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig, ModelError> {
        let read = |p: &Path| crate::files::read_json_text(p).map_err(|e| ModelError::io(p, e));
        let path = dir.join("config.json");
        let text = read(&path)?;
        let gen_path = dir.join("generation_config.json");
        let gen = match gen_path.exists() {
            true => Some(read(&gen_path)?),
            false => None,
        };
        Self::from_texts(
            (&path, &text),
            gen.as_deref().map(|g| (gen_path.as_path(), g)),
        )
    }

    /// Parses the texts of a config.json and, when there is one, a generation_config.json
    /// (each with its path, for errors): what [`ModelConfig::from_dir`] reads.
    pub fn from_texts(
        config: (&Path, &str),
        generation: Option<(&Path, &str)>,
    ) -> Result<ModelConfig, ModelError> {
        let mut cfg = Self::parse(config.0, &json_object(config.0, config.1)?)?;
        if let Some((gen_path, text)) = generation {
            let gen = json_object(gen_path, text)?;
            let f = Fields {
                file: gen_path,
                obj: &gen,
            };
            if let Some(eos) = f.ids("eos_token_id")? {
                cfg.eos = eos;
            }
            if let Some(bos) = f.ids("bos_token_id")? {
                cfg.bos = bos.first().copied();
            }
        }
        Ok(cfg)
    }

    /// Parses the object of a config.json; `file` is used in error messages only.
    pub fn parse(file: &Path, obj: &Map<String, Value>) -> Result<ModelConfig, ModelError> {
        let f = Fields { file, obj };
        let unsupported = |field: &str, value: String, supported: &str| ModelError::Unsupported {
            file: PathBuf::from(file),
            field: field.into(),
            value,
            supported: supported.into(),
        };
        let arch_name = match f.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => a[0]
                .as_str()
                .ok_or_else(|| f.err("architectures", "expected a list of strings"))?,
            Some(_) => return Err(f.err("architectures", "expected a non-empty list of strings")),
            None => return Err(f.err("architectures", "missing")),
        };
        let multimodal = arch_name == "Qwen3_5ForConditionalGeneration";
        let arch = Arch::ALL
            .into_iter()
            .find(|a| a.hf_name() == arch_name || (multimodal && *a == Arch::Qwen3_5))
            .ok_or_else(|| {
                // Qwen3-Next (a mixture of experts around the same DeltaNet) has its ops but
                // not its experts.
                let next = arch_name.starts_with("Qwen3Next");
                unsupported(
                    "architectures",
                    format!("{arch_name:?}"),
                    if next {
                        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                         Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration; \
                         the gated DeltaNet mixture of experts (Qwen3-Next) is not yet wired \
                         into decode"
                    } else {
                        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                         Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration"
                    },
                )
            })?;
        // Qwen3.5's multimodal config nests the text model's settings under `text_config`:
        // read those, with the top level's as defaults (tie_word_embeddings lives there).
        let merged;
        let f = match f.get("text_config") {
            Some(Value::Object(tc)) if arch == Arch::Qwen3_5 => {
                let mut m = obj.clone();
                m.extend(tc.iter().map(|(k, v)| (k.clone(), v.clone())));
                merged = m;
                Fields { file, obj: &merged }
            }
            Some(v) if arch == Arch::Qwen3_5 => {
                return Err(f.err("text_config", format!("expected an object, got {v}")))
            }
            _ => f,
        };

        // Every dimension within its bound, and consistent with the others, before the
        // config is returned to anything that sizes a buffer or a loop by it.
        let hidden = f.bounded("hidden_size", MAX_WIDTH)?;
        let intermediate = f.bounded("intermediate_size", MAX_WIDTH)?;
        let layers = f.bounded("num_hidden_layers", MAX_LAYERS)?;
        let vocab = f.bounded("vocab_size", MAX_VOCAB)?;
        let max_positions = f
            .bounded_opt("max_position_embeddings", MAX_POSITIONS)?
            .unwrap_or(4096);
        let heads = f.bounded("num_attention_heads", MAX_HEADS)?;
        let kv_heads = f
            .bounded_opt("num_key_value_heads", MAX_HEADS)?
            .unwrap_or(heads);
        if !heads.is_multiple_of(kv_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = match f.bounded_opt("head_dim", MAX_HEAD_DIM)? {
            Some(d) => d,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(f.err(
                    "head_dim",
                    format!("missing, and hidden_size {hidden} is not a multiple of {heads} heads"),
                ))
            }
        };
        if !head_dim.is_multiple_of(2) {
            return Err(f.err(
                "head_dim",
                format!("{head_dim} must be even and positive (RoPE)"),
            ));
        }
        if heads * head_dim > MAX_WIDTH {
            return Err(f.err(
                "head_dim",
                format!(
                    "num_attention_heads {heads} × head_dim {head_dim} is wider than {MAX_WIDTH}"
                ),
            ));
        }
        if let Some(act) = f.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(unsupported(
                    "hidden_act",
                    format!("{act:?}"),
                    "only \"silu\"",
                ));
            }
        }
        for field in ["attention_bias", "mlp_bias"] {
            if arch != Arch::Qwen2 && f.bool_or(field, false)? {
                return Err(unsupported(
                    field,
                    "true".into(),
                    "only false for this architecture",
                ));
            }
        }
        let rope_scaling = match f.get("rope_scaling") {
            // Qwen3.5's rope settings (and its mrope sections) are read by `parse_hybrid`.
            _ if arch == Arch::Qwen3_5 => None,
            None => None,
            Some(Value::Object(rs)) => {
                let rf = Fields { file, obj: rs };
                let kind = match rf.str_opt("rope_type")? {
                    Some(k) => k,
                    None => rf.str_opt("type")?.unwrap_or("default"),
                };
                match kind {
                    "default" => None,
                    "llama3" => {
                        let num = |k: &str| -> Result<f64, ModelError> {
                            match rs.get(k).and_then(Value::as_f64) {
                                Some(v) if v > 0.0 && v.is_finite() => Ok(v),
                                _ => Err(f.err(
                                    &format!("rope_scaling.{k}"),
                                    "missing or not a finite positive number",
                                )),
                            }
                        };
                        let s = Llama3Scaling {
                            factor: num("factor")?,
                            low_freq_factor: num("low_freq_factor")?,
                            high_freq_factor: num("high_freq_factor")?,
                            original_max_position_embeddings: num(
                                "original_max_position_embeddings",
                            )?,
                        };
                        if s.high_freq_factor <= s.low_freq_factor {
                            return Err(f.err(
                                "rope_scaling.high_freq_factor",
                                "must exceed low_freq_factor",
                            ));
                        }
                        Some(s)
                    }
                    other => {
                        return Err(unsupported(
                            "rope_scaling.rope_type",
                            format!("{other:?}"),
                            "supported: default, llama3",
                        ))
                    }
                }
            }
            Some(v) => {
                return Err(f.err(
                    "rope_scaling",
                    format!("expected an object or null, got {v}"),
                ))
            }
        };
        let dtype = match f.str_opt("torch_dtype")?.or(f.str_opt("dtype")?) {
            None => None,
            Some(s) => Some(DType::parse(s).ok_or_else(|| {
                unsupported(
                    "torch_dtype",
                    format!("{s:?}"),
                    "float32, float16, bfloat16",
                )
            })?),
        };
        // Below 1: the epsilon only guards the division of a norm (typically 1e-5 or 1e-6);
        // and representable in f32, in which the kernels use it.
        let rms_eps = f.positive_or("rms_norm_eps", 1e-6, Some(1.0))?;
        if rms_eps as f32 == 0.0 {
            return Err(f.err(
                "rms_norm_eps",
                format!("{rms_eps} is 0 in f32, the kernels' precision"),
            ));
        }
        let (hybrid, rope_theta) = match arch {
            Arch::Qwen3_5 => {
                let (h, theta) = parse_hybrid(&f, layers, heads, head_dim, multimodal)?;
                (Some(h), theta)
            }
            _ => (None, f.positive_or("rope_theta", 10000.0, None)?),
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            max_positions,
            rms_eps: rms_eps as f32,
            rope_theta,
            rope_scaling,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3_5),
            tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
            dtype,
            bos: f.ids("bos_token_id")?.and_then(|v| v.first().copied()),
            eos: f.ids("eos_token_id")?.unwrap_or_default(),
            hybrid,
            gptq: GptqConfig::from_config(file, &Value::Object(obj.clone()))?,
        };
        // A tiny theta (1e-36) passes as positive, but its frequencies 1 / theta^(2i/d), or the
        // angles position · frequency, overflow f32, in which the kernels rotate: the logits
        // would be NaN from that position on.
        let top = cfg.inv_freq().into_iter().fold(0.0f32, f32::max);
        if !(top * cfg.max_positions as f32).is_finite() {
            return Err(f.err(
                "rope_theta",
                format!(
                    "{} is too small: its RoPE angles overflow f32 (the kernels' precision) \
                     within max_position_embeddings {}",
                    cfg.rope_theta, cfg.max_positions
                ),
            ));
        }
        Ok(cfg)
    }

    /// The checkpoint's `architectures[0]`: [`Arch::hf_name`], but Qwen3.5's multimodal class
    /// where the weights are laid out as its.
    pub fn hf_name(&self) -> &'static str {
        match &self.hybrid {
            Some(h) if h.multimodal => "Qwen3_5ForConditionalGeneration",
            _ => self.arch.hf_name(),
        }
    }

    /// Each layer's mixer: all attention unless the model is a hybrid.
    pub fn kind(&self, layer: usize) -> LayerKind {
        match &self.hybrid {
            Some(h) => h.kinds[layer],
            None => LayerKind::Attention,
        }
    }

    /// Whether the RMSNorm weights are stored zero-centred (Qwen3.5: the norm multiplies by
    /// 1 + w, in f32; the loader adds the 1 so that the norm ops stay `· w`).
    pub fn zero_centred_norms(&self) -> bool {
        self.arch == Arch::Qwen3_5
    }

    /// Dimensions of each head that RoPE rotates (all of them but in Qwen3.5).
    pub fn rotary_dim(&self) -> usize {
        self.hybrid.as_ref().map_or(self.head_dim, |h| h.rotary_dim)
    }

    /// RoPE inverse frequencies `1 / theta^(2i / rotary_dim)` for `i < rotary_dim / 2`
    /// (rotary_dim = head_dim but in Qwen3.5), with `llama3` scaling applied, rounded to f32
    /// as transformers stores them.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim() as f64;
        (0..self.rotary_dim() / 2)
            .map(|i| {
                // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in f32.
                let expo = ((2 * i) as f32 / d as f32) as f64;
                let f = (1.0 / self.rope_theta.powf(expo)) as f32 as f64;
                let Some(s) = self.rope_scaling else {
                    return f as f32;
                };
                let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let g = if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                };
                g as f32
            })
            .collect()
    }

    /// Builds the JSON object of a config.json for this config (used by `synth`).
    pub fn to_json(&self) -> Value {
        use serde_json::json;
        let mut v = json!({
            "architectures": [self.arch.hf_name()],
            "model_type": self.arch.model_type(),
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            // The f32's shortest decimal (1e-5), not its exact binary value widened to f64
            // (9.999999747378752e-6): what a Hugging Face config holds.
            "rms_norm_eps": f32_decimal(self.rms_eps),
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos,
        });
        if let Some(d) = self.dtype {
            v["torch_dtype"] = json!(match d {
                DType::F32 => "float32",
                DType::F16 => "float16",
                DType::BF16 => "bfloat16",
                DType::U32 => "uint32",
            });
        }
        v["eos_token_id"] = match self.eos.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        if let Some(s) = self.rope_scaling {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                // An integer in Hugging Face configs (8192): written as one when whole.
                "original_max_position_embeddings": whole_or_float(s.original_max_position_embeddings),
            });
        }
        if self.arch == Arch::Qwen2 {
            v["use_sliding_window"] = Value::Bool(false);
        }
        let mut v = match &self.hybrid {
            Some(h) => hybrid_json(self, h, v),
            None => v,
        };
        // At the top level, as the official Qwen3.5 GPTQ checkpoints have it.
        if let Some(q) = &self.gptq {
            v["quantization_config"] = q.to_json();
        }
        v
    }
}

/// Qwen3.5's settings beyond the transformer's (transformers' `Qwen3_5TextConfig`), and its
/// rope theta: `rope_parameters` (or the older `rope_scaling`) holds `rope_theta` and
/// `partial_rotary_factor` (either may also sit at the top level; defaults 10000 and 0.25, as
/// the config class); its `mrope_section` splits the rotary dims between the temporal, height
/// and width positions of images, which for text are all the token's position, so the
/// sections collapse to plain RoPE.
fn parse_hybrid(
    f: &Fields<'_>,
    layers: usize,
    heads: usize,
    head_dim: usize,
    multimodal: bool,
) -> Result<(Hybrid, f64), ModelError> {
    let unsupported = |field: &str, value: String, supported: &str| ModelError::Unsupported {
        file: f.file.to_path_buf(),
        field: field.into(),
        value,
        supported: supported.into(),
    };
    let (mut theta, mut factor) = (None, None);
    for key in ["rope_parameters", "rope_scaling"] {
        match f.get(key) {
            None => {}
            Some(Value::Object(rp)) => {
                let rf = Fields {
                    file: f.file,
                    obj: rp,
                };
                let kind = match rf.str_opt("rope_type")? {
                    Some(k) => k,
                    None => rf.str_opt("type")?.unwrap_or("default"),
                };
                if !matches!(kind, "default" | "mrope") {
                    return Err(unsupported(
                        &format!("{key}.rope_type"),
                        format!("{kind:?}"),
                        "supported for Qwen3.5: default (its mrope sections are plain RoPE for \
                         text)",
                    ));
                }
                if rf.get("rope_theta").is_some() {
                    theta = Some(rf.positive_or("rope_theta", 0.0, None)?);
                }
                if rf.get("partial_rotary_factor").is_some() {
                    factor =
                        Some(rf.positive_or("partial_rotary_factor", 0.0, Some(1.0 + 1e-9))?);
                }
                break;
            }
            Some(v) => return Err(f.err(key, format!("expected an object or null, got {v}"))),
        }
    }
    let theta = match theta {
        Some(t) => t,
        None => f.positive_or("rope_theta", 10000.0, None)?,
    };
    let factor = match factor {
        Some(p) => p,
        None => f.positive_or("partial_rotary_factor", 0.25, Some(1.0 + 1e-9))?,
    };
    // transformers: dim = int(head_dim * partial_rotary_factor).
    let rotary_dim = (head_dim as f64 * factor) as usize;
    if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        return Err(f.err(
            "partial_rotary_factor",
            format!(
                "{factor} of head_dim {head_dim} is {rotary_dim} dims: must be even and at least 2"
            ),
        ));
    }
    let kinds = match f.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(f.err(
                    "layer_types",
                    format!("{} entries for num_hidden_layers {layers}", a.len()),
                ));
            }
            a.iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(LayerKind::Attention),
                    Some("linear_attention") => Ok(LayerKind::Delta),
                    _ => Err(unsupported(
                        "layer_types",
                        v.to_string(),
                        "each \"full_attention\" or \"linear_attention\"",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(v) => return Err(f.err("layer_types", format!("expected a list, got {v}"))),
        None => {
            let every = f
                .bounded_opt("full_attention_interval", MAX_LAYERS)?
                .unwrap_or(4);
            (0..layers)
                .map(|i| match (i + 1) % every {
                    0 => LayerKind::Attention,
                    _ => LayerKind::Delta,
                })
                .collect()
        }
    };
    let k_heads = f
        .bounded_opt("linear_num_key_heads", MAX_HEADS)?
        .unwrap_or(16);
    let v_heads = f
        .bounded_opt("linear_num_value_heads", MAX_HEADS)?
        .unwrap_or(32);
    if !v_heads.is_multiple_of(k_heads) {
        return Err(f.err(
            "linear_num_value_heads",
            format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
        ));
    }
    let h = Hybrid {
        kinds,
        k_heads,
        v_heads,
        dk: f
            .bounded_opt("linear_key_head_dim", MAX_HEAD_DIM)?
            .unwrap_or(128),
        dv: f
            .bounded_opt("linear_value_head_dim", MAX_HEAD_DIM)?
            .unwrap_or(128),
        conv_kernel: f
            .bounded_opt("linear_conv_kernel_dim", MAX_CONV_KERNEL)?
            .unwrap_or(4),
        rotary_dim,
        attn_gate: f.bool_or("attn_output_gate", true)?,
        multimodal,
    };
    if h.conv_kernel < 2 {
        return Err(f.err("linear_conv_kernel_dim", "must be at least 2"));
    }
    if h.conv_dim() > MAX_WIDTH {
        return Err(f.err(
            "linear_num_value_heads",
            format!(
                "the DeltaNet q|k|v width {} is wider than {MAX_WIDTH}",
                h.conv_dim()
            ),
        ));
    }
    if 2 * heads * head_dim > MAX_WIDTH {
        return Err(f.err(
            "num_attention_heads",
            format!(
                "q_proj with its output gate is 2·heads·head_dim = {} wide, more than \
                 {MAX_WIDTH}",
                2 * heads * head_dim
            ),
        ));
    }
    Ok((h, theta))
}

/// `v` (a flat config.json) in Qwen3.5's layout: its DeltaNet fields and `rope_parameters`
/// added and, for the multimodal class, nested under `text_config` as the official
/// checkpoints are (Qwen/Qwen3.5-27B: `Qwen3_5ForConditionalGeneration`, vision settings
/// beside; `tprun` reads none of them).
fn hybrid_json(c: &ModelConfig, h: &Hybrid, mut v: Value) -> Value {
    use serde_json::json;
    let o = v.as_object_mut().expect("an object");
    for k in ["rope_theta", "rope_scaling", "architectures"] {
        o.remove(k);
    }
    let kinds: Vec<&str> = h
        .kinds
        .iter()
        .map(|k| match k {
            LayerKind::Attention => "full_attention",
            LayerKind::Delta => "linear_attention",
        })
        .collect();
    let factor = h.rotary_dim as f64 / c.head_dim as f64;
    let mut rope = json!({
        "rope_type": "default",
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": factor,
    });
    // Qwen3.5-27B's sections (11 + 11 + 10 = 32 = its rotary_dim / 2); any other rotary
    // width leaves them to transformers' default, which text never reads.
    if h.rotary_dim == 64 {
        rope["mrope_section"] = json!([11, 11, 10]);
        rope["mrope_interleaved"] = json!(true);
    }
    o.insert("model_type".into(), json!("qwen3_5_text"));
    o.insert("layer_types".into(), json!(kinds));
    o.insert("linear_num_key_heads".into(), json!(h.k_heads));
    o.insert("linear_num_value_heads".into(), json!(h.v_heads));
    o.insert("linear_key_head_dim".into(), json!(h.dk));
    o.insert("linear_value_head_dim".into(), json!(h.dv));
    o.insert("linear_conv_kernel_dim".into(), json!(h.conv_kernel));
    o.insert("attn_output_gate".into(), json!(h.attn_gate));
    o.insert("partial_rotary_factor".into(), json!(factor));
    o.insert("rope_parameters".into(), rope);
    o.insert("attention_bias".into(), json!(false));
    if !h.multimodal {
        o.insert("architectures".into(), json!([Arch::Qwen3_5.hf_name()]));
        return v;
    }
    json!({
        "architectures": [c.hf_name()],
        "model_type": "qwen3_5",
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": v.get("torch_dtype").cloned().unwrap_or(Value::Null),
        "text_config": v,
        // Qwen3.5-27B's vision tower settings, for the layout's sake.
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152,
                          "num_heads": 16, "out_hidden_size": c.hidden},
    })
}

/// The f64 whose shortest decimal is `x`'s shortest decimal (1e-5 for the f32 nearest 1e-5).
fn f32_decimal(x: f32) -> f64 {
    x.to_string()
        .parse()
        .expect("an f32's Display parses as f64")
}

/// `x` as a JSON integer when it is a whole number that fits u64, else as a float.
fn whole_or_float(x: f64) -> Value {
    if x.fract() == 0.0 && (0.0..u64::MAX as f64).contains(&x) {
        Value::from(x as u64)
    } else {
        Value::from(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig, ModelError> {
        ModelConfig::parse(Path::new("config.json"), v.as_object().unwrap())
    }

    fn llama() -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
            "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4,
            "vocab_size": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
            "eos_token_id": 2, "bos_token_id": 1
        })
    }

    #[test]
    fn parses_llama_with_defaults() {
        let c = parse(llama()).unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.kv_heads, c.eos.clone()),
            (Arch::Llama, 8, 4, vec![2])
        );
        assert!(c.tie_embeddings && !c.qkv_bias && !c.qk_norm && c.rope_scaling.is_none());
    }

    #[test]
    fn qwen_variants_set_bias_and_qk_norm() {
        let mut v = llama();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        assert!(parse(v.clone()).unwrap().qkv_bias);
        v["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
        v["head_dim"] = serde_json::json!(16);
        let c = parse(v).unwrap();
        assert!(c.qk_norm && c.head_dim == 16);
    }

    /// Qwen/Qwen3.5-27B's config.json (its text_config; the vision settings trimmed).
    fn qwen35_27b() -> Value {
        serde_json::json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": false, "eos_token_id": 248046,
            "text_config": {
                "attention_bias": false, "attn_output_gate": true, "eos_token_id": 248044,
                "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
                "hidden_size": 5120, "intermediate_size": 17408, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 48, "linear_value_head_dim": 128,
                "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
                "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4,
                "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
                "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
                "vocab_size": 248320
            },
            "vision_config": {"depth": 27, "hidden_size": 1152}
        })
    }

    #[test]
    fn qwen35_nested_text_config_parses() {
        let c = parse(qwen35_27b()).unwrap();
        let h = c.hybrid.clone().unwrap();
        assert_eq!(
            (
                c.arch,
                c.hidden,
                c.intermediate,
                c.layers,
                c.heads,
                c.kv_heads,
                c.head_dim
            ),
            (Arch::Qwen3_5, 5120, 17408, 64, 24, 4, 256)
        );
        assert_eq!(
            (c.vocab, c.rope_theta, c.eos.clone()),
            (248320, 1e7, vec![248044])
        );
        assert!(h.multimodal && h.attn_gate && c.qk_norm && !c.tie_embeddings);
        assert_eq!((h.k_heads, h.v_heads, h.dk, h.dv), (16, 48, 128, 128));
        assert_eq!((h.conv_kernel, h.rotary_dim), (4, 64));
        // Every 4th layer (3, 7, …) is attention.
        let attn: Vec<usize> = (0..64)
            .filter(|&i| c.kind(i) == LayerKind::Attention)
            .collect();
        assert_eq!(attn, (0..16).map(|j| 4 * j + 3).collect::<Vec<_>>());
        // inv_freq over the 64 rotated dims.
        let f = c.inv_freq();
        assert_eq!(f.len(), 32);
        assert_eq!(f[1], (1.0 / 1e7f64.powf((2.0f32 / 64.0) as f64)) as f32);
        // What synth writes (the nested layout) parses back to the same config, and so does
        // the flat text-only layout.
        assert_eq!(parse(c.to_json()).unwrap(), c);
        let mut flat = c.clone();
        flat.hybrid.as_mut().unwrap().multimodal = false;
        let j = flat.to_json();
        assert_eq!(j["architectures"][0], "Qwen3_5ForCausalLM");
        assert_eq!(parse(j).unwrap(), flat);
        // Explicit layer_types win over the interval.
        let mut v = qwen35_27b();
        let mut kinds = vec!["linear_attention"; 64];
        kinds[0] = "full_attention";
        v["text_config"]["layer_types"] = serde_json::json!(kinds);
        let c = parse(v).unwrap();
        assert_eq!(
            (c.kind(0), c.kind(3)),
            (LayerKind::Attention, LayerKind::Delta)
        );
    }

    #[test]
    fn qwen35_bad_values_are_one_clear_line() {
        let cases: &[(&str, Value, &str)] = &[
            (
                "linear_num_value_heads",
                serde_json::json!(40),
                "linear_num_key_heads",
            ),
            ("linear_num_key_heads", serde_json::json!(0), "out of range"),
            (
                "layer_types",
                serde_json::json!(["full_attention"]),
                "1 entries",
            ),
            (
                "layer_types",
                serde_json::json!(vec!["sliding"; 64]),
                "linear_attention",
            ),
            ("partial_rotary_factor", serde_json::json!(0.001), "even"),
            ("linear_conv_kernel_dim", serde_json::json!(1), "at least 2"),
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "yarn"}),
                "yarn",
            ),
            (
                "rope_parameters",
                serde_json::json!({"rope_theta": -1.0}),
                "`rope_theta`",
            ),
            (
                "attn_output_gate",
                serde_json::json!("yes"),
                "true or false",
            ),
        ];
        for (field, value, says) in cases {
            let mut v = qwen35_27b();
            if *field == "partial_rotary_factor" {
                v["text_config"]["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("partial_rotary_factor");
            }
            v["text_config"][*field] = value.clone();
            let e = parse(v)
                .expect_err(&format!("{field} = {value}"))
                .to_string();
            let named = e.contains(field) || *field == "rope_parameters";
            assert!(
                named && e.contains(says) && !e.contains('\n'),
                "{field} = {value}: {e}"
            );
        }
        let mut v = qwen35_27b();
        v["text_config"] = serde_json::json!(3);
        assert!(parse(v).unwrap_err().to_string().contains("text_config"));
    }

    #[test]
    fn mistral_and_eos_lists_parse() {
        let mut v = llama();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        v["sliding_window"] = serde_json::json!(4096);
        v["eos_token_id"] = serde_json::json!([2, 7]);
        v["tie_word_embeddings"] = serde_json::json!(false);
        let c = parse(v).unwrap();
        assert_eq!(c.arch, Arch::Mistral);
        assert_eq!(c.eos, vec![2, 7]);
        assert!(!c.tie_embeddings && !c.qkv_bias);
        // What synth writes parses back to the same config.
        let again = parse(c.to_json()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn llama3_rope_scaling_matches_transformers_bands() {
        let mut v = llama();
        v["head_dim"] = serde_json::json!(128);
        v["rope_theta"] = serde_json::json!(500000.0);
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        let f = c.inv_freq();
        assert_eq!(f[0], 1.0); // high frequency: unchanged
        let base = |i: usize| (1.0 / 500000f64.powf(2.0 * i as f64 / 128.0)) as f32;
        // Lowest frequency: wavelength > 8192 → divided by the factor.
        assert!((f[63] as f64 - base(63) as f64 / 8.0).abs() < 1e-12);
        // A band in between is interpolated: strictly between the two.
        let mid = (0..64).find(|&i| {
            let w = 2.0 * std::f64::consts::PI / base(i) as f64;
            w > 2048.0 && w < 8192.0
        });
        let i = mid.unwrap();
        assert!(f[i] < base(i) && f[i] > base(i) / 8.0);
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = llama();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = parse(v).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("hidden_size") && e.contains("missing"),
            "{e}"
        );

        let mut v = llama();
        v["num_attention_heads"] = serde_json::json!("eight");
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("num_attention_heads"), "{e}");

        let mut v = llama();
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        let e = parse(v).unwrap_err();
        assert!(matches!(e, ModelError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        assert!(!e.to_string().contains("DeltaNet"), "{e}");
        // A Qwen3-Next checkpoint is told why, not only that.
        let mut v = llama();
        v["architectures"] = serde_json::json!(["Qwen3NextForCausalLM"]);
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("Qwen3Next") && e.contains("DeltaNet"), "{e}");

        let mut v = llama();
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        assert!(parse(v).unwrap_err().to_string().contains("rope_scaling"));

        let mut v = llama();
        v["num_key_value_heads"] = serde_json::json!(3);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
    }

    /// Every dimension is bounded, and every float finite and positive, at parse: the field
    /// is named, and nothing is sized by the value first.
    #[test]
    fn out_of_range_fields_are_refused_by_name() {
        let cases: &[(&str, Value)] = &[
            ("num_hidden_layers", serde_json::json!(100_000_000_000u64)),
            ("num_hidden_layers", serde_json::json!(0)),
            ("hidden_size", serde_json::json!(1u64 << 40)),
            ("intermediate_size", serde_json::json!(MAX_WIDTH + 1)),
            ("vocab_size", serde_json::json!(MAX_VOCAB + 1)),
            ("vocab_size", serde_json::json!(-5)),
            ("num_attention_heads", serde_json::json!(MAX_HEADS + 8)),
            ("num_key_value_heads", serde_json::json!(0)),
            ("max_position_embeddings", serde_json::json!(1u64 << 33)),
            ("head_dim", serde_json::json!(MAX_HEAD_DIM + 2)),
            ("head_dim", serde_json::json!(999)),
            ("rope_theta", serde_json::json!(-10000.0)),
            ("rope_theta", serde_json::json!(0.0)),
            ("rope_theta", serde_json::json!(1e-300)),
            ("rope_theta", serde_json::json!(1e-50)), // finite frequencies (head_dim 8), angles not
            ("rms_norm_eps", serde_json::json!(-1e-5)),
            ("rms_norm_eps", serde_json::json!(0.0)),
            ("rms_norm_eps", serde_json::json!(1e-60)),
            ("rms_norm_eps", serde_json::json!(2.0)),
            ("rms_norm_eps", serde_json::json!("1e-5")),
        ];
        for (field, value) in cases {
            let mut v = llama();
            v[*field] = value.clone();
            let e = parse(v)
                .expect_err(&format!("{field} = {value}"))
                .to_string();
            assert!(e.contains(field), "{field} = {value}: {e}");
        }
        let mut v = llama();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": -8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("rope_scaling.factor"));
    }

    #[test]
    fn synth_writes_what_a_hugging_face_config_holds() {
        let mut v = llama();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        let json = c.to_json();
        assert_eq!(json["rms_norm_eps"].as_f64(), Some(1e-5));
        let text = serde_json::to_string(&json).unwrap();
        assert!(
            text.contains(r#""original_max_position_embeddings":8192"#) && !text.contains("8192.0"),
            "{text}"
        );
        assert_eq!(parse(c.to_json()).unwrap(), c);
    }

    #[test]
    fn config_files_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("tprun-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        std::fs::write(dir.join("config.json"), "{ not json").unwrap();
        let e = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("JSON"), "{e}");
        std::fs::write(dir.join("config.json"), llama().to_string()).unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [2, 1]}"#,
        )
        .unwrap();
        assert_eq!(ModelConfig::from_dir(&dir).unwrap().eos, vec![2, 1]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .unwrap();
        let e = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

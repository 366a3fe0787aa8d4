//! The model's shape and options, parsed from a Hugging Face `config.json` (and the eos ids
//! from `generation_config.json`). Owns validation: every missing, mistyped or unsupported
//! field becomes a [`ModelError`] naming the file and the field.
//!
//! Supported `architectures`: `LlamaForCausalLM` (Llama 2/3, incl. `rope_scaling` type
//! `llama3`), `MistralForCausalLM`, `Qwen2ForCausalLM` (bias on q/k/v), `Qwen3ForCausalLM`
//! (per-head RMSNorm on q and k, explicit `head_dim`). Sliding-window attention (Mistral,
//! Qwen2's `use_sliding_window`) is not implemented: attention is always over the whole
//! context, which is what those models do within their window.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tprun_kernels::DType;

use super::ModelError;

/// Which transformer variant a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    /// The `architectures[0]` name in config.json.
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The `model_type` in config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
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
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| ModelError::io(p, e));
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
        let arch = [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3]
            .into_iter()
            .find(|a| a.hf_name() == arch_name)
            .ok_or_else(|| {
                // The hybrid families have their ops (kernels: GatedDelta, CausalConv,
                // GatedRmsNorm) and their GPTQ loader (gptq.rs), not yet a model.
                let hybrid = arch_name.starts_with("Qwen3_5") || arch_name.starts_with("Qwen3Next");
                unsupported(
                    "architectures",
                    format!("{arch_name:?}"),
                    if hybrid {
                        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                         Qwen3ForCausalLM; the gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) are \
                         not yet wired into decode"
                    } else {
                        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                         Qwen3ForCausalLM"
                    },
                )
            })?;

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
        Ok(ModelConfig {
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
            rope_theta: f.positive_or("rope_theta", 10000.0, None)?,
            rope_scaling,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch == Arch::Qwen3,
            tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
            dtype,
            bos: f.ids("bos_token_id")?.and_then(|v| v.first().copied()),
            eos: f.ids("eos_token_id")?.unwrap_or_default(),
        })
    }

    /// RoPE inverse frequencies `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, with
    /// `llama3` scaling applied, rounded to f32 as transformers stores them.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
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
        v
    }
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
        // A Qwen3.5 checkpoint is told why, not only that.
        for name in ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"] {
            let mut v = llama();
            v["architectures"] = serde_json::json!([name]);
            let e = parse(v).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains("DeltaNet"), "{e}");
        }

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

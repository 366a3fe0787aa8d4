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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

    fn usize(&self, field: &str) -> Result<usize, ModelError> {
        let v = self
            .usize_opt(field)?
            .ok_or_else(|| self.err(field, "missing"))?;
        if v == 0 {
            return Err(self.err(field, "must be positive"));
        }
        Ok(v)
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64, ModelError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(field, format!("expected a number, got {v}"))),
        }
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
                unsupported(
                    "architectures",
                    format!("{arch_name:?}"),
                    "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
                )
            })?;

        let hidden = f.usize("hidden_size")?;
        let heads = f.usize("num_attention_heads")?;
        let kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(f.err(
                    "head_dim",
                    format!("missing, and hidden_size {hidden} is not a multiple of {heads} heads"),
                ))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(f.err(
                "head_dim",
                format!("{head_dim} must be even and positive (RoPE)"),
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
                                Some(v) if v > 0.0 => Ok(v),
                                _ => Err(f.err(
                                    &format!("rope_scaling.{k}"),
                                    "missing or not a positive number",
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
        let rms_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        Ok(ModelConfig {
            arch,
            hidden,
            intermediate: f.usize("intermediate_size")?,
            layers: f.usize("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            vocab: f.usize("vocab_size")?,
            max_positions: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
            rms_eps: rms_eps as f32,
            rope_theta: f.f64_or("rope_theta", 10000.0)?,
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
            "rms_norm_eps": self.rms_eps as f64,
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
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        if self.arch == Arch::Qwen2 {
            v["use_sliding_window"] = Value::Bool(false);
        }
        v
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

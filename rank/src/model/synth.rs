//! Writing a complete Hugging Face model folder with seeded random weights: `config.json`,
//! `generation_config.json`, `model.safetensors` (streamed to disk a chunk at a time, with a
//! progress callback) and a byte-level `tokenizer.json` that covers the whole vocab (the ids
//! past the bytes decode as made-up words, so a preset's text is never empty whatever ids its
//! random weights favour). For tests, benchmarks and demos of real model shapes without
//! downloading a checkpoint.
//!
//! Weights are uniform with standard deviation 1/√fan_in (so every projection keeps unit-scale
//! activations unit-scale), the embedding and LM head 1/√hidden (so logits come out with a
//! standard deviation near 1), norm weights 1 ± 0.1 and biases ± 0.1.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tprun_kernels::dtype::encode;
use tprun_kernels::DType;

use ::safetensors::Dtype;

use super::gptq::{self, GptqConfig, QuantizeOptions, ZeroFormat};
use super::rng::Rng;
use super::{safetensors, Arch, Llama3Scaling, ModelConfig, ModelError};

/// Model shapes `synth` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Preset {
    /// For CI: hidden 64, 3 layers, 8 heads over 4 KV heads, an odd MLP width (97), vocab 300.
    Tiny,
    /// For CPU demos and benchmarks: hidden 512, 8 layers, 8 heads over 4 KV heads (head 64),
    /// MLP 1376, vocab 32000: 39.6M parameters with tied embeddings, 79 MB in bf16.
    Small,
    /// Llama 3.1 8B's shapes (meta-llama/Llama-3.1-8B config.json).
    Llama3_8b,
    /// Qwen3 32B's shapes (Qwen/Qwen3-32B config.json).
    Qwen3_32b,
    /// Qwen3.5 27B's text model (Qwen/Qwen3.5-27B config.json's text_config): 64 layers, every
    /// 4th full attention (24 query heads of 256 over 4 KV heads, a quarter of each head
    /// rotated), the others gated DeltaNets (16 key heads, 48 value heads of 128, conv 4).
    /// `--arch qwen3_5` only.
    Qwen3_5_27b,
}

impl Preset {
    pub const ALL: [Preset; 5] = [
        Preset::Tiny,
        Preset::Small,
        Preset::Llama3_8b,
        Preset::Qwen3_32b,
        Preset::Qwen3_5_27b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Llama3_8b => "llama3-8b",
            Preset::Qwen3_32b => "qwen3-32b",
            Preset::Qwen3_5_27b => "27b",
        }
    }

    pub fn parse(s: &str) -> Option<Preset> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
}

impl Arch {
    /// The CLI's names for `synth --arch`: llama, mistral, qwen2, qwen3, qwen3_5.
    pub fn parse(s: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.model_type() == s)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SynthOptions {
    pub arch: Arch,
    pub preset: Preset,
    /// Dtype of every tensor in the file.
    pub dtype: DType,
    pub seed: u64,
    /// Override the preset's choice of tied embeddings.
    pub tie_embeddings: Option<bool>,
    /// `--quant gptq-int4`: the MLP in GPTQ int4.
    pub quant: Option<SynthQuant>,
}

/// `--quant gptq-int4`: the MLP's linears (gate, up, down) stored as GPTQ int4 in the
/// official layout (`qweight`, `qzeros`, `scales`, `g_idx`; symmetric, as the official
/// Qwen3.5 GPTQ checkpoints), everything else in the model's dtype, with the
/// `quantization_config` whose `dynamic` rule keeps attention and DeltaNet dense. The int4
/// values are the dense synth's values rounded to nearest (GPTQ's storage, not its algorithm).
/// The tiny preset's MLP becomes 128 wide, so that it splits in whole groups over 1, 2 and 4
/// ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SynthQuant {
    /// Input rows per group; `None`: −1, one group over all of K.
    pub group_size: Option<usize>,
    /// Act-order groups (`g_idx` not monotone): each K's inputs grouped in one seeded
    /// order, the same for every linear of that K (so gate and up, which read the same
    /// input, share it, as GPTQ's act-order of a shared input's Hessian does).
    pub desc_act: bool,
    /// The zero convention stored: v1 (`gptq`, z − 1 = 7) as GPTQModel writes, or v2.
    pub format: ZeroFormat,
    /// Write the dequantised twin instead (for tests): the same model with its MLP dense, in
    /// f32, holding exactly the values the int4 tensors stand for, and no
    /// `quantization_config`.
    pub dequantised: bool,
}

impl SynthQuant {
    /// The default group size: 128, as the official checkpoints, or 32 for the tiny preset
    /// (whose hidden size, 64, 128 does not divide).
    pub fn default_group(preset: Preset) -> usize {
        match preset {
            Preset::Tiny => 32,
            _ => 128,
        }
    }

    /// The `quantization_config` of the quantized checkpoint.
    fn config(&self) -> GptqConfig {
        let v = json!({
            "quant_method": "gptq",
            "bits": gptq::BITS,
            "group_size": self.group_size.map_or(-1, |g| g as i64),
            "sym": true,
            "desc_act": self.desc_act,
            "checkpoint_format": self.format.name(),
            "dynamic": { "-:.*(self_attn|linear_attn).*": {} },
        });
        GptqConfig::parse(Path::new("synth"), "quantization_config", &v)
            .expect("a valid quantization_config")
    }
}

/// Token ids of the synthetic tokenizer's special tokens; bytes are ids 0–255.
pub const SYNTH_BOS: u32 = 256;
pub const SYNTH_EOS: u32 = 257;

/// The config `synth` writes for `opts`.
pub fn config_for(opts: &SynthOptions) -> ModelConfig {
    let arch = opts.arch;
    let mut c = ModelConfig {
        arch,
        hidden: 64,
        intermediate: 97,
        layers: 3,
        heads: 8,
        kv_heads: 4,
        head_dim: if arch == Arch::Qwen3 { 16 } else { 8 },
        vocab: 300,
        max_positions: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        tie_embeddings: arch != Arch::Qwen3,
        dtype: Some(opts.dtype),
        bos: Some(SYNTH_BOS),
        eos: vec![SYNTH_EOS],
        hybrid: None,
        gptq: None,
    };
    match opts.preset {
        Preset::Tiny => {}
        Preset::Small => {
            c.hidden = 512;
            c.intermediate = 1376;
            c.layers = 8;
            c.head_dim = 64;
            c.vocab = 32000;
            c.max_positions = 2048;
        }
        Preset::Llama3_8b => {
            c.hidden = 4096;
            c.intermediate = 14336;
            c.layers = 32;
            c.heads = 32;
            c.kv_heads = 8;
            c.head_dim = 128;
            c.vocab = 128256;
            c.max_positions = 131072;
            c.rope_theta = 500000.0;
            c.rms_eps = 1e-5;
            c.tie_embeddings = false;
            if arch == Arch::Llama {
                c.rope_scaling = Some(Llama3Scaling {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                });
            }
        }
        // Shapes of Qwen/Qwen3.5-27B, whatever `--arch` says (it is a Qwen3.5 preset).
        Preset::Qwen3_5_27b => {
            c.hidden = 5120;
            c.intermediate = 17408;
            c.layers = 64;
            c.heads = 24;
            c.kv_heads = 4;
            c.head_dim = 256;
            c.vocab = 248320;
            c.max_positions = 262144;
            c.rope_theta = 10_000_000.0;
            c.rms_eps = 1e-6;
            c.tie_embeddings = false;
        }
        Preset::Qwen3_32b => {
            c.hidden = 5120;
            c.intermediate = 25600;
            c.layers = 64;
            c.heads = 64;
            c.kv_heads = 8;
            c.head_dim = 128;
            c.vocab = 151936;
            c.max_positions = 40960;
            c.rope_theta = 1_000_000.0;
            c.rms_eps = 1e-6;
            c.tie_embeddings = false;
        }
    }
    if arch == Arch::Qwen3_5 || opts.preset == Preset::Qwen3_5_27b {
        hybridise(&mut c, opts.preset);
    }
    if let Some(t) = opts.tie_embeddings {
        c.tie_embeddings = t;
    }
    if let Some(q) = &opts.quant {
        if opts.preset == Preset::Tiny {
            c.intermediate = 128;
        }
        if !q.dequantised {
            c.gptq = Some(q.config());
        }
    }
    c
}

/// Makes `c` a Qwen3.5 of its preset's size, in the official (multimodal) layout. The tiny
/// one: 4 layers alternating DeltaNet and attention, 4 query heads of 16 over 2 KV heads
/// (RoPE on the first 4 dims), 4 DeltaNet key heads and 8 value heads of 8; it shards over
/// 1, 2 and 4 ranks.
fn hybridise(c: &mut ModelConfig, preset: Preset) {
    use super::config::{Hybrid, LayerKind};
    c.arch = Arch::Qwen3_5;
    c.qkv_bias = false;
    c.qk_norm = true;
    if preset == Preset::Tiny {
        (c.layers, c.heads, c.kv_heads, c.head_dim) = (4, 4, 2, 16);
        c.rope_theta = 10_000_000.0;
        c.tie_embeddings = false;
    }
    let every = match preset {
        Preset::Qwen3_5_27b => 4,
        _ => 2,
    };
    let kinds = (0..c.layers)
        .map(|i| match (i + 1) % every {
            0 => LayerKind::Attention,
            _ => LayerKind::Delta,
        })
        .collect();
    let (k_heads, v_heads, dk) = match preset {
        Preset::Qwen3_5_27b => (16, 48, 128),
        Preset::Tiny => (4, 8, 8),
        // The plain presets' attention, with as many DeltaNet key heads as KV heads and
        // twice as many value heads, of the attention head size.
        _ => (c.kv_heads, 2 * c.kv_heads, c.head_dim),
    };
    c.hybrid = Some(Hybrid {
        kinds,
        k_heads,
        v_heads,
        dk,
        dv: dk,
        conv_kernel: 4,
        // partial_rotary_factor 0.25, as Qwen3.5's.
        rotary_dim: c.head_dim / 4,
        attn_gate: true,
        multimodal: true,
    });
}

/// How a tensor's random values are drawn: `offset + scale · U[-1, 1)`.
struct Init {
    offset: f32,
    scale: f32,
}

fn tensor_list(c: &ModelConfig, dtype: DType) -> Vec<(String, DType, Vec<usize>, Init)> {
    if let Some(hy) = &c.hybrid {
        return hybrid_tensor_list(c, hy, dtype);
    }
    let (h, d) = (c.hidden, c.head_dim);
    // Uniform on [-a, a] has standard deviation a/√3.
    let linear = |fan_in: usize| Init {
        offset: 0.0,
        scale: (3.0 / fan_in as f32).sqrt(),
    };
    let norm = || Init {
        offset: 1.0,
        scale: 0.1,
    };
    let bias = || Init {
        offset: 0.0,
        scale: 0.1,
    };
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        dtype,
        vec![c.vocab, h],
        linear(h),
    )];
    for i in 0..c.layers {
        let p = format!("model.layers.{i}.");
        let mut add = |n: &str, shape: Vec<usize>, init: Init| {
            t.push((format!("{p}{n}"), dtype, shape, init))
        };
        add("input_layernorm.weight", vec![h], norm());
        add("self_attn.q_proj.weight", vec![c.heads * d, h], linear(h));
        add(
            "self_attn.k_proj.weight",
            vec![c.kv_heads * d, h],
            linear(h),
        );
        add(
            "self_attn.v_proj.weight",
            vec![c.kv_heads * d, h],
            linear(h),
        );
        if c.qkv_bias {
            add("self_attn.q_proj.bias", vec![c.heads * d], bias());
            add("self_attn.k_proj.bias", vec![c.kv_heads * d], bias());
            add("self_attn.v_proj.bias", vec![c.kv_heads * d], bias());
        }
        if c.qk_norm {
            add("self_attn.q_norm.weight", vec![d], norm());
            add("self_attn.k_norm.weight", vec![d], norm());
        }
        add(
            "self_attn.o_proj.weight",
            vec![h, c.heads * d],
            linear(c.heads * d),
        );
        add("post_attention_layernorm.weight", vec![h], norm());
        add("mlp.gate_proj.weight", vec![c.intermediate, h], linear(h));
        add("mlp.up_proj.weight", vec![c.intermediate, h], linear(h));
        add(
            "mlp.down_proj.weight",
            vec![h, c.intermediate],
            linear(c.intermediate),
        );
    }
    t.push(("model.norm.weight".into(), dtype, vec![h], norm()));
    if !c.tie_embeddings {
        t.push(("lm_head.weight".into(), dtype, vec![c.vocab, h], linear(h)));
    }
    t
}

/// Qwen3.5's tensors in the official layout (transformers' `Qwen3_5ForConditionalGeneration`
/// names: the text model under `model.language_model.`). Its RMSNorm weights are zero-centred
/// (the norm multiplies by 1 + w), so they are drawn around 0; the DeltaNet's gated norm is
/// plain (around 1). A_log is ln of U(1, 16)'s range as transformers initialises it, dt_bias
/// around 1. The vision tower and the multi-token-prediction head, which text decode skips,
/// are stood for by one small tensor each (`model.visual.merger.norm.weight`,
/// `mtp.norm.weight`), not their real weights.
///
/// With `--quant gptq-int4`, [`write_weights`] replaces the MLP matrices listed here by their
/// packed int4 tensors, as the official Qwen3.5-27B-GPTQ-Int4 checkpoint does.
fn hybrid_tensor_list(
    c: &ModelConfig,
    hy: &super::Hybrid,
    dtype: DType,
) -> Vec<(String, DType, Vec<usize>, Init)> {
    use super::config::LayerKind;
    let (h, d) = (c.hidden, c.head_dim);
    let pre = super::weights::text_prefix(c);
    let linear = |fan_in: usize| Init {
        offset: 0.0,
        scale: (3.0 / fan_in as f32).sqrt(),
    };
    let centred = || Init {
        offset: 0.0,
        scale: 0.1,
    };
    let init = |offset: f32, scale: f32| Init { offset, scale };
    let mut t = vec![(
        format!("{pre}embed_tokens.weight"),
        dtype,
        vec![c.vocab, h],
        linear(h),
    )];
    let (kd, vd) = (hy.k_heads * hy.dk, hy.v_heads * hy.dv);
    for i in 0..c.layers {
        let p = format!("{pre}layers.{i}.");
        let mut add = |n: &str, shape: Vec<usize>, init: Init| {
            t.push((format!("{p}{n}"), dtype, shape, init))
        };
        add("input_layernorm.weight", vec![h], centred());
        match hy.kinds[i] {
            LayerKind::Attention => {
                let q_rows = if hy.attn_gate { 2 } else { 1 } * c.heads * d;
                add("self_attn.q_proj.weight", vec![q_rows, h], linear(h));
                add(
                    "self_attn.k_proj.weight",
                    vec![c.kv_heads * d, h],
                    linear(h),
                );
                add(
                    "self_attn.v_proj.weight",
                    vec![c.kv_heads * d, h],
                    linear(h),
                );
                add("self_attn.q_norm.weight", vec![d], centred());
                add("self_attn.k_norm.weight", vec![d], centred());
                add(
                    "self_attn.o_proj.weight",
                    vec![h, c.heads * d],
                    linear(c.heads * d),
                );
            }
            LayerKind::Delta => {
                add(
                    "linear_attn.in_proj_qkv.weight",
                    vec![2 * kd + vd, h],
                    linear(h),
                );
                add("linear_attn.in_proj_z.weight", vec![vd, h], linear(h));
                add(
                    "linear_attn.in_proj_b.weight",
                    vec![hy.v_heads, h],
                    linear(h),
                );
                add(
                    "linear_attn.in_proj_a.weight",
                    vec![hy.v_heads, h],
                    linear(h),
                );
                add(
                    "linear_attn.conv1d.weight",
                    vec![2 * kd + vd, 1, hy.conv_kernel],
                    linear(hy.conv_kernel),
                );
                // ln A for A in [1, 16]: [0, 2.77].
                add("linear_attn.A_log", vec![hy.v_heads], init(1.386, 1.386));
                add("linear_attn.dt_bias", vec![hy.v_heads], init(1.0, 0.5));
                add("linear_attn.norm.weight", vec![hy.dv], init(1.0, 0.1));
                add("linear_attn.out_proj.weight", vec![h, vd], linear(vd));
            }
        }
        add("post_attention_layernorm.weight", vec![h], centred());
        add("mlp.gate_proj.weight", vec![c.intermediate, h], linear(h));
        add("mlp.up_proj.weight", vec![c.intermediate, h], linear(h));
        add(
            "mlp.down_proj.weight",
            vec![h, c.intermediate],
            linear(c.intermediate),
        );
    }
    t.push((format!("{pre}norm.weight"), dtype, vec![h], centred()));
    if !c.tie_embeddings {
        t.push(("lm_head.weight".into(), dtype, vec![c.vocab, h], linear(h)));
    }
    if hy.multimodal {
        t.push((
            "model.visual.merger.norm.weight".into(),
            dtype,
            vec![h],
            centred(),
        ));
    }
    t.push(("mtp.norm.weight".into(), dtype, vec![h], centred()));
    t
}

/// GPT-2's byte ↔ printable-character table for byte-level BPE: printable Latin-1 bytes map to
/// themselves, the other 68 bytes to U+0100 onwards, in byte order.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("Latin-1")
            } else {
                next += 1;
                char::from_u32(next - 1).expect("below U+0200")
            }
        })
        .collect()
}

/// The ids [`tokenizer_json`] gives `text`: BOS, then one id per byte. For the rank crate's
/// tests, which run without a tokenizer (the coordinator owns it and checks that the two agree).
pub fn synth_ids(text: &str) -> Vec<u32> {
    std::iter::once(SYNTH_BOS)
        .chain(text.bytes().map(u32::from))
        .collect()
}

/// The text of token `id` >= 258 in [`tokenizer_json`]: a space and a made-up word of one to
/// three consonant–vowel syllables, numbered in order (" ba", " be", …, " baba", …), so that
/// noise from a random model reads as words. Distinct for every id below 1 010 358 (100 +
/// 100² + 100³ words), far more than any preset's vocab; beyond that, ids get a numeric word.
fn word(id: usize) -> String {
    const C: &[u8; 20] = b"bcdfghjklmnprstvwxyz";
    const V: &[u8; 5] = b"aeiou";
    let mut n = id - 258;
    let mut w = String::from(" ");
    for len in 1..=3u32 {
        let count = 100usize.pow(len);
        if n < count {
            for _ in 0..len {
                let s = n % 100;
                w.push(C[s / 5] as char);
                w.push(V[s % 5] as char);
                n /= 100;
            }
            return w;
        }
        n -= count;
    }
    format!(" w{id}")
}

/// A byte-level BPE tokenizer.json for a vocab of `vocab` ids, with no merges: every byte is
/// one token (id = byte value), plus `<|bos|>` (added at the start of every encoding) and
/// `<|eos|>`; ids 258 and up are words ([`word`]) that encoding never produces (no merge makes
/// them) but decoding shows, so that every id a model samples has text.
pub fn tokenizer_json(vocab: usize) -> Value {
    let bytes = byte_chars();
    let space = bytes[b' ' as usize];
    // The special tokens are in the model's vocab too, as in Hugging Face's files: the
    // tokenizers crate gives an added token missing from it the next free id instead.
    let vocab: serde_json::Map<String, Value> = bytes
        .iter()
        .map(|ch| ch.to_string())
        .chain(["<|bos|>".to_string(), "<|eos|>".to_string()])
        .chain((SYNTH_EOS as usize + 1..vocab).map(|id| word(id).replace(' ', &space.to_string())))
        .enumerate()
        .map(|(id, t)| (t, json!(id)))
        .collect();
    let special = |id: u32, s: &str| {
        json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(SYNTH_BOS, "<|bos|>"), special(SYNTH_EOS, "<|eos|>")],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [SYNTH_BOS], "tokens": ["<|bos|>"]}}
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": []
        }
    })
}

/// Elements generated and written per chunk (256 Ki: 1 MiB of f32 staging).
const CHUNK: usize = 1 << 18;

/// Writes the model folder for `opts` into `dir` (created if needed). `progress(done, total)`
/// is called with bytes of tensor data written so far.
pub fn synth(
    dir: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ModelConfig, ModelError> {
    let cfg = config_for(opts);
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let write_json = |name: &str, v: &Value| {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).expect("json"))
            .map_err(|e| ModelError::io(&p, e))
    };
    write_json("config.json", &cfg.to_json())?;
    write_json(
        "generation_config.json",
        &json!({"bos_token_id": SYNTH_BOS, "eos_token_id": cfg.eos, "do_sample": false}),
    )?;
    write_json("tokenizer.json", &tokenizer_json(cfg.vocab))?;
    write_weights(&dir.join("model.safetensors"), opts, progress)?;
    Ok(cfg)
}

/// The model `synth` writes for `opts`, made in memory instead: its config, and a checkpoint
/// whose one file is a memfd. Nothing touches the filesystem, so nothing can be left there
/// however the process ends; the memory goes with the last mapping. The embedded default of
/// `decode` runs from this on every rank.
pub fn in_memory(
    opts: &SynthOptions,
) -> Result<(ModelConfig, safetensors::Checkpoint), ModelError> {
    use std::os::fd::AsRawFd;
    let memfd =
        nix::sys::memfd::memfd_create(c"tprun-synth-model", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| ModelError::io("memfd_create", e.into()))?;
    // The memfd's name in /proc: writing and mapping it there is writing and mapping a file
    // (opening it again shares the memfd's memory), so the writer and reader need no second way in.
    let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", memfd.as_raw_fd()));
    write_weights(&path, opts, &mut |_, _| {})?;
    let ck = safetensors::Checkpoint::single(&path, Path::new("memfd:tprun-synth-model"))?;
    // The checkpoint's map holds the memory from here on.
    drop(memfd);
    Ok((config_for(opts), ck))
}

/// Writes the weights of `synth`'s model for `opts` to the safetensors file `path`.
/// `progress(done, total)` is called with bytes of tensor data written so far. One tensor is
/// in memory at a time (a quantized linear: its dense values and its packed tensors).
fn write_weights(
    path: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), ModelError> {
    let cfg = config_for(opts);
    let list = tensor_list(&cfg, opts.dtype);
    // Each file tensor: (logical tensor of `list`, the part of a quantized linear: its index
    // into `Quantized::tensors`, 0 for a dequantised twin; `None`: a dense tensor), with its
    // header entry.
    let quant = opts.quant.as_ref().map(|q| (q, q.config()));
    let mut parts: Vec<(usize, Option<usize>)> = Vec::new();
    let mut header: Vec<(String, Dtype, Vec<usize>)> = Vec::new();
    for (i, (name, dtype, shape, _)) in list.iter().enumerate() {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        match &quant {
            Some((q, gc)) if is_quantized_mlp(gc, module) => {
                let (n, k) = (shape[0], shape[1]);
                let g = q.group_size.unwrap_or(k);
                if q.dequantised {
                    parts.push((i, Some(0)));
                    header.push((name.clone(), Dtype::F32, shape.clone()));
                    continue;
                }
                let ng = k / g.max(1);
                for (p, (t, d, sh)) in [
                    ("qweight", Dtype::I32, vec![k / 8, n]),
                    ("qzeros", Dtype::I32, vec![ng, n / 8]),
                    ("scales", Dtype::F16, vec![ng, n]),
                    ("g_idx", Dtype::I32, vec![k]),
                ]
                .into_iter()
                .enumerate()
                {
                    parts.push((i, Some(p)));
                    header.push((format!("{module}.{t}"), d, sh));
                }
            }
            _ => {
                parts.push((i, None));
                header.push((name.clone(), safetensors::st_dtype(*dtype), shape.clone()));
            }
        }
    }
    let total: u64 = header
        .iter()
        .map(|(_, d, s)| (s.iter().product::<usize>() * d.bitsize() / 8) as u64)
        .sum();
    let mut done = 0u64;
    progress(0, total);
    // The packed tensors of the last quantized linear (its parts are consecutive).
    let mut packed: Option<(usize, Vec<Vec<u8>>)> = None;
    safetensors::write_stored(path, &header, &mut |j, out| {
        let (i, part) = parts[j];
        let (name, dtype, shape, init) = &list[i];
        // Each tensor has its own stream, so its values do not depend on the others' sizes.
        let mut rng = Rng::new(opts.seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let n: usize = shape.iter().product();
        let mut draw = |count: usize, vals: &mut Vec<f32>| {
            vals.extend((0..count).map(|_| init.offset + init.scale * rng.f32_sym()));
        };
        let mut emit = |bytes: &[u8]| {
            out(bytes)?;
            done += bytes.len() as u64;
            progress(done, total);
            Ok::<_, std::io::Error>(())
        };
        if let Some(part) = part {
            // A quantized linear (or its dequantised twin): drawn whole, quantized once.
            if packed.as_ref().is_none_or(|(pi, _)| *pi != i) {
                let (q, _) = quant.as_ref().expect("quantized parts come from --quant");
                let mut w = Vec::with_capacity(n);
                draw(n, &mut w);
                let qz = quantize_synth(&w, shape[0], shape[1], q, opts.seed)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                let module = name.strip_suffix(".weight").unwrap_or(name);
                let bytes = if q.dequantised {
                    vec![encode(DType::F32, &qz.dequantize())]
                } else {
                    qz.tensors(module, true).into_iter().map(|t| t.3).collect()
                };
                packed = Some((i, bytes));
            }
            let (_, bytes) = packed.as_ref().expect("just made");
            return emit(&bytes[part]);
        }
        let mut vals = Vec::with_capacity(CHUNK.min(n));
        let mut left = n;
        while left > 0 {
            let k = left.min(CHUNK);
            vals.clear();
            draw(k, &mut vals);
            emit(&encode(*dtype, &vals))?;
            left -= k;
        }
        Ok(())
    })
}

/// Whether `module` is an MLP linear (`…mlp.gate_proj`, `up_proj`, `down_proj`) that `q`
/// quantizes: GPTQ quantizes the decoder layers' linears only (never the embedding or the LM
/// head), and tprun's int4 path is the MLP's.
fn is_quantized_mlp(q: &GptqConfig, module: &str) -> bool {
    ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        .iter()
        .any(|m| module.ends_with(m))
        && q.is_quantized(module)
}

/// Quantizes one synthetic [n, k] linear as `q` says; with `desc_act`, in an act order drawn
/// from `seed` and k alone (a Fisher–Yates shuffle), so every linear of the same inputs
/// shares it.
fn quantize_synth(
    w: &[f32],
    n: usize,
    k: usize,
    q: &SynthQuant,
    seed: u64,
) -> Result<gptq::Quantized, ModelError> {
    let act_order = q.desc_act.then(|| {
        let mut rng = Rng::new(seed ^ (k as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let mut order: Vec<usize> = (0..k).collect();
        for i in (1..k).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        order
    });
    gptq::quantize(
        w,
        n,
        k,
        &QuantizeOptions {
            group_size: q.group_size,
            sym: true,
            format: q.format,
            act_order,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_memory_model_is_the_folder_model_with_no_file() {
        let opts = SynthOptions {
            arch: Arch::Qwen2,
            preset: Preset::Tiny,
            dtype: DType::BF16,
            seed: 7,
            tie_embeddings: None,
            quant: None,
        };
        let dir = std::env::temp_dir().join(format!("tprun-synth-mem-{}", std::process::id()));
        let cfg = synth(&dir, &opts, &mut |_, _| {}).unwrap();
        let on_disk = safetensors::Checkpoint::open(&dir).unwrap();
        let (mem_cfg, in_mem) = in_memory(&opts).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(mem_cfg, cfg);
        for (name, _, shape, _) in tensor_list(&cfg, opts.dtype) {
            let full = safetensors::Slice::Full;
            assert!(in_mem.contains(&name), "{name}");
            assert_eq!(
                in_mem.read_f32(&name, &shape, &full).unwrap(),
                on_disk.read_f32(&name, &shape, &full).unwrap(),
                "{name}"
            );
        }
        // What the checkpoint maps is a memfd, not a file anywhere on disk.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.contains("/memfd:tprun-synth-model"), "{maps}");
        drop(in_mem);
    }

    #[test]
    fn presets_have_real_shapes() {
        let o = |arch, preset| SynthOptions {
            arch,
            preset,
            dtype: DType::BF16,
            seed: 0,
            tie_embeddings: None,
            quant: None,
        };
        let c = config_for(&o(Arch::Llama, Preset::Llama3_8b));
        let params: usize = tensor_list(&c, DType::BF16)
            .iter()
            .map(|t| t.2.iter().product::<usize>())
            .sum();
        assert_eq!(params, 8_030_261_248); // Llama 3.1 8B's parameter count
        let c = config_for(&o(Arch::Llama, Preset::Small));
        let params: usize = tensor_list(&c, DType::BF16)
            .iter()
            .map(|t| t.2.iter().product::<usize>())
            .sum();
        assert_eq!(params, 39_592_448);
        let c = config_for(&o(Arch::Qwen3, Preset::Qwen3_32b));
        let params: usize = tensor_list(&c, DType::BF16)
            .iter()
            .map(|t| t.2.iter().product::<usize>())
            .sum();
        assert_eq!(params, 32_762_123_264); // Qwen3-32B's parameter count
    }

    /// `--arch qwen3_5 --preset 27b`: Qwen/Qwen3.5-27B's text shapes in its official layout.
    /// A `--quant gptq-int4` folder's config.json parses back to the config synth meant
    /// (the quantization_config included), and holds the four tensors of every MLP linear
    /// and no dense MLP weight.
    #[test]
    fn gptq_synth_config_round_trips() {
        let opts = SynthOptions {
            arch: Arch::Qwen3_5,
            preset: Preset::Tiny,
            dtype: DType::BF16,
            seed: 3,
            tie_embeddings: None,
            quant: Some(SynthQuant {
                group_size: Some(16),
                desc_act: true,
                format: ZeroFormat::V2,
                dequantised: false,
            }),
        };
        let dir = std::env::temp_dir().join(format!("tprun-synth-gptq-{}", std::process::id()));
        let cfg = synth(&dir, &opts, &mut |_, _| {}).unwrap();
        let back = ModelConfig::from_dir(&dir).unwrap();
        let ck = safetensors::Checkpoint::open(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back.gptq, cfg.gptq);
        let q = cfg.gptq.as_ref().unwrap();
        assert_eq!((q.base.group_size, q.base.desc_act), (Some(16), true));
        assert_eq!(q.format, ZeroFormat::V2);
        let pre = "model.language_model.layers.1.";
        assert!(q.is_quantized(&format!("{pre}mlp.up_proj")));
        assert!(!q.is_quantized(&format!("{pre}self_attn.q_proj")));
        for m in ["gate_proj", "up_proj", "down_proj"] {
            for t in ["qweight", "qzeros", "scales", "g_idx"] {
                assert!(ck.contains(&format!("{pre}mlp.{m}.{t}")), "{m}.{t}");
            }
            assert!(!ck.contains(&format!("{pre}mlp.{m}.weight")));
        }
        assert!(ck.contains(&format!("{pre}self_attn.q_proj.weight")));
    }

    #[test]
    fn qwen35_27b_has_the_official_shapes_and_names() {
        use crate::model::LayerKind;
        let c = config_for(&SynthOptions {
            arch: Arch::Qwen3_5,
            preset: Preset::Qwen3_5_27b,
            dtype: DType::BF16,
            seed: 0,
            tie_embeddings: None,
            quant: None,
        });
        let h = c.hybrid.clone().unwrap();
        assert_eq!(
            (
                c.hidden,
                c.intermediate,
                c.layers,
                c.heads,
                c.kv_heads,
                c.head_dim,
                c.vocab
            ),
            (5120, 17408, 64, 24, 4, 256, 248320)
        );
        assert_eq!(
            (h.k_heads, h.v_heads, h.dk, h.dv, h.conv_kernel),
            (16, 48, 128, 128, 4)
        );
        assert_eq!((h.rotary_dim, c.rope_theta), (64, 1e7));
        assert!(h.attn_gate && h.multimodal && c.qk_norm && !c.tie_embeddings);
        let attn: Vec<usize> = (0..64)
            .filter(|&i| h.kinds[i] == LayerKind::Attention)
            .collect();
        assert_eq!(attn, (3..64).step_by(4).collect::<Vec<_>>());
        let list = tensor_list(&c, DType::BF16);
        let shape = |n: &str| {
            list.iter()
                .find(|t| t.0 == n)
                .unwrap_or_else(|| panic!("{n}"))
                .2
                .clone()
        };
        let l = "model.language_model.layers.";
        assert_eq!(
            shape(&format!("{l}63.self_attn.q_proj.weight")),
            [12288, 5120]
        );
        assert_eq!(
            shape(&format!("{l}62.linear_attn.in_proj_qkv.weight")),
            [10240, 5120]
        );
        assert_eq!(
            shape(&format!("{l}62.linear_attn.conv1d.weight")),
            [10240, 1, 4]
        );
        assert_eq!(
            shape(&format!("{l}0.linear_attn.in_proj_z.weight")),
            [6144, 5120]
        );
        assert_eq!(
            shape(&format!("{l}0.linear_attn.out_proj.weight")),
            [5120, 6144]
        );
        assert_eq!(shape("lm_head.weight"), [248320, 5120]);
        // What synth writes parses back to this config.
        let back = ModelConfig::parse(Path::new("config.json"), c.to_json().as_object().unwrap());
        assert_eq!(back.unwrap(), c);
    }
}

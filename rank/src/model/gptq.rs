//! GPTQ int4 checkpoints (AutoGPTQ / GPTQModel layout): the `quantization_config` of
//! `config.json`, reading one quantized linear layer (or a rank's slice of it) and
//! dequantising it to the `[N, K]` row-major f32 matrix the rest of tprun uses (Hugging Face's
//! `[out_features, in_features]`), and the quantiser that writes such layers (tests, and
//! `tprun synth --quant gptq-int4`). CPU only: no kernels here, and nothing here decides which
//! modules of a model are quantized beyond answering the config's `dynamic` rules.
//!
//! One quantized linear `X` of `K` inputs and `N` outputs, groups of `g` input rows
//! (`G = K / g`; `group_size` −1 is one group over all of K):
//!
//! | tensor | dtype | shape | holds |
//! | --- | --- | --- | --- |
//! | `X.qweight` | I32 | [K/8, N] | q\[k\]\[n\]: bits 4·(k mod 8) of word \[k/8\]\[n\] |
//! | `X.qzeros` | I32 | [G, N/8] | stored zero of (group, n): bits 4·(n mod 8) of \[group\]\[n/8\] |
//! | `X.scales` | F16 | [G, N] | s\[group\]\[n\] |
//! | `X.g_idx` | I32 | [K] | the group of input row k (`desc_act`); absent: k / g |
//!
//! Nibble 0 is the low four bits (low nibble first). w\[n\]\[k\] = (q\[k\]\[n\] −
//! z\[g(k)\]\[n\]) · s\[g(k)\]\[n\].
//!
//! The zero point is a known trap. Format `gptq` (v1) stores z − 1, `gptq_v2` stores z, and
//! the official Qwen3.5-27B-GPTQ-Int4 checkpoint stores 8 while saying `gptq`. Symmetric
//! quantization always has z = 8, so for `sym` the stored zeros decide: all 7 is v1, all 8 is
//! v2, anything else is an error ([`detect_zero_format`]). Asymmetric checkpoints are read as
//! declared; a v1 stored 15 is z = 0 (the packer wrote −1), as AutoGPTQ's reference
//! dequantiser reads it (`(stored + 1) & 15`).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use half::f16;
use safetensors::Dtype;
use serde_json::{Map, Value};
use tprun_kernels::int4::Int4Host;

use super::safetensors::{Checkpoint, Slice, TensorSource};
use super::ModelError;

/// The only width supported: 4-bit weights, eight to an int32.
pub const BITS: u32 = 4;
/// int4 values per packed int32 word.
const PACK: usize = 8;
/// Zero point of symmetric int4 quantization: 2^(bits−1) (AutoGPTQ's `(maxq + 1) / 2`).
const SYM_ZERO: u8 = 8;

// ---- config ------------------------------------------------------------------------------

/// The zero-point convention of the stored `qzeros`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ZeroFormat {
    /// `gptq`: stores z − 1 (AutoGPTQ's packer subtracts one).
    V1,
    /// `gptq_v2`: stores z.
    V2,
}

impl ZeroFormat {
    /// The `checkpoint_format` name.
    pub fn name(self) -> &'static str {
        match self {
            ZeroFormat::V1 => "gptq",
            ZeroFormat::V2 => "gptq_v2",
        }
    }

    /// The zero point a stored nibble stands for.
    fn zero(self, stored: u8) -> u8 {
        match self {
            ZeroFormat::V1 => (stored + 1) & 0xf,
            ZeroFormat::V2 => stored,
        }
    }

    /// The nibble that stores zero point `z` (0..=15).
    fn stored(self, z: u8) -> u8 {
        match self {
            ZeroFormat::V1 => z.wrapping_sub(1) & 0xf,
            ZeroFormat::V2 => z,
        }
    }
}

/// How one linear layer is quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSettings {
    /// Bits per weight: always [`BITS`] (anything else is refused when parsed).
    pub bits: u32,
    /// Input rows per group; `None` is `group_size` −1, one group over all of K.
    pub group_size: Option<usize>,
    /// Symmetric: every zero point is [`SYM_ZERO`].
    pub sym: bool,
    /// Act-order: groups are sets of rows given by `g_idx`, not runs of `group_size` rows.
    pub desc_act: bool,
}

impl QuantSettings {
    /// Rows per group for a layer of `k` inputs.
    pub fn group_len(&self, k: usize) -> usize {
        self.group_size.unwrap_or(k)
    }
}

/// What a `dynamic` rule does to the modules it matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuleAction {
    /// `-:regex`: the module stays unquantized (plain `X.weight`).
    Skip,
    /// `+:regex` or a bare regex: the given fields replace the base settings (`None`: kept).
    /// Other keys GPTQModel writes there (`damp_percent`, …) only steer quantizing and are
    /// ignored.
    Override {
        bits: Option<u32>,
        /// `Some(None)`: group_size −1.
        group_size: Option<Option<usize>>,
        sym: Option<bool>,
        desc_act: Option<bool>,
    },
}

/// One `dynamic` rule: a Python regular expression matched at the start of the module name
/// (Python's `re.match`, which GPTQModel and vLLM use), and what it does.
#[derive(Clone, Debug)]
pub struct DynamicRule {
    /// The key as written, prefix included.
    pub key: String,
    pattern: regex::Regex,
    pub action: RuleAction,
}

/// Rules are equal when written the same: the pattern is compiled from the key.
impl PartialEq for DynamicRule {
    fn eq(&self, other: &Self) -> bool {
        (&self.key, &self.action) == (&other.key, &other.action)
    }
}

/// A parsed, validated `quantization_config` of method `gptq`.
#[derive(Clone, Debug, PartialEq)]
pub struct GptqConfig {
    /// The settings of every quantized module no `+:` rule overrides.
    pub base: QuantSettings,
    /// The declared zero-point convention (`checkpoint_format`, else `format`, else `gptq`);
    /// the stored zeros overrule it for `sym` layers.
    pub format: ZeroFormat,
    /// In key order. The JSON object's order is not kept (serde_json sorts keys), so instead
    /// of Python's first match over insertion order: any matching `-:` rule wins, else the
    /// first matching override in key order. The two differ only for a module that several
    /// rules match.
    pub dynamic: Vec<DynamicRule>,
}

impl GptqConfig {
    /// The GPTQ config of a parsed `config.json` (`file` names it in errors): from
    /// `quantization_config` at the top level or under `text_config`. `None` when there is
    /// none; an error when there is one of another method or with unsupported settings.
    pub fn from_config(file: &Path, config: &Value) -> Result<Option<GptqConfig>, ModelError> {
        let top = config.get("quantization_config").filter(|v| !v.is_null());
        let nested = config
            .get("text_config")
            .and_then(|t| t.get("quantization_config"))
            .filter(|v| !v.is_null());
        match (top, nested) {
            (Some(q), _) => GptqConfig::parse(file, "quantization_config", q).map(Some),
            (None, Some(q)) => {
                GptqConfig::parse(file, "text_config.quantization_config", q).map(Some)
            }
            (None, None) => Ok(None),
        }
    }

    /// Parses the `quantization_config` object `q`, found at `field` of `file`.
    pub fn parse(file: &Path, field: &str, q: &Value) -> Result<GptqConfig, ModelError> {
        let f = Fields {
            file,
            prefix: field,
        };
        let obj = q
            .as_object()
            .ok_or_else(|| f.err("", format!("expected an object, got {q}")))?;
        let method = f.str_opt(obj, "quant_method")?;
        match method.as_deref().map(str::to_ascii_lowercase).as_deref() {
            Some("gptq") | Some("gptq_v2") => {}
            _ => {
                return Err(f.unsupported(
                    "quant_method",
                    method.unwrap_or_else(|| "(missing)".into()),
                    "gptq",
                ))
            }
        }
        let fmt_field = ["checkpoint_format", "format"]
            .into_iter()
            .find(|k| obj.get(*k).is_some_and(|v| !v.is_null()));
        let format = match fmt_field {
            None if method.as_deref() == Some("gptq_v2") => ZeroFormat::V2,
            None => ZeroFormat::V1,
            Some(k) => match f.str_opt(obj, k)?.unwrap_or_default().as_str() {
                "gptq" => ZeroFormat::V1,
                "gptq_v2" => ZeroFormat::V2,
                other => return Err(f.unsupported(k, other, "gptq, gptq_v2")),
            },
        };
        let bits = f
            .int_opt(obj, "bits")?
            .ok_or_else(|| f.err("bits", "missing"))?;
        let base = QuantSettings {
            bits: f.bits(bits)?,
            group_size: f.group_size(f.int_opt(obj, "group_size")?.unwrap_or(128))?,
            sym: f.bool_opt(obj, "sym")?.unwrap_or(true),
            desc_act: f.bool_opt(obj, "desc_act")?.unwrap_or(false),
        };
        let mut dynamic = Vec::new();
        match obj.get("dynamic") {
            None | Some(Value::Null) => {}
            Some(Value::Object(rules)) => {
                for (key, v) in rules {
                    dynamic.push(f.rule(key, v)?);
                }
            }
            Some(v) => return Err(f.err("dynamic", format!("expected an object, got {v}"))),
        }
        Ok(GptqConfig {
            base,
            format,
            dynamic,
        })
    }

    /// The settings of module `module` (a tensor name without `.qweight`), or `None` if a
    /// `-:` rule keeps it unquantized.
    pub fn settings(&self, module: &str) -> Option<QuantSettings> {
        let hits = || self.dynamic.iter().filter(|r| r.pattern.is_match(module));
        if hits().any(|r| r.action == RuleAction::Skip) {
            return None;
        }
        let mut s = self.base;
        if let Some(RuleAction::Override {
            bits,
            group_size,
            sym,
            desc_act,
        }) = hits().map(|r| &r.action).next()
        {
            s.bits = bits.unwrap_or(s.bits);
            s.group_size = group_size.unwrap_or(s.group_size);
            s.sym = sym.unwrap_or(s.sym);
            s.desc_act = desc_act.unwrap_or(s.desc_act);
        }
        Some(s)
    }

    /// The `quantization_config` object that parses back to this config (the rules' keys
    /// as written; an override rule with only the fields it sets).
    pub fn to_json(&self) -> Value {
        let group = |g: Option<usize>| g.map_or(-1, |g| g as i64);
        let dynamic: Map<String, Value> = self
            .dynamic
            .iter()
            .map(|r| {
                let mut o = Map::new();
                if let RuleAction::Override {
                    bits,
                    group_size,
                    sym,
                    desc_act,
                } = &r.action
                {
                    let mut put = |k: &str, v: Option<Value>| {
                        if let Some(v) = v {
                            o.insert(k.into(), v);
                        }
                    };
                    put("bits", bits.map(Value::from));
                    put("group_size", group_size.map(|g| Value::from(group(g))));
                    put("sym", sym.map(Value::from));
                    put("desc_act", desc_act.map(Value::from));
                }
                (r.key.clone(), Value::Object(o))
            })
            .collect();
        serde_json::json!({
            "quant_method": "gptq",
            "bits": self.base.bits,
            "group_size": group(self.base.group_size),
            "sym": self.base.sym,
            "desc_act": self.base.desc_act,
            "checkpoint_format": self.format.name(),
            "dynamic": dynamic,
        })
    }

    /// Whether `module` is stored quantized (no `-:` rule matches it).
    pub fn is_quantized(&self, module: &str) -> bool {
        self.settings(module).is_some()
    }
}

/// The `quantization_config` object with its file and place, so that every error names the
/// field.
struct Fields<'a> {
    file: &'a Path,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, field: &str) -> String {
        match field {
            "" => self.prefix.into(),
            f => format!("{}.{f}", self.prefix),
        }
    }

    fn err(&self, field: &str, why: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: self.file.to_path_buf(),
            field: self.name(field),
            why: why.into(),
        }
    }

    fn unsupported(&self, field: &str, value: impl Into<String>, supported: &str) -> ModelError {
        ModelError::Unsupported {
            file: self.file.to_path_buf(),
            field: self.name(field),
            value: value.into(),
            supported: supported.into(),
        }
    }

    fn str_opt(&self, o: &Map<String, Value>, k: &str) -> Result<Option<String>, ModelError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(k, format!("expected a string, got {v}"))),
        }
    }

    fn int_opt(&self, o: &Map<String, Value>, k: &str) -> Result<Option<i64>, ModelError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.err(k, format!("expected an integer, got {v}"))),
        }
    }

    fn bool_opt(&self, o: &Map<String, Value>, k: &str) -> Result<Option<bool>, ModelError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(k, format!("expected true or false, got {v}"))),
        }
    }

    fn bits(&self, bits: i64) -> Result<u32, ModelError> {
        if bits != BITS as i64 {
            return Err(self.unsupported("bits", bits.to_string(), "4"));
        }
        Ok(BITS)
    }

    /// −1, or a positive multiple of 8: a group holds whole packed words, so that a
    /// row-parallel split on group boundaries is also on word boundaries. (Real checkpoints
    /// use 32, 64 and 128.)
    fn group_size(&self, g: i64) -> Result<Option<usize>, ModelError> {
        match g {
            -1 => Ok(None),
            g if g > 0 && g % PACK as i64 == 0 && g <= u32::MAX as i64 => Ok(Some(g as usize)),
            g => Err(self.unsupported(
                "group_size",
                g.to_string(),
                "-1 or a positive multiple of 8, such as 32, 64, 128",
            )),
        }
    }

    fn rule(&self, key: &str, v: &Value) -> Result<DynamicRule, ModelError> {
        let field = format!("dynamic.{key}");
        let (skip, pat) = match key.strip_prefix("-:") {
            Some(p) => (true, p),
            None => (false, key.strip_prefix("+:").unwrap_or(key)),
        };
        // `re.match` anchors at the start only.
        let pattern = regex::Regex::new(&format!("^(?:{pat})")).map_err(|e| {
            self.err(
                &field,
                format!("not a regular expression tprun can match ({e})")
                    .lines()
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })?;
        let action = if skip {
            RuleAction::Skip
        } else {
            let o = v
                .as_object()
                .ok_or_else(|| self.err(&field, format!("expected an object, got {v}")))?;
            let sub = Fields {
                file: self.file,
                prefix: &self.name(&field),
            };
            RuleAction::Override {
                bits: sub.int_opt(o, "bits")?.map(|b| sub.bits(b)).transpose()?,
                group_size: sub
                    .int_opt(o, "group_size")?
                    .map(|g| sub.group_size(g))
                    .transpose()?,
                sym: sub.bool_opt(o, "sym")?,
                desc_act: sub.bool_opt(o, "desc_act")?,
            }
        };
        Ok(DynamicRule {
            key: key.into(),
            pattern,
            action,
        })
    }
}

// ---- reading -----------------------------------------------------------------------------

/// A rank's slice of one quantized linear layer, unpacked where the packing would not survive
/// slicing (zeros along N), with the zero convention applied.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantLinear {
    /// Output rows held, global (a column-parallel shard's).
    pub n: Range<usize>,
    /// Input columns held, global (a row-parallel shard's); multiples of 8.
    pub k: Range<usize>,
    /// `qweight` rows `k/8`, columns `n`, as stored: [k.len()/8, n.len()].
    pub qweight: Vec<u32>,
    /// The global groups `zeros` and `scales` hold rows of.
    pub groups: Range<usize>,
    /// Zero points (not the stored values): [groups.len(), n.len()], 0..=15.
    pub zeros: Vec<u8>,
    /// Scales, widened from f16: [groups.len(), n.len()].
    pub scales: Vec<f32>,
    /// The global group of each input column held: [k.len()].
    pub g_idx: Vec<u32>,
    /// The convention the stored zeros were read in.
    pub zero_format: ZeroFormat,
}

impl QuantLinear {
    /// The int4 value of (input column `k`, output row `n`), both local.
    pub fn q(&self, k: usize, n: usize) -> u8 {
        ((self.qweight[k / PACK * self.n.len() + n] >> (4 * (k % PACK))) & 0xf) as u8
    }

    /// The slice as f32, [n.len(), k.len()] row-major: w[n][k] = (q − z) · s.
    pub fn dequantize(&self) -> Vec<f32> {
        let (nl, kl) = (self.n.len(), self.k.len());
        let mut w = vec![0f32; nl * kl];
        for k in 0..kl {
            let g = (self.g_idx[k] as usize - self.groups.start) * nl;
            for n in 0..nl {
                let z = self.zeros[g + n];
                w[n * kl + k] = (self.q(k, n) as f32 - z as f32) * self.scales[g + n];
            }
        }
        w
    }
}

impl QuantLinear {
    /// The slice in the device layout of [`tprun_kernels::int4`], for
    /// [`tprun_kernels::ops::MatmulInt4`]: transposed to N-major, with `desc_act`'s inputs
    /// sorted by group through a `perm` (and ragged groups of a row-parallel `desc_act`
    /// shard padded with zero weights). Its `dequantize()` equals this one's exactly.
    pub fn to_int4(&self) -> Result<Int4Host, ModelError> {
        let rel: Vec<u32> = self
            .g_idx
            .iter()
            .map(|&g| g - self.groups.start as u32)
            .collect();
        Int4Host::from_gptq(
            self.n.len(),
            self.k.len(),
            &self.qweight,
            &self.zeros,
            &self.scales,
            &rel,
        )
        .map_err(|why| ModelError::Invalid(format!("gptq: {why}")))
    }
}

/// The tensor names of module `module`.
fn names(module: &str) -> [String; 4] {
    ["qweight", "qzeros", "scales", "g_idx"].map(|t| format!("{module}.{t}"))
}

/// One quantized linear layer, and the part of it a rank reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearPart<'a> {
    /// `X` of `X.qweight`.
    pub module: &'a str,
    /// N, the layer's global output count.
    pub out_features: usize,
    /// K, the layer's global input count.
    pub in_features: usize,
    /// Output rows read (a column-parallel split): any range.
    pub n: Range<usize>,
    /// Input columns read (a row-parallel split): on multiples of 8, see [`k_shard`].
    pub k: Range<usize>,
}

impl<'a> LinearPart<'a> {
    /// The whole layer.
    pub fn full(module: &'a str, out_features: usize, in_features: usize) -> LinearPart<'a> {
        LinearPart {
            module,
            out_features,
            in_features,
            n: 0..out_features,
            k: 0..in_features,
        }
    }
}

impl GptqConfig {
    /// [`read_linear`] with the module's settings and the declared convention; refused for
    /// a module a `-:` rule keeps unquantized.
    pub fn read_linear(
        &self,
        ck: &Checkpoint,
        part: &LinearPart<'_>,
    ) -> Result<QuantLinear, ModelError> {
        let s = self.settings(part.module).ok_or_else(|| {
            ModelError::Invalid(format!(
                "gptq: {} is unquantized by a dynamic rule, it has no qweight to read",
                part.module
            ))
        })?;
        read_linear(ck, part, &s, self.format)
    }
}

/// Reads `part` of a quantized linear layer, quantized as `s`, its zeros declared in
/// `declared`. `part.k` must start and end on multiples of 8 (the packing); a row-parallel
/// split should also fall on group boundaries ([`k_shard`]) so that ranks share no group,
/// but reading does not need it.
///
/// Every shape, every `g_idx` value read and (for `sym`) every stored zero is checked first:
/// a malformed checkpoint is an error naming the tensor, never a panic.
pub fn read_linear(
    ck: &Checkpoint,
    part: &LinearPart<'_>,
    s: &QuantSettings,
    declared: ZeroFormat,
) -> Result<QuantLinear, ModelError> {
    let (nn, kk, module) = (part.out_features, part.in_features, part.module);
    let (n, k) = (part.n.clone(), part.k.clone());
    let [qw_name, qz_name, sc_name, gi_name] = names(module);
    // Existence first, so that a missing tensor is reported as missing.
    for t in [&qw_name, &qz_name, &sc_name] {
        ck.info(t)?;
    }
    // The file of tensor `t`, else (g_idx missing) of qweight.
    let file = |t: &str| -> PathBuf {
        ck.info(t)
            .or_else(|_| ck.info(&qw_name))
            .map(|(f, _)| f.path().to_path_buf())
            .unwrap_or_default()
    };
    let tbad = |t: &str, why: String| ModelError::Tensor {
        file: file(t),
        tensor: t.into(),
        why,
    };
    if s.bits != BITS {
        return Err(tbad(
            &qw_name,
            format!("{}-bit GPTQ is not supported", s.bits),
        ));
    }
    if kk == 0 || nn == 0 || !kk.is_multiple_of(PACK) {
        return Err(tbad(
            &qw_name,
            format!(
                "in_features {kk} is not a positive multiple of 8 (8 int4 values per int32 \
                 along K)"
            ),
        ));
    }
    if !nn.is_multiple_of(PACK) {
        return Err(tbad(
            &qz_name,
            format!("out_features {nn} is not a multiple of 8 (8 int4 zeros per int32 along N)"),
        ));
    }
    let gl = s.group_len(kk);
    if !kk.is_multiple_of(gl) {
        return Err(tbad(
            &qw_name,
            format!("group_size {gl} does not divide in_features {kk}"),
        ));
    }
    let ng = kk / gl;
    if n.start > n.end || n.end > nn {
        return Err(tbad(
            &qw_name,
            format!("output rows {n:?} are outside 0..{nn}"),
        ));
    }
    if k.start > k.end || k.end > kk || !k.start.is_multiple_of(PACK) || !k.end.is_multiple_of(PACK)
    {
        return Err(tbad(
            &qw_name,
            format!("input columns {k:?} are not multiples of 8 within 0..{kk}"),
        ));
    }

    // Shapes: the reader checks each against the expected one, naming the tensor.
    let qweight = read_i32_block(
        ck,
        &qw_name,
        [kk / PACK, nn],
        k.start / PACK..k.end / PACK,
        n.clone(),
    )?;
    let g_idx: Vec<u32> = if ck.contains(&gi_name) {
        let raw = ck.read_i32(&gi_name, &[kk], &Slice::Rows(k.clone()))?;
        let mut out = Vec::with_capacity(raw.len());
        for (i, &g) in raw.iter().enumerate() {
            if g < 0 || g as usize >= ng {
                return Err(tbad(
                    &gi_name,
                    format!(
                        "g_idx[{}] = {g} is not a group (there are {ng}: in_features {kk} / \
                         group_size {gl})",
                        k.start + i
                    ),
                ));
            }
            out.push(g as u32);
        }
        out
    } else if s.desc_act {
        return Err(tbad(
            &gi_name,
            "missing from the checkpoint, and desc_act needs it".into(),
        ));
    } else {
        k.clone().map(|i| (i / gl) as u32).collect()
    };
    let groups = match (g_idx.iter().min(), g_idx.iter().max()) {
        (Some(&lo), Some(&hi)) => lo as usize..hi as usize + 1,
        _ => 0..0,
    };

    // Zeros: the packed words covering `n`, unpacked; for `sym`, the whole tensor decides the
    // convention (it is 1/(8·g) of the weight's size), so that every rank decides the same.
    let zshape = [ng, nn / PACK];
    let zw = n.start / PACK..n.end.div_ceil(PACK);
    let (zero_format, packed) = if s.sym {
        let all = ck.read_i32(&qz_name, &zshape, &Slice::Full)?;
        let fmt = detect_zero_format(&all, nn / PACK)
            .map_err(|why| tbad(&qz_name, format!("{why} (the config says sym)")))?;
        log_zero_format(module, fmt, declared);
        let rows = &all[groups.start * zshape[1]..groups.end * zshape[1]];
        (fmt, cut_cols(rows, zshape[1], zw.clone()))
    } else {
        let packed = read_i32_block(ck, &qz_name, zshape, groups.clone(), zw.clone())?;
        (declared, packed)
    };
    let mut zeros = Vec::with_capacity(groups.len() * n.len());
    for row in packed.chunks_exact(zw.len().max(1)).take(groups.len()) {
        for c in n.clone() {
            let word = row[c / PACK - zw.start] as u32;
            let stored = ((word >> (4 * (c % PACK))) & 0xf) as u8;
            zeros.push(zero_format.zero(stored));
        }
    }

    let scales = read_f32_block(ck, &sc_name, [ng, nn], groups.clone(), n.clone())?;
    Ok(QuantLinear {
        n,
        k,
        qweight: qweight.into_iter().map(|w| w as u32).collect(),
        groups,
        zeros,
        scales,
        g_idx,
        zero_format,
    })
}

/// The convention of a `sym` layer's stored zeros (`qzeros` words, `words_per_row` per group):
/// every nibble 7 is v1, every nibble 8 is v2. Anything else is an error saying what was
/// found where.
pub fn detect_zero_format(qzeros: &[i32], words_per_row: usize) -> Result<ZeroFormat, String> {
    let mut first: Option<u8> = None;
    for (i, &w) in qzeros.iter().enumerate() {
        for j in 0..PACK {
            let z = ((w as u32 >> (4 * j)) & 0xf) as u8;
            match first {
                None => first = Some(z),
                Some(f) if f != z => {
                    let (g, c) = (
                        i / words_per_row.max(1),
                        i % words_per_row.max(1) * PACK + j,
                    );
                    return Err(format!(
                        "stored zeros differ: {f} and {z} (group {g}, column {c}); symmetric \
                         int4 stores one value, 7 (gptq) or 8 (gptq_v2)"
                    ));
                }
                Some(_) => {}
            }
        }
    }
    match first {
        Some(7) => Ok(ZeroFormat::V1),
        Some(8) | None => Ok(ZeroFormat::V2),
        Some(z) => Err(format!(
            "every stored zero is {z}; symmetric int4 stores 7 (gptq) or 8 (gptq_v2)"
        )),
    }
}

/// Logs the convention taken, once per process and convention (a model's layers all agree;
/// tests load many).
fn log_zero_format(module: &str, taken: ZeroFormat, declared: ZeroFormat) {
    // Relaxed: a flag that only suppresses repeated log lines; nothing is published by it.
    static LOGGED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    let i = taken as usize;
    if LOGGED[i].swap(true, Ordering::Relaxed) {
        return;
    }
    let stored = match taken {
        ZeroFormat::V1 => 7,
        ZeroFormat::V2 => 8,
    };
    if taken == declared {
        tracing::info!(
            "gptq: {module}: stored zeros are {stored}: reading as {}, as declared",
            taken.name()
        );
    } else {
        tracing::info!(
            "gptq: {module}: stored zeros are {stored}: reading as {}, although the config \
             says {}",
            taken.name(),
            declared.name()
        );
    }
}

/// Rows `rows` × columns `cols` of the 2-D I32 tensor `name` of shape `shape`, reading only
/// a row run or a column run from the file (both partial: the rows, then cut).
fn read_i32_block(
    ck: &Checkpoint,
    name: &str,
    shape: [usize; 2],
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<Vec<i32>, ModelError> {
    let sl = block_slice(shape, &rows, &cols);
    let v = ck.read_i32(name, &shape, &sl)?;
    Ok(cut(v, shape, &sl, cols))
}

/// [`read_i32_block`] for a float tensor, widened to f32.
fn read_f32_block(
    ck: &Checkpoint,
    name: &str,
    shape: [usize; 2],
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<Vec<f32>, ModelError> {
    let sl = block_slice(shape, &rows, &cols);
    let v = ck.read_f32(name, &shape, &sl)?;
    Ok(cut(v, shape, &sl, cols))
}

/// The file slice to read for a block: all columns of the rows (one run), or, where every row
/// is wanted, the columns (one run per row).
fn block_slice(shape: [usize; 2], rows: &Range<usize>, cols: &Range<usize>) -> Slice {
    if *rows == (0..shape[0]) && *cols != (0..shape[1]) {
        Slice::Cols(cols.clone())
    } else {
        Slice::Rows(rows.clone())
    }
}

/// Columns `cols` of `v`, which holds `sl` of a tensor of `shape`.
fn cut<T: Copy>(v: Vec<T>, shape: [usize; 2], sl: &Slice, cols: Range<usize>) -> Vec<T> {
    match sl {
        Slice::Rows(_) if cols.len() != shape[1] => cut_cols(&v, shape[1], cols),
        _ => v,
    }
}

/// Columns `cols` of `rows`, whole rows of `width` elements.
fn cut_cols<T: Copy>(rows: &[T], width: usize, cols: Range<usize>) -> Vec<T> {
    rows.chunks_exact(width.max(1))
        .flat_map(|r| r[cols.clone()].iter().copied())
        .collect()
}

/// The input columns rank `rank` of `world` holds of a row-parallel quantized layer of `k`
/// inputs: whole groups where there are at least as many groups as ranks, else whole packed
/// words (one group over all of K, or few large groups); uneven where they do not divide, as
/// [`tprun_kernels::comm::shard_range`] splits.
pub fn k_shard(
    k: usize,
    s: &QuantSettings,
    world: usize,
    rank: usize,
) -> Result<Range<usize>, ModelError> {
    let gl = s.group_len(k);
    if gl == 0 || !k.is_multiple_of(gl) {
        return Err(ModelError::Shard {
            world,
            why: format!("group_size {gl} does not divide in_features {k}"),
        });
    }
    let unit = if k / gl >= world { gl } else { PACK };
    if k == 0 || !k.is_multiple_of(unit) || k / unit < world {
        return Err(ModelError::Shard {
            world,
            why: format!(
                "in_features {k} cannot be split into {world} parts of whole {unit}-row units"
            ),
        });
    }
    let r = tprun_kernels::comm::shard_range(k / unit, world, rank);
    Ok(r.start * unit..r.end * unit)
}

// ---- writing -----------------------------------------------------------------------------

/// How [`quantize`] quantizes a matrix.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// Rows per group; `None`: one group over all of K (`group_size` −1).
    pub group_size: Option<usize>,
    pub sym: bool,
    /// The convention the zeros are stored in.
    pub format: ZeroFormat,
    /// `desc_act`: the order in which input rows are grouped (a permutation of 0..K; group i
    /// is rows `order[i·g .. (i+1)·g]`), as GPTQ's act-order processes columns by decreasing
    /// Hessian diagonal. `None`: runs of `group_size` rows.
    pub act_order: Option<Vec<usize>>,
}

/// A quantized linear layer's tensors, as a checkpoint stores them.
#[derive(Clone, Debug)]
pub struct Quantized {
    /// out_features.
    pub n: usize,
    /// in_features.
    pub k: usize,
    pub settings: QuantSettings,
    pub format: ZeroFormat,
    /// [K/8, N].
    pub qweight: Vec<i32>,
    /// [G, N/8].
    pub qzeros: Vec<i32>,
    /// [G, N], each f16-representable.
    pub scales: Vec<f32>,
    /// [K]: the group of each input row.
    pub g_idx: Vec<i32>,
}

/// Quantizes `w`, an [N, K] row-major f32 matrix, to GPTQ int4 (round to nearest, no Hessian
/// correction: GPTQ's storage format, not its algorithm). Symmetric: s = 2·max|w| / 15, z = 8
/// (AutoGPTQ's `sym`). Asymmetric: s = (max − min) / 15, z = round(−min / s), with min ≤ 0 ≤
/// max. Scales are rounded to f16 before the weights are divided by them.
pub fn quantize(
    w: &[f32],
    n: usize,
    k: usize,
    opts: &QuantizeOptions,
) -> Result<Quantized, ModelError> {
    let bad = |why: String| ModelError::Invalid(format!("gptq quantize: {why}"));
    if n.checked_mul(k) != Some(w.len()) {
        return Err(bad(format!("{} values for [{n}, {k}]", w.len())));
    }
    if k == 0 || n == 0 || !k.is_multiple_of(PACK) || !n.is_multiple_of(PACK) {
        return Err(bad(format!(
            "[{n}, {k}]: both dimensions must be positive multiples of 8"
        )));
    }
    let gl = opts.group_size.unwrap_or(k);
    if gl == 0 || !k.is_multiple_of(gl) {
        return Err(bad(format!("group size {gl} does not divide {k}")));
    }
    let ng = k / gl;
    let order: Vec<usize> = match &opts.act_order {
        Some(o) => {
            let mut seen = vec![false; k];
            if o.len() != k
                || o.iter()
                    .any(|&i| i >= k || std::mem::replace(&mut seen[i], true))
            {
                return Err(bad("act_order is not a permutation of 0..K".into()));
            }
            o.clone()
        }
        None => (0..k).collect(),
    };
    let mut g_idx = vec![0i32; k];
    for (pos, &row) in order.iter().enumerate() {
        g_idx[row] = (pos / gl) as i32;
    }
    let mut scales = vec![0f32; ng * n];
    let mut zeros = vec![0u8; ng * n];
    let mut qweight = vec![0i32; k / PACK * n];
    // Output rows (contiguous in `w`) split over the cores: each thread owns columns
    // [c0, c1) of every row of `scales`, `zeros` and `qweight`, so the result is the same
    // whatever the split (synth --quant writes 192 matrices of 27B size).
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n);
    let bounds: Vec<usize> = (0..=threads).map(|t| t * n / threads).collect();
    let mut parts: Vec<ColumnPart<'_>> = (0..threads)
        .map(|t| ColumnPart {
            c0: bounds[t],
            scales: Vec::new(),
            zeros: Vec::new(),
            qweight: Vec::new(),
        })
        .collect();
    for row in scales.chunks_mut(n) {
        for (part, piece) in parts.iter_mut().zip(split_at(row, &bounds)) {
            part.scales.push(piece);
        }
    }
    for row in zeros.chunks_mut(n) {
        for (part, piece) in parts.iter_mut().zip(split_at(row, &bounds)) {
            part.zeros.push(piece);
        }
    }
    for row in qweight.chunks_mut(n) {
        for (part, piece) in parts.iter_mut().zip(split_at(row, &bounds)) {
            part.qweight.push(piece);
        }
    }
    std::thread::scope(|scope| {
        for part in parts {
            let (order, g_idx) = (&order, &g_idx);
            scope.spawn(move || quantize_columns(w, k, gl, opts, order, g_idx, part));
        }
    });
    let mut qzeros = vec![0i32; ng * n / PACK];
    for g in 0..ng {
        for c in 0..n {
            let st = opts.format.stored(zeros[g * n + c]) as u32;
            qzeros[g * n / PACK + c / PACK] |= (st << (4 * (c % PACK))) as i32;
        }
    }
    Ok(Quantized {
        n,
        k,
        settings: QuantSettings {
            bits: BITS,
            group_size: opts.group_size,
            sym: opts.sym,
            desc_act: opts.act_order.is_some(),
        },
        format: opts.format,
        qweight,
        qzeros,
        scales,
        g_idx,
    })
}

/// One thread's columns [c0, c0 + width) of `quantize`'s outputs: per group (`scales`,
/// `zeros`) or per packed input row (`qweight`), the slice of that row it owns.
struct ColumnPart<'a> {
    c0: usize,
    scales: Vec<&'a mut [f32]>,
    zeros: Vec<&'a mut [u8]>,
    qweight: Vec<&'a mut [i32]>,
}

/// `row` cut at `bounds` (ascending, from 0 to row.len()).
fn split_at<'a, T>(mut row: &'a mut [T], bounds: &[usize]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(bounds.len() - 1);
    for w in bounds.windows(2) {
        let (head, tail) = row.split_at_mut(w[1] - w[0]);
        out.push(head);
        row = tail;
    }
    out
}

/// `quantize` for the output rows of one [`ColumnPart`]: each group's scale and zero, then
/// every weight's nibble (by output rows, contiguous in `w`: three times faster than by
/// inputs).
fn quantize_columns(
    w: &[f32],
    k: usize,
    gl: usize,
    opts: &QuantizeOptions,
    order: &[usize],
    g_idx: &[i32],
    mut part: ColumnPart<'_>,
) {
    let width = part.scales.first().map_or(0, |s| s.len());
    for j in 0..width {
        let row = &w[(part.c0 + j) * k..(part.c0 + j + 1) * k];
        for (g, rows) in order.chunks_exact(gl).enumerate() {
            let vals = rows.iter().map(|&r| row[r]);
            let (lo, hi) = vals.fold((0f32, 0f32), |(a, b), v| (a.min(v), b.max(v)));
            let (s, z) = if opts.sym {
                let amax = hi.max(-lo);
                (2.0 * amax / 15.0, SYM_ZERO)
            } else {
                let s = (hi - lo) / 15.0;
                let s16 = f16::from_f32(s).to_f32();
                let z = if s16 > 0.0 { (-lo / s16).round() } else { 0.0 };
                (s, z.clamp(0.0, 15.0) as u8)
            };
            // A zero range (all-zero group) or one below f16's range: any positive scale
            // quantizes it to z; AutoGPTQ takes the range [−1, 1].
            let s16 = f16::from_f32(s).to_f32();
            part.scales[g][j] = if s16 > 0.0 {
                s16
            } else {
                f16::from_f32(2.0 / 15.0).to_f32()
            };
            part.zeros[g][j] = z;
        }
        for (r, &v) in row.iter().enumerate() {
            let g = g_idx[r] as usize;
            let (s, z) = (part.scales[g][j], part.zeros[g][j] as f32);
            let q = ((v / s).round() + z).clamp(0.0, 15.0) as u32;
            part.qweight[r / PACK][j] |= (q << (4 * (r % PACK))) as i32;
        }
    }
}

impl Quantized {
    /// The dequantised [N, K] matrix, straight from the in-memory tensors (the reference a
    /// reader must reproduce exactly).
    pub fn dequantize(&self) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut w = vec![0f32; n * k];
        for r in 0..k {
            let g = self.g_idx[r] as usize;
            for c in 0..n {
                let q = (self.qweight[r / PACK * n + c] as u32 >> (4 * (r % PACK))) & 0xf;
                let st = (self.qzeros[g * n / PACK + c / PACK] as u32 >> (4 * (c % PACK))) & 0xf;
                let z = self.format.zero(st as u8);
                w[c * k + r] = (q as f32 - z as f32) * self.scales[g * n + c];
            }
        }
        w
    }

    /// The tensors of module `module`: (name, dtype, shape, little-endian bytes). `g_idx` is
    /// included for `desc_act`, or when `with_g_idx` (GPTQModel writes it always).
    pub fn tensors(
        &self,
        module: &str,
        with_g_idx: bool,
    ) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        let [qw, qz, sc, gi] = names(module);
        let ints = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let ng = self.qzeros.len() * PACK / self.n;
        let mut out = vec![
            (
                qw,
                Dtype::I32,
                vec![self.k / PACK, self.n],
                ints(&self.qweight),
            ),
            (qz, Dtype::I32, vec![ng, self.n / PACK], ints(&self.qzeros)),
            (
                sc,
                Dtype::F16,
                vec![ng, self.n],
                self.scales
                    .iter()
                    .flat_map(|&s| f16::from_f32(s).to_le_bytes())
                    .collect(),
            ),
        ];
        if with_g_idx || self.settings.desc_act {
            out.push((gi, Dtype::I32, vec![self.k], ints(&self.g_idx)));
        }
        out
    }
}

/// Writes a safetensors file of `tensors` (as [`Quantized::tensors`] returns them, any
/// number of layers and plain tensors concatenated).
pub fn write(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) -> Result<(), ModelError> {
    let header: Vec<(String, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
        .collect();
    let source: &mut TensorSource<'_> = &mut |i, out| out(&tensors[i].3);
    super::safetensors::write_stored(path, &header, source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tprun-gptq-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn cfg(q: Value) -> Result<GptqConfig, ModelError> {
        GptqConfig::from_config(
            Path::new("config.json"),
            &json!({ "quantization_config": q }),
        )
        .map(|c| c.expect("present"))
    }

    /// A deterministic [N, K] matrix with a spread of magnitudes per row and column.
    fn matrix(n: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::model::rng::Rng::new(seed);
        (0..n * k)
            .map(|i| rng.f32_sym() * (1.0 + (i % 7) as f32))
            .collect()
    }

    fn opts(group_size: Option<usize>, format: ZeroFormat) -> QuantizeOptions {
        QuantizeOptions {
            group_size,
            sym: true,
            format,
            act_order: None,
        }
    }

    /// The largest |w − r| in units of each element's scale.
    fn max_step_error(q: &Quantized, w: &[f32], r: &[f32]) -> f32 {
        let (n, k) = (q.n, q.k);
        (0..n * k)
            .map(|i| {
                let g = q.g_idx[i % k] as usize;
                (w[i] - r[i]).abs() / q.scales[g * n + i / k]
            })
            .fold(0f32, f32::max)
    }

    /// Writes `q` as module `m` into `dir/model.safetensors` and opens it.
    fn checkpoint(dir: &Path, q: &Quantized, with_g_idx: bool) -> Checkpoint {
        write(&dir.join("model.safetensors"), &q.tensors("m", with_g_idx)).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    fn read_all(
        ck: &Checkpoint,
        q: &Quantized,
        declared: ZeroFormat,
    ) -> Result<QuantLinear, ModelError> {
        read_linear(ck, &LinearPart::full("m", q.n, q.k), &q.settings, declared)
    }

    /// Part `n` × `k` of module `m`, of [N, K] = [`nn`, `kk`].
    fn part(nn: usize, kk: usize, n: Range<usize>, k: Range<usize>) -> LinearPart<'static> {
        LinearPart {
            module: "m",
            out_features: nn,
            in_features: kk,
            n,
            k,
        }
    }

    #[test]
    fn config_parses_fields_defaults_and_nesting() {
        let c = cfg(json!({"quant_method": "gptq", "bits": 4, "group_size": 128,
                           "sym": true, "desc_act": false}))
        .unwrap();
        assert_eq!(
            c.base,
            QuantSettings {
                bits: 4,
                group_size: Some(128),
                sym: true,
                desc_act: false
            }
        );
        assert_eq!(c.format, ZeroFormat::V1);
        let c = cfg(json!({"quant_method": "gptq", "bits": 4, "group_size": -1,
                           "desc_act": true, "checkpoint_format": "gptq_v2"}))
        .unwrap();
        assert_eq!((c.base.group_size, c.base.desc_act), (None, true));
        assert_eq!(c.format, ZeroFormat::V2);
        assert_eq!(c.base.group_len(4096), 4096);
        // `format` (older GPTQModel) and quant_method gptq_v2.
        let c = cfg(json!({"quant_method": "gptq", "bits": 4, "format": "gptq_v2"})).unwrap();
        assert_eq!(c.format, ZeroFormat::V2);
        let c = cfg(json!({"quant_method": "gptq_v2", "bits": 4})).unwrap();
        assert_eq!(c.format, ZeroFormat::V2);
        // Nested under text_config (multimodal checkpoints); absent: none.
        let v =
            json!({"text_config": {"quantization_config": {"quant_method": "gptq", "bits": 4}}});
        let c = GptqConfig::from_config(Path::new("c.json"), &v)
            .unwrap()
            .unwrap();
        assert_eq!(c.base.group_size, Some(128));
        assert!(
            GptqConfig::from_config(Path::new("c.json"), &json!({"hidden_size": 8}))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn unsupported_configs_are_one_clear_line() {
        let cases = [
            (
                json!({"quant_method": "gptq", "bits": 8}),
                "quantization_config.bits`: 8 is not supported (4)",
            ),
            (
                json!({"quant_method": "gptq", "bits": 3}),
                "`quantization_config.bits`: 3 is not supported",
            ),
            (
                json!({"quant_method": "awq", "bits": 4}),
                "quant_method`: awq is not supported (gptq)",
            ),
            (json!({"bits": 4}), "quant_method`: (missing)"),
            (
                json!({"quant_method": "gptq"}),
                "`quantization_config.bits`: missing",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 100}),
                "group_size`: 100 is not supported",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 0}),
                "group_size`: 0",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "sym": "yes"}),
                "sym`: expected true or false",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}),
                "checkpoint_format`: marlin",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "dynamic": {"+:mlp": {"bits": 8}}}),
                "dynamic.+:mlp.bits`: 8 is not supported",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "dynamic": {"-:(?<=a)b": {}}}),
                "dynamic.-:(?<=a)b`: not a regular expression",
            ),
        ];
        for (q, want) in cases {
            let e = cfg(q.clone()).unwrap_err().to_string();
            assert!(
                e.starts_with("config.json: field `") && e.contains(want),
                "{q}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn dynamic_rules_skip_and_override_modules() {
        let c = cfg(
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {
                "-:.*\\.self_attn\\..*": {},
                "-:model\\.layers\\.0\\.": {},
                "+:.*down_proj": {"group_size": 32, "desc_act": true},
                "lm_head": {"sym": false}
            }}),
        )
        .unwrap();
        assert_eq!(c.dynamic.len(), 4);
        assert!(!c.is_quantized("model.layers.3.self_attn.q_proj"));
        assert!(
            !c.is_quantized("model.layers.0.mlp.up_proj"),
            "-: wins over nothing"
        );
        assert!(
            !c.is_quantized("model.layers.0.mlp.down_proj"),
            "-: wins over +:"
        );
        assert!(c.is_quantized("model.layers.10.mlp.up_proj"));
        assert_eq!(c.settings("model.layers.10.mlp.up_proj"), Some(c.base));
        let d = c.settings("model.layers.10.mlp.down_proj").unwrap();
        assert_eq!((d.group_size, d.desc_act, d.sym), (Some(32), true, true));
        assert!(!c.settings("lm_head").unwrap().sym, "a bare key overrides");
        // Matched at the start only, as Python's re.match.
        assert!(c.is_quantized("x.model.layers.0.mlp"));
    }

    /// The packing, pinned by hand: nibble j of qweight word [i][n] is q[8i + j][n], of qzeros
    /// word [g][i] the zero of column 8i + j.
    #[test]
    fn packing_is_low_nibble_first() {
        let (n, k) = (8, 16);
        // q[k][n] = (k + n) % 16; zeros (v2) z[n] = n; scale of column n = n + 1.
        let mut qweight = vec![0i32; k / 8 * n];
        for r in 0..k {
            for c in 0..n {
                qweight[r / 8 * n + c] |= ((((r + c) % 16) as u32) << (4 * (r % 8))) as i32;
            }
        }
        assert_eq!(qweight[0] as u32, 0x7654_3210);
        let qzeros = vec![0x7654_3210u32 as i32];
        let q = Quantized {
            n,
            k,
            settings: QuantSettings {
                bits: 4,
                group_size: None,
                sym: false,
                desc_act: false,
            },
            format: ZeroFormat::V2,
            qweight,
            qzeros,
            scales: (0..n).map(|c| (c + 1) as f32).collect(),
            g_idx: vec![0; k],
        };
        let d = tmpdir("pack");
        let ck = checkpoint(&d, &q, false);
        let w = read_all(&ck, &q, ZeroFormat::V2).unwrap().dequantize();
        for r in 0..k {
            for c in 0..n {
                let want = (((r + c) % 16) as f32 - c as f32) * (c + 1) as f32;
                assert_eq!(w[c * k + r], want, "w[{c}][{r}]");
            }
        }
        assert_eq!(w, q.dequantize());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// quantize → write → read → dequantise equals the reference exactly, for every group
    /// size and both conventions, with or without act-order; the stored zeros decide the
    /// convention whatever the config declares.
    #[test]
    fn round_trips_exactly_and_detects_the_zero_convention() {
        let (n, k) = (24, 256);
        let w = matrix(n, k, 11);
        let d = tmpdir("round");
        for group in [Some(32), Some(64), Some(128), None] {
            for format in [ZeroFormat::V1, ZeroFormat::V2] {
                for act in [false, true] {
                    let mut o = opts(group, format);
                    // A fixed scramble of 0..K: 7 is odd, so r ↦ 7r mod K is a permutation.
                    o.act_order = act.then(|| (0..k).map(|r| r * 7 % k).collect());
                    let q = quantize(&w, n, k, &o).unwrap();
                    // Quantisation error is at most half a step (the sym range is ±7.5 s),
                    // give or take the f16 rounding of s (2^-11 relative, times 15 steps).
                    let r = q.dequantize();
                    assert!(max_step_error(&q, &w, &r) <= 0.5 * 1.01);
                    let ck = checkpoint(&d, &q, group == Some(64));
                    for declared in [ZeroFormat::V1, ZeroFormat::V2] {
                        let l = read_all(&ck, &q, declared).unwrap();
                        assert_eq!(l.zero_format, format, "{group:?} {format:?} {act}");
                        assert_eq!(l.dequantize(), r, "{group:?} {format:?} {act}");
                    }
                    if act && group.is_some() {
                        // Act-order groups are not runs: g_idx is not k / g.
                        let gl = group.unwrap_or(k);
                        assert!((0..k).any(|r| q.g_idx[r] as usize != r / gl));
                    }
                }
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Asymmetric layers are read in the declared convention (the zeros vary, so the data
    /// cannot say), including v1's stored 15 for z = 0.
    #[test]
    fn asymmetric_layers_trust_the_declared_convention() {
        let (n, k) = (16, 64);
        // Row 0 of each column all positive: min is 0, so z = 0 (v1 stores 15).
        let w: Vec<f32> = matrix(n, k, 3)
            .iter()
            .enumerate()
            .map(|(i, &v)| if i / k % 2 == 0 { v.abs() } else { v })
            .collect();
        let d = tmpdir("asym");
        for format in [ZeroFormat::V1, ZeroFormat::V2] {
            let mut o = opts(Some(32), format);
            o.sym = false;
            let q = quantize(&w, n, k, &o).unwrap();
            let ck = checkpoint(&d, &q, false);
            let l = read_all(&ck, &q, format).unwrap();
            assert!(l.zeros.contains(&0) && l.zeros.iter().any(|&z| z != l.zeros[0]));
            assert_eq!(l.zero_format, format);
            assert_eq!(l.dequantize(), q.dequantize());
            // Within a step: the top of the range may clamp at 15 after z is rounded.
            assert!(max_step_error(&q, &w, &q.dequantize()) <= 1.01);
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A rank's slice along N (column-parallel) or K (row-parallel) equals that slice of the
    /// whole dequantised matrix, for uneven and unaligned N ranges and K on group
    /// boundaries or word boundaries.
    #[test]
    fn slices_equal_the_slice_of_the_whole() {
        let (n, k) = (40, 256);
        let w = matrix(n, k, 5);
        let d = tmpdir("slices");
        for (group, act) in [(Some(64), false), (Some(32), true), (None, false)] {
            let mut o = opts(group, ZeroFormat::V2);
            o.act_order = act.then(|| (0..k).rev().collect());
            let q = quantize(&w, n, k, &o).unwrap();
            let full = q.dequantize();
            let ck = checkpoint(&d, &q, false);
            let s = q.settings;
            let mut ns: Vec<Range<usize>> = vec![3..13, 0..0, 39..40, 8..16];
            ns.extend((0..3).map(|r| tprun_kernels::comm::shard_range(n, 3, r)));
            for nr in ns {
                let got = read_linear(&ck, &part(n, k, nr.clone(), 0..k), &s, ZeroFormat::V1)
                    .unwrap()
                    .dequantize();
                let want: Vec<f32> = full[nr.start * k..nr.end * k].to_vec();
                assert_eq!(got, want, "{group:?} n {nr:?}");
            }
            let mut ks: Vec<Range<usize>> = vec![8..24, 64..128, 248..256];
            for world in [2, 3, 4] {
                ks.extend((0..world).map(|r| k_shard(k, &s, world, r).unwrap()));
            }
            for kr in ks {
                for nr in [0..n, 5..21] {
                    let p = part(n, k, nr.clone(), kr.clone());
                    let l = read_linear(&ck, &p, &s, ZeroFormat::V2).unwrap();
                    let want: Vec<f32> = nr
                        .clone()
                        .flat_map(|c| full[c * k + kr.start..c * k + kr.end].to_vec())
                        .collect();
                    assert_eq!(l.dequantize(), want, "{group:?} k {kr:?} n {nr:?}");
                    if !act {
                        let gl = s.group_len(k);
                        assert_eq!(l.groups, kr.start / gl..kr.end.div_ceil(gl));
                    }
                }
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Every slice a rank may read, converted to the int4 device layout, dequantises to the
    /// same matrix, and the CPU twin of `MatmulInt4` over it equals x · wᵀ of
    /// [`QuantLinear::dequantize`] (f64 reference): group sizes 32/64/128/−1, desc_act, column
    /// and row shards, both zero conventions.
    #[test]
    fn int4_layout_matches_dequantize_through_the_cpu_twin() {
        use tprun_kernels::cpu::CpuDevice;
        use tprun_kernels::ops::{Epilogue, MatmulInt4, Prologue};
        use tprun_kernels::{DType, Device, Op, View};
        let dev = CpuDevice::new(0, 2, 10);
        let (n, k) = (32, 256);
        let w = matrix(n, k, 21);
        let d = tmpdir("int4");
        for group in [Some(32), Some(64), Some(128), None] {
            for (act, format) in [(false, ZeroFormat::V1), (true, ZeroFormat::V2)] {
                let mut o = opts(group, format);
                o.act_order = act.then(|| (0..k).map(|r| r * 7 % k).collect());
                let q = quantize(&w, n, k, &o).unwrap();
                let ck = checkpoint(&d, &q, true);
                let s = q.settings;
                let mut parts = vec![(0..n, 0..k), (8..24, 0..k)];
                parts.extend((0..2).map(|r| (0..n, k_shard(k, &s, 2, r).unwrap())));
                for (nr, kr) in parts {
                    let l =
                        read_linear(&ck, &part(n, k, nr.clone(), kr.clone()), &s, format).unwrap();
                    let h = l.to_int4().unwrap();
                    let wd = l.dequantize();
                    let what = format!("{group:?} act {act} n {nr:?} k {kr:?}");
                    assert_eq!(h.dequantize(), wd, "{what}");
                    let (nl, kl) = (nr.len(), kr.len());
                    let x: Vec<f32> = matrix(1, kl, 5);
                    let bytes = |v: Vec<u8>| {
                        let b = dev.alloc(v.len().max(4)).unwrap();
                        dev.write(&b, 0, &v).unwrap();
                        b
                    };
                    let u32s = |v: &[u32]| bytes(v.iter().flat_map(|w| w.to_le_bytes()).collect());
                    let bx = bytes(x.iter().flat_map(|v| v.to_le_bytes()).collect());
                    let bq = u32s(&h.qweight);
                    let bs = bytes(h.scales.iter().flat_map(|v| v.to_le_bytes()).collect());
                    let bz = u32s(&h.zeros);
                    let bp = h.perm.as_ref().map(|p| u32s(p));
                    let by = dev.alloc(nl * 4).unwrap();
                    dev.run(&Op::MatmulInt4(MatmulInt4 {
                        x: View::new(&bx, 0, kl, DType::F32),
                        qweight: View::new(&bq, 0, h.qweight.len(), DType::U32),
                        scales: View::new(&bs, 0, h.scales.len(), DType::F16),
                        zeros: View::new(&bz, 0, h.zeros.len(), DType::U32),
                        perm: bp.as_ref().map(|b| View::new(b, 0, h.kq(), DType::U32)),
                        y: View::new(&by, 0, nl, DType::F32),
                        m: 1,
                        k: kl,
                        n: nl,
                        group: h.group,
                        groups: h.groups,
                        prologue: Prologue::None,
                        epilogue: Epilogue::None,
                    }))
                    .unwrap();
                    let mut yb = vec![0u8; nl * 4];
                    dev.read(&by, 0, &mut yb).unwrap();
                    for (row, c) in yb.chunks_exact(4).enumerate() {
                        let got = f32::from_le_bytes(c.try_into().unwrap()) as f64;
                        let want: f64 =
                            (0..kl).map(|j| x[j] as f64 * wd[row * kl + j] as f64).sum();
                        let err = (got - want).abs() / (1.0 + want.abs());
                        assert!(err < 1e-5, "{what} row {row}: {got} vs {want}");
                    }
                }
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The config's reader takes each module's settings and refuses a skipped module.
    #[test]
    fn config_reads_quantized_modules_only() {
        let (n, k) = (8, 64);
        let q = quantize(&matrix(n, k, 2), n, k, &opts(Some(32), ZeroFormat::V2)).unwrap();
        let d = tmpdir("cfgread");
        let ck = checkpoint(&d, &q, false);
        let c = cfg(json!({"quant_method": "gptq", "bits": 4, "group_size": 32,
                           "dynamic": {"-:skip": {}}}))
        .unwrap();
        let l = c.read_linear(&ck, &LinearPart::full("m", n, k)).unwrap();
        assert_eq!(l.dequantize(), q.dequantize());
        assert_eq!(
            l.zero_format,
            ZeroFormat::V2,
            "the data overrules the declared gptq"
        );
        let e = c
            .read_linear(&ck, &LinearPart::full("skip", n, k))
            .unwrap_err();
        assert!(e.to_string().contains("skip is unquantized"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn k_shards_fall_on_group_boundaries() {
        let s = QuantSettings {
            bits: 4,
            group_size: Some(128),
            sym: true,
            desc_act: false,
        };
        // 17408 inputs (Qwen3.5-27B's down_proj) = 136 groups over 4 ranks: 34 each.
        let parts: Vec<_> = (0..4).map(|r| k_shard(17408, &s, 4, r).unwrap()).collect();
        assert_eq!(parts[1], 34 * 128..68 * 128);
        assert_eq!(parts[3].end, 17408);
        // Uneven: 5 groups over 2 ranks.
        assert_eq!(k_shard(640, &s, 2, 0).unwrap(), 0..384);
        // One group over all of K: whole words.
        let one = QuantSettings {
            group_size: None,
            ..s
        };
        assert_eq!(k_shard(64, &one, 3, 2).unwrap(), 48..64);
        assert!(k_shard(16, &one, 3, 0)
            .unwrap_err()
            .to_string()
            .contains("3 ranks"));
    }

    /// Overwrites tensor `t` of `dir/model.safetensors` (written from `q` as module `m`) with
    /// the given dtype, shape and bytes.
    fn with_tensor(
        dir: &Path,
        q: &Quantized,
        g_idx: bool,
        t: &str,
        dt: Dtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Checkpoint {
        let mut ts = q.tensors("m", g_idx);
        match ts.iter_mut().find(|x| x.0 == t) {
            Some(x) => *x = (t.into(), dt, shape, bytes),
            None => ts.push((t.into(), dt, shape, bytes)),
        }
        write(&dir.join("model.safetensors"), &ts).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    fn ints(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn malformed_layers_are_clear_errors() {
        let (n, k) = (16, 64);
        let w = matrix(n, k, 9);
        let q = quantize(&w, n, k, &opts(Some(32), ZeroFormat::V1)).unwrap();
        let d = tmpdir("bad");
        let s = q.settings;
        let read = |ck: &Checkpoint, s: &QuantSettings, n: usize, k: usize| {
            read_linear(ck, &LinearPart::full("m", n, k), s, ZeroFormat::V1)
                .unwrap_err()
                .to_string()
        };
        let ck = checkpoint(&d, &q, true);
        // Shapes that disagree with the layer's.
        let e = read(&ck, &s, n, k + 32);
        assert!(
            e.contains("`m.qweight`") && e.contains("shape [8, 16], expected [12, 16]"),
            "{e}"
        );
        let e = read(&ck, &s, n + 8, k);
        assert!(
            e.contains("`m.qweight`") && e.contains("expected [8, 24]"),
            "{e}"
        );
        // K not a multiple of 8, N not a multiple of 8, group not dividing K.
        let e = read(&ck, &s, n, 60);
        assert!(
            e.contains("`m.qweight`") && e.contains("in_features 60"),
            "{e}"
        );
        let e = read(&ck, &s, 12, k);
        assert!(
            e.contains("`m.qzeros`") && e.contains("out_features 12"),
            "{e}"
        );
        let g48 = QuantSettings {
            group_size: Some(48),
            ..s
        };
        let e = read(&ck, &g48, n, k);
        assert!(
            e.contains("group_size 48 does not divide in_features 64"),
            "{e}"
        );
        let b8 = QuantSettings { bits: 8, ..s };
        assert!(read(&ck, &b8, n, k).contains("8-bit GPTQ is not supported"));
        // A K range off the packing, an N range out of bounds.
        let e = read_linear(&ck, &part(n, k, 0..n, 4..32), &s, ZeroFormat::V1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("input columns 4..32"), "{e}");
        let e = read_linear(&ck, &part(n, k, 0..17, 0..k), &s, ZeroFormat::V1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("output rows 0..17"), "{e}");

        // qzeros of the wrong shape; qweight of the wrong dtype.
        let ck = with_tensor(
            &d,
            &q,
            false,
            "m.qzeros",
            Dtype::I32,
            vec![2, 1],
            ints(&[0x7777_7777; 2]),
        );
        let e = read(&ck, &s, n, k);
        assert!(
            e.contains("`m.qzeros`") && e.contains("expected [2, 2]"),
            "{e}"
        );
        let ck = with_tensor(
            &d,
            &q,
            false,
            "m.qweight",
            Dtype::F32,
            vec![8, 16],
            ints(&q.qweight),
        );
        let e = read(&ck, &s, n, k);
        assert!(
            e.contains("`m.qweight`") && e.contains("dtype F32, expected I32"),
            "{e}"
        );

        // g_idx out of range, negative, of the wrong length; missing under desc_act.
        let mut g = q.g_idx.clone();
        g[5] = 2;
        let ck = with_tensor(&d, &q, true, "m.g_idx", Dtype::I32, vec![k], ints(&g));
        let e = read(&ck, &s, n, k);
        assert!(
            e.contains("`m.g_idx`") && e.contains("g_idx[5] = 2 is not a group (there are 2"),
            "{e}"
        );
        g[5] = -1;
        let ck = with_tensor(&d, &q, true, "m.g_idx", Dtype::I32, vec![k], ints(&g));
        assert!(read(&ck, &s, n, k).contains("g_idx[5] = -1"));
        let ck = with_tensor(
            &d,
            &q,
            true,
            "m.g_idx",
            Dtype::I32,
            vec![k - 8],
            ints(&g[8..]),
        );
        assert!(read(&ck, &s, n, k).contains("expected [64]"));
        let ck = checkpoint(&d, &q, false);
        let act = QuantSettings {
            desc_act: true,
            ..s
        };
        let e = read(&ck, &act, n, k);
        assert!(
            e.contains("`m.g_idx`") && e.contains("desc_act needs it"),
            "{e}"
        );

        // Under sym: mixed stored zeros, or one value that is neither 7 nor 8.
        let mut z = q.qzeros.clone();
        z[3] = 0x7777_7778;
        let ck = with_tensor(&d, &q, false, "m.qzeros", Dtype::I32, vec![2, 2], ints(&z));
        let e = read(&ck, &s, n, k);
        assert!(
            e.contains("`m.qzeros`")
                && e.contains("stored zeros differ: 7 and 8 (group 1, column 8)")
                && e.contains("sym"),
            "{e}"
        );
        let ck = with_tensor(
            &d,
            &q,
            false,
            "m.qzeros",
            Dtype::I32,
            vec![2, 2],
            ints(&[0x5555_5555; 4]),
        );
        let e = read(&ck, &s, n, k);
        assert!(e.contains("every stored zero is 5"), "{e}");

        // A missing tensor.
        let mut ts = q.tensors("m", false);
        ts.retain(|t| t.0 != "m.scales");
        write(&d.join("model.safetensors"), &ts).unwrap();
        let ck = Checkpoint::open(&d).unwrap();
        let e = read(&ck, &s, n, k);
        assert!(e.contains("`m.scales`") && e.contains("missing"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn quantize_refuses_bad_input() {
        let w = vec![0.0; 16 * 64];
        let e = |o: &QuantizeOptions, n, k| quantize(&w[..n * k], n, k, o).unwrap_err().to_string();
        assert!(e(&opts(Some(48), ZeroFormat::V1), 16, 64).contains("group size 48"));
        assert!(e(&opts(None, ZeroFormat::V1), 12, 64).contains("multiples of 8"));
        let mut o = opts(None, ZeroFormat::V1);
        o.act_order = Some(vec![0; 64]);
        assert!(e(&o, 16, 64).contains("permutation"));
        // All-zero weights: a positive scale, every q = z, and exact zeros back.
        let q = quantize(&w, 16, 64, &opts(Some(32), ZeroFormat::V2)).unwrap();
        assert!(q.scales.iter().all(|&s| s > 0.0));
        assert!(q.dequantize().iter().all(|&x| x == 0.0));
    }
}

//! Element types and their conversions to and from f32 (every reduction accumulates in f32).

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// Token ids, positions and step counters (never a weight or an activation).
    U32,
}

impl DType {
    /// The float dtypes (what weights, activations and allreduces take).
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    pub fn is_float(self) -> bool {
        self != DType::U32
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The name used in the CLI, the benchmark tables and the safetensors headers' lower case.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
        }
    }

    /// A float dtype by name: the CLI's (`f32`, `f16`, `bf16`) or a config's (`float16`,
    /// `bfloat16`, …), any case. The one parser of dtype names (flags, `config.json`); `u32`
    /// is internal (ids, positions) and never read from input.
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(DType::F32),
            "f16" | "float16" | "half" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A storable element: how it widens to f32 and narrows back (round to nearest even).
pub trait Elem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Elem for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Calls `$body` with `$T` bound to the Rust type of `$dtype`: the one place that dispatches
/// on dtype (candle's `Map1` idea, as a macro).
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::U32 => {
                type $T = u32;
                $body
            }
        }
    };
}

/// u32 ids and positions: "conversions" are plain casts, used only by same-dtype copies and
/// fills (ops reject u32 where a float is meant, in `validate`).
impl Elem for u32 {
    const DTYPE: DType = DType::U32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as u32
    }
}

/// Encodes f32 values as `dtype` bytes (little endian), rounding to nearest even.
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            DType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
        }
    }
    out
}

/// Decodes `dtype` bytes (little endian) to f32.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::U32 => bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
    }
}

/// Encodes u32 values (token ids, positions) little endian.
pub fn encode_u32(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Decodes little-endian u32 values.
pub fn decode_u32(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trips_representable_values() {
        let vals = [0.0f32, 1.0, -2.5, 1024.0, 0.125];
        for d in DType::ALL {
            assert_eq!(decode(d, &encode(d, &vals)), vals, "{d}");
        }
    }

    #[test]
    fn parse_accepts_cli_and_safetensors_names() {
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("BF16"), Some(DType::BF16));
        assert_eq!(DType::parse("float16"), Some(DType::F16));
        assert_eq!(DType::parse("f64"), None);
        assert_eq!(DType::parse("u32"), None, "internal, never an input");
    }
}

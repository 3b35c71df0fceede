//! The element type of a bundle's weights, caches and tables.

use std::fmt;
use std::str::FromStr;

/// Storage type of weights, KV caches and tables (`model.dtype` / `tables.dtype` in bundle.toml).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE float32.
    Fp32,
    /// IEEE float16.
    Fp16,
}

impl Dtype {
    /// Bytes per element: 4 or 2.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Fp16 => 2,
        }
    }

    /// The name bundle.toml uses: `fp32` or `fp16`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Fp16 => "fp16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name other than `fp32` or `fp16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} must be \"fp32\" or \"fp16\"")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fp32" => Ok(Dtype::Fp32),
            "fp16" => Ok(Dtype::Fp16),
            other => Err(UnknownDtype(other.to_owned())),
        }
    }
}

/// How a graph stores its weights (`[model].weights`, `[graphs.<name>].weights`).
///
/// The float formats store every weight in that dtype. The quantized formats are written by
/// `herald-export --dtype q8|q4` for the talker's and code predictor's projections only
/// (docs/bundle.md "Quantized weights"); their activations and KV caches stay in the bundle's
/// [`Dtype`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// IEEE float32, 4 bytes per weight.
    Fp32,
    /// IEEE float16, 2 bytes per weight.
    Fp16,
    /// int8 per output channel (symmetric, one float32 scale per channel) with activations
    /// quantized at run time to int8, symmetric per tensor (absmax / 127, no zero points):
    /// ONNX `MatMulInteger` int8 × int8.
    Q8,
    /// 4-bit blocks of 32 weights with one float16-exact scale each (symmetric, code − 8):
    /// `com.microsoft.MatMulNBits` `bits = 4, block_size = 32`, 0.625 bytes per weight (the
    /// Q4_0 layout tract's block-quant kernels read).
    Q4,
}

impl WeightFormat {
    /// The name bundle.toml uses: `fp32`, `fp16`, `q8`, `q4`.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightFormat::Fp32 => "fp32",
            WeightFormat::Fp16 => "fp16",
            WeightFormat::Q8 => "q8",
            WeightFormat::Q4 => "q4",
        }
    }

    /// Bytes per quantized weight including its share of the scales: 4, 2, 1 + 4/K (taken
    /// as 1) and 18/32 = 0.5625 (16 bytes of codes and an f16 scale per 32 weights, Q4_0).
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            WeightFormat::Fp32 => 4.0,
            WeightFormat::Fp16 => 2.0,
            WeightFormat::Q8 => 1.0,
            WeightFormat::Q4 => 18.0 / 32.0,
        }
    }

    /// Whether the format is one of the quantized ones.
    pub fn is_quantized(self) -> bool {
        matches!(self, WeightFormat::Q8 | WeightFormat::Q4)
    }
}

impl From<Dtype> for WeightFormat {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::Fp32 => WeightFormat::Fp32,
            Dtype::Fp16 => WeightFormat::Fp16,
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A weight format name other than `fp32`, `fp16`, `q8` or `q4`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} must be \"fp32\", \"fp16\", \"q8\" or \"q4\"")]
pub struct UnknownWeightFormat(pub String);

impl FromStr for WeightFormat {
    type Err = UnknownWeightFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fp32" => Ok(WeightFormat::Fp32),
            "fp16" => Ok(WeightFormat::Fp16),
            "q8" => Ok(WeightFormat::Q8),
            "q4" => Ok(WeightFormat::Q4),
            other => Err(UnknownWeightFormat(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in [Dtype::Fp32, Dtype::Fp16] {
            assert_eq!(d.as_str().parse::<Dtype>().unwrap(), d);
        }
        assert_eq!(Dtype::Fp16.bytes(), 2);
        assert_eq!("bf16".parse::<Dtype>().unwrap_err().to_string(), "\"bf16\" must be \"fp32\" or \"fp16\"");
    }

    #[test]
    fn weight_formats_round_trip() {
        for w in [WeightFormat::Fp32, WeightFormat::Fp16, WeightFormat::Q8, WeightFormat::Q4] {
            assert_eq!(w.as_str().parse::<WeightFormat>().unwrap(), w);
        }
        assert_eq!(WeightFormat::from(Dtype::Fp16), WeightFormat::Fp16);
        assert!("q3".parse::<WeightFormat>().is_err());
        assert!(WeightFormat::Q4.is_quantized() && !WeightFormat::Fp16.is_quantized());
        // Q4_0: 16 code bytes + one f16 scale per 32 weights
        assert_eq!(WeightFormat::Q4.bytes_per_weight() * 32.0, 18.0);
    }
}

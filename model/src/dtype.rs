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
}

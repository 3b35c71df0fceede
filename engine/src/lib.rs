//! herald's compute core: the model bundle, step graphs, caches, the decode loop, sampling and
//! vocoder windowing. Pure compute: this crate never opens a device or reads `/proc`; the
//! board crate does that and hands plain settings in.

pub mod graph;
pub mod manifest;
pub mod pipeline;
pub mod prompt;
pub mod sampler;
pub mod sanitize;
pub mod stack;
pub mod stats;
pub mod synth;
pub mod tables;

pub use manifest::{Manifest, ManifestError};
pub use pipeline::{Engine, PcmChunk, Report};
pub use synth::{Bundle, EngineError, EngineSettings, Frame, Request, StopReason};

//! herald's model facts: everything about the Qwen3-TTS 12 Hz models that is pure arithmetic,
//! with no I/O, no threads and no runtime. The engine, the backends, the board and the benchmark
//! all read these, so a count or a rule exists once.
//!
//! - [`manifest`]: `bundle.toml` types, parsing and validation (reading the file is the engine's);
//! - [`frame`], [`dtype`]: frame constants and the element type;
//! - [`footprint`]: parameters per step, KV bytes per position, what a bundle needs in memory;
//! - [`kv`]: ring slots, masks and RoPE angles of the host-owned KV caches;
//! - [`prompt`]: the prompt layout over a loaded tokenizer; [`segment`]: long texts cut into
//!   segments at sentence boundaries;
//! - [`sampler`]: logits processors and sampling (the reference decoder's contract);
//! - [`schedule`]: the vocoder's chunk schedule;
//! - [`metrics`], [`stats`]: playback metrics of a chunk timeline, timing counters, the median;
//! - [`backend`]: the traits an inference runtime implements for the engine.

pub mod backend;
pub mod dtype;
pub mod footprint;
pub mod frame;
pub mod kv;
pub mod manifest;
pub mod metrics;
pub mod pause;
pub mod prompt;
pub mod sampler;
pub mod schedule;
pub mod segment;
pub mod start;
pub mod stats;

pub use dtype::Dtype;
pub use frame::{CODEBOOKS, Frame};
pub use manifest::{Manifest, ManifestError};
pub use metrics::PlaybackMetrics;
pub use schedule::ChunkSchedule;

//! herald's runtime: the decode loop, the vocoder driver, the two-stage pipeline, frame pools and
//! stage placement, over any inference backend ([`model::backend`]). Pure compute: this crate
//! never opens a device or reads `/proc`; the board crate does that and hands plain settings in.
//!
//! - [`bundle`]: opening a bundle (manifest, tokenizer, tables, the backend's graphs);
//! - [`decoder`]: the frame loop (talker prefill and step, 15 code-predictor sub-steps, sampling);
//! - [`vocoder`]: windows of frames through the backend's vocoder;
//! - [`pipeline`]: the decode and vocoder threads and the [`Engine`] a CLI and a daemon share;
//! - [`pool`]: per-stage frame pools behind a global allocator; [`placement`]: CPU pinning.

pub mod bundle;
pub mod decoder;
pub mod error;
pub mod pipeline;
pub mod placement;
pub mod pool;
pub mod settings;
pub mod tables;
pub mod vocoder;

pub use bundle::{Bundle, Verified, read_manifest, read_prompter, shared_prompter, verify};
pub use error::EngineError;
pub use pipeline::{Engine, PcmChunk, Report, StageMemory};
pub use settings::{DEFAULT_POOL_BYTES, EngineSettings, Request, StopReason};

// The model types the engine's API speaks in (a request's prompt mode, a bundle's manifest, a
// report's playback metrics), so a caller of the engine needs no second import path for them.
pub use model::{Manifest, ManifestError, PlaybackMetrics, backend, frame, manifest, pause, prompt, segment, start, stats};

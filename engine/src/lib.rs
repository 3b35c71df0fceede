//! herald's compute core: the model bundle, step graphs, caches, the decode loop, sampling and
//! vocoder windowing. Pure compute: this crate never opens a device or reads `/proc`; the
//! board crate does that and hands plain settings in.

pub mod bench;
pub mod graph;
pub mod manifest;
pub mod metrics;
pub mod pipeline;
pub mod placement;
pub mod pool;
pub mod prompt;
pub mod sampler;
pub mod sanitize;
pub mod stack;
pub mod stats;
pub mod synth;
pub mod tables;

pub use manifest::{Manifest, ManifestError};
pub use metrics::PlaybackMetrics;
pub use pipeline::{Engine, PcmChunk, Report, StageMemory};
pub use synth::{Bundle, EngineError, EngineSettings, Frame, Request, StopReason};

/// Use `threads` compute threads for the matrix products of every graph (tract's executor; the
/// decode and vocoder stages keep their own threads on top). 0 or 1: single-threaded.
///
/// Process-wide: call it once, before loading, from the binary.
pub fn set_compute_threads(threads: usize) {
    use tract_linalg::multithread::{Executor, set_default_executor};
    set_default_executor(if threads > 1 { Executor::multithread(threads) } else { Executor::SingleThread });
}

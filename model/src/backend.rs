//! The backend seam: what the engine needs from an inference runtime, and nothing more.
//!
//! The engine (decode loop, vocoder driver, pipeline) talks to a runtime only through these
//! traits; `backend/tract` implements them on tract (ONNX, symbolic past length, host-owned KV
//! buffers that grow by doubling), and a static-shape NPU backend (QNN context binaries: one
//! compiled graph per fixed slot count, fp16 I/O) implements the same traits with its own
//! buffers. What stays on the host for every backend lives in [`crate::kv`] (ring-slot
//! arithmetic, masks, RoPE angles) and [`crate::sampler`].
//!
//! Shape of the seam:
//! - [`Backend::load`] turns a bundle directory plus its validated [`Manifest`] into
//!   [`LoadedGraphs`]: the heavy, once-per-process work (parsing, optimizing, mapping weights).
//! - [`LoadedGraphs::step_session`] gives one [`StepSession`] per stack and thread: a step graph
//!   with its own KV caches, one sequence at a time (the talker keeps one per utterance, the
//!   code predictor clears its cache every frame).
//! - [`LoadedGraphs::vocoder_session`] gives a [`VocoderSession`] that decodes a window of frames
//!   (windowed) or a chunk with the decoder's state carried between calls (stateful).
//! - [`LoadedGraphs::stage_compute`] gives the compute threads of one pipeline stage (pinned to
//!   the stage's CPUs): the engine pins its own stage thread and runs the stage inside it.
//!
//! Sessions are `Send` (each lives on its stage's thread) and are driven by one thread at a
//! time; loaded graphs are shared (`Send + Sync`). Trait objects rather than a type parameter:
//! which backend runs is decided at run time from the bundle and the board.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::frame::Frame;
use crate::manifest::Manifest;

/// Why a bundle's graphs cannot be loaded. Names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A graph file is missing, unreadable or not in the backend's format (e.g. truncated).
    #[error("{path}: cannot load: {message}")]
    Load {
        /// The graph file.
        path: PathBuf,
        /// What the runtime or the decoder reported.
        message: String,
    },
    /// The graph's inputs or outputs differ from what bundle.toml declares.
    #[error("{path}: {message}")]
    Mismatch {
        /// The graph file.
        path: PathBuf,
        /// Which input/output differs and how.
        message: String,
    },
    /// The runtime cannot prepare the graph (type, optimize, compile).
    #[error("{path}: {backend} cannot run this graph: {message}")]
    Runtime {
        /// The graph file.
        path: PathBuf,
        /// The backend's name (`tract`, `qnn`).
        backend: &'static str,
        /// The runtime's error chain.
        message: String,
    },
    /// The manifest asks for something this backend cannot do (a graph it lacks, a contract it
    /// does not follow), or the OS refused a resource (compute threads).
    #[error("{0}")]
    Unsupported(String),
}

/// Why a step could not run. The session's cache is unchanged when a step fails.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The sequence would exceed the cache capacity.
    #[error("{stack}: {needed} positions exceed the KV cache capacity of {capacity}")]
    Capacity {
        /// talker / code_predictor.
        stack: String,
        /// Positions the step needs.
        needed: usize,
        /// Configured capacity.
        capacity: usize,
    },
    /// The step's inputs have the wrong size, or the graph lacks an input or output the step
    /// contract needs.
    #[error("{stack}: {message}")]
    BadInput {
        /// talker / code_predictor.
        stack: String,
        /// What is wrong.
        message: String,
    },
    /// An output failed validation; nothing was written to the cache.
    #[error("{stack}: output {name} {message}; cache left unchanged")]
    BadOutput {
        /// talker / code_predictor.
        stack: String,
        /// Output name.
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// The runtime failed to run the graph.
    #[error("{stack}: {backend}: {message}")]
    Runtime {
        /// talker / code_predictor.
        stack: String,
        /// The backend's name.
        backend: &'static str,
        /// The runtime's error chain.
        message: String,
    },
}

/// The vocoder failed or returned the wrong number of samples; the message says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct VocoderError(pub String);

/// Which step graph a session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackRole {
    /// The talker (`[talker]` in bundle.toml): prefill over the prompt, then one position per
    /// frame; returns the codec logits and the post-norm hidden state.
    Talker,
    /// The code predictor (`[code_predictor]`): a 2-position prefill and 14 one-position steps
    /// per frame, head `k` for codebook `k + 1`.
    CodePredictor,
}

impl StackRole {
    /// The stack's key in bundle.toml and in messages: `talker` or `code_predictor`.
    pub fn key(self) -> &'static str {
        match self {
            StackRole::Talker => "talker",
            StackRole::CodePredictor => "code_predictor",
        }
    }
}

/// One input of a step graph, by its name in the contract (docs/bundle.md "Step graphs"): what
/// every backend feeds it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepInput {
    /// `x`: `[1, S, hidden_in]`, the step's input vectors.
    X,
    /// `cos`: `[1, S, head_dim]`, the RoPE angles' cosines.
    Cos,
    /// `sin`: `[1, S, head_dim]`, their sines.
    Sin,
    /// `mask_full_past`: `[1, 1, S, slots]`, additive mask over the full caches.
    FullPast,
    /// `mask_full_new`: `[1, 1, S, S]`, causal mask over the step's own positions.
    FullNew,
    /// `mask_sliding_ring`: `[1, 1, S, window - 1]`, mask over the ring of the sliding layers.
    RingPast,
    /// `mask_sliding_new`: `[1, 1, S, S]`, the sliding layers' mask over the step's positions.
    RingNew,
    /// `head`: `[1]` int64, the code predictor's head.
    Head,
    /// `k_cache_<i>`: layer `i`'s cached keys.
    K(usize),
    /// `v_cache_<i>`: layer `i`'s cached values.
    V(usize),
}

impl StepInput {
    /// The input called `name` in a graph of `layers` layers; `None` for a name outside the
    /// contract (or a cache of a layer the stack does not have).
    pub fn parse(name: &str, layers: usize) -> Option<Self> {
        Some(match name {
            "x" => StepInput::X,
            "cos" => StepInput::Cos,
            "sin" => StepInput::Sin,
            "mask_full_past" => StepInput::FullPast,
            "mask_full_new" => StepInput::FullNew,
            "mask_sliding_ring" => StepInput::RingPast,
            "mask_sliding_new" => StepInput::RingNew,
            "head" => StepInput::Head,
            other => {
                let layer = |p: &str| other.strip_prefix(p).and_then(|i| i.parse::<usize>().ok()).filter(|&i| i < layers);
                match (layer("k_cache_"), layer("v_cache_")) {
                    (Some(i), _) => StepInput::K(i),
                    (_, Some(i)) => StepInput::V(i),
                    _ => return None,
                }
            }
        })
    }
}

/// What a step session is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSpec {
    /// Which stack.
    pub role: StackRole,
    /// Positions a `full` cache layer can hold (the longest sequence).
    pub capacity: usize,
    /// The most positions one step may carry (the longest prefill).
    pub max_seq: usize,
    /// Width of `x` (the talker hidden size, for both stacks).
    pub hidden_in: usize,
}

/// KV-cache counters of the last step (for tests and statistics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Bytes of new entries the host copied into the KV caches.
    pub bytes_copied: usize,
    /// Bytes copied to move filled entries into a grown buffer (0 unless the step grew a cache).
    pub bytes_regrown: usize,
    /// Positions in the step.
    pub positions: usize,
    /// Slots of the full caches during the step (≥ positions held + positions of the step).
    pub slots: usize,
}

/// What a step returns: views into the session's own buffers, valid until its next call.
#[derive(Debug, Clone, Copy)]
pub struct StepOutput<'a> {
    /// Logits of the step's last position, `[V]` float32 (codec vocabulary for the talker,
    /// codebook size for the code predictor).
    pub logits: &'a [f32],
    /// Post-norm hidden state of the last position, `[H]` (the talker's; `None` for a graph
    /// without a `hidden` output).
    pub hidden: Option<&'a [f32]>,
}

/// A step graph with its own KV caches: one sequence at a time, on one thread at a time.
pub trait StepSession: Send {
    /// Position the next step starts at (= positions held).
    fn position(&self) -> usize;

    /// Retire the sequence: empty caches, position 0. Cheap enough to call every frame.
    fn clear(&mut self);

    /// Run one step over `positions` new positions starting at [`StepSession::position`].
    ///
    /// `x` is `[positions, hidden_in]` row-major float32; `head` selects the code predictor's
    /// head (`None` for the talker). The caches advance only if every output is valid.
    ///
    /// # Errors
    /// [`StepError`]: wrong input size, capacity exceeded, invalid outputs, runtime failure.
    fn step(&mut self, x: &[f32], positions: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError>;

    /// KV counters of the last successful step.
    fn last_stats(&self) -> KvStats;
}

/// Which vocoder graph decodes a bundle's frames (`synthesis.vocoder`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VocoderForm {
    /// `[vocoder].graph`: every chunk is decoded together with up to `left_context` earlier
    /// frames, whose samples are thrown away (the context is recomputed, 3.9× the work at the
    /// default 72 + 25 frames; close to, not exactly, a single pass).
    Windowed,
    /// `[vocoder].stream_graph`: every chunk is decoded alone, the decoder's causal state
    /// (convolution tails, the transformer's keys and values, the position) carried from the
    /// previous chunk: one pass per frame, equal to a single pass over the utterance.
    Stateful,
}

impl VocoderForm {
    /// The configuration name: `windowed` or `stateful`.
    pub fn name(self) -> &'static str {
        match self {
            VocoderForm::Windowed => "windowed",
            VocoderForm::Stateful => "stateful",
        }
    }

    /// Parse a configuration name (`windowed`, `stateful`); `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "windowed" => Some(VocoderForm::Windowed),
            "stateful" => Some(VocoderForm::Stateful),
            _ => None,
        }
    }
}

impl fmt::Display for VocoderForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The vocoder: decodes frames to PCM, a chunk at a time.
pub trait VocoderSession: Send {
    /// Decode `window` and write the chunk's `n × samples_per_frame` float32 samples in
    /// [-1, 1] into `out`. A windowed session takes context frames then the chunk's `n` frames
    /// (oldest first); a stateful one takes exactly the chunk's `n` frames (`window.len() ==
    /// n`) and continues from the state the previous call left.
    ///
    /// # Errors
    /// [`VocoderError`] when the window is longer than the session was built for (or, stateful,
    /// not exactly `n` frames), the runtime fails, or the graph returns another number of
    /// samples than the window needs. A failed stateful call leaves the state unchanged.
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError>;

    /// Start a new utterance: forget the carried state (a windowed session has none). Required
    /// rather than defaulted, so that a session wrapping another cannot forget to pass it on.
    fn reset(&mut self);

    /// The form this session decodes in.
    fn form(&self) -> VocoderForm;
}

/// Called on each compute thread of a stage as it starts: pins it to the stage's CPUs.
pub type PinThread = std::sync::Arc<dyn Fn() + Send + Sync>;

/// The compute threads of one pipeline stage.
pub trait StageCompute: Send + Sync {
    /// Run `f` on the calling thread with this stage's compute threads doing the work inside
    /// it (matrix products). The caller has already pinned its own thread.
    fn run(&self, f: &mut dyn FnMut());
}

/// Seconds each graph took to load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadTimes {
    /// The talker step graph.
    pub talker: f64,
    /// The code-predictor step graph.
    pub code_predictor: f64,
    /// The vocoder graph.
    pub vocoder: f64,
    /// Whether every graph skipped parsing because the backend had it cached (tract: the
    /// decluttered models under `runtime.graph_cache_dir`).
    pub from_cache: bool,
}

/// A bundle's graphs, loaded by one backend: shared by every session and thread.
pub trait LoadedGraphs: Send + Sync + fmt::Debug {
    /// The backend's name (`tract`, `qnn`), for logs and messages.
    fn backend(&self) -> &'static str;

    /// A step session for one stack.
    ///
    /// # Errors
    /// [`StepError::BadInput`] when the graph lacks an input or output the step contract needs,
    /// or the runtime cannot prepare a session.
    fn step_session(&self, spec: &StepSpec) -> Result<Box<dyn StepSession>, StepError>;

    /// A vocoder session in the form the graphs were loaded with ([`Backend::load`]), for
    /// windows (windowed) or chunks (stateful) of at most `max_window` frames.
    ///
    /// # Errors
    /// [`VocoderError`] when the runtime cannot prepare it.
    fn vocoder_session(&self, max_window: usize) -> Result<Box<dyn VocoderSession>, VocoderError>;

    /// Compute threads for the stage named `stage` (`talker`, `vocoder`): `cpus.len()` of them
    /// (one CPU: the stage's own thread alone), each calling `pin` first so that it runs on the
    /// stage's CPUs (the engine owns CPU affinity); an empty list means the process-wide default.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when the threads cannot be started.
    fn stage_compute(&self, stage: &str, cpus: &[usize], pin: PinThread) -> Result<Box<dyn StageCompute>, BackendError>;

    /// How long each graph took to load.
    fn load_times(&self) -> LoadTimes;
}

/// An inference runtime that can load a bundle's graphs.
pub trait Backend: Send + Sync {
    /// The backend's name (`tract`, `qnn`).
    fn name(&self) -> &'static str;

    /// Load the graphs `manifest` names from `dir` (the manifest is already validated, and its
    /// files exist): the two step graphs and the vocoder graph of `vocoder`'s form.
    ///
    /// # Errors
    /// [`BackendError`] naming the graph file at fault; [`BackendError::Unsupported`] when the
    /// bundle has no graph of that form or the backend cannot run it.
    fn load(&self, dir: &Path, manifest: &Manifest, vocoder: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError>;
}

//! What an engine is built with ([`EngineSettings`]) and what one utterance asks for
//! ([`Request`]), and why it ended ([`StopReason`]).

use model::backend::VocoderForm;
use model::prompt::PromptMode;

/// Engine settings that do not come from the bundle.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Talker KV cache capacity in positions (prompt + frames); preallocated per layer.
    pub kv_capacity: usize,
    /// Chunk ramp in frames (default: [`model::schedule::default_ramp`]: chunks of 2 frames for the
    /// stateful vocoder, the bundle's `vocoder.ramp` for the windowed one).
    pub ramp: Option<Vec<usize>>,
    /// Vocoder left context in frames of the windowed vocoder (default: the bundle's
    /// `vocoder.left_context_frames`); the stateful vocoder needs none.
    pub left_context: Option<usize>,
    /// Vocoder form (default: the bundle's, stateful when it carries a stream graph).
    pub vocoder: Option<VocoderForm>,
    /// CPUs of the decode stage (talker + code predictor): its thread and its matrix-product
    /// threads are pinned there. Empty: unpinned, the process-wide executor.
    pub talker_cpus: Vec<usize>,
    /// CPUs of the vocoder stage, disjoint from `talker_cpus` on a board with more than one.
    /// Empty: unpinned.
    pub vocoder_cpus: Vec<usize>,
    /// Bytes of freed blocks each stage's frame pool may keep ([`crate::pool::FramePool`]):
    /// the decode and the vocoder thread each get one. A stage whose working set fits (and
    /// whose largest block is at most a quarter of it) stays off the heap in the steady state;
    /// 0 turns pooling off.
    pub pool_bytes: usize,
}

/// Default [`EngineSettings::pool_bytes`]: 512 MiB per stage. Measured (docs/engine.md
/// "Allocations"): it holds the whole decode working set at 0.6B (19 MiB) and all but the 45
/// largest of the vocoder's 5,356 blocks per chunk, for 0.24 GB more peak memory than no pool.
pub const DEFAULT_POOL_BYTES: usize = 512 << 20;

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            kv_capacity: 4096,
            ramp: None,
            left_context: None,
            vocoder: None,
            talker_cpus: Vec::new(),
            vocoder_cpus: Vec::new(),
            pool_bytes: DEFAULT_POOL_BYTES,
        }
    }
}

/// What to say and how.
#[derive(Debug, Clone)]
pub struct Request {
    /// The text (UTF-8; a Rust string cannot hold lone surrogates).
    pub text: String,
    /// Language name from the bundle's `[languages]`, or None / "auto".
    pub language: Option<String>,
    /// Speaker name from the bundle's `[speakers]`.
    pub speaker: Option<String>,
    /// Streaming-text (default) or non-streaming prompt.
    pub mode: PromptMode,
    /// `Some(seed)`: seeded sampling (SplitMix64 contract); `None`: greedy.
    pub seed: Option<u64>,
    /// Override of the runaway frame cap.
    pub max_frames: Option<usize>,
    /// Test hook: force c0 = eos at this frame (that many frames are produced).
    pub force_eos_at: Option<usize>,
}

impl Request {
    /// A greedy, streaming-text request with automatic language and no speaker.
    pub fn new(text: impl Into<String>) -> Self {
        Request {
            text: text.into(),
            language: None,
            speaker: None,
            mode: PromptMode::Streaming,
            seed: None,
            max_frames: None,
            force_eos_at: None,
        }
    }
}

/// Why the frame loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The talker sampled eos.
    Eos,
    /// The test hook forced eos.
    Forced,
    /// The runaway frame cap was reached (logged as a warning).
    Cap,
    /// The KV cache capacity (`synthesis.kv_capacity`) ended the utterance before the text was
    /// spoken: the text is too long for the configured capacity.
    Capacity,
}

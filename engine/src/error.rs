//! The engine's error type: everything that can go wrong, by stage.

use model::ManifestError;
use model::backend::{BackendError, StepError};
use model::prompt::PromptError;
use model::sampler::SamplerError;

use crate::tables::TablesError;

/// Everything that can go wrong in the engine, by stage. Messages name the file, key or input.
///
/// [`EngineError::Internal`] is a bug in herald (a worker thread panicked), not bad input: the
/// binary exits 1 for it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// bundle.toml is unreadable, malformed or unsupported.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// tables.safetensors is unreadable or disagrees with the manifest.
    #[error(transparent)]
    Tables(#[from] TablesError),
    /// A graph is unreadable, disagrees with the manifest, or the backend cannot run it.
    #[error(transparent)]
    Graph(#[from] BackendError),
    /// The text or the voice options are not usable.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// Sampling failed (non-finite logits, bad parameters).
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// A step graph failed.
    #[error(transparent)]
    Step(#[from] StepError),
    /// The vocoder failed or returned the wrong number of samples.
    #[error("vocoder: {0}")]
    Vocoder(String),
    /// The bundle's parts do not fit together (manifest against graphs or tokenizer).
    #[error("{0}")]
    Bundle(String),
    /// The request does not fit the settings (prompt longer than one prefill, bad ramp).
    #[error("{0}")]
    Config(String),
    /// A bug: a worker thread panicked or could not be started. Not the caller's fault.
    #[error("internal error: {0}")]
    Internal(String),
    /// The request was cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl From<model::backend::VocoderError> for EngineError {
    fn from(e: model::backend::VocoderError) -> Self {
        EngineError::Vocoder(e.0)
    }
}

impl From<model::schedule::BadRamp> for EngineError {
    fn from(e: model::schedule::BadRamp) -> Self {
        EngineError::Config(e.to_string())
    }
}

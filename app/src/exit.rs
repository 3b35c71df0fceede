//! herald's exit codes, and the one mapping from errors to them (docs/config.md "Exit codes").
//!
//! 0 ok, 2 bad input or configuration, 3 audio device (or amplifier line), 4 model bundle,
//! 130 stopped by SIGINT/SIGTERM (128 + SIGINT, the shell convention; `herald serve` exits 0
//! on a stop, its normal end), 1 anything else: a bug, please report it.

use board::audio::{SinkError, SinkErrorKind};
use engine::EngineError;
use service::fifo::FifoError;
use service::{JobError, ServiceError, TextError};

use crate::tuning::TuneError;

/// Exit code of a bug (anything not listed below).
pub const BUG: u8 = 1;
/// Exit code for bad input (text, flags) or a bad configuration.
pub const INPUT: u8 = 2;
/// Exit code for an audio device (or the amplifier line) that cannot be opened or fails.
pub const AUDIO: u8 = 3;
/// Exit code for a missing or broken model bundle.
pub const BUNDLE: u8 = 4;
/// Exit code after SIGINT/SIGTERM stopped the utterance (128 + SIGINT).
pub const INTERRUPTED: u8 = 130;

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub struct Failure {
    /// The exit code.
    pub code: u8,
    /// What went wrong (printed on one line).
    pub err: anyhow::Error,
}

/// A failure with exit code `code`.
pub fn fail(code: u8, err: impl Into<anyhow::Error>) -> Failure {
    Failure { code, err: err.into() }
}

/// The exit code of an engine error: bad text or settings 2, a stop 130, a bug inside the
/// engine (a worker thread that panicked) 1, the bundle 4.
pub fn engine_code(e: &EngineError) -> u8 {
    match e {
        EngineError::Prompt(_) | EngineError::Config(_) => INPUT,
        EngineError::Cancelled => INTERRUPTED,
        EngineError::Internal(_) => BUG,
        _ => BUNDLE,
    }
}

/// The exit code of a sink (or amplifier) error of this kind: a path or a setting 2, the device 3.
pub fn kind_code(kind: SinkErrorKind) -> u8 {
    match kind {
        SinkErrorKind::Config | SinkErrorKind::Output => INPUT,
        _ => AUDIO,
    }
}

/// The exit code of a sink error.
pub fn sink_code(e: &SinkError) -> u8 {
    kind_code(e.kind())
}

impl From<ServiceError> for Failure {
    fn from(e: ServiceError) -> Self {
        let code = match &e {
            ServiceError::Amplifier(a) => kind_code(a.kind()),
            ServiceError::Sink(s) => sink_code(s),
            ServiceError::Bundle { source, .. } => engine_code(source),
            ServiceError::Tokenizer { .. } => BUNDLE,
            ServiceError::Prompt(_) => INPUT,
        };
        fail(code, e)
    }
}

/// The exit code of a job's error: the engine's or the sink's, 130 for a cancel, 1 for a panic.
pub fn job_code(e: &JobError) -> u8 {
    match e {
        JobError::Engine(e) => engine_code(e),
        JobError::Sink(s) => sink_code(s),
        JobError::Cancelled => INTERRUPTED,
        JobError::Panicked(_) => BUG,
    }
}

impl From<JobError> for Failure {
    fn from(e: JobError) -> Self {
        fail(job_code(&e), e)
    }
}

/// A bundle that does not fit is a bundle problem (4), a broken profile override bad input (2).
impl From<TuneError> for Failure {
    fn from(e: TuneError) -> Self {
        let code = match e {
            TuneError::Probe(_) => INPUT,
            TuneError::DoesNotFit(_) | TuneError::Bundle { .. } => BUNDLE,
        };
        fail(code, e)
    }
}

/// The replacement rules (`text.replacements`) cannot be read or have a bad rule: a
/// configuration error (2).
impl From<TextError> for Failure {
    fn from(e: TextError) -> Self {
        fail(INPUT, e)
    }
}

/// The FIFO cannot be opened: bad input (2); it failed while running: a bug (1).
impl From<FifoError> for Failure {
    fn from(e: FifoError) -> Self {
        let code = match e {
            FifoError::Read { .. } => BUG,
            _ => INPUT,
        };
        fail(code, e)
    }
}

/// The error and its causes on one line ([`service::one_line`]).
pub fn one_line(err: &anyhow::Error) -> String {
    service::one_line(err.as_ref())
}

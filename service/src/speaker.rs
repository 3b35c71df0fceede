//! The [`Speaker`]: one loaded engine, the amplifier line and the voice; it speaks [`Job`]s, one
//! at a time, each into its own sink with its own [`Cancel`] handle.
//!
//! Start-up is two steps so that what can fail fast does, before the model loads:
//! [`Speaker::prepare`] opens the amplifier line (a missing chip or line stops herald at once),
//! [`Preparing::begin_early`] may open an output ahead (`herald speak` opens the device before
//! loading, so a busy device fails in milliseconds), and [`Preparing::load`] loads the engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use board::audio::{AudioSink, SinkError, SinkStats};
use board::gpio::{AmpSink, LineAmplifier};
use engine::pause::{MAX_PAUSE, TagKind};
use engine::prompt::{PromptError, PromptMode, Prompter, clean_text};
use engine::segment::{MAX_LONG_TEXT_CHARS, SegmentLimits};
use engine::start::{self, Hold, StartPlanner, StartPolicy};
use engine::{Engine, EngineError, EngineSettings, Manifest, PlaybackMetrics, Report, Request, StopReason};

use crate::cancel::{Cancel, Stop};
use crate::lookahead::Feeder;
use crate::output::{OutputSettings, Target};
use crate::text::TextOptions;

/// Where each utterance's sampler seed comes from: `None` means greedy decoding. Clones share
/// the source.
#[derive(Clone)]
pub struct Seeding(Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl Seeding {
    /// Greedy decoding (no sampling).
    pub fn greedy() -> Self {
        Seeding(Arc::new(|| None))
    }

    /// Sampling with `seed` for every utterance (reproducible).
    pub fn fixed(seed: u64) -> Self {
        Seeding(Arc::new(move || Some(seed)))
    }

    /// The seed of each utterance from `f` (e.g. a fresh one each time; `None`: greedy).
    pub fn from_fn(f: impl Fn() -> Option<u64> + Send + Sync + 'static) -> Self {
        Seeding(Arc::new(f))
    }

    /// The next utterance's seed.
    pub fn next(&self) -> Option<u64> {
        (self.0)()
    }
}

impl std::fmt::Debug for Seeding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seeding(..)")
    }
}

/// The voice every job is spoken with, unless the job's [`Request`] says otherwise, and how its
/// text is read ([`TextOptions`]).
#[derive(Debug, Clone)]
pub struct Voice {
    /// Language name from the bundle, or `auto`.
    pub language: String,
    /// Speaker name from the bundle; `None`: the bundle's default.
    pub speaker: Option<String>,
    /// Prompt mode.
    pub mode: PromptMode,
    /// Seeding of the sampler.
    pub seeding: Seeding,
    /// The text front-end's settings (`[text]`): markdown, emoji, URLs, replacement rules.
    pub text: TextOptions,
    /// Speaking speed (`synthesis.speed`): 1.0 as the model speaks, 2.0 twice as fast, pitch
    /// kept ([`crate::stretch`]); a job may ask for its own ([`Job::speed`]).
    pub speed: f32,
}

impl Voice {
    /// The request for `text` in this voice (its seed from [`Seeding::next`]): the one place a
    /// [`Request`] is built from the configuration, so every front-end's text goes through the
    /// text front-end here ([`crate::text::spoken`]). A text that has nothing left once cleaned
    /// (only emoji, only code) becomes a blank, which [`check`] and [`plan`] refuse as having
    /// nothing to say ([`PromptError::BlankText`]), like a text of only white space.
    pub fn request(&self, text: &str) -> Request {
        let seed = self.seeding.next();
        let mut spoken = crate::text::spoken(text, &self.text);
        if spoken.is_empty() && !text.is_empty() {
            spoken.push(' ');
        }
        Request {
            text: spoken,
            language: Some(self.language.clone()),
            speaker: self.speaker.clone(),
            mode: self.mode,
            seed,
            max_frames: None,
            force_eos_at: None,
        }
    }
}

/// How a long text is read ([`engine::segment`]): cut at sentence boundaries into segments that
/// are spoken back to back into one output, with a pause between them; and the pauses a text
/// asks for ([`engine::pause`]) or the configuration puts between sentences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// Sentences are packed into one segment up to this many text tokens
    /// (`synthesis.segment_tokens`); a text within it is spoken in one pass, as it is.
    pub segment_tokens: usize,
    /// Digital silence between two segments (`synthesis.segment_pause_ms`).
    pub pause: Duration,
    /// Digital silence between two sentences (`synthesis.sentence_pause_ms`); zero: sentences
    /// are packed into segments as above. Non-zero: every sentence is spoken on its own.
    pub sentence_pause: Duration,
    /// Whether a malformed pause tag is an error (`text.pause_tags = "strict"`) or read as
    /// text (`lenient`).
    pub strict_tags: bool,
}

/// Default [`Reading::segment_tokens`] ([`engine::segment::DEFAULT_SEGMENT_TOKENS`]).
pub use engine::segment::DEFAULT_SEGMENT_TOKENS;

/// Default [`Reading::pause`]: 250 ms, about the pause a reader makes between sentences.
pub const DEFAULT_SEGMENT_PAUSE: Duration = Duration::from_millis(250);

impl Default for Reading {
    fn default() -> Self {
        Reading {
            segment_tokens: DEFAULT_SEGMENT_TOKENS,
            pause: DEFAULT_SEGMENT_PAUSE,
            sentence_pause: Duration::ZERO,
            strict_tags: false,
        }
    }
}

/// Seconds of audio a long text's player may hold ahead of the speaker ([`crate::lookahead`]).
pub const LOOKAHEAD_SECONDS: usize = 30;

/// One step of a job's plan ([`plan`]): a pass of the engine, or digital silence.
#[derive(Debug, Clone)]
pub enum Piece {
    /// One pass of the engine over this request.
    Speech(Request),
    /// This much silence (a segment or sentence pause, or a pause tag).
    Silence(Duration),
}

impl Piece {
    /// The request of a [`Piece::Speech`].
    pub fn speech(&self) -> Option<&Request> {
        match self {
            Piece::Speech(r) => Some(r),
            Piece::Silence(_) => None,
        }
    }
}

/// Punctuation that a pause tag takes over when it follows the tag directly.
const TAG_PUNCTUATION: &[char] = &['.', ',', ';', ':', '!', '?', '…', '。', '！', '？', '，', '、', '；', '：'];

/// How `request` is spoken, in order: itself (one [`Piece::Speech`]) when its text is within
/// `limits.target_tokens`, has no pause tag and `reading.sentence_pause` is zero (spoken
/// exactly as given); else the pieces of the cleaned text:
/// - the text between two pause tags ([`engine::pause`]) is read on its own and the tag is a
///   [`Piece::Silence`] of its length (also at the start or the end of the text); punctuation
///   right after a tag is dropped (`Fine [pause]. Done`: the pause stands for the full stop);
/// - within that, one speech per segment ([`engine::segment::segments`]) with
///   `reading.pause` between two, or, when `reading.sentence_pause` is not zero, one per
///   sentence with that pause between two (a sentence too long for one pass is cut as a
///   segment would be, and its cuts get the sentence pause too).
///
/// Each speech has the request's voice, mode, seed and frame limits and is checked against the
/// prompt layout; a piece with nothing to say (only punctuation or invisible characters, as in
/// `Yes [pause].`) is left out. Zero silences are left out.
///
/// # Errors
/// [`PromptError::TextTooLong`] over [`MAX_LONG_TEXT_CHARS`]; [`PromptError::PauseTag`] for a
/// malformed tag when `reading.strict_tags`; otherwise the [`PromptError`] of the text (empty,
/// blank: also a text of only pause tags) or the voice (unknown language or speaker).
pub fn plan(prompter: &Prompter, request: &Request, limits: SegmentLimits, reading: &Reading) -> Result<Vec<Piece>, PromptError> {
    let chars = request.text.chars().count();
    if chars > MAX_LONG_TEXT_CHARS {
        return Err(PromptError::TextTooLong { chars, limit: MAX_LONG_TEXT_CHARS });
    }
    // a text (or a segment) without a letter or digit in any script has nothing to say: a model
    // given only punctuation babbles (engine::prompt::has_words)
    let layout = |r: &Request| {
        prompter.layout(&r.text, r.language.as_deref(), r.speaker.as_deref(), r.mode)?;
        if engine::prompt::has_words(&r.text) { Ok(()) } else { Err(PromptError::BlankText) }
    };
    let tags = engine::pause::tags(&request.text);
    let mut pauses = Vec::with_capacity(tags.len());
    for tag in tags {
        match tag.kind {
            TagKind::Pause { duration, clamped } => {
                if clamped {
                    log::warn!("pause tag {:?}: longer than {:?}, clamped to it", &request.text[tag.range.clone()], MAX_PAUSE);
                }
                pauses.push((tag.range, duration));
            }
            TagKind::Malformed { reason } if reading.strict_tags => {
                return Err(PromptError::PauseTag { tag: request.text[tag.range].to_owned(), reason });
            }
            TagKind::Malformed { .. } => {}
        }
    }
    let sentences = SegmentLimits { target_tokens: 1, ..limits };
    let (cut, between) = if reading.sentence_pause.is_zero() { (limits, reading.pause) } else { (sentences, reading.sentence_pause) };
    let mut count = |s: &str| prompter.count_tokens(s);
    if pauses.is_empty() {
        let text = clean_text(&request.text);
        let ranges = engine::segment::segments(&text, cut, &mut count);
        if ranges.len() <= 1 {
            layout(request)?;
            return Ok(vec![Piece::Speech(request.clone())]);
        }
    }
    let mut pieces = Vec::new();
    let mut first_error = None;
    let mut speech = 0;
    let mut read = |chunk: &str, pieces: &mut Vec<Piece>| -> Result<(), PromptError> {
        let text = clean_text(chunk);
        let mut spoke = false;
        for r in engine::segment::segments(&text, cut, &mut count) {
            let part = Request { text: text[r].to_owned(), ..request.clone() };
            match layout(&part) {
                Ok(()) => {
                    if spoke && !between.is_zero() {
                        pieces.push(Piece::Silence(between));
                    }
                    pieces.push(Piece::Speech(part));
                    spoke = true;
                    speech += 1;
                }
                Err(e @ (PromptError::BlankText | PromptError::NoTokens { .. })) => {
                    first_error.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    let mut from = 0;
    for (range, duration) in pauses {
        // punctuation right after the previous tag (`Fine [pause]. Done`) is the pause's:
        // read at the start of the next words it would be a sound of its own
        let chunk = request.text[from..range.start].trim_start().trim_start_matches(TAG_PUNCTUATION);
        read(chunk, &mut pieces)?;
        if !duration.is_zero() {
            pieces.push(Piece::Silence(duration));
        }
        from = range.end;
    }
    read(request.text[from..].trim_start().trim_start_matches(TAG_PUNCTUATION), &mut pieces)?;
    if speech == 0 {
        return Err(first_error.unwrap_or(PromptError::BlankText));
    }
    Ok(pieces)
}

/// Check `request`'s text and voice against the bundle's prompt layout, before any device or
/// model work: [`plan`] with `reading` and the default KV capacity.
///
/// # Errors
/// The [`PromptError`] of the text (empty, too long, a malformed pause tag in strict mode) or
/// the voice (unknown language or speaker).
pub fn check(prompter: &Prompter, request: &Request, reading: &Reading) -> Result<(), PromptError> {
    let limits = SegmentLimits::new(reading.segment_tokens, EngineSettings::default().kv_capacity);
    plan(prompter, request, limits, reading).map(|_| ())
}

/// Check `request` against the bundle in `dir` without loading its graphs (only the tokenizer),
/// read as `reading` says.
///
/// # Errors
/// [`ServiceError::Tokenizer`] when the tokenizer cannot be loaded, [`ServiceError::Prompt`]
/// for the request.
pub fn check_in(dir: &Path, manifest: &Manifest, request: &Request, reading: &Reading) -> Result<(), ServiceError> {
    let prompter = engine::shared_prompter(dir, manifest).map_err(|source| ServiceError::Tokenizer { dir: dir.to_owned(), source })?;
    check(&prompter, request, reading).map_err(ServiceError::Prompt)
}

/// A board's stage rates, from its stored calibration (`board::calibration::Measured`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageRates {
    /// Production time per frame of the whole pipeline (decode and vocoder together), seconds.
    pub seconds_per_frame: f64,
    /// Worst lateness of a chunk the rates do not explain, seconds: the start policy's margin.
    pub jitter: f64,
    /// Frames per text token the board's utterances made, when measured.
    pub frames_per_token: Option<f64>,
}

/// How playback starts on a device (`synthesis.start_policy`, [`model::start`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StartSettings {
    /// The policy; files are always written at once.
    pub policy: StartPolicy,
    /// The longest wait before playback starts, from the request (`synthesis.max_start_delay_ms`);
    /// also the longest wait at a segment boundary beyond the pause.
    pub max_delay: Duration,
    /// The board's calibration, when one is stored; what the speaker's own utterances measure
    /// takes over from it.
    pub calibrated: Option<StageRates>,
}

/// Default [`StartSettings::max_delay`]: 3 s, within the 2–5 s after which Home Assistant's
/// satellites give up on audio that has not started.
pub const DEFAULT_MAX_START_DELAY: Duration = Duration::from_millis(3000);

/// The start policy's margin without a calibration: the calibration's smallest jitter (20 ms,
/// `board::calibration::MIN_JITTER_MS`).
pub const DEFAULT_START_MARGIN: f64 = 0.020;

impl Default for StartSettings {
    fn default() -> Self {
        StartSettings { policy: StartPolicy::PlayThrough, max_delay: DEFAULT_MAX_START_DELAY, calibrated: None }
    }
}

/// What the speaker's utterances measured (each segment of a long text counts as one): the
/// start policy's rates after the calibration's, and what an automatic calibration stores
/// ([`Speaker::on_learned`]). Keeps the last [`LEARNED_KEEP`] values of each.
#[derive(Debug, Clone, Default)]
pub struct Learned {
    /// Utterances measured (with at least three chunks).
    pub utterances: usize,
    /// Production seconds per frame, between the first and the last chunk.
    pub seconds_per_frame: Vec<f64>,
    /// Decode seconds per frame (talker + code predictor + sampling).
    pub decode_seconds_per_frame: Vec<f64>,
    /// Prefill seconds.
    pub prefill_seconds: Vec<f64>,
    /// Mean vocoder seconds per chunk, and the chunk's frames (the steady chunk of the ramp).
    pub vocoder_seconds: Vec<(usize, f64)>,
    /// Seconds from the request to the first chunk.
    pub ttfa: Vec<f64>,
    /// Frames per text token of utterances that ended by themselves (eos) or at the frame cap.
    pub frames_per_token: Vec<f64>,
    /// Chunk timelines, `(arrival s, frames)`.
    pub timelines: Vec<Vec<(f64, usize)>>,
}

/// Values of each kind [`Learned`] keeps.
pub const LEARNED_KEEP: usize = 8;

fn keep<T>(v: &mut Vec<T>, x: T) {
    if v.len() >= LEARNED_KEEP {
        v.remove(0);
    }
    v.push(x);
}

impl Learned {
    /// Note one utterance of `tokens` text tokens.
    pub fn add(&mut self, report: &Report, tokens: usize, chunk: usize) {
        // an utterance that ran to the frame cap counts too: a model that never stops early
        // (random weights) speaks that long every time; a rare runaway is an outlier the
        // median ignores
        let ended = matches!(report.stop, StopReason::Eos | StopReason::Cap);
        if let Some(fpt) = (ended && tokens > 0).then(|| report.frames as f64 / tokens as f64) {
            keep(&mut self.frames_per_token, fpt);
        }
        let Some(rate) = board::calibration::rate_from_chunks(&report.chunk_times).filter(|_| report.chunk_times.len() >= 3) else {
            return;
        };
        let st = &report.stats;
        self.utterances += 1;
        keep(&mut self.seconds_per_frame, 1.0 / rate);
        keep(
            &mut self.decode_seconds_per_frame,
            (st.talker.total() + st.predictor.total() + st.sampling.total()) / report.frames.max(1) as f64,
        );
        keep(&mut self.prefill_seconds, st.prefill.mean());
        keep(&mut self.vocoder_seconds, (chunk, st.vocoder.mean()));
        keep(&mut self.ttfa, report.ttfa);
        keep(&mut self.timelines, report.chunk_times.clone());
    }

    /// Median production seconds per frame, if measured.
    pub fn median_seconds_per_frame(&self) -> Option<f64> {
        median_of(&self.seconds_per_frame)
    }

    /// Median frames per token, if measured.
    pub fn median_frames_per_token(&self) -> Option<f64> {
        median_of(&self.frames_per_token)
    }
}

/// The median of `v`, `None` when empty.
pub fn median_of(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| engine::stats::median(&mut v.to_vec()))
}

/// Called once with what the first utterances measured ([`Speaker::on_learned`]).
pub type OnLearned = Box<dyn FnMut(&Learned) + Send>;

/// The amplifier-enable line (`[amplifier]`).
#[derive(Debug, Clone, PartialEq)]
pub struct AmpSettings {
    /// Label of the GPIO chip.
    pub chip: String,
    /// Line offset within the chip.
    pub line: u32,
    /// The low level enables the amplifier.
    pub active_low: bool,
    /// Time between enabling the line and the first sample.
    pub lead: Duration,
}

/// What a [`Speaker`] needs besides the engine: plain settings, mapped from the application's
/// configuration in one place by the caller.
#[derive(Debug, Clone)]
pub struct SpeakerSettings {
    /// The voice of [`Speaker::request`].
    pub voice: Voice,
    /// The amplifier line; `None` when there is none, or nothing is played (files only).
    pub amplifier: Option<AmpSettings>,
    /// The settings of every sink the speaker makes ([`Target::open`]).
    pub output: OutputSettings,
    /// How long texts are cut and read.
    pub reading: Reading,
    /// How playback starts.
    pub start: StartSettings,
}

/// Errors of starting a [`Speaker`].
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The amplifier line could not be opened.
    #[error(transparent)]
    Amplifier(#[from] board::gpio::AmpError),
    /// An output opened ahead ([`Preparing::begin_early`]) failed.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// The bundle could not be loaded (or its settings are unusable).
    #[error("bundle {}", dir.display())]
    Bundle {
        /// The bundle directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: EngineError,
    },
    /// The bundle's tokenizer cannot be loaded ([`check_in`]).
    #[error("bundle {}", dir.display())]
    Tokenizer {
        /// The bundle directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: PromptError,
    },
    /// The text or the voice cannot be spoken with this bundle.
    #[error(transparent)]
    Prompt(#[from] PromptError),
}

/// Errors of one job; the speaker stays usable after every one of them.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The engine failed, or refused the text or voice ([`EngineError::Prompt`]).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The sink failed (the utterance was stopped and the sink aborted).
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// The job was cancelled before it started.
    #[error("cancelled before it started")]
    Cancelled,
    /// The job panicked (a bug); the worker caught it and goes on.
    #[error("internal error (please report it): {0}")]
    Panicked(String),
}

/// A job that was spoken (to the end, or cancelled mid-way).
#[derive(Debug, Clone)]
pub struct Spoken {
    /// The engine's report; `None` when the job was cancelled mid-way (the audio so far was
    /// finished cleanly: fade-out, drain, WAV header).
    pub report: Option<Report>,
    /// What the sink did.
    pub stats: SinkStats,
}

/// Called once the job's sink is open, just before synthesis starts.
type OnBegin = Box<dyn FnOnce(&Request) + Send>;
/// Called for every chunk of audio.
type OnChunk = Box<dyn FnMut() + Send>;

/// One utterance to speak: the request, where it goes, its cancel handle and its callbacks.
pub struct Job {
    /// What to say and how.
    pub request: Request,
    target: Target,
    cancel: Cancel,
    on_begin: Option<OnBegin>,
    on_chunk: Option<OnChunk>,
    /// The amplifier's lead for this job (a reloaded `amplifier.lead_ms`); `None`: as it is.
    amp_lead: Option<Duration>,
    /// The job's speaking speed; `None`: the speaker's voice's ([`Voice::speed`]).
    speed: Option<f32>,
    /// Whether its rates count in what the speaker learns ([`Job::unmeasured`]).
    measured: bool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("request", &self.request).field("target", &self.target).finish_non_exhaustive()
    }
}

impl Job {
    /// A job speaking `request` into `target`.
    pub fn new(request: Request, target: Target) -> Self {
        Job { request, target, cancel: Cancel::new(), on_begin: None, on_chunk: None, amp_lead: None, speed: None, measured: true }
    }

    /// Speak this job at `speed` (0.25..=4.0, pitch kept: [`crate::stretch`]) instead of the
    /// speaker's voice's.
    pub fn speed(mut self, speed: f32) -> Self {
        self.speed = Some(speed);
        self
    }

    /// Leave this job out of what the speaker learns from its utterances ([`Learned`]: the start
    /// policy's rates and the automatic calibration): for the start-up self-test
    /// ([`crate::selftest`]), which runs cold and is cut at a few frames.
    pub fn unmeasured(mut self) -> Self {
        self.measured = false;
        self
    }

    /// Enable the amplifier line `lead` before this job's first sample (and every later job's,
    /// until another lead is given): how a reload of `amplifier.lead_ms` reaches the line.
    pub fn amp_lead(mut self, lead: Duration) -> Self {
        self.amp_lead = Some(lead);
        self
    }

    /// Call `f` once the sink is open, just before synthesis starts.
    pub fn on_begin(mut self, f: impl FnOnce(&Request) + Send + 'static) -> Self {
        self.on_begin = Some(Box::new(f));
        self
    }

    /// Call `f` for every chunk of audio (proof of progress, e.g. for a watchdog).
    pub fn on_chunk(mut self, f: impl FnMut() + Send + 'static) -> Self {
        self.on_chunk = Some(Box::new(f));
        self
    }

    /// This job's cancel handle.
    pub fn cancel_handle(&self) -> Cancel {
        self.cancel.clone()
    }
}

/// A speaker on its way up: the amplifier line is open, the engine not loaded yet.
pub struct Preparing {
    settings: SpeakerSettings,
    amp: Option<LineAmplifier>,
    stop: Stop,
}

/// The loaded speaker. [`speak`](Self::speak) runs a job on the caller's thread;
/// [`start`](Self::start) moves the speaker onto a worker thread behind a bounded queue.
pub struct Speaker {
    engine: Engine,
    amp: Option<LineAmplifier>,
    settings: SpeakerSettings,
    stop: Stop,
    /// Segment lengths for this engine's KV capacity.
    limits: SegmentLimits,
    /// What the utterances measured so far.
    learned: Learned,
    /// Called once after this many measured utterances.
    on_learned: Option<(usize, OnLearned)>,
}

impl Speaker {
    /// Open the amplifier line, if one is configured: at start-up, before the model loads, so
    /// that a missing chip or line stops the program at once. `stop` is the process-wide stop
    /// (SIGINT/SIGTERM) that cancels this speaker's jobs.
    ///
    /// # Errors
    /// [`ServiceError::Amplifier`].
    pub fn prepare(settings: SpeakerSettings, stop: Stop) -> Result<Preparing, ServiceError> {
        let amp = match &settings.amplifier {
            Some(a) => {
                let amp = board::gpio::open_line(&a.chip, a.line, a.active_low, a.lead)?;
                log::info!(
                    "amplifier: line {} of GPIO chip '{}', enabled {} ms before the first sample",
                    a.line,
                    a.chip,
                    a.lead.as_millis()
                );
                Some(amp)
            }
            None => None,
        };
        Ok(Preparing { settings, amp, stop })
    }

    /// The loaded engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The model's sample rate, Hz.
    pub fn sample_rate(&self) -> u32 {
        self.engine.bundle().manifest.audio.sample_rate
    }

    /// The settings the speaker was prepared with.
    pub fn settings(&self) -> &SpeakerSettings {
        &self.settings
    }

    /// The request for `text` in the speaker's voice ([`Voice::request`]).
    pub fn request(&self, text: &str) -> Request {
        self.settings.voice.request(text)
    }

    /// The pieces `request` is spoken as ([`plan`] with this speaker's segment limits and
    /// reading).
    ///
    /// # Errors
    /// As [`plan`].
    pub fn plan(&self, request: &Request) -> Result<Vec<Piece>, PromptError> {
        plan(&self.engine.bundle().prompter, request, self.limits, &self.settings.reading)
    }

    /// Check that the bundle knows the voice's language and speaker (a voice it lacks would
    /// fail every job).
    ///
    /// # Errors
    /// [`PromptError::UnknownLanguage`] or [`PromptError::UnknownSpeaker`].
    pub fn check_voice(&self) -> Result<(), PromptError> {
        match check(&self.engine.bundle().prompter, &self.request("Hello."), &Reading::default()) {
            Err(e @ (PromptError::UnknownLanguage { .. } | PromptError::UnknownSpeaker { .. })) => Err(e),
            _ => Ok(()),
        }
    }

    /// Speak `job` on this thread: check the text (before touching any device), open the
    /// job's sink (with the amplifier line around it when it plays), synthesize into it, and
    /// finish it, also after a cancel (fade-out, drain, WAV header). On an error the sink is
    /// aborted.
    ///
    /// # Errors
    /// [`JobError`]; the speaker stays usable.
    pub fn speak(&mut self, job: Job) -> Result<Spoken, JobError> {
        let Job { request, target, cancel, on_begin, mut on_chunk, amp_lead, speed, measured } = job;
        if let (Some(lead), Some(amp)) = (amp_lead, self.amp.as_mut()) {
            amp.set_lead(lead);
        }
        if cancel.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        // from here a stop cancels the job: it is still spoken as far as it got (nothing) and
        // its output finished, like a job stopped mid-way
        let _running = self.stop.guard(&cancel);
        let parts = self.plan(&request).map_err(EngineError::Prompt)?;
        let plays = target.plays();
        // the time stretch sits before the sink (and its amplifier line): speed 1.0 adds nothing
        let sink = crate::stretch::wrap(target.open(&self.settings.output)?, speed.unwrap_or(self.settings.voice.speed));
        let rate = self.sample_rate();
        let engine = &self.engine;
        let gate = (plays && self.settings.start.policy == StartPolicy::PlayThrough).then(|| Gate::new(self, Instant::now()));
        let mut unmeasured = Learned::default();
        let learned = if measured { &mut self.learned } else { &mut unmeasured };
        let play = |sink: &mut (dyn AudioSink + Send)| -> Result<Spoken, JobError> {
            sink.begin(rate)?;
            if let Some(f) = on_begin {
                f(&request);
            }
            let mut beat = || {
                if let Some(f) = on_chunk.as_mut() {
                    f();
                }
            };
            match (parts.as_slice(), gate) {
                ([Piece::Speech(one)], None) => {
                    let spoken = synthesize_into(engine, one, &cancel, sink, &mut beat);
                    if let Ok(Spoken { report: Some(r), .. }) = &spoken {
                        learned.add(r, engine.bundle().prompter.count_tokens(&one.text), steady_chunk(engine));
                    }
                    spoken
                }
                (_, gate) => read_into(engine, &parts, &cancel, sink, &mut beat, gate, learned),
            }
        };
        let result = match self.amp.take() {
            Some(amp) if plays => {
                // the line goes on `lead` before the first sample and off after the drain (or
                // the abort), on every path: board::gpio::AmpSink
                let mut switched = AmpSink::new(sink, amp);
                let result = play(&mut switched);
                let (_, amp) = switched.into_parts();
                self.amp = Some(amp);
                result
            }
            amp => {
                self.amp = amp;
                let mut sink = sink;
                play(sink.as_mut())
            }
        };
        if let Some((after, _)) = &self.on_learned
            && self.learned.utterances >= *after
            && let Some((_, mut f)) = self.on_learned.take()
        {
            f(&self.learned);
        }
        result
    }

    /// Set the board's stored calibration ([`StartSettings::calibrated`]), known once the
    /// engine is loaded.
    pub fn set_calibrated(&mut self, rates: Option<StageRates>) {
        self.settings.start.calibrated = rates;
    }

    /// Call `f` once, after `utterances` utterances measured their rates (the automatic
    /// calibration of a board that has none stored, docs/board.md).
    pub fn on_learned(&mut self, utterances: usize, f: OnLearned) {
        self.on_learned = Some((utterances.max(1), f));
    }

    /// What the utterances measured so far.
    pub fn learned(&self) -> &Learned {
        &self.learned
    }

    /// The process-wide stop this speaker obeys.
    pub fn stop_handle(&self) -> &Stop {
        &self.stop
    }
}

impl Preparing {
    /// Begin `sink` now, ahead of its job, with the amplifier line on (it stays on until the
    /// job finishes or this `Preparing` is dropped). Pass the result as [`Target::Sink`] with
    /// `plays` set; the job's `begin` is then a no-op.
    ///
    /// # Errors
    /// [`ServiceError::Amplifier`] or [`ServiceError::Sink`]; the line is off again.
    pub fn begin_early(&mut self, sink: Box<dyn AudioSink + Send>, rate: u32) -> Result<Box<dyn AudioSink + Send>, ServiceError> {
        let sink = match self.amp.take() {
            Some(amp) => {
                let mut switched = AmpSink::new(sink, amp);
                let begun = switched.begin(rate);
                // the amplifier keeps its state: on after a begin, off after a failed one
                let (sink, amp) = switched.into_parts();
                self.amp = Some(amp);
                begun?;
                sink
            }
            None => {
                let mut sink = sink;
                sink.begin(rate)?;
                sink
            }
        };
        Ok(Box::new(Begun { inner: sink, rate, pending: true }))
    }

    /// Load the engine from the bundle in `dir` with `settings`.
    ///
    /// # Errors
    /// [`ServiceError::Bundle`], naming the directory.
    pub fn load(self, dir: &Path, settings: &EngineSettings) -> Result<Speaker, ServiceError> {
        self.load_with(dir, settings, &backend_tract::Tract)
    }

    /// [`Preparing::load`] on `backend` (the application's `runtime.backend` choice).
    ///
    /// # Errors
    /// [`ServiceError::Bundle`], naming the directory.
    pub fn load_with(
        self,
        dir: &Path,
        settings: &EngineSettings,
        backend: &dyn engine::backend::Backend,
    ) -> Result<Speaker, ServiceError> {
        self.load_with_fallback(dir, settings, backend, None)
    }

    /// [`Preparing::load_with`], and when `backend` fails to load (a runtime that cannot make
    /// its backend or a context, a binary that does not match the bundle) and a `fallback` is
    /// given (`runtime.backend = "auto"` chose `backend`), one warning line saying why, then the
    /// bundle loaded with `fallback`.
    ///
    /// # Errors
    /// [`ServiceError::Bundle`], naming the directory: `backend`'s failure without a fallback,
    /// else the fallback's.
    pub fn load_with_fallback(
        self,
        dir: &Path,
        settings: &EngineSettings,
        backend: &dyn engine::backend::Backend,
        fallback: Option<&dyn engine::backend::Backend>,
    ) -> Result<Speaker, ServiceError> {
        let engine = load_engine(dir, settings, backend, fallback)?;
        Ok(self.with_engine(engine, settings))
    }

    /// The speaker over an engine loaded elsewhere with `settings` ([`load_engine`], e.g. on a
    /// thread started before the text was checked and the sink opened).
    pub fn with_engine(self, engine: Engine, settings: &EngineSettings) -> Speaker {
        let limits = SegmentLimits::new(self.settings.reading.segment_tokens, settings.kv_capacity);
        Speaker {
            engine,
            amp: self.amp,
            settings: self.settings,
            stop: self.stop,
            limits,
            learned: Learned::default(),
            on_learned: None,
        }
    }
}

/// Load the engine over `dir` with `backend`, and when that fails and a `fallback` is given
/// (`runtime.backend = "auto"` chose `backend`), one warning line saying why, then with
/// `fallback` ([`Preparing::load_with_fallback`] without the speaker).
///
/// # Errors
/// [`ServiceError::Bundle`], naming the directory: `backend`'s failure without a fallback,
/// else the fallback's.
pub fn load_engine(
    dir: &Path,
    settings: &EngineSettings,
    backend: &dyn engine::backend::Backend,
    fallback: Option<&dyn engine::backend::Backend>,
) -> Result<Engine, ServiceError> {
    let bundle_err = |source| ServiceError::Bundle { dir: dir.to_owned(), source };
    match (Engine::load(dir, backend, settings), fallback) {
        (Ok(e), _) => Ok(e),
        (Err(e), Some(f)) => {
            log::warn!("backend {} failed to load, using {} instead: {e}", backend.name(), f.name());
            Engine::load(dir, f, settings).map_err(bundle_err)
        }
        (Err(e), None) => Err(bundle_err(e)),
    }
}

/// A sink begun ahead of its job ([`Preparing::begin_early`]): the first `begin` at the same
/// rate is a no-op.
struct Begun {
    inner: Box<dyn AudioSink + Send>,
    rate: u32,
    pending: bool,
}

impl AudioSink for Begun {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        if std::mem::take(&mut self.pending) && sample_rate == self.rate {
            return Ok(());
        }
        self.inner.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.inner.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.inner.finish()
    }

    fn abort(&mut self) {
        self.inner.abort();
    }
}

/// Synthesize `request` into `sink` (already begun), calling `beat` for every chunk, and finish
/// the sink, also after a cancel. On an error the sink is aborted.
fn synthesize_into(
    engine: &Engine,
    request: &Request,
    cancel: &Cancel,
    sink: &mut (dyn AudioSink + Send),
    beat: &mut dyn FnMut(),
) -> Result<Spoken, JobError> {
    let mut sink_err: Option<SinkError> = None;
    let result = engine.synthesize(request, cancel.flag(), |chunk| {
        beat();
        if let Err(e) = sink.write(chunk.samples) {
            let msg = e.to_string();
            sink_err = Some(e);
            return Err(msg);
        }
        Ok(())
    });
    if let Some(e) = sink_err {
        sink.abort();
        return Err(JobError::Sink(e));
    }
    let report = match result {
        Ok(r) => Some(r),
        Err(EngineError::Cancelled) if cancel.is_cancelled() => None,
        Err(e) => {
            sink.abort();
            return Err(JobError::Engine(e));
        }
    };
    let stats = sink.finish()?;
    beat();
    Ok(Spoken { report, stats })
}

/// Read the pieces `parts` of one text ([`plan`]) into `sink` (already begun): each speech
/// back to back with the silences between them (rounded to whole samples), calling `beat` for
/// every chunk, and finish the sink,
/// also after a cancel; on an error the sink is aborted. A segment that fills the KV cache
/// ([`StopReason::Capacity`]) ends the reading there. A player thread writes the audio from a
/// queue of up to [`LOOKAHEAD_SECONDS`] ([`crate::lookahead::play_ahead`]), so the next
/// segment's prefill runs while the last one still plays.
#[allow(clippy::too_many_arguments)]
fn read_into(
    engine: &Engine,
    parts: &[Piece],
    cancel: &Cancel,
    sink: &mut (dyn AudioSink + Send),
    beat: &mut dyn FnMut(),
    gate: Option<Gate>,
    learned: &mut Learned,
) -> Result<Spoken, JobError> {
    let t0 = gate.as_ref().map_or_else(Instant::now, |g| g.t0);
    let mut holds: Vec<Hold> = Vec::new();
    let mut frames_before = 0usize;
    let m = &engine.bundle().manifest.audio;
    let capacity = LOOKAHEAD_SECONDS * m.sample_rate as usize;
    let frame_seconds = f64::from(m.samples_per_frame) / f64::from(m.sample_rate);
    let (read, failed) = crate::lookahead::play_ahead(sink, capacity, cancel, |feed| -> Result<Option<Report>, JobError> {
        let mut whole: Option<Report> = None;
        // the silence before each segment's boundary hold, seconds (start::played): the first
        // segment's is none (the player starts with it), a later one's what was queued since
        // the previous segment
        let mut silences: Vec<f64> = vec![0.0];
        feed.set_rate(m.sample_rate);
        let speeches = parts.iter().filter(|p| p.speech().is_some()).count();
        let mut i = 0;
        for piece in parts {
            let part = match piece {
                Piece::Speech(part) => part,
                Piece::Silence(d) => {
                    let n = (d.as_secs_f64() * f64::from(m.sample_rate)).round() as usize;
                    if n > 0 && feed.silence(n).is_err() {
                        return Ok(None);
                    }
                    if let Some(last) = silences.last_mut() {
                        *last += n as f64 / f64::from(m.sample_rate);
                    }
                    continue;
                }
            };
            let tokens = engine.bundle().prompter.count_tokens(&part.text);
            let mut seg = gate.as_ref().map(|g| g.segment(i, part, tokens, engine, feed));
            let offset = t0.elapsed().as_secs_f64();
            let spoken = engine.synthesize(part, cancel.flag(), |chunk| {
                beat();
                feed.push(chunk.samples)?;
                if let Some(s) = seg.as_mut() {
                    s.chunk(chunk.ready_at, chunk.frames, feed);
                }
                Ok(())
            });
            feed.open_all();
            if let Some(s) = seg {
                holds.extend(s.holds.iter().map(|h| Hold { at_frame: h.at_frame + frames_before, open: h.open + offset, ..*h }));
            }
            if let Ok(r) = &spoken {
                learned.add(r, tokens, steady_chunk(engine));
                frames_before += r.frames;
            }
            match spoken {
                // a segment the KV cache could not hold (a capacity below what segments need):
                // the text is read as far as it fits, as a single pass would be
                Ok(report) if report.stop == StopReason::Capacity => {
                    append(&mut whole, report, offset);
                    break;
                }
                Ok(report) => append(&mut whole, report, offset),
                // a cancel, or the player stopped (its error is `failed`)
                Err(EngineError::Cancelled) => return Ok(None),
                Err(e) => return Err(JobError::Engine(e)),
            }
            log::info!("segment {} of {speeches} spoken ({} characters)", i + 1, part.text.chars().count());
            i += 1;
            silences.push(0.0);
        }
        Ok(whole.map(|mut r| {
            r.playback = PlaybackMetrics::from_chunks(&r.chunk_times, frame_seconds);
            if gate.is_some() {
                log::info!("{} ({})", start::played(&r.chunk_times, &holds, &silences, frame_seconds), StartPolicy::PlayThrough);
            }
            r
        }))
    });
    if let Some(e) = failed {
        sink.abort();
        return Err(JobError::Sink(e));
    }
    let report = match read {
        Ok(r) => r,
        Err(e) => {
            sink.abort();
            return Err(e);
        }
    };
    if report.is_none() && !cancel.is_cancelled() {
        sink.abort();
        return Err(JobError::Engine(EngineError::Internal("a segment stopped without a cancel or an error".into())));
    }
    let stats = sink.finish()?;
    beat();
    Ok(Spoken { report, stats })
}

/// The ramp's steady chunk, frames.
fn steady_chunk(engine: &Engine) -> usize {
    engine.ramp().last().copied().unwrap_or(1).max(1)
}

/// The play-through start policy of one job ([`model::start`]): what it knows when the job
/// starts (the rates, the margin, the frames per token, the budget), and per segment a
/// [`Segment`] that holds the player until the segment plays through.
struct Gate {
    /// The job's request time.
    t0: Instant,
    policy: StartSettings,
    /// Seconds per frame known before the segment (learned, else calibrated).
    prior: Option<f64>,
    margin: f64,
    frames_per_token: f64,
    frame_s: f64,
}

impl Gate {
    fn new(speaker: &Speaker, t0: Instant) -> Self {
        let cal = speaker.settings.start.calibrated;
        let learned = &speaker.learned;
        let prior = learned.median_seconds_per_frame().or(cal.map(|c| c.seconds_per_frame));
        let frames_per_token =
            learned.median_frames_per_token().or(cal.and_then(|c| c.frames_per_token)).unwrap_or(start::DEFAULT_FRAMES_PER_TOKEN);
        let m = &speaker.engine.bundle().manifest.audio;
        Gate {
            t0,
            policy: speaker.settings.start,
            prior,
            margin: cal.map_or(DEFAULT_START_MARGIN, |c| c.jitter.max(DEFAULT_START_MARGIN)),
            frames_per_token,
            frame_s: f64::from(m.samples_per_frame) / f64::from(m.sample_rate),
        }
    }

    /// The planner of segment `i` (`part`, `tokens` text tokens), holding the player before it.
    fn segment(&self, i: usize, part: &Request, tokens: usize, engine: &Engine, feed: &Feeder<'_>) -> Segment {
        let t = Instant::now();
        let chunk = steady_chunk(engine);
        let b = engine.bundle();
        let mut cap = part.max_frames.unwrap_or_else(|| engine::prompt::frame_cap(tokens, b.manifest.sampling.talker.max_new_tokens));
        if let Some(f) = part.force_eos_at {
            cap = cap.min(f.max(1));
        }
        let predicted = start::predict_frames(tokens, self.frames_per_token, start::LENGTH_MARGIN, cap);
        // the budget: the first segment's start counts from the request; a later one's wait
        // from when the player reaches it (after what is queued)
        let ahead = feed.ahead(t);
        let max = self.policy.max_delay.as_secs_f64();
        let deadline = if i == 0 { (max - t.duration_since(self.t0).as_secs_f64()).max(0.0) } else { ahead + max };
        let hold = feed.hold();
        feed.open_at(hold, t + Duration::from_secs_f64(deadline));
        log::debug!(
            "start policy: segment {}: {tokens} tokens -> {predicted} frames predicted ({:.2} frames per token + {:.0} %, cap {cap}); \
             prior {} per frame, chunk {chunk}, margin {:.0} ms, budget {:.0} ms",
            i + 1,
            self.frames_per_token,
            start::LENGTH_MARGIN * 1e2,
            self.prior.map_or("unknown".into(), |p| format!("{:.1} ms", p * 1e3)),
            self.margin * 1e3,
            deadline * 1e3,
        );
        Segment {
            t,
            hold,
            planner: StartPlanner::new(self.frame_s, chunk, predicted, self.prior, self.margin, deadline).with_cap(cap),
            holds: vec![Hold { at_frame: 0, open: deadline, boundary: true }],
        }
    }
}

/// One segment under the play-through policy: its planner, the hold before it and the ones it
/// adds.
struct Segment {
    /// When the segment's synthesis started (its chunks' clock).
    t: Instant,
    /// The hold before the segment.
    hold: usize,
    planner: StartPlanner,
    /// The holds, the segment's clock and frames; the first is the segment's start.
    holds: Vec<Hold>,
}

impl Segment {
    /// A chunk of `frames` arrived at `at` (the segment's clock) and is queued: decide the
    /// start, or once playing, whether to pause once at the end of what is queued.
    fn chunk(&mut self, at: f64, frames: usize, feed: &Feeder<'_>) {
        self.planner.chunk(at, frames);
        log::trace!("start policy: chunk of {frames} frames at {:.1} ms ({} produced)", at * 1e3, self.planner.produced());
        let when = |s: f64| self.t + Duration::from_secs_f64(s.max(0.0));
        if !feed.passed(self.hold) {
            let d = self.planner.start();
            feed.open_at(self.hold, when(d.at));
            self.holds[0].open = d.at;
            log::debug!(
                "start policy: {} of {} frames at {:.0} ms, {} per frame (chunk rates' spread {:.1} %): start at {:.0} ms{}",
                d.produced,
                d.predicted,
                at * 1e3,
                d.spf.map_or("unknown".into(), |s| format!("{:.1} ms", s * 1e3)),
                d.spread * 1e2,
                d.at * 1e3,
                if d.capped { " (the budget)" } else { "" }
            );
        } else if feed.holds_ahead() == 0 {
            // what the device has yet to play, by its clock (a sink that takes audio faster
            // than real time, like ALSA's null device, must not look dry)
            let queued = feed.ahead(when(at));
            if let Some(d) = self.planner.resume(queued) {
                let h = feed.hold();
                feed.open_at(h, when(d.at));
                let at_frame = self.planner.produced();
                self.holds.push(Hold { at_frame, open: d.at, boundary: false });
                log::debug!(
                    "start policy: {} of {} frames, {:.0} ms queued, {} per frame (chunk rates' spread {:.1} %): would run dry; \
                     one pause, resuming at {:.0} ms",
                    d.produced,
                    d.predicted,
                    queued * 1e3,
                    d.spf.map_or("unknown".into(), |s| format!("{:.1} ms", s * 1e3)),
                    d.spread * 1e2,
                    d.at * 1e3
                );
            }
        }
    }
}

/// Add the report of the segment that started `offset` seconds after the job to `whole`: frames,
/// samples and chunks add up, chunk times move onto the job's clock, the stop reason is the last
/// segment's unless an earlier one ran out of KV capacity.
fn append(whole: &mut Option<Report>, mut next: Report, offset: f64) {
    for c in &mut next.chunk_times {
        c.0 += offset;
    }
    next.ttfa += offset;
    next.total += offset;
    match whole {
        None => *whole = Some(next),
        Some(w) => {
            w.frames += next.frames;
            w.samples += next.samples;
            w.chunks += next.chunks;
            w.chunk_times.extend_from_slice(&next.chunk_times);
            w.total = next.total;
            if w.stop != StopReason::Capacity {
                w.stop = next.stop;
            }
            w.memory = next.memory;
        }
    }
}

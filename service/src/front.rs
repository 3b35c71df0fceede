//! What the network front-ends (Wyoming, HTTP) share: the loaded speaker behind its bounded
//! queue, the bundle's voices, the text limit, and the sinks a network stream gets.
//!
//! A front-end turns a client's request into a [`Request`] with [`Front::request`] (the text
//! and the voice are checked here, before anything is queued, so a bad request is answered at
//! once), then submits it with [`Front::submit`]: refused at once with [`Refused::Full`] when
//! `queue_length` jobs already wait ("busy"), never queued without bound. Its audio goes into
//! the client's own sink ([`Front::raw_sink`], [`Front::wav_sink`]) or out of the device
//! ([`Front::play`]). Every job has its own cancel handle ([`JobHandle::cancel`]): a client that
//! goes away cancels its job, and the next one starts cleanly.
//!
//! [`Slot`] holds the front while the model loads, so a front-end can listen (and say
//! "loading") before it is ready.

use std::io::Write;
use std::sync::{Arc, OnceLock};

use board::audio::{AlsaSink, AudioSink, RawSink, WavSink};
use engine::prompt::{PromptError, Prompter};
use engine::{Manifest, Request};

use crate::cancel::Stop;
use crate::device::{DeviceHealth, NoDevice};
use crate::live::{Live, LiveSettings};
use crate::output::Target;
use crate::queue::{JobHandle, Queue, Refused};
use crate::speaker::{Job, JobError, Reading, Speaker, Voice, check};

/// One voice a client may ask for: a speaker of the bundle and the languages it speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoiceInfo {
    /// The speaker's name in the bundle's `[speakers]`, or [`DEFAULT_VOICE`] for a bundle
    /// without speakers.
    pub name: String,
    /// The languages of the bundle's `[languages]` this voice speaks (a dialect speaker only
    /// its dialect, `speaker_dialects`; every other speaker all of them).
    pub languages: Vec<String>,
}

/// The voice name that means "the configured voice" (`synthesis.speaker`, or none), and the
/// only voice of a bundle without speakers.
pub const DEFAULT_VOICE: &str = "default";

/// A request a front-end cannot take; the text names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The text is longer than `serve.max_text_chars`.
    #[error("text is {chars} characters long; the limit is {limit} characters (serve.max_text_chars)")]
    TooLong {
        /// Unicode scalar values in the text.
        chars: usize,
        /// The limit.
        limit: usize,
    },
    /// The voice is not one of the bundle's.
    #[error("unknown voice {given:?}; voices: {allowed}")]
    UnknownVoice {
        /// What was asked for.
        given: String,
        /// The voices, comma-separated.
        allowed: String,
    },
    /// The text or the language cannot be spoken with this bundle.
    #[error(transparent)]
    Prompt(#[from] PromptError),
}

/// The settings of the network front-ends that the service layer needs.
#[derive(Debug, Clone)]
pub struct FrontSettings {
    /// Jobs that may wait besides the one in progress; beyond it a request is refused "busy".
    pub queue_length: usize,
    /// The longest text a request may carry, in characters (Unicode scalar values).
    pub max_text_chars: usize,
}

/// The loaded speaker as the network front-ends see it (see the module doc).
pub struct Front {
    queue: Queue,
    prompter: Arc<Prompter>,
    /// The voice, the outputs' settings and the text limit, which a reload may change.
    live: Live,
    /// The playback device's state, when herald plays ([`Front::watch_device`]).
    device: Option<DeviceHealth>,
    sample_rate: u32,
    voices: Vec<VoiceInfo>,
    languages: Vec<String>,
    model: String,
    stop: Stop,
    /// How texts are read (pause tags, segments), for the check before a job is queued.
    reading: Reading,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front").field("model", &self.model).field("voices", &self.voices).finish_non_exhaustive()
    }
}

impl Front {
    /// Move `speaker` onto its worker thread behind a queue of `settings.queue_length` waiting
    /// jobs, and describe its bundle for the front-ends.
    ///
    /// # Errors
    /// The worker thread could not be started.
    pub fn start(speaker: Speaker, settings: &FrontSettings) -> std::io::Result<Front> {
        let prompter = Arc::clone(&speaker.engine().bundle().prompter);
        let manifest = &speaker.engine().bundle().manifest;
        let (voices, languages) = catalog(manifest);
        let model = model_name(manifest);
        // the configuration's words for the voice, in the bundle's (`en` → `english`)
        let mut voice = speaker.settings().voice.clone();
        voice.language = bundle_language(&languages, &voice.language);
        voice.speaker = bundle_speaker(&voices, voice.speaker.as_deref());
        let output = speaker.settings().output.clone();
        let reading = speaker.settings().reading;
        let sample_rate = speaker.sample_rate();
        let stop = speaker.stop_handle().clone();
        let queue = speaker.start(settings.queue_length)?;
        let live = Live::new(LiveSettings { voice, output, max_text_chars: settings.max_text_chars, amp_lead: None });
        Ok(Front { queue, prompter, live, device: None, sample_rate, voices, languages, model, stop, reading })
    }

    /// Keep track of the playback device ([`DeviceHealth`]): [`play`](Self::play) then refuses
    /// at once while it is missing.
    pub fn watch_device(&mut self, device: DeviceHealth) {
        self.device = Some(device);
    }

    /// The playback device's state, when it is watched.
    pub fn device(&self) -> Option<&DeviceHealth> {
        self.device.as_ref()
    }

    /// The settings a reload may change ([`Live`]).
    pub fn live(&self) -> &Live {
        &self.live
    }

    /// `voice` in the bundle's words (`en` → `english`, `default` → no speaker), checked: a
    /// language or speaker the bundle lacks would fail every job.
    ///
    /// # Errors
    /// [`PromptError::UnknownLanguage`] or [`PromptError::UnknownSpeaker`].
    pub fn bundle_voice(&self, voice: &Voice) -> Result<Voice, PromptError> {
        let mut voice = voice.clone();
        voice.language = bundle_language(&self.languages, &voice.language);
        voice.speaker = bundle_speaker(&self.voices, voice.speaker.as_deref());
        match check(&self.prompter, &voice.request("Hello."), &Reading::default()) {
            Err(e @ (PromptError::UnknownLanguage { .. } | PromptError::UnknownSpeaker { .. })) => Err(e),
            _ => Ok(voice),
        }
    }

    /// The queue, for front-ends that wait for room instead of refusing (the FIFO).
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The model's sample rate, Hz (24 000 for the 12 Hz models).
    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }

    /// The voices a client may ask for, in the bundle's order (name-sorted).
    pub fn voices(&self) -> &[VoiceInfo] {
        &self.voices
    }

    /// The bundle's languages (name-sorted; `auto` is always accepted besides them).
    pub fn languages(&self) -> &[String] {
        &self.languages
    }

    /// The model's name for clients: `qwen3-tts-<size>-<type>`, e.g. `qwen3-tts-0b6-base`.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The longest text a request may carry, characters.
    pub fn max_text_chars(&self) -> usize {
        self.live.get().max_text_chars
    }

    /// The process-wide stop (SIGINT/SIGTERM): a front-end stops accepting once it is set.
    pub fn stop_handle(&self) -> &Stop {
        &self.stop
    }

    /// The request for `text` in `voice` (a name from [`voices`](Self::voices), or `None` /
    /// [`DEFAULT_VOICE`] for the configured voice) and `language` (`None`: the configured one;
    /// `auto` or a bundle language), checked against the bundle before anything is queued.
    ///
    /// # Errors
    /// [`RequestError`]: too long, unknown voice, or what the prompt layout refuses (empty or
    /// blank text, unknown language).
    pub fn request(&self, text: &str, voice: Option<&str>, language: Option<&str>) -> Result<Request, RequestError> {
        let chars = text.chars().count();
        let live = self.live.get();
        if chars > live.max_text_chars {
            return Err(RequestError::TooLong { chars, limit: live.max_text_chars });
        }
        let mut request = live.voice.request(text);
        match voice.map(str::trim).filter(|v| !v.is_empty()) {
            None => {}
            Some(v) if v.eq_ignore_ascii_case(DEFAULT_VOICE) => {}
            Some(v) => {
                let Some(known) = self.voices.iter().find(|k| k.name.eq_ignore_ascii_case(v) && k.name != DEFAULT_VOICE) else {
                    return Err(RequestError::UnknownVoice { given: v.to_owned(), allowed: self.voice_names() });
                };
                request.speaker = Some(known.name.clone());
            }
        }
        if let Some(l) = language.map(str::trim).filter(|l| !l.is_empty()) {
            request.language = Some(self.language_name(l));
        }
        check(&self.prompter, &request, &self.reading)?;
        Ok(request)
    }

    /// Whether `text` has something to say once the text front-end has read it
    /// ([`crate::text::spoken`] with the configured options): a stream's piece of only emoji,
    /// a stray quote or only code has not.
    pub fn has_words(&self, text: &str) -> bool {
        engine::prompt::has_words(&crate::text::spoken(text, &self.live.get().voice.text))
    }

    /// The bundle's name for `language`: a name of its `[languages]` or `auto` as given (any
    /// case), else an ISO 639-1 code or a BCP 47 tag (`en`, `en-US`, `zh_CN`) mapped through
    /// [`LANGUAGE_CODES`] to a bundle language; anything else comes back lower-cased, for the
    /// prompt check to refuse with the list of languages.
    pub fn language_name(&self, language: &str) -> String {
        bundle_language(&self.languages, language)
    }

    /// The voices' names, comma-separated (for messages).
    pub fn voice_names(&self) -> String {
        let mut names: Vec<&str> = self.voices.iter().map(|v| v.name.as_str()).collect();
        if !names.contains(&DEFAULT_VOICE) {
            names.insert(0, DEFAULT_VOICE);
        }
        names.join(", ")
    }

    /// Queue `request` with its audio going into `sink` (not begun; the speaker begins it at
    /// the model rate) at `speed` (`None`: the configured `synthesis.speed`), calling
    /// `on_begin` just before synthesis starts. Refused at once when the queue is full or
    /// stopping.
    ///
    /// # Errors
    /// [`Refused`] (the job comes back in it).
    pub fn submit(
        &self,
        request: Request,
        sink: Box<dyn AudioSink + Send>,
        speed: Option<f32>,
        on_begin: impl FnOnce(&Request) + Send + 'static,
    ) -> Result<JobHandle, Refused> {
        let speed = speed.unwrap_or_else(|| self.live.get().voice.speed);
        self.queue.try_submit(Job::new(request, Target::Sink { sink, plays: false }).speed(speed).on_begin(on_begin))
    }

    /// Queue `request` to be played on the device's own output (ALSA, with the amplifier line
    /// around it) at `speed` (`None`: the configured `synthesis.speed`). Refused at once when
    /// the queue is full or stopping.
    ///
    /// # Errors
    /// [`Refused`].
    pub fn play(&self, request: Request, speed: Option<f32>) -> Result<JobHandle, Refused> {
        let live = self.live.get();
        let sink: Box<dyn AudioSink + Send> = Box::new(AlsaSink::new(live.output.alsa, live.output.shaper));
        let job = Job::new(request, Target::Sink { sink, plays: true }).speed(speed.unwrap_or(live.voice.speed));
        self.queue.try_submit(match live.amp_lead {
            Some(lead) => job.amp_lead(lead),
            None => job,
        })
    }

    /// Before [`play`](Self::play): whether the device is there ([`DeviceHealth::ready`]; always
    /// `Ok` when it is not watched).
    ///
    /// # Errors
    /// [`NoDevice`] while it cannot be opened.
    pub fn device_ready(&self) -> Result<(), NoDevice> {
        self.device.as_ref().map_or(Ok(()), DeviceHealth::ready)
    }

    /// After a job of [`play`](Self::play) ended: its device failure marks the device missing
    /// and comes back as [`NoDevice`] ([`DeviceHealth::note`]).
    pub fn note_played(&self, outcome: Result<(), &JobError>) -> Option<NoDevice> {
        self.device.as_ref().and_then(|d| d.note(outcome))
    }

    /// A sink writing headerless S16LE mono samples at the model rate to `w` (shaped like every
    /// other output: gain, silences, fades; the same bytes as `herald speak --raw`). `target`
    /// names it in error messages.
    pub fn raw_sink(&self, w: impl Write + Send + 'static, target: &str) -> Box<dyn AudioSink + Send> {
        Box::new(RawSink::new(w, target, self.live.get().output.shaper))
    }

    /// A sink writing a streaming 16-bit mono WAV (header with unknown sizes, never a seek) to
    /// `w`; the samples are those of [`raw_sink`](Self::raw_sink).
    pub fn wav_sink(&self, w: impl Write + Send + 'static, target: &str) -> Box<dyn AudioSink + Send> {
        Box::new(WavSink::stream(w, target, self.live.get().output.shaper))
    }

    /// A sink that encodes the audio as `codec` to `w` (`target` names it in messages), with
    /// the live shaping settings.
    pub fn encoded_sink(
        &self,
        codec: crate::encode::Codec,
        w: impl Write + Send + 'static,
        target: &str,
    ) -> Box<dyn AudioSink + Send> {
        Box::new(crate::encode::EncodedSink::new(codec, w, target, self.live.get().output.shaper))
    }
}

/// The front once the model is loaded: front-ends start listening before (they answer
/// "loading" meanwhile) and look here for every request.
#[derive(Debug, Clone, Default)]
pub struct Slot(Arc<OnceLock<Front>>);

impl Slot {
    /// An empty slot (the model is loading).
    pub fn new() -> Self {
        Self::default()
    }

    /// Put the loaded front in; a second call hands its front back.
    ///
    /// # Errors
    /// The front, when the slot was filled already.
    pub fn fill(&self, front: Front) -> Result<(), Box<Front>> {
        self.0.set(front).map_err(Box::new)
    }

    /// The front, once the model is loaded.
    pub fn get(&self) -> Option<&Front> {
        self.0.get()
    }
}

/// The ISO 639-1 code of each language name the Qwen3-TTS checkpoints use (their config's
/// `codec_language_id` keys); the Chinese dialects are Chinese. Wyoming clients (Home
/// Assistant) match voices by these codes.
pub const LANGUAGE_CODES: &[(&str, &str)] = &[
    ("chinese", "zh"),
    ("english", "en"),
    ("german", "de"),
    ("spanish", "es"),
    ("french", "fr"),
    ("italian", "it"),
    ("japanese", "ja"),
    ("korean", "ko"),
    ("portuguese", "pt"),
    ("russian", "ru"),
    ("beijing_dialect", "zh"),
    ("sichuan_dialect", "zh"),
];

/// The bundle's name for `language` (one vocabulary for the command line, the configuration,
/// HTTP and Wyoming): a name of `languages` (the bundle's `[languages]`) or `auto`, in any
/// case; else an ISO 639-1 code or a BCP 47 tag (`en`, `en-US`, `zh_CN`) mapped through
/// [`LANGUAGE_CODES`] to one of `languages`. Anything else comes back lower-cased, for the
/// prompt check to refuse with the list of languages.
pub fn bundle_language(languages: &[String], language: &str) -> String {
    let lower = language.trim().to_ascii_lowercase();
    if lower == "auto" || languages.contains(&lower) {
        return lower;
    }
    let primary = lower.split(['-', '_']).next().unwrap_or_default();
    LANGUAGE_CODES
        .iter()
        .find(|(name, code)| *code == primary && languages.iter().any(|l| l == name))
        .map(|(name, _)| (*name).to_owned())
        .unwrap_or(lower)
}

/// The bundle's name for `speaker` (the same vocabulary everywhere): `None`, empty or
/// [`DEFAULT_VOICE`] (any case) mean no speaker (the configured voice of a front-end, the
/// bundle's default for `speak`); a name of `voices` in any case is spelled as the bundle
/// spells it; anything else is kept, for the prompt check to refuse with the list.
pub fn bundle_speaker(voices: &[VoiceInfo], speaker: Option<&str>) -> Option<String> {
    let given = speaker.map(str::trim).filter(|s| !s.is_empty() && !s.eq_ignore_ascii_case(DEFAULT_VOICE))?;
    let known = voices.iter().find(|v| v.name != DEFAULT_VOICE && v.name.eq_ignore_ascii_case(given));
    Some(known.map_or_else(|| given.to_owned(), |v| v.name.clone()))
}

/// `request`'s language and speaker in the bundle's words ([`bundle_language`],
/// [`bundle_speaker`]): what `herald speak` takes from its flags and the configuration.
pub fn in_bundle_words(manifest: &Manifest, request: &mut Request) {
    let (voices, languages) = catalog(manifest);
    if let Some(l) = &request.language {
        request.language = Some(bundle_language(&languages, l));
    }
    request.speaker = bundle_speaker(&voices, request.speaker.as_deref());
}

/// The ISO 639-1 code of a bundle language name ([`LANGUAGE_CODES`]), or the name itself when
/// it has none.
pub fn language_code(name: &str) -> &str {
    LANGUAGE_CODES.iter().find(|(n, _)| *n == name).map_or(name, |(_, c)| c)
}

/// The voices and languages of `manifest` (see [`VoiceInfo`]).
pub fn catalog(manifest: &Manifest) -> (Vec<VoiceInfo>, Vec<String>) {
    let languages: Vec<String> = manifest.languages.keys().cloned().collect();
    let mut voices: Vec<VoiceInfo> = manifest
        .speakers
        .keys()
        .map(|name| VoiceInfo {
            name: name.clone(),
            languages: match manifest.speaker_dialects.get(name) {
                Some(dialect) => vec![dialect.clone()],
                None => languages.clone(),
            },
        })
        .collect();
    if voices.is_empty() {
        voices.push(VoiceInfo { name: DEFAULT_VOICE.into(), languages: languages.clone() });
    }
    (voices, languages)
}

/// The model's name for clients (see [`Front::model`]).
pub fn model_name(manifest: &Manifest) -> String {
    format!("qwen3-tts-{}-{}", manifest.model.size, manifest.model.kind).replace('_', "-")
}

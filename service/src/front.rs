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
//!
//! A voice name means the same everywhere (Wyoming's `voice.name`, HTTP's `voice`, the
//! configured `synthesis.speaker` of the FIFO and of `herald speak`): [`resolve_voice`] looks it
//! up among the bundle's speakers, then among the [`Aliases`] (`[voices.aliases]` over
//! [`BUILTIN_ALIASES`]), in any case.

use std::collections::BTreeMap;
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

/// The built-in aliases: OpenAI's six classic voice names, which OpenAI clients send (`alloy`
/// by default), onto the Qwen3-TTS CustomVoice speakers of a like character (the speakers as
/// the model card describes them): the male voices `echo` → `ryan` (dynamic), `fable` →
/// `aiden` (sunny, clear), `onyx` → `uncle_fu` (low, mellow); the female ones `nova` →
/// `vivian` (bright), `shimmer` → `serena` (warm, gentle), and the neutral `alloy` → `sohee`
/// (warm). One whose speaker the bundle lacks is not offered (the 0.6B and 1.7B CustomVoice
/// bundles have all six; a Base bundle none); `[voices.aliases]` overrides each of them.
pub const BUILTIN_ALIASES: &[(&str, &str)] =
    &[("alloy", "sohee"), ("echo", "ryan"), ("fable", "aiden"), ("nova", "vivian"), ("onyx", "uncle_fu"), ("shimmer", "serena")];

/// Another name for a voice ([`Aliases`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    /// The name a client uses (matched in any case), spelled as configured.
    pub name: String,
    /// The speaker it stands for, spelled as the bundle spells it; `None`: the configured
    /// voice (an alias of [`DEFAULT_VOICE`]).
    pub speaker: Option<String>,
    /// One of [`BUILTIN_ALIASES`], not the configuration's.
    pub builtin: bool,
}

/// The voice aliases in effect: the configuration's `[voices.aliases]` over
/// [`BUILTIN_ALIASES`], checked against the bundle's speakers, in name order. Cheap to clone
/// (shared).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Aliases(Arc<Vec<Alias>>);

/// An alias of `[voices.aliases]` that cannot be used with this bundle; the text names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AliasError {
    /// The alias points at a speaker the bundle does not have.
    #[error(
        "voices.aliases.{name} = {target:?}: the bundle has no speaker {target:?} (speakers: {speakers}; or \"default\", \
         the configured voice)"
    )]
    UnknownTarget {
        /// The alias.
        name: String,
        /// What it points at.
        target: String,
        /// The bundle's speakers, comma-separated.
        speakers: String,
    },
    /// The alias has the name of one of the bundle's speakers, which it would hide.
    #[error("voices.aliases.{name}: {speaker:?} is a speaker of the bundle, which an alias cannot hide; choose another name")]
    ShadowsSpeaker {
        /// The alias, as configured.
        name: String,
        /// The speaker, as the bundle spells it.
        speaker: String,
    },
    /// The alias is named `default` (any case), which means the configured voice.
    #[error("voices.aliases.{name}: \"default\" means the configured voice and cannot be an alias")]
    Reserved {
        /// The alias, as configured.
        name: String,
    },
    /// The alias's name is empty or has white space around it (a client's name is trimmed, so
    /// it could never be asked for).
    #[error("voices.aliases.{name:?}: an alias needs a name without white space around it")]
    BadName {
        /// The alias, as configured.
        name: String,
    },
    /// Two aliases whose names differ only in case (names are matched in any case).
    #[error("voices.aliases.{first} and voices.aliases.{second} differ only in case, and voice names are matched in any case")]
    Duplicate {
        /// The one first in name order.
        first: String,
        /// The other.
        second: String,
    },
}

impl Aliases {
    /// `user` (`[voices.aliases]`: alias → a speaker of `voices` in any case, or `default` for
    /// the configured voice) over [`BUILTIN_ALIASES`] (a user alias replaces the built-in one
    /// of the same name in any case), checked against `voices` (the bundle's, [`catalog`]). A
    /// built-in alias whose speaker the bundle lacks, or which has a speaker's name, is left
    /// out; a user alias that cannot be used is an error.
    ///
    /// # Errors
    /// [`AliasError`]: the first alias of `user` (in name order) that points at no speaker,
    /// hides a speaker, is named `default`, has a blank name or one only the case of another
    /// tells apart.
    pub fn new(voices: &[VoiceInfo], user: &BTreeMap<String, String>) -> Result<Aliases, AliasError> {
        let speaker = |name: &str| voices.iter().find(|v| v.name != DEFAULT_VOICE && v.name.eq_ignore_ascii_case(name.trim()));
        let mut list: Vec<Alias> = Vec::new();
        for (name, target) in user {
            if name.trim().is_empty() || name.trim() != name {
                return Err(AliasError::BadName { name: name.clone() });
            }
            if name.eq_ignore_ascii_case(DEFAULT_VOICE) {
                return Err(AliasError::Reserved { name: name.clone() });
            }
            if let Some(s) = speaker(name) {
                return Err(AliasError::ShadowsSpeaker { name: name.clone(), speaker: s.name.clone() });
            }
            if let Some(other) = list.iter().find(|a| a.name.eq_ignore_ascii_case(name)) {
                return Err(AliasError::Duplicate { first: other.name.clone(), second: name.clone() });
            }
            let speaker = if target.trim().eq_ignore_ascii_case(DEFAULT_VOICE) {
                None
            } else {
                match speaker(target) {
                    Some(s) => Some(s.name.clone()),
                    None => {
                        return Err(AliasError::UnknownTarget {
                            name: name.clone(),
                            target: target.clone(),
                            speakers: speaker_names(voices),
                        });
                    }
                }
            };
            list.push(Alias { name: name.clone(), speaker, builtin: false });
        }
        for (name, target) in BUILTIN_ALIASES {
            if list.iter().any(|a| a.name.eq_ignore_ascii_case(name)) || speaker(name).is_some() {
                continue;
            }
            if let Some(s) = speaker(target) {
                list.push(Alias { name: (*name).to_owned(), speaker: Some(s.name.clone()), builtin: true });
            }
        }
        list.sort_by(|a, b| a.name.to_lowercase().cmp(&b.name.to_lowercase()).then_with(|| a.name.cmp(&b.name)));
        Ok(Aliases(Arc::new(list)))
    }

    /// The built-in aliases that `voices` (the bundle's) can offer: [`Aliases::new`] without a
    /// configuration.
    pub fn builtin(voices: &[VoiceInfo]) -> Aliases {
        Aliases::new(voices, &BTreeMap::new()).unwrap_or_default()
    }

    /// The alias named `name` (trimmed, any case).
    pub fn get(&self, name: &str) -> Option<&Alias> {
        let name = name.trim();
        self.0.iter().find(|a| a.name.eq_ignore_ascii_case(name))
    }

    /// The aliases, in name order.
    pub fn iter(&self) -> std::slice::Iter<'_, Alias> {
        self.0.iter()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The bundle's speakers, comma-separated (`none` for a bundle without).
fn speaker_names(voices: &[VoiceInfo]) -> String {
    let names: Vec<&str> = voices.iter().filter(|v| v.name != DEFAULT_VOICE).map(|v| v.name.as_str()).collect();
    if names.is_empty() { "none".to_owned() } else { names.join(", ") }
}

/// What the voice name `name` means (the one lookup of every front-end and of `herald speak`):
/// `None`, empty or [`DEFAULT_VOICE`] (any case) → `Ok(None)`, the configured voice; a speaker
/// of `voices` in any case → `Ok(Some)` of it, spelled as the bundle spells it; else an alias
/// of `aliases` in any case → what it stands for (a speaker, or `Ok(None)` for an alias of
/// `default`). A speaker's name wins over an alias's ([`Aliases::new`] refuses such an alias
/// anyway).
///
/// # Errors
/// [`RequestError::UnknownVoice`], naming `name` and every name that is allowed
/// ([`voice_names`]).
pub fn resolve_voice(voices: &[VoiceInfo], aliases: &Aliases, name: Option<&str>) -> Result<Option<String>, RequestError> {
    let Some(given) = name.map(str::trim).filter(|v| !v.is_empty() && !v.eq_ignore_ascii_case(DEFAULT_VOICE)) else {
        return Ok(None);
    };
    if let Some(known) = voices.iter().find(|v| v.name != DEFAULT_VOICE && v.name.eq_ignore_ascii_case(given)) {
        return Ok(Some(known.name.clone()));
    }
    match aliases.get(given) {
        Some(alias) => Ok(alias.speaker.clone()),
        None => Err(RequestError::UnknownVoice { given: given.to_owned(), allowed: voice_names(voices, aliases) }),
    }
}

/// The names a request may give, for messages: `default`, the speakers, then the aliases with
/// what they stand for: `default, dylan, ryan; aliases: echo (ryan), kitchen (default)`.
pub fn voice_names(voices: &[VoiceInfo], aliases: &Aliases) -> String {
    let mut names: Vec<&str> = voices.iter().map(|v| v.name.as_str()).collect();
    if !names.contains(&DEFAULT_VOICE) {
        names.insert(0, DEFAULT_VOICE);
    }
    let mut text = names.join(", ");
    if !aliases.is_empty() {
        let listed: Vec<String> =
            aliases.iter().map(|a| format!("{} ({})", a.name, a.speaker.as_deref().unwrap_or(DEFAULT_VOICE))).collect();
        text.push_str("; aliases: ");
        text.push_str(&listed.join(", "));
    }
    text
}

/// One name a client may ask for, as the listings show it (Wyoming `describe`, `GET
/// /v1/audio/voices`): a speaker of the bundle, or an alias.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The name to ask for.
    pub name: String,
    /// For an alias, what it stands for: a speaker, or [`DEFAULT_VOICE`] (the configured
    /// voice); `None` for a speaker.
    pub alias_of: Option<String>,
    /// The languages of the bundle's `[languages]` it speaks (an alias: those of its speaker;
    /// of `default`: those of the configured speaker, or all).
    pub languages: Vec<String>,
}

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
    /// The voice aliases ([`Aliases::new`] of the bundle's voices, [`catalog`]).
    pub aliases: Aliases,
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
        voice.speaker = bundle_speaker(&voices, &settings.aliases, voice.speaker.as_deref());
        let output = speaker.settings().output.clone();
        let reading = speaker.settings().reading;
        let sample_rate = speaker.sample_rate();
        let stop = speaker.stop_handle().clone();
        let queue = speaker.start(settings.queue_length)?;
        let live = Live::new(LiveSettings {
            voice,
            aliases: settings.aliases.clone(),
            output,
            max_text_chars: settings.max_text_chars,
            amp_lead: None,
        });
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

    /// `voice` in the bundle's words (`en` → `english`, `default` → no speaker, an alias of
    /// `aliases` → its speaker), checked: a language or speaker the bundle lacks would fail
    /// every job.
    ///
    /// # Errors
    /// [`PromptError::UnknownLanguage`] or [`PromptError::UnknownSpeaker`].
    pub fn bundle_voice(&self, voice: &Voice, aliases: &Aliases) -> Result<Voice, PromptError> {
        let mut voice = voice.clone();
        voice.language = bundle_language(&self.languages, &voice.language);
        voice.speaker = bundle_speaker(&self.voices, aliases, voice.speaker.as_deref());
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

    /// The bundle's voices, in its order (name-sorted): its speakers, or [`DEFAULT_VOICE`]
    /// alone. The [`aliases`](Self::aliases) are other names for them.
    pub fn voices(&self) -> &[VoiceInfo] {
        &self.voices
    }

    /// The voice aliases now (a reload may change them).
    pub fn aliases(&self) -> Aliases {
        self.live.read(|l| l.aliases.clone())
    }

    /// What the voice name `voice` means now ([`resolve_voice`] with the bundle's voices and
    /// the aliases now): `Ok(None)` is the configured voice.
    ///
    /// # Errors
    /// [`RequestError::UnknownVoice`], naming every name that is allowed.
    pub fn resolve_voice(&self, voice: Option<&str>) -> Result<Option<String>, RequestError> {
        self.live.read(|l| resolve_voice(&self.voices, &l.aliases, voice))
    }

    /// Every name a client may ask for, for the listings: the bundle's voices, then the
    /// aliases (see [`Listed`]).
    pub fn listing(&self) -> Vec<Listed> {
        let (aliases, configured) = self.live.read(|l| (l.aliases.clone(), l.voice.speaker.clone()));
        let languages_of = |speaker: Option<&str>| {
            speaker
                .and_then(|s| self.voices.iter().find(|v| v.name == s))
                .map_or_else(|| self.languages.clone(), |v| v.languages.clone())
        };
        let mut out: Vec<Listed> =
            self.voices.iter().map(|v| Listed { name: v.name.clone(), alias_of: None, languages: v.languages.clone() }).collect();
        out.extend(aliases.iter().map(|a| Listed {
            name: a.name.clone(),
            alias_of: Some(a.speaker.clone().unwrap_or_else(|| DEFAULT_VOICE.to_owned())),
            languages: languages_of(a.speaker.as_deref().or(configured.as_deref())),
        }));
        out
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
        if let Some(speaker) = resolve_voice(&self.voices, &live.aliases, voice)? {
            request.speaker = Some(speaker);
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

    /// The names a request may give, for messages ([`voice_names`] with the aliases now).
    pub fn voice_names(&self) -> String {
        self.live.read(|l| voice_names(&self.voices, &l.aliases))
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

/// The bundle's name for the configured `speaker` (the same vocabulary everywhere,
/// [`resolve_voice`]): `None`, empty or [`DEFAULT_VOICE`] (any case) mean no speaker (the
/// configured voice of a front-end, the bundle's default for `speak`); a name of `voices` in any
/// case is spelled as the bundle spells it; an alias of `aliases` is its speaker (or none, for
/// an alias of `default`); anything else is kept, for the prompt check to refuse with the
/// list.
pub fn bundle_speaker(voices: &[VoiceInfo], aliases: &Aliases, speaker: Option<&str>) -> Option<String> {
    resolve_voice(voices, aliases, speaker).unwrap_or_else(|_| speaker.map(|s| s.trim().to_owned()))
}

/// `request`'s language and speaker in the bundle's words ([`bundle_language`],
/// [`bundle_speaker`] with `aliases`): what `herald speak` takes from its flags and the
/// configuration.
pub fn in_bundle_words(manifest: &Manifest, aliases: &Aliases, request: &mut Request) {
    let (voices, languages) = catalog(manifest);
    if let Some(l) = &request.language {
        request.language = Some(bundle_language(&languages, l));
    }
    request.speaker = bundle_speaker(&voices, aliases, request.speaker.as_deref());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny bundle's voices: every speaker speaks english and chinese, a dialect speaker its
    /// dialect.
    fn voices(names: &[&str]) -> Vec<VoiceInfo> {
        names
            .iter()
            .map(|n| VoiceInfo {
                name: (*n).into(),
                languages: if *n == "dylan" { vec!["beijing_dialect".into()] } else { vec!["chinese".into(), "english".into()] },
            })
            .collect()
    }

    fn tiny() -> Vec<VoiceInfo> {
        voices(&["dylan", "eric", "ryan", "serena", "vivian"])
    }

    fn user(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(a, v)| ((*a).to_owned(), (*v).to_owned())).collect()
    }

    fn listed(a: &Aliases) -> Vec<(String, Option<String>, bool)> {
        a.iter().map(|a| (a.name.clone(), a.speaker.clone(), a.builtin)).collect()
    }

    fn alias(name: &str, speaker: Option<&str>, builtin: bool) -> (String, Option<String>, bool) {
        (name.to_owned(), speaker.map(str::to_owned), builtin)
    }

    #[test]
    fn built_in_aliases_are_offered_where_the_bundle_has_their_speakers() {
        // the tiny bundle lacks sohee, aiden and uncle_fu
        let a = Aliases::builtin(&tiny());
        assert_eq!(
            listed(&a),
            [alias("echo", Some("ryan"), true), alias("nova", Some("vivian"), true), alias("shimmer", Some("serena"), true)]
        );
        // a CustomVoice bundle's nine speakers: all six
        let full = voices(&["aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian"]);
        let names: Vec<String> = Aliases::builtin(&full).iter().map(|a| a.name.clone()).collect();
        assert_eq!(names, ["alloy", "echo", "fable", "nova", "onyx", "shimmer"]);
        // a bundle without speakers (Base): none
        assert!(Aliases::builtin(&voices(&[DEFAULT_VOICE])).is_empty());
        // a speaker of the same name wins over a built-in alias
        let a = Aliases::builtin(&voices(&["nova", "ryan", "vivian"]));
        assert_eq!(listed(&a), [alias("echo", Some("ryan"), true)]);
    }

    #[test]
    fn user_aliases_override_the_built_in_ones_and_take_any_case() {
        let a = Aliases::new(&tiny(), &user(&[("Kitchen", "VIVIAN"), ("ECHO", "serena"), ("hall", "Default")])).unwrap();
        assert_eq!(
            listed(&a),
            [
                alias("ECHO", Some("serena"), false),
                alias("hall", None, false),
                alias("Kitchen", Some("vivian"), false),
                alias("nova", Some("vivian"), true),
                alias("shimmer", Some("serena"), true),
            ]
        );
        assert_eq!(a.get(" kitchen ").map(|a| a.name.as_str()), Some("Kitchen"));
        assert_eq!(a.get("Echo").and_then(|a| a.speaker.as_deref()), Some("serena"));
        assert!(a.get("alloy").is_none());
    }

    #[test]
    fn aliases_the_bundle_cannot_serve_are_errors_naming_the_key() {
        let err = |pairs: &[(&str, &str)]| Aliases::new(&tiny(), &user(pairs)).unwrap_err().to_string();
        assert_eq!(
            err(&[("kitchen", "vivan")]),
            "voices.aliases.kitchen = \"vivan\": the bundle has no speaker \"vivan\" (speakers: dylan, eric, ryan, serena, \
             vivian; or \"default\", the configured voice)"
        );
        // an alias of an alias is no speaker either
        assert!(err(&[("kitchen", "nova")]).starts_with("voices.aliases.kitchen = \"nova\": the bundle has no speaker"));
        assert_eq!(
            err(&[("Ryan", "vivian")]),
            "voices.aliases.Ryan: \"ryan\" is a speaker of the bundle, which an alias cannot hide; choose another name"
        );
        assert_eq!(
            err(&[("DEFAULT", "ryan")]),
            "voices.aliases.DEFAULT: \"default\" means the configured voice and cannot be an alias"
        );
        assert_eq!(err(&[(" hall", "ryan")]), "voices.aliases.\" hall\": an alias needs a name without white space around it");
        assert_eq!(err(&[("", "ryan")]), "voices.aliases.\"\": an alias needs a name without white space around it");
        assert_eq!(
            err(&[("Hall", "ryan"), ("hall", "eric")]),
            "voices.aliases.Hall and voices.aliases.hall differ only in case, and voice names are matched in any case"
        );
        // a bundle without speakers: only `default`
        let base = voices(&[DEFAULT_VOICE]);
        assert!(Aliases::new(&base, &user(&[("hall", "default")])).is_ok());
        let e = Aliases::new(&base, &user(&[("hall", "ryan")])).unwrap_err().to_string();
        assert!(e.contains("(speakers: none;"), "{e}");
    }

    #[test]
    fn a_voice_name_resolves_the_same_way_everywhere() {
        let v = tiny();
        let a = Aliases::new(&v, &user(&[("kitchen", "vivian"), ("hall", "default")])).unwrap();
        let r = |name: Option<&str>| resolve_voice(&v, &a, name).map_err(|e| e.to_string());
        // the configured voice
        for name in [None, Some(""), Some("  "), Some("default"), Some("Default"), Some("hall"), Some("HALL")] {
            assert_eq!(r(name), Ok(None), "{name:?}");
        }
        // a speaker, in any case, spelled as the bundle spells it
        assert_eq!(r(Some(" Ryan ")), Ok(Some("ryan".into())));
        // an alias, in any case: its speaker
        assert_eq!(r(Some("KITCHEN")), Ok(Some("vivian".into())));
        assert_eq!(r(Some("echo")), Ok(Some("ryan".into())));
        // unknown: named, with everything that is allowed
        assert_eq!(
            r(Some("alloy")),
            Err("unknown voice \"alloy\"; voices: default, dylan, eric, ryan, serena, vivian; aliases: echo (ryan), hall \
                 (default), kitchen (vivian), nova (vivian), shimmer (serena)"
                .into())
        );
        // the configured speaker and `herald speak --speaker`: the same, an unknown name kept for
        // the prompt check's message
        assert_eq!(bundle_speaker(&v, &a, Some("Kitchen")), Some("vivian".into()));
        assert_eq!(bundle_speaker(&v, &a, Some("hall")), None);
        assert_eq!(bundle_speaker(&v, &a, Some("nobody ")), Some("nobody".into()));
        // no aliases: the speakers alone
        assert_eq!(voice_names(&v, &Aliases::default()), "default, dylan, eric, ryan, serena, vivian");
        assert_eq!(voice_names(&voices(&[DEFAULT_VOICE]), &Aliases::default()), "default");
    }
}

//! herald's configuration (reference: docs/config.md).
//!
//! Sources, lowest to highest precedence: built-in defaults < the config file < `HERALD_*`
//! environment variables < command-line flags. [`Config::load`] applies the first three; the
//! binary applies its flags afterwards with [`Config::apply_cli`] (or [`Config::set`]).
//!
//! Every key is declared once, in the `settings!` table below: its section and name, Rust type,
//! default, rule (range, allowed names, non-empty, …), the [`CliOverrides`] field and the flag
//! that set it, and its doc comment. The section structs, their defaults, [`CliOverrides`], the
//! environment variable names (`HERALD_<SECTION>_<KEY>`), parsing of the file, the environment
//! and `--set`, the checks, `herald config`'s output and docs/config.md's example and key tables
//! are all made from that table. **To add a key, add one entry there**; then refresh the docs
//! with `HERALD_TEST_BLESS=1 cargo test --workspace config::tests::docs_are_generated` (the test
//! fails while docs/config.md differs from the table), and give a command a flag in main.rs if
//! it should have one.
//!
//! Every value goes through one path: a source produces raw values ([`Raw`]: the file through
//! toml, the environment and `--set` from text, the command line from [`CliOverrides`]), and
//! `Config::merge` checks each with its key's rule and records where it came from, so that an
//! error names the source (file and line, variable, command line), the key, the value and what
//! is allowed.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::ops::{Range, RangeInclusive};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The config file read when neither `--config` nor `HERALD_CONFIG` names one (if it exists).
pub const DEFAULT_PATH: &str = "/etc/herald/herald.toml";
/// Default `model.bundle`.
pub const DEFAULT_BUNDLE: &str = "/usr/share/herald/bundles/default";
/// Default `model.bundles_dir`: the folder of [`DEFAULT_BUNDLE`].
pub const DEFAULT_BUNDLES_DIR: &str = "/usr/share/herald/bundles";
/// Environment variable naming the config file (like `--config`, which wins over it).
pub const CONFIG_ENV: &str = "HERALD_CONFIG";
/// `HERALD_*` variables that are not settings but are used by herald or its tooling, so that
/// they are not rejected as unknown settings.
pub const ENV_ALLOWED: &[&str] = &[CONFIG_ENV, "HERALD_HW_PROFILE", "HERALD_PYTHON", "HERALD_Q4_KERNEL", "HERALD_Q4_SPLIT"];
/// Prefixes of `HERALD_*` variables that are not settings (test hooks).
pub const ENV_ALLOWED_PREFIXES: &[&str] = &["HERALD_TEST_"];

/// `audio.volume`: linear gain.
pub const VOLUME: RangeInclusive<f64> = 0.0..=2.0;
/// `audio.leading_silence_ms` and `audio.trailing_silence_ms`.
pub const SILENCE_MS: RangeInclusive<u32> = 0..=5000;
/// `audio.fade_ms`.
pub const FADE_MS: RangeInclusive<u32> = 0..=100;
/// `audio.period_ms`.
pub const PERIOD_MS: RangeInclusive<u32> = 5..=200;
/// `audio.buffer_periods`.
pub const BUFFER_PERIODS: RangeInclusive<u32> = 2..=32;
/// Each entry of `synthesis.ramp`, in frames.
pub const RAMP_FRAMES: RangeInclusive<usize> = 1..=256;
/// Number of entries of `synthesis.ramp`.
pub const RAMP_LEN: RangeInclusive<usize> = 1..=32;
/// `synthesis.left_context`, in frames.
pub const LEFT_CONTEXT: RangeInclusive<usize> = 1..=512;
/// `synthesis.kv_capacity`, in positions.
pub const KV_CAPACITY: RangeInclusive<usize> = 64..=65536;
/// `synthesis.seed` (a TOML integer is an i64, so seeds stop at `i64::MAX`).
pub const SEED: RangeInclusive<u64> = 0..=(i64::MAX as u64);
/// `runtime.threads` (0 = derived from the board, stages pinned; see tuning.rs).
pub const THREADS: RangeInclusive<usize> = 0..=256;
/// `runtime.frame_pool_mib`: MiB each worker stage's frame pool may keep.
pub const FRAME_POOL_MIB: RangeInclusive<usize> = 0..=65536;
/// Default `runtime.frame_pool_mib` (engine::DEFAULT_POOL_BYTES).
pub const DEFAULT_FRAME_POOL_MIB: usize = engine::DEFAULT_POOL_BYTES >> 20;
/// Default `runtime.graph_cache_dir`.
pub const DEFAULT_GRAPH_CACHE_DIR: &str = "/var/cache/herald/graphs";
/// Default `runtime.calibration_dir`.
pub const DEFAULT_CALIBRATION_DIR: &str = "/var/lib/herald/calibration";
/// `serve.queue_length`: jobs that may wait besides the one in progress.
pub const QUEUE_LENGTH: RangeInclusive<usize> = 1..=64;
/// `serve.max_connections`: connections per network front-end.
pub const MAX_CONNECTIONS: RangeInclusive<usize> = 1..=1024;
/// `serve.max_text_chars`: up to the longest text herald reads
/// (`engine::segment::MAX_LONG_TEXT_CHARS`).
pub const MAX_TEXT_CHARS: RangeInclusive<usize> = 1..=engine::segment::MAX_LONG_TEXT_CHARS;
/// `synthesis.segment_tokens`: from a few words to the hard limit of the largest KV capacity.
pub const SEGMENT_TOKENS: RangeInclusive<usize> = 8..=5000;
/// `synthesis.segment_pause_ms`: up to 5 s.
pub const SEGMENT_PAUSE_MS: RangeInclusive<u32> = 0..=5000;
/// `synthesis.speed`: OpenAI's range (also WSOLA's, `service::stretch`).
pub const SPEED: RangeInclusive<f64> = 0.25..=4.0;
/// `synthesis.sentence_pause_ms`: up to 5 s, as between segments.
pub const SENTENCE_PAUSE_MS: RangeInclusive<u32> = 0..=5000;
/// `synthesis.max_start_delay_ms`: up to 60 s.
pub const MAX_START_DELAY_MS: RangeInclusive<u32> = 0..=60_000;
/// `serve.request_timeout_s`.
pub const REQUEST_TIMEOUT_S: RangeInclusive<u32> = 1..=600;
/// `serve.idle_timeout_s`.
pub const IDLE_TIMEOUT_S: RangeInclusive<u32> = 1..=86_400;
/// The FIFO `herald serve` reads by default (`serve.fifo`; in the systemd unit's
/// `RuntimeDirectory=herald`).
pub const DEFAULT_FIFO: &str = "/run/herald/say";
/// Default `serve.wyoming`: the port Home Assistant's Wyoming integration expects of a TTS
/// server (wyoming-piper's 10200), on loopback.
pub const DEFAULT_WYOMING: &str = "tcp://127.0.0.1:10200";
/// Default `serve.http`: the port of Piper's HTTP server (5000), on loopback.
pub const DEFAULT_HTTP: &str = "127.0.0.1:5000";
/// `amplifier.line`: line offset within the chip.
pub const AMP_LINE: RangeInclusive<u32> = 0..=4095;
/// `amplifier.lead_ms`: how long before the first sample the amplifier is enabled.
pub const AMP_LEAD_MS: RangeInclusive<u32> = 0..=5000;

// ---------------------------------------------------------------------------------------------
// The declaration

/// Makes everything per key from the table below. One entry:
///
/// ```text
/// /// Doc comment: the field's rustdoc and docs/config.md's "What it does".
/// name: Type = default, rule [, cli FIELD] [, flag "--flag"];
/// ```
///
/// `Type` implements [`Setting`] (strings, paths, `f64`, `u32`, `u64`, `usize`, `Vec<usize>`,
/// the named enums, and `Option` of those), `rule` is a [`Rule`] for it: `NonEmpty("what")`,
/// `Any("what")`, `FsPath("what")`, `OneOf` (an enum's names), `Within(RANGE)`, `Ramp`, and
/// `Opt("what unset means", rule)` for an `Option`. `cli FIELD` adds `CliOverrides::FIELD`;
/// `flag` names the command-line flag that sets the key (for the docs; a test checks that a
/// command has it).
macro_rules! settings {
    (@opt) => { None };
    (@opt $x:expr) => { Some($x) };
    (@cli $ty:ty) => { |_: &CliOverrides| None };
    (@cli $ty:ty, $cli:ident) => { |o: &CliOverrides| o.$cli.as_ref().map(<$ty as Setting>::given) };
    ($(
        $(#[doc = $sdoc:literal])*
        $section:ident: $Section:ident {
            $(
                $(#[doc = $doc:literal])*
                $field:ident: $ty:ty = $default:expr, $rule:expr $(, cli $cli:ident)? $(, flag $flag:literal)?;
            )*
        }
    )*) => {
        $(
            #[doc = concat!("`[", stringify!($section), "]`:")]
            $(#[doc = $sdoc])*
            #[derive(Debug, Clone, PartialEq)]
            pub struct $Section {
                $(
                    $(#[doc = $doc])*
                    pub $field: $ty,
                )*
            }

            impl Default for $Section {
                fn default() -> Self {
                    $Section { $($field: $default,)* }
                }
            }
        )*

        /// The effective configuration.
        #[derive(Debug, Clone)]
        pub struct Config {
            $(
                #[doc = concat!("`[", stringify!($section), "]`.")]
                pub $section: $Section,
            )*
            /// The sources applied, in order: `defaults`, `file PATH`, `env HERALD_…` (one per
            /// variable), `command line`. For `herald info` and the startup log.
            pub source: Vec<String>,
            /// The config file that was read, if any.
            pub file: Option<PathBuf>,
            /// Where each key not at its default came from (`file:line`, `env HERALD_…`,
            /// `command line`).
            origins: BTreeMap<&'static str, String>,
        }

        impl Default for Config {
            fn default() -> Self {
                Config {
                    $($section: $Section::default(),)*
                    source: vec!["defaults".into()],
                    file: None,
                    origins: BTreeMap::new(),
                }
            }
        }

        /// Command-line overrides, applied last by [`Config::apply_cli`]. `None` leaves a value
        /// alone; for an optional key, `Some("")` clears it. Values are checked like every other
        /// source (`command line: audio.volume = 3.5 is out of …`).
        #[derive(Debug, Clone, Default)]
        pub struct CliOverrides {
            $($($(
                #[doc = concat!("`", stringify!($section), ".", stringify!($field), "`.")]
                pub $cli: Option<<$ty as Setting>::Given>,
            )?)*)*
        }

        /// The sections with their doc comments, in documentation order.
        static SECTIONS: &[(&str, &[&str])] = &[$((stringify!($section), &[$($sdoc),*]),)*];

        /// Every key, in documentation order.
        static SETTINGS: &[Key] = &[$($(
            Key {
                name: concat!(stringify!($section), ".", stringify!($field)),
                doc: &[$($doc),*],
                flag: settings!(@opt $($flag)?),
                shape: <$ty as Setting>::SHAPE,
                optional: <$ty as Setting>::OPTIONAL,
                doc_type: <$ty as Setting>::DOC_TYPE,
                set: |c: &mut Config, raw: Raw, base: Option<&Path>| {
                    c.$section.$field = checked(&$rule, raw, base)?;
                    Ok(())
                },
                get: |c: &Config| c.$section.$field.to_toml(),
                describe: || rule_doc::<$ty, _>(&$rule),
                cli: settings!(@cli $ty $(, $cli)?),
            },
        )*)*];
    };
}

settings! {
    /// The model bundle.
    model: ModelConfig {
        /// The model bundle directory (holds `bundle.toml`, see [bundle.md](bundle.md)).
        bundle: PathBuf = PathBuf::from(DEFAULT_BUNDLE), FsPath("non-empty path"), cli bundle, flag "--bundle";
        /// Where `herald bundle install` puts bundles (one folder each, named by the archive's
        /// index) and where `herald bundle list` and `remove` look ([bundle.md](bundle.md),
        /// "Bundle archives").
        bundles_dir: PathBuf = PathBuf::from(DEFAULT_BUNDLES_DIR), FsPath("a directory");
        /// Check the SHA-256 of every bundle file that `bundle.toml` gives one for (the tokenizer
        /// and the graphs) before loading, and refuse a bundle whose files were damaged or
        /// replaced (exit 4, naming the file). It reads every byte once: about 2 s for a 0.6B
        /// float32 bundle on a board with a fast SD card, more on a slow one. `herald info
        /// --verify` does the same check on demand.
        verify: bool = false, Flag;
    }

    /// The audio output: the ALSA device and how each utterance is shaped (gain, silences,
    /// fades) and buffered.
    audio: AudioConfig {
        /// The ALSA device: `default`, `hw:0,0`, `plughw:CARD=…,DEV=…`, a name from `asound.conf`.
        device: String = "default".into(), NonEmpty("non-empty ALSA PCM name"), cli device, flag "--device";
        /// Sample format written to the device: `s16` = signed 16-bit little-endian (`S16_LE`,
        /// every device takes it), `f32` = 32-bit float (`FLOAT_LE`).
        format: SampleFormat = SampleFormat::S16, OneOf, cli format;
        /// Linear gain applied to the samples: `1.0` leaves them as the model made them, `0.5` is
        /// about −6 dB, above `1.0` amplifies (samples are clipped at full scale). An integer such
        /// as `1` is accepted.
        volume: f64 = 1.0, Within(VOLUME), cli volume, flag "--volume";
        /// Silence played before each utterance, in milliseconds: gives amplifiers that power up
        /// with the stream time to wake, so the first syllable is not lost.
        leading_silence_ms: u32 = 0, Within(SILENCE_MS), cli leading_silence_ms;
        /// Silence played after each utterance, in milliseconds, before the stream is drained and
        /// closed.
        trailing_silence_ms: u32 = 0, Within(SILENCE_MS), cli trailing_silence_ms;
        /// Length of the fade-in at the start and the fade-out at the end (and when speech is
        /// cancelled), in milliseconds, so that no click is heard. `0` turns fading off.
        fade_ms: u32 = 5, Within(FADE_MS), cli fade_ms;
        /// ALSA period length in milliseconds: how much audio is handed to the device at a time.
        /// Shorter periods lower the latency and raise the wake-ups.
        period_ms: u32 = 20, Within(PERIOD_MS), cli period_ms;
        /// ALSA buffer length in periods (buffer = `period_ms` × `buffer_periods`, 80 ms by
        /// default). A longer buffer rides out scheduling hiccups at the price of latency.
        buffer_periods: u32 = 4, Within(BUFFER_PERIODS), cli buffer_periods;
    }

    /// How text becomes speech: language, voice, prompt mode, sampling, and the vocoder's chunk
    /// schedule and cache.
    synthesis: SynthesisConfig {
        /// The language of the text, as named in the bundle's `[languages]` (lower-case, e.g.
        /// `"english"`, `"chinese"`; `herald info` lists them). `auto` lets the model decide.
        /// Checked against the bundle when it is loaded.
        language: String = "auto".into(), NonEmpty("`\"auto\"` or a language of the bundle"), cli language,
            flag "--language";
        /// The voice, as named in the bundle's `[speakers]` (CustomVoice models; `herald info`
        /// lists them). To have no speaker, leave the key out (TOML has no null); an empty string,
        /// `speaker = ""` or `HERALD_SYNTHESIS_SPEAKER=`, also means no speaker, which lets the
        /// environment undo a speaker set in the file. Checked against the bundle when it is
        /// loaded.
        speaker: Option<String> = None, Opt("", Any("a speaker of the bundle")), cli speaker, flag "--speaker";
        /// How the text enters the model: `streaming` feeds it token by token as frames are
        /// produced (upstream's default; speech starts sooner), `non-streaming` puts the whole
        /// text in the prompt first.
        mode: SynthesisMode = SynthesisMode::Streaming, OneOf, cli mode, flag "--mode";
        /// `sample` draws codes with the bundle's sampling parameters (temperature, top-k, top-p,
        /// repetition penalty from its `[sampling]`), as the official model does; `greedy` always
        /// takes the most likely code: deterministic without a seed, but often flat or stuck in
        /// loops. (`--seed` implies `sample`.)
        sampling: Sampling = Sampling::Sample, OneOf, cli sampling, flag "--greedy";
        /// Seed of the sampler (ignored with `greedy`). Not set: every utterance gets a fresh seed
        /// from the clock, and herald logs it (`seed=…`, at `info`), so that a run can be
        /// reproduced by setting `seed` to the logged value. Set: every utterance uses this seed,
        /// so the same text gives the same audio. The upper limit is TOML's largest integer.
        /// `HERALD_SYNTHESIS_SEED=` (empty) unsets it.
        seed: Option<u64> = None, Opt("a fresh seed per utterance", Within(SEED)), cli seed, flag "--seed";
        /// Sizes, in frames (one frame = 80 ms of audio), of the chunks the vocoder turns into
        /// sound; the last size repeats. Small first chunks start the audio sooner; with the
        /// windowed vocoder larger later chunks cost less (each chunk decodes its left context
        /// again). The default applies to the windowed vocoder: the stateful vocoder decodes each
        /// frame once whatever the chunk, so when the ramp is not set it takes chunks of 2 frames
        /// throughout (`[2]`): the vocoder keeps pace with the decoder instead of waiting for a
        /// large chunk, and the end of an utterance does not wait for one (docs/performance.md).
        /// When it is not set anywhere, `herald calibrate`'s schedule for this
        /// board is used if one is stored (`runtime.calibration_dir`). In a variable:
        /// comma-separated, `2,4,8` (brackets allowed).
        ramp: Vec<usize> = vec![2, 4, 8, 16, 25], Ramp, cli ramp;
        /// How the vocoder turns chunks of frames into sound. `stateful`: each chunk is decoded
        /// once, the decoder's state carried from the previous chunk; the result equals decoding
        /// the whole utterance at once, and a chunk costs in proportion to its length (needs a
        /// bundle with a stream graph, docs/bundle.md). `windowed`: each chunk is decoded again
        /// together with `left_context` frames before it (several times the work, close to but not
        /// exactly seamless). `auto`: `stateful` when the bundle has a stream graph, else
        /// `windowed`.
        vocoder: VocoderChoice = VocoderChoice::Auto, OneOf, cli vocoder;
        /// Frames of already-played audio the windowed vocoder sees before each chunk, so that
        /// chunk borders are seamless. Less is faster and may be audible at the borders. The
        /// stateful vocoder needs none and ignores it.
        left_context: usize = 72, Within(LEFT_CONTEXT), cli left_context;
        /// The most positions the talker's KV cache may hold (prompt + frames); the cache grows by
        /// doubling up to it (docs/engine.md), and herald lowers it to what fits in this board's
        /// memory. It bounds the length of an utterance (4096 positions ≈ 5 minutes of speech) and
        /// the memory use (`herald info` prints the cost per position).
        kv_capacity: usize = 4096, Within(KV_CAPACITY), cli kv_capacity;
        /// A long text is read in segments, cut at sentence boundaries (paragraphs, then `.` `!`
        /// `?` `;` `。` `！` `？` and the like, never inside `45.6` or after `Mr.`; clauses, words
        /// and characters only for a sentence too long for the KV cache; the rules are in
        /// [reliability.md](reliability.md#long-texts)), spoken back to back into one output.
        /// Sentences are packed into one segment up to this many text tokens; a text within it
        /// is spoken in one pass. No segment is longer than what `kv_capacity` can hold
        /// (`(kv_capacity - 56) / 11` tokens: 367 at 4096), whatever this says.
        segment_tokens: usize = engine::segment::DEFAULT_SEGMENT_TOKENS, Within(SEGMENT_TOKENS);
        /// Speaking speed: `1.0` as the model speaks, `2.0` twice as fast, `0.5` half as fast
        /// (0.25 to 4.0, OpenAI's range), with the pitch kept: a time stretch (WSOLA) of the
        /// audio as it is made, about 45 ms held back. HTTP's `speed` overrides it per request.
        /// At `1.0` the audio is untouched. The start policy plans as for `1.0`: above it a
        /// board must be that much faster than real time not to pause.
        speed: f64 = 1.0, Within(SPEED), cli speed, flag "--speed";
        /// Milliseconds of silence between two segments of a long text.
        segment_pause_ms: u32 = 250, Within(SEGMENT_PAUSE_MS);
        /// Milliseconds of silence between two sentences (Piper's `sentence_silence`). `0`:
        /// sentences flow as the model reads them (packed into segments as above; the output is
        /// what it was before this key existed). Above 0, each sentence is spoken on its own
        /// and this much silence follows it, in every text: a sentence ends where a long text's
        /// segments may end (`.` `!` `?` `;` `。` and the like, paragraphs). A pause tag in the
        /// text (`[pause:800ms]`, [the text front-end](#pause-tags)) adds its own.
        sentence_pause_ms: u32 = 0, Within(SENTENCE_PAUSE_MS);
        /// When playback starts on a device. `play-through`: once the audio already made plus
        /// what will be made while it plays covers the utterance (or, in a long text, the
        /// segment), predicted from the board's production rate (its calibration, then what the
        /// running utterance measures) and the text's length; a board faster than real time
        /// starts at the first audio, a slower one a little later and then plays without a gap,
        /// pausing at a segment boundary if it must ([engine.md](engine.md#playback-start)).
        /// `immediate`: at the first audio, as before (a board slower than real time stutters).
        /// Files, standard output and the audio sent to network clients are written at once.
        start_policy: StartPolicyChoice = StartPolicyChoice::PlayThrough, OneOf;
        /// The longest `play-through` waits before playback starts, in milliseconds from the
        /// request (Home Assistant's satellites give up on audio that has not started within
        /// 2-5 s). An utterance that needs longer starts at this budget and then pauses once,
        /// as briefly as the measured rate allows; a pause at a segment boundary is held to
        /// it too.
        max_start_delay_ms: u32 = 3000, Within(MAX_START_DELAY_MS);
    }

    /// Other names for the bundle's voices, for clients that ask for a voice by a name of their
    /// own: Home Assistant's voice picker (Wyoming), OpenAI clients, which send `alloy` and its
    /// siblings. Wherever a voice is named (Wyoming's `voice.name`, HTTP's `voice`,
    /// `synthesis.speaker`, `herald speak --speaker`) an alias means the same as the name it
    /// stands for, in any case; Wyoming's `describe` and `GET /v1/audio/voices` list the aliases
    /// with what they stand for ([the aliases](#voice-aliases)).
    voices: VoicesConfig {
        /// Alias → voice, as a table: `[voices.aliases]` with one `kitchen = "vivian"` a line.
        /// A voice is a speaker of the bundle (any case) or `"default"`, the configured voice
        /// (`synthesis.speaker`). Built in, where the bundle has the speaker: `alloy` → `sohee`,
        /// `echo` → `ryan`, `fable` → `aiden`, `nova` → `vivian`, `onyx` → `uncle_fu`, `shimmer`
        /// → `serena` (OpenAI's voice names; an alias here replaces the built-in one of its
        /// name: `alloy = "default"` makes OpenAI clients' default follow `synthesis.speaker`).
        /// Checked against the bundle when it is loaded: an alias of a speaker it lacks, one
        /// with a speaker's name, or one named `default` stops herald (exit 2, naming the key).
        /// In a variable: comma-separated, `kitchen=vivian,alloy=ryan` (braces and quotes
        /// allowed); empty: none.
        aliases: BTreeMap<String, String> = BTreeMap::new(), AliasTable;
    }

    /// The text front-end: what every text (the FIFO's lines, Wyoming and HTTP requests,
    /// `herald speak`) goes through before it is spoken, so that a language model's answer
    /// is read as a person would read it ([the text front-end](#the-text-front-end)).
    text: TextConfig {
        /// Whether the text is read as markdown: `auto` parses it as markdown only when it shows
        /// markdown's signs (a `# heading`, a `- ` or `1. ` list line, `**bold**`, `*emphasis*`,
        /// a code fence or `` `code` ``, a `[link](url)`, a `| table |` row, a `> quote`); `on`
        /// always; `off` never (the text is read as it is, the other rules still apply).
        /// Markdown is read as its words: headings, list items and table rows as sentences,
        /// links as their text; images, struck-out text, footnotes and HTML tags not at all.
        markdown: TextMarkdown = TextMarkdown::Auto, OneOf;
        /// `remove` takes emoji and pictographs out of the text (whole sequences: ZWJ
        /// sequences, skin tones, flags, keycaps, variation selectors, tags), `keep` leaves them
        /// to the model.
        emoji: TextEmoji = TextEmoji::Remove, OneOf;
        /// Markdown's code, fenced blocks and inline `` `code` ``: `skip` leaves it out, `read`
        /// reads it as text.
        code: TextCode = TextCode::Skip, OneOf;
        /// URLs and e-mail addresses: `host` reads a URL as its host
        /// (`https://www.example.com/a?b` → `example.com`) and an address as `name at
        /// example.com`; `skip` leaves both out; `keep` reads them as they are.
        urls: TextUrls = TextUrls::Host, OneOf;
        /// A file of replacement rules applied, in order, after the rules above
        /// ([format](#replacement-rules)): `TEXT => REPLACEMENT` or `/REGEX/ => REPLACEMENT`,
        /// one a line. Read and checked at start-up: a bad rule stops herald with exit code 2,
        /// naming the file and the line. `herald serve` reads it again on SIGHUP (a bad file
        /// then changes nothing). A relative path in a file is relative to that file's
        /// directory. Not set: no rules.
        replacements: Option<PathBuf> = None, Opt("no replacement rules", FsPath("a file"));
        /// Pause tags in a text (`[pause]`, `[pause:0.8s]`, `[pause:800ms]`: that much silence
        /// there, [details](#pause-tags)). `lenient`: a tag that does not parse
        /// (`[pause:2]`, `[pause:fast]`) is read as text. `strict`: it is refused as bad
        /// input, naming the tag (HTTP 400, a Wyoming `error`, exit 2).
        pause_tags: TextPauseTags = TextPauseTags::Lenient, OneOf;
    }

    /// Compute threads, the stored calibration and the memory pools.
    runtime: RuntimeConfig {
        /// Threads for the model computation. `0`: herald places the work itself (see
        /// [board.md](board.md)): the talker stage is pinned to two thirds of the big cores
        /// herald may use (its CPU affinity included; `herald probe` prints the sets), the
        /// vocoder stage to the rest (a single CPU is shared), and each stage computes with one
        /// thread per CPU of its set. `N`: no pinning, `N` compute threads shared by both stages
        /// (for experiments and benchmarks).
        threads: usize = 0, Within(THREADS), cli threads;
        /// Where `herald calibrate` stores this board's chunk schedule, one `<fingerprint>.json`
        /// per hardware + bundle pair (16 hex digits; `herald probe` prints the fingerprint).
        /// `speak` uses the file that matches when `synthesis.ramp` is not set explicitly, and
        /// says so in its log; a missing directory or file means the defaults, a corrupt or
        /// foreign file is ignored with one warning. A relative path in a file is relative to
        /// that file's directory.
        calibration_dir: PathBuf = PathBuf::from(DEFAULT_CALIBRATION_DIR), FsPath("a directory");
        /// Where the tract backend keeps each graph it has parsed, decluttered and stored as
        /// NNEF (one entry per graph and bundle), so that the next start skips reading and
        /// decluttering the ONNX files ([performance.md](performance.md#fast-start) measures
        /// what that saves). Entries are keyed by the graph file, the manifest's checksum and
        /// IO, and the herald build, so a stale entry is never used; a corrupt one is rebuilt
        /// with one warning; an unwritable directory costs the speed-up (one warning), never
        /// the start. Created on first use; deleting it is always safe.
        graph_cache_dir: PathBuf = PathBuf::from(DEFAULT_GRAPH_CACHE_DIR), FsPath("a directory");
        /// Which runtime runs the talker and the code predictor. `tract`: the CPU (the bundle's
        /// ONNX graphs). `qnn`: the Qualcomm NPU, from the bundle's QNN context binaries
        /// ([backend.md](backend.md)); a missing library, a bundle without binaries for
        /// `qnn_arch` or a binary that does not match stops herald (exit 4). `auto`: `qnn` on a
        /// board the probe calls `snapdragon_npu` when the bundle has binaries for it and the
        /// libraries load, else `tract` (the log says why); a QNN runtime that then fails to
        /// load the binaries under `auto` is logged in one line and tract loads instead. The
        /// vocoder runs on the CPU unless `qnn_vocoder` says `npu`.
        backend: BackendChoice = BackendChoice::Auto, OneOf, cli backend, flag "--backend";
        /// Where the vocoder runs when the `qnn` backend runs the talker and the code predictor.
        /// `cpu`: tract, as with the `tract` backend (the edge design measured the vocoder
        /// better off the NPU). `npu`: the bundle's vocoder context binaries (`export qnn
        /// --vocoder`, [backend.md](backend.md)), stateful only; with `backend = "qnn"` a bundle
        /// without them for `qnn_arch` stops herald (exit 4), under `auto` it keeps the backend
        /// on `tract`. Ignored when the backend is `tract`.
        qnn_vocoder: QnnVocoder = QnnVocoder::Cpu, OneOf;
        /// The arithmetic of the stateful vocoder's convolutions on the CPU (tract). `fp32`: as
        /// exported. `fp16`: float16 weights and activations in the convolutions (the rest
        /// float32), which halves their memory traffic and, on a core with half-precision
        /// arithmetic (Cortex-A55/A76/A78, Oryon: `herald probe` lists `fp16_arith`), runs them on
        /// twice the vector lanes; at load herald decodes 8 frames both ways and refuses to
        /// start (exit 4) when the fp16 samples' SNR against the float32 ones is below 30 dB
        /// (the load log gives the value; [backend.md](backend.md#the-vocoder-in-half-precision)).
        /// `auto`: `fp16` on a core with half-precision arithmetic, staying `fp32` (one
        /// warning) when the gate fails; `fp32` elsewhere. The gate costs one more vocoder plan
        /// and 8 frames decoded twice at each start. Ignored for the windowed vocoder and the
        /// NPU vocoder.
        vocoder_precision: VocoderPrecision = VocoderPrecision::Fp32, OneOf;
        /// The folder holding the board's `libQnnHtp.so` and `libQnnSystem.so` (the vendor's QNN
        /// runtime; herald does not ship it). Unset: `/usr/lib`,
        /// `/usr/lib64`, `/usr/lib/aarch64-linux-gnu`, `/usr/local/lib`, `/vendor/lib64`,
        /// `/odm/lib64` and `LD_LIBRARY_PATH`, in that order.
        qnn_lib_dir: Option<PathBuf> = None, Opt("the standard locations", FsPath("a directory"));
        /// The HTP architecture whose context binaries run (`v68`, `v73`, `v75`, `v79`:
        /// [backend.md](backend.md) lists each SoC's). Unset: the bundle's only one.
        qnn_arch: Option<String> = None, Opt("the bundle's only architecture", Any("an HTP architecture such as v73"));
        /// MiB of freed memory the decode stage and the vocoder stage may each keep for reuse
        /// (their frame pools, [engine.md](engine.md#allocations)): tract asks for thousands of
        /// blocks per frame, and a pool that holds a stage's working set serves them all without
        /// the system allocator (no lock, no page fault) once the stage is warm. A block above a
        /// quarter of this is never kept. More holds more of the vocoder's working set at the
        /// price of peak memory; `0` turns pooling off.
        frame_pool_mib: usize = DEFAULT_FRAME_POOL_MIB, Within(FRAME_POOL_MIB);
    }

    /// An optional GPIO line that enables the speaker amplifier: herald drives it active
    /// `lead_ms` before the first sample of an utterance and inactive once the audio has
    /// drained, so the amplifier is off (silent, cool, no hiss) between utterances. The chip is
    /// found by its label (`gpiodetect` lists them), never by number: numbers change between
    /// kernels (the Pi 5 header moved from `gpiochip4` to `gpiochip0` in 2024). A missing chip
    /// or line stops herald at start-up with exit code 3, before any synthesis.
    amplifier: AmplifierConfig {
        /// The label of the GPIO chip, e.g. `"pinctrl-rp1"` (Raspberry Pi 5 header),
        /// `"tegra234-gpio"` (Jetson Orin). Not set (or empty): no amplifier line.
        chip: Option<String> = None, Opt("no amplifier line", Any("a GPIO chip label"));
        /// The line offset within that chip (for the Pi 5 header: the BCM GPIO number).
        line: u32 = 0, Within(AMP_LINE);
        /// The level that enables the amplifier; `low` for an active-low enable or shutdown pin.
        active: ActiveLevel = ActiveLevel::High, OneOf;
        /// Milliseconds between enabling the amplifier and the first sample, for amplifiers that
        /// pop or clip the first syllable while they wake up.
        lead_ms: u32 = 50, Within(AMP_LEAD_MS);
    }

    /// `herald serve`'s network front-ends ([README](../README.md#on-the-network)): a Wyoming
    /// TTS server for Home Assistant and an OpenAI-compatible HTTP API, next to the FIFO, on
    /// one engine with one bounded job queue. Both listen on loopback unless configured
    /// otherwise; under systemd, `herald.socket` may hand the sockets over instead (matched
    /// by port).
    serve: ServeConfig {
        /// The FIFO `herald serve` reads lines of text from (created when missing, mode 0620,
        /// and removed on exit when herald created it), or `off` for none: the network
        /// front-ends only. Its directory must exist: the systemd unit's
        /// `RuntimeDirectory=herald` makes `/run/herald`. A relative path is relative to the
        /// working directory (a FIFO named `off` is `./off`).
        fifo: String = DEFAULT_FIFO.into(), NonEmpty("a path, or `off`"), cli fifo, flag "--fifo";
        /// Where the Wyoming server listens: `tcp://HOST:PORT`, or `off`. `0.0.0.0` listens on
        /// every address (for Home Assistant on another machine).
        wyoming: String = DEFAULT_WYOMING.into(), Any("`tcp://HOST:PORT` or `off`"), cli wyoming, flag "--wyoming";
        /// Where the HTTP server (`POST /v1/audio/speech`, `GET /v1/models`, `GET /healthz`,
        /// `POST /v1/say`, and a web page to try the voices at `GET /`) listens: `HOST:PORT`,
        /// or `off`. A non-loopback address needs `api_key`.
        http: String = DEFAULT_HTTP.into(), Any("`HOST:PORT` or `off`"), cli http, flag "--http";
        /// Requests that may wait while one is spoken, all front-ends together; one more is
        /// refused at once as busy (Wyoming `error` with code `busy`, HTTP 503), never queued
        /// without bound. The FIFO waits for room instead.
        queue_length: usize = 4, Within(QUEUE_LENGTH);
        /// Connections each network server keeps open at once, counted until their sockets
        /// close. One more makes room by closing an idle or slow one (per-address fairness,
        /// then oldest first, [reliability.md](reliability.md#a-hostile-lan)); when none may
        /// close, it is refused (Wyoming: an `error` event `busy`, HTTP: 503) and closed.
        max_connections: usize = 16, Within(MAX_CONNECTIONS);
        /// The longest text a network request may carry, in characters (4096 is the OpenAI
        /// speech API's limit; up to 100,000, read in segments like any long text,
        /// [reliability.md](reliability.md#long-texts)); a longer one is refused with a message
        /// naming this key.
        max_text_chars: usize = 4096, Within(MAX_TEXT_CHARS);
        /// Seconds a request may take to arrive in full once its first byte came (a Wyoming
        /// event; an HTTP request's head and body); a slower client is disconnected. Also how
        /// long a write to a client that does not read may block before its job is cancelled.
        request_timeout_s: u32 = 10, Within(REQUEST_TIMEOUT_S);
        /// Seconds a connection may stay open with nothing to do before it is closed.
        idle_timeout_s: u32 = 120, Within(IDLE_TIMEOUT_S);
        /// Zeroconf (mDNS / DNS-SD) announcement of the Wyoming server as `_wyoming._tcp`, which
        /// Home Assistant discovers: `auto` announces it when `wyoming` is not a loopback
        /// address (only then can Home Assistant reach it), `off` never does. A failure to
        /// announce is logged and the server runs without it.
        zeroconf: Zeroconf = Zeroconf::Auto, OneOf;
        /// Before herald says it is ready (systemd's `READY=1`, the Wyoming server and its
        /// Zeroconf announcement, `/healthz` answering 200), speak one short sentence
        /// ("Hello.", at most 16 frames) through the loaded model into a sink that discards it,
        /// as a network request would be spoken but without the audio device. A failure stops
        /// herald with one line and the exit code of what failed (4 for a bundle that loads but
        /// cannot speak, such as tables damaged in place), before anything is announced
        /// ([reliability.md](reliability.md#prove-before-announcing)). It adds that sentence's
        /// time to the start-up: 0.2 to 0.4 s for the tiny bundle, about 2 s for a 0.6B q4
        /// bundle on a machine near real time, at most about 7 s on a board at RTF 5. `false`
        /// skips it.
        self_test: bool = true, Flag;
        /// The HTTP API's bearer token (`Authorization: Bearer <key>`, every route but
        /// `/healthz` and the page at `/`, which asks for the key its requests send). Not set: no authentication, which is refused at start-up when `http`
        /// is not a loopback address. Empty (`HERALD_SERVE_API_KEY=`) means not set, as for
        /// every optional key (the environment can undo the file's key): on loopback herald
        /// says so in one line; where a key is required (`http` not on loopback) it is an
        /// error that names where the empty value came from. Prefer `HERALD_SERVE_API_KEY` in
        /// the service's environment to writing it into the file.
        api_key: Option<String> = None, Opt("no authentication (loopback only)", Any("a token"));
    }

    /// Logging.
    log: LogConfig {
        /// How much herald logs (to stderr / the journal). When the `RUST_LOG` environment
        /// variable is set and not empty it wins over this key, and may be a full filter such as
        /// `RUST_LOG=info,engine=debug`.
        level: LogLevel = LogLevel::Info, OneOf, cli log_level;
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// What went wrong while building the configuration. Every message names its source: a file
/// (with the line where toml gives one), an environment variable or the command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A config file named by `--config` or `HERALD_CONFIG` does not exist.
    #[error("{}: config file not found (named by {via})", path.display())]
    NotFound {
        /// The file.
        path: PathBuf,
        /// `--config` or `HERALD_CONFIG`.
        via: &'static str,
    },
    /// The config file exists but cannot be read.
    #[error("{}: cannot read config file: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML.
    #[error("{}: malformed TOML: {message}", location(path, *line, *column))]
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line, when toml gives a position.
        line: Option<usize>,
        /// 1-based column, when toml gives a position.
        column: Option<usize>,
        /// toml's message.
        message: String,
    },
    /// A table that is not one of herald's sections.
    #[error("{origin}: unknown section [{name}] (sections: {})", section_names())]
    UnknownSection {
        /// Where: `file:line` or the source that named it.
        origin: String,
        /// The section name.
        name: String,
    },
    /// A plain key outside any section.
    #[error("{origin}: key {key} is outside any section (settings live in the sections {})", section_headers())]
    TopLevelKey {
        /// Where: `file:line`.
        origin: String,
        /// The key.
        key: String,
    },
    /// A key that its section does not have.
    #[error("{origin}: unknown key {key} (keys of [{section}]: {})", section_keys(section).join(", "))]
    UnknownKey {
        /// Where: `file:line` or the source that named it.
        origin: String,
        /// The full key, `section.name`.
        key: String,
        /// The section.
        section: String,
    },
    /// A value of the wrong type, out of range or not one of the allowed names.
    #[error("{origin}: {key} = {value} {problem}")]
    Invalid {
        /// Where: `file:line`, `env HERALD_…` or `command line`.
        origin: String,
        /// The full key, `section.name`.
        key: String,
        /// The value as given (strings quoted).
        value: String,
        /// What is wrong and what is allowed, e.g. `is out of range (0.0..=2.0)`.
        problem: String,
    },
    /// A `HERALD_*` environment variable that is neither a setting nor on the allow-list.
    #[error(
        "unknown environment variable {name}: settings are HERALD_<SECTION>_<KEY> ({}); also allowed: {}",
        env_names().join(", "),
        env_allowed_names()
    )]
    UnknownEnv {
        /// The variable.
        name: String,
    },
}

fn location(path: &Path, line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!("{}:{l}:{c}", path.display()),
        (Some(l), None) => format!("{}:{l}", path.display()),
        _ => path.display().to_string(),
    }
}

/// The sections, in documentation order.
pub fn sections() -> Vec<&'static str> {
    SECTIONS.iter().map(|(name, _)| *name).collect()
}

/// The key names of `section` (without the `section.` prefix), in documentation order.
pub fn section_keys(section: &str) -> Vec<&'static str> {
    SETTINGS.iter().filter(|k| k.section() == section).map(Key::short_name).collect()
}

fn section_names() -> String {
    sections().join(", ")
}

fn section_headers() -> String {
    sections().iter().map(|s| format!("[{s}]")).collect::<Vec<_>>().join(", ")
}

fn env_allowed_names() -> String {
    let mut v: Vec<String> = ENV_ALLOWED.iter().map(|s| s.to_string()).collect();
    v.extend(ENV_ALLOWED_PREFIXES.iter().map(|p| format!("{p}*")));
    v.join(", ")
}

/// Every key, `section.name`, in documentation order.
pub fn keys() -> impl Iterator<Item = &'static str> {
    SETTINGS.iter().map(|k| k.name)
}

/// The environment variable of a key: `audio.volume` → `HERALD_AUDIO_VOLUME`.
pub fn env_name(key: &str) -> String {
    format!("HERALD_{}", key.replace('.', "_").to_ascii_uppercase())
}

fn env_names() -> Vec<String> {
    keys().map(env_name).collect()
}

/// The declared key named `section.name`.
fn setting(key: &str) -> Option<&'static Key> {
    SETTINGS.iter().find(|k| k.name == key)
}

// ---------------------------------------------------------------------------------------------
// Named values

/// The error of parsing one of the named values (`s16`, `streaming`, …).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not one of: {}", allowed.join(", "))]
pub struct UnknownName {
    /// What was given.
    pub value: String,
    /// The accepted names.
    pub allowed: &'static [&'static str],
}

/// A value that is one of a few names (the enums below).
trait Named: FromStr<Err = UnknownName> {
    /// The accepted names, as written in the config.
    const NAMES: &'static [&'static str];
}

macro_rules! named {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// The accepted names, as written in the config.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name as written in the config.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl Named for $name {
            const NAMES: &'static [&'static str] = $name::NAMES;
        }

        impl Setting for $name {
            const SHAPE: Shape = Shape::Str;
            const DOC_TYPE: &'static str = "string";
            type Given = $name;
            fn given(g: &$name) -> Raw {
                Raw::Str(g.as_str().into())
            }
            fn to_toml(&self) -> Option<toml::Value> {
                Some(toml::Value::String(self.as_str().into()))
            }
        }

        impl FromStr for $name {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownName { value: s.to_string(), allowed: Self::NAMES }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

named! {
    /// `audio.format`: the sample format written to the device.
    SampleFormat {
        /// Signed 16-bit little-endian (`S16_LE`).
        S16 = "s16",
        /// 32-bit float little-endian (`FLOAT_LE`).
        F32 = "f32",
    }
}

named! {
    /// `serve.zeroconf`: whether the Wyoming server is announced over mDNS.
    Zeroconf {
        /// Announced when the Wyoming server listens on an address other machines can reach.
        Auto = "auto",
        /// Never announced.
        Off = "off",
    }
}

named! {
    /// `synthesis.mode`: how the text enters the model.
    SynthesisMode {
        /// Only the first text token is in the prefill, the rest is fed one per frame.
        Streaming = "streaming",
        /// The whole text is in the prefill.
        NonStreaming = "non-streaming",
    }
}

named! {
    /// `synthesis.start_policy`: when playback starts (`model::start`).
    StartPolicyChoice {
        /// Once the audio made plus what is made while it plays covers the utterance.
        PlayThrough = "play-through",
        /// At the first audio.
        Immediate = "immediate",
    }
}

impl StartPolicyChoice {
    /// The policy of `model::start`.
    pub fn policy(self) -> model::start::StartPolicy {
        match self {
            StartPolicyChoice::PlayThrough => model::start::StartPolicy::PlayThrough,
            StartPolicyChoice::Immediate => model::start::StartPolicy::Immediate,
        }
    }
}

named! {
    /// `synthesis.vocoder`: which vocoder graph decodes the frames.
    VocoderChoice {
        /// `stateful` when the bundle has a stream graph, else `windowed`.
        Auto = "auto",
        /// The stream graph, its state carried between chunks (exact, one pass per frame).
        Stateful = "stateful",
        /// The windowed graph, `left_context` frames decoded again before every chunk.
        Windowed = "windowed",
    }
}

impl VocoderChoice {
    /// The engine's form: `None` lets the bundle choose.
    pub fn form(self) -> Option<model::backend::VocoderForm> {
        match self {
            VocoderChoice::Auto => None,
            VocoderChoice::Stateful => Some(model::backend::VocoderForm::Stateful),
            VocoderChoice::Windowed => Some(model::backend::VocoderForm::Windowed),
        }
    }
}

named! {
    /// `text.markdown`: whether a text is read as markdown.
    TextMarkdown {
        /// When it shows markdown's signs.
        Auto = "auto",
        /// Always.
        On = "on",
        /// Never.
        Off = "off",
    }
}

named! {
    /// `text.emoji`: what happens to emoji and pictographs.
    TextEmoji {
        /// Taken out.
        Remove = "remove",
        /// Left to the model.
        Keep = "keep",
    }
}

named! {
    /// `text.pause_tags`: what a malformed pause tag is.
    TextPauseTags {
        /// Read as text.
        Lenient = "lenient",
        /// Refused as bad input.
        Strict = "strict",
    }
}

named! {
    /// `text.code`: what happens to markdown's code.
    TextCode {
        /// Left out.
        Skip = "skip",
        /// Read as text.
        Read = "read",
    }
}

named! {
    /// `text.urls`: what happens to URLs and e-mail addresses.
    TextUrls {
        /// A URL as its host, an address as `name at host`.
        Host = "host",
        /// Left out.
        Skip = "skip",
        /// As they are.
        Keep = "keep",
    }
}

named! {
    /// `runtime.backend`: which runtime runs the step graphs.
    BackendChoice {
        /// `qnn` on a Snapdragon board whose bundle has binaries for it and whose libraries
        /// load, else `tract`.
        Auto = "auto",
        /// The CPU, through tract.
        Tract = "tract",
        /// The NPU, through the QNN context binaries.
        Qnn = "qnn",
    }
}

named! {
    /// `runtime.qnn_vocoder`: where the vocoder runs under the `qnn` backend.
    QnnVocoder {
        /// The CPU, through tract.
        Cpu = "cpu",
        /// The NPU, from the bundle's vocoder context binaries.
        Npu = "npu",
    }
}

named! {
    /// `runtime.vocoder_precision`: the arithmetic of the vocoder's convolutions on the CPU.
    VocoderPrecision {
        /// float32, as exported.
        Fp32 = "fp32",
        /// float16 convolutions, behind the SNR gate.
        Fp16 = "fp16",
        /// fp16 on a core with half-precision arithmetic when the gate passes, else fp32.
        Auto = "auto",
    }
}

named! {
    /// `synthesis.sampling`: how codes are chosen.
    Sampling {
        /// The bundle's sampling parameters with a seeded generator.
        Sample = "sample",
        /// The most likely code every time (deterministic, no seed).
        Greedy = "greedy",
    }
}

named! {
    /// `amplifier.active`: the line level that enables the amplifier.
    ActiveLevel {
        /// Enabled when the line is high.
        High = "high",
        /// Enabled when the line is low (active-low enable, e.g. an SD/shutdown pin).
        Low = "low",
    }
}

named! {
    /// `log.level`.
    LogLevel {
        /// Errors only.
        Error = "error",
        /// Warnings and errors.
        Warn = "warn",
        /// Progress and timings.
        Info = "info",
        /// Details for debugging.
        Debug = "debug",
        /// Everything.
        Trace = "trace",
    }
}

// ---------------------------------------------------------------------------------------------
// Raw values, types and rules

/// A value as a source gave it, before its key's rule checked it. Integers are wide enough for
/// every integer type of a key, so that a range error shows the value as given.
#[derive(Debug, Clone, PartialEq)]
pub enum Raw {
    /// A string (also names and paths).
    Str(String),
    /// An integer.
    Int(i128),
    /// A number.
    Float(f64),
    /// An array of integers.
    Ints(Vec<i128>),
    /// A boolean.
    Bool(bool),
    /// A table of strings, in the order given.
    Table(Vec<(String, String)>),
    /// An empty environment value of an optional key: unset it.
    Unset,
}

impl fmt::Display for Raw {
    /// As the value appears in messages: strings quoted, floats as TOML writes them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Raw::Str(s) => write!(f, "{s:?}"),
            Raw::Int(n) => write!(f, "{n}"),
            Raw::Float(v) => f.write_str(&render_f64(*v)),
            Raw::Ints(v) => f.write_str(&ints_text(v)),
            Raw::Bool(b) => write!(f, "{b}"),
            Raw::Table(t) => f.write_str(&table_text(t)),
            Raw::Unset => f.write_str("\"\""),
        }
    }
}

/// The form of a key's raw value: how it is read from TOML and from text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A string.
    Str,
    /// An integer.
    Int,
    /// A number (an integer is accepted).
    Float,
    /// An array of integers (in text: comma-separated).
    Ints,
    /// A boolean (in text: `true` or `false`).
    Bool,
    /// A table of strings (in text: comma-separated `name=value` pairs).
    Table,
}

impl Shape {
    /// For "wrong type" and parse messages.
    fn expected(self) -> &'static str {
        match self {
            Shape::Str => "a string",
            Shape::Int => "an integer",
            Shape::Float => "a number",
            Shape::Ints => "an array of integers",
            Shape::Bool => "true or false",
            Shape::Table => "a table of strings",
        }
    }

    /// A TOML value of this shape; `None` for the wrong type.
    fn read_toml(self, v: &toml::Value) -> Option<Raw> {
        use toml::Value as V;
        match (self, v) {
            (Shape::Str, V::String(s)) => Some(Raw::Str(s.clone())),
            (Shape::Int, V::Integer(n)) => Some(Raw::Int((*n).into())),
            (Shape::Float, V::Float(x)) => Some(Raw::Float(*x)),
            (Shape::Float, V::Integer(n)) => Some(Raw::Float(*n as f64)),
            (Shape::Bool, V::Boolean(b)) => Some(Raw::Bool(*b)),
            (Shape::Ints, V::Array(a)) => a.iter().map(|x| x.as_integer().map(i128::from)).collect::<Option<Vec<_>>>().map(Raw::Ints),
            (Shape::Table, V::Table(t)) => {
                t.iter().map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned()))).collect::<Option<Vec<_>>>().map(Raw::Table)
            }
            _ => None,
        }
    }

    /// An environment or `--set` value of this shape.
    fn read_text(self, raw: &str) -> Result<Raw, Bad> {
        let int = |s: &str| s.trim().parse::<i64>().map(i128::from);
        match self {
            Shape::Str => Ok(Raw::Str(raw.to_string())),
            Shape::Int => int(raw).map(Raw::Int).map_err(|_| (quoted(raw), format!("is not {}", self.expected()))),
            Shape::Float => raw.trim().parse::<f64>().map(Raw::Float).map_err(|_| (quoted(raw), "is not a number".to_string())),
            Shape::Bool => match raw.trim() {
                "true" => Ok(Raw::Bool(true)),
                "false" => Ok(Raw::Bool(false)),
                _ => Err((quoted(raw), format!("is not {}", self.expected()))),
            },
            Shape::Table => table_from_text(raw).map(Raw::Table).map_err(|why| (quoted(raw), why)),
            Shape::Ints => {
                let inner = raw.trim();
                let inner = inner.strip_prefix('[').and_then(|i| i.strip_suffix(']')).unwrap_or(inner).trim();
                if inner.is_empty() {
                    return Ok(Raw::Ints(Vec::new()));
                }
                inner
                    .split(',')
                    .map(int)
                    .collect::<Result<Vec<_>, _>>()
                    .map(Raw::Ints)
                    .map_err(|_| (quoted(raw), "is not a comma-separated list of integers (e.g. 2,4,8,16,25)".to_string()))
            }
        }
    }
}

/// A Rust type a key may have: the shape of its raw values, what a flag gives, and how a value
/// prints as TOML.
pub trait Setting: Sized {
    /// The shape of raw values.
    const SHAPE: Shape;
    /// An `Option`: the key may be unset.
    const OPTIONAL: bool = false;
    /// docs/config.md's "Type" column.
    const DOC_TYPE: &'static str;
    /// The type of a [`CliOverrides`] field (without its `Option`).
    type Given;
    /// A flag's value as a raw value.
    fn given(g: &Self::Given) -> Raw;
    /// The value as TOML; `None` when an optional key is unset.
    fn to_toml(&self) -> Option<toml::Value>;
}

impl Setting for String {
    const SHAPE: Shape = Shape::Str;
    const DOC_TYPE: &'static str = "string";
    type Given = String;
    fn given(g: &String) -> Raw {
        Raw::Str(g.clone())
    }
    fn to_toml(&self) -> Option<toml::Value> {
        Some(toml::Value::String(self.clone()))
    }
}

impl Setting for PathBuf {
    const SHAPE: Shape = Shape::Str;
    const DOC_TYPE: &'static str = "path";
    type Given = PathBuf;
    fn given(g: &PathBuf) -> Raw {
        Raw::Str(g.to_string_lossy().into_owned())
    }
    fn to_toml(&self) -> Option<toml::Value> {
        Some(toml::Value::String(self.to_string_lossy().into_owned()))
    }
}

impl Setting for bool {
    const SHAPE: Shape = Shape::Bool;
    const DOC_TYPE: &'static str = "boolean";
    type Given = bool;
    fn given(g: &bool) -> Raw {
        Raw::Bool(*g)
    }
    fn to_toml(&self) -> Option<toml::Value> {
        Some(toml::Value::Boolean(*self))
    }
}

/// `true` or `false`.
struct Flag;

impl Rule<bool> for Flag {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<bool, Bad> {
        match raw {
            Raw::Bool(b) => Ok(b),
            other => wrong_shape(other, Shape::Bool),
        }
    }
    fn allowed(&self) -> String {
        "`true`, `false`".into()
    }
}

impl Setting for f64 {
    const SHAPE: Shape = Shape::Float;
    const DOC_TYPE: &'static str = "float";
    type Given = f64;
    fn given(g: &f64) -> Raw {
        Raw::Float(*g)
    }
    fn to_toml(&self) -> Option<toml::Value> {
        Some(toml::Value::Float(*self))
    }
}

macro_rules! integer_setting {
    ($($t:ty),+) => {$(
        impl Setting for $t {
            const SHAPE: Shape = Shape::Int;
            const DOC_TYPE: &'static str = "integer";
            type Given = $t;
            fn given(g: &$t) -> Raw {
                Raw::Int(i128::try_from(*g).unwrap_or(i128::MAX))
            }
            fn to_toml(&self) -> Option<toml::Value> {
                Some(toml::Value::Integer(i64::try_from(*self).unwrap_or(i64::MAX)))
            }
        }

        impl Rule<$t> for Within<$t> {
            fn check(&self, raw: Raw, _: Option<&Path>) -> Result<$t, Bad> {
                match raw {
                    Raw::Int(v) => match <$t>::try_from(v) {
                        Ok(t) if self.0.contains(&t) => Ok(t),
                        _ => Err((v.to_string(), format!("is out of range ({})", range_text(&self.0)))),
                    },
                    other => wrong_shape(other, Shape::Int),
                }
            }
            fn allowed(&self) -> String {
                format!("`{}`", range_text(&self.0))
            }
        }
    )+};
}

integer_setting!(u32, u64, usize);

impl Setting for Vec<usize> {
    const SHAPE: Shape = Shape::Ints;
    const DOC_TYPE: &'static str = "array of integers";
    type Given = Vec<usize>;
    fn given(g: &Vec<usize>) -> Raw {
        Raw::Ints(g.iter().map(|&x| i128::try_from(x).unwrap_or(i128::MAX)).collect())
    }
    fn to_toml(&self) -> Option<toml::Value> {
        let int = |&x: &usize| toml::Value::Integer(i64::try_from(x).unwrap_or(i64::MAX));
        Some(toml::Value::Array(self.iter().map(int).collect()))
    }
}

impl Setting for BTreeMap<String, String> {
    const SHAPE: Shape = Shape::Table;
    const DOC_TYPE: &'static str = "table of strings";
    type Given = BTreeMap<String, String>;
    fn given(g: &BTreeMap<String, String>) -> Raw {
        Raw::Table(g.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
    fn to_toml(&self) -> Option<toml::Value> {
        Some(toml::Value::Table(self.iter().map(|(k, v)| (k.clone(), toml::Value::String(v.clone()))).collect()))
    }
}

impl<T: Setting> Setting for Option<T> {
    const SHAPE: Shape = T::SHAPE;
    const OPTIONAL: bool = true;
    const DOC_TYPE: &'static str = T::DOC_TYPE;
    type Given = T::Given;
    fn given(g: &T::Given) -> Raw {
        T::given(g)
    }
    fn to_toml(&self) -> Option<toml::Value> {
        self.as_ref().and_then(T::to_toml)
    }
}

/// A bad value: (the value as given, what is wrong with it).
type Bad = (String, String);

/// How a key of type `T` checks its raw values.
trait Rule<T> {
    /// The checked value. `base`: the directory a relative path is relative to (a file's).
    fn check(&self, raw: Raw, base: Option<&Path>) -> Result<T, Bad>;
    /// docs/config.md's "Allowed" column.
    fn allowed(&self) -> String;
    /// For an optional key: what being unset means (`herald config` prints it).
    fn unset_note(&self) -> Option<&'static str> {
        None
    }
}

fn checked<T, R: Rule<T>>(rule: &R, raw: Raw, base: Option<&Path>) -> Result<T, Bad> {
    rule.check(raw, base)
}

fn rule_doc<T, R: Rule<T>>(rule: &R) -> RuleDoc {
    RuleDoc { allowed: rule.allowed(), unset_note: rule.unset_note() }
}

/// A raw value of another shape than the key's: cannot happen, as every source reads the
/// key's shape, but it is an error rather than a panic.
fn wrong_shape<T>(raw: Raw, shape: Shape) -> Result<T, Bad> {
    Err((raw.to_string(), format!("has the wrong type (expected {})", shape.expected())))
}

/// A non-empty string (the text describes what is allowed).
struct NonEmpty(&'static str);

impl Rule<String> for NonEmpty {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<String, Bad> {
        match raw {
            Raw::Str(v) if v.trim().is_empty() => Err((quoted(&v), "must not be empty".into())),
            Raw::Str(v) => Ok(v),
            other => wrong_shape(other, Shape::Str),
        }
    }
    fn allowed(&self) -> String {
        self.0.into()
    }
}

/// Any string (the text describes what is allowed; the bundle checks it later).
struct Any(&'static str);

impl Rule<String> for Any {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<String, Bad> {
        match raw {
            Raw::Str(v) => Ok(v),
            other => wrong_shape(other, Shape::Str),
        }
    }
    fn allowed(&self) -> String {
        self.0.into()
    }
}

/// A non-empty path; in a file relative to the file's directory, else to the working
/// directory; stored absolute, so that `herald config` prints a path that means the same from
/// anywhere.
struct FsPath(&'static str);

impl Rule<PathBuf> for FsPath {
    fn check(&self, raw: Raw, base: Option<&Path>) -> Result<PathBuf, Bad> {
        let p = PathBuf::from(NonEmpty(self.0).check(raw, base)?);
        let p = match base {
            Some(d) if p.is_relative() => d.join(p),
            _ => p,
        };
        Ok(std::path::absolute(&p).unwrap_or(p))
    }
    fn allowed(&self) -> String {
        self.0.into()
    }
}

/// One of the names of an enum.
struct OneOf;

impl<T: Named> Rule<T> for OneOf {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<T, Bad> {
        match raw {
            Raw::Str(v) => v.parse::<T>().map_err(|e| (quoted(&v), format!("is not one of: {}", e.allowed.join(", ")))),
            other => wrong_shape(other, Shape::Str),
        }
    }
    fn allowed(&self) -> String {
        T::NAMES.iter().map(|n| format!("`{n:?}`")).collect::<Vec<_>>().join(", ")
    }
}

/// A number in a range.
struct Within<T>(RangeInclusive<T>);

impl Rule<f64> for Within<f64> {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<f64, Bad> {
        match raw {
            Raw::Float(v) if v.is_finite() && self.0.contains(&v) => Ok(v),
            Raw::Float(v) => Err((render_f64(v), format!("is out of range ({:?}..={:?})", self.0.start(), self.0.end()))),
            other => wrong_shape(other, Shape::Float),
        }
    }
    fn allowed(&self) -> String {
        format!("`{:?}..={:?}`", self.0.start(), self.0.end())
    }
}

/// `synthesis.ramp`: [`RAMP_LEN`] entries, each in [`RAMP_FRAMES`].
struct Ramp;

impl Rule<Vec<usize>> for Ramp {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<Vec<usize>, Bad> {
        match raw {
            Raw::Ints(v) => ramp(v),
            other => wrong_shape(other, Shape::Ints),
        }
    }
    fn allowed(&self) -> String {
        format!("{} to {} entries, each `{}`", RAMP_LEN.start(), RAMP_LEN.end(), range_text(&RAMP_FRAMES))
    }
}

/// `voices.aliases`: a table of alias → voice. What depends on the bundle (the voice exists, the
/// alias hides no speaker) and the names themselves are checked when the bundle is loaded
/// (`service::Aliases::new`); here only the shape.
struct AliasTable;

impl Rule<BTreeMap<String, String>> for AliasTable {
    fn check(&self, raw: Raw, _: Option<&Path>) -> Result<BTreeMap<String, String>, Bad> {
        match raw {
            Raw::Table(pairs) => {
                let shown = table_text(&pairs);
                let mut out = BTreeMap::new();
                for (name, voice) in pairs {
                    if out.contains_key(&name) {
                        return Err((shown, format!("names {name:?} twice")));
                    }
                    out.insert(name, voice);
                }
                Ok(out)
            }
            other => wrong_shape(other, Shape::Table),
        }
    }
    fn allowed(&self) -> String {
        "names → a speaker of the bundle or `\"default\"`".into()
    }
}

/// An optional key: unset by an empty value, else checked by the inner rule. The text says
/// what unset means (empty: nothing to say).
struct Opt<R>(&'static str, R);

impl<T, R: Rule<T>> Rule<Option<T>> for Opt<R> {
    fn check(&self, raw: Raw, base: Option<&Path>) -> Result<Option<T>, Bad> {
        match raw {
            Raw::Unset => Ok(None),
            Raw::Str(s) if s.is_empty() => Ok(None),
            raw => self.1.check(raw, base).map(Some),
        }
    }
    fn allowed(&self) -> String {
        self.1.allowed()
    }
    fn unset_note(&self) -> Option<&'static str> {
        Some(self.0).filter(|n| !n.is_empty())
    }
}

/// What a key's rule allows, for the docs and `herald config`.
struct RuleDoc {
    /// docs/config.md's "Allowed" column.
    allowed: String,
    /// What unset means, for an optional key.
    unset_note: Option<&'static str>,
}

/// One key, made by `settings!` from its declaration.
struct Key {
    /// `section.name`.
    name: &'static str,
    /// The doc comment's lines.
    doc: &'static [&'static str],
    /// The command-line flag that sets it (`--volume`), if any.
    flag: Option<&'static str>,
    /// The shape of its raw values.
    shape: Shape,
    /// It may be unset.
    optional: bool,
    /// docs/config.md's "Type" column.
    doc_type: &'static str,
    /// Check a raw value with the key's rule and store it.
    set: fn(&mut Config, Raw, Option<&Path>) -> Result<(), Bad>,
    /// The value as TOML; `None` when unset.
    get: fn(&Config) -> Option<toml::Value>,
    /// What its rule allows.
    describe: fn() -> RuleDoc,
    /// Its [`CliOverrides`] field as a raw value, when set.
    cli: fn(&CliOverrides) -> Option<Raw>,
}

impl Key {
    fn section(&self) -> &'static str {
        self.name.split_once('.').map_or(self.name, |(s, _)| s)
    }

    fn short_name(&self) -> &'static str {
        self.name.split_once('.').map_or(self.name, |(_, n)| n)
    }

    /// An environment or `--set` value; empty unsets an optional key that is not a string
    /// (a string key gets the empty string, which unsets or is refused by its rule).
    fn parse_text(&self, raw: &str) -> Result<Raw, Bad> {
        if self.optional && self.shape != Shape::Str && raw.trim().is_empty() {
            return Ok(Raw::Unset);
        }
        self.shape.read_text(raw)
    }
}

/// The raw values of one source, by key.
type Layer = BTreeMap<&'static str, Raw>;

fn quoted(s: &str) -> String {
    format!("{s:?}")
}

fn render_f64(v: f64) -> String {
    toml::Value::Float(v).to_string()
}

fn range_text<T: fmt::Display>(r: &RangeInclusive<T>) -> String {
    format!("{}..={}", r.start(), r.end())
}

fn ints_text(v: &[i128]) -> String {
    format!("[{}]", v.iter().map(i128::to_string).collect::<Vec<_>>().join(", "))
}

/// A table as TOML writes it inline: `{ kitchen = "vivian" }`.
fn table_text(t: &[(String, String)]) -> String {
    let mut table = toml::Table::new();
    for (k, v) in t {
        table.insert(k.clone(), toml::Value::String(v.clone()));
    }
    toml::Value::Table(table).to_string()
}

/// A table from an environment or `--set` value: comma-separated `name=value` pairs, each side
/// trimmed and unquoted (`"…"`), the whole optionally in braces; empty (or `{}`): no pair.
/// `name = "value"` pairs, as `herald config` prints them, read back.
fn table_from_text(raw: &str) -> Result<Vec<(String, String)>, String> {
    let inner = raw.trim();
    let inner = inner.strip_prefix('{').and_then(|i| i.strip_suffix('}')).unwrap_or(inner).trim();
    let unquote = |s: &str| {
        let s = s.trim();
        s.strip_prefix('"').and_then(|u| u.strip_suffix('"')).unwrap_or(s).to_owned()
    };
    let mut out = Vec::new();
    for pair in inner.split(',').filter(|p| !p.trim().is_empty()) {
        let Some((name, value)) = pair.split_once('=') else {
            return Err(format!("has {:?}, not a name=voice pair (e.g. kitchen=vivian,alloy=ryan)", pair.trim()));
        };
        out.push((unquote(name), unquote(value)));
    }
    Ok(out)
}

fn ramp(v: Vec<i128>) -> Result<Vec<usize>, Bad> {
    let shown = ints_text(&v);
    if v.is_empty() {
        return Err((shown, "must not be empty (chunk sizes in frames, e.g. [2, 4, 8, 16, 25])".into()));
    }
    if !RAMP_LEN.contains(&v.len()) {
        return Err((shown, format!("has {} entries (allowed: {})", v.len(), range_text(&RAMP_LEN))));
    }
    let mut out = Vec::with_capacity(v.len());
    for &x in &v {
        match usize::try_from(x) {
            Ok(f) if RAMP_FRAMES.contains(&f) => out.push(f),
            _ => {
                return Err((shown, format!("has entry {x}: each entry must be in {} frames", range_text(&RAMP_FRAMES))));
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Helpers of the sections

impl SynthesisConfig {
    /// The seed for the next utterance: `None` with greedy decoding, else the configured seed or
    /// a fresh one from [`clock_seed`]. Log it: `seed = N` in the config reproduces the run.
    pub fn utterance_seed(&self) -> Option<u64> {
        match self.sampling {
            Sampling::Greedy => None,
            Sampling::Sample => Some(self.seed.unwrap_or_else(clock_seed)),
        }
    }
}

/// A fresh seed from the clock (and a counter, so two calls never collide), inside [`SEED`] so
/// that it can be written back into a config file.
pub fn clock_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    // SplitMix64 finalizer over time and counter.
    let mut z = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) & *SEED.end()
}

impl RuntimeConfig {
    /// The compute thread count when the stages are not pinned: `threads`, or for 0 the
    /// available parallelism (at least 1). With `threads = 0` herald pins the stages and sizes
    /// their thread pools from the board instead (tuning.rs).
    pub fn effective_threads(&self) -> usize {
        if self.threads > 0 { self.threads } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) }
    }
}

impl LogConfig {
    /// The log filter: `RUST_LOG` when it is set and not empty (it wins over the config), else
    /// `log.level`. Pass `std::env::var("RUST_LOG").ok().as_deref()`.
    pub fn filter<'a>(&self, rust_log: Option<&'a str>) -> &'a str {
        match rust_log {
            Some(f) if !f.trim().is_empty() => f,
            _ => self.level.as_str(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The config file

/// Where a key stands in the file.
struct Place {
    key: &'static Key,
    line: usize,
    value: Range<usize>,
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Check the file's sections and keys against the declaration (so that an unknown key is
/// reported with its line and the keys of its section) and note where each key stands.
fn places(path: &Path, text: &str) -> Result<Vec<Place>, ConfigError> {
    let syntax = |e: toml::de::Error| {
        let (line, column) = e.span().map(|s| line_col(text, s.start)).unzip();
        ConfigError::Syntax { path: path.to_owned(), line, column, message: e.message().trim().to_string() }
    };
    let doc = toml::de::DeTable::parse(text).map_err(syntax)?;
    let at = |offset: usize| format!("{}:{}", path.display(), line_col(text, offset).0);
    let mut top: Vec<_> = doc.get_ref().iter().collect();
    top.sort_by_key(|(k, _)| k.span().start);
    let mut out = Vec::new();
    for (section, value) in top {
        let name: &str = section.get_ref();
        let Some(section_name) = sections().into_iter().find(|s| *s == name) else {
            return Err(if value.get_ref().is_table() {
                ConfigError::UnknownSection { origin: at(section.span().start), name: name.to_string() }
            } else {
                ConfigError::TopLevelKey { origin: at(section.span().start), key: name.to_string() }
            });
        };
        let Some(table) = value.get_ref().as_table() else {
            let shown = text.get(value.span()).unwrap_or("").trim().to_string();
            return Err(ConfigError::Invalid {
                origin: at(section.span().start),
                key: name.to_string(),
                value: shown,
                problem: format!("must be a section ([{name}])"),
            });
        };
        let mut entries: Vec<_> = table.iter().collect();
        entries.sort_by_key(|(k, _)| k.span().start);
        for (key, value) in entries {
            let full = format!("{section_name}.{}", key.get_ref());
            match setting(&full) {
                Some(k) => out.push(Place { key: k, line: line_col(text, key.span().start).0, value: value.span() }),
                None => {
                    return Err(ConfigError::UnknownKey {
                        origin: at(key.span().start),
                        key: full,
                        section: section_name.to_string(),
                    });
                }
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Loading

impl Config {
    /// [`DEFAULT_PATH`].
    pub fn default_path() -> &'static Path {
        Path::new(DEFAULT_PATH)
    }

    /// Defaults < config file < `HERALD_*` variables of `env`.
    ///
    /// The file: `explicit` (`--config`, must exist), else `HERALD_CONFIG` from `env` when set
    /// and not empty (must exist), else [`DEFAULT_PATH`] if it exists. `env` is the process
    /// environment ([`Config::process_env`]); only `HERALD_*` names are looked at, and one that
    /// is neither a setting nor in [`ENV_ALLOWED`] / [`ENV_ALLOWED_PREFIXES`] is an error.
    ///
    /// # Errors
    /// [`ConfigError`]: the first problem found, naming its source, key and what is allowed.
    pub fn load(explicit: Option<&Path>, env: &[(String, String)]) -> Result<Config, ConfigError> {
        Self::load_with_default(Self::default_path(), explicit, env)
    }

    /// [`Config::load`] with another default file (tests; a development machine).
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_with_default(default_path: &Path, explicit: Option<&Path>, env: &[(String, String)]) -> Result<Config, ConfigError> {
        // Settings from the environment: names first, so a typo is reported even when the file
        // has a problem too.
        let mut settings: Vec<(&'static str, &str, &str)> = Vec::new();
        for (name, value) in env {
            if !name.starts_with("HERALD_")
                || ENV_ALLOWED.contains(&name.as_str())
                || ENV_ALLOWED_PREFIXES.iter().any(|p| name.starts_with(p))
            {
                continue;
            }
            let key = keys().find(|k| env_name(k) == *name).ok_or_else(|| ConfigError::UnknownEnv { name: name.clone() })?;
            settings.push((key, name, value));
        }
        settings.sort_by_key(|(_, name, _)| *name);

        let config_env = env.iter().rev().find(|(n, _)| n == CONFIG_ENV).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
        let (path, via) = match (explicit, config_env) {
            (Some(p), _) => (p, Some("--config")),
            (None, Some(p)) => (Path::new(p), Some(CONFIG_ENV)),
            (None, None) => (default_path, None),
        };
        let mut config = Config::default();
        match std::fs::read_to_string(path) {
            Ok(text) => config.merge_file(path, &text)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(via) = via {
                    return Err(ConfigError::NotFound { path: path.to_owned(), via });
                }
            }
            Err(source) => return Err(ConfigError::Read { path: path.to_owned(), source }),
        }
        for (key, name, value) in settings {
            config.set(key, value, &format!("env {name}"))?;
        }
        Ok(config)
    }

    /// The process environment for [`Config::load`]: the `HERALD_*` variables (non-UTF-8 values
    /// converted lossily; `std::env::vars` would panic on them).
    pub fn process_env() -> Vec<(String, String)> {
        std::env::vars_os()
            .filter_map(|(k, v)| {
                let k = k.into_string().ok()?;
                k.starts_with("HERALD_").then(|| (k, v.to_string_lossy().into_owned()))
            })
            .collect()
    }

    /// Apply a config file's text (`path` is for messages and relative paths).
    ///
    /// # Errors
    /// Malformed TOML, unknown sections or keys, bad values.
    pub fn merge_file(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let places = places(path, text)?;
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let (line, column) = e.span().map(|s| line_col(text, s.start)).unzip();
            ConfigError::Syntax { path: path.to_owned(), line, column, message: e.message().trim().to_string() }
        })?;
        let origin_of = |p: &Place| format!("{}:{}", path.display(), p.line);
        let mut layer = Layer::new();
        for p in &places {
            let (section, name) = (p.key.section(), p.key.short_name());
            let value = table.get(section).and_then(|s| s.get(name));
            match value.and_then(|v| p.key.shape.read_toml(v)) {
                Some(raw) => {
                    layer.insert(p.key.name, raw);
                }
                None => {
                    let mut shown = text.get(p.value.clone()).unwrap_or("").trim().to_string();
                    let mut problem = format!("has the wrong type (expected {})", p.key.shape.expected());
                    // a table (`[voices.aliases]` spans its header): the table, and the entry
                    if let Some(toml::Value::Table(t)) = value {
                        shown = toml::Value::Table(t.clone()).to_string();
                        if let Some((k, v)) = t.iter().find(|(_, v)| !v.is_str()) {
                            problem = format!("has the wrong type (expected {}; {k} = {v} is not a string)", p.key.shape.expected());
                        }
                    }
                    return Err(ConfigError::Invalid { origin: origin_of(p), key: p.key.name.to_string(), value: shown, problem });
                }
            }
        }
        let lines: BTreeMap<&str, usize> = places.iter().map(|p| (p.key.name, p.line)).collect();
        let origin = |key: &str| format!("{}:{}", path.display(), lines.get(key).copied().unwrap_or(0));
        // A relative path in a file is relative to the file's directory.
        let base = path.parent().filter(|d| !d.as_os_str().is_empty());
        self.merge(layer, &origin, base)?;
        self.file = Some(path.to_owned());
        self.source.push(format!("file {}", path.display()));
        Ok(())
    }

    /// Set one key from a string, as an environment variable would (`origin` is for messages
    /// and [`Config::origin`], e.g. `--set` or `env HERALD_AUDIO_VOLUME`). Lists are
    /// comma-separated; an empty `synthesis.speaker` or `synthesis.seed` clears it.
    ///
    /// # Errors
    /// An unknown key, a value that does not parse or is not allowed.
    pub fn set(&mut self, key: &str, value: &str, origin: &str) -> Result<(), ConfigError> {
        let Some(k) = setting(key) else {
            let (section, _) = key.split_once('.').unwrap_or((key, ""));
            return Err(if sections().contains(&section) {
                ConfigError::UnknownKey { origin: origin.into(), key: key.into(), section: section.into() }
            } else {
                ConfigError::UnknownSection { origin: origin.into(), name: section.into() }
            });
        };
        let raw = k.parse_text(value).map_err(|(value, problem)| ConfigError::Invalid {
            origin: origin.into(),
            key: k.name.into(),
            value,
            problem,
        })?;
        self.merge(Layer::from([(k.name, raw)]), &|_| origin.to_string(), None)?;
        self.source.push(origin.to_string());
        Ok(())
    }

    /// Apply command-line flags (highest precedence), checked like the other sources.
    ///
    /// # Errors
    /// A value out of range (`command line: audio.volume = 3.5 is out of range (0.0..=2.0)`).
    pub fn apply_cli(&mut self, cli: &CliOverrides) -> Result<(), ConfigError> {
        const ORIGIN: &str = "command line";
        let layer: Layer = SETTINGS.iter().filter_map(|k| (k.cli)(cli).map(|raw| (k.name, raw))).collect();
        if self.merge(layer, &|_| ORIGIN.to_string(), None)? > 0 {
            self.source.push(ORIGIN.into());
        }
        Ok(())
    }

    /// Check and apply one source's raw values, in declaration order; returns how many keys it
    /// set.
    fn merge(&mut self, mut layer: Layer, origin: &dyn Fn(&str) -> String, base: Option<&Path>) -> Result<usize, ConfigError> {
        let mut set = 0;
        for key in SETTINGS {
            let Some(raw) = layer.remove(key.name) else { continue };
            (key.set)(self, raw, base).map_err(|(value, problem)| ConfigError::Invalid {
                origin: origin(key.name),
                key: key.name.into(),
                value,
                problem,
            })?;
            self.origins.insert(key.name, origin(key.name));
            set += 1;
        }
        Ok(set)
    }

    /// Where `key` got its value: `default`, `FILE:LINE`, `env HERALD_…` or `command line`.
    pub fn origin(&self, key: &str) -> &str {
        self.origins.get(key).map_or("default", String::as_str)
    }

    /// The value of `key` as TOML (`"default"`, `1.0`, `[2, 4]`); `None` for an unknown key or
    /// an unset optional one.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn get(&self, key: &str) -> Option<String> {
        setting(key).and_then(|k| (k.get)(self)).map(|v| v.to_string())
    }

    /// The effective configuration as a config file (every key; unset optional keys as
    /// comments). Parsing it gives the same configuration.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn to_toml(&self) -> String {
        self.render(false)
    }

    fn render(&self, annotate: bool) -> String {
        let mut out = String::new();
        for (n, section) in sections().into_iter().enumerate() {
            if n > 0 {
                out.push('\n');
            }
            let _ = writeln!(out, "[{section}]");
            for key in SETTINGS.iter().filter(|k| k.section() == section) {
                let name = key.short_name();
                let line = match ((key.get)(self), (key.describe)().unset_note) {
                    (Some(v), _) => format!("{name} = {v}"),
                    (None, Some(note)) => format!("# {name}: not set ({note})"),
                    (None, None) => format!("# {name}: not set"),
                };
                let from = self.origin(key.name);
                if annotate && from != "default" {
                    let _ = writeln!(out, "{line}  # from {from}");
                } else {
                    let _ = writeln!(out, "{line}");
                }
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Settings for the board's audio sinks

impl From<SampleFormat> for board::audio::SampleFormat {
    fn from(f: SampleFormat) -> Self {
        match f {
            SampleFormat::S16 => board::audio::SampleFormat::S16,
            SampleFormat::F32 => board::audio::SampleFormat::F32,
        }
    }
}

impl Config {
    /// The ALSA sink settings of `[audio]`: device, format, period and buffer; the sink's other
    /// settings (start threshold, busy retries, stall timeout) at the board's defaults.
    pub fn alsa_settings(&self) -> board::audio::AlsaSettings {
        board::audio::AlsaSettings {
            device: self.audio.device.clone(),
            format: self.audio.format.into(),
            period_ms: self.audio.period_ms,
            periods: self.audio.buffer_periods,
            ..Default::default()
        }
    }

    /// The utterance shaping of `[audio]` (gain, leading and trailing silence, fades), the same
    /// for every sink.
    pub fn shaper_settings(&self) -> board::audio::ShaperSettings {
        board::audio::ShaperSettings {
            gain: self.audio.volume as f32,
            lead_silence_ms: self.audio.leading_silence_ms,
            trail_silence_ms: self.audio.trailing_silence_ms,
            fade_ms: self.audio.fade_ms,
        }
    }
}

/// The effective configuration as TOML, each value not at its default annotated with its
/// source (`# from env HERALD_AUDIO_VOLUME`). Still a valid config file.
impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(true))
    }
}

// ---------------------------------------------------------------------------------------------
// docs/config.md

/// docs/config.md's key reference, made from the declaration: per section a heading, the
/// section's doc comment and a table of its keys (type, default, allowed values, doc comment,
/// environment variable, flag). The test `docs_are_generated` keeps the page equal to it.
#[cfg_attr(not(test), allow(dead_code))]
pub fn markdown_keys() -> String {
    let defaults = Config::default();
    let mut out = String::new();
    for (n, (section, doc)) in SECTIONS.iter().enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let _ = writeln!(out, "### `[{section}]`\n");
        let text: Vec<&str> = doc.iter().map(|l| l.strip_prefix(' ').unwrap_or(l)).collect();
        if !text.is_empty() {
            let _ = writeln!(out, "{}\n", text.join("\n"));
        }
        out.push_str("| Key | Type | Default | Allowed | What it does |\n");
        out.push_str("|-----|------|---------|---------|--------------|\n");
        for key in SETTINGS.iter().filter(|k| k.section() == *section) {
            let default = (key.get)(&defaults).map_or_else(|| "not set".to_string(), |v| format!("`{v}`"));
            let mut what = key.doc.iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ");
            let _ = write!(what, " Env: `{}`.", env_name(key.name));
            if let Some(flag) = key.flag {
                let _ = write!(what, " Flag: `{flag}`.");
            }
            let _ = writeln!(
                out,
                "| `{}` | {} | {default} | {} | {} |",
                key.name,
                key.doc_type,
                (key.describe)().allowed,
                what.replace('|', "\\|")
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A default path that never exists, so tests do not read the machine's /etc.
    const NO_DEFAULT: &str = "/nonexistent/herald-test/herald.toml";

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// A fresh file under the temp dir holding `text`.
    fn file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("herald-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn load_text(name: &str, text: &str) -> Result<Config, ConfigError> {
        let path = file(name, text);
        Config::load_with_default(Path::new(NO_DEFAULT), Some(&path), &[])
    }

    fn load_err(name: &str, text: &str) -> String {
        let e = load_text(name, text).expect_err(text);
        e.to_string()
    }

    fn same_settings(a: &Config, b: &Config) {
        assert_eq!(a.model, b.model);
        assert_eq!(a.audio, b.audio);
        assert_eq!(a.synthesis, b.synthesis);
        assert_eq!(a.voices, b.voices);
        assert_eq!(a.runtime, b.runtime);
        assert_eq!(a.amplifier, b.amplifier);
        assert_eq!(a.log, b.log);
    }

    #[test]
    fn defaults() {
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &[]).unwrap();
        assert_eq!(c.model.bundle, Path::new("/usr/share/herald/bundles/default"));
        assert_eq!(c.audio.device, "default");
        assert_eq!(c.audio.format, SampleFormat::S16);
        assert_eq!(c.audio.volume, 1.0);
        assert_eq!((c.audio.leading_silence_ms, c.audio.trailing_silence_ms), (0, 0));
        assert_eq!((c.audio.fade_ms, c.audio.period_ms, c.audio.buffer_periods), (5, 20, 4));
        assert_eq!(c.synthesis.language, "auto");
        assert_eq!(c.synthesis.speaker, None);
        assert_eq!(c.synthesis.mode, SynthesisMode::Streaming);
        assert_eq!(c.synthesis.sampling, Sampling::Sample);
        assert_eq!(c.synthesis.seed, None);
        assert_eq!(c.synthesis.ramp, vec![2, 4, 8, 16, 25]);
        assert_eq!((c.synthesis.left_context, c.synthesis.kv_capacity), (72, 4096));
        assert_eq!(c.runtime.threads, 0);
        assert_eq!(c.log.level, LogLevel::Info);
        assert_eq!(c.source, vec!["defaults"]);
        assert_eq!(c.file, None);
        assert_eq!(c.origin("audio.volume"), "default");
        assert_eq!(Config::default_path(), Path::new("/etc/herald/herald.toml"));
        same_settings(&c, &Config::default());
    }

    #[test]
    fn default_file_is_read_when_present_and_skipped_when_absent() {
        let path = file("default.toml", "[audio]\nvolume = 0.5\n");
        let c = Config::load_with_default(&path, None, &[]).unwrap();
        assert_eq!(c.audio.volume, 0.5);
        assert_eq!(c.file.as_deref(), Some(path.as_path()));
        assert_eq!(c.source, vec!["defaults".to_string(), format!("file {}", path.display())]);
    }

    #[test]
    fn file_overrides_defaults() {
        let text = "[audio]\ndevice = \"hw:0,0\"\nformat = \"f32\"\nvolume = 1\n\n[synthesis]\nspeaker = \"ryan\"\nseed = 42\n\
                    ramp = [1, 3]\nsampling = \"greedy\"\nmode = \"non-streaming\"\n\n[log]\nlevel = \"debug\"\n";
        let c = load_text("override.toml", text).unwrap();
        assert_eq!(c.audio.device, "hw:0,0");
        assert_eq!(c.audio.format, SampleFormat::F32);
        assert_eq!(c.audio.volume, 1.0, "an integer is accepted for a float");
        assert_eq!(c.synthesis.speaker.as_deref(), Some("ryan"));
        assert_eq!(c.synthesis.seed, Some(42));
        assert_eq!(c.synthesis.ramp, vec![1, 3]);
        assert_eq!(c.synthesis.sampling, Sampling::Greedy);
        assert_eq!(c.synthesis.mode, SynthesisMode::NonStreaming);
        assert_eq!(c.log.level, LogLevel::Debug);
        // untouched keys keep their defaults
        assert_eq!(c.audio.fade_ms, 5);
        assert_eq!(c.synthesis.kv_capacity, 4096);
        assert!(c.origin("audio.device").ends_with("override.toml:2"), "{}", c.origin("audio.device"));
        assert_eq!(c.origin("audio.fade_ms"), "default");
        // an empty file and empty sections are fine
        same_settings(&load_text("empty.toml", "").unwrap(), &Config::default());
        same_settings(&load_text("sections.toml", "[audio]\n[log]\n").unwrap(), &Config::default());
    }

    #[test]
    fn relative_bundle_is_relative_to_the_file() {
        let path = file("rel.toml", "[model]\nbundle = \"bundles/tiny\"\n");
        let c = Config::load_with_default(Path::new(NO_DEFAULT), Some(&path), &[]).unwrap();
        assert_eq!(c.model.bundle, path.parent().unwrap().join("bundles/tiny"));
        let c = load_text("abs.toml", "[model]\nbundle = \"/opt/b\"\n").unwrap();
        assert_eq!(c.model.bundle, Path::new("/opt/b"));
        // from the environment it is relative to the working directory, stored absolute
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_MODEL_BUNDLE", "b")])).unwrap();
        assert_eq!(c.model.bundle, std::env::current_dir().unwrap().join("b"));
    }

    #[test]
    fn env_overrides_file() {
        let path = file("env.toml", "[audio]\nvolume = 0.5\ndevice = \"hw:1\"\n[synthesis]\nspeaker = \"ryan\"\nseed = 7\n");
        let vars = env(&[
            ("HERALD_AUDIO_VOLUME", "1.5"),
            ("HERALD_SYNTHESIS_RAMP", "2,4,8"),
            ("HERALD_SYNTHESIS_SPEAKER", ""),
            ("HERALD_SYNTHESIS_SEED", ""),
            ("HERALD_RUNTIME_THREADS", " 4 "),
            ("HERALD_LOG_LEVEL", "trace"),
            ("HOME", "/root"),
            ("HERALD_HW_PROFILE", "jetson"),
            ("HERALD_TEST_BUNDLES", "/x"),
            ("HERALD_PYTHON", "/usr/bin/python3"),
        ]);
        let c = Config::load_with_default(Path::new(NO_DEFAULT), Some(&path), &vars).unwrap();
        assert_eq!(c.audio.volume, 1.5);
        assert_eq!(c.audio.device, "hw:1", "file value kept where no variable is set");
        assert_eq!(c.synthesis.ramp, vec![2, 4, 8]);
        assert_eq!(c.synthesis.speaker, None, "empty variable = no speaker");
        assert_eq!(c.synthesis.seed, None, "empty variable = no seed");
        assert_eq!(c.runtime.threads, 4);
        assert_eq!(c.log.level, LogLevel::Trace);
        assert_eq!(c.origin("audio.volume"), "env HERALD_AUDIO_VOLUME");
        assert!(c.origin("audio.device").ends_with("env.toml:3"));
        assert!(c.source.contains(&"env HERALD_SYNTHESIS_RAMP".to_string()));
        assert_eq!(c.source[1], format!("file {}", path.display()));
        // a bracketed list is accepted too
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_SYNTHESIS_RAMP", "[ 3, 5 ]")])).unwrap();
        assert_eq!(c.synthesis.ramp, vec![3, 5]);
    }

    #[test]
    fn every_key_has_an_environment_variable() {
        let values = [
            ("model.bundle", "/b"),
            ("audio.device", "hw:0"),
            ("audio.format", "f32"),
            ("audio.volume", "0.25"),
            ("audio.leading_silence_ms", "100"),
            ("audio.trailing_silence_ms", "200"),
            ("audio.fade_ms", "10"),
            ("audio.period_ms", "10"),
            ("audio.buffer_periods", "8"),
            ("synthesis.language", "english"),
            ("synthesis.speaker", "ryan"),
            ("synthesis.mode", "non-streaming"),
            ("synthesis.sampling", "greedy"),
            ("synthesis.seed", "9"),
            ("synthesis.ramp", "4"),
            ("synthesis.left_context", "32"),
            ("synthesis.kv_capacity", "2048"),
            ("runtime.threads", "2"),
            ("runtime.calibration_dir", "/tmp/cal"),
            ("runtime.graph_cache_dir", "/tmp/graphs"),
            ("runtime.frame_pool_mib", "64"),
            ("amplifier.chip", "pinctrl-rp1"),
            ("amplifier.line", "17"),
            ("amplifier.active", "low"),
            ("amplifier.lead_ms", "120"),
            ("log.level", "warn"),
        ];
        let vars: Vec<(String, String)> = values.iter().map(|(k, v)| (env_name(k), v.to_string())).collect();
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &vars).unwrap();
        for (key, value) in values {
            assert_eq!(c.origin(key), format!("env {}", env_name(key)), "{key}");
            let got = c.get(key).unwrap();
            assert_eq!(got.trim_matches('"').trim_matches(|c| c == '[' || c == ']'), value, "{key}");
        }
        // every declared key, at its default written as a variable would give it
        let text = |v: String| v.trim_matches('"').trim_matches(|c| c == '[' || c == ']').to_string();
        let vars: Vec<(String, String)> =
            keys().map(|k| (env_name(k), Config::default().get(k).map(text).unwrap_or_default())).collect();
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &vars).unwrap();
        same_settings(&c, &Config::default());
        for key in keys() {
            assert_eq!(c.origin(key), format!("env {}", env_name(key)), "{key}");
        }
        assert_eq!(env_name("audio.leading_silence_ms"), "HERALD_AUDIO_LEADING_SILENCE_MS");
    }

    /// `[voices.aliases]`: a table in the file (as a section or inline), comma-separated pairs in
    /// a variable, printed inline by `herald config` and read back; a value that is no string
    /// or a pair without `=` names the key.
    #[test]
    fn voice_aliases_from_the_file_the_environment_and_back() {
        let want: BTreeMap<String, String> =
            [("kitchen", "vivian"), ("living room", "ryan")].map(|(a, v)| (a.to_owned(), v.to_owned())).into();
        let c =
            load_text("aliases.toml", "[audio]\nvolume = 0.5\n\n[voices.aliases]\nkitchen = \"vivian\"\n\"living room\" = \"ryan\"\n")
                .unwrap();
        assert_eq!(c.voices.aliases, want);
        assert!(c.origin("voices.aliases").ends_with("aliases.toml:4"), "{}", c.origin("voices.aliases"));
        assert_eq!(c.get("voices.aliases").as_deref(), Some("{ kitchen = \"vivian\", \"living room\" = \"ryan\" }"));
        let inline =
            load_text("aliases-inline.toml", "[voices]\naliases = { kitchen = \"vivian\", \"living room\" = \"ryan\" }\n").unwrap();
        assert_eq!(inline.voices.aliases, want);
        // printed by `herald config` and read back
        let back = load_text("aliases-rt.toml", &c.to_string()).unwrap();
        same_settings(&back, &c);
        // the environment: pairs, braces and quotes allowed, empty for none
        let from_env = |v: &str| Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_VOICES_ALIASES", v)]));
        assert_eq!(from_env("kitchen=vivian, living room = ryan").unwrap().voices.aliases, want);
        assert_eq!(from_env(&c.get("voices.aliases").unwrap()).unwrap().voices.aliases, want);
        for none in ["", " ", "{}"] {
            assert!(from_env(none).unwrap().voices.aliases.is_empty(), "{none:?}");
        }
        assert_eq!(
            from_env("kitchen").unwrap_err().to_string(),
            "env HERALD_VOICES_ALIASES: voices.aliases = \"kitchen\" has \"kitchen\", not a name=voice pair (e.g. kitchen=vivian,alloy=ryan)"
        );
        assert_eq!(
            from_env("a=ryan,a=eric").unwrap_err().to_string(),
            "env HERALD_VOICES_ALIASES: voices.aliases = { a = \"eric\" } names \"a\" twice"
        );
        // the file: only strings
        let e = load_err("aliases-bad.toml", "[voices.aliases]\nkitchen = 3\n");
        assert!(
            e.ends_with(
                "aliases-bad.toml:1: voices.aliases = { kitchen = 3 } has the wrong type (expected a table of strings; kitchen = 3 \
                 is not a string)"
            ),
            "{e}"
        );
        let e = load_err("aliases-bad2.toml", "[voices]\naliases = \"kitchen\"\n");
        assert!(e.ends_with(":2: voices.aliases = \"kitchen\" has the wrong type (expected a table of strings)"), "{e}");
        let e = load_err("aliases-bad3.toml", "[voices]\nalias = {}\n");
        assert!(e.contains("unknown key voices.alias (keys of [voices]: aliases)"), "{e}");
    }

    #[test]
    fn config_file_from_environment() {
        let path = file("from-env.toml", "[audio]\nvolume = 0.3\n");
        let vars = env(&[("HERALD_CONFIG", path.to_str().unwrap())]);
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &vars).unwrap();
        assert_eq!(c.audio.volume, 0.3);
        // --config wins over HERALD_CONFIG
        let other = file("from-flag.toml", "[audio]\nvolume = 0.4\n");
        let c = Config::load_with_default(Path::new(NO_DEFAULT), Some(&other), &vars).unwrap();
        assert_eq!(c.audio.volume, 0.4);
        // an empty HERALD_CONFIG is unset
        let c = Config::load_with_default(&path, None, &env(&[("HERALD_CONFIG", "")])).unwrap();
        assert_eq!(c.audio.volume, 0.3);
        // a missing HERALD_CONFIG file is an error naming it
        let e = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_CONFIG", "/nonexistent/h.toml")])).unwrap_err();
        assert_eq!(e.to_string(), "/nonexistent/h.toml: config file not found (named by HERALD_CONFIG)");
    }

    #[test]
    fn missing_config_file() {
        let e = Config::load_with_default(Path::new(NO_DEFAULT), Some(Path::new("/nonexistent/herald.toml")), &[]).unwrap_err();
        assert!(matches!(e, ConfigError::NotFound { via: "--config", .. }), "{e:?}");
        assert_eq!(e.to_string(), "/nonexistent/herald.toml: config file not found (named by --config)");
        // a directory is not readable as a file
        let dir = std::env::temp_dir();
        let e = Config::load_with_default(Path::new(NO_DEFAULT), Some(&dir), &[]).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains("cannot read config file"), "{e}");
    }

    #[test]
    fn unknown_key_in_each_section() {
        for section in sections() {
            let names = section_keys(section);
            let text = format!("# comment\n[{section}]\nbogus = 1\n");
            let e = load_text(&format!("unknown-{section}.toml"), &text).unwrap_err();
            assert!(matches!(&e, ConfigError::UnknownKey { key, .. } if *key == format!("{section}.bogus")), "{e:?}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("unknown-{section}.toml:3: unknown key {section}.bogus (keys of [{section}]: ")), "{msg}");
            for n in &names {
                assert!(msg.contains(n), "{msg} lists {n}");
            }
        }
        // the keys of the section, in declaration order, starting with these
        let audio = section_keys("audio").join(", ");
        assert!(audio.starts_with("device, format, volume, leading_silence_ms, "), "{audio}");
        let msg = load_err("unknown-audio.toml", "[audio]\nvolume = 1.0\nvolum = 1.0\n");
        assert!(msg.ends_with(&format!("unknown-audio.toml:3: unknown key audio.volum (keys of [audio]: {audio})")), "{msg}");
        // dotted keys and inline tables are checked the same way
        let msg = load_err("dotted.toml", "audio.gain = 1.0\n");
        assert!(msg.ends_with(&format!("dotted.toml:1: unknown key audio.gain (keys of [audio]: {audio})")), "{msg}");
        let msg = load_err("inline.toml", "log = { level = \"info\", colour = true }\n");
        assert!(msg.contains("inline.toml:1: unknown key log.colour"), "{msg}");
    }

    #[test]
    fn unknown_sections_and_top_level_keys() {
        let msg = load_err("gpio.toml", "[audio]\n\n[gpio]\npin = 4\n");
        assert!(
            msg.ends_with(
                "gpio.toml:3: unknown section [gpio] (sections: model, audio, synthesis, voices, text, runtime, amplifier, serve, log)"
            ),
            "{msg}"
        );
        let msg = load_err("top.toml", "volume = 1.0\n");
        assert!(
            msg.ends_with(
                "top.toml:1: key volume is outside any section (settings live in the sections [model], \
                               [audio], [synthesis], [voices], [text], [runtime], [amplifier], [serve], [log])"
            ),
            "{msg}"
        );
        let msg = load_err("notable.toml", "audio = 3\n");
        assert!(msg.ends_with("notable.toml:1: audio = 3 must be a section ([audio])"), "{msg}");
    }

    /// Bad values in a file: `(text, expected message tail)`.
    const BAD: &[(&str, &str)] = &[
        ("[audio]\nvolume = 3.5", "audio.volume = 3.5 is out of range (0.0..=2.0)"),
        ("[audio]\nvolume = -0.1", "audio.volume = -0.1 is out of range (0.0..=2.0)"),
        ("[audio]\nvolume = nan", "audio.volume = nan is out of range (0.0..=2.0)"),
        ("[audio]\nvolume = \"loud\"", "audio.volume = \"loud\" has the wrong type (expected a number)"),
        ("[audio]\nformat = \"u8\"", "audio.format = \"u8\" is not one of: s16, f32"),
        ("[audio]\ndevice = \"\"", "audio.device = \"\" must not be empty"),
        ("[audio]\nleading_silence_ms = 5001", "audio.leading_silence_ms = 5001 is out of range (0..=5000)"),
        ("[audio]\ntrailing_silence_ms = -1", "audio.trailing_silence_ms = -1 is out of range (0..=5000)"),
        ("[audio]\nfade_ms = 101", "audio.fade_ms = 101 is out of range (0..=100)"),
        ("[audio]\nfade_ms = 5.0", "audio.fade_ms = 5.0 has the wrong type (expected an integer)"),
        ("[audio]\nperiod_ms = 4", "audio.period_ms = 4 is out of range (5..=200)"),
        ("[audio]\nperiod_ms = 201", "audio.period_ms = 201 is out of range (5..=200)"),
        ("[audio]\nbuffer_periods = 1", "audio.buffer_periods = 1 is out of range (2..=32)"),
        ("[audio]\nbuffer_periods = 33", "audio.buffer_periods = 33 is out of range (2..=32)"),
        ("[model]\nbundle = \"\"", "model.bundle = \"\" must not be empty"),
        ("[model]\nbundle = 3", "model.bundle = 3 has the wrong type (expected a string)"),
        ("[synthesis]\nlanguage = \"\"", "synthesis.language = \"\" must not be empty"),
        ("[synthesis]\nmode = \"x\"", "synthesis.mode = \"x\" is not one of: streaming, non-streaming"),
        ("[synthesis]\nsampling = \"random\"", "synthesis.sampling = \"random\" is not one of: sample, greedy"),
        ("[synthesis]\nseed = -1", "synthesis.seed = -1 is out of range (0..=9223372036854775807)"),
        ("[synthesis]\nramp = [2, 0, 8]", "synthesis.ramp = [2, 0, 8] has entry 0: each entry must be in 1..=256 frames"),
        ("[synthesis]\nramp = [300]", "synthesis.ramp = [300] has entry 300: each entry must be in 1..=256 frames"),
        ("[synthesis]\nramp = []", "synthesis.ramp = [] must not be empty (chunk sizes in frames, e.g. [2, 4, 8, 16, 25])"),
        ("[synthesis]\nramp = 4", "synthesis.ramp = 4 has the wrong type (expected an array of integers)"),
        ("[synthesis]\nramp = [2, \"a\"]", "synthesis.ramp = [2, \"a\"] has the wrong type (expected an array of integers)"),
        ("[synthesis]\nleft_context = 0", "synthesis.left_context = 0 is out of range (1..=512)"),
        ("[synthesis]\nleft_context = 513", "synthesis.left_context = 513 is out of range (1..=512)"),
        ("[synthesis]\nkv_capacity = 63", "synthesis.kv_capacity = 63 is out of range (64..=65536)"),
        ("[synthesis]\nkv_capacity = 65537", "synthesis.kv_capacity = 65537 is out of range (64..=65536)"),
        ("[runtime]\nthreads = 1000", "runtime.threads = 1000 is out of range (0..=256)"),
        ("[runtime]\nthreads = -1", "runtime.threads = -1 is out of range (0..=256)"),
        ("[runtime]\nframe_pool_mib = \"abc\"", "runtime.frame_pool_mib = \"abc\" has the wrong type (expected an integer)"),
        ("[runtime]\nframe_pool_mib = 65537", "runtime.frame_pool_mib = 65537 is out of range (0..=65536)"),
        ("[runtime]\ncalibration_dir = 3", "runtime.calibration_dir = 3 has the wrong type (expected a string)"),
        ("[amplifier]\nline = 4096", "amplifier.line = 4096 is out of range (0..=4095)"),
        ("[amplifier]\nline = \"17\"", "amplifier.line = \"17\" has the wrong type (expected an integer)"),
        ("[amplifier]\nactive = \"on\"", "amplifier.active = \"on\" is not one of: high, low"),
        ("[amplifier]\nlead_ms = 5001", "amplifier.lead_ms = 5001 is out of range (0..=5000)"),
        ("[log]\nlevel = \"loud\"", "log.level = \"loud\" is not one of: error, warn, info, debug, trace"),
        ("[log]\nlevel = \"INFO\"", "log.level = \"INFO\" is not one of: error, warn, info, debug, trace"),
    ];

    #[test]
    fn bad_values_name_file_line_key_and_range() {
        for (i, (text, tail)) in BAD.iter().enumerate() {
            let name = format!("bad-{i}.toml");
            let text = format!("# herald\n{text}\n");
            let e = load_text(&name, &text).unwrap_err();
            assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
            let msg = e.to_string();
            let path = file(&name, &text);
            assert_eq!(msg, format!("{}:3: {tail}", path.display()), "{text}");
        }
        let range = (ramp(vec![1; 33])).unwrap_err();
        assert_eq!(range.1, "has 33 entries (allowed: 1..=32)");
    }

    #[test]
    fn malformed_toml_names_the_line() {
        let e = load_text("malformed.toml", "[audio]\nvolume = 1.0\ndevice = \"hw:0\n").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { line: Some(3), .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("malformed.toml:3:"), "{msg}");
        assert!(msg.contains("malformed TOML"), "{msg}");
        let e = load_text("dup.toml", "[audio]\nvolume = 1.0\nvolume = 2.0\n").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { line: Some(3), .. }), "{e:?}");
        let e = load_text("noeq.toml", "[log]\n\nlevel \"info\"\n").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { line: Some(3), .. }), "{e:?}");
    }

    #[test]
    fn unknown_environment_variable() {
        let e = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_AUDIO_VOLUM", "1")])).unwrap_err();
        assert!(matches!(&e, ConfigError::UnknownEnv { name } if name == "HERALD_AUDIO_VOLUM"), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "unknown environment variable HERALD_AUDIO_VOLUM: settings are HERALD_<SECTION>_<KEY> (HERALD_MODEL_BUNDLE, "
            ),
            "{msg}"
        );
        assert!(msg.contains("HERALD_AUDIO_VOLUME,"), "{msg}");
        assert!(
            msg.ends_with(
                "also allowed: HERALD_CONFIG, HERALD_HW_PROFILE, HERALD_PYTHON, HERALD_Q4_KERNEL, HERALD_Q4_SPLIT, HERALD_TEST_*"
            ),
            "{msg}"
        );
        // even when the file is fine, and before the file is read
        let e = Config::load_with_default(Path::new(NO_DEFAULT), Some(Path::new("/nonexistent")), &env(&[("HERALD_GPIO_PIN", "4")]))
            .unwrap_err();
        assert!(matches!(e, ConfigError::UnknownEnv { .. }), "{e:?}");
        // names are case-sensitive: other variables are not herald's
        Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("herald_audio_volum", "1")])).unwrap();
    }

    #[test]
    fn environment_parse_errors() {
        let cases = [
            ("HERALD_AUDIO_VOLUME", "abc", "env HERALD_AUDIO_VOLUME: audio.volume = \"abc\" is not a number"),
            ("HERALD_AUDIO_VOLUME", "2.5", "env HERALD_AUDIO_VOLUME: audio.volume = 2.5 is out of range (0.0..=2.0)"),
            ("HERALD_AUDIO_FADE_MS", "5ms", "env HERALD_AUDIO_FADE_MS: audio.fade_ms = \"5ms\" is not an integer"),
            (
                "HERALD_RUNTIME_FRAME_POOL_MIB",
                "abc",
                "env HERALD_RUNTIME_FRAME_POOL_MIB: runtime.frame_pool_mib = \"abc\" is not an integer",
            ),
            ("HERALD_AUDIO_FORMAT", "u8", "env HERALD_AUDIO_FORMAT: audio.format = \"u8\" is not one of: s16, f32"),
            ("HERALD_AUDIO_DEVICE", "", "env HERALD_AUDIO_DEVICE: audio.device = \"\" must not be empty"),
            (
                "HERALD_SYNTHESIS_RAMP",
                "2,x",
                "env HERALD_SYNTHESIS_RAMP: synthesis.ramp = \"2,x\" is not a comma-separated list of integers (e.g. 2,4,8,16,25)",
            ),
            (
                "HERALD_SYNTHESIS_RAMP",
                "",
                "env HERALD_SYNTHESIS_RAMP: synthesis.ramp = [] must not be empty (chunk sizes in frames, e.g. [2, 4, 8, 16, 25])",
            ),
            (
                "HERALD_SYNTHESIS_RAMP",
                "4,0",
                "env HERALD_SYNTHESIS_RAMP: synthesis.ramp = [4, 0] has entry 0: each entry must be in 1..=256 frames",
            ),
            (
                "HERALD_SYNTHESIS_SEED",
                "-3",
                "env HERALD_SYNTHESIS_SEED: synthesis.seed = -3 is out of range (0..=9223372036854775807)",
            ),
            (
                "HERALD_SYNTHESIS_MODE",
                "x",
                "env HERALD_SYNTHESIS_MODE: synthesis.mode = \"x\" is not one of: streaming, non-streaming",
            ),
            ("HERALD_RUNTIME_THREADS", "1000", "env HERALD_RUNTIME_THREADS: runtime.threads = 1000 is out of range (0..=256)"),
            ("HERALD_LOG_LEVEL", "loud", "env HERALD_LOG_LEVEL: log.level = \"loud\" is not one of: error, warn, info, debug, trace"),
        ];
        for (name, value, want) in cases {
            let e = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[(name, value)])).unwrap_err();
            assert_eq!(e.to_string(), want);
        }
    }

    #[test]
    fn cli_overrides_come_last() {
        let vars = env(&[("HERALD_AUDIO_VOLUME", "0.5"), ("HERALD_SYNTHESIS_SPEAKER", "ryan")]);
        let mut c = Config::load_with_default(Path::new(NO_DEFAULT), None, &vars).unwrap();
        c.apply_cli(&CliOverrides { volume: Some(0.75), speaker: Some(String::new()), seed: Some(5), ..Default::default() }).unwrap();
        assert_eq!(c.audio.volume, 0.75);
        assert_eq!(c.synthesis.speaker, None);
        assert_eq!(c.synthesis.seed, Some(5));
        assert_eq!(c.origin("audio.volume"), "command line");
        assert_eq!(c.source.last().map(String::as_str), Some("command line"));
        let e = c.apply_cli(&CliOverrides { volume: Some(3.5), ..Default::default() }).unwrap_err();
        assert_eq!(e.to_string(), "command line: audio.volume = 3.5 is out of range (0.0..=2.0)");
        let e = c.apply_cli(&CliOverrides { ramp: Some(vec![]), ..Default::default() }).unwrap_err();
        assert!(e.to_string().starts_with("command line: synthesis.ramp = [] must not be empty"), "{e}");
        let e = c.apply_cli(&CliOverrides { seed: Some(u64::MAX), ..Default::default() }).unwrap_err();
        assert_eq!(e.to_string(), "command line: synthesis.seed = 18446744073709551615 is out of range (0..=9223372036854775807)");
        let e = c.apply_cli(&CliOverrides { threads: Some(1000), ..Default::default() }).unwrap_err();
        assert_eq!(e.to_string(), "command line: runtime.threads = 1000 is out of range (0..=256)");
        // an empty override changes nothing and adds no source
        let n = c.source.len();
        c.apply_cli(&CliOverrides::default()).unwrap();
        assert_eq!(c.source.len(), n);
        // set(): the generic string form
        c.set("audio.format", "f32", "--set").unwrap();
        assert_eq!(c.audio.format, SampleFormat::F32);
        assert_eq!(c.origin("audio.format"), "--set");
        let e = c.set("audio.gain", "1", "--set").unwrap_err();
        assert!(e.to_string().starts_with("--set: unknown key audio.gain (keys of [audio]: device,"), "{e}");
        let e = c.set("gpio.pin", "1", "--set").unwrap_err();
        assert!(matches!(e, ConfigError::UnknownSection { .. }), "{e:?}");
    }

    #[test]
    fn named_values_parse_and_print() {
        for n in SampleFormat::NAMES {
            assert_eq!(n.parse::<SampleFormat>().unwrap().to_string(), *n);
        }
        for n in SynthesisMode::NAMES {
            assert_eq!(n.parse::<SynthesisMode>().unwrap().as_str(), *n);
        }
        for n in Sampling::NAMES {
            assert_eq!(n.parse::<Sampling>().unwrap().as_str(), *n);
        }
        for n in LogLevel::NAMES {
            assert_eq!(n.parse::<LogLevel>().unwrap().as_str(), *n);
        }
        assert_eq!("u8".parse::<SampleFormat>().unwrap_err().to_string(), "\"u8\" is not one of: s16, f32");
    }

    #[test]
    fn helpers() {
        let mut s = SynthesisConfig { seed: Some(3), ..Default::default() };
        assert_eq!(s.utterance_seed(), Some(3));
        s.seed = None;
        let a = s.utterance_seed().unwrap();
        let b = s.utterance_seed().unwrap();
        assert_ne!(a, b, "fresh seeds differ");
        assert!(SEED.contains(&a) && SEED.contains(&b));
        s.sampling = Sampling::Greedy;
        assert_eq!(s.utterance_seed(), None);
        assert!(RuntimeConfig { threads: 0, ..Default::default() }.effective_threads() >= 1);
        assert_eq!(RuntimeConfig { threads: 3, ..Default::default() }.effective_threads(), 3);
        let l = LogConfig { level: LogLevel::Warn };
        assert_eq!(l.filter(None), "warn");
        assert_eq!(l.filter(Some("")), "warn");
        assert_eq!(l.filter(Some("engine=debug")), "engine=debug");
    }

    /// The audio defaults here are the board's defaults.
    #[test]
    fn board_settings() {
        let c = Config::default();
        assert_eq!(c.alsa_settings(), board::audio::AlsaSettings::default());
        assert_eq!(c.shaper_settings(), board::audio::ShaperSettings::default());
        let mut c = Config::default();
        c.set("audio.format", "f32", "test").unwrap();
        c.set("audio.volume", "0.5", "test").unwrap();
        c.set("audio.buffer_periods", "8", "test").unwrap();
        c.set("audio.leading_silence_ms", "100", "test").unwrap();
        let a = c.alsa_settings();
        assert_eq!((a.format, a.periods), (board::audio::SampleFormat::F32, 8));
        let s = c.shaper_settings();
        assert_eq!((s.gain, s.lead_silence_ms), (0.5, 100));
    }

    #[test]
    fn to_toml_round_trips() {
        for text in ["", "[synthesis]\nspeaker = \"ryan\"\nseed = 9223372036854775807\nramp = [1]\n[audio]\nvolume = 0.1\n"] {
            let c = load_text("rt-src.toml", text).unwrap();
            let printed = c.to_toml();
            let back = load_text("rt.toml", &printed).unwrap();
            same_settings(&c, &back);
            let annotated = c.to_string();
            let back = load_text("rt-annotated.toml", &annotated).unwrap();
            same_settings(&c, &back);
        }
        let c = load_text("rt-src.toml", "[audio]\nvolume = 0.1\n").unwrap();
        assert!(c.to_string().contains("volume = 0.1  # from "), "{c}");
        let printed = Config::default().to_toml();
        assert!(
            printed.starts_with(
                "[model]\nbundle = \"/usr/share/herald/bundles/default\"\nbundles_dir = \"/usr/share/herald/bundles\"\nverify = false\n\n[audio]\n"
            ),
            "{printed}"
        );
        assert!(printed.contains("\nvolume = 1.0\n"), "{printed}");
        assert!(printed.contains("\n# speaker: not set\n"), "{printed}");
        assert!(printed.contains("\nramp = [2, 4, 8, 16, 25]\n"), "{printed}");
    }

    /// Every declared key is printed by `herald config`, read back from a file, and its
    /// neighbour names are refused.
    #[test]
    fn key_list_matches_the_declaration() {
        let mut c = Config::default();
        c.synthesis.speaker = Some("s".into());
        c.synthesis.seed = Some(1);
        c.amplifier.chip = Some("gpiochip-label".into());
        c.serve.api_key = Some("secret".into());
        c.runtime.qnn_lib_dir = Some(PathBuf::from("/usr/lib/qnn"));
        c.runtime.qnn_arch = Some("v73".into());
        c.text.replacements = Some(PathBuf::from("/etc/herald/words.txt"));
        let printed = c.to_toml();
        let table: toml::Table = printed.parse().unwrap();
        let mut printed_keys: Vec<String> = Vec::new();
        for (section, v) in &table {
            for key in v.as_table().unwrap().keys() {
                printed_keys.push(format!("{section}.{key}"));
            }
        }
        let mut all: Vec<String> = keys().map(String::from).collect();
        printed_keys.sort();
        all.sort();
        assert_eq!(printed_keys, all);
        same_settings(&load_text("every-key.toml", &printed).unwrap(), &c);
        let mut names: Vec<&str> = keys().collect();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len(), "keys are unique");
        for key in SETTINGS {
            assert!(c.get(key.name).is_some(), "{}", key.name);
            assert!(!key.doc.is_empty(), "{} has a doc comment", key.name);
            let bogus = format!("[{}]\n{}x = 1\n", key.section(), key.short_name());
            let e = load_text("bogus.toml", &bogus).unwrap_err();
            assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e:?}");
        }
        for (section, doc) in SECTIONS {
            assert!(!doc.is_empty(), "[{section}] has a doc comment");
        }
    }

    /// The flags named in the declaration exist on some command.
    #[test]
    fn declared_flags_exist() {
        use clap::CommandFactory;
        let cli = crate::Cli::command();
        let longs: Vec<String> =
            cli.get_subcommands().flat_map(|c| c.get_arguments().filter_map(|a| a.get_long().map(|l| format!("--{l}")))).collect();
        for key in SETTINGS {
            if let Some(flag) = key.flag {
                assert!(longs.iter().any(|l| l == flag), "{}: no command has {flag}", key.name);
            }
        }
    }

    /// The ```toml blocks of a markdown text.
    fn toml_blocks(md: &str) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        let mut current: Option<(usize, String)> = None;
        for (n, line) in md.lines().enumerate() {
            match &mut current {
                None if line.trim_start().starts_with("```toml") => current = Some((n + 1, String::new())),
                Some(_) if line.trim_start().starts_with("```") => out.extend(current.take()),
                Some((_, text)) => {
                    text.push_str(line);
                    text.push('\n');
                }
                None => {}
            }
        }
        out
    }

    /// docs/config.md: its full example (the first ```toml block) is every key at its default
    /// (the optional ones as `# key: not set` comments), and every other ```toml block parses.
    #[test]
    fn docs_example_parses_exactly() {
        let md = include_str!("../../docs/config.md");
        let blocks = toml_blocks(md);
        assert!(!blocks.is_empty(), "docs/config.md has no ```toml block");
        let (line, full) = &blocks[0];
        let c = load_text("docs-full.toml", full).unwrap_or_else(|e| panic!("docs/config.md:{line}: {e}"));
        same_settings(&c, &Config::default());
        // every key is in the example: set, or commented out as `# key = …` or `# key: not set`
        let mut section = "";
        let mut seen = Vec::new();
        for l in full.lines() {
            let t = l.trim();
            if let Some(s) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
                section = sections().into_iter().find(|n| *n == s).unwrap_or("");
            } else if let Some((k, _)) =
                t.trim_start_matches("# ").split_once(" = ").or_else(|| t.strip_prefix("# ")?.split_once(": not set"))
            {
                let key = format!("{section}.{}", k.trim());
                if setting(&key).is_some() {
                    seen.push(key);
                }
            }
        }
        for key in keys() {
            assert!(seen.iter().any(|s| s == key), "docs/config.md's full example lacks {key}");
        }
        // the reference mentions every key and its variable
        for key in keys() {
            assert!(md.contains(&format!("`{key}`")), "docs/config.md does not describe `{key}`");
            assert!(md.contains(&env_name(key)), "docs/config.md does not name {}", env_name(key));
        }
        for (line, block) in &blocks[1..] {
            load_text("docs-block.toml", block).unwrap_or_else(|e| panic!("docs/config.md:{line}: {e}"));
        }
    }

    /// Replace the text between `<!-- generated: NAME ... -->` and the next
    /// `<!-- end generated -->` of `md` with `body`.
    fn replace_generated(md: &str, name: &str, body: &str) -> String {
        let open = format!("<!-- generated: {name} ");
        let start = md.find(&open).unwrap_or_else(|| panic!("docs/config.md has no {open}... -->"));
        let start = start + md[start..].find("-->\n").unwrap() + 4;
        let end = start + md[start..].find("<!-- end generated -->").unwrap();
        format!("{}{body}{}", &md[..start], &md[end..])
    }

    /// docs/config.md's "The file" names every section of the declaration, `[serve]` included.
    #[test]
    fn docs_name_every_section() {
        let md = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config.md")).unwrap();
        let list = md.split("Keys live in the sections").nth(1).and_then(|r| r.split(".\n").next()).unwrap();
        for section in sections() {
            assert!(list.contains(&format!("`[{section}]`")), "docs/config.md's list of sections lacks [{section}]: {list}");
        }
    }

    /// docs/config.md's full example and key tables are made from the declaration: this test
    /// fails while the page differs. Refresh it with
    /// `HERALD_TEST_BLESS=1 cargo test --workspace config::tests::docs_are_generated`.
    #[test]
    fn docs_are_generated() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config.md");
        let md = std::fs::read_to_string(&path).unwrap();
        let example = format!("```toml\n{}```\n", Config::default().to_toml());
        let want = replace_generated(&md, "example", &example);
        let want = replace_generated(&want, "keys", &markdown_keys());
        if want == md {
            return;
        }
        if std::env::var_os("HERALD_TEST_BLESS").is_some_and(|v| v == "1") {
            std::fs::write(&path, &want).unwrap();
            return;
        }
        let (n, (have, should)) = md.lines().zip(want.lines()).enumerate().find(|(_, (a, b))| a != b).unwrap_or((0, ("", "")));
        panic!(
            "docs/config.md differs from the declaration in app/src/config.rs at line {}:\n  docs: {have}\n  code: {should}\n\
             refresh it with HERALD_TEST_BLESS=1 cargo test --workspace config::tests::docs_are_generated",
            n + 1
        );
    }
}

//! herald's configuration (reference: docs/config.md).
//!
//! Sources, lowest to highest precedence: built-in defaults < the config file < `HERALD_*`
//! environment variables < command-line flags. [`Config::load`] applies the first three; the
//! binary applies its flags afterwards with [`Config::apply_cli`] (or [`Config::set`]).
//!
//! Every value goes through one path: a source produces a `Layer`-shaped set of raw values
//! (the file through serde with `deny_unknown_fields`, the environment and the command line by
//! hand), and `Config::merge` checks each value (type, range, allowed names) and records where
//! it came from, so that an error names the source (file and line, variable, command line), the
//! key, the value and what is allowed.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::ops::{Range, RangeInclusive};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer};

/// The config file read when neither `--config` nor `HERALD_CONFIG` names one (if it exists).
pub const DEFAULT_PATH: &str = "/etc/herald/herald.toml";
/// Default `model.bundle`.
pub const DEFAULT_BUNDLE: &str = "/usr/share/herald/bundles/default";
/// Environment variable naming the config file (like `--config`, which wins over it).
pub const CONFIG_ENV: &str = "HERALD_CONFIG";
/// `HERALD_*` variables that are not settings but are used by herald or its tooling, so that
/// they are not rejected as unknown settings.
pub const ENV_ALLOWED: &[&str] = &[CONFIG_ENV, "HERALD_HW_PROFILE", "HERALD_PYTHON"];
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
/// `runtime.threads` (0 = one per available core).
pub const THREADS: RangeInclusive<usize> = 0..=256;
/// `runtime.frame_pool_mib`: MiB each worker stage's frame pool may keep.
pub const FRAME_POOL_MIB: RangeInclusive<usize> = 0..=65536;
/// Default `runtime.frame_pool_mib` (engine::DEFAULT_POOL_BYTES).
pub const DEFAULT_FRAME_POOL_MIB: usize = engine::DEFAULT_POOL_BYTES >> 20;
/// Default `runtime.calibration_dir`.
pub const DEFAULT_CALIBRATION_DIR: &str = "/var/lib/herald/calibration";
/// `amplifier.line`: line offset within the chip.
pub const AMP_LINE: RangeInclusive<u32> = 0..=4095;
/// `amplifier.lead_ms`: how long before the first sample the amplifier is enabled.
pub const AMP_LEAD_MS: RangeInclusive<u32> = 0..=5000;

/// Every key, `section.name`, in documentation order. Sections are the prefixes, in this order.
pub const KEYS: &[&str] = &[
    "model.bundle",
    "audio.device",
    "audio.format",
    "audio.volume",
    "audio.leading_silence_ms",
    "audio.trailing_silence_ms",
    "audio.fade_ms",
    "audio.period_ms",
    "audio.buffer_periods",
    "synthesis.language",
    "synthesis.speaker",
    "synthesis.mode",
    "synthesis.sampling",
    "synthesis.seed",
    "synthesis.ramp",
    "synthesis.left_context",
    "synthesis.kv_capacity",
    "runtime.threads",
    "runtime.calibration_dir",
    "runtime.frame_pool_mib",
    "amplifier.chip",
    "amplifier.line",
    "amplifier.active",
    "amplifier.lead_ms",
    "log.level",
];

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
    let mut out: Vec<&'static str> = Vec::new();
    for key in KEYS {
        let (section, _) = key.split_once('.').unwrap_or((key, ""));
        if !out.contains(&section) {
            out.push(section);
        }
    }
    out
}

/// The key names of `section` (without the `section.` prefix), in documentation order.
pub fn section_keys(section: &str) -> Vec<&'static str> {
    KEYS.iter().filter_map(|k| k.split_once('.').filter(|(s, _)| *s == section).map(|(_, n)| n)).collect()
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

/// Every key, `section.name`, in documentation order ([`KEYS`]).
pub fn keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter().copied()
}

/// The environment variable of a key: `audio.volume` → `HERALD_AUDIO_VOLUME`.
pub fn env_name(key: &str) -> String {
    format!("HERALD_{}", key.replace('.', "_").to_ascii_uppercase())
}

fn env_names() -> Vec<String> {
    keys().map(env_name).collect()
}

/// The static key for a `section.name` string.
fn static_key(key: &str) -> Option<&'static str> {
    keys().find(|k| *k == key)
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
    /// `synthesis.mode`: how the text enters the model.
    SynthesisMode {
        /// Only the first text token is in the prefill, the rest is fed one per frame.
        Streaming = "streaming",
        /// The whole text is in the prefill.
        NonStreaming = "non-streaming",
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
// The configuration

/// `[model]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Bundle directory (holds `bundle.toml`).
    pub bundle: PathBuf,
}

/// `[audio]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioConfig {
    /// ALSA PCM name.
    pub device: String,
    /// Sample format written to the device.
    pub format: SampleFormat,
    /// Linear gain, [`VOLUME`].
    pub volume: f64,
    /// Silence before each utterance, ms ([`SILENCE_MS`]).
    pub leading_silence_ms: u32,
    /// Silence after each utterance, ms ([`SILENCE_MS`]).
    pub trailing_silence_ms: u32,
    /// Fade-in and fade-out length, ms ([`FADE_MS`]).
    pub fade_ms: u32,
    /// ALSA period, ms ([`PERIOD_MS`]).
    pub period_ms: u32,
    /// ALSA buffer length in periods ([`BUFFER_PERIODS`]).
    pub buffer_periods: u32,
}

/// `[synthesis]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthesisConfig {
    /// `auto` or a language name of the bundle.
    pub language: String,
    /// A speaker name of the bundle; `None`: no speaker.
    pub speaker: Option<String>,
    /// How the text enters the model.
    pub mode: SynthesisMode,
    /// Sampling or greedy decoding.
    pub sampling: Sampling,
    /// Sampling seed; `None`: a fresh seed per utterance ([`SynthesisConfig::utterance_seed`]).
    pub seed: Option<u64>,
    /// Vocoder chunk sizes in frames, the last repeated.
    pub ramp: Vec<usize>,
    /// Vocoder left context in frames.
    pub left_context: usize,
    /// Talker KV cache capacity in positions (prompt + frames).
    pub kv_capacity: usize,
}

/// `[runtime]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeConfig {
    /// Compute threads; 0 = one per available core ([`RuntimeConfig::effective_threads`]).
    pub threads: usize,
    /// Directory of the calibration files (`<fingerprint>.json`, `herald calibrate`).
    pub calibration_dir: PathBuf,
    /// MiB of freed blocks the decode and the vocoder stage's frame pools may each keep
    /// (engine::pool; 0: no pooling).
    pub frame_pool_mib: usize,
}

/// `[amplifier]`: the optional amplifier-enable GPIO line.
#[derive(Debug, Clone, PartialEq)]
pub struct AmplifierConfig {
    /// Label of the GPIO chip (`pinctrl-rp1` on a Pi 5); `None`: no amplifier line.
    pub chip: Option<String>,
    /// Line offset within the chip.
    pub line: u32,
    /// The level that enables the amplifier.
    pub active: ActiveLevel,
    /// Milliseconds the line is enabled before the first sample is written.
    pub lead_ms: u32,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    /// Log level; `RUST_LOG`, when set, wins ([`LogConfig::filter`]).
    pub level: LogLevel,
}

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[model]`.
    pub model: ModelConfig,
    /// `[audio]`.
    pub audio: AudioConfig,
    /// `[synthesis]`.
    pub synthesis: SynthesisConfig,
    /// `[runtime]`.
    pub runtime: RuntimeConfig,
    /// `[amplifier]`.
    pub amplifier: AmplifierConfig,
    /// `[log]`.
    pub log: LogConfig,
    /// The sources applied, in order: `defaults`, `file PATH`, `env HERALD_…` (one per
    /// variable), `command line`. For `herald info` and the startup log.
    pub source: Vec<String>,
    /// The config file that was read, if any.
    pub file: Option<PathBuf>,
    /// Where each key not at its default came from (`file:line`, `env HERALD_…`, `command line`).
    origins: BTreeMap<&'static str, String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { bundle: PathBuf::from(DEFAULT_BUNDLE) }
    }
}

impl Default for AudioConfig {
    fn default() -> Self {
        AudioConfig {
            device: "default".into(),
            format: SampleFormat::S16,
            volume: 1.0,
            leading_silence_ms: 0,
            trailing_silence_ms: 0,
            fade_ms: 5,
            period_ms: 20,
            buffer_periods: 4,
        }
    }
}

impl Default for SynthesisConfig {
    fn default() -> Self {
        SynthesisConfig {
            language: "auto".into(),
            speaker: None,
            mode: SynthesisMode::Streaming,
            sampling: Sampling::Sample,
            seed: None,
            ramp: vec![2, 4, 8, 16, 25],
            left_context: 72,
            kv_capacity: 4096,
        }
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { threads: 0, calibration_dir: PathBuf::from(DEFAULT_CALIBRATION_DIR), frame_pool_mib: DEFAULT_FRAME_POOL_MIB }
    }
}

impl Default for AmplifierConfig {
    fn default() -> Self {
        AmplifierConfig { chip: None, line: 0, active: ActiveLevel::High, lead_ms: 50 }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { level: LogLevel::Info }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            model: ModelConfig::default(),
            audio: AudioConfig::default(),
            synthesis: SynthesisConfig::default(),
            runtime: RuntimeConfig::default(),
            amplifier: AmplifierConfig::default(),
            log: LogConfig::default(),
            source: vec!["defaults".into()],
            file: None,
            origins: BTreeMap::new(),
        }
    }
}

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
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    // SplitMix64 finalizer over time and counter.
    let mut z = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) & *SEED.end()
}

impl RuntimeConfig {
    /// The thread count to use: `threads`, or for 0 the available parallelism (at least 1).
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

/// Command-line overrides, applied last by [`Config::apply_cli`]. `None` leaves a value alone.
/// Values are checked like every other source (`command line: audio.volume = 3.5 is out of …`).
#[derive(Debug, Clone, Default)]
pub struct CliOverrides {
    /// `model.bundle`.
    pub bundle: Option<PathBuf>,
    /// `audio.device`.
    pub device: Option<String>,
    /// `audio.format`.
    pub format: Option<SampleFormat>,
    /// `audio.volume`.
    pub volume: Option<f64>,
    /// `audio.leading_silence_ms`.
    pub leading_silence_ms: Option<u32>,
    /// `audio.trailing_silence_ms`.
    pub trailing_silence_ms: Option<u32>,
    /// `audio.fade_ms`.
    pub fade_ms: Option<u32>,
    /// `audio.period_ms`.
    pub period_ms: Option<u32>,
    /// `audio.buffer_periods`.
    pub buffer_periods: Option<u32>,
    /// `synthesis.language`.
    pub language: Option<String>,
    /// `synthesis.speaker`; `Some("")` clears it.
    pub speaker: Option<String>,
    /// `synthesis.mode`.
    pub mode: Option<SynthesisMode>,
    /// `synthesis.sampling`.
    pub sampling: Option<Sampling>,
    /// `synthesis.seed`.
    pub seed: Option<u64>,
    /// `synthesis.ramp`.
    pub ramp: Option<Vec<usize>>,
    /// `synthesis.left_context`.
    pub left_context: Option<usize>,
    /// `synthesis.kv_capacity`.
    pub kv_capacity: Option<usize>,
    /// `runtime.threads`.
    pub threads: Option<usize>,
    /// `log.level`.
    pub log_level: Option<LogLevel>,
}

// ---------------------------------------------------------------------------------------------
// Raw values of one source

/// The raw values of one source, before checks: what a config file may contain. Names stay
/// strings and integers stay `i64` so that [`Config::merge`] reports every bad value the same
/// way, with its source.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Layer {
    model: ModelLayer,
    audio: AudioLayer,
    synthesis: SynthesisLayer,
    runtime: RuntimeLayer,
    amplifier: AmplifierLayer,
    log: LogLayer,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct ModelLayer {
    bundle: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AudioLayer {
    device: Option<String>,
    format: Option<String>,
    volume: Option<f64>,
    leading_silence_ms: Option<i64>,
    trailing_silence_ms: Option<i64>,
    fade_ms: Option<i64>,
    period_ms: Option<i64>,
    buffer_periods: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct SynthesisLayer {
    language: Option<String>,
    /// `Some("")` clears the speaker.
    speaker: Option<String>,
    mode: Option<String>,
    sampling: Option<String>,
    /// `Some(None)` clears the seed (an empty `HERALD_SYNTHESIS_SEED`); TOML cannot say that.
    #[serde(deserialize_with = "present")]
    seed: Option<Option<i64>>,
    ramp: Option<Vec<i64>>,
    left_context: Option<i64>,
    kv_capacity: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RuntimeLayer {
    threads: Option<i64>,
    calibration_dir: Option<String>,
    frame_pool_mib: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AmplifierLayer {
    /// `Some("")` clears the chip.
    chip: Option<String>,
    line: Option<i64>,
    active: Option<String>,
    lead_ms: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct LogLayer {
    level: Option<String>,
}

/// A key that is present in the file holds a value.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<i64>>, D::Error> {
    i64::deserialize(d).map(|v| Some(Some(v)))
}

/// What the type of a key is, for "wrong type" and parse messages.
fn expected(key: &str) -> &'static str {
    match key {
        "audio.volume" => "a number",
        "synthesis.ramp" => "an array of integers",
        "audio.leading_silence_ms"
        | "audio.trailing_silence_ms"
        | "audio.fade_ms"
        | "audio.period_ms"
        | "audio.buffer_periods"
        | "synthesis.seed"
        | "synthesis.left_context"
        | "synthesis.kv_capacity"
        | "runtime.threads"
        | "runtime.frame_pool_mib"
        | "amplifier.line"
        | "amplifier.lead_ms" => "an integer",
        _ => "a string",
    }
}

/// A bad value: (the value as given, what is wrong with it).
type Bad = (String, String);

fn quoted(s: &str) -> String {
    format!("{s:?}")
}

fn render_f64(v: f64) -> String {
    toml::Value::Float(v).to_string()
}

fn range_text<T: fmt::Display>(r: &RangeInclusive<T>) -> String {
    format!("{}..={}", r.start(), r.end())
}

fn text(v: String) -> Result<String, Bad> {
    if v.trim().is_empty() { Err((quoted(&v), "must not be empty".into())) } else { Ok(v) }
}

fn name<E: FromStr<Err = UnknownName>>(v: String) -> Result<E, Bad> {
    v.parse::<E>().map_err(|e| (quoted(&v), format!("is not one of: {}", e.allowed.join(", "))))
}

fn float_in(v: f64, r: &RangeInclusive<f64>) -> Result<f64, Bad> {
    if v.is_finite() && r.contains(&v) {
        Ok(v)
    } else {
        Err((render_f64(v), format!("is out of range ({:?}..={:?})", r.start(), r.end())))
    }
}

fn int_in<T: Copy + PartialOrd + fmt::Display + TryFrom<i64>>(v: i64, r: &RangeInclusive<T>) -> Result<T, Bad> {
    match T::try_from(v) {
        Ok(t) if r.contains(&t) => Ok(t),
        _ => Err((v.to_string(), format!("is out of range ({})", range_text(r)))),
    }
}

fn ramp(v: Vec<i64>) -> Result<Vec<usize>, Bad> {
    let shown = format!("[{}]", v.iter().map(i64::to_string).collect::<Vec<_>>().join(", "));
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
                return Err((
                    shown,
                    format!("has entry {x}: each entry must be in {} frames", range_text(&RAMP_FRAMES)),
                ));
            }
        }
    }
    Ok(out)
}

/// Parse an environment or `--set` value for `key` into `layer`.
fn parse_into(layer: &mut Layer, key: &'static str, raw: &str) -> Result<(), Bad> {
    let int = || -> Result<i64, Bad> {
        raw.trim().parse::<i64>().map_err(|_| (quoted(raw), format!("is not {}", expected(key))))
    };
    let s = || Some(raw.to_string());
    match key {
        "model.bundle" => layer.model.bundle = s(),
        "audio.device" => layer.audio.device = s(),
        "audio.format" => layer.audio.format = s(),
        "audio.volume" => {
            let v = raw.trim().parse::<f64>().map_err(|_| (quoted(raw), "is not a number".to_string()))?;
            layer.audio.volume = Some(v);
        }
        "audio.leading_silence_ms" => layer.audio.leading_silence_ms = Some(int()?),
        "audio.trailing_silence_ms" => layer.audio.trailing_silence_ms = Some(int()?),
        "audio.fade_ms" => layer.audio.fade_ms = Some(int()?),
        "audio.period_ms" => layer.audio.period_ms = Some(int()?),
        "audio.buffer_periods" => layer.audio.buffer_periods = Some(int()?),
        "synthesis.language" => layer.synthesis.language = s(),
        "synthesis.speaker" => layer.synthesis.speaker = s(),
        "synthesis.mode" => layer.synthesis.mode = s(),
        "synthesis.sampling" => layer.synthesis.sampling = s(),
        "synthesis.seed" => layer.synthesis.seed = Some(if raw.trim().is_empty() { None } else { Some(int()?) }),
        "synthesis.ramp" => {
            let inner = raw.trim();
            let inner = inner.strip_prefix('[').and_then(|i| i.strip_suffix(']')).unwrap_or(inner).trim();
            let list = if inner.is_empty() {
                Vec::new()
            } else {
                inner.split(',').map(|x| x.trim().parse::<i64>()).collect::<Result<Vec<_>, _>>().map_err(|_| {
                    (quoted(raw), "is not a comma-separated list of integers (e.g. 2,4,8,16,25)".to_string())
                })?
            };
            layer.synthesis.ramp = Some(list);
        }
        "synthesis.left_context" => layer.synthesis.left_context = Some(int()?),
        "synthesis.kv_capacity" => layer.synthesis.kv_capacity = Some(int()?),
        "runtime.threads" => layer.runtime.threads = Some(int()?),
        "runtime.calibration_dir" => layer.runtime.calibration_dir = s(),
        "runtime.frame_pool_mib" => layer.runtime.frame_pool_mib = Some(int()?),
        "amplifier.chip" => layer.amplifier.chip = s(),
        "amplifier.line" => layer.amplifier.line = Some(int()?),
        "amplifier.active" => layer.amplifier.active = s(),
        "amplifier.lead_ms" => layer.amplifier.lead_ms = Some(int()?),
        "log.level" => layer.log.level = s(),
        _ => return Err((quoted(raw), "is not a setting".into())),
    }
    Ok(())
}

fn wide<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

// ---------------------------------------------------------------------------------------------
// The config file

/// Where a key stands in the file.
struct Place {
    key: &'static str,
    line: usize,
    value: Range<usize>,
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Check the file's sections and keys against [`KEYS`] (so that an unknown key is reported
/// with its line and the keys of its section) and note where each key stands.
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
            match static_key(&full) {
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
    pub fn load_with_default(
        default_path: &Path,
        explicit: Option<&Path>,
        env: &[(String, String)],
    ) -> Result<Config, ConfigError> {
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
            let key =
                keys().find(|k| env_name(k) == *name).ok_or_else(|| ConfigError::UnknownEnv { name: name.clone() })?;
            settings.push((key, name, value));
        }
        settings.sort_by_key(|(_, name, _)| *name);

        let config_env =
            env.iter().rev().find(|(n, _)| n == CONFIG_ENV).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
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

    /// Apply a config file's text (`path` is for messages and relative bundle paths).
    ///
    /// # Errors
    /// Malformed TOML, unknown sections or keys, bad values.
    pub fn merge_file(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let places = places(path, text)?;
        let layer: Layer = toml::from_str(text).map_err(|e| {
            let start = e.span().map_or(0, |s| s.start);
            match places.iter().find(|p| p.value.contains(&start) || p.value.start == start) {
                Some(p) => ConfigError::Invalid {
                    origin: format!("{}:{}", path.display(), p.line),
                    key: p.key.to_string(),
                    value: text.get(p.value.clone()).unwrap_or("").trim().to_string(),
                    problem: format!("has the wrong type (expected {})", expected(p.key)),
                },
                None => {
                    let (line, column) = e.span().map(|s| line_col(text, s.start)).unzip();
                    ConfigError::Syntax { path: path.to_owned(), line, column, message: e.message().trim().to_string() }
                }
            }
        })?;
        let lines: BTreeMap<&str, usize> = places.iter().map(|p| (p.key, p.line)).collect();
        let origin = |key: &str| format!("{}:{}", path.display(), lines.get(key).copied().unwrap_or(0));
        // A relative bundle path in a file is relative to the file's directory.
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
        let Some(k) = static_key(key) else {
            let (section, _) = key.split_once('.').unwrap_or((key, ""));
            return Err(if sections().contains(&section) {
                ConfigError::UnknownKey { origin: origin.into(), key: key.into(), section: section.into() }
            } else {
                ConfigError::UnknownSection { origin: origin.into(), name: section.into() }
            });
        };
        let mut layer = Layer::default();
        parse_into(&mut layer, k, value).map_err(|(value, problem)| ConfigError::Invalid {
            origin: origin.into(),
            key: k.into(),
            value,
            problem,
        })?;
        self.merge(layer, &|_| origin.to_string(), None)?;
        self.source.push(origin.to_string());
        Ok(())
    }

    /// Apply command-line flags (highest precedence), checked like the other sources.
    ///
    /// # Errors
    /// A value out of range (`command line: audio.volume = 3.5 is out of range (0.0..=2.0)`).
    pub fn apply_cli(&mut self, cli: &CliOverrides) -> Result<(), ConfigError> {
        const ORIGIN: &str = "command line";
        let seed = match cli.seed {
            Some(s) => Some(Some(i64::try_from(s).map_err(|_| ConfigError::Invalid {
                origin: ORIGIN.into(),
                key: "synthesis.seed".into(),
                value: s.to_string(),
                problem: format!("is out of range ({})", range_text(&SEED)),
            })?)),
            None => None,
        };
        let layer = Layer {
            model: ModelLayer { bundle: cli.bundle.as_ref().map(|p| p.to_string_lossy().into_owned()) },
            audio: AudioLayer {
                device: cli.device.clone(),
                format: cli.format.map(|f| f.as_str().into()),
                volume: cli.volume,
                leading_silence_ms: cli.leading_silence_ms.map(i64::from),
                trailing_silence_ms: cli.trailing_silence_ms.map(i64::from),
                fade_ms: cli.fade_ms.map(i64::from),
                period_ms: cli.period_ms.map(i64::from),
                buffer_periods: cli.buffer_periods.map(i64::from),
            },
            synthesis: SynthesisLayer {
                language: cli.language.clone(),
                speaker: cli.speaker.clone(),
                mode: cli.mode.map(|m| m.as_str().into()),
                sampling: cli.sampling.map(|s| s.as_str().into()),
                seed,
                ramp: cli.ramp.as_ref().map(|r| r.iter().copied().map(wide).collect()),
                left_context: cli.left_context.map(wide),
                kv_capacity: cli.kv_capacity.map(wide),
            },
            runtime: RuntimeLayer { threads: cli.threads.map(wide), calibration_dir: None, frame_pool_mib: None },
            amplifier: AmplifierLayer::default(),
            log: LogLayer { level: cli.log_level.map(|l| l.as_str().into()) },
        };
        if self.merge(layer, &|_| ORIGIN.to_string(), None)? > 0 {
            self.source.push(ORIGIN.into());
        }
        Ok(())
    }

    /// Check and apply one source's raw values; returns how many keys it set.
    fn merge(&mut self, l: Layer, origin: &dyn Fn(&str) -> String, base: Option<&Path>) -> Result<usize, ConfigError> {
        let mut set = Vec::<&'static str>::new();
        macro_rules! take {
            ($raw:expr, $key:literal, $check:expr => $dst:expr) => {
                if let Some(v) = $raw {
                    $dst = $check(v).map_err(|(value, problem): Bad| ConfigError::Invalid {
                        origin: origin($key),
                        key: $key.into(),
                        value,
                        problem,
                    })?;
                    set.push($key);
                }
            };
        }
        take!(l.model.bundle, "model.bundle", |v: String| text(v).map(|v| {
            let p = PathBuf::from(v);
            let p = match base {
                Some(d) if p.is_relative() => d.join(p),
                _ => p,
            };
            // absolute, so `herald config` prints a path that means the same from anywhere
            std::path::absolute(&p).unwrap_or(p)
        }) => self.model.bundle);
        take!(l.audio.device, "audio.device", text => self.audio.device);
        take!(l.audio.format, "audio.format", name => self.audio.format);
        take!(l.audio.volume, "audio.volume", |v| float_in(v, &VOLUME) => self.audio.volume);
        take!(l.audio.leading_silence_ms, "audio.leading_silence_ms", |v| int_in(v, &SILENCE_MS) => self.audio.leading_silence_ms);
        take!(l.audio.trailing_silence_ms, "audio.trailing_silence_ms", |v| int_in(v, &SILENCE_MS) => self.audio.trailing_silence_ms);
        take!(l.audio.fade_ms, "audio.fade_ms", |v| int_in(v, &FADE_MS) => self.audio.fade_ms);
        take!(l.audio.period_ms, "audio.period_ms", |v| int_in(v, &PERIOD_MS) => self.audio.period_ms);
        take!(l.audio.buffer_periods, "audio.buffer_periods", |v| int_in(v, &BUFFER_PERIODS) => self.audio.buffer_periods);
        take!(l.synthesis.language, "synthesis.language", text => self.synthesis.language);
        take!(l.synthesis.speaker, "synthesis.speaker", |v: String| Ok::<_, Bad>(Some(v).filter(|s| !s.is_empty())) => self.synthesis.speaker);
        take!(l.synthesis.mode, "synthesis.mode", name => self.synthesis.mode);
        take!(l.synthesis.sampling, "synthesis.sampling", name => self.synthesis.sampling);
        take!(l.synthesis.seed, "synthesis.seed", |v: Option<i64>| v.map(|s| int_in(s, &SEED)).transpose() => self.synthesis.seed);
        take!(l.synthesis.ramp, "synthesis.ramp", ramp => self.synthesis.ramp);
        take!(l.synthesis.left_context, "synthesis.left_context", |v| int_in(v, &LEFT_CONTEXT) => self.synthesis.left_context);
        take!(l.synthesis.kv_capacity, "synthesis.kv_capacity", |v| int_in(v, &KV_CAPACITY) => self.synthesis.kv_capacity);
        take!(l.runtime.threads, "runtime.threads", |v| int_in(v, &THREADS) => self.runtime.threads);
        take!(l.runtime.frame_pool_mib, "runtime.frame_pool_mib", |v| int_in(v, &FRAME_POOL_MIB) => self.runtime.frame_pool_mib);
        take!(l.runtime.calibration_dir, "runtime.calibration_dir", |v: String| text(v).map(|v| {
            let p = PathBuf::from(v);
            let p = match base {
                Some(d) if p.is_relative() => d.join(p),
                _ => p,
            };
            std::path::absolute(&p).unwrap_or(p)
        }) => self.runtime.calibration_dir);
        take!(l.amplifier.chip, "amplifier.chip", |v: String| Ok::<_, Bad>(Some(v).filter(|s| !s.is_empty())) => self.amplifier.chip);
        take!(l.amplifier.line, "amplifier.line", |v| int_in(v, &AMP_LINE) => self.amplifier.line);
        take!(l.amplifier.active, "amplifier.active", name => self.amplifier.active);
        take!(l.amplifier.lead_ms, "amplifier.lead_ms", |v| int_in(v, &AMP_LEAD_MS) => self.amplifier.lead_ms);
        take!(l.log.level, "log.level", name => self.log.level);
        for key in &set {
            self.origins.insert(key, origin(key));
        }
        Ok(set.len())
    }

    /// Where `key` got its value: `default`, `FILE:LINE`, `env HERALD_…` or `command line`.
    pub fn origin(&self, key: &str) -> &str {
        self.origins.get(key).map_or("default", String::as_str)
    }

    /// The value of `key` as TOML (`"default"`, `1.0`, `[2, 4]`); `None` for an unknown key or
    /// an unset optional one.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn get(&self, key: &str) -> Option<String> {
        self.value(key).map(|v| v.to_string())
    }

    fn value(&self, key: &str) -> Option<toml::Value> {
        use toml::Value as V;
        let s = |s: &str| Some(V::String(s.to_string()));
        let i = |n: i64| Some(V::Integer(n));
        match key {
            "model.bundle" => s(&self.model.bundle.to_string_lossy()),
            "audio.device" => s(&self.audio.device),
            "audio.format" => s(self.audio.format.as_str()),
            "audio.volume" => Some(V::Float(self.audio.volume)),
            "audio.leading_silence_ms" => i(self.audio.leading_silence_ms.into()),
            "audio.trailing_silence_ms" => i(self.audio.trailing_silence_ms.into()),
            "audio.fade_ms" => i(self.audio.fade_ms.into()),
            "audio.period_ms" => i(self.audio.period_ms.into()),
            "audio.buffer_periods" => i(self.audio.buffer_periods.into()),
            "synthesis.language" => s(&self.synthesis.language),
            "synthesis.speaker" => self.synthesis.speaker.as_deref().and_then(s),
            "synthesis.mode" => s(self.synthesis.mode.as_str()),
            "synthesis.sampling" => s(self.synthesis.sampling.as_str()),
            "synthesis.seed" => self.synthesis.seed.and_then(|n| i(wide(n))),
            "synthesis.ramp" => Some(V::Array(self.synthesis.ramp.iter().map(|&r| V::Integer(wide(r))).collect())),
            "synthesis.left_context" => i(wide(self.synthesis.left_context)),
            "synthesis.kv_capacity" => i(wide(self.synthesis.kv_capacity)),
            "runtime.threads" => i(wide(self.runtime.threads)),
            "runtime.calibration_dir" => s(&self.runtime.calibration_dir.to_string_lossy()),
            "runtime.frame_pool_mib" => i(wide(self.runtime.frame_pool_mib)),
            "amplifier.chip" => self.amplifier.chip.as_deref().and_then(s),
            "amplifier.line" => i(self.amplifier.line.into()),
            "amplifier.active" => s(self.amplifier.active.as_str()),
            "amplifier.lead_ms" => i(self.amplifier.lead_ms.into()),
            "log.level" => s(self.log.level.as_str()),
            _ => None,
        }
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
            for name in section_keys(section) {
                let key = format!("{section}.{name}");
                let line = match self.value(&key) {
                    Some(v) => format!("{name} = {v}"),
                    None if key == "synthesis.seed" => "# seed: not set (a fresh seed per utterance)".into(),
                    None if key == "amplifier.chip" => "# chip: not set (no amplifier line)".into(),
                    None => format!("# {name}: not set"),
                };
                let from = self.origin(&key);
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
        let path =
            file("env.toml", "[audio]\nvolume = 0.5\ndevice = \"hw:1\"\n[synthesis]\nspeaker = \"ryan\"\nseed = 7\n");
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
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_SYNTHESIS_RAMP", "[ 3, 5 ]")]))
            .unwrap();
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
            ("runtime.frame_pool_mib", "64"),
            ("amplifier.chip", "pinctrl-rp1"),
            ("amplifier.line", "17"),
            ("amplifier.active", "low"),
            ("amplifier.lead_ms", "120"),
            ("log.level", "warn"),
        ];
        assert_eq!(values.len(), keys().count());
        let vars: Vec<(String, String)> = values.iter().map(|(k, v)| (env_name(k), v.to_string())).collect();
        let c = Config::load_with_default(Path::new(NO_DEFAULT), None, &vars).unwrap();
        for (key, value) in values {
            assert_eq!(c.origin(key), format!("env {}", env_name(key)), "{key}");
            let got = c.get(key).unwrap();
            assert_eq!(got.trim_matches('"').trim_matches(|c| c == '[' || c == ']'), value, "{key}");
        }
        assert_eq!(env_name("audio.leading_silence_ms"), "HERALD_AUDIO_LEADING_SILENCE_MS");
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
        let e =
            Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_CONFIG", "/nonexistent/h.toml")]))
                .unwrap_err();
        assert_eq!(e.to_string(), "/nonexistent/h.toml: config file not found (named by HERALD_CONFIG)");
    }

    #[test]
    fn missing_config_file() {
        let e = Config::load_with_default(Path::new(NO_DEFAULT), Some(Path::new("/nonexistent/herald.toml")), &[])
            .unwrap_err();
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
            assert!(
                msg.contains(&format!("unknown-{section}.toml:3: unknown key {section}.bogus (keys of [{section}]: ")),
                "{msg}"
            );
            for n in &names {
                assert!(msg.contains(n), "{msg} lists {n}");
            }
        }
        let msg = load_err("unknown-audio.toml", "[audio]\nvolume = 1.0\nvolum = 1.0\n");
        assert!(msg.ends_with(
            "unknown-audio.toml:3: unknown key audio.volum (keys of [audio]: device, format, volume, leading_silence_ms, \
             trailing_silence_ms, fade_ms, period_ms, buffer_periods)"
        ), "{msg}");
        // dotted keys and inline tables are checked the same way
        let msg = load_err("dotted.toml", "audio.gain = 1.0\n");
        assert!(
            msg.ends_with(
                "dotted.toml:1: unknown key audio.gain (keys of [audio]: device, format, volume, \
                               leading_silence_ms, trailing_silence_ms, fade_ms, period_ms, buffer_periods)"
            ),
            "{msg}"
        );
        let msg = load_err("inline.toml", "log = { level = \"info\", colour = true }\n");
        assert!(msg.contains("inline.toml:1: unknown key log.colour"), "{msg}");
    }

    #[test]
    fn unknown_sections_and_top_level_keys() {
        let msg = load_err("gpio.toml", "[audio]\n\n[gpio]\npin = 4\n");
        assert!(
            msg.ends_with("gpio.toml:3: unknown section [gpio] (sections: model, audio, synthesis, runtime, amplifier, log)"),
            "{msg}"
        );
        let msg = load_err("top.toml", "volume = 1.0\n");
        assert!(
            msg.ends_with(
                "top.toml:1: key volume is outside any section (settings live in the sections [model], \
                               [audio], [synthesis], [runtime], [amplifier], [log])"
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
        (
            "[synthesis]\nramp = [2, 0, 8]",
            "synthesis.ramp = [2, 0, 8] has entry 0: each entry must be in 1..=256 frames",
        ),
        ("[synthesis]\nramp = [300]", "synthesis.ramp = [300] has entry 300: each entry must be in 1..=256 frames"),
        (
            "[synthesis]\nramp = []",
            "synthesis.ramp = [] must not be empty (chunk sizes in frames, e.g. [2, 4, 8, 16, 25])",
        ),
        ("[synthesis]\nramp = 4", "synthesis.ramp = 4 has the wrong type (expected an array of integers)"),
        (
            "[synthesis]\nramp = [2, \"a\"]",
            "synthesis.ramp = [2, \"a\"] has the wrong type (expected an array of integers)",
        ),
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
        let e =
            Config::load_with_default(Path::new(NO_DEFAULT), None, &env(&[("HERALD_AUDIO_VOLUM", "1")])).unwrap_err();
        assert!(matches!(&e, ConfigError::UnknownEnv { name } if name == "HERALD_AUDIO_VOLUM"), "{e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with("unknown environment variable HERALD_AUDIO_VOLUM: settings are HERALD_<SECTION>_<KEY> (HERALD_MODEL_BUNDLE, "), "{msg}");
        assert!(msg.contains("HERALD_AUDIO_VOLUME,"), "{msg}");
        assert!(msg.ends_with("also allowed: HERALD_CONFIG, HERALD_HW_PROFILE, HERALD_PYTHON, HERALD_TEST_*"), "{msg}");
        // even when the file is fine, and before the file is read
        let e = Config::load_with_default(
            Path::new(NO_DEFAULT),
            Some(Path::new("/nonexistent")),
            &env(&[("HERALD_GPIO_PIN", "4")]),
        )
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
            (
                "HERALD_RUNTIME_THREADS",
                "1000",
                "env HERALD_RUNTIME_THREADS: runtime.threads = 1000 is out of range (0..=256)",
            ),
            (
                "HERALD_LOG_LEVEL",
                "loud",
                "env HERALD_LOG_LEVEL: log.level = \"loud\" is not one of: error, warn, info, debug, trace",
            ),
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
        c.apply_cli(&CliOverrides {
            volume: Some(0.75),
            speaker: Some(String::new()),
            seed: Some(5),
            ..Default::default()
        })
        .unwrap();
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
        assert_eq!(
            e.to_string(),
            "command line: synthesis.seed = 18446744073709551615 is out of range (0..=9223372036854775807)"
        );
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
        for text in
            ["", "[synthesis]\nspeaker = \"ryan\"\nseed = 9223372036854775807\nramp = [1]\n[audio]\nvolume = 0.1\n"]
        {
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
            printed.starts_with("[model]\nbundle = \"/usr/share/herald/bundles/default\"\n\n[audio]\n"),
            "{printed}"
        );
        assert!(printed.contains("\nvolume = 1.0\n"), "{printed}");
        assert!(printed.contains("\n# speaker: not set\n"), "{printed}");
        assert!(printed.contains("\nramp = [2, 4, 8, 16, 25]\n"), "{printed}");
    }

    /// The keys in [`KEYS`] are exactly the serde structs' fields and `value`'s keys.
    #[test]
    fn key_list_matches_the_structs() {
        let mut c = Config::default();
        c.synthesis.speaker = Some("s".into());
        c.synthesis.seed = Some(1);
        c.amplifier.chip = Some("gpiochip-label".into());
        let printed = c.to_toml();
        // every key printed, parsed by serde (deny_unknown_fields) and DeTable check alike
        let layer: Layer = toml::from_str(&printed).unwrap();
        assert!(layer.synthesis.seed.is_some() && layer.synthesis.speaker.is_some());
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
        for key in keys() {
            assert!(c.get(key).is_some(), "{key}");
            let section = key.split('.').next().unwrap();
            let bogus = format!("[{section}]\n{} = 1\n", key.split('.').nth(1).unwrap().to_owned() + "x");
            assert!(toml::from_str::<Layer>(&bogus).is_err(), "serde rejects unknown keys in [{section}]");
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
    /// (the two optional ones commented out), and every other ```toml block parses.
    #[test]
    fn docs_example_parses_exactly() {
        let md = include_str!("../../docs/config.md");
        let blocks = toml_blocks(md);
        assert!(!blocks.is_empty(), "docs/config.md has no ```toml block");
        let (line, full) = &blocks[0];
        let c = load_text("docs-full.toml", full).unwrap_or_else(|e| panic!("docs/config.md:{line}: {e}"));
        same_settings(&c, &Config::default());
        // every key is in the example: set, or commented out as `# key = …`
        let mut section = "";
        let mut seen = Vec::new();
        for l in full.lines() {
            let t = l.trim();
            if let Some(s) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
                section = sections().into_iter().find(|n| *n == s).unwrap_or("");
            } else if let Some((k, _)) = t.trim_start_matches("# ").split_once(" = ") {
                let key = format!("{section}.{}", k.trim());
                if static_key(&key).is_some() {
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
}

//! Board-aware engine settings: the hardware probe, the settings derived from it and the bundle
//! (`board::derive`), and the stored calibration (`board::calibration`), turned into
//! [`EngineSettings`] with a log of where each choice came from.
//!
//! Rules:
//! - `runtime.threads = 0` (the default): the two stages are pinned to the derived CPU sets
//!   (talker 2/3 of the big cluster, vocoder the rest); `runtime.threads = N`: no pinning, `N`
//!   compute threads shared by both stages (for experiments and benchmarks).
//! - KV capacity: `synthesis.kv_capacity`, lowered to what fits in memory; a bundle that does not
//!   fit is refused before anything loads.
//! - Chunk ramp: `synthesis.ramp` when it is set explicitly (file, environment, flag); else this
//!   board's calibration for this bundle when one is stored; else the default.

use model::backend::VocoderForm;
use std::path::{Path, PathBuf};

use board::calibration::{self, Calibration, Lookup, MIN_JITTER_MS, Measured};
use board::derive::{self, Derived, DoesNotFit};
use board::probe::{HardwareProfile, ProbeError};
use engine::{EngineSettings, Manifest};
use model::footprint::ModelFootprint;

use crate::config::Config;

/// Errors of [`tune`].
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// The hardware probe or its override failed.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The bundle does not fit this board's memory.
    #[error(transparent)]
    DoesNotFit(#[from] DoesNotFit),
    /// The bundle's files could not be listed.
    #[error("cannot read bundle {dir}: {source}")]
    Bundle {
        /// The bundle directory.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Where the chunk ramp came from.
#[derive(Debug, Clone, PartialEq)]
pub enum RampSource {
    /// `synthesis.ramp` set explicitly; the calibration is not consulted.
    Configured,
    /// A stored calibration.
    Calibrated(PathBuf),
    /// No calibration file yet (the path it would have).
    Default(PathBuf),
    /// A file that could not be used, and why.
    Ignored(String),
}

/// The probe, the derived settings and the engine settings built from them.
#[derive(Debug, Clone)]
pub struct Tuned {
    /// The hardware profile (probe or `HERALD_HW_PROFILE`).
    pub profile: HardwareProfile,
    /// The derived settings.
    pub derived: Derived,
    /// 16-hex fingerprint of this board and bundle (the calibration file name).
    pub fingerprint: String,
    /// Where the ramp came from.
    pub ramp_source: RampSource,
    /// The engine settings.
    pub settings: EngineSettings,
    /// Compute threads for the process-wide executor (loading, and both stages when unpinned).
    pub threads: usize,
    /// The stored calibration in use (its ramp is the engine's unless `synthesis.ramp` is set).
    pub calibration: Option<Box<Calibration>>,
    /// No usable calibration is stored for this board and bundle and the probe is live: the
    /// first utterances measure one ([`Tuned::auto_calibration`]).
    pub calibrate_automatically: bool,
    /// Where a calibration of this board and bundle is stored.
    pub calibration_dir: PathBuf,
}

/// What `dir`'s bundle needs in memory: every file of the bundle directory except the
/// tokenizer and the memory-mapped text-embedding rows (of which a prompt touches a few), KV
/// bytes per position over the talker's full-attention layers, and the fixed-size caches.
///
/// # Errors
/// The directory cannot be listed.
///
/// Only the vocoder graph of `form` counts (a bundle carries both the windowed and the stream
/// graph; one is loaded), and the stream graph counts once per plan the tract backend optimizes
/// from it ([`backend_tract::vocoder::STREAM_PLAN_FRAMES`]: each plan packs its own weights).
pub fn footprint(dir: &Path, m: &Manifest, form: VocoderForm) -> std::io::Result<ModelFootprint> {
    let file_of = |f: VocoderForm| m.vocoder_graph(f).and_then(|k| m.graphs.get(k)).map(|g| g.file.as_str());
    let (used, unused) = match form {
        VocoderForm::Windowed => (file_of(VocoderForm::Windowed), file_of(VocoderForm::Stateful)),
        VocoderForm::Stateful => (file_of(VocoderForm::Stateful), file_of(VocoderForm::Windowed)),
    };
    let copies = if form == VocoderForm::Stateful { backend_tract::vocoder::STREAM_PLAN_FRAMES.len() as u64 } else { 1 };
    let mut files = 0u64;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let md = e.metadata()?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        let belongs = |f: Option<&str>| f.is_some_and(|f| name == f || name.strip_suffix(".data") == Some(f));
        // QNN context binaries are not counted: herald picks the backend after this check, and the
        // ONNX step graphs it counts instead are what the CPU backend needs (docs/backend.md)
        let qnn = m.qnn.as_ref().is_some_and(|q| q.binaries.iter().any(|b| name == b.file.as_str()));
        if !md.is_file() || name == m.tokenizer.file.as_str() || belongs(unused) || qnn {
            continue;
        }
        files += if belongs(used) { md.len() * copies } else { md.len() };
    }
    Ok(ModelFootprint::of(m, files))
}

/// The bundle's identity for the fingerprint: its manifest text and the sizes of its files.
/// Two copies of one bundle agree; a re-export with other dimensions or dtype does not.
///
/// # Errors
/// The manifest or the directory cannot be read.
pub fn bundle_id(dir: &Path) -> std::io::Result<String> {
    let mut id = std::fs::read_to_string(dir.join("bundle.toml"))?;
    let mut sizes: Vec<(String, u64)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let md = e.metadata()?;
        if md.is_file() {
            sizes.push((e.file_name().to_string_lossy().into_owned(), md.len()));
        }
    }
    sizes.sort();
    for (name, len) in sizes {
        id.push_str(&format!("\n{name} {len}"));
    }
    Ok(id)
}

/// The allowed CPUs of this process, empty when unknown.
fn allowed_cpus() -> Vec<usize> {
    engine::placement::allowed_cpus().unwrap_or_else(|e| {
        log::warn!("{e}; threads will not be pinned");
        Vec::new()
    })
}

/// Probe the board, derive the settings for the bundle in `dir` and look up the calibration.
///
/// # Errors
/// [`TuneError::DoesNotFit`] (the caller exits with the bundle code), probe errors, an
/// unreadable bundle directory.
pub fn tune(cfg: &Config, dir: &Path, m: &Manifest) -> Result<Tuned, TuneError> {
    let profile = board::probe::probe_system()?;
    tune_for(cfg, dir, m, profile, &allowed_cpus())
}

/// The chunk ramp before any calibration: `synthesis.ramp` when it is configured; otherwise
/// [`model::schedule::default_ramp`] for `form` (chunks of 2 frames for the stateful vocoder,
/// `synthesis.ramp`'s default for the windowed one).
pub fn default_ramp(cfg: &Config, form: VocoderForm) -> Vec<usize> {
    if cfg.origin("synthesis.ramp") != "default" {
        cfg.synthesis.ramp.clone()
    } else {
        model::schedule::default_ramp(form, &cfg.synthesis.ramp)
    }
}

/// [`tune`] with an explicit profile and CPU set (tests, `herald probe`).
///
/// # Errors
/// As [`tune`].
pub fn tune_for(cfg: &Config, dir: &Path, m: &Manifest, profile: HardwareProfile, allowed: &[usize]) -> Result<Tuned, TuneError> {
    let bundle_err = |source| TuneError::Bundle { dir: dir.to_owned(), source };
    let form = cfg.synthesis.vocoder.form().unwrap_or_else(|| m.default_vocoder_form());
    let fp = footprint(dir, m, form).map_err(bundle_err)?;
    let derived = derive::derive(&profile, &fp, allowed, cfg.synthesis.kv_capacity as u64)?;
    // a calibration measures one vocoder form in one arithmetic: the other form has other costs
    // per chunk, and the half-precision convolutions (runtime.vocoder_precision) others again
    // (on a core with fp16 arithmetic; `auto` resolves from the CPU's features, which the
    // fingerprint holds too)
    let bundle_id = format!(
        "{}\nvocoder {form}\nvocoder precision {}",
        bundle_id(dir).map_err(bundle_err)?,
        cfg.runtime.vocoder_precision.as_str()
    );
    let fingerprint = calibration::fingerprint(&profile, &bundle_id);
    let default = default_ramp(cfg, form);
    let steady = default.last().copied().unwrap_or(25);
    let live = !profile.source.starts_with("override:");
    // the calibration: its rates serve the start policy even when synthesis.ramp is set; one
    // written by another herald version is measured again (its numbers may no longer hold)
    let lookup = match calibration::load(&cfg.runtime.calibration_dir, &fingerprint, steady, live) {
        Lookup::Found(cal, path) if cal.herald != HERALD_VERSION => Lookup::Ignored(format!(
            "{}: written by herald {}, this is herald {HERALD_VERSION}; measuring again",
            path.display(),
            cal.herald
        )),
        other => other,
    };
    let calibration = match &lookup {
        Lookup::Found(cal, _) => Some(cal.clone()),
        _ => None,
    };
    let calibrate_automatically = live && calibration.is_none() && cfg.origin("synthesis.ramp") == "default";
    let (ramp, ramp_source) = if cfg.origin("synthesis.ramp") != "default" {
        (default, RampSource::Configured)
    } else {
        match lookup {
            Lookup::Found(cal, path) => (cal.schedule.ramp.clone(), RampSource::Calibrated(path)),
            Lookup::Missing(path) => (default, RampSource::Default(path)),
            Lookup::Ignored(why) => (default, RampSource::Ignored(why)),
        }
    };
    let pinned = cfg.runtime.threads == 0;
    let (talker_cpus, vocoder_cpus) =
        if pinned { (derived.talker_cpus.clone(), derived.vocoder_cpus.clone()) } else { (Vec::new(), Vec::new()) };
    let threads = if pinned { derived.talker_cpus.len().max(1) } else { cfg.runtime.effective_threads() };
    let settings = EngineSettings {
        kv_capacity: usize::try_from(derived.kv_capacity).unwrap_or(usize::MAX).max(64),
        ramp: Some(ramp),
        left_context: Some(cfg.synthesis.left_context),
        vocoder: cfg.synthesis.vocoder.form(),
        talker_cpus,
        vocoder_cpus,
        pool_bytes: cfg.runtime.frame_pool_mib << 20,
    };
    let calibration_dir = cfg.runtime.calibration_dir.clone();
    Ok(Tuned { profile, derived, fingerprint, ramp_source, settings, threads, calibration, calibrate_automatically, calibration_dir })
}

/// herald's version, written into a calibration and compared when one is read.
pub const HERALD_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Utterances the automatic calibration measures before it stores the board's rates.
pub const AUTO_CALIBRATION_UTTERANCES: usize = 3;

impl Tuned {
    /// The stored calibration's rates for the playback start policy.
    pub fn stage_rates(&self) -> Option<service::StageRates> {
        self.calibration.as_ref().map(|c| service::StageRates {
            seconds_per_frame: c.measured.ms_per_frame / 1e3,
            jitter: c.measured.jitter_ms / 1e3,
            frames_per_token: c.measured.frames_per_token,
        })
    }

    /// Give `speaker` the stored calibration's rates and, on a board without one, the
    /// automatic calibration: after `utterances` measured utterances (`serve`:
    /// [`AUTO_CALIBRATION_UTTERANCES`]; `speak`, which speaks once: 1) their rates are stored as
    /// this board's calibration (atomically, [`calibration::store`]; a failure is one warning).
    pub fn attach(&self, speaker: &mut service::Speaker, manifest: &Manifest, dir: &Path, utterances: usize) {
        speaker.set_calibrated(self.stage_rates());
        if !self.calibrate_automatically {
            return;
        }
        let ramp = speaker.engine().ramp().to_vec();
        let left_context = speaker.engine().vocoder_left_context();
        let frame_ms = 1e3 * f64::from(manifest.audio.samples_per_frame) / f64::from(manifest.audio.sample_rate);
        let fingerprint = self.fingerprint.clone();
        let hardware = self.profile.describe();
        let bundle = format!("{} ({} {} {})", dir.display(), manifest.model.family, manifest.model.size, manifest.model.dtype);
        let store_dir = self.calibration_dir.clone();
        speaker.on_learned(
            utterances,
            Box::new(move |learned| {
                let Some(cal) = auto_calibration(learned, &ramp, left_context, frame_ms) else { return };
                let cal = Calibration { fingerprint: fingerprint.clone(), hardware: hardware.clone(), bundle: bundle.clone(), ..cal };
                match calibration::store(&store_dir, &cal) {
                    Ok(p) => log::info!(
                        "calibration measured by the first {} utterances ({:.1} ms per frame, RTF {:.2}) stored in {}",
                        cal.measured.utterances,
                        cal.measured.ms_per_frame,
                        cal.measured.rtf,
                        p.display()
                    ),
                    Err(e) => log::warn!("cannot store the automatic calibration: {e}"),
                }
            }),
        );
    }

    /// Log the decisions: one line each, warnings for what the user should know.
    pub fn log(&self) {
        log::info!("board: {}", self.profile.describe());
        if self.settings.talker_cpus.is_empty() {
            log::info!("threads: {} compute thread(s), not pinned (runtime.threads is set)", self.threads);
        } else {
            log::info!(
                "threads: talker stage on CPUs {:?}, vocoder stage on CPUs {:?}",
                self.settings.talker_cpus,
                self.settings.vocoder_cpus
            );
        }
        log::info!(
            "memory: budget {:.0} MiB, KV capacity {} positions, dtype {}",
            self.derived.memory_budget_bytes as f64 / 1048576.0,
            self.settings.kv_capacity,
            self.derived.dtype.as_str()
        );
        for n in &self.derived.notes {
            log::warn!("{n}");
        }
        let ramp = self.settings.ramp.as_deref().unwrap_or(&[]);
        match &self.ramp_source {
            RampSource::Configured => log::info!("chunk ramp {ramp:?} from synthesis.ramp"),
            RampSource::Calibrated(p) => log::info!("using calibration {}: chunk ramp {ramp:?}", p.display()),
            RampSource::Default(p) => log::info!(
                "no calibration for this board and bundle ({} is absent): default chunk ramp {ramp:?}; \
                 the first utterances measure one (or run `herald calibrate`)",
                p.display()
            ),
            RampSource::Ignored(why) => log::warn!("ignoring calibration {why}; default chunk ramp {ramp:?}"),
        }
    }
}

/// A calibration from what a speaker's utterances measured (`fingerprint`, `hardware` and
/// `bundle` left empty for the caller): the rate, decode time per frame, prefill, vocoder cost
/// per chunk and TTFA are the medians, the jitter the worst lateness of a timeline against the
/// model those make (at least [`MIN_JITTER_MS`]); the schedule keeps the ramp it was measured
/// with (`formula` is the derivation, for reference). `None` before an utterance measured
/// anything or with an empty ramp.
pub fn auto_calibration(learned: &service::Learned, ramp: &[usize], left_context: usize, frame_ms: f64) -> Option<Calibration> {
    use service::speaker::median_of;
    let spf = learned.median_seconds_per_frame()?;
    if ramp.is_empty() {
        return None;
    }
    let ms_per_frame = spf * 1e3;
    let decode_ms_per_frame = median_of(&learned.decode_seconds_per_frame)? * 1e3;
    let prefill_ms = median_of(&learned.prefill_seconds)? * 1e3;
    let steady = ramp.last().copied().unwrap_or(1).max(1);
    let voc: Vec<f64> = learned.vocoder_seconds.iter().map(|v| v.1 * 1e3).collect();
    let vocoder_ms = std::collections::BTreeMap::from([(left_context + steady, median_of(&voc)?)]);
    let cost = |w: usize| calibration::vocoder_cost_ms(&vocoder_ms, w);
    let jitter = learned
        .timelines
        .iter()
        .map(|t| {
            let frames = t.iter().map(|c| c.1).sum();
            calibration::lateness_ms(t, &calibration::simulate(ramp, decode_ms_per_frame, prefill_ms, &cost, left_context, frames))
        })
        .fold(MIN_JITTER_MS, f64::max);
    let measured = Measured {
        utterances: learned.utterances,
        rate_frames_per_s: 1.0 / spf,
        ms_per_frame,
        rtf: ms_per_frame / frame_ms,
        decode_ms_per_frame,
        jitter_ms: jitter,
        prefill_ms,
        vocoder_ms,
        ttfa_default_ms: median_of(&learned.ttfa)? * 1e3,
        frames_per_token: learned.median_frames_per_token(),
        source: Some("automatic".into()),
    };
    Some(Calibration {
        version: calibration::FORMAT_VERSION,
        fingerprint: String::new(),
        herald: HERALD_VERSION.to_string(),
        created_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        hardware: String::new(),
        bundle: String::new(),
        profile_override: false,
        formula: calibration::derive_schedule(ms_per_frame, jitter, steady),
        // the ramp it measured with, not a derived one: the rates are for the start policy, and
        // a derived ramp can start with an odd chunk the stateful vocoder pays a padded frame
        // and a plan of its own for (measured: RTF 1.2 -> 2.2 with [1, 2] at 0.6B q4);
        // `herald calibrate` derives and checks a schedule
        schedule: calibration::Schedule {
            ramp: ramp.to_vec(),
            first_chunk: ramp[0],
            ..calibration::derive_schedule(ms_per_frame, jitter, steady)
        },
        measured,
    })
}

//! `herald calibrate`: measure this board with this bundle, derive the chunk schedule and store
//! it where `speak` finds it (`runtime.calibration_dir/<fingerprint>.json`).
//!
//! Measurement: one discarded warm-up utterance, then `--utterances` measured ones (fixed
//! texts, fixed seed, at most `--frames` ([`MAX_FRAMES`] by default) frames each, no audio device), all with the
//! default ramp through the real pipeline on the derived CPU sets. From their chunk timelines:
//! the production rate (frames after the first chunk / time between first and last chunk,
//! median over utterances), the decode time per frame, the vocoder's cost per window length,
//! the jitter (worst lateness of a chunk against the model those make, at least
//! [`MIN_JITTER_MS`]), TTFA. The schedule follows
//! `board::calibration::derive_schedule`, checked against a simulation of this board
//! (`derive_checked_schedule`). `--chart FILE.svg` then speaks once more with the
//! calibrated ramp and draws both timelines against the playback clock.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use board::calibration::{self, Calibration, MIN_JITTER_MS, Measured};
use engine::{Engine, EngineSettings, PlaybackMetrics, Request};
use model::stats::median;
use service::{Cancel, Voice};

use super::{init_logging_from, load_config};
use crate::config::{CliOverrides, Config};
use crate::exit::{self, Failure, engine_code, fail};
use crate::tuning;

/// Frames per measured utterance at most, by default (9.6 s of audio): `--frames`.
pub const MAX_FRAMES: usize = 120;
/// The fewest frames `--frames` takes: enough for the default ramp's first four chunks
/// (2 + 4 + 8 + 16), so that a production rate can be read off the chunk timeline.
pub const MIN_FRAMES: usize = 30;
/// Sampling seed of the calibration utterances (any fixed value: the timeline, not the audio,
/// is measured).
const SEED: u64 = 20_261_130;
/// Warm-up texts, cycled.
const TEXTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest before the sun goes down.",
    "Good morning. Today will be sunny with a light breeze from the west, and temperatures around twenty degrees.",
    "Your package has arrived at the front desk. Please bring a photo ID when you come to collect it this afternoon.",
];
/// Frames of the simulated utterance a schedule is checked on (24 s: past the end of the ramp).
const CHECK_FRAMES: usize = 300;
/// Window lengths (frames of left context + chunk) whose vocoder cost is measured, up to the
/// longest window (left context + steady chunk), which is always measured.
const WINDOWS: &[usize] = &[1, 2, 4, 8, 16, 32, 48, 64, 80];

/// `herald calibrate` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    pub bundle: Option<PathBuf>,
    /// Measured utterances (after one warm-up).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub utterances: u32,
    /// Frames per utterance at most: fewer make a quicker, rougher calibration.
    #[arg(long, default_value_t = MAX_FRAMES as u32,
          value_parser = clap::value_parser!(u32).range(MIN_FRAMES as i64..=MAX_FRAMES as i64))]
    pub frames: u32,
    /// Store the calibration in DIR instead of runtime.calibration_dir.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Also draw the chunk arrivals against the playback clock, default ramp and calibrated
    /// ramp, as an SVG timeline.
    #[arg(long, value_name = "FILE.svg")]
    pub chart: Option<PathBuf>,
}

/// The `i`th calibration utterance in the configured voice, with a fixed seed and a cap of
/// `frames` frames.
fn request(voice: &Voice, i: usize, frames: u32) -> Request {
    Request { seed: Some(SEED + i as u64), max_frames: Some(frames as usize), ..voice.request(TEXTS[i % TEXTS.len()]) }
}

/// One utterance without audio output: its report. SIGINT/SIGTERM cancel it (exit 130).
fn measure(engine: &Engine, req: &Request) -> Result<engine::Report, Failure> {
    let cancel = Cancel::new();
    let _running = crate::STOP.guard(&cancel);
    engine.synthesize(req, cancel.flag(), |_| Ok(())).map_err(|e| fail(engine_code(&e), e))
}

/// Run `herald calibrate`.
pub fn run(config: Option<&Path>, args: CalibrateArgs) -> Result<(), Failure> {
    let mut cfg = load_config(config)?;
    init_logging_from(&cfg);
    cfg.apply_cli(&CliOverrides { bundle: args.bundle.clone(), ..CliOverrides::default() }).map_err(|e| fail(exit::INPUT, e))?;
    calibrate(&cfg, &args)
}

/// Run the calibration; prints a summary and the path written.
fn calibrate(cfg: &Config, args: &CalibrateArgs) -> Result<(), Failure> {
    let mut cfg = cfg.clone();
    if let Some(d) = &args.dir {
        cfg.runtime.calibration_dir = d.clone();
    }
    let cfg = &cfg;
    // Where the results go must be writable before minutes of measuring, not after.
    check_store_dir(&cfg.runtime.calibration_dir).map_err(|e| fail(exit::INPUT, e))?;
    if let Some(chart) = &args.chart {
        check_chart_path(chart).map_err(|e| fail(exit::INPUT, e))?;
    }
    // the calibration texts are read as they are, whatever the user's replacement rules say
    let voice = {
        let mut plain = cfg.clone();
        plain.text.replacements = None;
        crate::speaker::settings(&plain, false)?.voice
    };
    let dir = &cfg.model.bundle;
    let bundle_ctx = |e: engine::ManifestError| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display())));
    let manifest = engine::read_manifest(dir).map_err(bundle_ctx)?;
    let tuned = tuning::tune(cfg, dir, &manifest)?;
    tuned.log();
    let profile_override = tuned.profile.source.starts_with("override:");
    if profile_override {
        log::warn!(
            "HERALD_HW_PROFILE is set: measuring this machine but filing the result under that profile's fingerprint; \
             the file is marked, and a board probing itself ignores it"
        );
    }
    backend_tract::set_compute_threads(tuned.threads);
    backend_tract::set_graph_cache_dir(Some(cfg.runtime.graph_cache_dir.clone()));
    // measure with the configured (default) ramp, never with a previous calibration
    let form = cfg.synthesis.vocoder.form().unwrap_or_else(|| manifest.default_vocoder_form());
    let default_ramp = tuning::default_ramp(cfg, form);
    let steady = default_ramp.last().copied().unwrap_or(25);
    let settings = EngineSettings { ramp: Some(default_ramp.clone()), ..tuned.settings.clone() };
    let t_load = Instant::now();
    let engine = Engine::load(dir, &crate::backend::tract_with(cfg, true), &settings)
        .map_err(|e| fail(engine_code(&e), anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    let frame_ms = 1e3 * f64::from(manifest.audio.samples_per_frame) / f64::from(manifest.audio.sample_rate);
    log::info!("bundle loaded in {:.2} s; warming up", t_load.elapsed().as_secs_f64());

    measure(&engine, &request(&voice, 0, args.frames))?;
    let mut rates = Vec::new();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut ttfa = Vec::new();
    let mut timelines = Vec::new();
    for i in 0..args.utterances as usize {
        let r = measure(&engine, &request(&voice, i + 1, args.frames))?;
        match calibration::rate_from_chunks(&r.chunk_times) {
            Some(rate) if r.chunk_times.len() >= 3 => {
                rates.push(rate);
                prefill.push(r.stats.prefill.mean() * 1e3);
                let st = &r.stats;
                decode.push((st.talker.total() + st.predictor.total() + st.sampling.total()) * 1e3 / r.frames.max(1) as f64);
                ttfa.push(r.ttfa * 1e3);
                timelines.push(r.chunk_times.clone());
                log::info!("utterance {}: {} frames, {:.1} frames/s, {}", i + 1, r.frames, rate, r.playback);
            }
            _ => log::warn!("utterance {}: only {} chunk(s) ({} frames); not used", i + 1, r.chunk_times.len(), r.frames),
        }
    }
    if rates.is_empty() {
        return Err(fail(
            1,
            anyhow::anyhow!("no utterance was long enough to measure (each ended within 2 chunks); the bundle stops too early"),
        ));
    }
    let rate = median(&mut rates);
    let ms_per_frame = 1e3 / rate;
    let decode_ms_per_frame = median(&mut decode);
    let prefill_ms = median(&mut prefill);
    // the stateful vocoder decodes a chunk alone: its cost depends on the chunk only
    let left_context = engine.vocoder_left_context();
    let windows: Vec<usize> = WINDOWS.iter().copied().filter(|&w| w < left_context + steady).chain([left_context + steady]).collect();
    let costs = engine.vocoder_cost(&windows, 5).map_err(|e| fail(engine_code(&e), e))?;
    let vocoder_ms: BTreeMap<usize, f64> = windows.iter().copied().zip(costs.iter().map(|s| s * 1e3)).collect();
    // jitter: what the model of this board (decode time per frame, vocoder cost per window)
    // does not explain in the measured timelines
    let voc = |w: usize| calibration::vocoder_cost_ms(&vocoder_ms, w);
    let jitter = timelines
        .iter()
        .map(|t| {
            let frames = t.iter().map(|c| c.1).sum();
            let model = calibration::simulate(&default_ramp, decode_ms_per_frame, prefill_ms, &voc, left_context, frames);
            calibration::lateness_ms(t, &model)
        })
        .fold(MIN_JITTER_MS, f64::max);
    let measured = Measured {
        utterances: rates.len(),
        rate_frames_per_s: rate,
        ms_per_frame,
        rtf: ms_per_frame / frame_ms,
        decode_ms_per_frame,
        jitter_ms: jitter,
        prefill_ms,
        vocoder_ms,
        ttfa_default_ms: median(&mut ttfa),
        frames_per_token: None,
        source: Some("calibrate".into()),
    };
    let formula = calibration::derive_schedule(ms_per_frame, jitter, steady);
    let schedule = calibration::derive_checked_schedule(&measured, steady, left_context, CHECK_FRAMES);
    let cal = Calibration {
        version: calibration::FORMAT_VERSION,
        fingerprint: tuned.fingerprint.clone(),
        herald: env!("CARGO_PKG_VERSION").to_string(),
        created_unix: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        hardware: tuned.profile.describe(),
        profile_override,
        bundle: format!("{} ({} {} {})", dir.display(), manifest.model.family, manifest.model.size, manifest.model.dtype),
        measured,
        formula,
        schedule,
    };
    let store_dir = cfg.runtime.calibration_dir.clone();
    let path = calibration::store(&store_dir, &cal).map_err(|e| fail(exit::INPUT, e))?;
    let m = &cal.measured;
    println!("board       {}", cal.hardware);
    println!("bundle      {}", cal.bundle);
    println!(
        "measured    {:.1} frames/s ({:.1} ms per 80 ms frame, RTF {:.2}), jitter {:.0} ms, prefill {:.0} ms, TTFA {:.0} ms with ramp {default_ramp:?}",
        m.rate_frames_per_s, m.ms_per_frame, m.rtf, m.jitter_ms, m.prefill_ms, m.ttfa_default_ms
    );
    let costs: Vec<String> = m.vocoder_ms.iter().map(|(n, ms)| format!("{n}: {ms:.1}")).collect();
    let what = if engine.vocoder_left_context() == 0 {
        "ms per chunk of N frames (stateful)"
    } else {
        "ms per window of N frames (windowed: left context + chunk)"
    };
    println!("vocoder     {what}: {}", costs.join(", "));
    println!("decode      {:.1} ms per frame (talker + code predictor + sampling)", m.decode_ms_per_frame);
    println!(
        "formula     ramp {:?} (lead {:.0} ms, safety margin {:.0} ms)",
        cal.formula.ramp, cal.formula.lead_ms, cal.formula.safety_margin_ms
    );
    if cal.schedule.ramp != cal.formula.ramp {
        println!("checked     the formula's ramp would stall on this board's simulated timeline; first chunk raised");
    }
    println!("schedule    ramp {:?}", cal.schedule.ramp);
    println!("stored      {}", path.display());

    if let Some(chart) = &args.chart {
        // the same warm engine, the same text as the first measured utterance, the new ramp
        let mut engine = engine;
        engine.set_ramp(&cal.schedule.ramp).map_err(|e| fail(engine_code(&e), e))?;
        let calibrated = measure(&engine, &request(&voice, 1, args.frames))?;
        let reference = timelines.first().cloned().unwrap_or_default();
        let lanes = [
            Lane { title: format!("default ramp {default_ramp:?}"), chunks: reference, frame_s: frame_ms / 1e3 },
            Lane {
                title: format!("calibrated ramp {:?}", cal.schedule.ramp),
                chunks: calibrated.chunk_times,
                frame_s: frame_ms / 1e3,
            },
        ];
        let p = &tuned.profile;
        let title = format!(
            "herald calibrate: {} ({}, {} CPUs), {} {} {}",
            p.cpu_model, p.class, p.n_logical, manifest.model.family, manifest.model.size, manifest.model.dtype
        );
        let svg = chart_svg(&title, &lanes);
        write_chart(chart, svg.as_bytes()).map_err(|e| fail(exit::INPUT, e))?;
        println!("chart       {}", chart.display());
    }
    Ok(())
}

/// The calibration directory exists (or can be created) and takes a file: checked by writing
/// and removing a probe file.
fn check_store_dir(dir: &Path) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if dir.exists() && !dir.is_dir() {
        anyhow::bail!("calibration directory {}: not a directory", dir.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create the calibration directory {}", dir.display()))?;
    probe_write(dir).with_context(|| format!("cannot write to the calibration directory {}", dir.display()))
}

/// `--chart PATH`: a new or regular file in an existing, writable directory.
fn check_chart_path(path: &Path) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if path.file_name().is_none() {
        anyhow::bail!("--chart {}: not a file name", path.display());
    }
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => anyhow::bail!("--chart {}: exists and is not a regular file", path.display()),
        _ => {}
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        anyhow::bail!("--chart {}: the directory {} does not exist", path.display(), dir.display());
    }
    probe_write(dir).with_context(|| format!("--chart {}: cannot write to {}", path.display(), dir.display()))
}

fn probe_write(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".herald-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

/// Write the chart atomically ([`service::write_atomic`]), checking the path again first (new
/// or a regular file: never rename over a device).
fn write_chart(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context as _;
    check_chart_path(path)?;
    service::write_atomic(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// One timeline of the chart.
pub struct Lane {
    /// Heading.
    pub title: String,
    /// `(arrival s, frames)` per chunk.
    pub chunks: Vec<(f64, usize)>,
    /// Seconds per frame.
    pub frame_s: f64,
}

/// An SVG chart, one panel per lane: x = wall-clock seconds from the request, y = seconds of
/// audio. The blue staircase is the audio delivered (each step a chunk arrival, labelled with
/// its frames); the green line is a player started at the earliest stall-free moment
/// (`playback start`), which never crosses the staircase; the red line is a player started at
/// the first audio (TTFA): where it runs flat it waits for the next chunk (a stall).
pub fn chart_svg(title: &str, lanes: &[Lane]) -> String {
    let (w, ph, ml, mr, mt, mb) = (900.0, 260.0, 60.0, 20.0, 50.0, 40.0);
    let h = mt + lanes.len() as f64 * (ph + mb) + 20.0;
    // shared x scale: until the last audio has played in any lane
    let mut t_max: f64 = 0.1;
    for l in lanes {
        let m = PlaybackMetrics::from_chunks(&l.chunks, l.frame_s);
        t_max = t_max.max(m.playback_start + m.audio).max(m.last_chunk);
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h:.0}" viewBox="0 0 {w} {h:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{ml}" y="24" font-size="15">{}</text>"#, xml(title));
    for (k, lane) in lanes.iter().enumerate() {
        let m = PlaybackMetrics::from_chunks(&lane.chunks, lane.frame_s);
        let top = mt + k as f64 * (ph + mb);
        let a_max = m.audio.max(0.1);
        let x = |t: f64| ml + t / t_max * (w - ml - mr);
        let y = |a: f64| top + ph - a / a_max * (ph - 30.0);
        let _ = writeln!(
            s,
            r#"<text x="{ml}" y="{:.1}" font-weight="bold">{}: TTFA {:.0} ms, playback start {:.0} ms, stall {:.0} ms in {} gap(s), RTF {:.2}</text>"#,
            top + 8.0,
            xml(&lane.title),
            m.ttfa * 1e3,
            m.playback_start * 1e3,
            m.stall * 1e3,
            m.stalls,
            m.rtf
        );
        // axes and ticks
        let _ = writeln!(s, r##"<line x1="{ml}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/>"##, y(0.0), w - mr, y(0.0));
        let _ = writeln!(s, r##"<line x1="{ml}" y1="{:.1}" x2="{ml}" y2="{:.1}" stroke="#333"/>"##, y(0.0), y(a_max));
        let step = nice_step(t_max);
        let mut t = 0.0;
        while t <= t_max + 1e-9 {
            let _ = writeln!(
                s,
                r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#ddd"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{t:.1} s</text>"##,
                x(t),
                y(0.0),
                y(a_max),
                y(0.0) + 15.0
            );
            t += step;
        }
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{a_max:.1} s</text>"#, ml - 4.0, y(a_max) + 4.0);
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">audio</text>"#, ml - 4.0, y(a_max) + 18.0);
        // delivered audio: staircase
        let mut pts = format!("{:.1},{:.1}", x(0.0), y(0.0));
        let mut delivered = 0.0;
        for &(t, n) in &lane.chunks {
            let _ = write!(pts, " {:.1},{:.1}", x(t), y(delivered));
            delivered += n as f64 * lane.frame_s;
            let _ = write!(pts, " {:.1},{:.1}", x(t), y(delivered));
            let _ =
                writeln!(s, r##"<text x="{:.1}" y="{:.1}" fill="#1f5fbf" font-size="10">{n}</text>"##, x(t) + 2.0, y(delivered) - 3.0);
        }
        let _ = write!(pts, " {:.1},{:.1}", x(t_max), y(delivered));
        let _ = writeln!(s, r##"<polyline points="{pts}" fill="none" stroke="#1f5fbf" stroke-width="2"/>"##);
        // player at playback start: a straight line of slope 1
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#2a9d3a" stroke-width="2"/>"##,
            x(m.playback_start),
            y(0.0),
            x(m.playback_start + m.audio),
            y(m.audio)
        );
        // player at TTFA: waits (runs flat) where the next chunk is late
        let mut cursor = m.ttfa;
        let mut played = 0.0;
        let mut p = format!("{:.1},{:.1}", x(cursor), y(0.0));
        for &(t, n) in &lane.chunks {
            if t > cursor {
                let _ = write!(p, " {:.1},{:.1}", x(t), y(played));
                cursor = t;
            }
            let d = n as f64 * lane.frame_s;
            cursor += d;
            played += d;
            let _ = write!(p, " {:.1},{:.1}", x(cursor), y(played));
        }
        let _ = writeln!(s, r##"<polyline points="{p}" fill="none" stroke="#d62828" stroke-width="1.5" stroke-dasharray="5,3"/>"##);
        // legend, top left: early on little audio has arrived, so that corner stays empty
        let ly = y(a_max) + 14.0;
        let _ = writeln!(
            s,
            r##"<text x="{0:.1}" y="{ly:.1}" fill="#1f5fbf">— audio delivered (chunk frames)</text><text x="{0:.1}" y="{1:.1}" fill="#2a9d3a">— playback from {2:.0} ms, no stall</text><text x="{0:.1}" y="{3:.1}" fill="#d62828">- - playback from TTFA (flat = stall)</text>"##,
            ml + 10.0,
            ly + 15.0,
            m.playback_start * 1e3,
            ly + 30.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A tick step of 1, 2 or 5 × 10^k giving 5 to 10 ticks over `span`.
fn nice_step(span: f64) -> f64 {
    let raw = span / 8.0;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag)
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_one_panel_per_lane_with_the_metrics_in_its_heading() {
        let lanes = [
            Lane { title: "default ramp [1, 25]".into(), chunks: vec![(0.03, 1), (0.19, 25), (0.35, 25)], frame_s: 0.08 },
            Lane { title: "calibrated ramp [2, 4, 25]".into(), chunks: vec![(0.05, 2), (0.12, 4), (0.30, 25)], frame_s: 0.08 },
        ];
        let svg = chart_svg("test <board>", &lanes);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("test &lt;board&gt;"));
        // lane 1: the prior design's stall: start 110 ms, stall 80 ms (metrics.rs test)
        assert!(svg.contains("TTFA 30 ms, playback start 110 ms, stall 80 ms in 1 gap(s)"), "{svg}");
        // lane 2: 0.05, 0.12-0.16 < 0.05, 0.30-0.48 < 0: no stall
        assert!(svg.contains("TTFA 50 ms, playback start 50 ms, stall 0 ms in 0 gap(s)"), "{svg}");
        assert_eq!(svg.matches("<polyline").count(), 4);
        // balanced elements: every opened text is closed
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    }

    #[test]
    fn tick_steps() {
        for (span, step) in [(8.0, 1.0), (1.2, 0.2), (30.0, 5.0), (0.5, 0.1)] {
            assert!((nice_step(span) - step).abs() < 1e-12, "{span}: {}", nice_step(span));
        }
    }
}

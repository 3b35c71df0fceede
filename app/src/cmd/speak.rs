//! `herald speak`: one text, spoken through ALSA or written as WAV / MP3 / FLAC / raw PCM, then
//! exit.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use engine::StopReason;
use service::encode::Codec;
use service::{Job, JobError, Speaker, Target};

use super::{init_logging_from, load_config, rss_text};
use crate::config::{BackendChoice, CliOverrides, Config, Sampling, SynthesisMode};
use crate::exit::{self, Failure, fail};
use crate::tuning;

/// The flags of `herald speak`.
#[derive(clap::Args)]
pub struct SpeakArgs {
    /// The text; `-` or nothing reads standard input (UTF-8).
    text: Option<String>,
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    bundle: Option<PathBuf>,
    /// Write the audio to FILE in the format its extension names (`.wav` or none: 16-bit mono
    /// WAV; `.mp3`; `.flac`; `.opus` or `.ogg`: Opus in Ogg), or a WAV to standard output with
    /// `-` (streaming header).
    #[arg(long, value_name = "FILE", conflicts_with = "raw")]
    out: Option<String>,
    /// Write raw S16LE mono PCM at the model rate to standard output (no header).
    #[arg(long)]
    raw: bool,
    /// ALSA playback PCM (overrides audio.device), e.g. `default`, `plughw:1,0`.
    #[arg(long, value_name = "PCM")]
    device: Option<String>,
    /// Speaker name from the bundle, or a voice alias (see `herald info`).
    #[arg(long)]
    speaker: Option<String>,
    /// Language from the bundle, or `auto`.
    #[arg(long)]
    language: Option<String>,
    /// Seed of the sampler (reproducible output).
    #[arg(long, conflicts_with = "greedy")]
    seed: Option<u64>,
    /// Greedy decoding instead of sampling.
    #[arg(long)]
    greedy: bool,
    /// Prompt mode (overrides synthesis.mode): streaming or non-streaming.
    #[arg(long, value_name = "MODE")]
    mode: Option<SynthesisMode>,
    /// Linear output gain 0.0..=2.0 (overrides audio.volume).
    #[arg(long)]
    volume: Option<f64>,
    /// Speaking speed 0.25..=4.0, pitch kept (overrides synthesis.speed).
    #[arg(long)]
    speed: Option<f64>,
    /// Which runtime runs the talker and code predictor (overrides runtime.backend): auto,
    /// tract or qnn.
    #[arg(long, value_name = "BACKEND")]
    backend: Option<BackendChoice>,
}

/// Run `herald speak`.
pub fn run(config: Option<&Path>, a: SpeakArgs) -> Result<(), Failure> {
    let mut cfg = load_config(config)?;
    init_logging_from(&cfg);
    let overrides = CliOverrides {
        bundle: a.bundle,
        device: a.device,
        speaker: a.speaker,
        language: a.language,
        seed: a.seed,
        mode: a.mode,
        volume: a.volume,
        speed: a.speed,
        backend: a.backend,
        // --seed asks for sampling even when the config says greedy
        sampling: if a.greedy { Some(Sampling::Greedy) } else { a.seed.map(|_| Sampling::Sample) },
        ..CliOverrides::default()
    };
    cfg.apply_cli(&overrides).map_err(|e| fail(exit::INPUT, e))?;
    if (a.out.is_some() || a.raw) && overrides.device.is_some() {
        log::warn!("--device is ignored: the output goes to {}", if a.raw { "standard output" } else { "--out" });
    }
    let text = read_text(a.text)?;
    speak(&cfg, &text, a.out.as_deref(), a.raw)
}

fn read_text(arg: Option<String>) -> Result<String, Failure> {
    match arg.as_deref() {
        Some(t) if t != "-" => Ok(t.to_owned()),
        _ => {
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprintln!("reading text from standard input; end with Ctrl-D");
            }
            // Never read more than the longest accepted text can take (4 bytes per character).
            let limit = engine::segment::MAX_LONG_TEXT_CHARS * 4 + 4;
            let mut bytes = Vec::new();
            // nothing to finish cleanly yet: a SIGINT/SIGTERM now exits at once (signals.rs)
            crate::signals::reading_input(true);
            if crate::STOP.is_stopped() {
                return Err(fail(
                    exit::INTERRUPTED,
                    anyhow::anyhow!("stopped by a signal before the text was read; nothing was spoken"),
                ));
            }
            let read = stdin.take(limit as u64 + 1).read_to_end(&mut bytes);
            crate::signals::reading_input(false);
            read.map_err(|e| fail(exit::INPUT, anyhow::Error::new(e).context("reading standard input")))?;
            if bytes.len() > limit {
                return Err(fail(
                    exit::INPUT,
                    anyhow::anyhow!(
                        "standard input is longer than the longest text herald accepts ({} characters)",
                        engine::segment::MAX_LONG_TEXT_CHARS
                    ),
                ));
            }
            String::from_utf8(bytes).map_err(|e| {
                fail(
                    exit::INPUT,
                    anyhow::anyhow!("standard input is not valid UTF-8 (first bad byte at offset {})", e.utf8_error().valid_up_to()),
                )
            })
        }
    }
}

/// Where `--out` / `--raw` send the audio; a bad `--out` is bad input.
fn target(out: Option<&str>, raw: bool) -> Result<Target, Failure> {
    Ok(match (out, raw) {
        (_, true) => Target::RawStdout,
        (Some("-"), _) => Target::WavStdout,
        (Some(path), _) => {
            if path.is_empty() {
                return Err(fail(exit::INPUT, anyhow::anyhow!("--out needs a file name (or - for standard output)")));
            }
            if Path::new(path).is_dir() {
                return Err(fail(exit::INPUT, anyhow::anyhow!("--out {path}: is a directory")));
            }
            match out_format(path)? {
                None => Target::File(PathBuf::from(path)),
                Some(codec) => Target::Encoded { path: PathBuf::from(path), codec },
            }
        }
        (None, false) => Target::Device,
    })
}

/// The extensions `--out` takes, for messages.
const OUT_EXTENSIONS: &str = ".wav, .mp3, .flac, .opus, .ogg";

/// The format `--out FILE` asks for by its extension (any case): `None` for WAV (also a name
/// without an extension, such as `/dev/null`, as before there were other formats), else the
/// codec; another extension is bad input, refused before anything is written.
fn out_format(path: &str) -> Result<Option<Codec>, Failure> {
    let ext = Path::new(path).extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("wav") => Ok(None),
        Some("mp3") => Ok(Some(Codec::Mp3)),
        Some("flac") => Ok(Some(Codec::Flac)),
        Some("opus" | "ogg") => Ok(Some(Codec::Opus)),
        Some(other) => Err(fail(
            exit::INPUT,
            anyhow::anyhow!("--out {path}: herald cannot write .{other} files; the extension must be one of {OUT_EXTENSIONS}"),
        )),
        None => Ok(None),
    }
}

/// Tell the signal thread what a second SIGINT/SIGTERM (exit at once) leaves behind: for
/// `--out FILE`, the unfinished temporary file is removed (the file is as it was before) or,
/// when the audio was finished already, the file is kept.
fn say_what_a_second_signal_leaves(out: Option<&str>, raw: bool) {
    match (out, raw) {
        (_, true) | (Some("-"), _) => {
            crate::signals::on_second_signal(|| "the audio on standard output ends mid-stream".into());
        }
        (Some(path), false) => {
            let path = PathBuf::from(path);
            crate::signals::on_second_signal(move || {
                if board::fsutil::remove_own_temps(&path).is_empty() {
                    format!("--out {}: its audio was finished and is kept", path.display())
                } else {
                    format!("--out {}: not written; its unfinished temporary file was removed", path.display())
                }
            });
        }
        (None, false) => crate::signals::on_second_signal(|| "the playback was cut off".into()),
    }
}

fn speak(cfg: &Config, text: &str, out: Option<&str>, raw: bool) -> Result<(), Failure> {
    let t0 = Instant::now();
    let plays = out.is_none() && !raw;
    let settings = crate::speaker::settings(cfg, plays)?;
    let mut request = settings.voice.request(text);
    // test hook: cap the utterance at this many frames (the HTP simulator tests keep it short)
    if let Some(n) = std::env::var("HERALD_TEST_MAX_FRAMES").ok().and_then(|v| v.parse::<usize>().ok()) {
        request.max_frames = Some(n);
    }
    match request.seed {
        Some(s) => log::info!("sampling with seed {s} (--seed {s} reproduces this run)"),
        None => log::info!("greedy decoding"),
    }
    let dir = &cfg.model.bundle;
    let manifest = engine::read_manifest(dir)
        .map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    if cfg.model.verify {
        crate::cmd::info::verify(dir, &manifest)?;
    }
    // `--language en`, `--speaker default`, an alias: the words HTTP and Wyoming take, too
    let aliases = crate::speaker::aliases(cfg, &service::front::catalog(&manifest).0).map_err(|e| fail(exit::INPUT, e))?;
    service::front::in_bundle_words(&manifest, &aliases, &mut request);
    let rate = manifest.audio.sample_rate;
    // The board: thread placement, memory (a bundle that cannot fit is refused here), ramp.
    let tuned = tuning::tune(cfg, dir, &manifest)?;
    tuned.log();
    backend_tract::set_compute_threads(tuned.threads);
    backend_tract::set_graph_cache_dir(Some(cfg.runtime.graph_cache_dir.clone()));
    // Which runtime runs the step graphs: a `qnn` that cannot work stops here, before the device.
    let chosen = crate::backend::choose(cfg, &manifest, tuned.profile.class)?;
    log::info!("{}", chosen.why);
    // The graphs (seconds) start loading now, on their own thread, while the text and voice
    // are checked (the tokenizer, built once and shared with the load) and the output and the
    // amplifier line are opened. A failure of any of those still stops herald at once: the
    // loader is not waited for, and ends with the process.
    let engine_settings = tuned.settings.clone();
    let loader = {
        let (dir, settings, backend, fallback) = (dir.clone(), engine_settings.clone(), chosen.backend, chosen.fallback);
        std::thread::Builder::new()
            .name("load-bundle".into())
            .spawn(move || service::load_engine(&dir, &settings, backend.as_ref(), fallback.as_deref()))
            .map_err(|e| fail(exit::BUG, anyhow::anyhow!("cannot start the bundle loader thread: {e}")))?
    };
    // Check the text and the voice before touching the device.
    service::check_in(dir, &manifest, &request, &settings.reading)?;
    let sink = target(out, raw)?.open(&settings.output).map_err(|e| fail(exit::sink_code(&e), e))?;
    say_what_a_second_signal_leaves(out, raw);
    // The amplifier line (only when playing): a missing chip or line stops here.
    let mut preparing = Speaker::prepare(settings, crate::STOP.clone())?;
    // Open the output before the graphs are ready: a busy or missing device fails fast.
    let mut sink = preparing.begin_early(sink, rate)?;
    let mut speaker = match loader.join() {
        Ok(Ok(engine)) => preparing.with_engine(engine, &engine_settings),
        Ok(Err(e)) => {
            sink.abort();
            return Err(e.into());
        }
        Err(_) => {
            sink.abort();
            return Err(fail(exit::BUG, anyhow::anyhow!("the bundle loader thread panicked")));
        }
    };
    tuned.attach(&mut speaker, &manifest, dir, 1);
    log::info!(
        "ready in {:.2} s (bundle load {:.2} s), resident memory {}",
        t0.elapsed().as_secs_f64(),
        speaker.engine().bundle().load_seconds,
        rss_text()
    );
    // Finished (fade-out, drain, WAV header, the file renamed into place) also after an
    // interrupt: what was spoken stays a valid file.
    let speed = speaker.settings().voice.speed;
    let spoken = match speaker.speak(Job::new(request, Target::Sink { sink, plays }).speed(speed)) {
        Ok(s) => s,
        Err(JobError::Sink(e)) if e.is_broken_pipe() => {
            log::info!("the reader of standard output went away; stopping");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let Some(report) = spoken.report else {
        return Err(fail(exit::INTERRUPTED, anyhow::anyhow!("interrupted; the audio so far was finished cleanly")));
    };
    let audio_s = report.samples as f64 / f64::from(rate);
    log::info!(
        "{} frames ({audio_s:.2} s of audio) in {:.2} s: RTF {:.2}, time to first audio {:.0} ms, stop: {:?}, xruns {}",
        report.frames,
        report.total,
        report.rtf(f64::from(rate)),
        report.ttfa * 1e3,
        report.stop,
        spoken.stats.xruns
    );
    log::debug!("step statistics:\n{}", report.stats);
    if report.stop == StopReason::Capacity {
        return Err(fail(
            exit::INPUT,
            anyhow::anyhow!(
                "the text did not fit: the KV cache ({} positions: synthesis.kv_capacity, or what fits in memory) filled after {} frames; split the text",
                tuned.settings.kv_capacity,
                report.frames
            ),
        ));
    }
    if let Some(path) = out.filter(|p| *p != "-") {
        eprintln!("wrote {path} ({audio_s:.2} s)");
    }
    let _ = std::io::stdout().flush();
    Ok(())
}

//! `herald`: the appliance binary. Command line, configuration and wiring; the model work is in
//! the engine crate, the device work in the board crate.
//!
//! Exit codes (docs/config.md "Exit codes"): 0 ok, 2 bad input or config, 3 audio device,
//! 4 model/bundle, 1 anything else (a bug: please report it).

mod bench;
mod calibrate;
mod config;
mod tuning;
mod serve;

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use board::audio::{AlsaSink, AudioSink, RawSink, SinkError, SinkErrorKind, WavSink};
use clap::{Parser, Subcommand};
use engine::prompt::PromptMode;
use engine::{Engine, EngineError, Request, StopReason};

use crate::config::{CliOverrides, Config, Sampling, SynthesisMode};

/// The process's allocator: the decode and vocoder threads are served from their stages' frame
/// pools (engine::pool) and stay off the heap in the steady state; every other thread, and every
/// pool miss, goes to the system allocator, counted for `herald bench`.
#[global_allocator]
static GLOBAL: engine::pool::Pooled<bench::Counting> = engine::pool::Pooled::new(bench::Counting);

/// Exit code for bad input (text, flags) or a bad configuration.
const EXIT_INPUT: u8 = 2;
/// Exit code for an audio device that cannot be opened or fails.
const EXIT_AUDIO: u8 = 3;
/// Exit code for a missing or broken model bundle.
const EXIT_BUNDLE: u8 = 4;

#[derive(Parser)]
#[command(name = "herald", version, about = "On-device Qwen3-TTS for speaking appliances")]
struct Cli {
    /// Configuration file (default: /etc/herald/herald.toml when it exists; or HERALD_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Speak TEXT (or standard input) through ALSA, or write it as WAV / raw PCM.
    Speak {
        /// The text; `-` or nothing reads standard input (UTF-8).
        text: Option<String>,
        /// Bundle directory (overrides model.bundle).
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
        /// Write a 16-bit mono WAV to FILE, or to standard output with `-` (streaming header).
        #[arg(long, value_name = "FILE", conflicts_with = "raw")]
        out: Option<String>,
        /// Write raw S16LE mono PCM at the model rate to standard output (no header).
        #[arg(long)]
        raw: bool,
        /// ALSA playback PCM (overrides audio.device), e.g. `default`, `plughw:1,0`.
        #[arg(long, value_name = "PCM")]
        device: Option<String>,
        /// Speaker name from the bundle (see `herald info`).
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
    },
    /// Print the effective configuration (defaults, file, environment) as TOML.
    Config,
    /// Print a bundle's model facts, graphs, speakers and languages, and a memory estimate.
    Info {
        /// Bundle directory (overrides model.bundle).
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
    },
    /// Rewrite an ONNX file so tract can load it (NaN guards, allowzero, rank-0 axes, value_info).
    Sanitize {
        /// Input ONNX file.
        input: PathBuf,
        /// Output ONNX file (written atomically; external data files are copied alongside).
        output: PathBuf,
    },
    /// List ALSA playback PCMs.
    Devices,
    /// Print this board's hardware profile (or HERALD_HW_PROFILE's) and the settings derived
    /// for the bundle: threads, memory budget, KV capacity, calibration.
    Probe {
        /// Bundle directory (overrides model.bundle).
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
    },
    /// Measure this board (frame rate, vocoder cost per chunk, jitter), derive the chunk
    /// schedule and store it for `speak` (runtime.calibration_dir).
    Calibrate(calibrate::CalibrateArgs),
    /// Measure step latencies against the memory-bandwidth floor, the pipeline, load time and a
    /// thread sweep (docs/performance.md).
    Bench(bench::BenchArgs),
    /// Run as the appliance: load the model once, speak each line written to a FIFO (systemd notify).
    Serve(serve::ServeArgs),
}

/// A failure with the exit code it maps to.
struct Failure {
    code: u8,
    err: anyhow::Error,
}

fn fail(code: u8, err: impl Into<anyhow::Error>) -> Failure {
    Failure { code, err: err.into() }
}

/// Exit code and message of a [`tuning::TuneError`]: a bundle that does not fit is a bundle
/// problem (4), a broken profile override bad input (2).
fn tune_failure(e: tuning::TuneError) -> Failure {
    let code = match e {
        tuning::TuneError::Probe(_) => EXIT_INPUT,
        tuning::TuneError::DoesNotFit(_) | tuning::TuneError::Bundle { .. } => EXIT_BUNDLE,
    };
    fail(code, e)
}

/// Open the amplifier-enable line of `[amplifier]`, if one is configured: at start-up, so that
/// a missing chip or line stops herald (exit 3) before the model loads.
fn open_amplifier(cfg: &Config) -> Result<Option<board::gpio::LineAmplifier>, Failure> {
    let Some(chip) = &cfg.amplifier.chip else { return Ok(None) };
    let amp = board::gpio::open_line(
        chip,
        cfg.amplifier.line,
        cfg.amplifier.active == config::ActiveLevel::Low,
        std::time::Duration::from_millis(cfg.amplifier.lead_ms.into()),
    )
    .map_err(|e| fail(EXIT_AUDIO, e))?;
    log::info!(
        "amplifier: line {} of GPIO chip '{chip}', enabled {} ms before the first sample",
        cfg.amplifier.line,
        cfg.amplifier.lead_ms
    );
    Ok(Some(amp))
}

/// Why [`synthesize_into`] stopped early.
enum PlayError {
    /// The sink failed (the engine was cancelled).
    Sink(SinkError),
    /// The engine failed.
    Engine(EngineError),
}

/// Speak `request` into `sink` (already begun), calling `beat` for every chunk. On an error the
/// sink is aborted; `Ok(None)` means SIGINT/SIGTERM cut the utterance short and the sink is still
/// open, to be finished so that what was spoken stays valid.
fn synthesize_into(
    engine: &Engine,
    request: &Request,
    sink: &mut dyn AudioSink,
    beat: &dyn Fn(),
) -> Result<Option<engine::Report>, PlayError> {
    let mut sink_err: Option<SinkError> = None;
    let result = engine.synthesize(request, &INTERRUPTED, |chunk| {
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
        return Err(PlayError::Sink(e));
    }
    match result {
        Ok(r) => Ok(Some(r)),
        Err(EngineError::Cancelled) if INTERRUPTED.load(Ordering::Relaxed) => Ok(None),
        Err(e) => {
            sink.abort();
            Err(PlayError::Engine(e))
        }
    }
}

/// `herald probe`: the profile, then what herald derives from it for the configured bundle.
fn print_probe(cfg: &Config) -> Result<(), Failure> {
    let p = board::probe::probe_system().map_err(|e| fail(EXIT_INPUT, e))?;
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{}", p.describe());
    let dir = &cfg.model.bundle;
    match engine::read_manifest(dir) {
        Ok(m) => {
            // A profile from HERALD_HW_PROFILE describes another board: show its own split, not
            // what this machine's CPU set would leave of it (speak pins within what it may use).
            let allowed: Vec<usize> = if p.source.starts_with("override:") {
                (0..p.n_logical.max(p.clusters.iter().flat_map(|c| c.cpus.iter().map(|&n| n + 1)).max().unwrap_or(1))).collect()
            } else {
                engine::placement::allowed_cpus().unwrap_or_default()
            };
            match tuning::tune_for(cfg, dir, &m, p.clone(), &allowed) {
                Ok(t) => {
                    let _ = writeln!(o, "bundle      {} ({} {}, {})", dir.display(), m.model.family, m.model.size, m.model.dtype);
                    for line in t.derived.describe().lines() {
                        let _ = writeln!(o, "derived     {line}");
                    }
                    for n in &t.derived.notes {
                        let _ = writeln!(o, "note        {n}");
                    }
                    let _ = writeln!(o, "fingerprint {}", t.fingerprint);
                    let ramp = t.settings.ramp.clone().unwrap_or_default();
                    let cal = match &t.ramp_source {
                        tuning::RampSource::Configured => format!("not used: synthesis.ramp = {ramp:?} is set"),
                        tuning::RampSource::Calibrated(path) => format!("{} (ramp {ramp:?})", path.display()),
                        tuning::RampSource::Default(path) => {
                            format!("none yet ({}); default ramp {ramp:?}; run herald calibrate", path.display())
                        }
                        tuning::RampSource::Ignored(why) => format!("ignored: {why}"),
                    };
                    let _ = writeln!(o, "calibration {cal}");
                }
                Err(tuning::TuneError::DoesNotFit(e)) => {
                    let _ = writeln!(o, "derived     refused: {e}");
                }
                Err(e) => return Err(tune_failure(e)),
            }
        }
        Err(e) => {
            let (talker, vocoder) = p.thread_split();
            let _ = writeln!(o, "threads     talker stage on CPUs {talker:?}, vocoder stage on CPUs {vocoder:?}");
            let _ = writeln!(o, "bundle      none usable at {} ({e}); pass --bundle for memory and calibration", dir.display());
        }
    }
    let _ = writeln!(o, "{}", p.to_json());
    Ok(())
}

fn engine_code(e: &EngineError) -> u8 {
    match e {
        EngineError::Prompt(_) | EngineError::Config(_) => EXIT_INPUT,
        EngineError::Cancelled => EXIT_INTERRUPTED,
        _ => EXIT_BUNDLE,
    }
}

/// Exit code after SIGINT/SIGTERM stopped the utterance (128 + SIGINT, the shell convention).
const EXIT_INTERRUPTED: u8 = 130;

/// Set by SIGINT/SIGTERM: the utterance stops within a frame, the output is finished cleanly
/// (fade-out, WAV header), and herald exits with [`EXIT_INTERRUPTED`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn sink_code(e: &SinkError) -> u8 {
    match e.kind() {
        SinkErrorKind::Config | SinkErrorKind::Output => EXIT_INPUT,
        _ => EXIT_AUDIO,
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) {
                let _ = e.print();
                return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(EXIT_INPUT));
            }
            // a usage error: one line, like every other error
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("error: bad arguments").trim_end();
            eprintln!("{first} (see herald --help)");
            return ExitCode::from(EXIT_INPUT);
        }
    };
    if let Err(e) = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::Relaxed) {
            // a second signal: stop now
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        }
    }) {
        eprintln!("warning: cannot handle SIGINT/SIGTERM: {e}");
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", one_line(&f.err));
            ExitCode::from(f.code)
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text its parent already shows
/// (typed errors print their source themselves).
fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn load_config(explicit: Option<&Path>) -> Result<Config, Failure> {
    Config::load(explicit, &Config::process_env()).map_err(|e| fail(EXIT_INPUT, e))
}

/// Log to stderr with `filter` (env_logger syntax: `info`, `engine=debug`, ...).
fn init_logging(filter: &str) {
    let mut b = env_logger::Builder::new();
    b.parse_filters(filter);
    b.format_timestamp_millis();
    let _ = b.try_init();
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Sanitize { input, output } => {
            init_logging("warn");
            let report = backend_tract::sanitize::sanitize_file(&input, &output).map_err(|e| fail(EXIT_INPUT, e))?;
            eprintln!("{}: {report}", output.display());
            Ok(())
        }
        Command::Devices => {
            init_logging("warn");
            let devs = board::audio::list_playback_devices().map_err(|e| fail(EXIT_AUDIO, e))?;
            let mut o = std::io::stdout().lock();
            if !devs.iter().any(|d| d.name == "default") {
                // alsa-lib lists only PCMs with hints; `default` always exists unless redefined away
                let _ = writeln!(o, "{:<28} alsa-lib's default device", "default");
            }
            for d in devs {
                if writeln!(o, "{:<28} {}", d.name, d.description.replace('\n', " / ")).is_err() {
                    break; // the reader went away (e.g. `| head`)
                }
            }
            Ok(())
        }
        Command::Serve(args) => serve::run(cli.config.as_deref(), args),
        Command::Bench(args) => {
            init_logging(std::env::var("RUST_LOG").as_deref().unwrap_or("warn"));
            bench::run(&args).map(|_| ()).map_err(|e| {
                let code = e.downcast_ref::<EngineError>().map_or(EXIT_INPUT, engine_code);
                fail(code, e)
            })
        }
        Command::Probe { bundle } => {
            let mut cfg = load_config(cli.config.as_deref())?;
            init_logging("warn");
            cfg.apply_cli(&CliOverrides { bundle, ..CliOverrides::default() }).map_err(|e| fail(EXIT_INPUT, e))?;
            print_probe(&cfg)
        }
        Command::Calibrate(args) => {
            let mut cfg = load_config(cli.config.as_deref())?;
            init_logging(cfg.log.filter(std::env::var("RUST_LOG").ok().as_deref()));
            cfg.apply_cli(&CliOverrides { bundle: args.bundle.clone(), ..CliOverrides::default() })
                .map_err(|e| fail(EXIT_INPUT, e))?;
            calibrate::run(&cfg, &args)
        }
        Command::Info { bundle } => {
            let cfg = load_config(cli.config.as_deref())?;
            init_logging(cfg.log.filter(std::env::var("RUST_LOG").ok().as_deref()));
            let dir = bundle.unwrap_or_else(|| cfg.model.bundle.clone());
            let m = engine::read_manifest(&dir).map_err(|e| fail(EXIT_BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
            match print_info(&dir, &m) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(fail(1, e)),
                _ => Ok(()),
            }
        }
        Command::Speak { text, bundle, out, raw, device, speaker, language, seed, greedy, mode, volume } => {
            let mut cfg = load_config(cli.config.as_deref())?;
            init_logging(cfg.log.filter(std::env::var("RUST_LOG").ok().as_deref()));
            let overrides = CliOverrides {
                bundle,
                device,
                speaker,
                language,
                seed,
                mode,
                volume,
                // --seed asks for sampling even when the config says greedy
                sampling: if greedy { Some(Sampling::Greedy) } else { seed.map(|_| Sampling::Sample) },
                ..CliOverrides::default()
            };
            cfg.apply_cli(&overrides).map_err(|e| fail(EXIT_INPUT, e))?;
            if (out.is_some() || raw) && overrides.device.is_some() {
                log::warn!("--device is ignored: the output goes to {}", if raw { "standard output" } else { "--out" });
            }
            let text = read_text(text)?;
            speak(&cfg, &text, out.as_deref(), raw)
        }
        Command::Config => {
            let cfg = load_config(cli.config.as_deref())?;
            let _ = write!(std::io::stdout().lock(), "{cfg}");
            Ok(())
        }
    }
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
            let limit = engine::prompt::MAX_TEXT_CHARS * 4 + 4;
            let mut bytes = Vec::new();
            stdin
                .take(limit as u64 + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| fail(EXIT_INPUT, anyhow::Error::new(e).context("reading standard input")))?;
            if bytes.len() > limit {
                return Err(fail(
                    EXIT_INPUT,
                    anyhow::anyhow!(
                        "standard input is longer than the longest text herald accepts ({} characters); split it",
                        engine::prompt::MAX_TEXT_CHARS
                    ),
                ));
            }
            String::from_utf8(bytes).map_err(|e| {
                fail(EXIT_INPUT, anyhow::anyhow!("standard input is not valid UTF-8 (first bad byte at offset {})", e.utf8_error().valid_up_to()))
            })
        }
    }
}

fn rss_mb() -> Option<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096.0 / 1e6)
}

fn speak(cfg: &Config, text: &str, out: Option<&str>, raw: bool) -> Result<(), Failure> {
    let t0 = Instant::now();
    let mode = match cfg.synthesis.mode {
        SynthesisMode::NonStreaming => PromptMode::NonStreaming,
        SynthesisMode::Streaming => PromptMode::Streaming,
    };
    let seed = cfg.synthesis.utterance_seed();
    match seed {
        Some(s) => log::info!("sampling with seed {s} (--seed {s} reproduces this run)"),
        None => log::info!("greedy decoding"),
    }
    let request = Request {
        text: text.to_owned(),
        language: Some(cfg.synthesis.language.clone()),
        speaker: cfg.synthesis.speaker.clone(),
        mode,
        seed,
        max_frames: None,
        force_eos_at: None,
    };
    let bundle_err = |e: engine::ManifestError| {
        fail(EXIT_BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", cfg.model.bundle.display())))
    };
    let manifest = engine::read_manifest(&cfg.model.bundle).map_err(bundle_err)?;
    let rate = manifest.audio.sample_rate;
    // The board: thread placement, memory (a bundle that cannot fit is refused here), ramp.
    let tuned = tuning::tune(cfg, &cfg.model.bundle, &manifest).map_err(tune_failure)?;
    tuned.log();
    backend_tract::set_compute_threads(tuned.threads);
    let settings = tuned.settings.clone();
    // Check the text and the voice before touching the device or loading the graphs.
    let prompter = engine::read_prompter(&cfg.model.bundle, &manifest)
        .map_err(|e| fail(EXIT_BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", cfg.model.bundle.display()))))?;
    prompter
        .layout(&request.text, request.language.as_deref(), request.speaker.as_deref(), request.mode)
        .map_err(|e| fail(EXIT_INPUT, e))?;
    drop(prompter);
    let shaper = cfg.shaper_settings();
    let file_out = match out {
        Some(path) if path != "-" => Some(FileOut::new(Path::new(path)).map_err(|e| fail(EXIT_INPUT, e))?),
        _ => None,
    };
    let mut sink: Box<dyn AudioSink> = match (&file_out, out, raw) {
        (_, _, true) => Box::new(RawSink::stdout(shaper)),
        (Some(f), _, _) => Box::new(WavSink::create(f.write_path(), shaper).map_err(|e| fail(sink_code(&e), e))?),
        (None, Some(_), _) => Box::new(WavSink::stdout(shaper)),
        (None, None, false) => Box::new(AlsaSink::new(cfg.alsa_settings(), shaper)),
    };
    // The amplifier line (only when playing): a missing chip or line stops here, before loading.
    if out.is_none() && !raw
        && let Some(amp) = open_amplifier(cfg)?
    {
        sink = Box::new(board::gpio::AmpSink::new(sink, amp));
    }
    // Open the output before loading the graphs: a busy or missing device fails fast.
    sink.begin(rate).map_err(|e| fail(sink_code(&e), e))?;
    let engine = match Engine::load(&cfg.model.bundle, &backend_tract::Tract, &settings) {
        Ok(e) => e,
        Err(e) => {
            sink.abort();
            let code = engine_code(&e);
            return Err(fail(code, anyhow::Error::new(e).context(format!("bundle {}", cfg.model.bundle.display()))));
        }
    };
    log::info!(
        "ready in {:.2} s (bundle load {:.2} s), resident memory {}",
        t0.elapsed().as_secs_f64(),
        engine.bundle().load_seconds,
        rss_mb().map_or_else(|| "unknown".into(), |m| format!("{m:.0} MB"))
    );
    let report = match synthesize_into(&engine, &request, sink.as_mut(), &|| ()) {
        Ok(r) => r,
        Err(PlayError::Sink(e)) if e.is_broken_pipe() => {
            log::info!("the reader of standard output went away; stopping");
            return Ok(());
        }
        Err(PlayError::Sink(e)) => return Err(fail(sink_code(&e), e)),
        Err(PlayError::Engine(e)) => return Err(fail(engine_code(&e), e)),
    };
    // Finish the output (fade-out, drain, WAV header) also after an interrupt: what was spoken
    // stays a valid file.
    let stats = match sink.finish() {
        Ok(s) => s,
        Err(e) if e.is_broken_pipe() => return Ok(()),
        Err(e) => return Err(fail(sink_code(&e), e)),
    };
    drop(sink);
    if let Some(f) = file_out {
        f.commit().map_err(|e| fail(EXIT_INPUT, e))?;
    }
    let Some(report) = report else {
        return Err(fail(EXIT_INTERRUPTED, anyhow::anyhow!("interrupted; the audio so far was finished cleanly")));
    };
    let audio_s = report.samples as f64 / f64::from(rate);
    log::info!(
        "{} frames ({audio_s:.2} s of audio) in {:.2} s: RTF {:.2}, time to first audio {:.0} ms, stop: {:?}, xruns {}",
        report.frames,
        report.total,
        report.rtf(f64::from(rate)),
        report.ttfa * 1e3,
        report.stop,
        stats.xruns
    );
    log::debug!("step statistics:\n{}", report.stats);
    if report.stop == StopReason::Capacity {
        return Err(fail(
            EXIT_INPUT,
            anyhow::anyhow!(
                "the text did not fit: the KV cache ({} positions: synthesis.kv_capacity, or what fits in memory) filled after {} frames; split the text",
                settings.kv_capacity,
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

/// A WAV file written under a temporary name in the same folder and renamed into place only
/// when the utterance finished: a failure never leaves a truncated file or destroys an
/// existing one. Device nodes and FIFOs (`/dev/null`, a named pipe) are written directly.
struct FileOut {
    target: PathBuf,
    temp: Option<PathBuf>,
}

impl FileOut {
    fn new(target: &Path) -> anyhow::Result<Self> {
        if target.as_os_str().is_empty() {
            anyhow::bail!("--out needs a file name (or - for standard output)");
        }
        match std::fs::metadata(target) {
            Ok(m) if m.is_dir() => anyhow::bail!("--out {}: is a directory", target.display()),
            Ok(m) if !m.is_file() => return Ok(FileOut { target: target.to_owned(), temp: None }),
            _ => {}
        }
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = target.with_file_name(format!(".{name}.partial-{}", std::process::id()));
        Ok(FileOut { target: target.to_owned(), temp: Some(temp) })
    }

    fn write_path(&self) -> &Path {
        self.temp.as_deref().unwrap_or(&self.target)
    }

    fn commit(mut self) -> anyhow::Result<()> {
        if let Some(t) = self.temp.take() {
            std::fs::rename(&t, &self.target).map_err(|e| anyhow::anyhow!("--out {}: cannot rename into place: {e}", self.target.display()))?;
        }
        Ok(())
    }
}

impl Drop for FileOut {
    fn drop(&mut self) {
        if let Some(t) = &self.temp {
            let _ = std::fs::remove_file(t);
        }
    }
}

fn print_info(dir: &Path, m: &engine::Manifest) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    writeln!(o, "bundle      {}", dir.display())?;
    writeln!(o, "model       {} {} {} ({}), from {}", m.model.family, m.model.size, m.model.kind, m.model.dtype, m.model.source)?;
    writeln!(o, 
        "audio       {} Hz, {} samples/frame ({} frames/s), {} codebooks x {}",
        m.audio.sample_rate,
        m.audio.samples_per_frame,
        m.frame_rate(),
        m.audio.num_codebooks,
        m.audio.codebook_size
    )?;
    for (name, s) in [("talker", &m.talker), ("predictor", &m.code_predictor)] {
        let sliding = s.cache.iter().filter(|c| matches!(c, engine::manifest::CacheKind::Sliding { .. })).count();
        writeln!(o, 
            "{name:<11} {} layers ({} sliding), hidden {}, {} q / {} kv heads x {}",
            s.layers, sliding, s.hidden, s.heads, s.kv_heads, s.head_dim
        )?;
    }
    let names = |map: &std::collections::BTreeMap<String, u32>| {
        if map.is_empty() { "(none)".to_string() } else { map.keys().cloned().collect::<Vec<_>>().join(", ") }
    };
    writeln!(o, "languages   auto, {}", names(&m.languages))?;
    writeln!(o, "speakers    {}", names(&m.speakers))?;
    let mut total = 0u64;
    for (name, g) in &m.graphs {
        let size = std::fs::metadata(dir.join(&g.file)).map(|md| md.len()).unwrap_or(0);
        total += size;
        writeln!(o, "graph       {name:<15} {:>9.1} MB  {} inputs, {} outputs", size as f64 / 1e6, g.inputs.len(), g.outputs.len())?;
    }
    let tables = std::fs::metadata(dir.join(&m.tables.file)).map(|md| md.len()).unwrap_or(0);
    let kv_per_pos = model::footprint::kv_bytes_per_position(&m.talker, m.dtype());
    writeln!(o, "tables      {:>9.1} MB (memory-mapped; only the rows a prompt uses become resident)", tables as f64 / 1e6)?;
    writeln!(o, 
        "memory      ~{:.1} MB of graph weights + {:.1} KiB KV cache per talker position",
        total as f64 / 1e6,
        kv_per_pos as f64 / 1024.0
    )?;
    Ok(())
}

//! `herald`: the appliance binary. The command line (one file per command in [`cmd`]), the
//! configuration ([`config`]) and the exit codes ([`exit`]); the speaking is in the service
//! crate, the model work in the engine crate, the device work in the board crate.
//!
//! Exit codes (docs/config.md "Exit codes"): 0 ok, 2 bad input or config, 3 audio device,
//! 4 model/bundle, 130 stopped by SIGINT/SIGTERM, 1 anything else (a bug: please report it).

mod backend;
mod bundles;
mod cmd;
mod config;
mod exit;
mod signals;
mod speaker;
mod tuning;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::LazyLock;

use clap::{Parser, Subcommand};

/// The process's allocator: the decode and vocoder threads are served from their stages' frame
/// pools (engine::pool) and stay off the heap in the steady state; every other thread, and every
/// pool miss, goes to the system allocator, counted for `herald bench`.
#[global_allocator]
static GLOBAL: engine::pool::Pooled<cmd::bench::Counting> = engine::pool::Pooled::new(cmd::bench::Counting);

/// The process-wide stop: SIGINT/SIGTERM cancel the utterance in progress within a frame (its
/// output is finished cleanly: fade-out, WAV header) and every later one; `speak` then exits with
/// [`exit::INTERRUPTED`], `serve` with 0. A second signal exits at once ([`signals`]).
static STOP: LazyLock<service::Stop> = LazyLock::new(service::Stop::new);

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
    Speak(cmd::speak::SpeakArgs),
    /// Print the effective configuration (defaults, file, environment) as TOML.
    Config,
    /// Print a bundle's model facts, graphs, speakers, voice aliases and languages, and a memory
    /// estimate.
    Info(cmd::info::InfoArgs),
    /// Rewrite an ONNX file so tract can load it (NaN guards, allowzero, rank-0 axes, value_info).
    Sanitize(cmd::sanitize::SanitizeArgs),
    /// List ALSA playback PCMs.
    Devices,
    /// Print this board's hardware profile (or HERALD_HW_PROFILE's) and the settings derived
    /// for the bundle: threads, memory budget, KV capacity, calibration.
    Probe(cmd::probe::ProbeArgs),
    /// Measure this board (frame rate, vocoder cost per chunk, jitter), derive the chunk
    /// schedule and store it for `speak` (runtime.calibration_dir).
    Calibrate(cmd::calibrate::CalibrateArgs),
    /// Measure step latencies against the memory-bandwidth floor, the pipeline, load time and a
    /// thread sweep (docs/performance.md).
    Bench(cmd::bench::BenchArgs),
    /// Install, list, remove and choose bundles in model.bundles_dir (`herald bundle install
    /// ARCHIVE` takes what `tools/export/export pack` writes; docs/bundle.md, "Bundle archives").
    Bundle(cmd::bundle::BundleArgs),
    /// Run as the appliance: load the model once and serve the FIFO, Wyoming and HTTP (systemd notify).
    ///
    /// Three front-ends share one job queue and the speaker, each turned off with `off`:
    ///
    /// - the FIFO: each line of text written to it is spoken (`--fifo`, serve.fifo; default
    ///   /run/herald/say);
    ///
    /// - Wyoming, for Home Assistant (`--wyoming`, serve.wyoming; default
    ///   tcp://127.0.0.1:10200; announced over Zeroconf when not on loopback);
    ///
    /// - HTTP, the OpenAI speech API (`POST /v1/audio/speech`, `GET /v1/models`),
    ///   `POST /v1/say` and `GET /healthz` (`--http`, serve.http;
    ///   default 127.0.0.1:5000; an address other machines reach needs serve.api_key).
    ///
    /// Limits, timeouts and the API key: the [serve] section of the configuration
    /// (docs/config.md, "herald serve"); SIGHUP reloads them (docs/reliability.md, "Signals").
    Serve(cmd::serve::ServeArgs),
}

fn main() -> ExitCode {
    // before any thread starts, so that every thread inherits the mask ([`signals`])
    let blocked = signals::block();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(exit::INPUT));
            }
            // a usage error: one line, like every other error
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("error: bad arguments").trim_end();
            eprintln!("{first} (see herald --help)");
            return ExitCode::from(exit::INPUT);
        }
    };
    // a bundle file cut short under a running herald: one line and exit 4, not a bare SIGBUS
    if let Err(e) = engine::tables::exit_on_truncation(i32::from(exit::BUNDLE)) {
        eprintln!("warning: cannot handle SIGBUS: {e}");
    }
    if let Err(e) = blocked.map_err(std::io::Error::from).and_then(|()| signals::start(STOP.clone())) {
        eprintln!("warning: cannot handle SIGINT/SIGTERM/SIGHUP: {e}");
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", exit::one_line(&f.err));
            ExitCode::from(f.code)
        }
    }
}

fn run(cli: Cli) -> Result<(), exit::Failure> {
    let config = cli.config.as_deref();
    match cli.command {
        Command::Speak(args) => cmd::speak::run(config, args),
        Command::Config => cmd::config::run(config),
        Command::Info(args) => cmd::info::run(config, args),
        Command::Sanitize(args) => cmd::sanitize::run(args),
        Command::Devices => cmd::devices::run(),
        Command::Probe(args) => cmd::probe::run(config, args),
        Command::Calibrate(args) => cmd::calibrate::run(config, args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Bundle(args) => cmd::bundle::run(config, args),
        Command::Serve(args) => cmd::serve::run(config, args),
    }
}

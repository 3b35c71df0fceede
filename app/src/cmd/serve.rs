//! `herald serve`: the appliance mode that the systemd unit runs.
//!
//! herald loads the bundle once, creates a FIFO (default [`DEFAULT_FIFO`]) and speaks every
//! line of UTF-8 text written to it, one line at a time, through the configured ALSA device (or
//! into one WAV file per line with `--out-dir`). A line that cannot be spoken (not UTF-8, too
//! long, nothing to say, a failing device) is logged with its line number and skipped; the
//! service keeps running. SIGTERM or SIGINT stops the current line within a frame (with a
//! fade-out) and exits with code 0.
//!
//! This file is the wiring: configuration, start-up order and exit codes. The speaking is the
//! service crate's [`Speaker`] and its queue, the FIFO reading [`service::fifo`], and the
//! systemd side ([`service::notify`]) sends `READY=1` once the engine is loaded, `STATUS=…` as it
//! works, `WATCHDOG=1` every half of `$WATCHDOG_USEC` while its work is alive, and `STOPPING=1`
//! on shutdown.

use std::path::{Path, PathBuf};
use std::time::Instant;

use service::Speaker;
use service::fifo::{Fifo, FifoSettings, Served};
use service::notify::{Heartbeat, Notifier, NotifyState, Watchdog};

use super::{init_logging_from, load_config, rss_text};
use crate::config::CliOverrides;
use crate::exit::{self, Failure, fail};

/// The FIFO `herald serve` reads when `--fifo` is not given (in systemd's
/// `RuntimeDirectory=herald`).
pub const DEFAULT_FIFO: &str = "/run/herald/say";

/// Jobs that may wait in the speaker's queue. The FIFO submits one line at a time and waits
/// for it (the pipe holds the rest), so one is enough.
const QUEUE_CAPACITY: usize = 1;

/// The flags of `herald serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The FIFO to read lines of text from (created when missing; removed on exit if herald
    /// created it).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_FIFO)]
    fifo: PathBuf,
    /// Write each line's audio as a 16-bit mono WAV `DIR/NNNNNN.wav` (NNNNNN = the line's
    /// number since start, from 000001) instead of playing it.
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    bundle: Option<PathBuf>,
    /// ALSA playback PCM (overrides audio.device).
    #[arg(long, value_name = "PCM")]
    device: Option<String>,
}

/// Run `herald serve` until SIGTERM/SIGINT. Startup errors map to the documented exit codes
/// (2 configuration, FIFO or output folder; 3 amplifier line; 4 bundle); once running, a line
/// that fails is logged and skipped.
pub fn run(config: Option<&Path>, args: ServeArgs) -> Result<(), Failure> {
    let mut cfg = load_config(config)?;
    init_logging_from(&cfg);
    let overrides = CliOverrides { bundle: args.bundle, device: args.device, ..CliOverrides::default() };
    cfg.apply_cli(&overrides).map_err(|e| fail(exit::INPUT, e))?;
    if let Some(dir) = &args.out_dir
        && !dir.is_dir()
    {
        return Err(fail(exit::INPUT, anyhow::anyhow!("--out-dir {}: not a directory", dir.display())));
    }
    let notifier = match Notifier::from_env() {
        Ok(n) => n,
        Err(e) => {
            log::warn!("{e}; running without systemd notifications");
            None
        }
    };
    let notify = |states: &[NotifyState<'_>]| {
        if let Some(n) = &notifier {
            n.notify(states);
        }
    };
    let settings = crate::speaker::settings(&cfg, args.out_dir.is_none());
    let voice = settings.voice.clone();
    // The amplifier line (only when playing): a missing chip or line stops here, at start-up.
    let preparing = Speaker::prepare(settings, crate::STOP.clone())?;
    let fifo = Fifo::open(&args.fifo)?;
    let t0 = Instant::now();
    let dir = &cfg.model.bundle;
    notify(&[NotifyState::Status(&format!("loading bundle {}", dir.display()))]);
    let manifest = engine::read_manifest(dir)
        .map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    // The board, as `speak` sees it: thread placement, memory, the calibrated ramp.
    let tuned = crate::tuning::tune(&cfg, dir, &manifest)?;
    tuned.log();
    backend_tract::set_compute_threads(tuned.threads);
    backend_tract::set_graph_cache_dir(Some(cfg.runtime.graph_cache_dir.clone()));
    let speaker = preparing.load(dir, &tuned.settings)?;
    // A language or speaker the bundle lacks would fail every line: refuse to start instead.
    speaker.check_voice().map_err(|e| fail(exit::INPUT, e))?;
    let lines =
        FifoSettings { voice, out_dir: args.out_dir, sample_rate: speaker.sample_rate(), kv_capacity: cfg.synthesis.kv_capacity };
    let queue =
        speaker.start(QUEUE_CAPACITY).map_err(|e| fail(exit::BUG, anyhow::Error::new(e).context("cannot start the speaker")))?;
    let ready = format!("ready; reading lines from {}", fifo.path().display());
    log::info!("{ready} (bundle {} loaded in {:.2} s, resident memory {})", dir.display(), t0.elapsed().as_secs_f64(), rss_text());
    notify(&[NotifyState::Ready, NotifyState::Status(&ready)]);
    let heartbeat = Heartbeat::new();
    let watchdog = notifier.as_ref().and_then(|n| Watchdog::start(n, &heartbeat));

    let mut served = Served::default();
    let result = service::fifo::serve(&fifo, &queue, &lines, notifier.as_ref(), &heartbeat, &crate::STOP, &mut served);
    let stopping = format!("stopping; {} line(s) spoken, {} skipped", served.spoken, served.skipped);
    log::info!("{stopping}");
    notify(&[NotifyState::Stopping, NotifyState::Status(&stopping)]);
    if let Some(w) = watchdog {
        w.stop();
    }
    drop(queue);
    drop(fifo);
    result.map_err(Failure::from)
}

//! `herald serve`: the appliance mode that the systemd unit runs.
//!
//! herald loads the bundle once, creates a FIFO (`serve.fifo`, default [`config::DEFAULT_FIFO`]; `off`
//! for none) and speaks every line of UTF-8 text written to it, one line at a time, through the
//! configured ALSA device (or into one WAV file per line with `--out-dir`). A line that cannot
//! be spoken (not UTF-8, too long, nothing to say, a failing device) is logged with its line
//! number and skipped; the service keeps running. SIGTERM or SIGINT stops the current line
//! within a frame (with a fade-out) and exits with code 0, naming the signal; SIGHUP reloads the
//! configuration ([`reload`]) and never stops herald.
//!
//! The audio device is opened once at start (and closed: no sound); when it cannot be, one
//! warning says so, `POST /v1/say` answers 503 while it stays missing, and every line tries it
//! again (service::device).
//!
//! This file is the wiring: configuration, start-up order and exit codes. The speaking is the
//! service crate's [`Speaker`] and its queue, the FIFO reading [`service::fifo`], and the
//! systemd side ([`service::notify`]) sends `READY=1` once the engine is loaded and has passed
//! its self-test ([`service::selftest`]: one sentence into a null sink), `STATUS=…` as it
//! works, `WATCHDOG=1` every half of `$WATCHDOG_USEC` while its work is alive, and `STOPPING=1`
//! on shutdown.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use service::fifo::{Fifo, FifoSettings, Served};
use service::front::{Front, FrontSettings, Slot};
use service::http::{HttpReload, HttpServer, HttpSettings};
use service::listen;
use service::notify::{Heartbeat, Notifier, NotifyState, Watchdog};
use service::selftest::{self, SelfTestError};
use service::wyoming::{WyomingReload, WyomingServer, WyomingSettings};
use service::zeroconf;
use service::{DeviceHealth, LiveSettings, Speaker};

use super::{init_logging_from, load_config, rss_text};
use crate::config::{self, CliOverrides, Config, ServeConfig, Zeroconf};
use crate::exit::{self, Failure, fail};

/// How often the loop without a FIFO checks for the stop and beats the watchdog's heartbeat.
const IDLE_POLL: Duration = Duration::from_millis(200);

/// How long the network servers get, after the stop, to end their streams (the job in
/// progress is cut at a frame boundary, so this is one frame and a flush in practice).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The flags of `herald serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The FIFO to read lines of text from (created when missing; removed on exit if herald
    /// created it), or `off` for none (overrides serve.fifo; default /run/herald/say).
    #[arg(long, value_name = "PATH")]
    fifo: Option<String>,
    /// Where the Wyoming server (Home Assistant) listens: tcp://HOST:PORT, or `off` (overrides
    /// serve.wyoming; default tcp://127.0.0.1:10200; 0.0.0.0 for other machines).
    #[arg(long, value_name = "URI")]
    wyoming: Option<String>,
    /// Where the HTTP server (OpenAI speech API, /v1/say, /healthz) listens: HOST:PORT, or `off`
    /// (overrides serve.http; default 127.0.0.1:5000; another address needs serve.api_key).
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
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
    // SIGHUP reloads, and never stops serve, from the start on (signals.rs)
    crate::signals::defer_hangup();
    // before any thread: a daemon that starts threads all the time keeps its arenas bounded
    let arenas = board::malloc::bound_arenas();
    let mut cfg = load_config(config)?;
    init_logging_from(&cfg);
    if arenas {
        log::debug!("malloc: at most {} arenas (MALLOC_ARENA_MAX overrides)", board::malloc::SERVE_ARENAS);
    }
    let overrides = CliOverrides {
        bundle: args.bundle,
        device: args.device,
        fifo: args.fifo,
        wyoming: args.wyoming,
        http: args.http,
        ..CliOverrides::default()
    };
    cfg.apply_cli(&overrides).map_err(|e| fail(exit::INPUT, e))?;
    let fifo_path = fifo_path(&cfg.serve.fifo);
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
    let plays = args.out_dir.is_none();
    let settings = crate::speaker::settings(&cfg, plays)?;
    // The network front-ends' addresses and sockets: a bad or busy address stops here, before
    // the model loads.
    let net = Network::open(&cfg.serve, cfg.origin("serve.api_key"))?;
    if fifo_path.is_none() && net.wyoming.is_none() && net.http.is_none() {
        return Err(fail(
            exit::INPUT,
            anyhow::anyhow!("nothing to serve: serve.fifo, serve.wyoming and serve.http are all \"off\"; turn one of them on"),
        ));
    }
    // The audio device, once (open and close, no sound): missing, it is one warning, not a stop.
    let device = plays.then(|| DeviceHealth::new(&cfg.audio.device));
    if let Some(d) = &device {
        d.check_at_start();
    }
    // The amplifier line (only when playing): a missing chip or line stops here, at start-up.
    let preparing = Speaker::prepare(settings, crate::STOP.clone())?;
    let fifo = fifo_path.as_deref().map(Fifo::open).transpose()?;
    // Both sockets listen from now on. HTTP answers at once (/healthz: "loading"); Wyoming
    // clients wait in the backlog until the model is in the slot.
    let slot = Slot::new();
    let mut net = net;
    let mut servers = net.start_http(&cfg.serve, &slot)?;
    let t0 = Instant::now();
    let dir = &cfg.model.bundle;
    notify(&[NotifyState::Status(&format!("loading bundle {}", dir.display()))]);
    let manifest = engine::read_manifest(dir)
        .map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    if cfg.model.verify {
        crate::cmd::info::verify(dir, &manifest)?;
    }
    // The voice aliases fit the bundle, or herald stops before the model loads.
    let aliases = crate::speaker::aliases(&cfg, &service::front::catalog(&manifest).0).map_err(|e| fail(exit::INPUT, e))?;
    // The board, as `speak` sees it: thread placement, memory, the calibrated ramp.
    let tuned = crate::tuning::tune(&cfg, dir, &manifest)?;
    tuned.log();
    backend_tract::set_compute_threads(tuned.threads);
    backend_tract::set_graph_cache_dir(Some(cfg.runtime.graph_cache_dir.clone()));
    let chosen = crate::backend::choose(&cfg, &manifest, tuned.profile.class)?;
    log::info!("{}", chosen.why);
    let mut speaker = preparing.load_with_fallback(dir, &tuned.settings, chosen.backend.as_ref(), chosen.fallback.as_deref())?;
    tuned.attach(&mut speaker, &manifest, dir, crate::tuning::AUTO_CALIBRATION_UTTERANCES);
    let loaded = t0.elapsed();
    let sample_rate = speaker.sample_rate();
    let front_settings = FrontSettings { queue_length: cfg.serve.queue_length, max_text_chars: cfg.serve.max_text_chars, aliases };
    let mut front = Front::start(speaker, &front_settings)
        .map_err(|e| fail(exit::BUG, anyhow::Error::new(e).context("cannot start the speaker")))?;
    // A language or speaker the bundle lacks would fail every line: refuse to start instead.
    front.bundle_voice(&front.live().get().voice, &front.aliases()).map_err(|e| fail(exit::INPUT, e))?;
    if let Some(d) = &device {
        front.watch_device(d.clone());
    }
    // Prove before announcing: one sentence through the engine into a null sink, before READY=1,
    // the Wyoming server, Zeroconf and HTTP's "ready". A bundle that loads but cannot speak
    // stops here with its exit code, announced nowhere.
    if cfg.serve.self_test {
        notify(&[NotifyState::Status(&format!("self-test: speaking {:?} into a null sink", selftest::TEXT))]);
        match selftest::run(&front) {
            Ok(proof) => log::info!("self-test passed: {proof}"),
            // the stop is handled below, like one that came while the model loaded
            Err(SelfTestError::Stopped) => {}
            Err(e) => return Err(self_test_failure(e, dir)),
        }
    }
    let lines = FifoSettings {
        live: front.live().clone(),
        device: device.clone(),
        out_dir: args.out_dir,
        sample_rate,
        kv_capacity: cfg.synthesis.kv_capacity,
    };
    if slot.fill(front).is_err() {
        return Err(fail(exit::BUG, anyhow::anyhow!("the speaker was started twice")));
    }
    let Some(front) = slot.get() else { return Err(fail(exit::BUG, anyhow::anyhow!("the speaker's slot is empty"))) };
    if crate::STOP.is_stopped() {
        // SIGTERM while the model loaded or during the self-test: never say ready, stop at once
        // (clients waiting in the Wyoming backlog see the connection closed)
        log::info!(
            "stopping on {} before ready (it came while the model loaded or spoke its self-test)",
            crate::signals::stopped_by().unwrap_or("a signal")
        );
        notify(&[NotifyState::Stopping]);
        servers.shutdown(SHUTDOWN_GRACE);
        return Ok(());
    }
    servers.start_wyoming(&mut net, &cfg.serve, &slot)?;
    let reloading = Reloading {
        explicit: config.map(Path::to_path_buf),
        overrides,
        started: cfg.clone(),
        applied: Mutex::new(cfg.clone()),
        slot: slot.clone(),
        device,
        plays,
        http: servers.http.as_ref().map(|h| (h.reload_handle(), h.local_addr())),
        wyoming: servers.wyoming.as_ref().map(WyomingServer::reload_handle),
    };
    crate::signals::on_hangup(move || reloading.reload());
    let mut ready = match &fifo {
        Some(f) => format!("ready; reading lines from {}", f.path().display()),
        None => "ready; no FIFO (serve.fifo = \"off\")".to_owned(),
    };
    for s in servers.describe() {
        ready.push_str(&format!(", {s}"));
    }
    log::info!(
        "{ready} (bundle {} loaded in {:.2} s, ready {:.2} s after the load began, resident memory {})",
        dir.display(),
        loaded.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        rss_text()
    );
    notify(&[NotifyState::Ready, NotifyState::Status(&ready)]);
    let heartbeat = Heartbeat::new();
    let watchdog = notifier.as_ref().and_then(|n| Watchdog::start(n, &heartbeat));

    let mut served = Served::default();
    let result = match &fifo {
        Some(fifo) => service::fifo::serve(fifo, front.queue(), &lines, notifier.as_ref(), &heartbeat, &crate::STOP, &mut served),
        None => {
            while !crate::STOP.is_stopped() {
                heartbeat.beat();
                std::thread::sleep(IDLE_POLL);
            }
            Ok(())
        }
    };
    let why = crate::signals::stopped_by().map_or_else(String::new, |s| format!(" on {s}"));
    let stopping = format!("stopping{why}; {} line(s) spoken, {} skipped", served.spoken, served.skipped);
    log::info!("{stopping}");
    notify(&[NotifyState::Stopping, NotifyState::Status(&stopping)]);
    // the stop has cut the job in progress at a frame boundary; its stream ends cleanly
    servers.shutdown(SHUTDOWN_GRACE);
    if let Some(w) = watchdog {
        w.stop();
    }
    drop(fifo);
    result.map_err(Failure::from)
}

/// The network front-ends' listening sockets, bound (or taken from systemd) before the model
/// loads.
struct Network {
    wyoming: Option<TcpListener>,
    http: Option<TcpListener>,
}

/// The running network servers.
struct Servers {
    wyoming: Option<WyomingServer>,
    http: Option<HttpServer>,
    zeroconf: Option<zeroconf::Announcement>,
}

impl Network {
    /// Parse `serve.wyoming` and `serve.http`, check that a non-loopback HTTP address has an
    /// `api_key`, and take each socket from systemd's socket activation (matched by port) or
    /// bind it. Exit code 2 for every problem (the message names the key).
    fn open(cfg: &ServeConfig, api_key_origin: &str) -> Result<Network, Failure> {
        let input = |e: listen::ListenError| fail(exit::INPUT, e);
        let wyoming = listen::parse("serve.wyoming", &cfg.wyoming, "tcp").map_err(input)?;
        let http = listen::parse("serve.http", &cfg.http, "http").map_err(input)?;
        check_api_key(cfg, http, api_key_origin).map_err(|e| fail(exit::INPUT, e))?;
        if let (Some(w), Some(h)) = (wyoming, http)
            && w.port() == h.port()
            && w.port() != 0
        {
            return Err(fail(exit::INPUT, anyhow::anyhow!("serve.wyoming and serve.http both name port {}", w.port())));
        }
        let mut inherited = listen::inherited();
        let mut take = |key, value: &str, addr: Option<SocketAddr>| -> Result<Option<TcpListener>, Failure> {
            let Some(addr) = addr else { return Ok(None) };
            let (l, passed) = listen::take_or_bind(&mut inherited, key, value, addr).map_err(input)?;
            if passed {
                log::info!("{key}: using the socket systemd passed for {addr}");
            }
            Ok(Some(l))
        };
        let wyoming = take("serve.wyoming", &cfg.wyoming, wyoming)?;
        let http = take("serve.http", &cfg.http, http)?;
        for (addr, _) in inherited {
            log::warn!("socket activation: a socket for {addr} was passed, but neither serve.wyoming nor serve.http names it; closed");
        }
        Ok(Network { wyoming, http })
    }

    /// Start the HTTP server on `slot` now (it answers `/healthz` and says "loading" until the
    /// slot is filled); the Wyoming socket waits for [`Servers::start_wyoming`].
    fn start_http(&mut self, cfg: &ServeConfig, slot: &Slot) -> Result<Servers, Failure> {
        let http = match self.http.take() {
            Some(l) => Some(HttpServer::start(l, slot.clone(), http_settings(cfg)).map_err(bug("cannot start the HTTP server"))?),
            None => None,
        };
        Ok(Servers { wyoming: None, http, zeroconf: None })
    }
}

fn bug(what: &'static str) -> impl Fn(std::io::Error) -> Failure {
    move |e| fail(exit::BUG, anyhow::Error::new(e).context(what))
}

fn wyoming_settings(cfg: &ServeConfig) -> WyomingSettings {
    WyomingSettings {
        max_connections: cfg.max_connections,
        request_timeout: Duration::from_secs(cfg.request_timeout_s.into()),
        idle_timeout: Duration::from_secs(cfg.idle_timeout_s.into()),
    }
}

fn http_settings(cfg: &ServeConfig) -> HttpSettings {
    HttpSettings {
        max_connections: cfg.max_connections,
        request_timeout: Duration::from_secs(cfg.request_timeout_s.into()),
        idle_timeout: Duration::from_secs(cfg.idle_timeout_s.into()),
        api_key: cfg.api_key.clone(),
    }
}

/// The port the Zeroconf announcement goes out on: [`zeroconf::MDNS_PORT`], or
/// `HERALD_TEST_MDNS_PORT` (the tests announce on a private port, away from the machine's real
/// mDNS responders).
fn mdns_port() -> u16 {
    std::env::var("HERALD_TEST_MDNS_PORT").ok().and_then(|v| v.parse().ok()).unwrap_or(zeroconf::MDNS_PORT)
}

impl Servers {
    /// Start the Wyoming server once the model is loaded: until then its clients wait in the
    /// listening socket's backlog (a Wyoming client such as Home Assistant takes an error to
    /// `describe` as a broken server), then announce it over Zeroconf when wanted.
    fn start_wyoming(&mut self, net: &mut Network, cfg: &ServeConfig, slot: &Slot) -> Result<(), Failure> {
        let Some(l) = net.wyoming.take() else { return Ok(()) };
        let w = WyomingServer::start(l, slot.clone(), wyoming_settings(cfg)).map_err(bug("cannot start the Wyoming server"))?;
        if cfg.zeroconf == Zeroconf::Auto && zeroconf::wanted(&w.local_addr()) {
            match zeroconf::Announcement::start(w.local_addr(), mdns_port()) {
                Ok(a) => self.zeroconf = Some(a),
                Err(e) => log::warn!("{e}; Home Assistant will not discover herald by itself (add it by host and port)"),
            }
        }
        self.wyoming = Some(w);
        Ok(())
    }

    /// One phrase per server for the ready line: `Wyoming on tcp://…`, `HTTP on http://…`.
    fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(w) = &self.wyoming {
            v.push(format!("Wyoming on tcp://{}", w.local_addr()));
        }
        if let Some(h) = &self.http {
            v.push(format!("HTTP on http://{}", h.local_addr()));
        }
        v
    }

    /// Stop accepting and give the open streams `grace` to end.
    fn shutdown(self, grace: Duration) {
        let deadline = Instant::now() + grace;
        if let Some(z) = self.zeroconf {
            z.stop();
        }
        // both stop accepting and close their idle connections first, then share one grace
        let mut wyoming = self.wyoming;
        if let Some(w) = wyoming.as_mut() {
            w.begin_shutdown();
        }
        if let Some(h) = &self.http {
            h.begin_shutdown();
        }
        if let Some(h) = self.http {
            h.finish_shutdown(deadline);
        }
        if let Some(w) = wyoming {
            w.finish(deadline);
        }
    }
}

/// The exit of a failed self-test: the code of what failed (the job's error as `herald speak`
/// maps it; 4 for a model that made no audio or non-numbers; 2 for a voice or text front-end
/// that cannot speak the sentence), the message naming the bundle and the key that skips it.
fn self_test_failure(e: SelfTestError, dir: &Path) -> Failure {
    let code = match &e {
        SelfTestError::Job(job) => exit::job_code(job),
        SelfTestError::Request(_) => exit::INPUT,
        SelfTestError::NoAudio { .. } | SelfTestError::NotFinite { .. } => exit::BUNDLE,
        SelfTestError::Stopped => exit::INTERRUPTED,
    };
    let context = format!("the self-test of bundle {} failed, so herald did not report ready (serve.self_test)", dir.display());
    fail(code, anyhow::Error::new(e).context(context))
}

/// The FIFO of `serve.fifo`: `None` for `off` (any case; a FIFO named `off` is `./off`).
fn fifo_path(value: &str) -> Option<PathBuf> {
    let v = value.trim();
    (!v.eq_ignore_ascii_case("off")).then(|| PathBuf::from(value))
}

/// Check `serve.api_key` for the HTTP server at `http` (`None`: off): not blank, and set where
/// `http` is reachable from other machines; `origin`: where the key came from, for the message
/// ([`Config::origin`]). An empty key on loopback is logged (it means no authentication).
///
/// # Errors
/// What is wrong, naming the keys.
fn check_api_key(cfg: &ServeConfig, http: Option<SocketAddr>, origin: &str) -> anyhow::Result<()> {
    if let Some(key) = &cfg.api_key
        && (key.trim().is_empty() || key.trim() != key)
    {
        // an EnvironmentFile= line with a trailing space would otherwise lock every client out
        anyhow::bail!("serve.api_key is blank or has white space around it; a bearer token cannot carry it");
    }
    // set, but empty (`HERALD_SERVE_API_KEY=`): no key, like every optional key left empty
    let empty_key = cfg.api_key.is_none() && origin != "default";
    if let Some(a) = http
        && !a.ip().is_loopback()
        && empty_key
    {
        anyhow::bail!(
            "serve.api_key is empty ({origin}), but serve.http = {:?} is reachable from other machines \
             and needs a key: give it a value, or listen on a loopback address",
            cfg.http
        );
    }
    if http.is_some() && empty_key {
        log::info!("serve.api_key is empty ({origin}): the HTTP API on loopback needs no key");
    }
    if let Some(a) = http
        && !a.ip().is_loopback()
        && cfg.api_key.is_none()
    {
        anyhow::bail!(
            "serve.http = {:?} is reachable from other machines: set serve.api_key (HERALD_SERVE_API_KEY) \
             so that requests need a bearer token, or listen on a loopback address",
            cfg.http
        );
    }
    Ok(())
}

/// The keys a SIGHUP applies to the running service (docs/reliability.md "Signals"): the
/// shaping and ALSA settings of each new output, the voice of a request that names none, the
/// voice aliases, the text front-end (`[text]`; the replacement file is read again), the
/// amplifier line's lead, the longest text a network request may carry, and the network
/// servers' limits, timeouts and API key. Every other key needs a restart (the amplifier's chip, line and level: the line is
/// held open; the addresses: the sockets are bound).
pub const RELOADABLE: &[&str] = &[
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
    "synthesis.speed",
    "voices.aliases",
    "text.markdown",
    "text.emoji",
    "text.code",
    "text.urls",
    "text.replacements",
    "serve.max_text_chars",
    "serve.queue_length",
    "serve.max_connections",
    "serve.request_timeout_s",
    "serve.idle_timeout_s",
    "serve.api_key",
    "amplifier.lead_ms",
];

/// What a SIGHUP needs to reload the configuration.
struct Reloading {
    /// `--config`, if given (else `HERALD_CONFIG` or the default file, as at start).
    explicit: Option<PathBuf>,
    /// The command line's flags, applied again on top.
    overrides: CliOverrides,
    /// The configuration herald started with (what needs a restart is compared with it).
    started: Config,
    /// The configuration whose reloadable keys are in effect.
    applied: Mutex<Config>,
    slot: Slot,
    device: Option<DeviceHealth>,
    plays: bool,
    /// The HTTP server's settings and its address (`serve.http` needs a restart), when it runs.
    http: Option<(HttpReload, SocketAddr)>,
    /// The Wyoming server's settings, when it runs.
    wyoming: Option<WyomingReload>,
}

impl Reloading {
    /// Read the configuration again (file, the environment herald started with, the flags) and
    /// apply the [`RELOADABLE`] keys that changed; name the other changed keys in one line
    /// "... needs a restart". A configuration with an error changes nothing (one error line).
    fn reload(&self) {
        let mut new = match Config::load(self.explicit.as_deref(), &Config::process_env()) {
            Ok(c) => c,
            Err(e) => {
                log::error!("SIGHUP: {e}; nothing was changed");
                return;
            }
        };
        if let Err(e) = new.apply_cli(&self.overrides) {
            log::error!("SIGHUP: {e}; nothing was changed");
            return;
        }
        // the replacement rules are read again on every SIGHUP: a bad file changes nothing
        let settings = match crate::speaker::settings(&new, self.plays) {
            Ok(s) => s,
            Err(e) => {
                log::error!("SIGHUP: {e}; nothing was changed");
                return;
            }
        };
        let Some(front) = self.slot.get() else { return };
        let mut applied = self.applied.lock().unwrap_or_else(PoisonError::into_inner);
        let mut changed: Vec<&str> = RELOADABLE.iter().copied().filter(|k| applied.get(k) != new.get(k)).collect();
        // the same file with other rules in it
        if !changed.contains(&"text.replacements") && settings.voice.text.replacements != front.live().get().voice.text.replacements {
            changed.push("text.replacements");
        }
        let restart: Vec<&str> = config::keys().filter(|k| !RELOADABLE.contains(k) && self.started.get(k) != new.get(k)).collect();
        if !changed.is_empty() {
            // everything is checked before anything changes
            if let Some((_, addr)) = &self.http
                && changed.contains(&"serve.api_key")
                && let Err(e) = check_api_key(&new.serve, Some(*addr), new.origin("serve.api_key"))
            {
                log::error!("SIGHUP: {e}; nothing was changed");
                return;
            }
            let aliases = match crate::speaker::aliases(&new, front.voices()) {
                Ok(a) => a,
                Err(e) => {
                    log::error!("SIGHUP: {e}; nothing was changed");
                    return;
                }
            };
            let voice = match front.bundle_voice(&settings.voice, &aliases) {
                Ok(v) => v,
                Err(e) => {
                    log::error!("SIGHUP: {e}; nothing was changed");
                    return;
                }
            };
            let amp_lead = Some(Duration::from_millis(new.amplifier.lead_ms.into()));
            front.live().set(LiveSettings {
                voice,
                aliases,
                output: settings.output,
                max_text_chars: new.serve.max_text_chars,
                amp_lead,
            });
            if let Some(d) = &self.device {
                d.set_device(&new.audio.device);
            }
            front.queue().set_capacity(new.serve.queue_length);
            if let Some((h, _)) = &self.http {
                h.apply(http_settings(&new.serve));
            }
            if let Some(w) = &self.wyoming {
                w.apply(wyoming_settings(&new.serve));
            }
            let list: Vec<String> = changed
                .iter()
                .map(|k| match (*k, new.get(k)) {
                    // a secret is never written to the log
                    ("serve.api_key", Some(_)) => format!("{k} (set)"),
                    (_, Some(v)) => format!("{k} = {v}"),
                    (_, None) => format!("{k} (not set)"),
                })
                .collect();
            log::info!("SIGHUP: reloaded {} (from the next request on)", list.join(", "));
            *applied = new;
        } else if restart.is_empty() {
            log::info!("SIGHUP: the configuration has not changed");
        }
        if !restart.is_empty() {
            log::warn!(
                "SIGHUP: {} changed, which needs a restart (systemctl restart herald); the rest is reloaded",
                restart.join(", ")
            );
        }
    }
}

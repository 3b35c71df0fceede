//! ALSA playback through alsa-lib (the `alsa` crate).

use std::time::{Duration, Instant};

use alsa::device_name::HintIter;
use alsa::pcm::{Access, Format, HwParams, PCM};
use alsa::{Direction, ValueOr};

use super::{AudioSink, SampleFormat, ShaperSettings, ShapingStage, SinkError, SinkStats, StreamResampler};
use crate::pcm::f32_to_s16;

/// Advice appended to negotiation errors.
const PLUG_HINT: &str = "; a `hw:` device converts nothing: use `plughw:CARD=<name>,DEV=0` or `default` \
     (Raspberry Pi HDMI: `sysdefault:` or `hdmi:`)";

/// Settings of an [`AlsaSink`].
#[derive(Debug, Clone, PartialEq)]
pub struct AlsaSettings {
    /// PCM name: `default`, `plughw:CARD=Headphones,DEV=0`, `sysdefault:`, `hw:0,0`, or any PCM
    /// from the ALSA configuration ([`list_playback_devices`] lists them). Default `default`.
    pub device: String,
    /// Sample format to ask for first. If the device refuses it, the others of S16_LE,
    /// FLOAT_LE, S32_LE are tried in that order. Default [`SampleFormat::S16`].
    pub format: SampleFormat,
    /// Requested period, ms (the granted size is read back). Default 20.
    pub period_ms: u32,
    /// Requested buffer size in periods (≥ 2; 4 recommended). Default 4.
    pub periods: u32,
    /// Start threshold in periods: playback starts once this much is queued (capped at the
    /// buffer). 1 gives the lowest first-audio latency. Default 1.
    pub start_periods: u32,
    /// Let alsa-lib resample (`plug`/`dmix` rate plugins, usually the `linear` converter) instead
    /// of herald. Default `false`: herald asks for the model rate, reads back what the device
    /// grants and resamples in-process with rubato when they differ.
    pub alsa_resample: bool,
    /// Open retries while the device is busy (EBUSY), after the first attempt. Default 5.
    pub busy_retries: u32,
    /// Pause between busy retries. Default 200 ms.
    pub busy_retry_delay: Duration,
    /// A write fails with [`SinkError::Stalled`] when the device takes no frames for this long.
    /// Default 2 s.
    pub stall_timeout: Duration,
}

impl Default for AlsaSettings {
    fn default() -> Self {
        Self {
            device: "default".into(),
            format: SampleFormat::S16,
            period_ms: 20,
            periods: 4,
            start_periods: 1,
            alsa_resample: false,
            busy_retries: 5,
            busy_retry_delay: Duration::from_millis(200),
            stall_timeout: Duration::from_secs(2),
        }
    }
}

/// A playback PCM from the ALSA configuration's name hints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// PCM name to pass as [`AlsaSettings::device`], e.g. `plughw:CARD=PCH,DEV=0`.
    pub name: String,
    /// Human description; ALSA's multi-line descriptions are joined with ", " (may be empty).
    pub description: String,
}

/// List the playback PCMs that alsa-lib's name hints (`snd_device_name_hint`) report, in
/// configuration order: the configured virtual devices (`default`, `sysdefault`, `dmix`…) and a
/// `hw`/`plughw`/… entry per card device.
///
/// Errors: [`SinkError::Alsa`] if the hint query fails.
pub fn list_playback_devices() -> Result<Vec<DeviceInfo>, SinkError> {
    let hints = HintIter::new_str(None, "pcm").map_err(|source| SinkError::Alsa {
        device: "(all)".into(),
        op: "snd_device_name_hint",
        source,
    })?;
    Ok(hints
        .filter(|h| h.direction != Some(Direction::Capture))
        .filter_map(|h| {
            let name = h.name?;
            let description = h.desc.unwrap_or_default().lines().map(str::trim).collect::<Vec<_>>().join(", ");
            Some(DeviceInfo { name, description })
        })
        .collect())
}

/// Whether a playback PCM can be opened now, without a sound: [`probe_device`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Openable {
    /// It opened (and was closed at once).
    Yes,
    /// It exists, but another program holds it (EBUSY).
    Busy,
    /// It cannot be opened; the error says why.
    No,
}

/// Open `device` for playback (non-blocking, no hardware parameters: nothing is played) and
/// close it at once: whether the device is there. alsa-lib's own messages go to the log at
/// debug level ([`quiet`]).
///
/// # Errors
/// [`SinkError::NotFound`] for a PCM or card that does not exist, [`SinkError::Busy`] (one
/// attempt) when another program holds it, [`SinkError::Config`] for a name alsa-lib cannot
/// take, and the open's error otherwise.
pub fn probe_device(device: &str) -> Result<(), SinkError> {
    if device.is_empty() || device.contains('\0') {
        return Err(SinkError::Config(format!("invalid ALSA device name {device:?}")));
    }
    match quiet(|| PCM::new(device, Direction::Playback, true)) {
        Ok(pcm) => {
            drop(pcm);
            Ok(())
        }
        Err(e) if matches!(e.errno(), libc::EBUSY | libc::EAGAIN) => {
            Err(SinkError::Busy { device: device.to_owned(), attempts: 1, waited_ms: 0 })
        }
        Err(e) => Err(open_error(device, e)),
    }
}

/// [`probe_device`] as [`Openable`].
pub fn openable(device: &str) -> Openable {
    match probe_device(device) {
        Ok(()) => Openable::Yes,
        Err(SinkError::Busy { .. }) => Openable::Busy,
        Err(_) => Openable::No,
    }
}

/// The error of a failed `snd_pcm_open` (not busy).
fn open_error(device: &str, e: alsa::Error) -> SinkError {
    if matches!(e.errno(), libc::ENOENT | libc::ENODEV | libc::ENXIO) {
        SinkError::NotFound { device: device.to_owned(), source: e }
    } else {
        alsa_error(device, "snd_pcm_open", e)
    }
}

thread_local! {
    /// This thread's alsa-lib error buffer ([`quiet`]).
    static ALSA_ERRORS: std::cell::RefCell<Option<std::rc::Rc<std::cell::RefCell<alsa::Output>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Run `f` with alsa-lib's error messages (the `ALSA lib pcm.c:… Unknown PCM …` lines it prints
/// to standard error by default) caught in a buffer: alsa-lib's thread-local error handler,
/// `snd_lib_error_set_local`, through the alsa crate's [`alsa::Output::local_error_handler`].
/// They go to the log at debug level; herald's own one-line error says what failed. Messages
/// alsa-lib printed on this thread since the last call (while playing) are logged first.
pub fn quiet<T>(f: impl FnOnce() -> T) -> T {
    let log_buffer = |buffer: &std::rc::Rc<std::cell::RefCell<alsa::Output>>| {
        let text = buffer.borrow().to_string();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            log::debug!("alsa-lib: {line}");
        }
    };
    // a fresh buffer each time: the old one is logged and dropped (alsa-lib has no call that
    // empties one)
    let old = ALSA_ERRORS.with_borrow_mut(|slot| slot.take());
    if let Some(b) = &old {
        log_buffer(b);
    }
    let fresh = alsa::Output::local_error_handler().ok();
    let out = f();
    if let Some(b) = &fresh {
        log_buffer(b);
        // empty again, and installed for what alsa-lib says later on this thread
        let again = alsa::Output::local_error_handler().ok();
        ALSA_ERRORS.with_borrow_mut(|slot| *slot = again);
    }
    out
}

/// The open PCM and what the device granted.
struct Open {
    pcm: PCM,
    rate: u32,
    channels: u32,
    format: SampleFormat,
    period: u32,
    buffer: u32,
}

/// Plays utterances on an ALSA PCM.
///
/// Per utterance (`begin` … `finish`): opens the PCM (non-blocking open, so a busy `hw:`
/// device fails fast instead of sleeping in the kernel; EBUSY is retried
/// [`busy_retries`](AlsaSettings::busy_retries) times), negotiates, plays, drains and
/// **closes** it. Holding no handle between utterances keeps the device free for other
/// programs (chimes, another player on `hw:`) and avoids the "device busy after rapid successive
/// runs" trap; the cost is one open + negotiation per utterance (a few ms). `abort` and drop
/// also close it.
///
/// Negotiation: interleaved read/write access; the preferred [`SampleFormat`] or another;
/// 1 channel, or the nearest count the device takes (the mono signal is then copied into every
/// channel); the rate nearest to the model rate (with alsa-lib resampling disabled unless
/// [`alsa_resample`](AlsaSettings::alsa_resample)); a period near `period_ms` and a buffer of
/// `periods` periods. All granted values are read back and reported in [`SinkStats`]. When the
/// rate differs, a [`StreamResampler`] converts in-process, streaming across writes and flushed
/// at `finish` to exactly `round(n · device_rate / model_rate)` frames.
///
/// Software parameters: start threshold = `start_periods` periods (default one period, for a
/// short time to first audio: TTS chunks arrive as 160 ms+ bursts, so the buffer fills at once),
/// avail_min = one period, stop threshold = the buffer (an underrun is the buffer running empty).
///
/// Playback: non-blocking `snd_pcm_writei` plus `snd_pcm_wait`. On an underrun (EPIPE) or
/// suspend (ESTRPIPE) the stream is recovered (`snd_pcm_recover`) and the frames that had not
/// been accepted are written again, so no sample is dropped or duplicated; each underrun is
/// counted and logged with `log::warn!`. `finish` drains (bounded wait); a drain EIO, seen on
/// QEMU virtio-snd although all audio was played, is logged and not treated as a failure.
pub struct AlsaSink {
    settings: AlsaSettings,
    stage: ShapingStage,
    open: Option<Open>,
    resampler: Option<StreamResampler>,
    use_resampler: bool,
    resampled: Vec<f32>,
    bytes: Vec<u8>,
    frames: u64,
    xruns: u32,
}

impl AlsaSink {
    /// A sink for `settings.device`; nothing is opened until `begin`.
    pub fn new(settings: AlsaSettings, shaper: ShaperSettings) -> Self {
        Self {
            settings,
            stage: ShapingStage::new(shaper),
            open: None,
            resampler: None,
            use_resampler: false,
            resampled: Vec::new(),
            bytes: Vec::new(),
            frames: 0,
            xruns: 0,
        }
    }

    /// The settings in use.
    pub fn settings(&self) -> &AlsaSettings {
        &self.settings
    }

    fn err(&self, op: &'static str, source: alsa::Error) -> SinkError {
        alsa_error(&self.settings.device, op, source)
    }

    fn open_pcm(&self) -> Result<PCM, SinkError> {
        let device = &self.settings.device;
        if device.is_empty() || device.contains('\0') {
            return Err(SinkError::Config(format!("invalid ALSA device name {device:?}")));
        }
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            match PCM::new(device, Direction::Playback, true) {
                Ok(pcm) => {
                    if attempts > 1 {
                        log::info!("audio device '{device}' opened after {attempts} attempts");
                    }
                    return Ok(pcm);
                }
                Err(e) if matches!(e.errno(), libc::EBUSY | libc::EAGAIN) => {
                    if attempts > self.settings.busy_retries {
                        return Err(SinkError::Busy {
                            device: device.clone(),
                            attempts,
                            waited_ms: started.elapsed().as_millis() as u64,
                        });
                    }
                    log::warn!(
                        "audio device '{device}' is busy (attempt {attempts} of {}); retrying in {} ms",
                        self.settings.busy_retries + 1,
                        self.settings.busy_retry_delay.as_millis()
                    );
                    std::thread::sleep(self.settings.busy_retry_delay);
                }
                Err(e) => return Err(open_error(device, e)),
            }
        }
    }

    fn unsupported(&self, what: String, source: alsa::Error) -> SinkError {
        SinkError::Unsupported { device: self.settings.device.clone(), what, source, hint: PLUG_HINT }
    }

    /// Negotiate hardware and software parameters for mono audio at `rate` Hz.
    fn negotiate(&self, pcm: PCM, rate: u32) -> Result<Open, SinkError> {
        let s = &self.settings;
        {
            let hwp = HwParams::any(&pcm).map_err(|e| self.err("snd_pcm_hw_params_any", e))?;
            hwp.set_rate_resample(s.alsa_resample).map_err(|e| self.err("snd_pcm_hw_params_set_rate_resample", e))?;
            hwp.set_access(Access::RWInterleaved).map_err(|e| self.unsupported("interleaved read/write access".into(), e))?;
            let mut order = vec![s.format];
            for f in [SampleFormat::S16, SampleFormat::F32, SampleFormat::S32] {
                if !order.contains(&f) {
                    order.push(f);
                }
            }
            let mut last = None;
            let mut chosen = None;
            for f in order {
                match hwp.set_format(alsa_format(f)) {
                    Ok(()) => {
                        chosen = Some(f);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            if chosen.is_none() {
                let e = last.unwrap_or_else(|| alsa::Error::unsupported("snd_pcm_hw_params_set_format"));
                return Err(self.unsupported("S16_LE, FLOAT_LE or S32_LE samples".into(), e));
            }
            if hwp.set_channels(1).is_err() {
                hwp.set_channels_near(2).map_err(|e| self.unsupported("any channel count".into(), e))?;
            }
            hwp.set_rate_near(rate, ValueOr::Nearest).map_err(|e| self.unsupported(format!("a sample rate near {rate} Hz"), e))?;
            let granted_rate = hwp.get_rate().map_err(|e| self.err("snd_pcm_hw_params_get_rate", e))?;
            let period = (u64::from(granted_rate) * u64::from(s.period_ms.max(1)) / 1000).max(16) as alsa::pcm::Frames;
            let periods = s.periods.max(2) as alsa::pcm::Frames;
            hwp.set_buffer_size_near(period * periods)
                .map_err(|e| self.unsupported(format!("a buffer of {} frames", period * periods), e))?;
            hwp.set_period_size_near(period, ValueOr::Nearest)
                .map_err(|e| self.unsupported(format!("a period of {period} frames"), e))?;
            pcm.hw_params(&hwp).map_err(|e| self.unsupported("the negotiated hardware parameters".into(), e))?;
        }
        let (rate_g, channels, format, period, buffer) = {
            let cur = pcm.hw_params_current().map_err(|e| self.err("snd_pcm_hw_params_current", e))?;
            let fmt = cur.get_format().map_err(|e| self.err("snd_pcm_hw_params_get_format", e))?;
            let format = match fmt {
                f if f == Format::s16() => SampleFormat::S16,
                f if f == Format::s32() => SampleFormat::S32,
                f if f == Format::float() => SampleFormat::F32,
                _ => return Err(self.err("snd_pcm_hw_params_get_format", alsa::Error::unsupported("format"))),
            };
            (
                cur.get_rate().map_err(|e| self.err("snd_pcm_hw_params_get_rate", e))?,
                cur.get_channels().map_err(|e| self.err("snd_pcm_hw_params_get_channels", e))?,
                format,
                cur.get_period_size().map_err(|e| self.err("snd_pcm_hw_params_get_period_size", e))? as u32,
                cur.get_buffer_size().map_err(|e| self.err("snd_pcm_hw_params_get_buffer_size", e))? as u32,
            )
        };
        {
            let swp = pcm.sw_params_current().map_err(|e| self.err("snd_pcm_sw_params_current", e))?;
            let start = (u64::from(period) * u64::from(s.start_periods.max(1))).min(u64::from(buffer));
            swp.set_start_threshold(start as alsa::pcm::Frames).map_err(|e| self.err("snd_pcm_sw_params_set_start_threshold", e))?;
            swp.set_avail_min(period as alsa::pcm::Frames).map_err(|e| self.err("snd_pcm_sw_params_set_avail_min", e))?;
            pcm.sw_params(&swp).map_err(|e| self.err("snd_pcm_sw_params", e))?;
        }
        if buffer < 4 * period {
            log::warn!(
                "audio device '{}': buffer of {buffer} frames is only {:.1} periods of {period}; underruns are more likely",
                s.device,
                f64::from(buffer) / f64::from(period.max(1))
            );
        }
        log::debug!(
            "audio device '{}': {rate_g} Hz, {channels} ch, {format}, period {period}, buffer {buffer} (asked {rate} Hz, 1 ch, {})",
            s.device,
            s.format
        );
        Ok(Open { pcm, rate: rate_g, channels, format, period, buffer })
    }

    /// Convert the shaped samples (or, when `resampled`, their resampled copy: mono at the
    /// device rate) to the device's frames in `self.bytes` and play them all.
    fn play(&mut self, resampled: bool) -> Result<(), SinkError> {
        let Some(open) = self.open.as_ref() else {
            return Err(SinkError::Config("write before begin".into()));
        };
        let src = if resampled { &self.resampled[..] } else { self.stage.shaped() };
        if src.is_empty() {
            return Ok(());
        }
        fill_frames(src, open.channels as usize, open.format, &mut self.bytes);
        let frame_bytes = open.channels as usize * sample_bytes(open.format);
        let result = write_all(open, &self.settings, &self.bytes, frame_bytes, &mut self.frames, &mut self.xruns);
        if result.is_err() {
            self.close(true);
        }
        result
    }

    fn close(&mut self, drop_pending: bool) {
        // Dropping `PCM` calls snd_pcm_close; `snd_pcm_drop` first discards queued frames.
        if let Some(open) = self.open.take()
            && drop_pending
        {
            let _ = open.pcm.drop();
        }
        if let Some(r) = self.resampler.as_mut() {
            r.reset();
        }
    }

    /// Open and negotiate the device for an utterance at `sample_rate` Hz (closing one left
    /// open) and set up the resampler when the device plays another rate.
    fn open_device(&mut self, sample_rate: u32) -> Result<Open, SinkError> {
        if self.open.is_some() {
            log::warn!("audio device '{}': begin without finish; dropping the previous utterance", self.settings.device);
            self.close(true);
        }
        let pcm = self.open_pcm()?;
        let open = self.negotiate(pcm, sample_rate)?;
        self.use_resampler = open.rate != sample_rate;
        if self.use_resampler {
            let reuse = self.resampler.as_ref().is_some_and(|r| r.in_rate() == sample_rate && r.out_rate() == open.rate);
            if reuse {
                if let Some(r) = self.resampler.as_mut() {
                    r.reset();
                }
            } else {
                self.resampler = Some(StreamResampler::new(sample_rate, open.rate)?);
            }
            log::debug!(
                "audio device '{}' plays {} Hz; resampling {sample_rate} Hz -> {} Hz in herald",
                self.settings.device,
                open.rate,
                open.rate
            );
        }
        Ok(open)
    }

    /// Play out what the buffer holds. herald first waits for the buffer to empty itself,
    /// watching `snd_pcm_delay`: alsa-lib's `snd_pcm_drain` blocks inside some plugins (ioplug:
    /// bluealsa, pulse, pipewire) even on a non-blocking stream, and never returns from a device
    /// whose clock stopped. A delay that does not shrink for `stall_timeout` ends the wait with
    /// a warning and the rest dropped (the utterance counts as played); a device that went
    /// away meanwhile is [`SinkError::Gone`]. Then `snd_pcm_drain`, which has (almost) nothing
    /// left to wait for, within the buffer's length + `stall_timeout`.
    fn drain(&self, open: &Open) -> Result<(), SinkError> {
        let frame_time = Duration::from_secs_f64(f64::from(open.buffer) / f64::from(open.rate.max(1)));
        let nap = Duration::from_secs_f64((f64::from(open.period) / f64::from(open.rate.max(1)) / 2.0).clamp(0.001, 0.01));
        if !self.wait_played(open, nap)? {
            return Ok(());
        }
        let deadline = Instant::now() + frame_time + self.settings.stall_timeout;
        loop {
            match open.pcm.drain() {
                Ok(()) => return Ok(()),
                Err(e) if e.errno() == libc::EAGAIN => {
                    if Instant::now() > deadline {
                        log::warn!(
                            "audio device '{}': drain did not finish within {} ms; dropping the rest",
                            self.settings.device,
                            (frame_time + self.settings.stall_timeout).as_millis()
                        );
                        let _ = open.pcm.drop();
                        return Ok(());
                    }
                    std::thread::sleep(nap);
                }
                // The buffer ran empty after the last write: everything was played.
                Err(e) if e.errno() == libc::EPIPE => return Ok(()),
                Err(e) if e.errno() == libc::EIO => {
                    log::warn!(
                        "audio device '{}': drain failed with EIO after all frames were written (known on QEMU virtio-snd); ignored",
                        self.settings.device
                    );
                    return Ok(());
                }
                Err(e) => return Err(self.err("snd_pcm_drain", e)),
            }
        }
    }

    /// Wait until the device has played what was written: `Ok(true)` to drain now, `Ok(false)`
    /// when the stream is over already (it ran empty, or stalled and was dropped).
    fn wait_played(&self, open: &Open, nap: Duration) -> Result<bool, SinkError> {
        use alsa::pcm::State;
        let device = &self.settings.device;
        let gone = |op| alsa_error(device, op, alsa::Error::new(op, libc::ENODEV));
        if open.pcm.state() == State::Prepared {
            // fewer frames than the start threshold were written: start playing them
            match open.pcm.start() {
                Ok(()) => {}
                Err(e) if e.errno() == libc::EPIPE => return Ok(false),
                Err(e) => return Err(self.err("snd_pcm_start", e)),
            }
        }
        let mut last = i64::MAX;
        let mut since = Instant::now();
        loop {
            match open.pcm.state() {
                State::Disconnected => return Err(gone("snd_pcm_state")),
                State::Running | State::Draining | State::Paused | State::Suspended => {}
                // ran empty (an underrun at the very end) or stopped: everything was played
                _ => return Ok(false),
            }
            match open.pcm.delay() {
                Ok(d) if d <= 0 => return Ok(true),
                Ok(d) => {
                    if d < last {
                        last = d;
                        since = Instant::now();
                    } else if since.elapsed() > self.settings.stall_timeout {
                        log::warn!(
                            "audio device '{device}': the last {d} frames did not play within {} ms; dropping them",
                            self.settings.stall_timeout.as_millis()
                        );
                        let _ = open.pcm.drop();
                        return Ok(false);
                    }
                }
                Err(e) if e.errno() == libc::EPIPE => {
                    return if open.pcm.state() == State::Disconnected { Err(gone("snd_pcm_delay")) } else { Ok(false) };
                }
                Err(e) => return Err(self.err("snd_pcm_delay", e)),
            }
            std::thread::sleep(nap);
        }
    }
}

fn alsa_format(f: SampleFormat) -> Format {
    match f {
        SampleFormat::S16 => Format::s16(),
        SampleFormat::S32 => Format::s32(),
        SampleFormat::F32 => Format::float(),
    }
}

fn sample_bytes(f: SampleFormat) -> usize {
    match f {
        SampleFormat::S16 => 2,
        SampleFormat::S32 | SampleFormat::F32 => 4,
    }
}

/// Interleave mono `src` into `channels` copies in the device format (native endian), into
/// `out` (cleared; capacity reused). S32 carries the S16 value in its top 16 bits; F32 is
/// clamped to [-1, 1] with NaN → 0, like the integer formats.
fn fill_frames(src: &[f32], channels: usize, format: SampleFormat, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(src.len() * channels * sample_bytes(format));
    for &x in src {
        match format {
            SampleFormat::S16 => {
                let b = f32_to_s16(x).to_ne_bytes();
                for _ in 0..channels {
                    out.extend_from_slice(&b);
                }
            }
            SampleFormat::S32 => {
                let b = (i32::from(f32_to_s16(x)) << 16).to_ne_bytes();
                for _ in 0..channels {
                    out.extend_from_slice(&b);
                }
            }
            SampleFormat::F32 => {
                let v = if x.is_nan() { 0.0 } else { x.clamp(-1.0, 1.0) };
                let b = v.to_ne_bytes();
                for _ in 0..channels {
                    out.extend_from_slice(&b);
                }
            }
        }
    }
}

/// The error of alsa-lib call `op` on an open stream of `device`: [`SinkError::Gone`] when the
/// device has disappeared (ENODEV, ENXIO, ESHUTDOWN: what a removed card's calls return), else
/// [`SinkError::Alsa`].
fn alsa_error(device: &str, op: &'static str, source: alsa::Error) -> SinkError {
    match source.errno() {
        libc::ENODEV | libc::ENXIO | libc::ESHUTDOWN => SinkError::Gone { device: device.to_owned(), op, source },
        _ => SinkError::Alsa { device: device.to_owned(), op, source },
    }
}

/// Write every frame of `bytes`, waiting for room, recovering from underruns and rewriting the
/// frames that were not accepted. Adds accepted frames to `frames` and underruns to `xruns`.
fn write_all(
    open: &Open,
    settings: &AlsaSettings,
    bytes: &[u8],
    frame_bytes: usize,
    frames: &mut u64,
    xruns: &mut u32,
) -> Result<(), SinkError> {
    let device = &settings.device;
    let alsa_err = |op, source| alsa_error(device, op, source);
    let wait_ms = (u64::from(open.buffer) * 1000 / u64::from(open.rate.max(1))).clamp(5, 1000) as u32;
    let mut off = 0;
    let mut last_progress = Instant::now();
    while off < bytes.len() {
        let result = open.pcm.io_bytes().writei(&bytes[off..]);
        let failure = match result {
            Ok(n) if n > 0 => {
                off += n * frame_bytes;
                *frames += n as u64;
                last_progress = Instant::now();
                continue;
            }
            // No room (non-blocking mode): wait for a period to free up, within the stall limit.
            Ok(_) => wait_for_room(open, settings, wait_ms, last_progress)?,
            Err(e) if e.errno() == libc::EAGAIN => wait_for_room(open, settings, wait_ms, last_progress)?,
            Err(e) => Some(("snd_pcm_writei", e)),
        };
        let Some((op, err)) = failure else {
            continue;
        };
        let pending = (bytes.len() - off) / frame_bytes;
        match err.errno() {
            // a removed card's stream reads as an underrun in some plugins: it is not one
            libc::EPIPE if open.pcm.state() == alsa::pcm::State::Disconnected => {
                return Err(alsa_err(op, alsa::Error::new(op, libc::ENODEV)));
            }
            libc::EPIPE => {
                *xruns += 1;
                log::warn!(
                    "audio device '{device}': underrun #{} after {} frames; recovering and rewriting the {pending} pending frames",
                    *xruns,
                    *frames
                );
            }
            libc::ESTRPIPE => log::warn!("audio device '{device}': stream suspended; resuming"),
            libc::EINTR => {}
            _ => return Err(alsa_err(op, err)),
        }
        open.pcm.try_recover(err, true).map_err(|e| alsa_err("snd_pcm_recover", e))?;
        // progress is frames accepted, not recoveries: a device that underruns again and again
        // without taking a frame (a pointer that keeps failing) is stalled, not busy
        if last_progress.elapsed() > settings.stall_timeout {
            return Err(SinkError::Stalled { device: device.clone(), waited_ms: last_progress.elapsed().as_millis() as u64 });
        }
    }
    Ok(())
}

/// Wait until the device has room. `Ok(None)`: try writing again; `Ok(Some(..))`: `snd_pcm_wait`
/// reported an error (an underrun, usually) for the caller to recover from.
fn wait_for_room(
    open: &Open,
    settings: &AlsaSettings,
    wait_ms: u32,
    last_progress: Instant,
) -> Result<Option<(&'static str, alsa::Error)>, SinkError> {
    if last_progress.elapsed() > settings.stall_timeout {
        return Err(SinkError::Stalled { device: settings.device.clone(), waited_ms: last_progress.elapsed().as_millis() as u64 });
    }
    match open.pcm.wait(Some(wait_ms)) {
        Ok(_) => Ok(None),
        Err(e) => Ok(Some(("snd_pcm_wait", e))),
    }
}

impl AudioSink for AlsaSink {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.stage.begin(sample_rate)?;
        match quiet(|| self.open_device(sample_rate)) {
            Ok(open) => {
                self.open = Some(open);
                self.frames = 0;
                self.xruns = 0;
                Ok(())
            }
            Err(e) => {
                self.stage.abort();
                Err(e)
            }
        }
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        if self.open.is_none() {
            return Err(SinkError::Config("write before begin".into()));
        }
        let shaped = self.stage.process(samples)?;
        if self.use_resampler {
            self.resampled.clear();
            if let Some(r) = self.resampler.as_mut() {
                r.process(shaped, &mut self.resampled)?;
            }
        }
        self.play(self.use_resampler)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        if self.open.is_none() {
            return Err(SinkError::Config("finish before begin".into()));
        }
        let shaped = self.stage.finish()?;
        if self.use_resampler {
            self.resampled.clear();
            if let Some(r) = self.resampler.as_mut() {
                r.process(shaped, &mut self.resampled)?;
                r.finish(&mut self.resampled)?;
            }
        }
        self.play(self.use_resampler)?;
        let Some(open) = self.open.take() else {
            return Err(SinkError::Config("finish before begin".into()));
        };
        let drained = self.drain(&open);
        let stats = SinkStats {
            input_samples: self.stage.input_samples(),
            frames_written: self.frames,
            xruns: self.xruns,
            device_rate: open.rate,
            channels: open.channels,
            format: open.format,
            period_frames: open.period,
            buffer_frames: open.buffer,
            resampled: self.use_resampler,
        };
        drop(open); // snd_pcm_close: the device is free between utterances.
        drained.map(|()| stats)
    }

    fn abort(&mut self) {
        self.close(true);
        self.stage.abort();
    }
}

impl Drop for AlsaSink {
    fn drop(&mut self) {
        self.close(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_interleaved_copies_in_the_device_format() {
        let mut out = Vec::new();
        fill_frames(&[0.5, -1.0], 2, SampleFormat::S16, &mut out);
        let s: Vec<i16> = out.chunks(2).map(|b| i16::from_ne_bytes([b[0], b[1]])).collect();
        assert_eq!(s, [16384, 16384, -32767, -32767]);
        fill_frames(&[0.5], 1, SampleFormat::S32, &mut out);
        assert_eq!(i32::from_ne_bytes([out[0], out[1], out[2], out[3]]), 16384 << 16);
        fill_frames(&[2.0, f32::NAN], 1, SampleFormat::F32, &mut out);
        let f: Vec<f32> = out.chunks(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(f, [1.0, 0.0]);
    }

    #[test]
    fn bad_device_names_are_config_errors() {
        for name in ["", "a\0b"] {
            let mut sink = AlsaSink::new(AlsaSettings { device: name.into(), ..AlsaSettings::default() }, ShaperSettings::default());
            assert!(matches!(sink.begin(24000), Err(SinkError::Config(_))));
        }
    }
}

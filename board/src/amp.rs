//! Amplifier-enable GPIO line (`[amplifier]` in the config): the line is driven active a lead
//! time before the first sample of an utterance and inactive once the audio has drained, so the
//! speaker amplifier (e.g. the SD pin of a MAX98357-class I2S amplifier) is off between
//! utterances and has time to wake before speech starts.
//!
//! - [`Amplifier`] drives any embedded-hal 1.0 [`OutputPin`] and knows the active level and the
//!   lead time; [`AmpSink`] wraps any [`AudioSink`] with one.
//! - [`open_line`] opens the real line: it finds the GPIO chip by its **label** among the
//!   `/dev/gpiochip*` character devices (never by number: the Raspberry Pi 5 header chip moved
//!   from `gpiochip4` to `gpiochip0` in kernel 6.6.45, raspberrypi/linux#6144) and requests the
//!   line as an output with consumer `"herald"`, initially inactive.
//!
//! **Start-up, not mid-utterance:** [`open_line`] does every check that can fail on a
//! misconfigured board (chip present, line in range, line free, permission). The caller must call
//! it when the program starts, before the model is loaded, and refuse to start on an error
//! (exit code 3, see [`AmpError::kind`]); afterwards only writes to an already-requested line
//! remain, which fail only when the hardware does.
//!
//! **Why linux-embedded-hal's `CdevPin` (gpio-cdev, GPIO uAPI v1) and not `gpiocdev` (v1 + v2):**
//! an amplifier enable is a single output line that is set and cleared, which uAPI v1 does
//! completely; v2 adds debounce, edge-event clocks and per-line configuration of multi-line
//! requests, none of which this needs. v1 is built by default whenever the GPIO character device
//! is (`CONFIG_GPIO_CDEV_V1`, `default y` since Linux 5.10; Debian's kernels enable it). A kernel
//! built without it makes [`open_line`] fail at start-up with [`AmpError::Request`] (ENOTTY from
//! the line-handle ioctl), never silently; switching to `gpiocdev` then only replaces
//! [`open_line`], since [`Amplifier`] takes any [`OutputPin`]. Both crates are pure Rust (no C
//! library), so the aarch64 cross build needs nothing extra. `CdevPin::set_high` means the
//! physical level high (it undoes a kernel `ACTIVE_LOW` flag), and herald requests the line
//! without that flag: `amplifier.active` is the only inversion.

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::time::Duration;

use embedded_hal::digital::OutputPin;
use linux_embedded_hal::CdevPin;
use linux_embedded_hal::gpio_cdev::{self, Chip, LineRequestFlags};

use crate::audio::{AudioSink, SinkError, SinkErrorKind, SinkStats};

/// Consumer name herald gives the kernel for the line (`gpioinfo` shows it).
pub const CONSUMER: &str = "herald";

/// The directory scanned for GPIO character devices by [`open_line`].
pub const DEV_DIR: &str = "/dev";

/// What to do about a permission error on a GPIO character device (Debian and Raspberry Pi OS
/// give group `gpio` read/write access to `/dev/gpiochip*`; systemd's `DeviceAllow=` names the
/// device class as listed in `/proc/devices`).
const PERMISSION_HINT: &str = "add herald's user to group gpio, and if the systemd unit restricts devices, \
     allow them with DeviceAllow=char-gpiochip rw";

/// Errors of the amplifier line. Every message names the chip label, the line and what to do.
///
/// The binary maps all of them to exit code 3 ("audio device"), like [`SinkError`]s about the
/// device: [`AmpError::kind`] classifies them with the same [`SinkErrorKind`].
#[derive(Debug, thiserror::Error)]
pub enum AmpError {
    /// The directory of character devices could not be listed.
    #[error("amplifier GPIO: cannot list {}: {source}", dir.display())]
    Scan {
        /// The directory scanned (normally `/dev`).
        dir: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// No GPIO chip carries the configured label.
    #[error(
        "amplifier GPIO: no GPIO chip labelled '{label}' in {} (chip labels found: {}){}; `gpiodetect` lists the chips",
        dir.display(), list_or_none(found), unreadable_note(unreadable)
    )]
    NoChip {
        /// The configured label (`amplifier.chip`).
        label: String,
        /// The directory scanned.
        dir: PathBuf,
        /// Labels of the chips that exist, in chip-number order (empty: none).
        found: Vec<String>,
        /// `gpiochip*` entries that could not be read as GPIO chips, as "path: error".
        unreadable: Vec<String>,
    },
    /// The label was not found, and at least one chip could not be opened for lack of
    /// permission, so it may be the one.
    #[error(
        "amplifier GPIO: looking for chip '{label}': permission denied opening {} ({source}); {PERMISSION_HINT}",
        path.display()
    )]
    ChipAccess {
        /// The configured label.
        label: String,
        /// The first chip device that could not be opened.
        path: PathBuf,
        /// The OS error (EACCES / EPERM).
        source: std::io::Error,
    },
    /// The chip exists but has no line at that offset.
    #[error(
        "amplifier GPIO: chip '{label}' ({}) has no line {line}: it has {lines} lines (offsets 0..{lines})",
        path.display()
    )]
    NoLine {
        /// The chip label.
        label: String,
        /// The chip's device path.
        path: PathBuf,
        /// The configured line offset (`amplifier.line`).
        line: u32,
        /// Number of lines of the chip.
        lines: u32,
    },
    /// The line is already requested by someone else (another process, a driver, a gpio-hog).
    #[error(
        "amplifier GPIO: line {line} of chip '{label}' ({}) is busy: in use by '{consumer}'; stop that user \
         (another herald, a gpioset, a device-tree overlay) or pick another line",
        path.display()
    )]
    Busy {
        /// The chip label.
        label: String,
        /// The chip's device path.
        path: PathBuf,
        /// The line offset.
        line: u32,
        /// The consumer the kernel reports, or "unknown".
        consumer: String,
    },
    /// Any other failure to get the line (an ioctl refused, no uAPI v1 in the kernel, …).
    #[error("amplifier GPIO: {op} for line {line} of chip '{label}' ({}) failed: {source}{hint}", path.display())]
    Request {
        /// The chip label.
        label: String,
        /// The chip's device path.
        path: PathBuf,
        /// The line offset.
        line: u32,
        /// What was being done, e.g. "requesting the line as output".
        op: &'static str,
        /// gpio-cdev's error.
        source: gpio_cdev::Error,
        /// Advice for the errno (may be empty).
        hint: &'static str,
    },
    /// Driving an already-requested line failed (only the hardware can cause this).
    #[error("amplifier GPIO: driving {name} {level} failed: {source}")]
    Pin {
        /// Which line, e.g. "line 17 of chip 'pinctrl-rp1' (/dev/gpiochip0)".
        name: String,
        /// "active (high)", "inactive (low)", ….
        level: String,
        /// The pin's error.
        source: Box<dyn StdError + Send + Sync>,
    },
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ")
    }
}

fn unreadable_note(items: &[String]) -> String {
    if items.is_empty() { String::new() } else { format!("; not readable as GPIO chips: {}", items.join(", ")) }
}

impl AmpError {
    /// Classify this error like a sink error, so the binary uses one mapping for both: every
    /// kind here is about the audio device (exit code 3). `NoChip`, `NoLine` → `NotFound`;
    /// `Busy` → `Busy`; everything else → `Device`.
    pub fn kind(&self) -> SinkErrorKind {
        match self {
            AmpError::NoChip { .. } | AmpError::NoLine { .. } => SinkErrorKind::NotFound,
            AmpError::Busy { .. } => SinkErrorKind::Busy,
            AmpError::Scan { .. } | AmpError::ChipAccess { .. } | AmpError::Request { .. } | AmpError::Pin { .. } => {
                SinkErrorKind::Device
            }
        }
    }
}

/// Sleeps for the lead time; injectable so tests can observe the lead without waiting.
pub type Sleeper = Box<dyn FnMut(Duration) + Send>;

/// The amplifier on a real GPIO line, as [`open_line`] returns it.
pub type LineAmplifier = Amplifier<CdevPin>;

/// An amplifier-enable line: drives `pin` to the active level and waits `lead` on
/// [`enable`](Self::enable), drives it inactive on [`disable`](Self::disable), and drives it
/// inactive when dropped while still active.
///
/// Both calls are idempotent: a call that finds the line already in the wanted state writes
/// nothing (and `enable` does not wait again). The pin must be at the inactive level when it is
/// handed over ([`open_line`] requests it so).
pub struct Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    pin: P,
    active_low: bool,
    lead: Duration,
    sleep: Sleeper,
    enabled: bool,
    name: String,
}

impl<P> Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    /// An amplifier on `pin` (currently inactive) that is enabled by the low level when
    /// `active_low`, by the high level otherwise, and needs `lead` between enable and the first
    /// sample. Waits with [`std::thread::sleep`]; see [`with_sleeper`](Self::with_sleeper).
    pub fn new(pin: P, active_low: bool, lead: Duration) -> Self {
        Self {
            pin,
            active_low,
            lead,
            sleep: Box::new(std::thread::sleep),
            enabled: false,
            name: "amplifier line".to_owned(),
        }
    }

    /// Replace the function that waits the lead time (called once per enable, only when the lead
    /// is not zero).
    pub fn with_sleeper(mut self, sleep: impl FnMut(Duration) + Send + 'static) -> Self {
        self.sleep = Box::new(sleep);
        self
    }

    /// Name the line in error and log messages, e.g. "line 17 of chip 'pinctrl-rp1'".
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The line's name as used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Time waited after driving the line active.
    pub fn lead(&self) -> Duration {
        self.lead
    }

    /// Whether the low level enables the amplifier.
    pub fn active_low(&self) -> bool {
        self.active_low
    }

    /// Whether the line is currently driven active.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Drive the line active, then wait the lead time. Does nothing when already active.
    ///
    /// # Errors
    /// [`AmpError::Pin`] when the write fails (the amplifier is then considered off).
    pub fn enable(&mut self) -> Result<(), AmpError> {
        if self.enabled {
            return Ok(());
        }
        self.drive(true)?;
        self.enabled = true;
        log::debug!("{} active; waiting {} ms lead", self.name, self.lead.as_millis());
        if !self.lead.is_zero() {
            (self.sleep)(self.lead);
        }
        Ok(())
    }

    /// Drive the line inactive. Does nothing when already inactive.
    ///
    /// # Errors
    /// [`AmpError::Pin`] when the write fails (the amplifier is then still considered on, so a
    /// later `disable` or the drop tries again).
    pub fn disable(&mut self) -> Result<(), AmpError> {
        if !self.enabled {
            return Ok(());
        }
        self.drive(false)?;
        self.enabled = false;
        log::debug!("{} inactive", self.name);
        Ok(())
    }

    fn drive(&mut self, active: bool) -> Result<(), AmpError> {
        let high = active != self.active_low;
        let result = if high { self.pin.set_high() } else { self.pin.set_low() };
        result.map_err(|e| AmpError::Pin {
            name: self.name.clone(),
            level: format!("{} ({})", if active { "active" } else { "inactive" }, if high { "high" } else { "low" }),
            source: Box::new(e),
        })
    }
}

impl<P> Drop for Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    fn drop(&mut self) {
        if let Err(e) = self.disable() {
            log::warn!("{e}");
        }
    }
}

/// An [`AudioSink`] that switches an [`Amplifier`] around each utterance of the sink it wraps.
///
/// `begin` enables the amplifier (line active, then the lead wait) and then begins the inner
/// sink, so the line is active at least `lead` before the first sample; `finish` finishes the
/// inner sink (which drains the device) and then disables; `abort` aborts the inner sink and then
/// disables. When the inner sink fails, the line is made inactive first and the inner error is
/// returned. Dropping the sink drops the amplifier, which drives the line inactive if needed.
///
/// The lead wait happens inside `begin`, so it adds to the time to first audio unless the caller
/// enables earlier (e.g. when a request arrives) through [`amplifier_mut`](Self::amplifier_mut):
/// `begin` then finds the line active and does not wait again.
pub struct AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    inner: S,
    amp: Amplifier<P>,
}

impl<S, P> AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    /// Wrap `inner` with `amp`.
    pub fn new(inner: S, amp: Amplifier<P>) -> Self {
        Self { inner, amp }
    }

    /// The wrapped sink.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The amplifier.
    pub fn amplifier(&self) -> &Amplifier<P> {
        &self.amp
    }

    /// The amplifier, e.g. to enable it before synthesis starts.
    pub fn amplifier_mut(&mut self) -> &mut Amplifier<P> {
        &mut self.amp
    }

    /// Take the sink and the amplifier apart (the amplifier keeps its state).
    pub fn into_parts(self) -> (S, Amplifier<P>) {
        (self.inner, self.amp)
    }

    fn disable_after(&mut self, what: &str) -> Result<(), SinkError> {
        self.amp.disable().map_err(|e| {
            log::warn!("after {what}: {e}");
            to_sink_error(e)
        })
    }
}

/// A failed amplifier write as a [`SinkError::Amplifier`]: a device error (exit 3), with the
/// whole [`AmpError`] as its message.
fn to_sink_error(e: AmpError) -> SinkError {
    SinkError::Amplifier(Box::new(e))
}

impl<S, P> AudioSink for AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.amp.enable().map_err(to_sink_error)?;
        if let Err(e) = self.inner.begin(sample_rate) {
            // The inner error is the one worth reporting; a failing disable is logged.
            let _ = self.disable_after("a failed begin");
            return Err(e);
        }
        Ok(())
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.inner.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let result = self.inner.finish();
        let disabled = self.disable_after(if result.is_ok() { "finish" } else { "a failed finish" });
        let stats = result?;
        disabled?;
        Ok(stats)
    }

    fn abort(&mut self) {
        self.inner.abort();
        let _ = self.disable_after("abort");
    }
}

/// Open the amplifier line `line` of the GPIO chip labelled `chip_label` under [`DEV_DIR`]
/// (see [`open_line_in`]).
///
/// # Errors
/// As [`open_line_in`].
pub fn open_line(chip_label: &str, line: u32, active_low: bool, lead: Duration) -> Result<Amplifier<CdevPin>, AmpError> {
    open_line_in(Path::new(DEV_DIR), chip_label, line, active_low, lead)
}

/// Open the amplifier line: find the chip labelled `chip_label` among the `gpiochip*` devices
/// in `dir` ([`find_chip`]), check that `line` exists and is free, and request it as an output
/// with consumer [`CONSUMER`] at the inactive level (low, or high when `active_low`). The line
/// stays requested (and at its level) until the returned [`Amplifier`] is dropped.
///
/// Call this at start-up, before loading the model, so that a wrong setting stops the program
/// before any synthesis.
///
/// # Errors
/// [`AmpError::Scan`], [`AmpError::NoChip`], [`AmpError::ChipAccess`] from the chip lookup;
/// [`AmpError::NoLine`] when `line` ≥ the chip's line count; [`AmpError::Busy`] when another
/// consumer holds the line; [`AmpError::Request`] for any other refusal.
pub fn open_line_in(
    dir: &Path,
    chip_label: &str,
    line: u32,
    active_low: bool,
    lead: Duration,
) -> Result<Amplifier<CdevPin>, AmpError> {
    let mut chip = find_chip(dir, chip_label)?;
    let path = chip.path().to_path_buf();
    let lines = chip.num_lines();
    if line >= lines {
        return Err(AmpError::NoLine { label: chip_label.to_owned(), path, line, lines });
    }
    let request_err = |op, source: gpio_cdev::Error, path: &Path| {
        let hint = match errno_of(&source) {
            Some(libc::EACCES | libc::EPERM) => "; add herald's user to group gpio",
            Some(libc::ENOTTY | libc::EINVAL) => {
                "; the kernel may lack GPIO character-device uAPI v1 (CONFIG_GPIO_CDEV_V1)"
            }
            _ => "",
        };
        AmpError::Request { label: chip_label.to_owned(), path: path.to_path_buf(), line, op, source, hint }
    };
    let gpio = chip.get_line(line).map_err(|e| request_err("looking up the line", e, &path))?;
    let busy = |info: Option<gpio_cdev::LineInfo>| AmpError::Busy {
        label: chip_label.to_owned(),
        path: path.clone(),
        line,
        consumer: info.and_then(|i| i.consumer().map(str::to_owned)).unwrap_or_else(|| "unknown".to_owned()),
    };
    let info = gpio.info().map_err(|e| request_err("reading the line info", e, &path))?;
    // GPIOLINE_FLAG_KERNEL: the line is requested by someone (a driver, a hog or a process).
    if info.is_kernel() {
        return Err(busy(Some(info)));
    }
    let inactive = u8::from(active_low);
    let handle = match gpio.request(LineRequestFlags::OUTPUT, inactive, CONSUMER) {
        Ok(h) => h,
        Err(e) if errno_of(&e) == Some(libc::EBUSY) => return Err(busy(gpio.info().ok())),
        Err(e) => return Err(request_err("requesting the line as output", e, &path)),
    };
    let pin = CdevPin::new(handle).map_err(|e| request_err("reading the requested line's info", e, &path))?;
    log::info!(
        "amplifier: line {line} of GPIO chip '{chip_label}' ({}), active {}, lead {} ms",
        path.display(),
        if active_low { "low" } else { "high" },
        lead.as_millis()
    );
    Ok(Amplifier::new(pin, active_low, lead)
        .with_name(format!("line {line} of GPIO chip '{chip_label}' ({})", path.display())))
}

/// Find the GPIO chip labelled `label` among the entries of `dir` named `gpiochip*`, in
/// chip-number order (the first match wins).
///
/// # Errors
/// [`AmpError::Scan`] when `dir` cannot be listed; [`AmpError::ChipAccess`] when no readable
/// chip matched and some chip could not be opened for lack of permission; otherwise
/// [`AmpError::NoChip`] listing the labels found (and entries that are not GPIO chips).
pub fn find_chip(dir: &Path, label: &str) -> Result<Chip, AmpError> {
    let scan_err = |source| AmpError::Scan { dir: dir.to_path_buf(), source };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(scan_err)? {
        let entry = entry.map_err(scan_err)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(number) = name.strip_prefix("gpiochip") {
            paths.push((number.parse::<u64>().unwrap_or(u64::MAX), name.to_owned(), entry.path()));
        }
    }
    paths.sort();
    let mut found = Vec::new();
    let mut unreadable = Vec::new();
    let mut denied: Option<(PathBuf, std::io::Error)> = None;
    for (_, _, path) in paths {
        match Chip::new(&path) {
            Ok(chip) if chip.label() == label => return Ok(chip),
            Ok(chip) => found.push(chip.label().to_owned()),
            Err(e) => match errno_of(&e) {
                Some(code @ (libc::EACCES | libc::EPERM)) => {
                    if denied.is_none() {
                        denied = Some((path, std::io::Error::from_raw_os_error(code)));
                    }
                }
                _ => unreadable.push(format!("{}: {e}", path.display())),
            },
        }
    }
    if let Some((path, source)) = denied {
        return Err(AmpError::ChipAccess { label: label.to_owned(), path, source });
    }
    Err(AmpError::NoChip { label: label.to_owned(), dir: dir.to_path_buf(), found, unreadable })
}

/// The errno behind a gpio-cdev error: an [`std::io::Error`] from opening the device, or a
/// [`nix::errno::Errno`] from an ioctl.
fn errno_of(e: &gpio_cdev::Error) -> Option<i32> {
    let source = StdError::source(e)?;
    if let Some(io) = source.downcast_ref::<std::io::Error>() {
        return io.raw_os_error();
    }
    source.downcast_ref::<nix::errno::Errno>().map(|errno| *errno as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::SampleFormat;
    use embedded_hal::digital::ErrorType;
    use embedded_hal_mock::eh1::MockError;
    use embedded_hal_mock::eh1::digital::{Mock as PinMock, State, Transaction};
    use std::sync::{Arc, Mutex};

    const LEAD: Duration = Duration::from_millis(50);

    #[derive(Debug, Clone, PartialEq)]
    enum Event {
        Pin(State),
        Sleep(Duration),
        Begin(u32),
        Write(usize),
        Finish,
        Abort,
    }

    type Log = Arc<Mutex<Vec<Event>>>;

    fn events(log: &Log) -> Vec<Event> {
        log.lock().unwrap().clone()
    }

    /// The mock pin checks the exact pin transactions; this wrapper also records each write in
    /// the shared log so its order relative to the sink calls and the sleep can be checked.
    struct LoggedPin {
        pin: PinMock,
        log: Log,
    }

    impl ErrorType for LoggedPin {
        type Error = MockError;
    }

    impl OutputPin for LoggedPin {
        fn set_low(&mut self) -> Result<(), MockError> {
            self.log.lock().unwrap().push(Event::Pin(State::Low));
            self.pin.set_low()
        }
        fn set_high(&mut self) -> Result<(), MockError> {
            self.log.lock().unwrap().push(Event::Pin(State::High));
            self.pin.set_high()
        }
    }

    /// An AudioSink that records its calls; `fail_begin` / `fail_finish` make those calls fail.
    struct RecordingSink {
        log: Log,
        fail_begin: bool,
        fail_finish: bool,
        rate: u32,
        samples: u64,
    }

    impl RecordingSink {
        fn new(log: &Log) -> Self {
            Self { log: log.clone(), fail_begin: false, fail_finish: false, rate: 0, samples: 0 }
        }
    }

    impl AudioSink for RecordingSink {
        fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
            self.log.lock().unwrap().push(Event::Begin(sample_rate));
            if self.fail_begin {
                return Err(SinkError::Config("test: begin refused".into()));
            }
            self.rate = sample_rate;
            self.samples = 0;
            Ok(())
        }
        fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
            self.log.lock().unwrap().push(Event::Write(samples.len()));
            self.samples += samples.len() as u64;
            Ok(())
        }
        fn finish(&mut self) -> Result<SinkStats, SinkError> {
            self.log.lock().unwrap().push(Event::Finish);
            if self.fail_finish {
                return Err(SinkError::Stalled { device: "test".into(), waited_ms: 7 });
            }
            Ok(SinkStats {
                input_samples: self.samples,
                frames_written: self.samples,
                xruns: 0,
                device_rate: self.rate,
                channels: 1,
                format: SampleFormat::S16,
                period_frames: 0,
                buffer_frames: 0,
                resampled: false,
            })
        }
        fn abort(&mut self) {
            self.log.lock().unwrap().push(Event::Abort);
        }
    }

    /// An amplifier on a logged mock pin expecting `transactions`; returns the mock (a clone
    /// sharing the expectations, for `done()`) and the log.
    fn amp(transactions: &[Transaction], active_low: bool, lead: Duration) -> (Amplifier<LoggedPin>, PinMock, Log) {
        let log: Log = Arc::default();
        let mock = PinMock::new(transactions);
        let sleeps = log.clone();
        let amp = Amplifier::new(LoggedPin { pin: mock.clone(), log: log.clone() }, active_low, lead)
            .with_sleeper(move |d| sleeps.lock().unwrap().push(Event::Sleep(d)))
            .with_name("test line");
        (amp, mock, log)
    }

    fn set(s: State) -> Transaction {
        Transaction::set(s)
    }

    #[test]
    fn enable_drives_active_then_waits_the_lead_and_both_are_idempotent() {
        let (mut a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        assert!(!a.is_enabled());
        a.disable().unwrap(); // already inactive: no write
        a.enable().unwrap();
        a.enable().unwrap(); // already active: no write, no second wait
        assert!(a.is_enabled());
        a.disable().unwrap();
        a.disable().unwrap();
        assert!(!a.is_enabled());
        assert_eq!(events(&log), [Event::Pin(State::High), Event::Sleep(LEAD), Event::Pin(State::Low)]);
        drop(a); // inactive: the drop writes nothing
        mock.done();
    }

    #[test]
    fn active_low_inverts_the_levels() {
        let (mut a, mut mock, log) = amp(&[set(State::Low), set(State::High)], true, LEAD);
        a.enable().unwrap();
        a.disable().unwrap();
        assert_eq!(events(&log), [Event::Pin(State::Low), Event::Sleep(LEAD), Event::Pin(State::High)]);
        drop(a);
        mock.done();
    }

    #[test]
    fn zero_lead_does_not_sleep() {
        let (mut a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, Duration::ZERO);
        a.enable().unwrap();
        a.disable().unwrap();
        assert_eq!(events(&log), [Event::Pin(State::High), Event::Pin(State::Low)]);
        drop(a);
        mock.done();
    }

    #[test]
    fn sink_orders_pin_lead_begin_writes_finish_pin_for_each_utterance() {
        let t = [set(State::High), set(State::Low), set(State::High), set(State::Low)];
        let (a, mut mock, log) = amp(&t, false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        for _ in 0..2 {
            sink.begin(24_000).unwrap();
            sink.write(&[0.1; 480]).unwrap();
            sink.write(&[]).unwrap();
            sink.write(&[0.2; 960]).unwrap();
            let stats = sink.finish().unwrap();
            assert_eq!(stats.input_samples, 1440);
            assert!(!sink.amplifier().is_enabled());
        }
        let one = [
            Event::Pin(State::High),
            Event::Sleep(LEAD),
            Event::Begin(24_000),
            Event::Write(480),
            Event::Write(0),
            Event::Write(960),
            Event::Finish,
            Event::Pin(State::Low),
        ];
        assert_eq!(events(&log), [one.clone(), one].concat());
        drop(sink);
        mock.done();
    }

    #[test]
    fn sink_active_low_drives_low_to_enable() {
        let (a, mut mock, log) = amp(&[set(State::Low), set(State::High)], true, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(16_000).unwrap();
        sink.write(&[0.0; 4]).unwrap();
        sink.finish().unwrap();
        assert_eq!(
            events(&log),
            [
                Event::Pin(State::Low),
                Event::Sleep(LEAD),
                Event::Begin(16_000),
                Event::Write(4),
                Event::Finish,
                Event::Pin(State::High)
            ]
        );
        drop(sink);
        mock.done();
    }

    #[test]
    fn abort_aborts_the_inner_sink_then_disables() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.abort(); // idle: the inner abort runs, the line is already inactive
        sink.begin(24_000).unwrap();
        sink.write(&[0.5; 10]).unwrap();
        sink.abort();
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(
            events(&log),
            [
                Event::Abort,
                Event::Pin(State::High),
                Event::Sleep(LEAD),
                Event::Begin(24_000),
                Event::Write(10),
                Event::Abort,
                Event::Pin(State::Low)
            ]
        );
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_inner_finish_still_disables_and_returns_the_inner_error() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut inner = RecordingSink::new(&log);
        inner.fail_finish = true;
        let mut sink = AmpSink::new(inner, a);
        sink.begin(24_000).unwrap();
        let err = sink.finish().unwrap_err();
        assert!(matches!(err, SinkError::Stalled { waited_ms: 7, .. }), "{err}");
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(events(&log).last(), Some(&Event::Pin(State::Low)));
        assert_eq!(events(&log)[events(&log).len() - 2], Event::Finish);
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_inner_begin_disables_and_returns_the_inner_error() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut inner = RecordingSink::new(&log);
        inner.fail_begin = true;
        let mut sink = AmpSink::new(inner, a);
        let err = sink.begin(24_000).unwrap_err();
        assert_eq!(err.kind(), SinkErrorKind::Config);
        assert_eq!(
            events(&log),
            [Event::Pin(State::High), Event::Sleep(LEAD), Event::Begin(24_000), Event::Pin(State::Low)]
        );
        drop(sink);
        mock.done();
    }

    #[test]
    fn drop_while_active_drives_the_line_inactive() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(24_000).unwrap();
        sink.write(&[0.1; 3]).unwrap();
        drop(sink);
        assert_eq!(events(&log).last(), Some(&Event::Pin(State::Low)));
        mock.done();
    }

    #[test]
    fn failed_enable_skips_the_inner_begin_and_names_the_line() {
        let err = MockError::Io(std::io::ErrorKind::Other);
        let (a, mut mock, log) = amp(&[set(State::High).with_error(err)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        let e = sink.begin(24_000).unwrap_err();
        assert_eq!(e.to_string(), "amplifier GPIO: driving test line active (high) failed: I/O error: Other");
        assert_eq!(e.kind(), crate::audio::SinkErrorKind::Device);
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(events(&log), [Event::Pin(State::High)]); // no lead wait, no begin
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_disable_after_a_good_finish_is_an_error_and_retried_on_drop() {
        let err = MockError::Io(std::io::ErrorKind::Other);
        let t = [set(State::High), set(State::Low).with_error(err), set(State::Low)];
        let (a, mut mock, log) = amp(&t, false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(24_000).unwrap();
        let e = sink.finish().unwrap_err();
        assert!(e.to_string().contains("driving test line inactive (low) failed"), "{e}");
        assert!(sink.amplifier().is_enabled());
        drop(sink); // the drop tries again and succeeds
        mock.done();
    }

    #[test]
    fn amp_sink_on_a_real_line_can_move_to_the_audio_thread() {
        fn send<T: Send>() {}
        send::<AmpSink<crate::audio::AlsaSink, CdevPin>>();
        send::<AmpSink<Box<dyn AudioSink + Send>, CdevPin>>();
        send::<AmpError>();
    }

    fn scratch_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("herald-amp-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn no_chip_in_an_empty_directory_says_none() {
        let dir = scratch_dir("empty");
        let e = open_line_in(&dir, "pinctrl-rp1", 17, false, LEAD).err().unwrap();
        match &e {
            AmpError::NoChip { label, found, unreadable, .. } => {
                assert_eq!(label, "pinctrl-rp1");
                assert!(found.is_empty() && unreadable.is_empty());
            }
            other => panic!("expected NoChip, got {other:?}"),
        }
        assert_eq!(e.kind(), SinkErrorKind::NotFound);
        assert_eq!(
            e.to_string(),
            format!(
                "amplifier GPIO: no GPIO chip labelled 'pinctrl-rp1' in {} (chip labels found: none); \
                 `gpiodetect` lists the chips",
                dir.display()
            )
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn entries_that_are_not_gpio_chips_are_reported_not_matched() {
        let dir = scratch_dir("fake");
        // A regular file named like a chip: it opens, but the GPIO_GET_CHIPINFO ioctl fails.
        std::fs::write(dir.join("gpiochip0"), b"not a chip").unwrap();
        std::fs::write(dir.join("ttyS0"), b"ignored").unwrap();
        let e = find_chip(&dir, "pinctrl-rp1").err().unwrap();
        match &e {
            AmpError::NoChip { found, unreadable, .. } => {
                assert!(found.is_empty());
                assert_eq!(unreadable.len(), 1, "{unreadable:?}");
                assert!(unreadable[0].starts_with(&format!("{}: ", dir.join("gpiochip0").display())));
            }
            other => panic!("expected NoChip, got {other:?}"),
        }
        assert!(e.to_string().contains("; not readable as GPIO chips: "), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_directory_is_a_scan_error() {
        let dir = std::env::temp_dir().join(format!("herald-amp-missing-{}", std::process::id()));
        let e = find_chip(&dir, "x").err().unwrap();
        assert!(matches!(e, AmpError::Scan { .. }), "{e:?}");
        assert_eq!(e.kind(), SinkErrorKind::Device);
    }

    #[test]
    fn a_label_no_chip_has_is_not_found_in_dev() {
        // This build machine has no GPIO chips; a machine with some must still not match this
        // label, and lists them (or says it may not read them).
        let label = "herald-test-no-such-chip";
        match open_line(label, 0, false, LEAD).err().unwrap() {
            e @ AmpError::NoChip { .. } => {
                let msg = e.to_string();
                assert!(msg.starts_with(&format!("amplifier GPIO: no GPIO chip labelled '{label}' in /dev (")), "{msg}");
                if !Path::new("/dev/gpiochip0").exists() {
                    assert!(msg.contains("(chip labels found: none)"), "{msg}");
                }
            }
            e @ AmpError::ChipAccess { .. } => assert!(e.to_string().contains("group gpio"), "{e}"),
            other => panic!("expected NoChip or ChipAccess, got {other:?}"),
        }
    }

    #[test]
    fn messages_name_the_chip_the_line_and_the_remedy() {
        let e = AmpError::NoLine { label: "pinctrl-rp1".into(), path: "/dev/gpiochip0".into(), line: 60, lines: 54 };
        assert_eq!(
            e.to_string(),
            "amplifier GPIO: chip 'pinctrl-rp1' (/dev/gpiochip0) has no line 60: it has 54 lines (offsets 0..54)"
        );
        assert_eq!(e.kind(), SinkErrorKind::NotFound);
        let e = AmpError::Busy {
            label: "pinctrl-rp1".into(),
            path: "/dev/gpiochip0".into(),
            line: 17,
            consumer: "gpioset".into(),
        };
        assert!(e.to_string().contains("line 17 of chip 'pinctrl-rp1' (/dev/gpiochip0) is busy: in use by 'gpioset'"));
        assert_eq!(e.kind(), SinkErrorKind::Busy);
        let e = AmpError::ChipAccess {
            label: "pinctrl-rp1".into(),
            path: "/dev/gpiochip0".into(),
            source: std::io::Error::from_raw_os_error(libc::EACCES),
        };
        let msg = e.to_string();
        assert!(msg.contains("permission denied opening /dev/gpiochip0"), "{msg}");
        assert!(msg.contains("group gpio") && msg.contains("DeviceAllow=char-gpiochip rw"), "{msg}");
        assert_eq!(e.kind(), SinkErrorKind::Device);
        let e = AmpError::NoChip {
            label: "pinctrl-rp1".into(),
            dir: "/dev".into(),
            found: vec!["pinctrl-bcm2835".into(), "raspberrypi-exp-gpio".into()],
            unreadable: vec![],
        };
        assert!(e.to_string().contains("(chip labels found: 'pinctrl-bcm2835', 'raspberrypi-exp-gpio')"), "{e}");
    }
}

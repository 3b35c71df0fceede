//! Whether the playback device is there: `herald serve` opens it once at start (open and
//! close, no sound) and says so in one warning when it cannot; while it is missing, a request
//! to play (`POST /v1/say`) is answered at once with "no audio device", after one more try to
//! open it, and the next job that plays tries it again as always. A job's device failure marks
//! it missing, its success present again.

use std::sync::{Arc, Mutex, PoisonError};

use board::audio::{SinkError, SinkErrorKind};

use crate::speaker::JobError;

/// The device is missing: its name and why it cannot be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the audio device '{device}' cannot be opened ({why}); herald tries it again for the next announcement")]
pub struct NoDevice {
    /// The ALSA PCM name.
    pub device: String,
    /// What opening it said.
    pub why: String,
}

/// The playback device's state, shared by the front-ends (clones share it).
#[derive(Debug, Clone)]
pub struct DeviceHealth(Arc<Mutex<State>>);

#[derive(Debug)]
struct State {
    device: String,
    /// Why it is missing; `None` while it is there (as far as herald knows).
    missing: Option<String>,
}

/// Whether a job's error says the device is missing (no such PCM or card, gone while playing,
/// or the open failed), as opposed to a failure of the audio itself.
pub fn is_missing(e: &SinkError) -> bool {
    matches!(e.kind(), SinkErrorKind::NotFound) || matches!(e, SinkError::Gone { .. } | SinkError::Alsa { op: "snd_pcm_open", .. })
}

impl DeviceHealth {
    /// The state of `device`, not checked yet (taken to be there).
    pub fn new(device: &str) -> Self {
        DeviceHealth(Arc::new(Mutex::new(State { device: device.to_owned(), missing: None })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device's name.
    pub fn device(&self) -> String {
        self.state().device.clone()
    }

    /// Watch `device` from now on (a reload changed `audio.device`); checked like at start.
    pub fn set_device(&self, device: &str) {
        let changed = {
            let mut s = self.state();
            let changed = s.device != device;
            s.device = device.to_owned();
            changed
        };
        if changed {
            self.check_at_start();
        }
    }

    /// Open and close the device now ([`board::audio::probe_device`]); when that fails, log one
    /// warning and mark it missing. `true` when it opened (or is busy: it exists).
    pub fn check_at_start(&self) -> bool {
        let device = self.device();
        match board::audio::probe_device(&device) {
            Ok(()) | Err(SinkError::Busy { .. }) => {
                self.state().missing = None;
                true
            }
            Err(e) => {
                log::warn!(
                    "{}; every line and POST /v1/say fail until it can be opened (herald tries it again for each)",
                    crate::one_line(&e)
                );
                self.state().missing = Some(crate::one_line(&e));
                false
            }
        }
    }

    /// Before a job that plays: `Ok` when the device is there; while it is marked missing it
    /// is opened once more (and marked present again when that works).
    ///
    /// # Errors
    /// [`NoDevice`] while it cannot be opened.
    pub fn ready(&self) -> Result<(), NoDevice> {
        let device = {
            let s = self.state();
            if s.missing.is_none() {
                return Ok(());
            }
            s.device.clone()
        };
        match board::audio::probe_device(&device) {
            Ok(()) | Err(SinkError::Busy { .. }) => {
                self.present();
                Ok(())
            }
            Err(e) => {
                let why = crate::one_line(&e);
                self.state().missing = Some(why.clone());
                Err(NoDevice { device, why })
            }
        }
    }

    fn present(&self) {
        let mut s = self.state();
        if s.missing.take().is_some() {
            log::info!("audio device '{}' can be opened again", s.device);
        }
    }

    /// After a job that played: a device failure marks the device missing (and comes back as
    /// [`NoDevice`]); anything else marks it present.
    pub fn note(&self, outcome: Result<(), &JobError>) -> Option<NoDevice> {
        match outcome {
            Err(JobError::Sink(e)) if is_missing(e) => {
                let why = crate::one_line(e);
                let mut s = self.state();
                s.missing = Some(why.clone());
                Some(NoDevice { device: s.device.clone(), why })
            }
            Err(_) => None,
            Ok(()) => {
                self.present();
                None
            }
        }
    }
}

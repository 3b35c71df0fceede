//! [`AmpError`]: what can go wrong with the amplifier line, and how the binary treats it.

use std::error::Error as StdError;
use std::path::PathBuf;

use linux_embedded_hal::gpio_cdev;

use crate::audio::{SinkError, SinkErrorKind};

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
    if items.is_empty() { "none".to_owned() } else { items.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ") }
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

/// An amplifier failure met while driving a sink ([`super::AmpSink`]): a [`SinkError::Other`]
/// of the error's [`kind`](AmpError::kind), with the whole [`AmpError`] as its message.
impl From<AmpError> for SinkError {
    fn from(e: AmpError) -> Self {
        SinkError::other(e.kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_chip_the_line_and_the_remedy() {
        let e = AmpError::NoLine { label: "pinctrl-rp1".into(), path: "/dev/gpiochip0".into(), line: 60, lines: 54 };
        assert_eq!(
            e.to_string(),
            "amplifier GPIO: chip 'pinctrl-rp1' (/dev/gpiochip0) has no line 60: it has 54 lines (offsets 0..54)"
        );
        assert_eq!(e.kind(), SinkErrorKind::NotFound);
        let e = AmpError::Busy { label: "pinctrl-rp1".into(), path: "/dev/gpiochip0".into(), line: 17, consumer: "gpioset".into() };
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

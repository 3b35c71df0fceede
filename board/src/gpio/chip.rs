//! Finding the GPIO chip by label and requesting the amplifier line ([`open_line`]).

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::time::Duration;

use linux_embedded_hal::CdevPin;
use linux_embedded_hal::gpio_cdev::{self, Chip, LineRequestFlags};

use super::{AmpError, Amplifier};

/// Consumer name herald gives the kernel for the line (`gpioinfo` shows it).
pub const CONSUMER: &str = "herald";

/// The directory scanned for GPIO character devices by [`open_line`].
pub const DEV_DIR: &str = "/dev";

/// The amplifier on a real GPIO line, as [`open_line`] returns it.
pub type LineAmplifier = Amplifier<CdevPin>;

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
            Some(libc::ENOTTY | libc::EINVAL) => "; the kernel may lack GPIO character-device uAPI v1 (CONFIG_GPIO_CDEV_V1)",
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
    Ok(Amplifier::new(pin, active_low, lead).with_name(format!("line {line} of GPIO chip '{chip_label}' ({})", path.display())))
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
    use crate::audio::SinkErrorKind;

    const LEAD: Duration = Duration::from_millis(50);

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
}

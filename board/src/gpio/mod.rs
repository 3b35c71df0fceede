//! GPIO: the amplifier-enable line (`[amplifier]` in the config), driven active a lead time
//! before the first sample of an utterance and inactive once the audio has drained, so the
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
//!
//! **Dependencies point one way:** this module uses [`crate::audio`] (the [`AudioSink`] trait
//! that [`AmpSink`] implements, [`SinkErrorKind`] for [`AmpError::kind`]); `audio` knows nothing
//! of GPIO. A failed amplifier write reaches the caller of a sink as a [`SinkError::Other`] of
//! kind [`SinkErrorKind::Device`] carrying the [`AmpError`].
//!
//! Files: `error.rs` ([`AmpError`]), `amplifier.rs` ([`Amplifier`], pin-generic), `chip.rs`
//! (finding and requesting the real line), `amp_sink.rs` ([`AmpSink`]).
//!
//! [`AudioSink`]: crate::audio::AudioSink
//! [`SinkErrorKind`]: crate::audio::SinkErrorKind
//! [`SinkErrorKind::Device`]: crate::audio::SinkErrorKind::Device
//! [`SinkError::Other`]: crate::audio::SinkError::Other
//! [`OutputPin`]: embedded_hal::digital::OutputPin

mod amp_sink;
mod amplifier;
mod chip;
mod error;
#[cfg(test)]
mod mock;

pub use amp_sink::AmpSink;
pub use amplifier::{Amplifier, Sleeper};
pub use chip::{CONSUMER, DEV_DIR, LineAmplifier, find_chip, open_line, open_line_in};
pub use error::AmpError;

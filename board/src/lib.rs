//! herald's device side: hardware probe, audio sinks (ALSA, WAV, null), GPIO and persistent
//! state. Sinks take plain sample slices; this crate never runs a model.

pub mod audio;
pub mod calibration;
pub mod derive;
pub mod fsutil;
pub mod gpio;
pub mod malloc;
pub mod pcm;
pub mod probe;

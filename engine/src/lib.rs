//! herald's compute core: the model bundle, step graphs, caches, the decode loop, sampling and
//! vocoder windowing. Pure compute: this crate never opens a device or reads `/proc`; the
//! board crate does that and hands plain settings in.

pub mod manifest;

pub use manifest::{Manifest, ManifestError};

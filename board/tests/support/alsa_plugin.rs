//! The test ALSA plugin `heraldclk` (support/heraldclk.c, an ioplug PCM that needs no sound
//! hardware), compiled at test time with `$CC` (default `cc`) against alsa-lib. Shared by the
//! board crate's ALSA tests and the `herald` binary's fault tests (included with `#[path]`).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

/// The plugin's C source.
pub const PLUGIN_C: &str = include_str!("heraldclk.c");

/// Compile the plugin into `dir` and return the asound.conf stanza that declares its PCM type
/// (`pcm_type.heraldclk { lib "…" }`); PCMs of `type heraldclk` can follow it.
pub fn build(dir: &Path) -> String {
    let src = dir.join("heraldclk.c");
    let lib = dir.join("libasound_module_pcm_heraldclk.so");
    std::fs::write(&src, PLUGIN_C).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-DPIC", "-O1", "-Wall", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-lasound")
        .output()
        .unwrap_or_else(|e| panic!("running {cc} to build the test ALSA plugin: {e}"));
    assert!(out.status.success(), "building the test ALSA plugin failed:\n{}", String::from_utf8_lossy(&out.stderr));
    format!("pcm_type.heraldclk {{\n    lib \"{}\"\n}}\n", lib.display())
}

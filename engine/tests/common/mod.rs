//! Test support: the tiny bundles, exported by the project's own exporter.
//!
//! `HERALD_TEST_BUNDLES=DIR` points at a directory holding `tiny-0.6b`, `tiny-1.7b` and
//! `tiny-hybrid` bundles (the README's test command exports them there). Without it, the
//! bundles are exported once into Cargo's per-test temporary directory through
//! `tools/export/export`, so `cargo test` alone also works.

#![allow(dead_code, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub const PRESETS: [&str; 3] = ["tiny-0.6b", "tiny-1.7b", "tiny-hybrid"];

/// The quantized tiny bundles: `tiny-q` (every matrix dimension a multiple of 32, so tract
/// keeps its Q4_0 blocks) exported with `--dtype q4` and `--dtype q8`, and its float32 twin.
pub const QUANTIZED: [&str; 2] = ["tiny-q-q4", "tiny-q-q8"];

/// `(preset, dtype)` of a test bundle name: `tiny-q-q4` is the preset `tiny-q` in q4.
fn preset_and_dtype(name: &str) -> (&str, &str) {
    for d in ["q4", "q8"] {
        if let Some(p) = name.strip_suffix(&format!("-{d}")) {
            return (p, d);
        }
    }
    (name, "fp32")
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Directory holding the three tiny bundles (exported on first use when not provided).
pub fn bundles() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("HERALD_TEST_BUNDLES").filter(|d| !d.is_empty()) {
            return PathBuf::from(d);
        }
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tiny-bundles");
        for name in PRESETS.iter().chain(&QUANTIZED).chain(&["tiny-q"]) {
            let out = dir.join(name);
            if out.join("bundle.toml").is_file() {
                continue;
            }
            let (preset, dtype) = preset_and_dtype(name);
            let status = Command::new(repo_root().join("tools/export/export"))
                .args(["export", "--tiny", preset, "--seed", "7", "--dtype", dtype, "--quiet", "--out"])
                .arg(&out)
                .status()
                .expect("run tools/export/export");
            assert!(status.success(), "exporting {name} failed");
        }
        dir
    })
}

/// One tiny bundle directory.
pub fn bundle(preset: &str) -> PathBuf {
    let p = bundles().join(preset);
    assert!(p.join("bundle.toml").is_file(), "no tiny bundle at {}", p.display());
    p
}

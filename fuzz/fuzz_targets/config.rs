//! `herald.toml`: any file herald accepts prints (`herald config`) as a file that reads back
//! to the same configuration; anything else is an error, never a panic. The configuration
//! module is herald's own (app/src/config.rs), compiled into this target as it is.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

#[allow(dead_code, missing_docs, clippy::all)]
#[path = "../../app/src/config.rs"]
mod config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut c = config::Config::default();
    if c.merge_file(Path::new("/etc/herald/herald.toml"), text).is_err() {
        return;
    }
    let printed = c.to_toml();
    let mut back = config::Config::default();
    if let Err(e) = back.merge_file(Path::new("/etc/herald/herald.toml"), &printed) {
        panic!("a configuration herald accepted does not read back from its own printout: {e}\n{printed}");
    }
    assert_eq!(back.to_toml(), printed, "the printout reads back to the same configuration");
});

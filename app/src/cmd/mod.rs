//! The commands, one file each; what several of them share is here.

pub mod bench;
pub mod bundle;
pub mod calibrate;
pub mod config;
pub mod devices;
pub mod info;
pub mod probe;
pub mod sanitize;
pub mod serve;
pub mod speak;

use std::path::Path;

use crate::config::Config;
use crate::exit::{self, Failure, fail};

/// The configuration: defaults, the file, the environment (exit 2 on an error).
pub fn load_config(explicit: Option<&Path>) -> Result<Config, Failure> {
    Config::load(explicit, &Config::process_env()).map_err(|e| fail(exit::INPUT, e))
}

/// Log to stderr with `filter` (env_logger syntax: `info`, `engine=debug`, ...).
pub fn init_logging(filter: &str) {
    let mut b = env_logger::Builder::new();
    b.parse_filters(filter);
    b.format_timestamp_millis();
    let _ = b.try_init();
}

/// Log as the configuration says (`log.level`), unless `RUST_LOG` is set.
pub fn init_logging_from(cfg: &Config) {
    init_logging(cfg.log.filter(std::env::var("RUST_LOG").ok().as_deref()));
}

/// Resident memory of this process in MB, for the "ready" log line.
pub fn rss_mb() -> Option<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096.0 / 1e6)
}

/// [`rss_mb`] as log text.
pub fn rss_text() -> String {
    rss_mb().map_or_else(|| "unknown".into(), |m| format!("{m:.0} MB"))
}

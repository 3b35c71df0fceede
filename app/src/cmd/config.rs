//! `herald config`: the effective configuration (defaults, file, environment) as TOML.

use std::io::Write;
use std::path::Path;

use super::load_config;
use crate::exit::Failure;

/// Run `herald config`.
pub fn run(config: Option<&Path>) -> Result<(), Failure> {
    let cfg = load_config(config)?;
    let _ = write!(std::io::stdout().lock(), "{cfg}");
    Ok(())
}

//! `herald sanitize`: rewrite an ONNX file so tract can load it.

use std::path::PathBuf;

use super::init_logging;
use crate::exit::{self, Failure, fail};

/// The arguments of `herald sanitize`.
#[derive(clap::Args)]
pub struct SanitizeArgs {
    /// Input ONNX file.
    input: PathBuf,
    /// Output ONNX file (written atomically; external data files are copied alongside).
    output: PathBuf,
}

/// Run `herald sanitize`.
pub fn run(a: SanitizeArgs) -> Result<(), Failure> {
    init_logging("warn");
    let report = backend_tract::sanitize::sanitize_file(&a.input, &a.output).map_err(|e| fail(exit::INPUT, e))?;
    eprintln!("{}: {report}", a.output.display());
    Ok(())
}

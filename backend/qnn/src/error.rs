//! The QNN backend's errors: every failure names the library call, the QNN error code and its
//! component, and the library's own message when it has one.

use std::path::PathBuf;

use crate::ffi::{ErrorHandle, code, component};

/// Why the QNN runtime could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QnnError {
    /// A library is missing or cannot be opened, or lacks a function herald calls.
    #[error("{}: {message}", path.display())]
    Library {
        /// The library file.
        path: PathBuf,
        /// dlopen's or the check's message.
        message: String,
    },
    /// No provider speaks an API version herald knows.
    #[error("{}: QNN API version {found}, herald speaks {wanted}", path.display())]
    ApiVersion {
        /// The library file.
        path: PathBuf,
        /// The versions its providers report.
        found: String,
        /// What herald needs.
        wanted: String,
    },
    /// A QNN call returned an error.
    #[error("{call} failed: QNN {component} error {code}{}", message.as_ref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Api {
        /// The API function.
        call: &'static str,
        /// The error code (low 16 bits of the handle).
        code: u32,
        /// The API component the code belongs to.
        component: &'static str,
        /// `errorGetMessage`'s text.
        message: Option<String>,
    },
    /// What a library returned does not have the layout herald reads.
    #[error("unexpected QNN data layout: {0}")]
    Layout(String),
}

impl QnnError {
    /// An [`QnnError::Api`] for `call` returning `e`.
    pub fn api(call: &'static str, e: ErrorHandle, message: Option<String>) -> Self {
        let c = code(e);
        QnnError::Api { call, code: c, component: component(c), message }
    }
}

//! herald's own compute kernels, apart from the runtime that calls them (issue 36).
//!
//! Laid out as tract-linalg is: the public face of each kernel family ([`q4`]) owns its data
//! layouts and chooses an implementation at run time from the CPU's features; the
//! implementations live in one folder per architecture (`x86_64/`, `aarch64/`), and every one
//! of them has a plain-Rust reference in `portable/` that runs on any CPU and that the tests
//! hold the vector forms to (integer results bit for bit, float results within the rounding
//! of the sum, documented per test). Nothing here names tract, reads files or starts threads:
//! `backend_tract` wires these kernels into its graphs as ops.

pub mod attention;
pub mod im2col;
pub mod q4;
pub mod snake;

mod portable;

#[cfg(target_arch = "x86_64")]
mod x86_64;

#[cfg(target_arch = "aarch64")]
mod aarch64;

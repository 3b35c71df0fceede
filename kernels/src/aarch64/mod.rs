//! aarch64 kernels (NEON, dot product), chosen at run time by their family's dispatcher.

pub(crate) mod attention;
pub(crate) mod q4;

//! x86-64 kernels (AVX2, AVX-512, VNNI), chosen at run time by their family's dispatcher.

pub(crate) mod attention;
pub(crate) mod q4;
pub(crate) mod snake;

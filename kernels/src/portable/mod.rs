//! The portable references (plain Rust, any CPU).

pub(crate) mod attention;
pub(crate) mod q4;
pub(crate) mod snake;

//! The portable references (plain Rust, any CPU).

pub(crate) mod q4;
pub(crate) mod snake;

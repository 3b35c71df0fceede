//! The C allocator of a long-running daemon: glibc's malloc gives each new thread an arena of its
//! own, up to eight per core, and keeps what each arena grew to. `herald serve` starts threads
//! for its connections and jobs all the time, so its resident memory crept up with every new
//! arena although nothing leaked. Measured with the soak (`scripts/soak --count 1000`, release
//! build, tiny bundle, this build machine, 2026-12-02): RSS of the first 100 requests after the
//! warm-up → the last 100 was 122.4 → 125.9 MiB (+2.9 %) with glibc's default, 110.4 → 110.6 MiB
//! (+0.2 %) with 2 arenas and 106.8 → 106.8 MiB with 1, at the same latency (the engine's hot
//! threads allocate from their own frame pools, not from malloc).

/// Arenas [`bound_arenas`] allows: 2.
pub const SERVE_ARENAS: i32 = 2;

/// Bound glibc malloc to [`SERVE_ARENAS`] arenas, unless the environment sets
/// `MALLOC_ARENA_MAX` (then the person who set it decides). Call it at start-up, before other
/// threads run. Returns whether the bound was set; `false` with another C library.
pub fn bound_arenas() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
            return false;
        }
        // SAFETY: mallopt(3) only sets a tuning parameter of the allocator; M_ARENA_MAX takes
        // effect for arenas created after the call. It is thread-safe in glibc.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, SERVE_ARENAS) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_bound() {
        // (the test binary's environment may set MALLOC_ARENA_MAX; then the call declines)
        assert_eq!(super::bound_arenas(), std::env::var_os("MALLOC_ARENA_MAX").is_none());
    }
}

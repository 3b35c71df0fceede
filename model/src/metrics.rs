//! Playback metrics of one streamed utterance, computed from the chunk arrival timeline.
//!
//! Definitions (shared/reference/edge-design-notes.md §4.6, the prior design's stream latency
//! bench), with `t_i` the arrival time of chunk `i` (seconds from the request), `d_i` its audio
//! duration and `C_i = d_0 + … + d_(i-1)` the audio delivered before it:
//!
//! - **TTFA** (time to first audio) = `t_0`;
//! - **playback start** = `max_i (t_i − C_i)`: the earliest moment a player can start and never
//!   run dry (chunk `i` is needed at `start + C_i`);
//! - **stall at TTFA**: a player that starts at TTFA stalls, in total, `playback start − TTFA`
//!   seconds; [`PlaybackMetrics::stalls`] counts the separate gaps (a cursor simulation);
//! - **RTF** (real-time factor) = `t_last / total audio`: below 1 is faster than real time.

/// Playback metrics of one utterance. All times in seconds from the request.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct PlaybackMetrics {
    /// Arrival of the first chunk (time to first audio).
    pub ttfa: f64,
    /// Earliest underrun-free playback start, `max_i (t_i − C_i)`; ≥ `ttfa`.
    pub playback_start: f64,
    /// Total silence a player that starts at TTFA would insert (`playback_start − ttfa`).
    pub stall: f64,
    /// Gaps such a player would hear (chunks that arrive after the cursor reached them by more
    /// than [`STALL_EPSILON`]).
    pub stalls: usize,
    /// Arrival of the last chunk.
    pub last_chunk: f64,
    /// Audio delivered, seconds.
    pub audio: f64,
    /// Real-time factor `last_chunk / audio` (0 when there is no audio).
    pub rtf: f64,
}

/// Gaps shorter than this (1 ms, below one ALSA period at any usual size) are not counted as
/// stalls; they still add to [`PlaybackMetrics::stall`].
pub const STALL_EPSILON: f64 = 1e-3;

impl PlaybackMetrics {
    /// Metrics of a timeline of `(arrival seconds, frames)` chunks in delivery order, each frame
    /// lasting `frame_seconds` (0.08 s for the 12 Hz models: 1920 samples at 24 kHz).
    ///
    /// An empty timeline gives all zeros.
    pub fn from_chunks(chunks: &[(f64, usize)], frame_seconds: f64) -> Self {
        let Some(&(t0, _)) = chunks.first() else { return Self::default() };
        let mut delivered = 0.0; // C_i
        let mut playback_start = t0;
        let mut cursor = t0; // when the player (started at TTFA) needs the next chunk
        let mut stalls = 0;
        for &(t, frames) in chunks {
            playback_start = playback_start.max(t - delivered);
            if t > cursor {
                if t - cursor > STALL_EPSILON {
                    stalls += 1;
                }
                cursor = t;
            }
            let d = frames as f64 * frame_seconds;
            cursor += d;
            delivered += d;
        }
        let last_chunk = chunks.last().map_or(t0, |c| c.0);
        PlaybackMetrics {
            ttfa: t0,
            playback_start,
            stall: playback_start - t0,
            stalls,
            last_chunk,
            audio: delivered,
            rtf: if delivered > 0.0 { last_chunk / delivered } else { 0.0 },
        }
    }
}

impl std::fmt::Display for PlaybackMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TTFA {:.0} ms, playback start {:.0} ms, stall {:.0} ms in {} gap(s), RTF {:.3} ({:.2} s of audio)",
            self.ttfa * 1e3,
            self.playback_start * 1e3,
            self.stall * 1e3,
            self.stalls,
            self.rtf,
            self.audio
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: f64 = 0.08;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn ramp_that_keeps_ahead_never_stalls() {
        // ramp 2,4,8 frames: 160, 320, 640 ms of audio. Arrivals 100, 250, 500 ms.
        // t - C: 100, 250-160=90, 500-480=20 -> start = 100 = TTFA.
        let m = PlaybackMetrics::from_chunks(&[(0.100, 2), (0.250, 4), (0.500, 8)], F);
        assert!(close(m.ttfa, 0.100));
        assert!(close(m.playback_start, 0.100));
        assert!(close(m.stall, 0.0));
        assert_eq!(m.stalls, 0);
        assert!(close(m.audio, 14.0 * F));
        assert!(close(m.rtf, 0.5 / 1.12));
    }

    #[test]
    fn one_frame_first_then_a_late_big_chunk_stalls() {
        // The prior design's measured failure (§4.1): 1 frame at 30 ms, 25 frames at 190 ms,
        // then 25 every 160 ms. t - C: 30, 190-80=110, then negative, so start = 110 ms;
        // a player starting at 30 ms runs dry at 110 ms and waits 80 ms for chunk 1.
        let m = PlaybackMetrics::from_chunks(&[(0.030, 1), (0.190, 25), (0.350, 25), (0.510, 25)], F);
        assert!(close(m.ttfa, 0.030));
        assert!(close(m.playback_start, 0.110));
        assert!(close(m.stall, 0.080));
        assert_eq!(m.stalls, 1);
        assert!(close(m.rtf, 0.510 / (76.0 * F)));
    }

    #[test]
    fn two_separate_gaps_add_up_to_start_minus_ttfa() {
        // chunk 0: 2 frames at 0.1 (plays to 0.26); chunk 1 at 0.4 (gap 0.14), 2 frames (plays
        // to 0.56); chunk 2 at 0.7 (gap 0.14). t - C: 0.1, 0.4-0.16=0.24, 0.7-0.32=0.38.
        let m = PlaybackMetrics::from_chunks(&[(0.1, 2), (0.4, 2), (0.7, 2)], F);
        assert!(close(m.playback_start, 0.38));
        assert!(close(m.stall, 0.28));
        assert_eq!(m.stalls, 2);
    }

    #[test]
    fn cursor_simulation_matches_the_closed_form_on_random_timelines() {
        // The total stall of a player started at TTFA equals max_i(t_i - C_i) - t_0.
        let mut state = 0x1234_5678_u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        };
        for _ in 0..200 {
            let mut t = next() * 0.3;
            let mut chunks = Vec::new();
            for _ in 0..(1 + (next() * 10.0) as usize) {
                chunks.push((t, 1 + (next() * 25.0) as usize));
                t += next() * 2.5;
            }
            let m = PlaybackMetrics::from_chunks(&chunks, F);
            // simulate with an explicit per-chunk cursor
            let mut cursor = chunks[0].0;
            let mut waited = 0.0;
            for &(t, n) in &chunks {
                if t > cursor {
                    waited += t - cursor;
                    cursor = t;
                }
                cursor += n as f64 * F;
            }
            assert!(close(m.stall, waited), "{chunks:?}: {} vs {waited}", m.stall);
            assert!(m.playback_start >= m.ttfa);
        }
    }

    #[test]
    fn empty_timeline_is_all_zero() {
        assert_eq!(PlaybackMetrics::from_chunks(&[], F), PlaybackMetrics::default());
    }
}

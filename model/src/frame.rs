//! Frame constants of the Qwen3-TTS 12 Hz codec.
//!
//! The numbers a bundle carries (`[audio]` in bundle.toml: sample rate, samples per frame,
//! codebooks) are read from its manifest at run time; the constants here are only the ones this
//! build's data structures are sized by, checked against the manifest when a bundle opens.

/// Codebooks per frame this build handles (the 12 Hz family has 16: `num_code_groups` in the
/// checkpoint's config.json).
pub const CODEBOOKS: usize = 16;

/// One codec frame: codebook 0 (the talker's c0) then codebooks 1..15.
pub type Frame = [u32; CODEBOOKS];

/// Seconds of one codec frame of a bundle with `samples_per_frame` samples at `sample_rate` Hz
/// (0.080 s for the 12 Hz models: 1920 samples at 24 kHz). 0 for a zero rate.
pub fn frame_seconds(samples_per_frame: u32, sample_rate: u32) -> f64 {
    if sample_rate == 0 { 0.0 } else { f64::from(samples_per_frame) / f64::from(sample_rate) }
}

/// Seconds of one codec frame of the 12 Hz family (1920 samples at 24 kHz: speech tokenizer
/// config `decode_upsample_rate` / `output_sample_rate`), for tables and tools that report
/// against the frame budget without a bundle at hand.
pub const FRAME_SECONDS_12HZ: f64 = 0.080;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_12hz_frame_is_80_ms() {
        assert_eq!(frame_seconds(1920, 24_000), FRAME_SECONDS_12HZ);
        assert_eq!(frame_seconds(1920, 0), 0.0);
    }
}

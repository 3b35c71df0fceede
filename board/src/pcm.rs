//! PCM sample conversion shared by every sink.

/// Convert one float sample in [-1, 1] to signed 16-bit PCM.
///
/// Values outside [-1, 1] are clamped (the vocoder clamps too, but gain and fades run after
/// it); NaN becomes 0. Scaling is by 32767 with round-half-away-from-zero, so -1.0 → -32767,
/// 1.0 → 32767 and the conversion is symmetric around zero.
pub fn f32_to_s16(x: f32) -> i16 {
    if x.is_nan() {
        return 0;
    }
    // Clamped to [-32767, 32767] first, so the cast cannot saturate or wrap.
    (x.clamp(-1.0, 1.0) * 32767.0).round() as i16
}

/// Convert a block of float samples into `out` as little-endian S16 bytes (2 bytes per sample).
///
/// `out` is cleared first; its capacity is reused, so a sink that keeps one buffer does not
/// allocate in the steady state.
pub fn f32_to_s16le(samples: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(samples.len() * 2);
    for &s in samples {
        out.extend_from_slice(&f32_to_s16(s).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_scale_and_zero() {
        assert_eq!(f32_to_s16(0.0), 0);
        assert_eq!(f32_to_s16(1.0), 32767);
        assert_eq!(f32_to_s16(-1.0), -32767);
        assert_eq!(f32_to_s16(0.5), 16384); // 16383.5 rounds away from zero
        assert_eq!(f32_to_s16(-0.5), -16384);
    }

    #[test]
    fn clamps_and_handles_nan() {
        assert_eq!(f32_to_s16(3.0), 32767);
        assert_eq!(f32_to_s16(f32::NEG_INFINITY), -32767);
        assert_eq!(f32_to_s16(f32::NAN), 0);
    }

    #[test]
    fn little_endian_bytes() {
        let mut out = Vec::new();
        f32_to_s16le(&[1.0, -1.0, 0.0], &mut out);
        assert_eq!(out, vec![0xff, 0x7f, 0x01, 0x80, 0x00, 0x00]);
    }
}

//! Step statistics: per-stage timing counters, returned with each utterance.
//!
//! Each counter keeps count, sum and max, plus the individual durations in a buffer reserved
//! up front (so recording allocates nothing) for the 95th percentile. "Share" is the mean as a
//! fraction of the 80 ms codec frame: above 1.0 that stage alone cannot keep up with playback.

use std::fmt;
use std::time::Duration;

use crate::frame::FRAME_SECONDS_12HZ as FRAME_SECONDS;

/// The median of `v` (sorted in place, NaN-safe total order); the mean of the two middle values
/// for an even count; 0 for an empty slice. The one median every benchmark and calibration uses.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// One timing counter.
#[derive(Debug, Clone)]
pub struct Counter {
    /// Counter name, e.g. `talker step`.
    pub name: &'static str,
    count: u64,
    sum: f64,
    max: f64,
    samples: Vec<f32>,
}

impl Counter {
    /// A counter that keeps up to `keep` samples for percentiles (reserved now).
    pub fn new(name: &'static str, keep: usize) -> Self {
        Counter { name, count: 0, sum: 0.0, max: 0.0, samples: Vec::with_capacity(keep) }
    }

    /// Record one duration.
    pub fn record(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        self.count += 1;
        self.sum += s;
        self.max = self.max.max(s);
        if self.samples.len() < self.samples.capacity() {
            self.samples.push(s as f32);
        }
    }

    /// Forget everything recorded (keeps the reservation).
    pub fn clear(&mut self) {
        self.count = 0;
        self.sum = 0.0;
        self.max = 0.0;
        self.samples.clear();
    }

    /// Number of recordings.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean in seconds (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.sum / self.count as f64 }
    }

    /// Total in seconds.
    pub fn total(&self) -> f64 {
        self.sum
    }

    /// Maximum in seconds.
    pub fn max(&self) -> f64 {
        self.max
    }

    /// 95th percentile in seconds (nearest rank over the kept samples; 0 when empty).
    pub fn p95(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let mut v = self.samples.clone();
        v.sort_by(f32::total_cmp);
        let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
        f64::from(v[rank - 1])
    }
}

/// The counters of one utterance.
#[derive(Debug, Clone)]
pub struct StepStats {
    /// Talker prefill (one per utterance).
    pub prefill: Counter,
    /// Talker decode step (one per frame).
    pub talker: Counter,
    /// The 15 code-predictor sub-steps of one frame, with their sampling.
    pub predictor: Counter,
    /// Sampling of c0 and the codes (one per frame, all 16 choices).
    pub sampling: Counter,
    /// One vocoder chunk (window decode).
    pub vocoder: Counter,
    /// Decode thread waiting for room in the frame queue.
    pub frame_queue_wait: Counter,
    /// Vocoder thread waiting for frames.
    pub vocoder_wait: Counter,
}

impl StepStats {
    /// Counters keeping up to `frames` samples each.
    pub fn new(frames: usize) -> Self {
        StepStats {
            prefill: Counter::new("talker prefill", 4),
            talker: Counter::new("talker step", frames),
            predictor: Counter::new("predictor loop", frames),
            sampling: Counter::new("sampling", frames),
            vocoder: Counter::new("vocoder chunk", frames),
            frame_queue_wait: Counter::new("frame queue wait", frames),
            vocoder_wait: Counter::new("vocoder wait", frames),
        }
    }

    /// All counters, in table order.
    pub fn counters(&self) -> [&Counter; 7] {
        [&self.prefill, &self.talker, &self.predictor, &self.sampling, &self.vocoder, &self.frame_queue_wait, &self.vocoder_wait]
    }

    /// Clear every counter.
    pub fn clear(&mut self) {
        for c in [
            &mut self.prefill,
            &mut self.talker,
            &mut self.predictor,
            &mut self.sampling,
            &mut self.vocoder,
            &mut self.frame_queue_wait,
            &mut self.vocoder_wait,
        ] {
            c.clear();
        }
    }
}

impl fmt::Display for StepStats {
    /// A table: count, mean, p95 and max in ms, and the mean's share of the 80 ms frame.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<18} {:>7} {:>9} {:>9} {:>9} {:>7}", "stage", "count", "mean ms", "p95 ms", "max ms", "share")?;
        for c in self.counters() {
            writeln!(
                f,
                "{:<18} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>6.1}%",
                c.name,
                c.count(),
                c.mean() * 1e3,
                c.p95() * 1e3,
                c.max() * 1e3,
                100.0 * c.mean() / FRAME_SECONDS
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_by_hand() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn mean_p95_max_by_hand() {
        let mut c = Counter::new("x", 100);
        for ms in 1..=20u64 {
            c.record(Duration::from_millis(ms));
        }
        assert_eq!(c.count(), 20);
        assert!((c.mean() - 0.0105).abs() < 1e-9); // (1 + ... + 20) / 20 ms
        assert!((c.max() - 0.020).abs() < 1e-9);
        assert!((c.p95() - 0.019).abs() < 1e-6); // rank ceil(0.95 * 20) = 19
    }

    #[test]
    fn recording_does_not_grow_past_the_reservation() {
        let mut c = Counter::new("x", 3);
        let cap = c.samples.capacity();
        for _ in 0..10 {
            c.record(Duration::from_millis(1));
        }
        assert_eq!(c.samples.capacity(), cap);
        assert_eq!(c.count(), 10);
    }

    #[test]
    fn table_lists_every_stage() {
        let s = StepStats::new(8);
        let t = s.to_string();
        for c in s.counters() {
            assert!(t.contains(c.name));
        }
    }
}

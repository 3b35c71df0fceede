//! Playing ahead: a sink fed from a bounded queue by a player thread, so that the producer (the
//! engine reading the next segment of a long text) runs ahead of the audio. While the player
//! still plays what the last segment left in the queue, the next segment's prefill and first
//! chunk are computed: on a board that is faster than real time the audio does not stall
//! between segments.
//!
//! The producer may put a *hold* in the queue ([`Feeder::hold`]): the player stops there until
//! the time the producer sets for it ([`Feeder::open_at`]), or until the producer is done. The
//! playback start policy ([`model::start`]) holds the player before each segment and, when the
//! audio would run dry, once at the end of what is queued: the waits fall where it chooses, not
//! after every chunk.
//!
//! The queue holds at most `capacity` samples (the producer waits beyond it: backpressure, not
//! growth). A cancel drops what is queued and ends the player within one write; a failing sink
//! stops the player, and the producer's next push returns the failure.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use board::audio::{AudioSink, SinkError};

use crate::cancel::Cancel;

/// How often a producer waiting for room looks at its cancel handle.
const CANCEL_POLL: Duration = Duration::from_millis(10);

/// One entry of the player's queue.
enum Item {
    /// Audio to write.
    Samples(Vec<f32>),
    /// Wait here until hold `n` opens ([`Feeder::hold`]).
    Hold(usize),
}

#[derive(Default)]
struct State {
    queue: VecDeque<Item>,
    /// When each hold opens (`None`: not yet decided), by number.
    opens: Vec<Option<Instant>>,
    /// Holds the player has passed.
    passed: usize,
    /// Samples per second of the audio ([`Feeder::set_rate`]; 0: unknown).
    rate: u32,
    /// When the audio handed to the sink so far has played, on a device that plays it in real
    /// time from the first write and after every underrun (the sink's own blocking aside).
    played_until: Option<Instant>,
    /// Samples in `queue`.
    queued: usize,
    /// The producer is done: the player drains the queue and ends.
    closed: bool,
    /// Drop what is queued and end now.
    cut: bool,
    /// The player stopped on this sink error.
    failed: Option<SinkError>,
    /// The player has stopped (after `failed`, a cut or the drain).
    ended: bool,
}

/// The producer's side of [`play_ahead`].
pub struct Feeder<'a> {
    state: &'a Mutex<State>,
    changed: &'a Condvar,
    capacity: usize,
    cancel: &'a Cancel,
}

impl Feeder<'_> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue a copy of `samples` for the player, waiting while the queue holds `capacity`
    /// samples or more.
    ///
    /// # Errors
    /// A message when the player stopped (its sink failed; [`play_ahead`] returns the error
    /// itself) or the job was cancelled while waiting.
    pub fn push(&self, samples: &[f32]) -> Result<(), String> {
        let mut st = self.lock();
        loop {
            if st.ended || st.failed.is_some() {
                return Err("the audio output stopped".into());
            }
            if self.cancel.is_cancelled() {
                return Err("cancelled".into());
            }
            if st.queued < self.capacity {
                break;
            }
            st = self.changed.wait_timeout(st, CANCEL_POLL).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
        st.queued += samples.len();
        st.queue.push_back(Item::Samples(samples.to_vec()));
        drop(st);
        self.changed.notify_all();
        Ok(())
    }

    /// Put a hold at the end of the queue: the player stops there until [`Feeder::open_at`]
    /// names a time that has come (or the producer is done). Returns its number.
    pub fn hold(&self) -> usize {
        let mut st = self.lock();
        let n = st.opens.len();
        st.opens.push(None);
        st.queue.push_back(Item::Hold(n));
        n
    }

    /// Let the player pass hold `n` at `at` (or at once if that has passed).
    pub fn open_at(&self, n: usize, at: Instant) {
        if let Some(o) = self.lock().opens.get_mut(n) {
            *o = Some(at);
        }
        self.changed.notify_all();
    }

    /// Open every hold now.
    pub fn open_all(&self) {
        let now = Instant::now();
        for o in &mut self.lock().opens {
            if o.is_none_or(|t| t > now) {
                *o = Some(now);
            }
        }
        self.changed.notify_all();
    }

    /// Whether the player has passed hold `n` (it plays what follows).
    pub fn passed(&self, n: usize) -> bool {
        self.lock().passed > n
    }

    /// Holds put in the queue that the player has not passed yet.
    pub fn holds_ahead(&self) -> usize {
        let st = self.lock();
        st.opens.len() - st.passed
    }

    /// Samples queued that the player has not handed to the sink yet.
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// The audio's sample rate, Hz: the player then keeps the clock of a device that plays in
    /// real time ([`Feeder::ahead`]).
    pub fn set_rate(&self, rate: u32) {
        self.lock().rate = rate;
    }

    /// Seconds of audio ahead of the device at `now`: what was handed to the sink and has not
    /// played yet by the clock of a real-time device, plus what is queued. 0 without a rate.
    pub fn ahead(&self, now: Instant) -> f64 {
        let st = self.lock();
        if st.rate == 0 {
            return 0.0;
        }
        let handed = st.played_until.and_then(|t| t.checked_duration_since(now)).map_or(0.0, |d| d.as_secs_f64());
        handed + st.queued as f64 / f64::from(st.rate)
    }

    /// Queue `n` samples of digital silence.
    ///
    /// # Errors
    /// As [`Feeder::push`].
    pub fn silence(&self, n: usize) -> Result<(), String> {
        // in pieces of at most one second at 24 kHz, so the queue bound stays meaningful
        let mut left = n;
        while left > 0 {
            let k = left.min(24_000);
            self.push(&vec![0.0; k])?;
            left -= k;
        }
        Ok(())
    }
}

/// Run `produce` with a [`Feeder`] while a player thread writes what it queues into `sink` (already
/// begun), in order. When `produce` returns, the player plays the rest of the queue (or drops it
/// when `cancel` is set) and ends; the sink is not finished here (the caller finishes or aborts
/// it).
///
/// Returns `produce`'s result and the sink error that stopped the player, if one did.
pub fn play_ahead<R>(
    sink: &mut (dyn AudioSink + Send),
    capacity: usize,
    cancel: &Cancel,
    produce: impl FnOnce(&Feeder<'_>) -> R,
) -> (R, Option<SinkError>) {
    let state = Mutex::new(State::default());
    let changed = Condvar::new();
    let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
    let result = std::thread::scope(|s| {
        let player = s.spawn(|| {
            loop {
                let mut st = lock();
                let item = loop {
                    if st.cut || cancel.is_cancelled() {
                        st.queue.clear();
                        st.queued = 0;
                        break None;
                    }
                    let mut wait = CANCEL_POLL;
                    match st.queue.front() {
                        Some(Item::Hold(n)) => {
                            let n = *n;
                            let now = Instant::now();
                            let opens = st.opens.get(n).copied().flatten();
                            if st.closed || opens.is_some_and(|t| t <= now) {
                                st.queue.pop_front();
                                st.passed = st.passed.max(n + 1);
                                continue;
                            }
                            if let Some(t) = opens {
                                wait = wait.min(t - now);
                            }
                        }
                        Some(Item::Samples(_)) => {
                            if let Some(Item::Samples(item)) = st.queue.pop_front() {
                                st.queued -= item.len();
                                break Some(item);
                            }
                        }
                        None if st.closed => break None,
                        None => {}
                    }
                    st = changed.wait_timeout(st, wait).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
                };
                if let (Some(item), rate) = (&item, st.rate)
                    && rate > 0
                {
                    let now = Instant::now();
                    let from = st.played_until.filter(|t| *t > now).unwrap_or(now);
                    st.played_until = Some(from + Duration::from_secs_f64(item.len() as f64 / f64::from(rate)));
                }
                drop(st);
                changed.notify_all();
                let Some(item) = item else { break };
                if let Err(e) = sink.write(&item) {
                    lock().failed = Some(e);
                    break;
                }
            }
            lock().ended = true;
            changed.notify_all();
        });
        let feeder = Feeder { state: &state, changed: &changed, capacity: capacity.max(1), cancel };
        let result = produce(&feeder);
        {
            let mut st = lock();
            st.closed = true;
            if cancel.is_cancelled() {
                st.cut = true;
            }
        }
        changed.notify_all();
        if player.join().is_err() {
            lock().failed.get_or_insert(SinkError::Config("internal error: the player thread panicked".into()));
        }
        result
    });
    let failed = state.into_inner().unwrap_or_else(|p| p.into_inner()).failed;
    (result, failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use board::audio::{SampleFormat, SinkStats};

    /// Records what it is given; fails at the `fail_at`-th write.
    struct Capture {
        got: Vec<f32>,
        writes: usize,
        fail_at: Option<usize>,
    }

    impl AudioSink for Capture {
        fn begin(&mut self, _: u32) -> Result<(), SinkError> {
            Ok(())
        }
        fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
            self.writes += 1;
            if Some(self.writes) == self.fail_at {
                return Err(SinkError::Config("unplugged".into()));
            }
            std::thread::sleep(Duration::from_micros(200));
            self.got.extend_from_slice(samples);
            Ok(())
        }
        fn finish(&mut self) -> Result<SinkStats, SinkError> {
            Ok(SinkStats::passthrough(self.got.len() as u64, 24_000, SampleFormat::S16))
        }
        fn abort(&mut self) {}
    }

    fn capture(fail_at: Option<usize>) -> Capture {
        Capture { got: Vec::new(), writes: 0, fail_at }
    }

    #[test]
    fn everything_queued_is_played_in_order() {
        let mut sink = capture(None);
        let cancel = Cancel::new();
        let (r, failed) = play_ahead(&mut sink, 10, &cancel, |f| {
            for i in 0..100 {
                f.push(&[i as f32, i as f32 + 0.5]).unwrap();
            }
            f.silence(3).unwrap();
            7
        });
        assert_eq!(r, 7);
        assert!(failed.is_none());
        let want: Vec<f32> = (0..100).flat_map(|i| [i as f32, i as f32 + 0.5]).chain([0.0; 3]).collect();
        assert_eq!(sink.got, want);
    }

    #[test]
    fn a_hold_stops_the_player_until_it_opens() {
        let mut sink = capture(None);
        let cancel = Cancel::new();
        let wait_for = |f: &Feeder<'_>, n: usize| {
            while f.queued() > n {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let (passed, failed) = play_ahead(&mut sink, 100, &cancel, |f| {
            f.push(&[1.0, 1.0]).unwrap();
            let h = f.hold();
            f.push(&[2.0]).unwrap();
            wait_for(f, 1);
            // the player wrote what came before the hold, and waits there
            std::thread::sleep(Duration::from_millis(20));
            let held = (f.queued(), f.passed(h), f.holds_ahead());
            f.open_at(h, Instant::now());
            wait_for(f, 0);
            (held, f.passed(h))
        });
        assert_eq!(passed, ((1, false, 1), true));
        assert!(failed.is_none());
        assert_eq!(sink.got, [1.0, 1.0, 2.0]);
    }

    #[test]
    fn ahead_is_what_a_real_time_device_has_yet_to_play() {
        let mut sink = capture(None);
        let cancel = Cancel::new();
        play_ahead(&mut sink, 100, &cancel, |f| {
            assert_eq!(f.ahead(Instant::now()), 0.0, "no rate, no clock");
            f.set_rate(10);
            let h = f.hold();
            f.push(&[0.5; 10]).unwrap();
            // held: one second queued, nothing handed to the device
            assert!((f.ahead(Instant::now()) - 1.0).abs() < 1e-9);
            f.open_at(h, Instant::now());
            while f.queued() > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            // handed over: the device plays it for a second from then
            let now = Instant::now();
            let ahead = f.ahead(now);
            assert!(ahead > 0.5 && ahead <= 1.0, "{ahead}");
            assert_eq!(f.ahead(now + Duration::from_secs(2)), 0.0);
        });
    }

    #[test]
    fn a_hold_never_opened_opens_when_the_producer_is_done() {
        let mut sink = capture(None);
        let cancel = Cancel::new();
        play_ahead(&mut sink, 100, &cancel, |f| {
            f.push(&[1.0]).unwrap();
            f.hold();
            f.push(&[2.0]).unwrap();
        });
        assert_eq!(sink.got, [1.0, 2.0]);
    }

    #[test]
    fn a_failing_sink_stops_the_producer_with_its_error() {
        let mut sink = capture(Some(3));
        let cancel = Cancel::new();
        let (pushed, failed) = play_ahead(&mut sink, 4, &cancel, |f| (0..1000).take_while(|_| f.push(&[1.0; 4]).is_ok()).count());
        assert!(pushed < 1000, "the producer saw the failure");
        assert!(matches!(failed, Some(SinkError::Config(ref m)) if m == "unplugged"), "{failed:?}");
        assert_eq!(sink.got.len(), 8, "two writes before the third failed");
    }

    #[test]
    fn a_cancel_drops_the_queue_and_frees_a_waiting_producer() {
        let mut sink = capture(None);
        let cancel = Cancel::new();
        let (r, failed) = play_ahead(&mut sink, 1_000_000, &cancel, |f| {
            for _ in 0..50 {
                f.push(&[1.0; 1000]).unwrap();
            }
            cancel.cancel();
            f.push(&[1.0; 10])
        });
        assert!(r.is_err());
        assert!(failed.is_none());
        assert!(sink.got.len() < 50_000, "the queue was dropped, {} samples played", sink.got.len());
    }
}

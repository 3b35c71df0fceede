//! [`AmpSink`]: an [`AudioSink`] gated by the amplifier line.

use std::error::Error as StdError;

use embedded_hal::digital::OutputPin;

use super::Amplifier;
use crate::audio::{AudioSink, SinkError, SinkStats};

/// An [`AudioSink`] that switches an [`Amplifier`] around each utterance of the sink it wraps.
///
/// `begin` enables the amplifier (line active, then the lead wait) and then begins the inner
/// sink, so the line is active at least `lead` before the first sample; `finish` finishes the
/// inner sink (which drains the device) and then disables; `abort` aborts the inner sink and then
/// disables. When the inner sink fails, the line is made inactive first and the inner error is
/// returned. A failed write to the line is a [`SinkError::Other`] of kind `Device` (exit 3)
/// whose message is the [`AmpError`](super::AmpError)'s. Dropping the sink drops the
/// amplifier, which drives the line inactive if needed.
///
/// The lead wait happens inside `begin`, so it adds to the time to first audio unless the caller
/// enables earlier (e.g. when a request arrives) through [`amplifier_mut`](Self::amplifier_mut):
/// `begin` then finds the line active and does not wait again.
pub struct AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    inner: S,
    amp: Amplifier<P>,
}

impl<S, P> AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    /// Wrap `inner` with `amp`.
    pub fn new(inner: S, amp: Amplifier<P>) -> Self {
        Self { inner, amp }
    }

    /// The wrapped sink.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The amplifier.
    pub fn amplifier(&self) -> &Amplifier<P> {
        &self.amp
    }

    /// The amplifier, e.g. to enable it before synthesis starts.
    pub fn amplifier_mut(&mut self) -> &mut Amplifier<P> {
        &mut self.amp
    }

    /// Take the sink and the amplifier apart (the amplifier keeps its state).
    pub fn into_parts(self) -> (S, Amplifier<P>) {
        (self.inner, self.amp)
    }

    fn disable_after(&mut self, what: &str) -> Result<(), SinkError> {
        self.amp.disable().map_err(|e| {
            log::warn!("after {what}: {e}");
            SinkError::from(e)
        })
    }
}

impl<S, P> AudioSink for AmpSink<S, P>
where
    S: AudioSink,
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.amp.enable()?;
        if let Err(e) = self.inner.begin(sample_rate) {
            // The inner error is the one worth reporting; a failing disable is logged.
            let _ = self.disable_after("a failed begin");
            return Err(e);
        }
        Ok(())
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.inner.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let result = self.inner.finish();
        let disabled = self.disable_after(if result.is_ok() { "finish" } else { "a failed finish" });
        let stats = result?;
        disabled?;
        Ok(stats)
    }

    fn abort(&mut self) {
        self.inner.abort();
        let _ = self.disable_after("abort");
    }
}

#[cfg(test)]
mod tests {
    use super::super::mock::{Event, LEAD, Log, amp, events, set};
    use super::*;
    use crate::audio::{SampleFormat, SinkErrorKind};
    use crate::gpio::AmpError;
    use embedded_hal_mock::eh1::MockError;
    use embedded_hal_mock::eh1::digital::State;
    use linux_embedded_hal::CdevPin;

    /// An AudioSink that records its calls; `fail_begin` / `fail_finish` make those calls fail.
    struct RecordingSink {
        log: Log,
        fail_begin: bool,
        fail_finish: bool,
        rate: u32,
        samples: u64,
    }

    impl RecordingSink {
        fn new(log: &Log) -> Self {
            Self { log: log.clone(), fail_begin: false, fail_finish: false, rate: 0, samples: 0 }
        }
    }

    impl AudioSink for RecordingSink {
        fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
            self.log.lock().unwrap().push(Event::Begin(sample_rate));
            if self.fail_begin {
                return Err(SinkError::Config("test: begin refused".into()));
            }
            self.rate = sample_rate;
            self.samples = 0;
            Ok(())
        }
        fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
            self.log.lock().unwrap().push(Event::Write(samples.len()));
            self.samples += samples.len() as u64;
            Ok(())
        }
        fn finish(&mut self) -> Result<SinkStats, SinkError> {
            self.log.lock().unwrap().push(Event::Finish);
            if self.fail_finish {
                return Err(SinkError::Stalled { device: "test".into(), waited_ms: 7 });
            }
            Ok(SinkStats::passthrough(self.samples, self.rate, SampleFormat::S16))
        }
        fn abort(&mut self) {
            self.log.lock().unwrap().push(Event::Abort);
        }
    }

    /// An amplifier on a logged mock pin expecting `transactions`; returns the mock (a clone

    #[test]
    fn sink_orders_pin_lead_begin_writes_finish_pin_for_each_utterance() {
        let t = [set(State::High), set(State::Low), set(State::High), set(State::Low)];
        let (a, mut mock, log) = amp(&t, false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        for _ in 0..2 {
            sink.begin(24_000).unwrap();
            sink.write(&[0.1; 480]).unwrap();
            sink.write(&[]).unwrap();
            sink.write(&[0.2; 960]).unwrap();
            let stats = sink.finish().unwrap();
            assert_eq!(stats.input_samples, 1440);
            assert!(!sink.amplifier().is_enabled());
        }
        let one = [
            Event::Pin(State::High),
            Event::Sleep(LEAD),
            Event::Begin(24_000),
            Event::Write(480),
            Event::Write(0),
            Event::Write(960),
            Event::Finish,
            Event::Pin(State::Low),
        ];
        assert_eq!(events(&log), [one.clone(), one].concat());
        drop(sink);
        mock.done();
    }

    #[test]
    fn sink_active_low_drives_low_to_enable() {
        let (a, mut mock, log) = amp(&[set(State::Low), set(State::High)], true, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(16_000).unwrap();
        sink.write(&[0.0; 4]).unwrap();
        sink.finish().unwrap();
        assert_eq!(
            events(&log),
            [
                Event::Pin(State::Low),
                Event::Sleep(LEAD),
                Event::Begin(16_000),
                Event::Write(4),
                Event::Finish,
                Event::Pin(State::High)
            ]
        );
        drop(sink);
        mock.done();
    }

    #[test]
    fn abort_aborts_the_inner_sink_then_disables() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.abort(); // idle: the inner abort runs, the line is already inactive
        sink.begin(24_000).unwrap();
        sink.write(&[0.5; 10]).unwrap();
        sink.abort();
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(
            events(&log),
            [
                Event::Abort,
                Event::Pin(State::High),
                Event::Sleep(LEAD),
                Event::Begin(24_000),
                Event::Write(10),
                Event::Abort,
                Event::Pin(State::Low)
            ]
        );
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_inner_finish_still_disables_and_returns_the_inner_error() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut inner = RecordingSink::new(&log);
        inner.fail_finish = true;
        let mut sink = AmpSink::new(inner, a);
        sink.begin(24_000).unwrap();
        let err = sink.finish().unwrap_err();
        assert!(matches!(err, SinkError::Stalled { waited_ms: 7, .. }), "{err}");
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(events(&log).last(), Some(&Event::Pin(State::Low)));
        assert_eq!(events(&log)[events(&log).len() - 2], Event::Finish);
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_inner_begin_disables_and_returns_the_inner_error() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut inner = RecordingSink::new(&log);
        inner.fail_begin = true;
        let mut sink = AmpSink::new(inner, a);
        let err = sink.begin(24_000).unwrap_err();
        assert_eq!(err.kind(), SinkErrorKind::Config);
        assert_eq!(events(&log), [Event::Pin(State::High), Event::Sleep(LEAD), Event::Begin(24_000), Event::Pin(State::Low)]);
        drop(sink);
        mock.done();
    }

    #[test]
    fn drop_while_active_drives_the_line_inactive() {
        let (a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(24_000).unwrap();
        sink.write(&[0.1; 3]).unwrap();
        drop(sink);
        assert_eq!(events(&log).last(), Some(&Event::Pin(State::Low)));
        mock.done();
    }

    #[test]
    fn failed_enable_skips_the_inner_begin_and_names_the_line() {
        let err = MockError::Io(std::io::ErrorKind::Other);
        let (a, mut mock, log) = amp(&[set(State::High).with_error(err)], false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        let e = sink.begin(24_000).unwrap_err();
        assert_eq!(e.to_string(), "amplifier GPIO: driving test line active (high) failed: I/O error: Other");
        assert_eq!(e.kind(), crate::audio::SinkErrorKind::Device);
        assert!(!sink.amplifier().is_enabled());
        assert_eq!(events(&log), [Event::Pin(State::High)]); // no lead wait, no begin
        drop(sink);
        mock.done();
    }

    #[test]
    fn failed_disable_after_a_good_finish_is_an_error_and_retried_on_drop() {
        let err = MockError::Io(std::io::ErrorKind::Other);
        let t = [set(State::High), set(State::Low).with_error(err), set(State::Low)];
        let (a, mut mock, log) = amp(&t, false, LEAD);
        let mut sink = AmpSink::new(RecordingSink::new(&log), a);
        sink.begin(24_000).unwrap();
        let e = sink.finish().unwrap_err();
        assert!(e.to_string().contains("driving test line inactive (low) failed"), "{e}");
        assert!(sink.amplifier().is_enabled());
        drop(sink); // the drop tries again and succeeds
        mock.done();
    }

    #[test]
    fn amp_sink_on_a_real_line_can_move_to_the_audio_thread() {
        fn send<T: Send>() {}
        send::<AmpSink<crate::audio::AlsaSink, CdevPin>>();
        send::<AmpSink<Box<dyn AudioSink + Send>, CdevPin>>();
        send::<AmpError>();
    }
}

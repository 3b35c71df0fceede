//! [`Amplifier`]: the enable line's state machine over any embedded-hal output pin.

use std::error::Error as StdError;
use std::time::Duration;

use embedded_hal::digital::OutputPin;

use super::AmpError;

/// Sleeps for the lead time; injectable so tests can observe the lead without waiting.
pub type Sleeper = Box<dyn FnMut(Duration) + Send>;

/// An amplifier-enable line: drives `pin` to the active level and waits `lead` on
/// [`enable`](Self::enable), drives it inactive on [`disable`](Self::disable), and drives it
/// inactive when dropped while still active.
///
/// Both calls are idempotent: a call that finds the line already in the wanted state writes
/// nothing (and `enable` does not wait again). The pin must be at the inactive level when it is
/// handed over ([`open_line`](super::open_line) requests it so).
pub struct Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    pin: P,
    active_low: bool,
    lead: Duration,
    sleep: Sleeper,
    enabled: bool,
    name: String,
}

impl<P> Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    /// An amplifier on `pin` (currently inactive) that is enabled by the low level when
    /// `active_low`, by the high level otherwise, and needs `lead` between enable and the first
    /// sample. Waits with [`std::thread::sleep`]; see [`with_sleeper`](Self::with_sleeper).
    pub fn new(pin: P, active_low: bool, lead: Duration) -> Self {
        Self { pin, active_low, lead, sleep: Box::new(std::thread::sleep), enabled: false, name: "amplifier line".to_owned() }
    }

    /// Replace the function that waits the lead time (called once per enable, only when the lead
    /// is not zero).
    pub fn with_sleeper(mut self, sleep: impl FnMut(Duration) + Send + 'static) -> Self {
        self.sleep = Box::new(sleep);
        self
    }

    /// Name the line in error and log messages, e.g. "line 17 of chip 'pinctrl-rp1'".
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The line's name as used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Time waited after driving the line active.
    pub fn lead(&self) -> Duration {
        self.lead
    }

    /// Wait `lead` after driving the line active from the next enable on (a reload of
    /// `amplifier.lead_ms`).
    pub fn set_lead(&mut self, lead: Duration) {
        self.lead = lead;
    }

    /// Whether the low level enables the amplifier.
    pub fn active_low(&self) -> bool {
        self.active_low
    }

    /// Whether the line is currently driven active.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Drive the line active, then wait the lead time. Does nothing when already active.
    ///
    /// # Errors
    /// [`AmpError::Pin`] when the write fails (the amplifier is then considered off).
    pub fn enable(&mut self) -> Result<(), AmpError> {
        if self.enabled {
            return Ok(());
        }
        self.drive(true)?;
        self.enabled = true;
        log::debug!("{} active; waiting {} ms lead", self.name, self.lead.as_millis());
        if !self.lead.is_zero() {
            (self.sleep)(self.lead);
        }
        Ok(())
    }

    /// Drive the line inactive. Does nothing when already inactive.
    ///
    /// # Errors
    /// [`AmpError::Pin`] when the write fails (the amplifier is then still considered on, so a
    /// later `disable` or the drop tries again).
    pub fn disable(&mut self) -> Result<(), AmpError> {
        if !self.enabled {
            return Ok(());
        }
        self.drive(false)?;
        self.enabled = false;
        log::debug!("{} inactive", self.name);
        Ok(())
    }

    fn drive(&mut self, active: bool) -> Result<(), AmpError> {
        let high = active != self.active_low;
        let result = if high { self.pin.set_high() } else { self.pin.set_low() };
        result.map_err(|e| AmpError::Pin {
            name: self.name.clone(),
            level: format!("{} ({})", if active { "active" } else { "inactive" }, if high { "high" } else { "low" }),
            source: Box::new(e),
        })
    }
}

impl<P> Drop for Amplifier<P>
where
    P: OutputPin,
    P::Error: StdError + Send + Sync + 'static,
{
    fn drop(&mut self) {
        if let Err(e) = self.disable() {
            log::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::mock::{Event, LEAD, amp, events, set};
    use embedded_hal_mock::eh1::digital::State;
    use std::time::Duration;

    #[test]
    fn enable_drives_active_then_waits_the_lead_and_both_are_idempotent() {
        let (mut a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, LEAD);
        assert!(!a.is_enabled());
        a.disable().unwrap(); // already inactive: no write
        a.enable().unwrap();
        a.enable().unwrap(); // already active: no write, no second wait
        assert!(a.is_enabled());
        a.disable().unwrap();
        a.disable().unwrap();
        assert!(!a.is_enabled());
        assert_eq!(events(&log), [Event::Pin(State::High), Event::Sleep(LEAD), Event::Pin(State::Low)]);
        drop(a); // inactive: the drop writes nothing
        mock.done();
    }

    #[test]
    fn active_low_inverts_the_levels() {
        let (mut a, mut mock, log) = amp(&[set(State::Low), set(State::High)], true, LEAD);
        a.enable().unwrap();
        a.disable().unwrap();
        assert_eq!(events(&log), [Event::Pin(State::Low), Event::Sleep(LEAD), Event::Pin(State::High)]);
        drop(a);
        mock.done();
    }

    #[test]
    fn a_new_lead_applies_from_the_next_enable() {
        let (mut a, mut mock, log) = amp(&[set(State::High), set(State::Low), set(State::High), set(State::Low)], false, LEAD);
        a.enable().unwrap();
        a.set_lead(Duration::from_millis(7));
        a.disable().unwrap();
        a.enable().unwrap();
        a.disable().unwrap();
        let want = [
            Event::Pin(State::High),
            Event::Sleep(LEAD),
            Event::Pin(State::Low),
            Event::Pin(State::High),
            Event::Sleep(Duration::from_millis(7)),
            Event::Pin(State::Low),
        ];
        assert_eq!(events(&log), want);
        drop(a);
        mock.done();
    }

    #[test]
    fn zero_lead_does_not_sleep() {
        let (mut a, mut mock, log) = amp(&[set(State::High), set(State::Low)], false, Duration::ZERO);
        a.enable().unwrap();
        a.disable().unwrap();
        assert_eq!(events(&log), [Event::Pin(State::High), Event::Pin(State::Low)]);
        drop(a);
        mock.done();
    }
}

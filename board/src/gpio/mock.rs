//! Test helpers: a logged mock pin and an amplifier on it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use embedded_hal::digital::{ErrorType, OutputPin};
use embedded_hal_mock::eh1::MockError;
use embedded_hal_mock::eh1::digital::{Mock as PinMock, State, Transaction};

use super::Amplifier;

pub(super) const LEAD: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Event {
    Pin(State),
    Sleep(Duration),
    Begin(u32),
    Write(usize),
    Finish,
    Abort,
}

pub(super) type Log = Arc<Mutex<Vec<Event>>>;

pub(super) fn events(log: &Log) -> Vec<Event> {
    log.lock().unwrap().clone()
}

/// The mock pin checks the exact pin transactions; this wrapper also records each write in
/// the shared log so its order relative to the sink calls and the sleep can be checked.
pub(super) struct LoggedPin {
    pin: PinMock,
    log: Log,
}

impl ErrorType for LoggedPin {
    type Error = MockError;
}

impl OutputPin for LoggedPin {
    fn set_low(&mut self) -> Result<(), MockError> {
        self.log.lock().unwrap().push(Event::Pin(State::Low));
        self.pin.set_low()
    }
    fn set_high(&mut self) -> Result<(), MockError> {
        self.log.lock().unwrap().push(Event::Pin(State::High));
        self.pin.set_high()
    }
}

/// An amplifier on a logged mock pin expecting `transactions`; returns the mock (a clone
/// sharing the expectations, for `done()`) and the log.
pub(super) fn amp(transactions: &[Transaction], active_low: bool, lead: Duration) -> (Amplifier<LoggedPin>, PinMock, Log) {
    let log: Log = Arc::default();
    let mock = PinMock::new(transactions);
    let sleeps = log.clone();
    let amp = Amplifier::new(LoggedPin { pin: mock.clone(), log: log.clone() }, active_low, lead)
        .with_sleeper(move |d| sleeps.lock().unwrap().push(Event::Sleep(d)))
        .with_name("test line");
    (amp, mock, log)
}

pub(super) fn set(s: State) -> Transaction {
    Transaction::set(s)
}

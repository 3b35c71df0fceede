//! What SIGINT, SIGTERM and SIGHUP mean to herald (docs/reliability.md "Signals").
//!
//! The three signals are blocked in every thread ([`block`], the first thing `main` does, so
//! every thread started later inherits the mask) and taken one at a time by a thread of their
//! own with `sigwait(2)` ([`start`]): what happens on a signal is ordinary code, not a signal
//! handler, so it may log, take locks and remove files. herald starts no child process, so the
//! mask reaches no other program.
//!
//! - SIGINT / SIGTERM: the first one stops the utterance in progress within a frame (its output
//!   finished cleanly: fade-out, WAV header) and every later one ([`service::Stop`]); `speak`
//!   then exits 130, `serve` 0, both naming the signal. While `speak` waits for text on standard
//!   input ([`reading_input`]) nothing is in progress: it exits 130 at once with a message. A
//!   second signal exits 130 at once, saying what it left behind ([`on_second_signal`]).
//! - SIGHUP: `serve` reloads its configuration ([`on_hangup`]) and never stops on it; for the
//!   other commands (run from a terminal that went away) it stops like SIGTERM.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use nix::sys::signal::{SigSet, Signal};

use crate::exit;

/// What SIGHUP does (see the [module](self) docs).
enum Hangup {
    /// Stop, like SIGTERM (every command but `serve`).
    Stops,
    /// `serve` before it can reload: remember it (`true` once one came) and reload once ready.
    Deferred(bool),
    /// `serve`, running: reload.
    Reload(Box<dyn Fn() + Send>),
}

static HANGUP: Mutex<Hangup> = Mutex::new(Hangup::Stops);
/// What a second stop signal left behind, for its message (`speak --out`).
static SECOND: Mutex<Option<Box<dyn Fn() -> String + Send>>> = Mutex::new(None);
/// Set while `speak` waits for its text on standard input.
static READING_INPUT: AtomicBool = AtomicBool::new(false);
/// The signal that stopped herald (its number), 0 while none did.
static STOPPED_BY: AtomicI32 = AtomicI32::new(0);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The signals herald takes itself.
fn signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Block SIGINT, SIGTERM and SIGHUP in this thread, and so in every thread it starts from now
/// on. Call before any thread is started.
///
/// # Errors
/// `pthread_sigmask(2)` failed (it does not, with these signals).
pub fn block() -> nix::Result<()> {
    signals().thread_block()
}

/// Start the thread that takes the signals [`block`] blocked and acts on them (see the
/// [module](self) docs); `stop` is the process-wide stop that SIGINT and SIGTERM set.
///
/// # Errors
/// The thread could not be started; the signals are unblocked again (their default action:
/// they end herald at once).
pub fn start(stop: service::Stop) -> std::io::Result<()> {
    let started = std::thread::Builder::new().name("signals".into()).spawn(move || {
        let set = signals();
        loop {
            // EINTR and the like: wait again
            if let Ok(signal) = set.wait() {
                on_signal(signal, &stop);
            }
        }
    });
    if let Err(e) = started {
        let _ = signals().thread_unblock();
        return Err(e);
    }
    Ok(())
}

fn on_signal(signal: Signal, stop: &service::Stop) {
    let name = signal.as_str();
    if signal == Signal::SIGHUP {
        let mut hangup = lock(&HANGUP);
        match &mut *hangup {
            Hangup::Stops => {}
            Hangup::Deferred(came) => {
                log::info!("SIGHUP: the configuration is read again once herald is ready");
                *came = true;
                return;
            }
            Hangup::Reload(reload) => {
                reload();
                return;
            }
        }
    }
    if stop.is_stopped() {
        let left = lock(&SECOND).as_ref().map(|f| f());
        match left {
            Some(what) => eprintln!("error: {name} again: stopped at once; {what}"),
            None => eprintln!("error: {name} again: stopped at once"),
        }
        std::process::exit(i32::from(exit::INTERRUPTED));
    }
    STOPPED_BY.store(signal as i32, Ordering::SeqCst);
    if READING_INPUT.load(Ordering::SeqCst) {
        eprintln!("error: {name} while waiting for text on standard input; nothing was spoken");
        std::process::exit(i32::from(exit::INTERRUPTED));
    }
    log::info!("{name}: stopping (a second signal stops at once)");
    stop.stop();
}

/// The name of the signal that stopped herald (`SIGTERM`), if one did.
pub fn stopped_by() -> Option<&'static str> {
    Signal::try_from(STOPPED_BY.load(Ordering::SeqCst)).ok().map(Signal::as_str)
}

/// While `reading` is true, a first SIGINT/SIGTERM exits 130 at once with a message (`speak`
/// waiting for its text on standard input: nothing to stop cleanly).
pub fn reading_input(reading: bool) {
    READING_INPUT.store(reading, Ordering::SeqCst);
}

/// `f` says, for a second stop signal's message, what herald leaves behind when it exits at
/// once (`speak --out`: the unfinished file removed, or the finished one kept). It runs on the
/// signal thread just before the exit.
pub fn on_second_signal(f: impl Fn() -> String + Send + 'static) {
    *lock(&SECOND) = Some(Box::new(f));
}

/// From now on SIGHUP never stops herald: it is remembered until [`on_hangup`] (`serve`, from
/// its start until it is ready).
pub fn defer_hangup() {
    let mut hangup = lock(&HANGUP);
    if matches!(*hangup, Hangup::Stops) {
        *hangup = Hangup::Deferred(false);
    }
}

/// SIGHUP runs `reload` (on the signal thread; one at a time). A SIGHUP that came while it was
/// deferred ([`defer_hangup`]) runs it now, on the caller's thread.
pub fn on_hangup(reload: impl Fn() + Send + 'static) {
    let mut hangup = lock(&HANGUP);
    let came = matches!(*hangup, Hangup::Deferred(true));
    if came {
        reload();
    }
    *hangup = Hangup::Reload(Box::new(reload));
}

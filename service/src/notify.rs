//! systemd integration, sd_notify(3): `READY=1`, `STATUS=…`, `STOPPING=1` and the watchdog
//! keep-alive `WATCHDOG=1`, as datagrams to `$NOTIFY_SOCKET`.
//!
//! The message names and the watchdog environment (`$WATCHDOG_USEC`, and `$WATCHDOG_PID` naming
//! this process or unset, as sd_watchdog_enabled(3)) come from the `sd-notify` crate. The
//! socket is opened here: sd-notify 0.5 connects to `$NOTIFY_SOCKET` as a file-system path, so
//! it cannot reach an abstract socket (`@name`, which sd_notify(3) allows and systemd in
//! containers and test harnesses uses); this module sends to a path or an abstract name.

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use sd_notify::NotifyState;

/// A problem with `$NOTIFY_SOCKET` (herald then runs without notifications).
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is neither an absolute path nor an abstract name (`@name`).
    #[error("NOTIFY_SOCKET={0:?} is neither an absolute path nor an abstract socket name (@name)")]
    Address(String),
    /// The address could not be built or the socket could not be created.
    #[error("NOTIFY_SOCKET={addr:?}: {source}")]
    Socket {
        /// `$NOTIFY_SOCKET`.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// The sd_notify(3) datagram socket, and the watchdog period systemd asked for.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// The notifier the process environment describes; `Ok(None)` without `$NOTIFY_SOCKET`.
    ///
    /// # Errors
    /// [`NotifyError`] for an unusable `$NOTIFY_SOCKET`.
    pub fn from_env() -> Result<Option<Notifier>, NotifyError> {
        let Some(sock) = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        let sock = sock.to_string_lossy().into_owned();
        let addr = notify_addr(&sock)?;
        let socket = UnixDatagram::unbound().map_err(|source| NotifyError::Socket { addr: sock.clone(), source })?;
        let watchdog = sd_notify::watchdog_enabled().filter(|d| !d.is_zero());
        Ok(Some(Notifier { socket, addr, watchdog }))
    }

    /// Send `states` in one datagram; a failure is logged, never fatal (systemd may be
    /// restarting).
    pub fn notify(&self, states: &[NotifyState<'_>]) {
        let msg: String = states.iter().map(|s| format!("{s}\n")).collect();
        if let Err(e) = self.socket.send_to_addr(msg.as_bytes(), &self.addr) {
            log::warn!("sd_notify {:?}: {e}", msg.lines().next().unwrap_or(""));
        }
    }

    /// The keep-alive period systemd expects (`$WATCHDOG_USEC`), if it asked for one.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    fn try_clone(&self) -> std::io::Result<Notifier> {
        Ok(Notifier { socket: self.socket.try_clone()?, addr: self.addr.clone(), watchdog: None })
    }
}

/// The socket address `$NOTIFY_SOCKET` names: an absolute path, or with a leading `@` an
/// abstract name (the rest; sd_notify(3) "NOTIFY_SOCKET").
fn notify_addr(sock: &str) -> Result<SocketAddr, NotifyError> {
    let err = |source| NotifyError::Socket { addr: sock.to_owned(), source };
    if let Some(name) = sock.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(err)
    } else if sock.starts_with('/') {
        SocketAddr::from_pathname(sock).map_err(err)
    } else {
        Err(NotifyError::Address(sock.to_owned()))
    }
}

/// Proof of life of the work the watchdog vouches for: the time of its last sign. Clones share
/// it.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    start: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self::new()
    }
}

impl Heartbeat {
    /// A heartbeat that beat now.
    pub fn new() -> Self {
        Heartbeat { start: Instant::now(), last_ms: Arc::new(AtomicU64::new(0)) }
    }

    /// A sign of life.
    pub fn beat(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the last sign of life.
    pub fn age(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// The thread that sends `WATCHDOG=1` every half period while the heartbeat is younger than
/// the period: when the work hangs, the keep-alive stops and systemd's `WatchdogSec=` restarts
/// the service.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Watchdog {
    /// Start the keep-alive when `notifier` has a watchdog period; `None` otherwise (or when
    /// the thread cannot start, which is logged).
    pub fn start(notifier: &Notifier, heartbeat: &Heartbeat) -> Option<Watchdog> {
        let period = notifier.watchdog?;
        let notifier = match notifier.try_clone() {
            Ok(n) => n,
            Err(e) => {
                log::warn!("watchdog: cannot clone the notification socket: {e}; no keep-alive");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let hb = heartbeat.clone();
        let flag = Arc::clone(&stop);
        log::info!("watchdog: keep-alive every {:.1} s", period.as_secs_f64() / 2.0);
        let thread = std::thread::Builder::new().name("herald-watchdog".into()).spawn(move || {
            let mut stalled = false;
            while !flag.load(Ordering::Relaxed) {
                let age = hb.age();
                if age < period {
                    notifier.notify(&[NotifyState::Watchdog]);
                    stalled = false;
                } else if !stalled {
                    log::error!("watchdog: no progress for {:.1} s; withholding the keep-alive", age.as_secs_f64());
                    stalled = true;
                }
                std::thread::park_timeout(period / 2);
            }
        });
        match thread {
            Ok(thread) => Some(Watchdog { stop, thread }),
            Err(e) => {
                log::warn!("watchdog: cannot start its thread: {e}; no keep-alive");
                None
            }
        }
    }

    /// Stop the keep-alive and wait for the thread.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.thread().unpark();
        let _ = self.thread.join();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::path::Path;

    #[test]
    fn notify_socket_addresses() {
        use std::os::linux::net::SocketAddrExt;
        let a = notify_addr("@herald/test").unwrap();
        assert_eq!(a.as_abstract_name(), Some(&b"herald/test"[..]));
        let p = notify_addr("/run/systemd/notify").unwrap();
        assert_eq!(p.as_pathname(), Some(Path::new("/run/systemd/notify")));
        assert!(matches!(notify_addr("relative/sock"), Err(NotifyError::Address(_))));
        assert!(matches!(notify_addr("vsock:2:1234"), Err(NotifyError::Address(_))));
    }

    #[test]
    fn one_datagram_of_assignments_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("herald-service-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier { socket: UnixDatagram::unbound().unwrap(), addr, watchdog: None };
        n.notify(&[NotifyState::Ready, NotifyState::Status("ready; reading lines")]);
        let mut buf = [0u8; 256];
        let len = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=ready; reading lines\n");
    }
}

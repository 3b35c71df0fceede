//! Zeroconf for the Wyoming server: a DNS-SD announcement of `_wyoming._tcp.local.`
//! (RFC 6763 over mDNS, RFC 6762), which is how Home Assistant discovers Wyoming services on
//! its network. The responder is the `mdns-sd` crate's daemon (its own thread); herald only
//! says what to announce. Only a server reachable from other machines is announced (see
//! [`wanted`]).

use std::net::{IpAddr, SocketAddr};

use mdns_sd::{ServiceDaemon, ServiceInfo};

/// The DNS-SD service type Home Assistant browses for Wyoming services.
pub const SERVICE_TYPE: &str = "_wyoming._tcp.local.";
/// The standard mDNS port (RFC 6762).
pub const MDNS_PORT: u16 = 5353;

/// Why the announcement could not be made (herald then serves without it).
#[derive(Debug, thiserror::Error)]
#[error("zeroconf: {0}")]
pub struct ZeroconfError(String);

impl From<mdns_sd::Error> for ZeroconfError {
    fn from(e: mdns_sd::Error) -> Self {
        ZeroconfError(e.to_string())
    }
}

/// Whether a Wyoming server bound to `addr` is announced: only when other machines can reach
/// it (not a loopback address).
pub fn wanted(addr: &SocketAddr) -> bool {
    !addr.ip().is_loopback()
}

/// The announcement; withdrawn (a goodbye packet) when stopped or dropped.
pub struct Announcement {
    daemon: ServiceDaemon,
    fullname: String,
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement").field("fullname", &self.fullname).finish_non_exhaustive()
    }
}

impl Announcement {
    /// Announce the Wyoming server at `addr` as the instance `herald-<host name>` with the
    /// host `<host name>.local.`: on every interface's addresses when `addr` is the
    /// unspecified address (`0.0.0.0`, `::`), else on `addr`'s IP only. `mdns_port` is
    /// [`MDNS_PORT`] except in tests.
    ///
    /// # Errors
    /// [`ZeroconfError`] when the daemon cannot start or the record is refused.
    pub fn start(addr: SocketAddr, mdns_port: u16) -> Result<Announcement, ZeroconfError> {
        let host = host_name();
        let daemon = ServiceDaemon::new_with_port(mdns_port)?;
        let instance = format!("herald-{host}");
        let properties: [(&str, &str); 1] = [("version", env!("CARGO_PKG_VERSION"))];
        let ips: Vec<IpAddr> = if addr.ip().is_unspecified() { Vec::new() } else { vec![addr.ip()] };
        let mut info = ServiceInfo::new(SERVICE_TYPE, &instance, &format!("{host}.local."), &ips[..], addr.port(), &properties[..])?;
        if ips.is_empty() {
            info = info.enable_addr_auto();
        }
        let fullname = info.get_fullname().to_owned();
        daemon.register(info)?;
        log::info!("zeroconf: announcing {fullname} (port {})", addr.port());
        Ok(Announcement { daemon, fullname })
    }

    /// The announced instance's full name, `herald-<host>._wyoming._tcp.local.`.
    pub fn fullname(&self) -> &str {
        &self.fullname
    }

    /// Withdraw the announcement and stop the responder.
    pub fn stop(self) {
        // Drop does it
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        if let Ok(done) = self.daemon.unregister(&self.fullname) {
            let _ = done.recv_timeout(std::time::Duration::from_secs(1));
        }
        let _ = self.daemon.shutdown();
    }
}

/// This machine's host name (the kernel's), as a DNS label: characters other than letters,
/// digits and `-` become `-`; `herald` when it cannot be read.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let label: String = raw.trim().chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }).take(63).collect();
    if label.trim_matches('-').is_empty() { "herald".into() } else { label }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn only_reachable_servers_are_announced() {
        assert!(!wanted(&"127.0.0.1:10200".parse().unwrap()));
        assert!(!wanted(&"[::1]:10200".parse().unwrap()));
        assert!(wanted(&"0.0.0.0:10200".parse().unwrap()));
        assert!(wanted(&"192.168.1.20:10200".parse().unwrap()));
    }

    #[test]
    fn host_names_become_dns_labels() {
        let h = host_name();
        assert!(!h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'), "{h}");
    }

    /// A browser (the crate's own querier, on a private mDNS port so the machine's real
    /// responders are not involved) resolves the announced instance to its port.
    #[test]
    fn a_browser_finds_the_announced_wyoming_service() {
        let mdns_port = 25353;
        let announced = Announcement::start("0.0.0.0:10277".parse().unwrap(), mdns_port).unwrap();
        let browser = ServiceDaemon::new_with_port(mdns_port).unwrap();
        let events = browser.browse(SERVICE_TYPE).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let mut found = None;
        while Instant::now() < end && found.is_none() {
            if let Ok(mdns_sd::ServiceEvent::ServiceResolved(s)) = events.recv_timeout(Duration::from_millis(200))
                && s.get_fullname() == announced.fullname()
            {
                found = Some(s.get_port());
            }
        }
        let _ = browser.shutdown();
        assert_eq!(found, Some(10277), "no resolution of {} within 10 s", announced.fullname());
        assert!(announced.fullname().starts_with("herald-") && announced.fullname().ends_with(SERVICE_TYPE));
    }
}

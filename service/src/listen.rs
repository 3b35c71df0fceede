//! The listening sockets of the network front-ends: from the configured addresses, or handed
//! over by systemd's socket activation (`herald.socket`, sd_listen_fds(3)).

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd};

/// A configured listening address that cannot be used; the text names the key and the value.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The value is not an address of the expected form.
    #[error("{key} = {value:?}: {problem}")]
    Address {
        /// The configuration key (`serve.wyoming`, `serve.http`).
        key: &'static str,
        /// The value.
        value: String,
        /// What is wrong, and the forms allowed.
        problem: String,
    },
    /// Binding failed (in use, not an address of this machine, a privileged port).
    #[error("{key} = {value:?}: cannot listen on {addr}: {source}")]
    Bind {
        /// The configuration key.
        key: &'static str,
        /// The value.
        value: String,
        /// The address tried.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Parse a listening address: `off` → `None`; else `HOST:PORT` with an
/// optional `scheme://` prefix (`tcp://` for Wyoming, `http://` for HTTP; `scheme` names the
/// one allowed), the host a name or an IP literal (IPv6 in brackets). Port 0 lets the kernel
/// choose (tests).
///
/// # Errors
/// [`ListenError::Address`].
pub fn parse(key: &'static str, value: &str, scheme: &str) -> Result<Option<SocketAddr>, ListenError> {
    let Some(rest) = split(key, value, scheme)? else { return Ok(None) };
    let bad = |problem: String| ListenError::Address { key, value: value.to_owned(), problem };
    let addr = rest
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve the host: {e}")))?
        .next()
        .ok_or_else(|| bad("the host has no address".into()))?;
    Ok(Some(addr))
}

/// The checks of [`parse`] that need no name lookup: `None` for `off`, else the `HOST:PORT`
/// part of `value` (scheme and a trailing `/` taken off), with a host and a port from 0 to
/// 65535. The fuzz target `address` runs it on any text.
///
/// # Errors
/// [`ListenError::Address`], naming what is missing or wrong.
pub fn split<'v>(key: &'static str, value: &'v str, scheme: &str) -> Result<Option<&'v str>, ListenError> {
    let v = value.trim();
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = |problem: String| ListenError::Address { key, value: value.to_owned(), problem };
    let forms = format!("expected `{scheme}://HOST:PORT`, `HOST:PORT` or `off`");
    if v.is_empty() {
        // a template that expanded to nothing must not turn a server off without a word
        return Err(bad(format!("empty; {forms}")));
    }
    let rest = match v.split_once("://") {
        Some((s, rest)) if s.eq_ignore_ascii_case(scheme) => rest,
        Some((s, _)) => return Err(bad(format!("unsupported scheme {s:?}; {forms}"))),
        None => v,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err(bad(format!("a path is not allowed; {forms}")));
    }
    let Some((host, port)) = rest.rsplit_once(':') else {
        if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
            // a port alone: the host is what is missing
            return Err(bad(format!(
                "no host: {rest} is a port alone; write 127.0.0.1:{rest} (this machine only) or 0.0.0.0:{rest} \
                 (every address); {forms}"
            )));
        }
        return Err(bad(format!("no port: {rest} is a host alone; write {rest}:PORT; {forms}")));
    };
    if host.is_empty() {
        return Err(bad(format!("no host (use 0.0.0.0 for every address); {forms}")));
    }
    port.parse::<u16>().map_err(|_| bad(format!("port {port:?} is not a number from 0 to 65535")))?;
    Ok(Some(rest))
}

/// Bind `addr` (for `key` = `value` in messages).
///
/// # Errors
/// [`ListenError::Bind`].
pub fn bind(key: &'static str, value: &str, addr: SocketAddr) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr).map_err(|source| ListenError::Bind { key, value: value.to_owned(), addr, source })
}

/// The TCP listening sockets systemd handed over (`$LISTEN_FDS` for this process), with their
/// addresses; descriptors that are not TCP listeners are logged and closed. Call it once per
/// process: each descriptor is taken over by the returned listener.
pub fn inherited() -> Vec<(SocketAddr, TcpListener)> {
    let fds = match sd_notify::listen_fds() {
        Ok(fds) => fds,
        Err(e) => {
            log::warn!("socket activation: {e}; ignoring the passed sockets");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for fd in fds {
        // SAFETY: sd_listen_fds(3): the descriptors from SD_LISTEN_FDS_START on, as many as
        // $LISTEN_FDS says and meant for this process ($LISTEN_PID), are open and passed to it;
        // nothing else in herald takes them, and this function runs once, so each is owned
        // exactly once from here on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let listener = TcpListener::from(owned);
        match listener.local_addr() {
            Ok(addr) => out.push((addr, listener)),
            Err(e) => log::warn!("socket activation: descriptor {fd} is not a TCP socket ({e}); closed"),
        }
    }
    out
}

/// Take the inherited listener for `addr` out of `inherited` (same port, and the same IP
/// unless either is the unspecified address), else bind `addr`.
///
/// # Errors
/// [`ListenError::Bind`].
pub fn take_or_bind(
    inherited: &mut Vec<(SocketAddr, TcpListener)>,
    key: &'static str,
    value: &str,
    addr: SocketAddr,
) -> Result<(TcpListener, bool), ListenError> {
    let matches =
        |a: &SocketAddr| a.port() == addr.port() && (a.ip() == addr.ip() || a.ip().is_unspecified() || addr.ip().is_unspecified());
    if addr.port() != 0
        && let Some(i) = inherited.iter().position(|(a, _)| matches(a))
    {
        return Ok((inherited.swap_remove(i).1, true));
    }
    bind(key, value, addr).map(|l| (l, false))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn addresses_parse_or_say_what_is_wrong() {
        let a = parse("serve.wyoming", "tcp://127.0.0.1:10200", "tcp").unwrap().unwrap();
        assert_eq!(a, "127.0.0.1:10200".parse().unwrap());
        assert_eq!(parse("serve.http", "0.0.0.0:5000", "http").unwrap().unwrap(), "0.0.0.0:5000".parse().unwrap());
        assert_eq!(parse("serve.http", "http://[::1]:5000/", "http").unwrap().unwrap(), "[::1]:5000".parse().unwrap());
        assert!(parse("serve.http", "off", "http").unwrap().is_none());
        assert!(parse("serve.http", "OFF", "http").unwrap().is_none());
        assert!(parse("serve.http", " ", "http").unwrap_err().to_string().contains("empty"));
        for (v, what) in [
            ("udp://1.2.3.4:5", "scheme"),
            ("127.0.0.1", "no port"),
            ("18500", "no host: 18500 is a port alone; write 127.0.0.1:18500"),
            ("tcp://10200", "no host: 10200 is a port alone"),
            ("127.0.0.1:99999", "port"),
            (":5000", "no host"),
            ("tcp://h:1/x", "path"),
        ] {
            let e = parse("serve.wyoming", v, "tcp").unwrap_err().to_string();
            assert!(e.contains(what) && e.contains("serve.wyoming"), "{v}: {e}");
        }
    }

    #[test]
    fn an_inherited_listener_is_taken_by_its_port() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut inherited = vec![(addr, l)];
        let (got, was_inherited) = take_or_bind(&mut inherited, "serve.http", "x", addr).unwrap();
        assert!(was_inherited && inherited.is_empty());
        assert_eq!(got.local_addr().unwrap(), addr);
        // a busy port names the key
        let e = take_or_bind(&mut inherited, "serve.http", "x", addr).unwrap_err().to_string();
        assert!(e.contains("serve.http") && e.contains("cannot listen"), "{e}");
    }
}

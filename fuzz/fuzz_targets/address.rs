//! The listening-address parser of `serve.wyoming` / `serve.http` (`service::listen::split`,
//! the part of `listen::parse` that needs no name lookup): any text is an address, `off` or one
//! error naming the key; an address it accepts is `HOST:PORT` with a port from 0 to 65535, and
//! an IP literal among them parses as a socket address.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for (key, scheme) in [("serve.wyoming", "tcp"), ("serve.http", "http")] {
        match service::listen::split(key, text, scheme) {
            Ok(None) => assert!(text.trim().eq_ignore_ascii_case("off")),
            Ok(Some(rest)) => {
                let (host, port) = rest.rsplit_once(':').expect("an accepted address has a port");
                assert!(!host.is_empty(), "an accepted address has a host");
                assert!(port.parse::<u16>().is_ok());
                if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
                    let addr: std::net::SocketAddr = rest.parse().unwrap_or_else(|_| std::net::SocketAddr::new(ip, 0));
                    assert_eq!(addr.ip(), ip);
                }
            }
            Err(e) => assert!(e.to_string().starts_with(key), "{e}"),
        }
    }
});

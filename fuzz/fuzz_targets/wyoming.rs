//! Wyoming event framing (`service::wyoming`): the bytes a client may send, read as the server
//! reads them (limits, JSON header, data and payload parts); every event's fields checked as a
//! connection checks them, and every event encoded again reads back the same
//! (`service::wyoming::fuzz_events`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = service::wyoming::fuzz_events(data);
});

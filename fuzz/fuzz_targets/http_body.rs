//! HTTP request bodies (`service::http`): the first byte picks the route (`/v1/audio/speech`
//! or `/v1/say`), the rest is the body; parsed and checked as the server does, every refusal
//! an OpenAI-style JSON error (`service::http::fuzz_body`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [route, body @ ..] = data else { return };
    let path = if route & 1 == 0 { "/v1/audio/speech" } else { "/v1/say" };
    let _ = service::http::fuzz_body(path, body);
});

//! `bundle.toml`: a manifest that parses and validates must answer every question the engine,
//! `herald info` and `herald probe` ask of it without a panic or an overflow.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use model::footprint::{ModelFootprint, predictor_step_params, talker_step_params};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(m) = model::Manifest::parse(text, Path::new("bundle.toml")) else { return };
    let _ = m.files();
    let _ = (m.dtype(), m.weights(), m.tables_dtype());
    for name in m.graphs.keys() {
        let _ = m.graph_weights(name);
    }
    let _ = (talker_step_params(&m), predictor_step_params(&m));
    let _ = ModelFootprint::of(&m, 1 << 30);
});

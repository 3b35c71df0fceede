//! `herald devices`: the ALSA playback PCMs.

use std::io::Write;

use super::init_logging;
use crate::exit::{self, Failure, fail};

/// Run `herald devices`.
pub fn run() -> Result<(), Failure> {
    init_logging("warn");
    let devs = board::audio::list_playback_devices().map_err(|e| fail(exit::AUDIO, e))?;
    let mut o = std::io::stdout().lock();
    if !devs.iter().any(|d| d.name == "default") {
        // alsa-lib lists only PCMs with hints; `default` always exists unless redefined away
        let _ = writeln!(o, "{:<28} alsa-lib's default device", "default");
    }
    for d in devs {
        if writeln!(o, "{:<28} {}", d.name, d.description.replace('\n', " / ")).is_err() {
            break; // the reader went away (e.g. `| head`)
        }
    }
    Ok(())
}

//! `herald devices`: the ALSA playback PCMs, each marked with whether it can be opened now.

use std::io::Write;

use board::audio::Openable;

use super::init_logging;
use crate::exit::{self, Failure, fail};

/// Run `herald devices`: one line per PCM, `NAME  OPENS  DESCRIPTION`, where OPENS is `yes`
/// (it opened, and was closed at once: nothing is played), `busy` (another program holds it)
/// or `no` (it cannot be opened: `herald speak --device NAME` says why).
pub fn run() -> Result<(), Failure> {
    init_logging("warn");
    let devs = board::audio::list_playback_devices().map_err(|e| fail(exit::AUDIO, e))?;
    let mut o = std::io::stdout().lock();
    let mut lines = Vec::with_capacity(devs.len() + 1);
    if !devs.iter().any(|d| d.name == "default") {
        // alsa-lib lists only PCMs with hints; `default` always exists unless redefined away
        lines.push(("default".to_owned(), "alsa-lib's default device".to_owned()));
    }
    lines.extend(devs.into_iter().map(|d| (d.name, d.description.replace('\n', " / "))));
    let _ = writeln!(o, "{:<28} {:<5} DESCRIPTION", "PCM", "OPENS");
    for (name, description) in lines {
        let opens = match board::audio::openable(&name) {
            Openable::Yes => "yes",
            Openable::Busy => "busy",
            Openable::No => "no",
        };
        if writeln!(o, "{name:<28} {opens:<5} {description}").is_err() {
            break; // the reader went away (e.g. `| head`)
        }
    }
    Ok(())
}

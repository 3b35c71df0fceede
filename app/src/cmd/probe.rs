//! `herald probe`: this board's hardware profile, and what herald derives from it for the
//! configured bundle.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{init_logging, load_config};
use crate::config::{CliOverrides, Config};
use crate::exit::{self, Failure, fail};
use crate::tuning;

/// The flags of `herald probe`.
#[derive(clap::Args)]
pub struct ProbeArgs {
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    bundle: Option<PathBuf>,
}

/// Run `herald probe`.
pub fn run(config: Option<&Path>, a: ProbeArgs) -> Result<(), Failure> {
    let mut cfg = load_config(config)?;
    init_logging("warn");
    cfg.apply_cli(&CliOverrides { bundle: a.bundle, ..CliOverrides::default() }).map_err(|e| fail(exit::INPUT, e))?;
    print_probe(&cfg)
}

/// The profile, then what herald derives from it for the configured bundle.
fn print_probe(cfg: &Config) -> Result<(), Failure> {
    let p = board::probe::probe_system().map_err(|e| fail(exit::INPUT, e))?;
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{}", p.describe());
    let dir = &cfg.model.bundle;
    match engine::read_manifest(dir) {
        Ok(m) => {
            // A profile from HERALD_HW_PROFILE describes another board: show its own split, not
            // what this machine's CPU set would leave of it (speak pins within what it may use).
            let allowed: Vec<usize> = if p.source.starts_with("override:") {
                (0..p.n_logical.max(p.clusters.iter().flat_map(|c| c.cpus.iter().map(|&n| n + 1)).max().unwrap_or(1))).collect()
            } else {
                engine::placement::allowed_cpus().unwrap_or_default()
            };
            match tuning::tune_for(cfg, dir, &m, p.clone(), &allowed) {
                Ok(t) => {
                    let _ = writeln!(o, "bundle      {} ({} {}, {})", dir.display(), m.model.family, m.model.size, m.model.dtype);
                    for line in t.derived.describe().lines() {
                        let _ = writeln!(o, "derived     {line}");
                    }
                    for n in &t.derived.notes {
                        let _ = writeln!(o, "note        {n}");
                    }
                    match crate::backend::choose(cfg, &m, p.class) {
                        Ok(c) => {
                            let _ = writeln!(o, "backend     {}", c.why);
                        }
                        Err(e) => {
                            let _ = writeln!(o, "backend     refused: {:#}", e.err);
                        }
                    }
                    let _ = writeln!(o, "fingerprint {}", t.fingerprint);
                    let ramp = t.settings.ramp.clone().unwrap_or_default();
                    let cal = match &t.ramp_source {
                        tuning::RampSource::Configured => format!("not used: synthesis.ramp = {ramp:?} is set"),
                        tuning::RampSource::Calibrated(path) => format!("{} (ramp {ramp:?})", path.display()),
                        tuning::RampSource::Default(path) => {
                            format!("none yet ({}); default ramp {ramp:?}; run herald calibrate", path.display())
                        }
                        tuning::RampSource::Ignored(why) => format!("ignored: {why}"),
                    };
                    let _ = writeln!(o, "calibration {cal}");
                }
                Err(tuning::TuneError::DoesNotFit(e)) => {
                    let _ = writeln!(o, "derived     refused: {e}");
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(e) => {
            let (talker, vocoder) = p.thread_split();
            let _ = writeln!(o, "threads     talker stage on CPUs {talker:?}, vocoder stage on CPUs {vocoder:?}");
            let _ = writeln!(o, "bundle      none usable at {} ({e}); pass --bundle for memory and calibration", dir.display());
        }
    }
    let _ = writeln!(o, "{}", p.to_json());
    Ok(())
}

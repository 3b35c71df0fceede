//! `herald bundle install ARCHIVE | list | remove NAME | use NAME`: the bundles in
//! `model.bundles_dir`
//! ([`crate::bundles`]; docs/bundle.md, "Bundle archives").

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::bundles::{self, BundleError};
use crate::exit::{self, Failure, fail};

/// `herald bundle`'s arguments.
#[derive(Args, Debug)]
pub struct BundleArgs {
    #[command(subcommand)]
    cmd: BundleCommand,
}

#[derive(Subcommand, Debug)]
enum BundleCommand {
    /// Install a bundle archive (written by `tools/export/export pack`) into model.bundles_dir:
    /// every file checked against the archive's index (size, SHA-256) and the bundle against
    /// this herald, then moved into place whole; nothing is left behind on any error.
    Install {
        /// The archive file.
        archive: PathBuf,
    },
    /// List the bundles in model.bundles_dir (`*` marks model.bundle).
    List,
    /// Remove a bundle from model.bundles_dir (not the one model.bundle names).
    Remove {
        /// The bundle's name (its folder in model.bundles_dir).
        name: String,
    },
    /// Speak with an installed bundle: model.bundles_dir/default (the default model.bundle)
    /// becomes a link to it; a running `herald serve` loads it when restarted.
    Use {
        /// The bundle's name (its folder in model.bundles_dir).
        name: String,
    },
}

fn code(e: BundleError) -> Failure {
    let c = match e {
        BundleError::Archive { .. } | BundleError::Incompatible { .. } => exit::BUNDLE,
        _ => exit::INPUT,
    };
    fail(c, e)
}

/// Run `herald bundle`.
///
/// # Errors
/// A [`Failure`]: 4 for an archive refused (damaged, cut short, not a bundle archive, a bundle
/// this herald cannot load), 2 for the rest (a missing archive, a name installed already or not
/// installed, the bundle in use, a write that failed).
pub fn run(config: Option<&std::path::Path>, args: BundleArgs) -> Result<(), Failure> {
    let cfg = super::load_config(config)?;
    super::init_logging_from(&cfg);
    let dir = &cfg.model.bundles_dir;
    match args.cmd {
        BundleCommand::Install { archive } => {
            let mut next_tenth = 1u64;
            let done = bundles::install(&archive, dir, |done, total| {
                // a log line per 10 %
                while total > 0 && done * 10 >= next_tenth * total && next_tenth <= 10 {
                    log::info!("{}: {} % ({done} of {total} bytes)", archive.display(), next_tenth * 10);
                    next_tenth += 1;
                }
            })
            .map_err(code)?;
            println!(
                "installed {} ({}; {} files, {:.1} MB, fingerprint {}) in {}",
                done.name,
                done.model,
                done.files,
                done.bytes as f64 / 1e6,
                &done.fingerprint[..16],
                done.dir.display()
            );
            if cfg.model.bundle != done.dir {
                println!("speak with it: herald speak --bundle {} \"Hello\" (or set model.bundle to it)", done.dir.display());
            }
        }
        BundleCommand::List => {
            let all = bundles::list(dir).map_err(code)?;
            if all.is_empty() {
                println!("no bundles in {} (herald bundle install ARCHIVE adds one)", dir.display());
            }
            let configured = cfg.model.bundle.canonicalize().ok();
            for b in all {
                let mark = if b.dir.canonicalize().ok().is_some_and(|d| Some(d) == configured) { "*" } else { " " };
                println!("{mark} {:<32} {:<28} {:>9.1} MB", b.name, b.model, b.bytes as f64 / 1e6);
            }
        }
        BundleCommand::Remove { name } => {
            let gone = bundles::remove(dir, &name, &cfg.model.bundle).map_err(code)?;
            println!("removed {}", gone.display());
        }
        BundleCommand::Use { name } => {
            let chosen = bundles::use_bundle(dir, &name).map_err(code)?;
            let link = dir.join(bundles::DEFAULT_LINK);
            println!("{} now links to {} (restart herald serve to load it)", link.display(), chosen.display());
            if cfg.model.bundle != link {
                println!(
                    "note: model.bundle is {}, not {}: herald speaks with {name} once model.bundle names that link (it does by \
                     default, when model.bundles_dir is the default too)",
                    cfg.model.bundle.display(),
                    link.display()
                );
            }
        }
    }
    Ok(())
}

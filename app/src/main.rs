//! `herald`: the appliance binary. Command line, configuration and wiring; the model work is in
//! the engine crate, the device work in the board crate.
//!
//! Exit codes: 0 ok, 2 bad input or config, 3 audio device, 4 model/bundle.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use engine::Manifest;

/// Exit code for a bad or missing model bundle.
const EXIT_BUNDLE: u8 = 4;

#[derive(Parser)]
#[command(name = "herald", version, about = "On-device Qwen3-TTS for speaking appliances")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a bundle's model facts, graphs, speakers and languages, and a memory estimate.
    Info {
        /// Bundle directory (holds bundle.toml).
        #[arg(long)]
        bundle: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Info { bundle } => match Manifest::load(&bundle) {
            Ok(m) => {
                print_info(&bundle, &m);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: bundle {}: {e}", bundle.display());
                ExitCode::from(EXIT_BUNDLE)
            }
        },
    }
}

fn print_info(dir: &std::path::Path, m: &Manifest) {
    println!("bundle      {}", dir.display());
    println!("model       {} {} {} ({}), from {}", m.model.family, m.model.size, m.model.kind, m.model.dtype, m.model.source);
    println!(
        "audio       {} Hz, {} samples/frame ({} frames/s), {} codebooks x {}",
        m.audio.sample_rate,
        m.audio.samples_per_frame,
        m.frame_rate(),
        m.audio.num_codebooks,
        m.audio.codebook_size
    );
    for (name, s) in [("talker", &m.talker), ("predictor", &m.code_predictor)] {
        let sliding = s.cache.iter().filter(|c| matches!(c, engine::manifest::CacheKind::Sliding { .. })).count();
        println!(
            "{name:<11} {} layers ({} sliding), hidden {}, {} q / {} kv heads x {}",
            s.layers, sliding, s.hidden, s.heads, s.kv_heads, s.head_dim
        );
    }
    let names = |map: &std::collections::BTreeMap<String, u32>| {
        if map.is_empty() { "(none)".to_string() } else { map.keys().cloned().collect::<Vec<_>>().join(", ") }
    };
    println!("languages   auto, {}", names(&m.languages));
    println!("speakers    {}", names(&m.speakers));
    let mut total = 0u64;
    for (name, g) in &m.graphs {
        let size = std::fs::metadata(dir.join(&g.file)).map(|md| md.len()).unwrap_or(0);
        total += size;
        println!("graph       {name:<15} {:>9.1} MB  {} inputs, {} outputs", size as f64 / 1e6, g.inputs.len(), g.outputs.len());
    }
    let tables = std::fs::metadata(dir.join(&m.tables.file)).map(|md| md.len()).unwrap_or(0);
    // KV cache per talker position: 2 (K and V) x kv_heads x head_dim x bytes, for full layers.
    let bytes = if m.model.dtype == "fp16" { 2 } else { 4 };
    let full_layers = m.talker.cache.iter().filter(|c| matches!(c, engine::manifest::CacheKind::Full)).count() as u64;
    let kv_per_pos = 2 * full_layers * u64::from(m.talker.kv_heads) * u64::from(m.talker.head_dim) * bytes;
    println!("tables      {:>9.1} MB (memory-mapped; only the rows a prompt uses become resident)", tables as f64 / 1e6);
    println!(
        "memory      ~{:.1} MB of graph weights + {:.1} KiB KV cache per talker position",
        total as f64 / 1e6,
        kv_per_pos as f64 / 1024.0
    );
}

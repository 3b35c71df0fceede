//! `herald info`: a bundle's model facts, graphs, speakers, voice aliases and languages, and a
//! memory estimate.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{init_logging_from, load_config};
use crate::exit::{self, Failure, fail};

/// The flags of `herald info`.
#[derive(clap::Args)]
pub struct InfoArgs {
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    bundle: Option<PathBuf>,
    /// Check the SHA-256 of the tokenizer and every graph against bundle.toml first (exit 4,
    /// naming the file, when one differs).
    #[arg(long)]
    verify: bool,
}

/// Run `herald info`.
pub fn run(config: Option<&Path>, a: InfoArgs) -> Result<(), Failure> {
    let cfg = load_config(config)?;
    init_logging_from(&cfg);
    let dir = a.bundle.unwrap_or_else(|| cfg.model.bundle.clone());
    let m = engine::read_manifest(&dir)
        .map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    if a.verify {
        let files = verify(&dir, &m)?;
        let bytes: u64 = files.iter().map(|f| f.bytes).sum();
        println!(
            "verified    {} files, {:.1} MB: SHA-256 as in bundle.toml, and the tables' header, shapes and length",
            files.len(),
            bytes as f64 / 1e6
        );
    }
    // the configuration's aliases with this bundle: listed, or what is wrong with them
    let aliases = match crate::speaker::aliases(&cfg, &service::front::catalog(&m).0) {
        Ok(a) if a.is_empty() => "(none)".to_owned(),
        Ok(a) => {
            a.iter().map(|a| format!("{} → {}", a.name, a.speaker.as_deref().unwrap_or("default"))).collect::<Vec<_>>().join(", ")
        }
        Err(e) => format!("(not usable: {e})"),
    };
    match print_info(&dir, &m, &aliases) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(fail(exit::BUG, e)),
        _ => Ok(()),
    }
}

/// Check the bundle's checksums and tables ([`engine::verify`]), logging the time it took.
///
/// # Errors
/// Exit 4 naming the file that cannot be read, whose SHA-256 differs, or the tables cut short.
pub fn verify(dir: &Path, m: &engine::Manifest) -> Result<Vec<engine::Verified>, Failure> {
    let t0 = std::time::Instant::now();
    let files =
        engine::verify(dir, m).map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", dir.display()))))?;
    log::info!("bundle {}: {} files verified ({:.2} s)", dir.display(), files.len(), t0.elapsed().as_secs_f64());
    Ok(files)
}

fn print_info(dir: &Path, m: &engine::Manifest, aliases: &str) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    writeln!(o, "bundle      {}", dir.display())?;
    writeln!(
        o,
        "model       {} {} {} ({} weights, {} activations and caches), from {}",
        m.model.family,
        m.model.size,
        m.model.kind,
        m.weights(),
        m.model.dtype,
        m.model.source
    )?;
    if let Some(q) = &m.quantization {
        let g = &q.gate;
        writeln!(o, "quantized   {}: {}; float: {}", q.format, q.scheme, q.float_weights.join(", "))?;
        if m.int8_activations() {
            writeln!(o, "activations int8 per block of 32 in the {} products (as the gate measured them)", q.format)?;
        }
        writeln!(
            o,
            "fidelity    gate {} at export against float32: talker logits SNR {:.1} dB, top-1 {:.1} %; predictor {:.1} dB, {:.1} % ({} teacher-forced positions); free-running greedy codes first differ after {} frames (fewest over {} texts of {} frames)",
            if g.passed { "passed" } else { "FAILED (exported with --allow-lossy)" },
            g.talker_logits_snr_db,
            100.0 * g.talker_top1,
            g.code_predictor_logits_snr_db,
            100.0 * g.code_predictor_top1,
            g.positions,
            g.free_running_agree_min,
            g.free_running_texts,
            g.free_running_frames
        )?;
    }
    writeln!(
        o,
        "audio       {} Hz, {} samples/frame ({} frames/s), {} codebooks x {}",
        m.audio.sample_rate,
        m.audio.samples_per_frame,
        m.frame_rate(),
        m.audio.num_codebooks,
        m.audio.codebook_size
    )?;
    for (name, s) in [("talker", &m.talker), ("predictor", &m.code_predictor)] {
        let sliding = s.cache.iter().filter(|c| matches!(c, engine::manifest::CacheKind::Sliding { .. })).count();
        writeln!(
            o,
            "{name:<11} {} layers ({} sliding), hidden {}, {} q / {} kv heads x {}",
            s.layers, sliding, s.hidden, s.heads, s.kv_heads, s.head_dim
        )?;
    }
    let names = |map: &std::collections::BTreeMap<String, u32>| {
        if map.is_empty() { "(none)".to_string() } else { map.keys().cloned().collect::<Vec<_>>().join(", ") }
    };
    writeln!(o, "languages   auto, {}", names(&m.languages))?;
    writeln!(o, "speakers    {}", names(&m.speakers))?;
    writeln!(o, "aliases     {aliases}")?;
    let mut total = 0u64;
    for (name, g) in &m.graphs {
        // the weights' bytes as the exporter counted them; older bundles: the file and its
        // external data on disk
        let size = g.weight_bytes.unwrap_or_else(|| {
            let len = |f: &str| std::fs::metadata(dir.join(f)).map(|md| md.len()).unwrap_or(0);
            len(&g.file) + len(&format!("{}.data", g.file))
        });
        total += size;
        writeln!(
            o,
            "graph       {name:<15} {:<4} {:>9.1} MB of weights  {} inputs, {} outputs",
            m.graph_weights(name).as_str(),
            size as f64 / 1e6,
            g.inputs.len(),
            g.outputs.len()
        )?;
    }
    if let Some(q) = &m.qnn {
        for arch in m.qnn_arches() {
            let tiers = |stack: &str| {
                let bins: Vec<_> = q.binaries.iter().filter(|b| b.arch == arch && b.stack == stack).collect();
                let bytes: u64 = bins.iter().map(|b| std::fs::metadata(dir.join(&b.file)).map(|md| md.len()).unwrap_or(0)).sum();
                if stack == "vocoder" {
                    let frames: Vec<String> = bins.iter().map(|b| b.frames.to_string()).collect();
                    return format!(", vocoder {} frames per run ({:.1} MB)", frames.join("/"), bytes as f64 / 1e6);
                }
                let slots: Vec<String> = bins.iter().map(|b| b.slots.to_string()).collect();
                format!("{stack} {} slots ({:.1} MB)", slots.join("/"), bytes as f64 / 1e6)
            };
            let vocoder =
                if q.binaries.iter().any(|b| b.arch == arch && b.stack == "vocoder") { tiers("vocoder") } else { String::new() };
            let precision = q.binaries.iter().find(|b| b.arch == arch).map_or("", |b| b.precision.as_str());
            writeln!(
                o,
                "qnn         {arch} {precision} context binaries: {}, {}{vocoder} (QAIRT {}, {})",
                tiers("talker"),
                tiers("code_predictor"),
                q.sdk,
                q.compiler
            )?;
        }
    }
    let tables = std::fs::metadata(dir.join(&m.tables.file)).map(|md| md.len()).unwrap_or(0);
    let kv_per_pos = model::footprint::kv_bytes_per_position(&m.talker, m.dtype());
    writeln!(o, "tables      {:>9.1} MB (memory-mapped; only the rows a prompt uses become resident)", tables as f64 / 1e6)?;
    writeln!(
        o,
        "memory      ~{:.1} MB of graph weights + {:.1} KiB KV cache per talker position",
        total as f64 / 1e6,
        kv_per_pos as f64 / 1024.0
    )?;
    Ok(())
}

//! `herald bench`: the measuring instrument of docs/performance.md.
//!
//! The measuring code is `engine::bench`; this command adds what needs the process: a counter of
//! the calls that reach the system allocator (one relaxed atomic increment per heap allocation,
//! always on: cheap next to the allocation itself; it sits under the frame pools, see
//! `engine::pool` and `main.rs`) for heap allocations per frame, and the peak resident set (`VmHWM` of
//! `/proc/self/status`). Results go to standard output as markdown, and optionally to a JSON
//! and a markdown file (each written atomically, [`service::write_atomic`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ::bench::{BenchConfig, BenchResult};
use anyhow::Context;
use clap::Args;

use super::init_logging;
use crate::exit::{self, Failure, fail};

/// The system allocator, counting the allocations and reallocations that reach it (all
/// threads). Wrapped by the process's global allocator, `engine::pool::Pooled` (`main.rs`).
pub struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call unchanged to the system allocator; the counter has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Heap allocations (and reallocations) since the process started, all threads; blocks the
/// frame pools serve are not counted.
fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Flags of `herald bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Bundle directory (e.g. build/bundles/qwen3-tts-0.6b-fp32).
    #[arg(long, value_name = "DIR")]
    pub bundle: PathBuf,
    /// Compute threads of the main measurements (default: the number of CPUs).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Thread sweep up to this count (default: the number of CPUs; 0: no sweep).
    #[arg(long, value_name = "N")]
    pub sweep: Option<usize>,
    /// Talker past lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 512])]
    pub past: Vec<usize>,
    /// Timed steps per measurement (talker steps, predictor sub-steps); at least 1.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Timed vocoder windows (each is a whole 72 + 25-frame window: expensive at full size).
    #[arg(long, default_value_t = 3)]
    pub vocoder_steps: usize,
    /// Pipeline frames (forced: random weights never sample eos). The default reaches three
    /// steady vocoder windows (72 frames of context + 25) after the ramp.
    #[arg(long, default_value_t = 155)]
    pub frames: usize,
    /// Bandwidth buffer MiB.
    #[arg(long, default_value_t = 256)]
    pub bandwidth_mib: usize,
    /// Only the step latencies and the bandwidth (no load time, pipeline or sweep): what
    /// tools/bench/ort_compare.py runs between onnxruntime rounds.
    #[arg(long)]
    pub steps_only: bool,
    /// Cap of each worker stage's frame pool in MiB, as `runtime.frame_pool_mib` sets it for
    /// speak and serve (0: no pooling, to compare heap allocations, peak RSS and times).
    #[arg(long, default_value_t = (engine::DEFAULT_POOL_BYTES >> 20) as u64, value_name = "MIB",
          value_parser = clap::value_parser!(u64).range(0..=65536))]
    pub frame_pool_mib: u64,
    /// Vocoder form to measure: `stateful` (the stream graph, one chunk) or `windowed` (the
    /// windowed graph, left context + chunk). Default: the bundle's (stateful when it has a
    /// stream graph).
    #[arg(long, value_name = "FORM", value_parser = ["stateful", "windowed"])]
    pub vocoder: Option<String>,
    /// The stateful vocoder's precision, as `runtime.vocoder_precision`: `fp32`, `fp16` (its
    /// gate runs at load: the SNR is logged at info level, `RUST_LOG=info`; below 30 dB the
    /// bench stops) or `auto`.
    #[arg(long, value_name = "PRECISION", default_value = "fp32", value_parser = ["fp32", "fp16", "auto"])]
    pub vocoder_precision: String,
    /// Instead of the benchmark, profile one stage per op type: `vocoder` times every node of
    /// the vocoder graph over `--profile-frames` frames (windowed: one single pass; stateful:
    /// one chunk from the zero state), folded onto ONNX op types (docs/performance.md "Vocoder (issue
    /// 13)"); `talker` and `code-predictor` time one-position steps of that graph (the first
    /// `--past` length of filled cache; `--steps` runs).
    #[arg(long, value_name = "STAGE", value_parser = ["vocoder", "talker", "code-predictor"])]
    pub profile: Option<String>,
    /// Frames of the profiled vocoder pass (1 to 1000).
    #[arg(long, default_value_t = 25, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub profile_frames: u64,
    /// Profile a plan optimized for exactly `--profile-frames` frames (concrete shapes) rather
    /// than the graph's symbolic length.
    #[arg(long)]
    pub profile_concrete: bool,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the markdown tables to FILE.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
}

/// Peak resident set of this process in bytes (`VmHWM`), None where /proc is unavailable.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Write `data` to `path` atomically.
fn write_atomic(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    service::write_atomic(path, data).with_context(|| format!("{}: cannot write", path.display()))
}

/// Validate the flags into a [`BenchConfig`].
///
/// # Errors
/// A message naming the bad flag.
pub fn config(a: &BenchArgs) -> anyhow::Result<BenchConfig> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or(cpus);
    if threads == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    if a.steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    if a.past.is_empty() {
        anyhow::bail!("--past needs at least one length");
    }
    if a.bandwidth_mib == 0 {
        anyhow::bail!("--bandwidth-mib must be at least 1");
    }
    if a.profile.is_none() && (a.profile_concrete || a.profile_frames != 25) {
        anyhow::bail!("--profile-frames and --profile-concrete need --profile vocoder");
    }
    if a.profile.as_deref().is_some_and(|p| p != "vocoder") && (a.profile_concrete || a.profile_frames != 25) {
        anyhow::bail!("--profile-frames and --profile-concrete apply to --profile vocoder only");
    }
    let sweep_to = if a.steps_only { 0 } else { a.sweep.unwrap_or(cpus) };
    Ok(BenchConfig {
        threads,
        sweep: (1..=sweep_to).collect(),
        pasts: a.past.clone(),
        warmup: a.warmup,
        steps: a.steps,
        vocoder_steps: a.vocoder_steps.max(1),
        bandwidth_bytes: a.bandwidth_mib << 20,
        frames: a.frames.max(1),
        steps_only: a.steps_only,
        pool_bytes: usize::try_from(a.frame_pool_mib << 20).unwrap_or(usize::MAX),
        vocoder: a.vocoder.as_deref().and_then(model::backend::VocoderForm::parse),
        vocoder_precision: match a.vocoder_precision.as_str() {
            "fp16" => backend_tract::VocoderPrecision::Fp16,
            "auto" => backend_tract::VocoderPrecision::Auto,
            _ => backend_tract::VocoderPrecision::Fp32,
        },
        ..BenchConfig::default()
    })
}

/// Run `herald bench`: an engine error exits with its code, anything else as bad input.
pub fn run(a: BenchArgs) -> Result<(), Failure> {
    init_logging(std::env::var("RUST_LOG").as_deref().unwrap_or("warn"));
    let result = if a.profile.is_some() { profile(&a) } else { bench(&a).map(|_| ()) };
    result.map_err(|e| {
        let code = e.downcast_ref::<engine::EngineError>().map_or(exit::INPUT, exit::engine_code);
        fail(code, e)
    })
}

/// Run the benchmark and write its outputs.
///
/// # Errors
/// Engine errors (as [`engine::EngineError`] inside the anyhow chain) and output errors.
pub fn bench(a: &BenchArgs) -> anyhow::Result<BenchResult> {
    let cfg = config(a)?;
    let counter: &dyn Fn() -> u64 = &allocations;
    let mut r = ::bench::run(&a.bundle, &cfg, Some(counter))?;
    r.peak_rss_bytes = peak_rss();
    let md = r.to_markdown();
    if let Some(p) = &a.json {
        let json = serde_json::to_vec_pretty(&r).context("serializing the results")?;
        write_atomic(p, &json)?;
    }
    if let Some(p) = &a.markdown {
        write_atomic(p, md.as_bytes())?;
    }
    let _ = std::io::stdout().lock().write_all(md.as_bytes());
    Ok(r)
}

/// `herald bench --profile vocoder`: the vocoder's time per op type, as markdown (and JSON).
///
/// # Errors
/// Bundle, graph and output errors.
pub fn profile(a: &BenchArgs) -> anyhow::Result<()> {
    let cfg = config(a)?;
    backend_tract::set_compute_threads(cfg.threads);
    let in_bundle = || format!("bundle {}", a.bundle.display());
    let manifest = engine::bundle::read_manifest(&a.bundle).map_err(engine::EngineError::from).with_context(in_bundle)?;
    if let Some(stage @ ("talker" | "code-predictor")) = a.profile.as_deref() {
        let past = a.past.first().copied().unwrap_or(64);
        let runs = a.steps.max(1);
        let profiled = backend_tract::profile::profile_step(&a.bundle, &manifest, stage == "code-predictor", past, runs);
        let (ops, total) = profiled.map_err(engine::EngineError::from).with_context(in_bundle)?;
        let title = format!(
            "{stage} step profile (herald's tract): one position over {past} filled cache positions, bundle `{}` ({} weights), {} compute thread(s), median of {runs} run(s): {total:.2} ms.",
            a.bundle.display(),
            manifest.weights(),
            cfg.threads
        );
        return write_profile(
            a,
            &title,
            &ops,
            serde_json::json!({"stage": stage, "past": past, "threads": cfg.threads, "runs": runs, "total_ms": total}),
        );
    }
    let form = cfg.vocoder.unwrap_or_else(|| manifest.default_vocoder_form());
    if manifest.vocoder_graph(form).is_none() {
        return Err(anyhow::Error::new(engine::EngineError::Config(format!(
            "--vocoder {form}, but {} has no stream graph ([vocoder].stream_graph)",
            a.bundle.join("bundle.toml").display()
        ))));
    }
    let frames = usize::try_from(a.profile_frames).unwrap_or(25);
    let runs = a.vocoder_steps.max(1);
    // under a frame pool, as the engine's vocoder thread runs (without one, every large block
    // tract asks for is a fresh mapping whose page faults land on the op that writes it first)
    let pool = engine::pool::FramePool::new(cfg.pool_bytes);
    let guard = pool.install().context("installing the frame pool")?;
    let profiled = backend_tract::profile::profile_vocoder(&a.bundle, &manifest, form, frames, runs, a.profile_concrete);
    drop(guard);
    let (ops, total) = profiled.map_err(engine::EngineError::from).with_context(in_bundle)?;
    let what = match form {
        model::backend::VocoderForm::Windowed => format!("one single pass of {frames} frames"),
        model::backend::VocoderForm::Stateful => format!("one stateful chunk of {frames} frames"),
    };
    let title = format!(
        "Vocoder profile (herald's tract): {what}, bundle `{}`, {} compute thread(s), median of {runs} run(s): {total:.1} ms ({:.1} ms per frame).",
        a.bundle.display(),
        cfg.threads,
        total / frames as f64
    );
    let json = serde_json::json!({
        "bundle": a.bundle, "form": form.name(), "frames": frames, "threads": cfg.threads, "runs": runs,
        "total_ms": total,
    });
    write_profile(a, &title, &ops, json)
}

/// Print a profile as markdown (title, then one row per op type) and write `--json` (`json`
/// plus the ops) and `--markdown`.
fn write_profile(
    a: &BenchArgs,
    title: &str,
    ops: &[backend_tract::profile::OpTime],
    mut json: serde_json::Value,
) -> anyhow::Result<()> {
    let mut md = format!("{title}\n\n| op type | tract ops (ms) | nodes | ms | share |\n|---|---|---|---|---|\n");
    let sum: f64 = ops.iter().map(|o| o.ms).sum::<f64>().max(f64::MIN_POSITIVE);
    for o in ops {
        let parts: Vec<String> =
            o.tract_ops.iter().filter(|(_, ms)| *ms >= 0.05).map(|(name, ms)| format!("{name} {ms:.1}")).collect();
        md.push_str(&format!("| {} | {} | {} | {:.1} | {:.1} % |\n", o.op, parts.join(", "), o.nodes, o.ms, 100.0 * o.ms / sum));
    }
    if let Some(p) = &a.json {
        json["bundle"] = serde_json::json!(a.bundle);
        json["ops"] = serde_json::to_value(ops).context("serializing the profile")?;
        write_atomic(p, &serde_json::to_vec_pretty(&json).context("serializing the profile")?)?;
    }
    if let Some(p) = &a.markdown {
        write_atomic(p, md.as_bytes())?;
    }
    let _ = std::io::stdout().lock().write_all(md.as_bytes());
    Ok(())
}

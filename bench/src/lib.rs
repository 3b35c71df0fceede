//! Benchmarks: step latencies against the memory-bandwidth floor, and the whole pipeline.
//!
//! Decode at batch 1 reads every weight of a step once, so a step cannot be faster than
//! `bytes read / memory bandwidth` (shared/reference/qwen3-tts.md §8). This module measures the
//! three step graphs on their own (talker decode step at a given past length, one
//! code-predictor sub-step, one vocoder chunk), the bandwidth of this machine in the same run,
//! and the threaded pipeline ([`engine::Engine::synthesize`]) on a fixed text. Pure compute: the
//! caller supplies what needs the OS (the allocation counter, peak RSS).
//!
//! Definitions (also in docs/performance.md):
//! - **step latency**: median wall time of `steps` timed steps after `warmup` untimed ones.
//! - **past length P**: the talker cache holds P positions (filled by one prefill of P random
//!   embedding rows) before the warm-up; step i then runs at position P + warmup + i, over the
//!   cache's slot count (the next power of two ≥ the positions, [`model::kv::MIN_SLOTS`]).
//! - **bytes read** by a step: its weights (every linear layer and norm of the stack plus the
//!   one head it uses; embeddings are host-side lookups) plus the K/V of every slot it attends
//!   over, at the bundle dtype's width.
//! - **bandwidth**: STREAM "copy" convention, 2 × buffer bytes / time of a `memcpy` of a
//!   buffer of at least 256 MiB, split over the step's thread count, median of several runs.
//! - **floor** = bytes read / bandwidth; **floor fraction** = floor / measured latency (1.0
//!   means the step runs at the speed of memory).
//! - **playback stall**: [`model::metrics`]: chunk i arrives at t_i after C_i seconds of earlier
//!   audio; a player that starts at the first chunk (TTFA = t_0) and waits whenever it runs dry
//!   waits `max_i(t_i - C_i) - t_0` seconds in total (0: gapless).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::Serialize;

use backend_tract::{TractWith, set_compute_threads};
use engine::decoder::Decoder;
use engine::tables::Embedding;
use engine::vocoder::Vocoder;
use engine::{Bundle, DEFAULT_POOL_BYTES, Engine, EngineError, EngineSettings, Request};
use model::PlaybackMetrics;
use model::backend::{StackRole, StepSpec};
use model::footprint::{kv_read_bytes, predictor_step_params, talker_step_params};
use model::frame::{CODEBOOKS, Frame};
use model::manifest::{Manifest, StackInfo};
use model::stats::median;

/// Summary of repeated timings, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Timed repetitions.
    pub count: usize,
    /// Median (the reported figure).
    pub median_ms: f64,
    /// Fastest repetition.
    pub min_ms: f64,
    /// 90th percentile (nearest rank).
    pub p90_ms: f64,
}

impl Timing {
    /// Summarize durations in seconds. Empty input gives zeros.
    pub fn from_seconds(samples: &[f64]) -> Self {
        let mut v: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
        let n = v.len();
        if n == 0 {
            return Timing { count: 0, median_ms: 0.0, min_ms: 0.0, p90_ms: 0.0 };
        }
        let med = median(&mut v); // sorts v
        let rank = ((0.9 * n as f64).ceil() as usize).clamp(1, n);
        Timing { count: n, median_ms: med, min_ms: v[0], p90_ms: v[rank - 1] }
    }
}

/// Measured memory bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct Bandwidth {
    /// Bytes of each of the two buffers.
    pub buffer_bytes: usize,
    /// Threads the copy was split over.
    pub threads: usize,
    /// Median over the runs, GB/s (1e9 bytes), counting 2 × buffer bytes per copy.
    pub gb_per_s: f64,
    /// Best run, GB/s.
    pub best_gb_per_s: f64,
    /// Timed runs (after one untimed).
    pub runs: usize,
}

/// Measure copy bandwidth: `runs` copies of a `bytes` buffer split over `threads` threads.
pub fn measure_bandwidth(bytes: usize, threads: usize, runs: usize) -> Bandwidth {
    let threads = threads.max(1);
    let n = (bytes / 8).max(threads);
    // touched by the initialisation, so the pages exist before timing
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![0u64; n];
    let per = n.div_ceil(threads);
    let mut rates = Vec::with_capacity(runs);
    for r in 0..=runs {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (d, sc) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(sc));
            }
        });
        let dt = t0.elapsed().as_secs_f64();
        if r > 0 {
            rates.push(2.0 * (n * 8) as f64 / dt / 1e9);
        }
    }
    std::hint::black_box(&dst);
    let med = median(&mut rates); // sorts rates
    Bandwidth { buffer_bytes: n * 8, threads, gb_per_s: med, best_gb_per_s: rates.last().copied().unwrap_or(0.0), runs }
}

/// Weight bytes of `params` parameters stored in the bundle's weight format
/// ([`model::dtype::WeightFormat::bytes_per_weight`]: 4, 2, 1 or 18/32 for q4). Norm weights,
/// which stay float, are counted at the quantized rate too: under 0.1 % of a stack.
fn weight_bytes(m: &Manifest, params: u64) -> usize {
    (params as f64 * m.weights().bytes_per_weight()).round() as usize
}

/// Weight bytes one code-predictor sub-step reads: the stack and projection in the weight
/// format, the selected `lm_head` in the model dtype (quantized bundles keep the stacked heads
/// in float: `[quantization].float_weights`).
fn predictor_weight_bytes(m: &Manifest) -> usize {
    let head = u64::from(m.audio.codebook_size) * u64::from(m.code_predictor.hidden);
    if m.weights().is_quantized() {
        weight_bytes(m, predictor_step_params(m) - head) + (head * m.dtype().bytes()) as usize
    } else {
        weight_bytes(m, predictor_step_params(m))
    }
}

/// K/V bytes a step of `s` reads over `slots` full-cache slots ([`kv_read_bytes`]).
fn kv_bytes(m: &Manifest, s: &StackInfo, slots: usize) -> usize {
    kv_read_bytes(s, m.dtype(), slots as u64) as usize
}

/// One step graph's latency against its bandwidth floor.
#[derive(Debug, Clone, Serialize)]
pub struct StepResult {
    /// `talker`, `code_predictor` or `vocoder`.
    pub graph: String,
    /// Cache positions filled before the warm-up (talker: P, so timed step i runs at position
    /// P + warm-up + i; predictor: 8, the middle of its sub-steps' positions 2..15; vocoder: the
    /// window's left-context frames).
    pub past: usize,
    /// Full-cache slots the step attends over (vocoder: window frames).
    pub slots: usize,
    /// Latency.
    pub timing: Timing,
    /// Weight bytes the step reads (0 for the vocoder: compute-bound, no floor).
    pub weight_bytes: usize,
    /// K/V bytes the step reads.
    pub kv_bytes: usize,
    /// (weight + kv bytes) / bandwidth, ms; 0 when not applicable.
    pub floor_ms: f64,
    /// floor / median latency; 0 when not applicable.
    pub floor_fraction: f64,
}

impl StepResult {
    fn with_floor(mut self, bw: &Bandwidth) -> Self {
        let bytes = (self.weight_bytes + self.kv_bytes) as f64;
        if bytes > 0.0 && bw.gb_per_s > 0.0 {
            self.floor_ms = bytes / (bw.gb_per_s * 1e9) * 1e3;
            if self.timing.median_ms > 0.0 {
                self.floor_fraction = self.floor_ms / self.timing.median_ms;
            }
        }
        self
    }
}

/// Deterministic input rows: codec-embedding rows of varying ids (realistic magnitudes).
fn rows(b: &Bundle, n: usize, salt: u32) -> Result<Vec<f32>, EngineError> {
    let h = b.manifest.talker.hidden as usize;
    let mut x = vec![0.0f32; n * h];
    for (r, row) in x.chunks_mut(h).enumerate() {
        let id = (r as u32).wrapping_mul(2_654_435_761).wrapping_add(salt) % 2048;
        b.tables.add(Embedding::Codec(id), row).map_err(|e| EngineError::Bundle(e.to_string()))?;
    }
    Ok(x)
}

/// Talker decode-step latency with `past` positions in the cache.
///
/// # Errors
/// Step errors ([`EngineError::Step`]), e.g. `past` beyond the talker's positions.
pub fn talker_step(b: &Bundle, past: usize, warmup: usize, steps: usize) -> Result<StepResult, EngineError> {
    let m = &b.manifest;
    let h = m.talker.hidden as usize;
    let cap = (past + warmup + steps + 1).next_power_of_two();
    let mut st = b.graphs.step_session(&StepSpec { role: StackRole::Talker, capacity: cap, max_seq: past.max(1), hidden_in: h })?;
    if past > 0 {
        let x = rows(b, past, 1)?;
        st.step(&x, past, None)?;
    }
    let x = rows(b, warmup + steps, 2)?;
    let mut t = Vec::with_capacity(steps);
    let mut slots = 0;
    for (i, row) in x.chunks(h).enumerate() {
        let t0 = Instant::now();
        st.step(row, 1, None)?;
        let dt = t0.elapsed().as_secs_f64();
        if i >= warmup {
            t.push(dt);
            slots = slots.max(st.last_stats().slots);
        }
    }
    Ok(StepResult {
        graph: "talker".into(),
        past,
        slots,
        timing: Timing::from_seconds(&t),
        weight_bytes: weight_bytes(m, talker_step_params(m)),
        kv_bytes: kv_bytes(m, &m.talker, slots),
        floor_ms: 0.0,
        floor_fraction: 0.0,
    })
}

/// Code-predictor sub-step latency: frames of a 2-position prefill then 14 one-position steps
/// (heads 1..14), as the decoder runs them; the one-position steps are timed.
///
/// # Errors
/// Step errors.
pub fn predictor_step(b: &Bundle, warmup: usize, steps: usize) -> Result<(StepResult, Timing), EngineError> {
    let m = &b.manifest;
    let h = m.talker.hidden as usize;
    let mut st = b.graphs.step_session(&StepSpec { role: StackRole::CodePredictor, capacity: CODEBOOKS, max_seq: 2, hidden_in: h })?;
    let x = rows(b, CODEBOOKS, 3)?;
    let mut t = Vec::with_capacity(steps + 14);
    let mut frames = Vec::new();
    let mut done = 0usize;
    let mut f = 0usize;
    while t.len() < steps || f < 2 {
        st.clear();
        let t_frame = Instant::now();
        st.step(&x[..2 * h], 2, Some(0))?;
        for k in 1..CODEBOOKS - 1 {
            let t0 = Instant::now();
            st.step(&x[(k + 1) * h..(k + 2) * h], 1, Some(k))?;
            let dt = t0.elapsed().as_secs_f64();
            if done >= warmup {
                t.push(dt);
            }
            done += 1;
        }
        if f > 0 {
            frames.push(t_frame.elapsed().as_secs_f64()); // the first frame is a warm-up
        }
        f += 1;
    }
    let slots = CODEBOOKS;
    let r = StepResult {
        graph: "code_predictor".into(),
        past: 8,
        slots,
        timing: Timing::from_seconds(&t),
        weight_bytes: predictor_weight_bytes(m),
        kv_bytes: kv_bytes(m, &m.code_predictor, slots),
        floor_ms: 0.0,
        floor_fraction: 0.0,
    };
    Ok((r, Timing::from_seconds(&frames)))
}

/// Vocoder latency of one chunk of `chunk` frames in the bundle's loaded form: windowed, a window
/// of `context + chunk` frames (steady state: 72 + 25; row `vocoder`); stateful, the chunk
/// alone after the state earlier chunks left (`context` ignored; row `vocoder_stream`, past 0).
///
/// # Errors
/// [`EngineError::Vocoder`].
pub fn vocoder_chunk(b: &Bundle, context: usize, chunk: usize, warmup: usize, steps: usize) -> Result<StepResult, EngineError> {
    let mut voc = Vocoder::new(b, context, chunk)?;
    let context = voc.left_context;
    let spf = b.manifest.audio.samples_per_frame as usize;
    let window: Vec<Frame> = (0..context + chunk)
        .map(|f| {
            let mut fr = [0u32; CODEBOOKS];
            for (q, c) in fr.iter_mut().enumerate() {
                *c = ((f * 131 + q * 977) % 2048) as u32;
            }
            fr
        })
        .collect();
    let mut out = vec![0.0f32; chunk * spf];
    let mut t = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let t0 = Instant::now();
        voc.decode(&window, chunk, &mut out)?;
        if i >= warmup {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    let graph = match voc.form() {
        model::backend::VocoderForm::Windowed => "vocoder",
        model::backend::VocoderForm::Stateful => "vocoder_stream",
    };
    Ok(StepResult {
        graph: graph.into(),
        past: context,
        slots: context + chunk,
        timing: Timing::from_seconds(&t),
        weight_bytes: 0,
        kv_bytes: 0,
        floor_ms: 0.0,
        floor_fraction: 0.0,
    })
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Compute threads of the main measurements.
    pub threads: usize,
    /// Thread counts of the sweep (empty: no sweep).
    pub sweep: Vec<usize>,
    /// Talker past lengths.
    pub pasts: Vec<usize>,
    /// Untimed steps before timing.
    pub warmup: usize,
    /// Timed steps (talker, predictor sub-steps).
    pub steps: usize,
    /// Timed vocoder chunks (each decodes the whole window; expensive at full size).
    pub vocoder_steps: usize,
    /// Bandwidth buffer bytes.
    pub bandwidth_bytes: usize,
    /// Bandwidth runs.
    pub bandwidth_runs: usize,
    /// Pipeline text.
    pub text: String,
    /// Pipeline frames (forced: random weights never say eos).
    pub frames: usize,
    /// Skip the pipeline and the load measurement (steps only, for the comparator).
    pub steps_only: bool,
    /// Each worker stage's frame-pool cap in bytes (`EngineSettings::pool_bytes`).
    pub pool_bytes: usize,
    /// Vocoder form (None: the bundle's default, stateful when it has a stream graph).
    pub vocoder: Option<model::backend::VocoderForm>,
    /// The stateful vocoder's precision (`runtime.vocoder_precision`; fp16 loads only when its
    /// gate passes).
    pub vocoder_precision: backend_tract::VocoderPrecision,
}

/// Default pipeline text: one English sentence (about 20 text tokens).
pub const DEFAULT_TEXT: &str = "The quick brown fox jumps over the lazy dog, and then it sleeps in the warm afternoon sun.";

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            threads: 1,
            sweep: Vec::new(),
            pasts: vec![64, 512],
            warmup: 5,
            steps: 50,
            vocoder_steps: 3,
            bandwidth_bytes: 256 << 20,
            bandwidth_runs: 7,
            text: DEFAULT_TEXT.into(),
            frames: 155,
            steps_only: false,
            pool_bytes: DEFAULT_POOL_BYTES,
            vocoder: None,
            vocoder_precision: backend_tract::VocoderPrecision::Fp32,
        }
    }
}

/// Step measurements at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct StepSet {
    /// Compute threads.
    pub threads: usize,
    /// Bandwidth measured with this many threads, just before the steps.
    pub bandwidth: Bandwidth,
    /// Talker steps, one per past length.
    pub talker: Vec<StepResult>,
    /// Code-predictor sub-step.
    pub code_predictor: StepResult,
    /// The 15 sub-steps of one frame (2-position prefill + 14 steps), median per frame.
    pub predictor_frame: Timing,
    /// Vocoder steady-state window.
    pub vocoder: StepResult,
}

/// Load timing.
#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    /// `Bundle::open`: manifest, tables, tokenizer, three graphs optimized.
    pub open_s: f64,
    /// From the start of `Bundle::open` to the first frame's codes (engine built, prompt
    /// prefilled, one frame decoded).
    pub first_frame_s: f64,
}

/// The whole pipeline on a fixed text.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineResult {
    /// Frames generated (forced count).
    pub frames: usize,
    /// Audio seconds.
    pub audio_s: f64,
    /// Request to last chunk, s.
    pub wall_s: f64,
    /// wall / audio.
    pub rtf: f64,
    /// Time to first audio, s (default ramp).
    pub ttfa_s: f64,
    /// Earliest underrun-free playback start `max_i(t_i − C_i)`, s ([`PlaybackMetrics`]).
    pub playback_start_s: f64,
    /// Total playback stall of a player that starts at TTFA: playback start − TTFA, s.
    pub stall_s: f64,
    /// Separate gaps that player hears.
    pub stall_gaps: usize,
    /// The play-through start policy over the same timeline ([`model::start::replay`], no
    /// calibration: the rate measured as the utterance goes, the length known): when it starts
    /// playback, s.
    pub play_through_start_s: f64,
    /// Its stall inside the utterance, s.
    pub play_through_stall_s: f64,
    /// Its gaps.
    pub play_through_gaps: usize,
    /// Talker prefill, ms.
    pub prefill_ms: f64,
    /// Talker decode step per frame, ms (mean).
    pub talker_ms_per_frame: f64,
    /// Code-predictor loop (15 sub-steps and sampling) per frame, ms (mean).
    pub predictor_ms_per_frame: f64,
    /// Vocoder time per frame, ms (all chunks / frames; runs on its own thread, concurrently).
    pub vocoder_ms_per_frame: f64,
    /// wall per frame − talker − predictor: prefill, embedding, queues, the vocoder's tail,
    /// contention between the threads.
    pub other_ms_per_frame: f64,
    /// wall / frames, ms (80 ms = real time).
    pub wall_ms_per_frame: f64,
    /// Heap allocations per frame in the steady state of the decode and vocoder threads
    /// ([`engine::StageMemory::steady_heap_allocations_per_frame`]: decode frames after the first
    /// two, vocoder chunks that repeat a window length); None when the utterance is too short to
    /// repeat a vocoder window (fewer than ramp sum + left context + 2 × the largest chunk
    /// frames: 155 with the default ramp is enough).
    pub allocations_per_frame: Option<f64>,
    /// Heap allocations per frame of the whole process over the whole utterance (warm-up,
    /// prefill and the caller's thread included); None without a counter.
    pub process_allocations_per_frame: Option<f64>,
    /// Blocks the decode and vocoder threads took from their frame pools per frame, whole
    /// utterance: what tract's executor asks for, served without the heap ([`engine::pool`]).
    pub pool_blocks_per_frame: f64,
    /// The utterance's frame-pool counters.
    pub memory: engine::StageMemory,
    /// Chunk sizes in frames, in order.
    pub chunks: Vec<usize>,
}

/// Everything one `herald bench` run measures.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Bundle directory.
    pub bundle: String,
    /// `model.size` and `model.dtype`.
    pub model: String,
    /// The model dtype (`model.dtype`: activations, KV cache, unquantized weights) and, for a
    /// quantized bundle, the step graphs' weight format (`model.weights`): `fp32` or
    /// `fp32, q4 weights`.
    pub dtype: String,
    /// Talker dims, e.g. `hidden 1024, 28 layers`.
    pub dims: String,
    /// Main thread count.
    pub threads: usize,
    /// Warm-up steps.
    pub warmup: usize,
    /// Load timing (None with steps-only).
    pub load: Option<LoadResult>,
    /// Steps at the main thread count.
    pub steps: StepSet,
    /// Pipeline (None with steps-only).
    pub pipeline: Option<PipelineResult>,
    /// Thread sweep: steps at each count (talker at the first past length, one timed vocoder
    /// window; the entry at `threads` reuses the main measurements).
    pub sweep: Vec<StepSet>,
    /// Peak resident set, bytes (filled by the caller; None when unknown).
    pub peak_rss_bytes: Option<u64>,
}

/// Steps at `threads` compute threads, the talker at each of `pasts`, and
/// `vocoder_steps` timed vocoder windows (after one untimed).
///
/// # Errors
/// Step or vocoder errors.
pub fn step_set(b: &Bundle, cfg: &BenchConfig, threads: usize, pasts: &[usize], vocoder_steps: usize) -> Result<StepSet, EngineError> {
    let bw = measure_bandwidth(cfg.bandwidth_bytes, threads, cfg.bandwidth_runs);
    // the steps run as a pipeline stage of `threads` CPUs runs them: tract's products on the
    // stage's executor, herald's Q4_0 products split over its threads (backend_tract::compute)
    let stage = backend_tract::compute::StageThreads::new("bench", threads, std::sync::Arc::new(|| {}))
        .map_err(|e| EngineError::Config(e.to_string()))?;
    let mut measured = None;
    model::backend::StageCompute::run(&stage, &mut || {
        measured = Some((|| {
            let mut talker = Vec::new();
            for &p in pasts {
                talker.push(talker_step(b, p, cfg.warmup, cfg.steps)?.with_floor(&bw));
            }
            let (cp, frame) = predictor_step(b, cfg.warmup, cfg.steps)?;
            let ramp = &b.manifest.vocoder.ramp;
            let chunk = ramp.last().copied().unwrap_or(25) as usize;
            let ctx = b.manifest.vocoder.left_context_frames as usize;
            let vocoder = vocoder_chunk(b, ctx, chunk, 1, vocoder_steps.max(1))?;
            Ok::<_, EngineError>((talker, cp, frame, vocoder))
        })());
    });
    let (talker, cp, frame, vocoder) = measured.ok_or_else(|| EngineError::Internal("the bench stage did not run".into()))??;
    Ok(StepSet { threads, bandwidth: bw.clone(), talker, code_predictor: cp.with_floor(&bw), predictor_frame: frame, vocoder })
}

/// Seconds from opening `dir` to the first frame's codes.
///
/// # Errors
/// Loading or step errors.
pub fn load_to_first_frame(
    dir: &Path,
    text: &str,
    vocoder: Option<model::backend::VocoderForm>,
    precision: backend_tract::VocoderPrecision,
) -> Result<(Arc<Bundle>, LoadResult), EngineError> {
    let t0 = Instant::now();
    let b = Arc::new(Bundle::open_with(dir, &TractWith { steps: true, vocoder: precision }, vocoder)?);
    let open_s = t0.elapsed().as_secs_f64();
    let mut dec = Decoder::new(Arc::clone(&b), &EngineSettings::default())?;
    let mut req = Request::new(text);
    req.max_frames = Some(2);
    dec.start(&req)?;
    let _ = dec.next_frame()?;
    Ok((b, LoadResult { open_s, first_frame_s: t0.elapsed().as_secs_f64() }))
}

/// Run the pipeline on `cfg.text` for `cfg.frames` frames (greedy), counting allocations with
/// `allocs` (a process-wide counter; None: not counted).
///
/// # Errors
/// Engine errors.
pub fn pipeline(b: &Arc<Bundle>, cfg: &BenchConfig, allocs: Option<&dyn Fn() -> u64>) -> Result<PipelineResult, EngineError> {
    set_compute_threads(cfg.threads);
    let settings = EngineSettings {
        kv_capacity: (cfg.frames + 512).next_power_of_two(),
        pool_bytes: cfg.pool_bytes,
        ..EngineSettings::default()
    };
    let engine = Engine::with_bundle(Arc::clone(b), &settings)?;
    let mut req = Request::new(cfg.text.clone());
    req.max_frames = Some(cfg.frames);
    let m = &b.manifest;
    let spf = m.audio.samples_per_frame as f64;
    let rate = f64::from(m.audio.sample_rate);
    let frame_s = spf / rate;
    let cancel = AtomicBool::new(false);
    let before = allocs.map(|a| a());
    let report = engine.synthesize(&req, &cancel, |_| Ok(()))?;
    let process_allocations_per_frame = match (allocs, before) {
        (Some(a), Some(b)) => Some((a() - b) as f64 / report.frames.max(1) as f64),
        _ => None,
    };
    let allocations_per_frame = report.memory.steady_heap_allocations_per_frame();
    let playback = PlaybackMetrics::from_chunks(&report.chunk_times, frame_s);
    let chunk = engine.ramp().last().copied().unwrap_or(1);
    let planner = model::start::StartPlanner::new(frame_s, chunk, report.frames, None, 0.02, f64::INFINITY);
    let holds = model::start::replay(&report.chunk_times, planner);
    let play_through = model::start::played(&report.chunk_times, &holds, &[], frame_s);
    let frames = report.frames.max(1) as f64;
    let s = &report.stats;
    let wall = report.total;
    let talker = s.talker.total() / frames * 1e3;
    let predictor = s.predictor.total() / frames * 1e3;
    let wall_pf = wall / frames * 1e3;
    Ok(PipelineResult {
        frames: report.frames,
        audio_s: report.samples as f64 / rate,
        wall_s: wall,
        rtf: report.rtf(rate),
        ttfa_s: report.ttfa,
        stall_s: playback.stall,
        stall_gaps: playback.stalls,
        playback_start_s: playback.playback_start,
        play_through_start_s: play_through.start,
        play_through_stall_s: play_through.stall,
        play_through_gaps: play_through.gaps,
        prefill_ms: s.prefill.total() * 1e3,
        talker_ms_per_frame: talker,
        predictor_ms_per_frame: predictor,
        vocoder_ms_per_frame: s.vocoder.total() / frames * 1e3,
        other_ms_per_frame: wall_pf - talker - predictor,
        wall_ms_per_frame: wall_pf,
        allocations_per_frame,
        process_allocations_per_frame,
        pool_blocks_per_frame: (report.memory.decode_served + report.memory.vocoder_served) as f64 / frames,
        memory: report.memory,
        chunks: report.chunk_times.iter().map(|c| c.1).collect(),
    })
}

/// Run everything `cfg` asks for on the bundle at `dir`.
///
/// # Errors
/// Loading, step, vocoder or pipeline errors.
pub fn run(dir: &Path, cfg: &BenchConfig, allocs: Option<&dyn Fn() -> u64>) -> Result<BenchResult, EngineError> {
    set_compute_threads(cfg.threads);
    let (b, load) = if cfg.steps_only {
        (Arc::new(Bundle::open_with(dir, &TractWith { steps: true, vocoder: cfg.vocoder_precision }, cfg.vocoder)?), None)
    } else {
        let (b, l) = load_to_first_frame(dir, &cfg.text, cfg.vocoder, cfg.vocoder_precision)?;
        (b, Some(l))
    };
    let steps = step_set(&b, cfg, cfg.threads, &cfg.pasts, cfg.vocoder_steps)?;
    let pipeline = if cfg.steps_only { None } else { Some(pipeline(&b, cfg, allocs)?) };
    let mut sweep = Vec::new();
    for &t in &cfg.sweep {
        if t == cfg.threads {
            // the main measurements already ran at this count: reuse them (first past length)
            let mut same = steps.clone();
            same.talker.truncate(1);
            sweep.push(same);
        } else {
            sweep.push(step_set(&b, cfg, t, &cfg.pasts[..cfg.pasts.len().min(1)], 1)?);
        }
    }
    let m = &b.manifest;
    Ok(BenchResult {
        bundle: dir.display().to_string(),
        model: format!("{} {}", m.model.family, m.model.size),
        dtype: if m.weights().is_quantized() { format!("{}, {} weights", m.model.dtype, m.weights()) } else { m.model.dtype.clone() },
        dims: format!(
            "talker hidden {} x {} layers, predictor hidden {} x {} layers",
            m.talker.hidden, m.talker.layers, m.code_predictor.hidden, m.code_predictor.layers
        ),
        threads: cfg.threads,
        warmup: cfg.warmup,
        load,
        steps,
        pipeline,
        sweep,
        peak_rss_bytes: None,
    })
}

fn step_row(out: &mut String, s: &StepResult) {
    use std::fmt::Write;
    let floor = |v: f64, f: &dyn Fn(f64) -> String| if v > 0.0 { f(v) } else { "–".into() };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.1} | {} | {} |",
        s.graph,
        s.past,
        s.slots,
        s.timing.median_ms,
        s.timing.min_ms,
        s.timing.p90_ms,
        (s.weight_bytes + s.kv_bytes) as f64 / 1e6,
        floor(s.floor_ms, &|v| format!("{v:.2}")),
        floor(s.floor_fraction, &|v| format!("{:.0} %", 100.0 * v)),
    );
}

impl BenchResult {
    /// The results as markdown tables (docs/performance.md's layout).
    pub fn to_markdown(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ =
            writeln!(o, "Bundle `{}`: {} {}, {}; {} compute threads.\n", self.bundle, self.model, self.dtype, self.dims, self.threads);
        let st = &self.steps;
        let _ = writeln!(
            o,
            "Memory bandwidth (copy, {} MiB, {} threads, median of {}): **{:.2} GB/s** (best {:.2}).\n",
            st.bandwidth.buffer_bytes >> 20,
            st.bandwidth.threads,
            st.bandwidth.runs,
            st.bandwidth.gb_per_s,
            st.bandwidth.best_gb_per_s
        );
        let _ = writeln!(o, "| step | past | slots | median ms | min ms | p90 ms | MB read | floor ms | floor fraction |");
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|");
        for s in &st.talker {
            step_row(&mut o, s);
        }
        step_row(&mut o, &st.code_predictor);
        step_row(&mut o, &st.vocoder);
        let _ =
            writeln!(o, "\nCode-predictor frame (2-position prefill + 14 sub-steps): median {:.2} ms.", st.predictor_frame.median_ms);
        if let Some(p) = &self.pipeline {
            let _ = writeln!(o, "\n| pipeline ({} frames, {:.2} s audio) | value |", p.frames, p.audio_s);
            let _ = writeln!(o, "|---|---|");
            let _ = writeln!(o, "| wall ms per 80 ms frame | {:.1} |", p.wall_ms_per_frame);
            let _ = writeln!(o, "| talker ms per frame | {:.1} |", p.talker_ms_per_frame);
            let _ = writeln!(o, "| predictor loop ms per frame | {:.1} |", p.predictor_ms_per_frame);
            let _ = writeln!(o, "| other ms per frame (wall − talker − predictor) | {:.1} |", p.other_ms_per_frame);
            let _ = writeln!(o, "| vocoder ms per frame (own thread, concurrent) | {:.1} |", p.vocoder_ms_per_frame);
            let _ = writeln!(o, "| talker prefill ms | {:.1} |", p.prefill_ms);
            let _ = writeln!(o, "| real-time factor | {:.3} |", p.rtf);
            let _ = writeln!(o, "| time to first audio s | {:.3} |", p.ttfa_s);
            let _ = writeln!(o, "| playback stall s | {:.3} |", p.stall_s);
            let _ = writeln!(
                o,
                "| play-through start s, stall s, gaps | {:.3}, {:.3}, {} |",
                p.play_through_start_s, p.play_through_stall_s, p.play_through_gaps
            );
            let allocs = p.allocations_per_frame.map_or("–".to_string(), |a| format!("{a:.0}"));
            let _ = writeln!(o, "| heap allocations per frame (steady state) | {allocs} |");
            let proc = p.process_allocations_per_frame.map_or("–".to_string(), |a| format!("{a:.0}"));
            let _ = writeln!(o, "| heap allocations per frame (whole utterance, all threads) | {proc} |");
            let _ = writeln!(o, "| frame-pool blocks per frame (tract's requests, no heap) | {:.0} |", p.pool_blocks_per_frame);
            let mem = &p.memory;
            let _ = writeln!(
                o,
                "| frames / chunks that reached the heap (warm-up, new slot tiers, new window lengths) | {} of {} / {} of {} |",
                mem.decode_frames_on_heap,
                p.frames,
                mem.vocoder_chunks_on_heap,
                p.chunks.len()
            );
        }
        if let Some(l) = &self.load {
            let _ = writeln!(o, "| load: bundle open s | {:.2} |", l.open_s);
            let _ = writeln!(o, "| load: open to first frame s | {:.2} |", l.first_frame_s);
        }
        if let Some(r) = self.peak_rss_bytes {
            if self.pipeline.is_some() {
                let _ = writeln!(o, "| peak RSS MB | {:.0} |", r as f64 / 1e6);
            } else {
                let _ = writeln!(o, "\nPeak RSS {:.0} MB.", r as f64 / 1e6);
            }
        }
        if !self.sweep.is_empty() {
            let _ = writeln!(
                o,
                "\n| threads | bandwidth GB/s | talker ms (past {}) | talker floor fraction | predictor sub-step ms | predictor floor fraction | vocoder chunk ms |",
                self.sweep[0].talker.first().map_or(0, |t| t.past)
            );
            let _ = writeln!(o, "|---|---|---|---|---|---|---|");
            for s in &self.sweep {
                let (tm, tf) = s.talker.first().map_or((0.0, 0.0), |t| (t.timing.median_ms, t.floor_fraction));
                let _ = writeln!(
                    o,
                    "| {} | {:.2} | {:.2} | {:.0} % | {:.2} | {:.0} % | {:.1} |",
                    s.threads,
                    s.bandwidth.gb_per_s,
                    tm,
                    100.0 * tf,
                    s.code_predictor.timing.median_ms,
                    100.0 * s.code_predictor.floor_fraction,
                    s.vocoder.timing.median_ms
                );
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_median_and_p90_by_hand() {
        let t = Timing::from_seconds(&[0.004, 0.001, 0.003, 0.002]);
        assert_eq!(t.count, 4);
        assert!((t.median_ms - 2.5).abs() < 1e-9);
        assert!((t.min_ms - 1.0).abs() < 1e-9);
        assert!((t.p90_ms - 4.0).abs() < 1e-9);
    }

    #[test]
    fn bandwidth_is_positive() {
        let b = measure_bandwidth(1 << 20, 2, 3);
        assert!(b.gb_per_s > 0.0 && b.best_gb_per_s >= b.gb_per_s);
        assert_eq!(b.buffer_bytes, 1 << 20);
    }
}

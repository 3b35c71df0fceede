//! The engine a CLI and a daemon share: load once, then synthesize utterance after utterance.
//!
//! Threads and data flow (docs/engine.md): the **decode thread** runs the frame loop and pushes
//! frames into a fixed-capacity queue ([`FRAME_QUEUE`] frames); the **vocoder thread** takes
//! frames, follows the chunk schedule and decodes windows (left context plus chunk), pushing PCM
//! chunks into a second fixed-capacity queue; the **caller's thread** receives chunks through a
//! callback (the audio sink writes them). Queues are `heapless` SPSC
//! rings; PCM buffers come from a pool allocated when the engine is built and circulate
//! between the vocoder and the caller, so the steady state allocates nothing in herald's code.
//! A full queue blocks its producer (backpressure): a slow sink slows the vocoder, which slows
//! the decoder; nothing grows. A stage with nothing to do parks; every enqueue and dequeue
//! unparks the stage on the other side, so hand-offs are immediate and idle stages do not spin
//! (they look at the cancel flag every [`CANCEL_POLL`]). Cancelling (the `cancel` flag or an error from the callback)
//! stops both threads within one frame.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use heapless::spsc::Queue;

use model::backend::Backend;
use model::frame::{CODEBOOKS, Frame};
use model::metrics::PlaybackMetrics;
use model::schedule::ChunkSchedule;
use model::stats::{StepStats, median};

use crate::bundle::Bundle;
use crate::decoder::Decoder;
use crate::error::EngineError;
use crate::placement::{StagePlacement, allowed_cpus};
use crate::pool::{FramePool, Installed, PoolStats};
use crate::settings::{EngineSettings, Request, StopReason};
use crate::vocoder::Vocoder;

/// Frames the decode → vocoder queue holds (heapless capacity N - 1).
pub const FRAME_QUEUE: usize = 64;
/// PCM chunks in flight between the vocoder and the caller.
pub const PCM_BUFFERS: usize = 3;

/// One chunk of PCM delivered to the caller.
#[derive(Debug)]
pub struct PcmChunk<'a> {
    /// Chunk index within the utterance, from 0.
    pub index: usize,
    /// Index of the chunk's first frame.
    pub first_frame: usize,
    /// Frames in the chunk.
    pub frames: usize,
    /// Mono float32 PCM at the bundle's sample rate, in [-1, 1]; frames × samples_per_frame.
    pub samples: &'a [f32],
    /// Seconds from the request to this chunk being ready.
    pub ready_at: f64,
}

/// What one utterance produced and how long it took.
#[derive(Debug, Clone)]
pub struct Report {
    /// Frames generated.
    pub frames: usize,
    /// Samples delivered (frames × samples_per_frame).
    pub samples: usize,
    /// Chunks delivered.
    pub chunks: usize,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Seconds from the request to the first chunk (time to first audio).
    pub ttfa: f64,
    /// Seconds from the request to the last chunk.
    pub total: f64,
    /// Ready time (s) and size (frames) of each chunk, in order.
    pub chunk_times: Vec<(f64, usize)>,
    /// Per-stage timing counters.
    pub stats: StepStats,
    /// TTFA, playback start, stall and RTF of the chunk timeline ([`PlaybackMetrics`]).
    pub playback: PlaybackMetrics,
    /// Where the decode and vocoder threads got their memory ([`crate::pool`]).
    pub memory: StageMemory,
}

/// Heap use of the two worker threads during one utterance, counted by their frame pools
/// ([`crate::pool::FramePool`]; zero everywhere unless the process's global allocator is
/// [`crate::pool::Pooled`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StageMemory {
    /// Frames during which the decode thread called the heap (a frame whose layouts the pool
    /// has not seen yet: the first two of an engine, the first of a new slot tier).
    pub decode_frames_on_heap: usize,
    /// Heap allocations of the decode thread.
    pub decode_heap_allocations: u64,
    /// Blocks the decode thread got from its pool instead.
    pub decode_served: u64,
    /// The decode thread's steady frames: all but its first two (the first code-predictor loop
    /// and the first one-position talker step), slot-tier growth included.
    pub decode_steady_frames: usize,
    /// Heap allocations of the decode thread in its steady frames.
    pub decode_steady_heap_allocations: u64,
    /// Chunks during which the vocoder thread called the heap (a window length the pool has not
    /// seen yet).
    pub vocoder_chunks_on_heap: usize,
    /// Heap allocations of the vocoder thread.
    pub vocoder_heap_allocations: u64,
    /// Blocks the vocoder thread got from its pool instead.
    pub vocoder_served: u64,
    /// Frames in the vocoder's steady chunks: those whose window length repeats the previous
    /// chunk's (after the ramp, the whole left context plus the largest chunk).
    pub vocoder_steady_frames: usize,
    /// Heap allocations of the vocoder thread in its steady chunks.
    pub vocoder_steady_heap_allocations: u64,
    /// Bytes the decode thread's pool keeps after the utterance.
    pub decode_retained_bytes: usize,
    /// Bytes the vocoder thread's pool keeps after the utterance.
    pub vocoder_retained_bytes: usize,
}

impl StageMemory {
    /// Heap allocations per frame in the steady state: the decode thread's per steady frame
    /// plus the vocoder's per frame of its steady chunks; None when either has no steady frame
    /// (an utterance too short to repeat a vocoder window).
    pub fn steady_heap_allocations_per_frame(&self) -> Option<f64> {
        if self.decode_steady_frames == 0 || self.vocoder_steady_frames == 0 {
            return None;
        }
        Some(
            self.decode_steady_heap_allocations as f64 / self.decode_steady_frames as f64
                + self.vocoder_steady_heap_allocations as f64 / self.vocoder_steady_frames as f64,
        )
    }
}

impl std::fmt::Display for StageMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "frame pools: decode thread {} heap allocations in {} frames ({} blocks from its pool), vocoder thread {} in {} chunks ({} from its pool); the pools keep {:.1} and {:.1} MiB",
            self.decode_heap_allocations,
            self.decode_frames_on_heap,
            self.decode_served,
            self.vocoder_heap_allocations,
            self.vocoder_chunks_on_heap,
            self.vocoder_served,
            self.decode_retained_bytes as f64 / f64::from(1u32 << 20),
            self.vocoder_retained_bytes as f64 / f64::from(1u32 << 20)
        )
    }
}

/// Installs a stage's frame pool on the worker thread, trims it after every unit of work (frame
/// or chunk) and counts the units that reached the heap.
struct HeapMeter<'a> {
    pool: &'a FramePool,
    installed: Option<Installed<'a>>,
    start: PoolStats,
    units: usize,
    units_on_heap: usize,
    shape: usize,
    steady_frames: usize,
    steady_heap: u64,
}

/// What a [`HeapMeter`] counted over one utterance.
#[derive(Debug, Clone, Copy, Default)]
struct MeterTotals {
    units_on_heap: usize,
    heap_allocations: u64,
    served: u64,
    steady_frames: usize,
    steady_heap_allocations: u64,
}

impl<'a> HeapMeter<'a> {
    /// Install `pool` on this thread (if another thread holds it, the stage runs on the heap).
    fn install(pool: &'a FramePool) -> Self {
        HeapMeter {
            pool,
            installed: pool.install(),
            start: pool.stats(),
            units: 0,
            units_on_heap: 0,
            shape: 0,
            steady_frames: 0,
            steady_heap: 0,
        }
    }

    /// Run one unit of work, noting whether it reached the heap; `frames` tells from its result
    /// how many frames it produced (0 for the decode thread's final call). `shape`
    /// names the unit's layouts (the vocoder's window length): when it changes, the pool is
    /// emptied first, so it never holds two working sets at once. A unit is steady from the
    /// third on when its shape repeats the previous one's: the decode thread's frames after the
    /// first predictor loop and talker step, the vocoder's repeated windows.
    fn unit<R>(&mut self, shape: usize, frames: impl FnOnce(&R) -> usize, f: impl FnOnce() -> R) -> R {
        let steady = self.units >= 2 && shape == self.shape;
        if shape != self.shape
            && let Some(i) = &mut self.installed
        {
            i.release();
        }
        self.shape = shape;
        let before = self.pool.stats().heap_allocations;
        let r = f();
        let heap = self.pool.stats().heap_allocations - before;
        self.units += 1;
        self.units_on_heap += usize::from(heap > 0);
        if steady {
            self.steady_frames += frames(&r);
            self.steady_heap += heap;
        }
        r
    }

    /// After a unit that did the stage's work (a frame, a chunk): keep only the layouts it used.
    fn trim(&mut self) {
        if let Some(i) = &mut self.installed {
            i.trim();
        }
    }

    /// Empty the pool (the vocoder's next utterance starts with other window lengths).
    fn release(&mut self) {
        if let Some(i) = &mut self.installed {
            i.release();
        }
    }

    /// (units on the heap, heap allocations, served) since `new`.
    fn totals(&self) -> MeterTotals {
        let d = self.pool.stats().since(&self.start);
        MeterTotals {
            units_on_heap: self.units_on_heap,
            heap_allocations: d.heap_allocations,
            served: d.served,
            steady_frames: self.steady_frames,
            steady_heap_allocations: self.steady_heap,
        }
    }
}

impl Report {
    /// Real-time factor: compute seconds per second of audio (below 1 is faster than real time).
    pub fn rtf(&self, samples_per_second: f64) -> f64 {
        let audio = self.samples as f64 / samples_per_second;
        if audio > 0.0 { self.total / audio } else { 0.0 }
    }
}

struct Shared {
    decoder: Decoder,
    vocoder: Vocoder,
    schedule: ChunkSchedule,
    pool: Vec<Vec<f32>>,
    stats: StepStats,
    window: Vec<Frame>,
}

/// A loaded engine. `synthesize` serves one utterance at a time (a second caller waits).
pub struct Engine {
    bundle: Arc<Bundle>,
    ramp: Vec<usize>,
    talker_place: StagePlacement,
    vocoder_place: StagePlacement,
    /// The decode thread's frame pool, kept across utterances.
    decode_pool: FramePool,
    /// The vocoder thread's frame pool, kept across utterances.
    vocoder_pool: FramePool,
    shared: Mutex<Shared>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("bundle", &self.bundle.dir).field("ramp", &self.ramp).finish_non_exhaustive()
    }
}

/// Longest a stage sleeps before it looks at the cancel flag again. Hand-offs do not wait for
/// it: every enqueue and dequeue unparks the thread on the other side at once; this bound is
/// only how soon a flag set from outside (a signal handler, another job's caller), which cannot
/// wake anyone, is seen by a stage that is idle.
const CANCEL_POLL: Duration = Duration::from_millis(10);

/// Sleep until another stage hands something over (or [`CANCEL_POLL`] passes).
fn wait() {
    thread::park_timeout(CANCEL_POLL);
}

/// The thread on the other side of a queue, known once it has started: parks and unparks are
/// how the stages hand over frames, PCM and buffers without polling. Neither setting nor waking
/// allocates.
#[derive(Default)]
struct Peer(OnceLock<Thread>);

impl Peer {
    /// Record the calling thread as this peer.
    fn set_current(&self) {
        let _ = self.0.set(thread::current());
    }

    /// Wake the peer if it is parked (a no-op before it started).
    fn wake(&self) {
        if let Some(t) = self.0.get() {
            t.unpark();
        }
    }
}

/// Push `item`, waiting while the queue is full (backpressure), and wake `consumer`; gives up
/// when `cancelled()`.
fn push<T, const N: usize>(
    tx: &mut heapless::spsc::Producer<'_, T, N>,
    mut item: T,
    consumer: &Peer,
    cancelled: &dyn Fn() -> bool,
) -> Result<(), EngineError> {
    loop {
        match tx.enqueue(item) {
            Ok(()) => {
                consumer.wake();
                return Ok(());
            }
            Err(back) => {
                item = back;
                if cancelled() {
                    return Err(EngineError::Cancelled);
                }
                wait();
            }
        }
    }
}

impl Engine {
    /// Open `dir` with `backend` and build the decoder, vocoder, queues and buffers.
    ///
    /// # Errors
    /// Any loading error, naming the file at fault.
    pub fn load(dir: &std::path::Path, backend: &dyn Backend, settings: &EngineSettings) -> Result<Self, EngineError> {
        let bundle = Arc::new(Bundle::open_with(dir, backend, settings.vocoder)?);
        Self::with_bundle(bundle, settings)
    }

    /// Build an engine over an already opened bundle.
    ///
    /// # Errors
    /// [`EngineError::Config`] for an unusable ramp or context; step-contract errors.
    pub fn with_bundle(bundle: Arc<Bundle>, settings: &EngineSettings) -> Result<Self, EngineError> {
        let m = &bundle.manifest;
        let ramp: Vec<usize> = settings.ramp.clone().unwrap_or_else(|| {
            let bundle_ramp: Vec<usize> = m.vocoder.ramp.iter().map(|&r| r as usize).collect();
            model::schedule::default_ramp(bundle.vocoder_form, &bundle_ramp)
        });
        let left_context = settings.left_context.unwrap_or(m.vocoder.left_context_frames as usize);
        let schedule = ChunkSchedule::new(&ramp)?;
        let max_chunk = schedule.max_chunk();
        let spf = m.audio.samples_per_frame as usize;
        let decoder = Decoder::new(Arc::clone(&bundle), settings)?;
        let vocoder = Vocoder::new(&bundle, left_context, max_chunk)?;
        let pool = (0..PCM_BUFFERS).map(|_| vec![0.0f32; max_chunk * spf]).collect();
        let frames = settings.kv_capacity;
        let shared = Shared {
            decoder,
            vocoder,
            schedule,
            pool,
            stats: StepStats::new(frames),
            window: Vec::with_capacity(left_context + max_chunk),
        };
        let (talker_place, vocoder_place) = if settings.talker_cpus.is_empty() && settings.vocoder_cpus.is_empty() {
            (StagePlacement::default(), StagePlacement::default())
        } else {
            let allowed = allowed_cpus()?;
            (
                StagePlacement::new("talker", &settings.talker_cpus, &allowed, &*bundle.graphs)?,
                StagePlacement::new("vocoder", &settings.vocoder_cpus, &allowed, &*bundle.graphs)?,
            )
        };
        Ok(Engine {
            bundle,
            ramp,
            talker_place,
            vocoder_place,
            decode_pool: FramePool::new(settings.pool_bytes),
            vocoder_pool: FramePool::new(settings.pool_bytes),
            shared: Mutex::new(shared),
        })
    }

    /// Frames of left context the vocoder decodes before each chunk: the configured context for
    /// the windowed vocoder, 0 for the stateful one (whose cost depends on the chunk only).
    pub fn vocoder_left_context(&self) -> usize {
        self.lock().vocoder.left_context
    }

    /// The vocoder form this engine decodes with.
    pub fn vocoder_form(&self) -> model::backend::VocoderForm {
        self.bundle.vocoder_form
    }

    /// Median seconds the vocoder stage takes for one window of each length in `windows`
    /// (frames: left context + chunk; the graph decodes the whole window, so its cost depends on
    /// the length only; for the stateful vocoder a window is a chunk, decoded after the state
    /// the previous runs left), over `runs` runs after one warm-up run, on the vocoder stage's
    /// CPUs. For calibration: the first chunks of an utterance have little context and cost less.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a length of 0 or above left context + the ramp's largest
    /// chunk; vocoder errors.
    pub fn vocoder_cost(&self, windows: &[usize], runs: usize) -> Result<Vec<f64>, EngineError> {
        let mut guard = self.lock();
        let sh = &mut *guard;
        let max = sh.vocoder.left_context + sh.schedule.max_chunk();
        if let Some(bad) = windows.iter().find(|&&n| n == 0 || n > max) {
            return Err(EngineError::Config(format!(
                "window of {bad} frames is outside 1..={max} (left context + the ramp's largest chunk)"
            )));
        }
        let spf = self.bundle.manifest.audio.samples_per_frame as usize;
        let vocoder = &mut sh.vocoder;
        let place = &self.vocoder_place;
        thread::scope(|s| {
            let h = s.spawn(|| {
                place.run(|| {
                    let mut out = vec![0.0f32; spf];
                    let mut times = Vec::with_capacity(runs.max(1));
                    let mut medians = Vec::with_capacity(windows.len());
                    for &w in windows {
                        let window: Vec<Frame> = vec![[0u32; CODEBOOKS]; w];
                        // a stateful vocoder decodes the whole window as its chunk
                        let n = if vocoder.left_context == 0 { w } else { 1 };
                        out.resize(n * spf, 0.0);
                        vocoder.decode(&window, n, &mut out)?;
                        times.clear();
                        for _ in 0..runs.max(1) {
                            let t = Instant::now();
                            vocoder.decode(&window, n, &mut out)?;
                            times.push(t.elapsed().as_secs_f64());
                        }
                        medians.push(median(&mut times));
                    }
                    Ok(medians)
                })
            });
            h.join().unwrap_or_else(|_| Err(EngineError::Internal("the vocoder timing thread panicked".into())))
        })
    }

    /// Use another chunk ramp from the next utterance on (calibration compares ramps on one
    /// loaded engine). Buffers were sized for the ramp given at load, so the new ramp's largest
    /// chunk may not exceed the old one's.
    ///
    /// # Errors
    /// [`EngineError::Config`] for an invalid ramp or one with a larger chunk.
    pub fn set_ramp(&mut self, ramp: &[usize]) -> Result<(), EngineError> {
        let new = ChunkSchedule::new(ramp)?;
        let old = ChunkSchedule::new(&self.ramp)?;
        if new.max_chunk() > old.max_chunk() {
            return Err(EngineError::Config(format!(
                "ramp {ramp:?} has a chunk of {} frames; this engine was built for at most {}",
                new.max_chunk(),
                old.max_chunk()
            )));
        }
        self.ramp = ramp.to_vec();
        Ok(())
    }

    /// The chunk ramp in use, frames.
    pub fn ramp(&self) -> &[usize] {
        &self.ramp
    }

    /// The loaded bundle.
    pub fn bundle(&self) -> &Bundle {
        &self.bundle
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic in a worker would poison the lock; the state is reset by every start().
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Synthesize `req`, calling `on_chunk` for each PCM chunk in order, on this thread.
    ///
    /// Returns after the last chunk with the utterance's report. `cancel` (checked every frame
    /// and every chunk) or an error returned by `on_chunk` stops both worker threads within one
    /// frame; the engine stays usable for the next request.
    ///
    /// # Errors
    /// The request's errors ([`EngineError::Prompt`] for bad text or voice, before any work),
    /// errors of the stages, the callback's error as [`EngineError::Cancelled`] after logging
    /// it, or `Cancelled`.
    pub fn synthesize<F>(&self, req: &Request, cancel: &AtomicBool, mut on_chunk: F) -> Result<Report, EngineError>
    where
        F: FnMut(&PcmChunk<'_>) -> Result<(), String>,
    {
        let t0 = Instant::now();
        let mut guard = self.lock();
        let sh = &mut *guard;
        sh.stats.clear();
        sh.schedule = ChunkSchedule::new(&self.ramp)?;
        let spf = self.bundle.manifest.audio.samples_per_frame as usize;
        // Bad input fails here, synchronously, before any thread starts.
        let tp = Instant::now();
        // The prefill runs here, on the decode stage's pool: what it frees (tract's buffers for
        // one-position steps among them) is there for the decode thread's first frames.
        let started = {
            let _pool = self.decode_pool.install();
            sh.decoder.start(req)
        };
        started?;
        sh.stats.prefill.record(tp.elapsed());

        let stop = AtomicBool::new(false);
        let mut frames_q: Queue<Frame, FRAME_QUEUE> = Queue::new();
        let mut pcm_q: Queue<(Vec<f32>, usize, usize, usize), 4> = Queue::new();
        let mut free_q: Queue<Vec<f32>, 4> = Queue::new();
        for b in sh.pool.drain(..) {
            let _ = free_q.enqueue(b);
        }
        let (mut f_tx, mut f_rx) = frames_q.split();
        let (mut p_tx, mut p_rx) = pcm_q.split();
        let (mut r_tx, mut r_rx) = free_q.split();
        let Shared { decoder, vocoder, schedule, stats, window, pool } = sh;
        let decoder = &mut *decoder;
        let StepStats { talker, predictor, sampling, vocoder: voc_stat, frame_queue_wait, vocoder_wait, .. } = stats;
        let decode_done = AtomicBool::new(false);
        let vocoder_done = AtomicBool::new(false);
        // who to wake after a hand-off: the caller (delivers PCM), the decode and vocoder threads
        let (caller, decode_peer, vocoder_peer) = (Peer::default(), Peer::default(), Peer::default());
        caller.set_current();
        // one entry per chunk; reserved per utterance, not per frame
        let mut report_chunks: Vec<(f64, usize)> = Vec::with_capacity(decoder.frame_cap() / self.ramp[0].max(1) + 8);
        // (units on the heap, heap allocations, blocks served) of each worker
        let (mut decode_mem, mut vocoder_mem) = (MeterTotals::default(), MeterTotals::default());
        let result: Result<(usize, usize), EngineError> = thread::scope(|s| {
            // reborrows, so the workers borrow what the engine keeps between utterances
            let decoder = &mut *decoder;
            let r_rx = &mut r_rx;
            let stop = &stop;
            let (decode_done, vocoder_done) = (&decode_done, &vocoder_done);
            let (caller, decode_peer, vocoder_peer) = (&caller, &decode_peer, &vocoder_peer);
            let cancelled = || cancel.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed);
            // ---- decode thread
            let talker_place = &self.talker_place;
            let vocoder_place = &self.vocoder_place;
            let (decode_pool, vocoder_pool) = (&self.decode_pool, &self.vocoder_pool);
            let (decode_mem, vocoder_mem) = (&mut decode_mem, &mut vocoder_mem);
            let dec = thread::Builder::new().name("herald-decode".into()).spawn_scoped(s, move || -> Result<usize, EngineError> {
                let mut meter = HeapMeter::install(decode_pool);
                decode_peer.set_current();
                let mut n = 0;
                let result = talker_place.run(|| {
                    loop {
                        if cancelled() {
                            return Err(EngineError::Cancelled);
                        }
                        let Some(frame) = meter.unit(0, |r| usize::from(matches!(r, Ok(Some(_)))), || decoder.next_frame())? else {
                            break;
                        };
                        meter.trim();
                        let ft = decoder.last_timing();
                        predictor.record(ft.predictor);
                        sampling.record(ft.sampling);
                        if let Some(tt) = ft.talker {
                            talker.record(tt);
                        }
                        let tw = Instant::now();
                        push(&mut f_tx, frame, vocoder_peer, &cancelled)?;
                        frame_queue_wait.record(tw.elapsed());
                        n += 1;
                    }
                    Ok(n)
                });
                *decode_mem = meter.totals();
                decode_done.store(true, Ordering::Release);
                if result.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                vocoder_peer.wake();
                result
            });
            let dec = match dec {
                Ok(h) => h,
                Err(e) => return Err(EngineError::Internal(format!("cannot start the decode thread: {e}"))),
            };
            // ---- vocoder thread
            let voc = thread::Builder::new().name("herald-vocoder".into()).spawn_scoped(s, move || -> Result<usize, EngineError> {
                let mut meter = HeapMeter::install(vocoder_pool);
                vocoder_peer.set_current();
                let result = vocoder_place.run(|| {
                    let mut done_frames = 0usize;
                    let mut pending = 0usize;
                    window.clear();
                    vocoder.reset();
                    loop {
                        if cancelled() {
                            return Err(EngineError::Cancelled);
                        }
                        let tw = Instant::now();
                        let had = pending;
                        while let Some(f) = f_rx.dequeue() {
                            // keep at most left_context + max_chunk frames: context then pending
                            if window.len() == window.capacity() {
                                window.remove(0);
                            }
                            window.push(f);
                            pending += 1;
                            if pending >= schedule.due() {
                                break;
                            }
                        }
                        if pending > had {
                            decode_peer.wake(); // room in the frame queue
                        }
                        let finished = decode_done.load(Ordering::Acquire) && f_rx.len() == 0;
                        let Some(n) = schedule.take(pending, finished) else {
                            if finished {
                                return Ok(done_frames);
                            }
                            wait();
                            continue;
                        };
                        vocoder_wait.record(tw.elapsed());
                        let mut buf = loop {
                            if let Some(b) = r_rx.dequeue() {
                                break b;
                            }
                            if cancelled() {
                                return Err(EngineError::Cancelled);
                            }
                            wait();
                        };
                        let spf_n = n * spf;
                        let w0 = window.len() - pending;
                        let ctx_start = w0.saturating_sub(vocoder.left_context);
                        let tv = Instant::now();
                        let r =
                            meter.unit(w0 + n - ctx_start, |_| n, || vocoder.decode(&window[ctx_start..w0 + n], n, &mut buf[..spf_n]));
                        voc_stat.record(tv.elapsed());
                        r?;
                        meter.trim();
                        pending -= n;
                        push(&mut p_tx, (buf, spf_n, done_frames, n), caller, &cancelled)?;
                        done_frames += n;
                    }
                });
                // the next utterance starts with other window lengths: nothing here is reused
                meter.release();
                *vocoder_mem = meter.totals();
                if result.is_err() {
                    stop.store(true, Ordering::Relaxed);
                    decode_peer.wake();
                }
                vocoder_done.store(true, Ordering::Release);
                caller.wake();
                result
            });
            let voc = match voc {
                Ok(h) => h,
                Err(e) => {
                    // the decode thread sees `stop` at its next frame or full queue and ends
                    stop.store(true, Ordering::Relaxed);
                    return Err(EngineError::Internal(format!("cannot start the vocoder thread: {e}")));
                }
            };
            // ---- caller: deliver chunks
            let mut index = 0;
            let mut delivered = 0usize;
            let mut callback_error = None;
            loop {
                if let Some((buf, len, first, n)) = p_rx.dequeue() {
                    let ready_at = t0.elapsed().as_secs_f64();
                    if callback_error.is_none() && !cancel.load(Ordering::Relaxed) {
                        let chunk = PcmChunk { index, first_frame: first, frames: n, samples: &buf[..len], ready_at };
                        if let Err(e) = on_chunk(&chunk) {
                            // the caller reports its consumer's failure (a client that hung up, a device)
                            log::debug!("audio consumer failed: {e}; cancelling the utterance");
                            callback_error = Some(e);
                            stop.store(true, Ordering::Relaxed);
                            decode_peer.wake();
                        }
                    }
                    if report_chunks.len() < report_chunks.capacity() {
                        report_chunks.push((ready_at, n));
                    }
                    delivered += len;
                    index += 1;
                    let _ = r_tx.enqueue(buf);
                    vocoder_peer.wake(); // a buffer back, room in the PCM queue
                    continue;
                }
                // (is_finished: a vocoder thread that panicked never sets the flag)
                if (vocoder_done.load(Ordering::Acquire) || voc.is_finished()) && p_rx.len() == 0 {
                    break;
                }
                wait();
            }
            let dec_r = dec.join().unwrap_or(Err(EngineError::Internal("the decode thread panicked".into())));
            let voc_r = voc.join().unwrap_or(Err(EngineError::Internal("the vocoder thread panicked".into())));
            if callback_error.is_some() || cancel.load(Ordering::Relaxed) {
                return Err(EngineError::Cancelled);
            }
            // report the stage that failed first, not the other stage's resulting cancellation
            let (frames, vf) = match (dec_r, voc_r) {
                (Ok(f), Ok(v)) => (f, v),
                (Err(e), Ok(_)) | (Ok(_), Err(e)) => return Err(e),
                (Err(EngineError::Cancelled), Err(e)) | (Err(e), Err(_)) => return Err(e),
            };
            if vf != frames {
                return Err(EngineError::Vocoder(format!("vocoded {vf} of {frames} frames")));
            }
            Ok((frames, delivered))
        });
        // return every PCM buffer to the pool
        while let Some(b) = r_rx.dequeue() {
            pool.push(b);
        }
        while let Some((b, ..)) = p_rx.dequeue() {
            pool.push(b);
        }
        let (frames, samples) = result?;
        if samples != frames * spf {
            return Err(EngineError::Vocoder(format!("delivered {samples} samples for {frames} frames")));
        }
        let stop = decoder.stop_reason().unwrap_or(StopReason::Eos);
        let ttfa = report_chunks.first().map_or(0.0, |c| c.0);
        let total = report_chunks.last().map_or(0.0, |c| c.0);
        let m = &self.bundle.manifest.audio;
        let frame_seconds = f64::from(m.samples_per_frame) / f64::from(m.sample_rate);
        let playback = PlaybackMetrics::from_chunks(&report_chunks, frame_seconds);
        log::info!("{playback}");
        let memory = StageMemory {
            decode_frames_on_heap: decode_mem.units_on_heap,
            decode_heap_allocations: decode_mem.heap_allocations,
            decode_served: decode_mem.served,
            decode_steady_frames: decode_mem.steady_frames,
            decode_steady_heap_allocations: decode_mem.steady_heap_allocations,
            vocoder_chunks_on_heap: vocoder_mem.units_on_heap,
            vocoder_heap_allocations: vocoder_mem.heap_allocations,
            vocoder_served: vocoder_mem.served,
            vocoder_steady_frames: vocoder_mem.steady_frames,
            vocoder_steady_heap_allocations: vocoder_mem.steady_heap_allocations,
            decode_retained_bytes: self.decode_pool.stats().retained_bytes,
            vocoder_retained_bytes: self.vocoder_pool.stats().retained_bytes,
        };
        log::debug!("{memory}");
        Ok(Report {
            frames,
            samples,
            chunks: report_chunks.len(),
            stop,
            ttfa,
            total,
            chunk_times: report_chunks,
            stats: guard.stats.clone(),
            playback,
            memory,
        })
    }
}

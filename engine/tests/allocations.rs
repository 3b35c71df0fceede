//! Heap allocations in the steady state, counted per thread under the process's allocator.
//!
//! The global allocator is herald's `Pooled` over a counting system allocator, as in the
//! binary. herald's own per-frame work (sampling, embedding lookups, chunk scheduling, cache
//! writes, masks, RoPE) allocates nothing at all after warm-up. tract's executor asks for each
//! node's output tensors on every run; with the stage's frame pool installed those requests are
//! served from the pool, and the heap sees none after the first frame (decode) or the first
//! window of a length (vocoder). The pipeline reports the same from its own threads.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use backend_tract::Tract;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use engine::decoder::Decoder;
use engine::pool::{FramePool, Pooled};
use engine::tables::Embedding;
use engine::vocoder::Vocoder;
use engine::{Bundle, DEFAULT_POOL_BYTES};
use engine::{Engine, EngineSettings, Request};
use model::ChunkSchedule;
use model::backend::VocoderForm;
use model::sampler::{Sampler, SplitMix64};
use std::sync::atomic::AtomicBool;

/// The heap: counts, per thread, the calls that reach the system allocator.
struct Counting;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Pooled<Counting> = Pooled::new(Counting);

fn count<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = COUNT.with(Cell::get);
    let r = f();
    (r, COUNT.with(Cell::get) - before)
}

#[test]
fn herald_parts_allocate_nothing_per_frame() {
    let b = Arc::new(Bundle::open(&common::bundle("tiny-0.6b"), &Tract).unwrap());
    let m = &b.manifest;
    let mut sampler = Sampler::from_manifest(m).unwrap();
    let mut rng = SplitMix64::new(3);
    let mut logits: Vec<f32> = (0..m.codec.vocab_size).map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0).collect();
    let history: Vec<u32> = (0..200).map(|i| i * 7 % 2048).collect();
    let mut row = vec![0f32; m.talker.hidden as usize];
    let mut sched = ChunkSchedule::new(&[2, 4, 8, 16, 25]).unwrap();
    // warm-up
    sampler.choose_c0(&mut logits.clone(), &history, Some(&mut rng)).unwrap();
    let ((), n) = count(|| {
        for f in 0..50 {
            let mut l = logits.clone(); // the clone is the test's, counted below and subtracted
            let _ = sampler.choose_c0(&mut l, &history[..f], Some(&mut rng)).unwrap();
            let _ = sampler.choose_code(&mut l[..2048], Some(&mut rng)).unwrap();
            b.tables.add(Embedding::Codec(2149), &mut row).unwrap();
            b.tables.add(Embedding::Residual { table: 3, code: 17 }, &mut row).unwrap();
            b.tables.add(Embedding::Text(151671), &mut row).unwrap();
            let _ = sched.take(f % 30, false);
        }
    });
    assert_eq!(n, 50, "only the test's own 50 clones may allocate");
    logits.clear();
}

#[test]
fn whole_frames_stay_off_the_heap_after_the_first() {
    let b = Arc::new(Bundle::open(&common::bundle("tiny-hybrid"), &Tract).unwrap());
    let mut dec = Decoder::new(b.clone(), &EngineSettings::default()).unwrap();
    let pool = FramePool::new(DEFAULT_POOL_BYTES);
    // the request's prefill runs on the caller's thread before the decode thread starts
    dec.start(&Request { max_frames: Some(80), ..Request::new("The steady state.") }).unwrap();
    let mut g = pool.install().unwrap();
    let mut per_frame = Vec::with_capacity(64);
    let mut served = Vec::with_capacity(64);
    loop {
        let before = pool.stats();
        let (f, n) = count(|| dec.next_frame().unwrap());
        g.trim();
        if f.is_none() {
            break;
        }
        per_frame.push(n);
        served.push(pool.stats().since(&before).served);
    }
    drop(g);
    assert_eq!(per_frame.len(), 80);
    // warm-up: frame 0 runs the first code-predictor loop, frame 1 the first one-position
    // talker step; later, the frame whose position passes 64 grows the full caches to 128 slots
    // (new layouts), and the frame after it meets a new-layout tensor that outlives a frame.
    // Every other frame reaches the heap not once.
    let on_heap: Vec<usize> = (0..per_frame.len()).filter(|&i| per_frame[i] > 0).collect();
    assert!(on_heap.len() <= 4 && on_heap[0] == 0, "heap allocations per frame: {per_frame:?}");
    if let [_, _, tier, ref rest @ ..] = on_heap[..] {
        assert!(rest.iter().all(|&f| f == tier + 1), "heap allocations per frame: {per_frame:?}");
        assert!(per_frame.len() - tier > 20, "the crossing should leave 20 steady frames: {per_frame:?}");
    } else {
        panic!("80 frames after a short prompt pass 64 positions: {per_frame:?}");
    }
    // tract still asks for its tensors every frame; the pool serves them, the same every frame
    // (the last frame's talker step is not run: the frame cap ends the utterance after it)
    let steady = (2..served.len() - 1).filter(|i| !on_heap.contains(i)).map(|i| served[i]);
    assert!(steady.into_iter().all(|n| n == served[2] && n > 1000), "blocks served per frame: {served:?}");
    println!("decode: heap allocations per frame {per_frame:?}; blocks served by the pool per frame: {}", served[2]);

    // the vocoder over the pipeline's windows: the ramp, then steady chunks of 25 frames
    // (stateful, the default) or windows of 72 + 25 frames (windowed)
    let frames = vec![[5u32; 16]; 200];
    let mut voc = Vocoder::new(&b, 72, 25).unwrap();
    let mut out = vec![0f32; 25 * 1920];
    let vpool = FramePool::new(DEFAULT_POOL_BYTES);
    let mut g = vpool.install().unwrap();
    let mut done = 0;
    let mut chunks = Vec::new();
    for n in [2usize, 4, 8, 16, 25, 25, 25, 25, 25] {
        let w = done.min(voc.left_context) + n;
        let (r, heap) = count(|| voc.decode(&frames[done + n - w..done + n], n, &mut out[..n * 1920]));
        r.unwrap();
        g.trim();
        chunks.push((w, heap));
        done += n;
    }
    drop(g);
    if voc.form() == VocoderForm::Windowed {
        // a window length met for the first time allocates; a repeated one does not
        for (i, &(w, heap)) in chunks.iter().enumerate() {
            let seen = chunks[..i].iter().any(|&(v, _)| v == w);
            assert_eq!(heap == 0, seen, "window {w}: {heap} heap allocations; all chunks {chunks:?}");
        }
    } else {
        // the stateful vocoder runs every chunk as runs of its fixed-size plans: once each plan
        // has run (its one 2-frame plan; an odd chunk's last frame runs padded and is held for the next
        // chunk, which then starts with it) the pool holds every layout
        let first_odd = chunks.iter().position(|&(w, _)| w % 2 == 1).unwrap();
        assert!(chunks[first_odd + 2..].iter().all(|&(_, heap)| heap == 0), "heap allocations per chunk: {chunks:?}");
        assert!(chunks.len() - first_odd > 3, "three steady chunks: {chunks:?}");
    }
    println!("vocoder (window frames, heap allocations): {chunks:?}");
}

#[test]
fn the_pipeline_reports_its_threads_off_the_heap() {
    // a ramp with changes of chunk length, which the accounting below follows
    let settings = EngineSettings { ramp: Some(vec![2, 4, 8, 16, 25]), ..EngineSettings::default() };
    let engine = Engine::load(&common::bundle("tiny-0.6b"), &Tract, &settings).unwrap();
    let cancel = AtomicBool::new(false);
    let req = Request { max_frames: Some(60), force_eos_at: Some(60), ..Request::new("Frames, chunks and pools.") };
    let first = engine.synthesize(&req, &cancel, |_| Ok(())).unwrap();
    let second = engine.synthesize(&req, &cancel, |_| Ok(())).unwrap();
    for r in [&first, &second] {
        assert_eq!(r.frames, 60);
        let m = &r.memory;
        // every frame and chunk asks tract for blocks; the pools serve them
        assert!(m.decode_served > 60 * 1000 && m.vocoder_served > 0, "{m}");
        // the vocoder reaches the heap exactly at each change of window length (ramp, first
        // steady window, flush); repeated windows are served by its pool
        let mut done = 0;
        let mut last = 0;
        let mut changes = 0;
        for &(_, n) in &r.chunk_times {
            let w = done.min(engine.vocoder_left_context()) + n;
            changes += usize::from(w != last);
            last = w;
            done += n;
        }
        assert_eq!(m.vocoder_chunks_on_heap, changes, "{m}; chunks {:?}", r.chunk_times);
    }
    // a fresh engine's decode thread meets its layouts in its first two frames and again when
    // the talker's full caches grow from 64 to 128 slots (prompt + 60 frames > 64 positions).
    // The next utterance keeps the 128 slots and finds its layouts in the pool; only its frame 0
    // may take blocks from the heap, for the prompt-length layouts of its prefill that the
    // trims after utterance one gave back (measured 11 with the code predictor's heads in its
    // graph, 58 with them split off into their own plans; a few dozen, once per utterance).
    assert!((2..=4).contains(&first.memory.decode_frames_on_heap), "{}", first.memory);
    assert!(second.memory.decode_frames_on_heap <= 1, "{}", second.memory);
    assert!(second.memory.decode_heap_allocations <= 80, "{}", second.memory);
    // the steady part (frames after the first two) is exactly zero
    assert_eq!(second.memory.decode_steady_frames, 58, "{:?}", second.memory);
    assert_eq!(second.memory.decode_steady_heap_allocations, 0, "{:?}", second.memory);
}

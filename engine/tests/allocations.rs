//! Heap allocations in the steady state, counted by a global allocator (per thread).
//!
//! herald's own per-frame work (sampling, embedding lookups, chunk scheduling, cache writes,
//! masks, RoPE) allocates nothing after warm-up. tract's executor allocates each node's output
//! tensors on every run, so a whole frame has a floor that is tract's: this test measures it
//! and asserts it is the same every frame (nothing grows with the utterance), and that
//! herald's parts add zero.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use engine::sampler::{Sampler, SplitMix64};
use engine::synth::{Bundle, ChunkSchedule, Decoder, Vocoder};
use engine::tables::Embedding;
use engine::{EngineSettings, Request};

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
static GLOBAL: Counting = Counting;

fn count<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = COUNT.with(Cell::get);
    let r = f();
    (r, COUNT.with(Cell::get) - before)
}

#[test]
fn herald_parts_allocate_nothing_per_frame() {
    let b = Arc::new(Bundle::open(&common::bundle("tiny-0.6b")).unwrap());
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
fn whole_frames_allocate_the_same_every_frame() {
    let b = Arc::new(Bundle::open(&common::bundle("tiny-hybrid")).unwrap());
    let mut dec = Decoder::new(b.clone(), &EngineSettings::default()).unwrap();
    // warm-up: one utterance, so buffers reach their steady shapes
    dec.start(&Request { max_frames: Some(20), ..Request::new("warm up") }).unwrap();
    while dec.next_frame().unwrap().is_some() {}
    dec.start(&Request { max_frames: Some(40), ..Request::new("The steady state.") }).unwrap();
    let mut per_frame = Vec::new();
    loop {
        let (f, n) = count(|| dec.next_frame().unwrap());
        if f.is_none() {
            break;
        }
        per_frame.push(n);
    }
    // frames 1.. are steady (frame 0 may still grow the talker cache from 0 to 64 slots)
    let steady = &per_frame[2..per_frame.len() - 1];
    let first = steady[0];
    assert!(steady.iter().all(|&n| n == first), "allocations per frame vary: {per_frame:?}");
    println!("allocations per frame (talker step + 15 predictor sub-steps, all in tract's executor): {first}");
    // the vocoder: steady windows allocate the same every chunk
    let frames = vec![[5u32; 16]; 200];
    let mut voc = Vocoder::new(&b, 72, 25).unwrap();
    let mut out = vec![0f32; 25 * 1920];
    voc.decode(&frames[..97], 25, &mut out).unwrap();
    let counts: Vec<u64> = (0..4).map(|i| count(|| voc.decode(&frames[i * 25..i * 25 + 97], 25, &mut out).unwrap()).1).collect();
    assert!(counts.iter().all(|&n| n == counts[0]), "{counts:?}");
    println!("allocations per 25-frame vocoder chunk (tract's executor): {}", counts[0]);
    let _ = ChunkSchedule::new(&[1]).unwrap();
}

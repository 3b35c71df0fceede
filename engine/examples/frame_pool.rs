//! What the frame pools keep: the working set of each vocoder window length and of a decode
//! frame, i.e. the cap a stage's pool needs for its steady state to stay off the heap.
//!
//!     cargo run --release -p herald-engine --example frame_pool -- BUNDLE
//!
//! Runs the vocoder over the pipeline's windows (the default ramp with its left context, then four
//! steady windows) and 40 decode frames, with an uncapped pool installed and trimmed after
//! every chunk and frame as the engine does, and prints per chunk / frame the heap allocations
//! and what the pool keeps: the working set a stage's pool needs (`pool_bytes`).

use backend_tract::Tract;
use std::alloc::System;
use std::sync::Arc;

use engine::Bundle;
use engine::decoder::Decoder;
use engine::pool::{FramePool, Pooled};
use engine::vocoder::Vocoder;
use engine::{EngineSettings, Request};
use model::CODEBOOKS;

#[global_allocator]
static GLOBAL: Pooled<System> = Pooled::new(System);

fn mib(b: usize) -> f64 {
    b as f64 / f64::from(1u32 << 20)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: frame_pool BUNDLE [--no-pool | CAP_MIB]";
    let dir = std::env::args().nth(1).ok_or(usage)?;
    // --no-pool: the same work on the plain heap, for the peak RSS and the chunk times;
    // CAP_MIB: the vocoder pool's cap (default: unbounded, to measure the working set)
    let arg = std::env::args().nth(2);
    let use_pool = arg.as_deref() != Some("--no-pool");
    let cap = match arg.as_deref() {
        None | Some("--no-pool") => usize::MAX,
        Some(n) => n.parse::<usize>().map_err(|_| usage)? << 20,
    };
    let b = Arc::new(Bundle::open(std::path::Path::new(&dir), &Tract)?);
    let m = &b.manifest;
    let spf = m.audio.samples_per_frame as usize;
    let ramp: Vec<usize> = m.vocoder.ramp.iter().map(|&r| r as usize).collect();
    let ctx = m.vocoder.left_context_frames as usize;
    let max_chunk = ramp.iter().copied().max().unwrap_or(25);
    let mut voc = Vocoder::new(&b, ctx, max_chunk)?;
    let frames = vec![[7u32; CODEBOOKS]; ctx + max_chunk];
    let mut out = vec![0f32; max_chunk * spf];
    // the pipeline's sequence of windows: the ramp, then steady windows; one pool, trimmed
    // after every chunk as the engine does
    let mut done = 0usize;
    let mut windows: Vec<(usize, usize)> = Vec::with_capacity(ramp.len() + 4);
    for &n in ramp.iter().chain(std::iter::repeat_n(&max_chunk, 4)) {
        windows.push((done.min(ctx) + n, n));
        done += n;
    }
    println!("{:>14} {:>6} {:>10} {:>12} {:>12} {:>8}", "window frames", "chunk", "ms", "heap allocs", "kept MiB", "layouts");
    let pool = FramePool::new(cap);
    let mut installed = if use_pool { Some(pool.install().ok_or("pool busy")?) } else { None };
    let mut last_w = 0;
    for (w, n) in windows {
        if let Some(i) = &mut installed
            && w != last_w
        {
            i.release();
        }
        last_w = w;
        let before = pool.stats();
        let t = std::time::Instant::now();
        voc.decode(&frames[..w], n, &mut out[..n * spf])?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let d = pool.stats().since(&before);
        if let Some(i) = &mut installed {
            i.trim();
        }
        let after = pool.stats();
        println!("{w:>14} {n:>6} {ms:>10.1} {:>12} {:>12.1} {:>8}", d.heap_allocations, mib(after.retained_bytes), after.layouts);
    }
    let high = pool.stats().high_water_bytes;
    drop(installed);
    drop(pool);
    let hwm = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned()));
    println!("vocoder pool high water {:.1} MiB; process peak RSS (VmHWM) {} kB", mib(high), hwm.unwrap_or_default());
    let mut dec = Decoder::new(Arc::clone(&b), &EngineSettings::default())?;
    dec.start(&Request { max_frames: Some(40), ..Request::new("Frame pools keep what a frame frees.") })?;
    let pool = FramePool::new(usize::MAX);
    let mut installed = pool.install().ok_or("pool busy")?;
    let mut per_frame = Vec::with_capacity(64);
    loop {
        let before = pool.stats();
        if dec.next_frame()?.is_none() {
            break;
        }
        per_frame.push(pool.stats().since(&before).heap_allocations);
        installed.trim();
    }
    let s = pool.stats();
    drop(installed);
    println!(
        "decode: {} frames, heap allocations per frame {per_frame:?}; kept {:.2} MiB in {} layouts, {} blocks served",
        per_frame.len(),
        mib(s.retained_bytes),
        s.layouts,
        s.served
    );
    Ok(())
}

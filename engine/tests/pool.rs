//! The frame pool allocator on its own: exact-layout reuse, alignment, zeroing, reallocation,
//! the cap, trimming, cross-thread frees and the return of every block to the heap.
//!
//! The global allocator is `Pooled<Counting>`: `Counting` stands for the heap and counts, per
//! thread, the calls that reach it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;

use engine::pool::{FramePool, Pooled};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static FREES: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = FREES.try_with(|c| c.set(c.get() + 1));
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Pooled<Counting> = Pooled::new(Counting);

fn heap_allocs() -> u64 {
    ALLOCS.with(Cell::get)
}
fn heap_frees() -> u64 {
    FREES.with(Cell::get)
}

/// One "frame" of work shaped like tract's: a few tensors of fixed sizes, created and dropped.
fn frame(seed: u8) -> u64 {
    let a = vec![seed; 1000];
    let b: Vec<f32> = vec![f32::from(seed); 4096];
    let c = Box::new([u64::from(seed); 3]);
    let s = String::from("x").repeat(40);
    black_box(a.iter().map(|&x| u64::from(x)).sum::<u64>() + b.len() as u64 + c[2] + s.len() as u64)
}

#[test]
fn after_one_frame_the_same_frames_never_reach_the_heap() {
    let pool = FramePool::new(1 << 20);
    let mut g = pool.install().unwrap();
    let h0 = heap_allocs();
    frame(1);
    g.trim();
    let first = heap_allocs() - h0;
    assert!(first >= 4, "the first frame allocates from the heap ({first})");
    let h1 = heap_allocs();
    let served = pool.stats().served;
    for i in 0..100 {
        assert_eq!(frame(i), 1000 * u64::from(i) + 4096 + u64::from(i) + 40);
        g.trim();
    }
    assert_eq!(heap_allocs() - h1, 0, "steady frames reached the heap");
    assert_eq!(pool.stats().served - served, 100 * first, "every request was served by the pool");
    assert_eq!(pool.stats().heap_allocations, first);
}

#[test]
fn blocks_are_aligned_zeroed_and_intact() {
    let pool = FramePool::new(1 << 20);
    let _g = pool.install().unwrap();
    for _ in 0..3 {
        for align in [1usize, 8, 16, 64, 128, 4096] {
            let l = Layout::from_size_align(300, align).unwrap();
            unsafe {
                let p = std::alloc::alloc(l);
                assert!(!p.is_null());
                assert_eq!(p as usize % align, 0, "alignment {align}");
                std::ptr::write_bytes(p, 0xAB, 300);
                std::alloc::dealloc(p, l);
                let z = std::alloc::alloc_zeroed(l);
                assert!((0..300).all(|i| *z.add(i) == 0), "a reused block must come back zeroed");
                std::alloc::dealloc(z, l);
            }
        }
    }
    // tiny layouts share the 16-byte floor and still work
    let a: Vec<Box<u8>> = (0..100u8).map(Box::new).collect();
    assert!(a.iter().enumerate().all(|(i, b)| usize::from(**b) == i));
}

#[test]
fn reallocation_keeps_the_contents() {
    let pool = FramePool::new(1 << 20);
    let _g = pool.install().unwrap();
    for _ in 0..3 {
        let mut v: Vec<u32> = Vec::new();
        for i in 0..10_000 {
            v.push(i);
        }
        assert!(v.iter().enumerate().all(|(i, &x)| x as usize == i));
        v.truncate(10);
        v.shrink_to_fit();
        assert_eq!(v, (0..10).collect::<Vec<_>>());
    }
}

#[test]
fn the_cap_bounds_what_a_pool_keeps() {
    let pool = FramePool::new(40_000);
    let g = pool.install().unwrap();
    // a block above a quarter of the cap is never kept
    drop(vec![0u8; 10_001]);
    assert_eq!(pool.stats().retained_bytes, 0);
    assert_eq!(pool.stats().passed, 1);
    // four layouts of 9000+ bytes fill it; the fifth goes back to the heap, the four stay
    let blocks: Vec<Vec<u8>> = (0..5).map(|i| vec![1u8; 9000 + i]).collect();
    let mut it = blocks.into_iter();
    for _ in 0..4 {
        drop(it.next());
    }
    assert_eq!(pool.stats().retained_bytes, 4 * 9000 + 6);
    let f = heap_frees();
    drop(it.next());
    assert_eq!(heap_frees() - f, 1);
    let s = pool.stats();
    assert_eq!(s.retained_bytes, 4 * 9000 + 6);
    assert_eq!(s.passed, 2);
    assert!(s.high_water_bytes <= 40_000);
    drop(g);
    // nothing is kept by a pool with cap 0, and everything is counted
    let zero = FramePool::new(0);
    let _g = zero.install().unwrap();
    let h = heap_allocs();
    for _ in 0..5 {
        frame(3);
    }
    assert_eq!(heap_allocs() - h, zero.stats().heap_allocations);
    assert_eq!(zero.stats().retained_bytes, 0);
}

#[test]
fn trimming_drops_layouts_the_last_frame_did_not_use() {
    let pool = FramePool::new(1 << 24);
    let mut g = pool.install().unwrap();
    drop(vec![0u8; 5000]);
    g.trim(); // the 5000-byte layout was used in this period: kept
    assert_eq!(pool.stats().retained_bytes, 5000);
    drop(vec![0u8; 7000]);
    let f = heap_frees();
    g.trim(); // 5000 unused since the last trim: back to the heap
    assert_eq!(pool.stats().retained_bytes, 7000);
    assert_eq!(heap_frees() - f, 1);
    assert_eq!(pool.stats().layouts, 1);
    g.release();
    assert_eq!(pool.stats().retained_bytes, 0);
    assert_eq!(pool.stats().layouts, 0);
    assert_eq!(heap_frees() - f, 2);
}

#[test]
fn one_thread_at_a_time_and_blocks_may_cross_threads() {
    let pool = FramePool::new(1 << 20);
    let g = pool.install().unwrap();
    assert!(pool.install().is_none(), "installed twice on one thread");
    std::thread::scope(|s| {
        s.spawn(|| assert!(pool.install().is_none(), "installed on two threads")).join().unwrap();
    });
    // a block from another (unpooled) thread, freed here, is kept and reused
    let v = std::thread::scope(|s| s.spawn(|| vec![9u8; 3333]).join().unwrap());
    drop(v);
    // (the scope's own bookkeeping, freed here too, is kept as well)
    assert!(pool.stats().retained_bytes >= 3333);
    let h = heap_allocs();
    let w = vec![1u8; 3333];
    assert_eq!(heap_allocs() - h, 0);
    // a pooled block freed on another thread goes to the heap
    let f = std::thread::scope(|s| {
        s.spawn(move || {
            let before = heap_frees();
            drop(w);
            heap_frees() - before
        })
        .join()
        .unwrap()
    });
    assert_eq!(f, 1);
    drop(g);
    // after uninstalling, another thread may install it
    std::thread::scope(|s| {
        s.spawn(|| {
            let _g = pool.install().expect("free again");
            drop(vec![0u8; 100]);
        });
    });
    assert!(pool.stats().retained_bytes >= 100);
}

#[test]
fn dropping_a_pool_returns_every_block_to_the_heap() {
    let pool = FramePool::new(1 << 20);
    let g = pool.install().unwrap();
    let blocks: Vec<Vec<u8>> = (1..50).map(|i| vec![0u8; i * 100]).collect();
    let n = blocks.len() as u64;
    drop(blocks); // 49 blocks of distinct layouts into the pool; the outer Vec too
    drop(g);
    let kept = pool.stats().retained_bytes;
    assert!(kept >= (1..50).map(|i| i * 100).sum::<usize>());
    let f = heap_frees();
    drop(pool);
    // every kept block (49 + the outer Vec's), then the pool's state and its two layout tables
    assert_eq!(heap_frees() - f, n + 1 + 3);
}

#[test]
fn pools_do_not_nest_and_a_leaked_guard_stays_sound() {
    let a = FramePool::new(1 << 20);
    let b = FramePool::new(1 << 20);
    let ga = a.install().unwrap();
    assert!(b.install().is_none(), "a second pool on one thread is refused");
    drop(ga);
    let gb = b.install().expect("free after the first guard is gone");
    drop(gb);
    // a leaked guard: the pool keeps serving this thread, and moving or dropping the pool
    // must not leave the thread pointing at freed memory (the pool's state is leaked instead)
    std::mem::forget(a.install().unwrap());
    let moved = a;
    let v = vec![7u8; 4000];
    drop(v);
    assert!(moved.stats().retained_bytes >= 4000);
    drop(moved);
    let w = vec![8u8; 4000]; // served by the leaked state, which is still valid
    assert!(w.iter().all(|&x| x == 8));
    drop(w);
    assert!(b.install().is_none(), "the thread still has the leaked pool installed");
}

/// The `VmFlags` line of the `/proc/self/smaps` mapping that holds `addr`.
#[cfg(target_os = "linux")]
fn vm_flags(addr: usize) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
        if let Some((a, b)) = range.and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))) {
            inside = (a..b).contains(&addr);
        } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
            return flags.trim().to_owned();
        }
    }
    panic!("no mapping holds {addr:#x}");
}

/// A large uninitialized block from the heap is advised as transparent huge pages (the kernel
/// marks its mapping `hg`, "huge page advise", in smaps, whether or not it could find huge
/// pages); a zeroed one (a KV cache, touched a little at a time) is not.
#[cfg(target_os = "linux")]
#[test]
fn large_uninitialized_blocks_are_advised_as_huge_pages() {
    if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
        eprintln!("SKIPPED: this kernel has no transparent huge pages");
        return;
    }
    let huge = 2usize << 20;
    let big: Vec<u8> = Vec::with_capacity(8 * huge);
    let aligned = (big.as_ptr() as usize).next_multiple_of(huge);
    assert!(vm_flags(aligned).split(' ').any(|f| f == "hg"), "{}", vm_flags(aligned));
    let zeroed = vec![0u8; 8 * huge];
    let aligned = (zeroed.as_ptr() as usize).next_multiple_of(huge);
    assert!(!vm_flags(aligned).split(' ').any(|f| f == "hg"), "{}", vm_flags(aligned));
    black_box((big, zeroed));
}

//! Frame pools: the decode and vocoder threads run their steady state without entering the heap.
//!
//! tract's executor creates every node's output tensors on each run and drops them when their
//! last consumer has run (docs/engine.md "Allocations"): a whole frame asks for thousands of
//! blocks, of the same sizes every frame. A [`FramePool`] keeps the blocks a stage frees, keyed
//! by their exact layout, and hands them back when the stage asks for that layout again; after
//! one warm-up frame no request of the decode or vocoder thread reaches the system allocator (no
//! lock, no `mmap`/`munmap`, no page fault on a fresh mapping).
//!
//! Two parts:
//! - [`Pooled`] is the process's global allocator (installed by the binary with
//!   `#[global_allocator]`). On a thread without a pool it forwards every call to the allocator
//!   it wraps; on a thread where a pool is installed it serves from and returns to that pool.
//! - [`FramePool`] is owned by the engine, one per stage, and lives across utterances; a stage's
//!   thread installs it ([`FramePool::install`]) for as long as it runs.
//!
//! Layouts are exact (no size classes), so a pooled block can always be returned to the heap
//! with the layout it was allocated with, whichever thread frees it, and nothing is wasted on
//! rounding. The only adjustment is a floor of 16 bytes and 8-byte alignment for every block, so
//! each free block can hold the free list's link (applied identically on every thread).
//!
//! A pool keeps at most `cap` bytes: a freed block that would exceed it goes back to the heap,
//! and so does any block larger than a quarter of the cap. The engine also trims a pool after every frame or chunk to the layouts
//! that unit used ([`Installed::trim`]), so a pool holds about one unit's working set.
//!
//! On its way to the heap, a large uninitialized block is advised as transparent huge pages
//! ([`advise_huge_pages`]): loading a bundle writes over a gigabyte of fresh memory, and 2 MiB
//! pages make that one page fault per 2 MiB instead of per 4 KiB.
//!
//! The price is memory: a pool reuses a block only for its own layout, where the heap can split
//! and merge freed memory across sizes, so a stage's peak grows by up to the cap
//! (docs/engine.md "Allocations" has the numbers).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr::{self, null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Number of distinct layouts one pool tracks (open addressing, power of two). A frame of the
/// 0.6B talker + code predictor uses a few hundred distinct layouts; a layout beyond the table
/// bypasses the pool (counted as a heap allocation, so a test would see it).
const ENTRIES: usize = 2048;
/// Smallest block: a free block stores the list's next pointer in its first bytes.
const MIN_SIZE: usize = 16;
/// Smallest alignment, for the same reason (the link is a pointer).
const MIN_ALIGN: usize = 8;

thread_local! {
    /// The state of the pool installed on this thread, or null. It points into the pool's heap
    /// allocation (stable when the `FramePool` value moves; leaked if a guard was leaked).
    static CURRENT: Cell<*const PoolState> = const { Cell::new(null()) };
}

/// The layout actually requested from the wrapped allocator for `l`: at least [`MIN_SIZE`]
/// bytes and [`MIN_ALIGN`] alignment. A pure function of `l`, so allocation and deallocation
/// agree on every thread.
fn effective(l: Layout) -> Layout {
    Layout::from_size_align(l.size().max(MIN_SIZE), l.align().max(MIN_ALIGN)).unwrap_or(l)
}

/// Blocks of at least this many bytes that come from the heap through [`GlobalAlloc::alloc`]
/// are advised as transparent huge pages ([`advise_huge_pages`]): one huge page, 2 MiB on x86-64
/// and on 4 KiB-page AArch64 kernels.
const HUGE_PAGE_BLOCK: usize = 2 << 20;

/// Ask Linux to back the whole 2 MiB-aligned part of a fresh block with transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`), before anything touches it.
///
/// Opening a bundle writes about 1.2 GB of fresh memory at 0.6B q4 (weights read from the
/// graph cache, reshaped and packed): with 4 KiB pages that is some 300,000 page faults, each
/// zeroing and charging one page, about a third of a warm start's CPU time (perf). With
/// `transparent_hugepage` set to `madvise` (Debian's and most boards' default) or `always`,
/// each 2 MiB is one fault; the measured warm start drops by about 0.25 s (docs/performance.md).
/// Only uninitialized blocks are advised: their owner writes them whole (tensors, packed
/// weights), while a zeroed block (`alloc_zeroed`, e.g. a KV cache sized for its capacity) may
/// be touched a little at a time and stays on small pages. The call is advice: where the kernel
/// has no THP or it is `never`, nothing changes and the error is ignored.
///
/// The advice must end with the block ([`unadvise_huge_pages`], on its way back to the heap):
/// glibc keeps freed memory of 2–32 MiB in its heaps, and an advised range reused for small or
/// zeroed blocks would be faulted (and compacted, and collapsed by khugepaged) 2 MiB at a time.
fn advise_huge_pages(p: *mut u8, size: usize) {
    madvise_whole_huge_pages(p, size, true);
}

/// Undo [`advise_huge_pages`] before a block of [`HUGE_PAGE_BLOCK`] bytes or more goes back to
/// the heap (`MADV_NOHUGEPAGE`): with `transparent_hugepage` at `madvise` that is the default
/// again; at `always` the range stays on small pages until a block there is advised again.
fn unadvise_huge_pages(p: *mut u8, size: usize) {
    madvise_whole_huge_pages(p, size, false);
}

/// `madvise` the 2 MiB-aligned part of `[p, p + size)` with `MADV_HUGEPAGE` (`huge`) or
/// `MADV_NOHUGEPAGE`; errors are ignored (advice only).
fn madvise_whole_huge_pages(p: *mut u8, size: usize, huge: bool) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (p as usize).next_multiple_of(HUGE);
        let end = (p as usize + size) & !(HUGE - 1);
        if end > start {
            let advice = if huge { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
            // SAFETY: [start, end) lies inside a block the caller owns; the advice changes how
            // the range is backed, never its contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, size, huge);
}

/// The pool installed on the calling thread, if any.
fn current<'a>() -> Option<&'a PoolState> {
    let p = CURRENT.try_with(Cell::get).unwrap_or(null());
    // SAFETY: a non-null pointer was set by `FramePool::install` and is reset by the guard's
    // drop, which the borrow of the pool outlives; if the guard was leaked instead, the pool's
    // drop leaks the state, so the pointer stays valid.
    if p.is_null() { None } else { Some(unsafe { &*p }) }
}

/// The global allocator that serves threads with an installed [`FramePool`] from it and
/// forwards everything else to `A` (usually [`std::alloc::System`]).
///
/// Install once per binary:
/// `#[global_allocator] static ALLOC: Pooled<System> = Pooled::new(System);`
#[derive(Debug)]
pub struct Pooled<A> {
    inner: A,
}

impl<A> Pooled<A> {
    /// Wrap `inner`.
    pub const fn new(inner: A) -> Self {
        Pooled { inner }
    }
}

// SAFETY: every block handed out comes from `inner` with `effective(layout)`, which satisfies
// `layout` (at least as large, at least as aligned); pooled blocks are handed out again only for
// the identical effective layout, and every block given back to `inner` carries the effective
// layout it was allocated with.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Pooled<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let e = effective(layout);
        if let Some(pool) = current() {
            // SAFETY: the pool is installed on this thread only (see `install`).
            let p = unsafe { pool.pop(e) };
            if !p.is_null() {
                return p;
            }
            pool.heap.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: `e` has a non-zero size; the caller's contract otherwise.
        let p = unsafe { self.inner.alloc(e) };
        if e.size() >= HUGE_PAGE_BLOCK && !p.is_null() {
            advise_huge_pages(p, e.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let e = effective(layout);
        if let Some(pool) = current() {
            // SAFETY: as in `alloc`.
            let p = unsafe { pool.pop(e) };
            if !p.is_null() {
                // SAFETY: the block is `e.size()` bytes, owned by the caller from now on.
                unsafe { ptr::write_bytes(p, 0, e.size()) };
                return p;
            }
            pool.heap.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as in `alloc`.
        unsafe { self.inner.alloc_zeroed(e) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let e = effective(layout);
        if let Some(pool) = current() {
            // SAFETY: `ptr` was allocated by this allocator with `layout`, hence from `inner`
            // with `e`; the pool is installed on this thread only.
            if unsafe { pool.push(ptr, e) } {
                return;
            }
        }
        if e.size() >= HUGE_PAGE_BLOCK {
            unadvise_huge_pages(ptr, e.size());
        }
        // SAFETY: as above.
        unsafe { self.inner.dealloc(ptr, e) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = effective(layout);
        // SAFETY (from_size_align_unchecked): the caller guarantees `new_size`, rounded up to
        // `layout.align()`, does not overflow isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // the size as raised for the link must stay a valid layout at the raised alignment
        let Ok(new) = Layout::from_size_align(new_size.max(MIN_SIZE), layout.align().max(MIN_ALIGN)) else {
            return null_mut();
        };
        if current().is_none() {
            // the heap may free the old block inside `realloc`: its advice ends here
            if old.size() >= HUGE_PAGE_BLOCK {
                unadvise_huge_pages(ptr, old.size());
            }
            // SAFETY: `ptr` came from `inner` with `old`; `new` keeps its alignment.
            return unsafe { self.inner.realloc(ptr, old, new.size()) };
        }
        if new.size() == old.size() {
            return ptr;
        }
        // SAFETY: `alloc`/`dealloc` contracts, with the caller's `ptr` and `layout`.
        unsafe {
            let p = self.alloc(new_layout);
            if !p.is_null() {
                ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            p
        }
    }
}

/// One layout's free list.
#[derive(Clone, Copy)]
struct Entry {
    /// Effective size in bytes (0: unused entry).
    size: usize,
    /// Effective alignment in bytes.
    align: usize,
    /// First free block; each free block starts with the next one's address.
    head: *mut u8,
    /// Free blocks in the list.
    blocks: usize,
    /// Pool clock at the last use (trimming drops what was not used since the last trim).
    last: u64,
}

impl Entry {
    /// Give every block of the list back to the heap and empty it.
    ///
    /// # Safety
    /// The pool must not be installed on the calling thread (the blocks would come back).
    unsafe fn free_all(&mut self) {
        // SAFETY: (size, align) came from a valid layout.
        let l = unsafe { Layout::from_size_align_unchecked(self.size, self.align) };
        while !self.head.is_null() {
            let b = self.head;
            // SAFETY: the block came from the global allocator (a `Pooled`: only it pushes
            // blocks) with the effective layout `l`, and `effective(l) == l`.
            unsafe {
                self.head = ptr::read_unaligned(b.cast::<*mut u8>());
                std::alloc::dealloc(b, l);
            }
        }
        self.blocks = 0;
    }
}

const UNUSED: Entry = Entry { size: 0, align: 0, head: null_mut(), blocks: 0, last: 0 };

struct Table {
    entries: [Entry; ENTRIES],
    /// Advances at every pop and push.
    clock: u64,
    /// Clock at the last trim: entries last used before it are stale at the next trim.
    mark: u64,
    /// Entries with a key.
    used: usize,
}

impl Table {
    fn new() -> Box<UnsafeCell<Table>> {
        Box::new(UnsafeCell::new(Table { entries: [UNUSED; ENTRIES], clock: 0, mark: 0, used: 0 }))
    }

    /// Index of the entry keyed (size, align), or of the empty entry where it belongs; None
    /// when neither exists (the table is full).
    fn find(&self, size: usize, align: usize) -> Option<usize> {
        let h = (size as u64 ^ (align as u64).rotate_left(48)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut i = (h >> (64 - ENTRIES.trailing_zeros())) as usize;
        for _ in 0..ENTRIES {
            let en = &self.entries[i];
            if en.size == 0 || (en.size == size && en.align == align) {
                return Some(i);
            }
            i = (i + 1) & (ENTRIES - 1);
        }
        None
    }
}

/// What a pool did, counted since it was created (all monotonic except the two byte counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Requests served from the pool (no heap call).
    pub served: u64,
    /// Requests of the installed thread that had to go to the heap (none pooled of the layout).
    pub heap_allocations: u64,
    /// Freed blocks given back to the heap because of the cap or a full layout table.
    pub passed: u64,
    /// Bytes held in free lists now.
    pub retained_bytes: usize,
    /// Most bytes ever held in free lists at once.
    pub high_water_bytes: usize,
    /// Distinct layouts the pool tracks now (at most 2048).
    pub layouts: usize,
}

impl PoolStats {
    /// Counts accumulated since `earlier` (byte counts are taken from `self`).
    pub fn since(&self, earlier: &PoolStats) -> PoolStats {
        PoolStats {
            served: self.served - earlier.served,
            heap_allocations: self.heap_allocations - earlier.heap_allocations,
            passed: self.passed - earlier.passed,
            ..*self
        }
    }
}

/// A stage's pool of freed blocks, reused by exact layout. See the module docs.
///
/// Owned by the engine; installed on one thread at a time. Dropping it returns every block to
/// the heap.
pub struct FramePool {
    /// Boxed so that the address the installed thread keeps survives moves of the pool;
    /// leaked instead of dropped if an [`Installed`] guard was leaked.
    state: ManuallyDrop<Box<PoolState>>,
}

/// A pool's free lists and counters.
struct PoolState {
    table: Box<UnsafeCell<Table>>,
    /// Where [`Installed::trim`] rebuilds the table without its stale keys (then swapped in).
    spare: Box<UnsafeCell<Table>>,
    busy: AtomicBool,
    cap: usize,
    retained: AtomicUsize,
    high_water: AtomicUsize,
    layouts: AtomicUsize,
    served: AtomicU64,
    heap: AtomicU64,
    passed: AtomicU64,
}

// SAFETY: the table is touched only by the thread the pool is installed on (`busy` admits one
// at a time, with acquire/release ordering between successive holders) and by the pool's drop
// (`&mut`, no guard alive); the counters are atomics.
unsafe impl Sync for PoolState {}
// SAFETY: the raw pointers in the table are blocks owned by the pool, not tied to a thread.
unsafe impl Send for PoolState {}

impl std::fmt::Debug for FramePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FramePool").field("cap", &self.state.cap).field("stats", &self.stats()).finish()
    }
}

/// Keeps a [`FramePool`] installed on the current thread; dropping it uninstalls the pool (the
/// blocks stay in the pool for the next thread that installs it).
///
/// Not `Send`: it uninstalls on the thread that installed.
pub struct Installed<'a> {
    pool: &'a PoolState,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Installed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installed").field("cap", &self.pool.cap).finish_non_exhaustive()
    }
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.set(null()));
        self.pool.busy.store(false, Ordering::Release);
    }
}

impl Installed<'_> {
    /// End of a unit of work (a frame, a chunk): give back to the heap every block of a layout
    /// neither requested nor freed since the previous trim, and forget those layouts; what the
    /// last unit used stays. The engine trims after every frame and every chunk, so a pool keeps
    /// about one unit's working set: the steady state stays off the heap, and the layouts of a
    /// slot tier or ramp window left behind do not pile up.
    ///
    /// Costs a scan of the layout table (2048 entries); the heap is touched only when layouts
    /// were dropped.
    pub fn trim(&mut self) {
        // SAFETY: the pool is installed on this thread (the guard is not Send), so the table is
        // ours alone.
        let t = unsafe { &mut *self.pool.table.get() };
        let mark = t.mark;
        self.drop_used_before(mark);
    }

    /// Give every block back to the heap and forget every layout: before a unit of work whose
    /// layouts differ from the last one's (a vocoder window of another length), so the pool
    /// never holds two working sets at once.
    pub fn release(&mut self) {
        self.drop_used_before(u64::MAX);
    }

    /// Drop the layouts last used at or before `mark`, and start a new trim period.
    fn drop_used_before(&mut self, mark: u64) {
        let pool = self.pool;
        // SAFETY: as in `trim`.
        let t = unsafe { &mut *pool.table.get() };
        t.mark = t.clock;
        if !t.entries.iter().any(|e| e.size != 0 && e.last <= mark) {
            return;
        }
        // blocks go back with the pool uninstalled, so the global allocator hands them to the heap
        let installed = CURRENT.try_with(|c| c.replace(null())).unwrap_or(null());
        // SAFETY: as above; `spare` is only used here.
        let spare = unsafe { &mut *pool.spare.get() };
        spare.entries.fill(UNUSED);
        spare.used = 0;
        let mut freed = 0usize;
        for en in &mut t.entries {
            if en.size == 0 {
                continue;
            }
            if en.last > mark
                && let Some(j) = spare.find(en.size, en.align)
            {
                spare.entries[j] = *en;
                spare.used += 1;
                continue;
            }
            freed += en.blocks * en.size;
            // SAFETY: the pool is uninstalled from this thread for the duration.
            unsafe { en.free_all() };
        }
        t.entries.copy_from_slice(&spare.entries);
        t.used = spare.used;
        pool.retained.fetch_sub(freed, Ordering::Relaxed);
        pool.layouts.store(t.used, Ordering::Relaxed);
        let _ = CURRENT.try_with(|c| c.set(installed));
    }
}

impl FramePool {
    /// An empty pool that keeps at most `cap` bytes of freed blocks (0: keeps nothing; every
    /// request goes to the heap, and is counted).
    pub fn new(cap: usize) -> FramePool {
        FramePool { state: ManuallyDrop::new(Box::new(PoolState::new(cap))) }
    }

    /// The cap in bytes.
    pub fn cap(&self) -> usize {
        self.state.cap
    }

    /// Counters so far.
    pub fn stats(&self) -> PoolStats {
        self.state.stats()
    }

    /// Serve the calling thread's allocations from this pool until the guard is dropped.
    ///
    /// Returns `None` (and changes nothing) when the pool is installed on another thread right
    /// now (a pool's free lists have one owner at a time), or when this thread already has a
    /// pool installed (pools do not nest). Only effective when the process's global allocator is
    /// [`Pooled`]; otherwise the pool simply stays empty.
    pub fn install(&self) -> Option<Installed<'_>> {
        let state: &PoolState = &self.state;
        if CURRENT.try_with(|c| !c.get().is_null()).unwrap_or(true) {
            return None;
        }
        if state.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return None;
        }
        if CURRENT.try_with(|c| c.set(state as *const PoolState)).is_err() {
            state.busy.store(false, Ordering::Release);
            return None;
        }
        Some(Installed { pool: state, _not_send: PhantomData })
    }
}

impl PoolState {
    fn new(cap: usize) -> PoolState {
        PoolState {
            table: Table::new(),
            spare: Table::new(),
            busy: AtomicBool::new(false),
            cap,
            retained: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
            layouts: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            heap: AtomicU64::new(0),
            passed: AtomicU64::new(0),
        }
    }

    /// Counters so far.
    fn stats(&self) -> PoolStats {
        PoolStats {
            served: self.served.load(Ordering::Relaxed),
            heap_allocations: self.heap.load(Ordering::Relaxed),
            passed: self.passed.load(Ordering::Relaxed),
            retained_bytes: self.retained.load(Ordering::Relaxed),
            high_water_bytes: self.high_water.load(Ordering::Relaxed),
            layouts: self.layouts.load(Ordering::Relaxed),
        }
    }

    /// Take a free block of exactly `e`, or null.
    ///
    /// # Safety
    /// Only the thread the pool is installed on may call it.
    unsafe fn pop(&self, e: Layout) -> *mut u8 {
        // SAFETY: exclusive access per the contract.
        let t = unsafe { &mut *self.table.get() };
        let (size, align) = (e.size(), e.align());
        let Some(i) = t.find(size, align) else { return null_mut() };
        t.clock += 1;
        let clock = t.clock;
        let en = &mut t.entries[i];
        if en.size == 0 {
            return null_mut();
        }
        // a request counts as a use: the layout stays through the next trim
        en.last = clock;
        if en.head.is_null() {
            return null_mut();
        }
        let p = en.head;
        // SAFETY: a free block of at least MIN_SIZE bytes holds its successor's address.
        en.head = unsafe { ptr::read_unaligned(p.cast::<*mut u8>()) };
        en.blocks -= 1;
        self.retained.fetch_sub(size, Ordering::Relaxed);
        self.served.fetch_add(1, Ordering::Relaxed);
        p
    }

    /// Keep the freed block `p` of layout `e`; false when it must go to the heap instead (above
    /// a quarter of the cap, no room left under the cap, or the layout table full).
    ///
    /// # Safety
    /// Only the thread the pool is installed on may call it; `p` was allocated from `heap` with
    /// `e` and is no longer used.
    unsafe fn push(&self, p: *mut u8, e: Layout) -> bool {
        // SAFETY: exclusive access per the contract.
        let t = unsafe { &mut *self.table.get() };
        let (size, align) = (e.size(), e.align());
        // a block above a quarter of the cap would push out much of the working set
        if size > self.cap / 4 {
            self.passed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // keep the table at most three quarters full, so probes stay short
        let Some(i) = t.find(size, align).filter(|&i| t.entries[i].size != 0 || t.used < ENTRIES * 3 / 4) else {
            self.passed.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        // full: the block goes back to the heap. What the pool already holds stays: a stage
        // repeats the same sequence of layouts every unit, so the blocks kept first are asked for
        // again first (evicting the oldest would evict exactly the next ones needed).
        if self.retained.load(Ordering::Relaxed) + size > self.cap {
            self.passed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let en = &mut t.entries[i];
        if en.size == 0 {
            *en = Entry { size, align, ..UNUSED };
            t.used += 1;
            self.layouts.store(t.used, Ordering::Relaxed);
        }
        t.clock += 1;
        let clock = t.clock;
        let en = &mut t.entries[i];
        // SAFETY: the block is at least MIN_SIZE bytes and ours now.
        unsafe { ptr::write_unaligned(p.cast::<*mut u8>(), en.head) };
        en.head = p;
        en.blocks += 1;
        en.last = clock;
        let now = self.retained.fetch_add(size, Ordering::Relaxed) + size;
        self.high_water.fetch_max(now, Ordering::Relaxed);
        true
    }
}

impl Drop for FramePool {
    fn drop(&mut self) {
        // `&mut self`: no guard is alive; `busy` still set means a guard was leaked, and its
        // thread may still point at the state: leak it rather than free it under that thread
        if *self.state.busy.get_mut() {
            return;
        }
        let state: &mut PoolState = &mut self.state;
        let t = state.table.get_mut();
        for en in &mut t.entries {
            if en.size == 0 {
                continue;
            }
            // SAFETY: `&mut self`: not installed anywhere (a leaked guard returned above).
            unsafe { en.free_all() };
        }
        state.retained.store(0, Ordering::Relaxed);
        // SAFETY: not used again; the blocks are back on the heap.
        unsafe { ManuallyDrop::drop(&mut self.state) };
    }
}

//! Compute threads: tract's matrix-product executor, process-wide or per pipeline stage.

use std::cell::RefCell;
use std::sync::Arc;

use model::backend::{BackendError, PinThread, StageCompute};
use tract_linalg::multithread::{Executor, multithread_tract_scope, set_default_executor};

/// Use `threads` compute threads for the matrix products of every graph (tract's default
/// executor; the decode and vocoder stages may keep their own on top, [`StageThreads`]). 0 or 1:
/// single-threaded.
///
/// Process-wide: call it once, before loading, from the binary.
pub fn set_compute_threads(threads: usize) {
    set_default_executor(if threads > 1 { Executor::multithread(threads) } else { Executor::SingleThread });
}

/// One stage's executor: `threads` rayon threads, each pinned by the engine's `pin` as it starts
/// (one thread: single-threaded products on the stage's own thread; none: the default executor).
pub struct StageThreads {
    executor: Option<Executor>,
    /// herald's Q4_0 products split over the stage's CPUs ([`SplitPool`]); `None` with one CPU
    /// or `HERALD_Q4_SPLIT=0`.
    split: Option<Arc<SplitPool>>,
}

impl std::fmt::Debug for StageThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageThreads")
            .field("own_executor", &self.executor.is_some())
            .field("split_threads", &self.split.as_ref().map(|s| s.wanted + 1))
            .finish()
    }
}

impl StageThreads {
    /// The executor of the stage `stage` with `threads` threads, and with two or more the
    /// [`SplitPool`] that splits herald's Q4_0 products over them (unless the environment
    /// variable `HERALD_Q4_SPLIT` is `0`: for comparisons).
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when a thread cannot be started.
    pub fn new(stage: &str, threads: usize, pin: PinThread) -> Result<Self, BackendError> {
        let split = match threads {
            0 | 1 => None,
            _ if std::env::var("HERALD_Q4_SPLIT").is_ok_and(|v| v == "0") => None,
            n => Some(Arc::new(SplitPool::new(stage, n, pin.clone()))),
        };
        let executor = match threads {
            0 => None,
            1 => Some(Executor::SingleThread),
            n => {
                let name = format!("herald-{stage}");
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(move |i| format!("{name}-mm{i}"))
                    .start_handler(move |_| pin())
                    .build()
                    .map_err(|e| BackendError::Unsupported(format!("cannot start the {stage} thread pool: {e}")))?;
                Some(Executor::MultiThread(std::sync::Arc::new(pool)))
            }
        };
        Ok(StageThreads { executor, split })
    }
}

impl StageCompute for StageThreads {
    fn run(&self, f: &mut dyn FnMut()) {
        /// Puts the previous split back when the stage ends, also when it panics.
        struct Restore(Option<Arc<SplitPool>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT_SPLIT.set(self.0.take());
            }
        }
        let _restore = Restore(CURRENT_SPLIT.replace(self.split.clone()));
        match &self.executor {
            Some(ex) => multithread_tract_scope(ex.clone(), &mut *f),
            None => f(),
        }
    }
}

thread_local! {
    /// The [`SplitPool`] of the stage running on this thread ([`StageThreads::run`]).
    static CURRENT_SPLIT: RefCell<Option<Arc<SplitPool>>> = const { RefCell::new(None) };
}

/// Runs `f` with the split of the stage running on this thread, [`kernels::q4::Serial`] outside
/// any stage or on one CPU.
pub(crate) fn with_split<R>(f: impl FnOnce(&dyn kernels::q4::Split) -> R) -> R {
    // a clone of the Arc (no allocation), so that `f` runs without a borrow of the cell
    match CURRENT_SPLIT.with_borrow(Option::clone) {
        Some(pool) => f(&*pool),
        None => f(&kernels::q4::Serial),
    }
}

/// The decode stage's helpers for herald's Q4_0 products ([`kernels::q4::Split`]): `threads − 1`
/// worker threads, pinned to the stage's CPUs, that take parts of a product beside the stage's
/// own thread (issue 36, item 3), started with the stage's first product (a stage without
/// any, the vocoder's, starts none). No thread is started and nothing is allocated per product:
/// the caller publishes the product under a new generation, every thread (the caller too)
/// claims parts with one compare-and-swap each until none are left, and the caller returns
/// when all have finished. Between products the workers spin for [`SPIN`] before they sleep
/// on a condition variable, so that the products of one step (a few µs apart) find them
/// awake, and an idle stage costs no CPU after that.
pub(crate) struct SplitPool {
    shared: Arc<Shared>,
    /// Workers to start, and how ([`SplitPool::workers`]).
    wanted: usize,
    stage: String,
    pin: PinThread,
    /// Started on the first product, so that a stage without Q4_0 products (the vocoder's)
    /// never starts any.
    workers: std::sync::OnceLock<Vec<std::thread::JoinHandle<()>>>,
}

/// How long an idle worker spins for the next product before it sleeps: 200 µs, longer than
/// the gaps between the products of one decode step (attention, norms and sampling: tens of
/// µs at 0.6B on the build machine), much shorter than a step.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// The job the workers share. `state` holds the generation in its high 32 bits, the product's
/// part count in the next 16 and the next unclaimed part in the low 16 ([`unpack`]); a part is
/// claimed by a compare-and-swap of the whole word, so a thread that saw an older generation
/// can never claim a part of a newer product.
struct Shared {
    state: std::sync::atomic::AtomicU64,
    /// Parts of the current product that have returned.
    done: std::sync::atomic::AtomicUsize,
    /// The current product's parts; written by the caller only while no part is claimable
    /// (before it publishes a generation), read by a thread only after it claimed a part.
    job: std::cell::UnsafeCell<Option<Job>>,
    sleepers: std::sync::atomic::AtomicUsize,
    lock: std::sync::Mutex<()>,
    wake: std::sync::Condvar,
    quit: std::sync::atomic::AtomicBool,
    /// A product is running: a second `run` meanwhile (nested in a part, or from another
    /// thread sharing the pool) runs its parts serially instead of touching the job.
    busy: std::sync::atomic::AtomicBool,
    /// A part panicked (a bug in a kernel): `run` resumes the first such panic on the caller's
    /// thread once all parts are done.
    panicked: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// The borrowed parts of one product, its lifetime erased: valid while the product runs
/// (`SplitPool::run` returns only after every claimed part has returned).
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync` and outlives every use (see `Shared::job`).
unsafe impl Send for Job {}
// SAFETY: the cell is written only while no thread may read it (see `Shared::job`).
unsafe impl Sync for Shared {}

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

impl Shared {
    /// Claims and runs parts of generation `generation` until none are left; returns how many
    /// it ran.
    fn work(&self, generation: u64) -> usize {
        let mut ran = 0;
        loop {
            let s = self.state.load(Acquire);
            let (g, parts, next) = unpack(s);
            if g != generation || next >= parts {
                return ran;
            }
            if self.state.compare_exchange_weak(s, s + 1, Acquire, Relaxed).is_err() {
                continue;
            }
            // SAFETY: a claimed part of the current generation: the job is set and lives until
            // `done` counts this part.
            if let Some(Job(f)) = unsafe { *self.job.get() } {
                // a panicking part (a bug) is counted as done and reported by `run`, so that
                // the caller never waits for it
                // SAFETY: as above.
                if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*f)(next) })) {
                    let mut first = self.panicked.lock().unwrap_or_else(|e| e.into_inner());
                    if first.is_none() {
                        *first = Some(payload);
                    } else {
                        // a second payload is not dropped here: its drop could panic outside
                        // the catch and leave the part uncounted
                        std::mem::forget(payload);
                    }
                }
            }
            self.done.fetch_add(1, Release);
            ran += 1;
        }
    }
}

/// The most parts one product may have: the state word keeps the part count and the next part
/// in 16 bits each.
const MAX_PARTS: usize = 0xFFFF;

/// `(generation, parts, next part)` of a state word.
fn unpack(s: u64) -> (u64, usize, usize) {
    (s >> 32, ((s >> 16) & 0xFFFF) as usize, (s & 0xFFFF) as usize)
}

impl SplitPool {
    /// A pool of `threads − 1` workers (none for 0 or 1), each running `pin` first; they start
    /// with the first product ([`SplitPool::workers`]).
    pub(crate) fn new(stage: &str, threads: usize, pin: PinThread) -> Self {
        let shared = Arc::new(Shared {
            state: Default::default(),
            done: Default::default(),
            job: std::cell::UnsafeCell::new(None),
            sleepers: Default::default(),
            lock: Default::default(),
            wake: Default::default(),
            quit: Default::default(),
            busy: Default::default(),
            panicked: Default::default(),
        });
        SplitPool { shared, wanted: threads.saturating_sub(1), stage: stage.to_string(), pin, workers: Default::default() }
    }

    /// The workers, started on the first call; one that cannot be started is logged and the
    /// pool works with those that did (none: every product on the caller's thread).
    fn workers(&self) -> &[std::thread::JoinHandle<()>] {
        self.workers.get_or_init(|| {
            let mut started = Vec::with_capacity(self.wanted);
            for i in 1..=self.wanted {
                let (shared, pin) = (self.shared.clone(), self.pin.clone());
                match std::thread::Builder::new().name(format!("herald-{}-q4-{i}", self.stage)).spawn(move || {
                    pin();
                    worker(&shared);
                }) {
                    Ok(w) => started.push(w),
                    Err(e) => {
                        log::warn!(
                            "cannot start the {} stage's product thread {i}: {e}; splitting over {} threads",
                            self.stage,
                            started.len() + 1
                        );
                        break;
                    }
                }
            }
            started
        })
    }
}

/// A worker: waits for each new generation (spinning, then sleeping), works on it.
fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let spin_from = std::time::Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            if shared.quit.load(Acquire) {
                return;
            }
            let g = shared.state.load(Acquire) >> 32;
            if g != seen {
                break g;
            }
            spins += 1;
            if !spins.is_multiple_of(64) || spin_from.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.sleepers.fetch_add(1, SeqCst);
            if shared.state.load(SeqCst) >> 32 == seen && !shared.quit.load(SeqCst) {
                drop(shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
            } else {
                drop(guard);
            }
            shared.sleepers.fetch_sub(1, SeqCst);
        };
        seen = generation;
        shared.work(generation);
    }
}

impl kernels::q4::Split for SplitPool {
    fn threads(&self) -> usize {
        self.workers().len() + 1
    }

    fn run(&self, parts: usize, part: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if self.workers().is_empty() || parts <= 1 || parts > MAX_PARTS || s.busy.swap(true, Acquire) {
            (0..parts).for_each(part);
            return;
        }
        // SAFETY: only the lifetime is erased; the job is cleared below before `part` ends.
        let job: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(part as *const (dyn Fn(usize) + Sync)) };
        // 32 bits of generation, wrapping (a worker only compares it for a change)
        let generation = ((s.state.load(Relaxed) >> 32) + 1) & 0xFFFF_FFFF;
        // SAFETY: no part is claimable now (the last generation's were all claimed and have
        // returned), so no thread reads the cell.
        unsafe { *s.job.get() = Some(Job(job)) };
        s.done.store(0, Relaxed);
        s.state.store(generation << 32 | (parts as u64) << 16, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            drop(s.lock.lock().unwrap_or_else(|e| e.into_inner()));
            s.wake.notify_all();
        }
        s.work(generation);
        while s.done.load(Acquire) < parts {
            std::hint::spin_loop();
        }
        // SAFETY: every part has returned and none is claimable: no thread reads the cell.
        unsafe { *s.job.get() = None };
        s.busy.store(false, Release);
        if let Some(payload) = s.panicked.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(payload);
        }
    }
}

impl Drop for SplitPool {
    fn drop(&mut self) {
        self.shared.quit.store(true, SeqCst);
        drop(self.shared.lock.lock().unwrap_or_else(|e| e.into_inner()));
        self.shared.wake.notify_all();
        for w in self.workers.take().unwrap_or_default() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::q4::Split;
    use std::sync::atomic::AtomicUsize;

    /// Every part of every product runs exactly once, on more than one thread, over many
    /// products in a row (the generations of back-to-back products, workers spinning), after
    /// the workers fell asleep (longer than `SPIN` between products) and with more parts than
    /// threads; dropping the pool joins its workers.
    #[test]
    fn the_split_pool_runs_every_part_once() {
        let pool = SplitPool::new("test", 3, Arc::new(|| {}));
        assert_eq!(pool.threads(), 3);
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        for round in 0..2000usize {
            let parts = 1 + round % 7;
            let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            pool.run(parts, &|i| {
                counts[i].fetch_add(1, SeqCst);
                threads.lock().unwrap().insert(std::thread::current().id());
            });
            assert!(counts.iter().all(|c| c.load(SeqCst) == 1), "round {round}: {counts:?}");
            if round % 500 == 499 {
                std::thread::sleep(SPIN * 10);
            }
        }
        // parts long enough that the workers wake and take some (the caller alone could take
        // every short part before a worker looks)
        threads.lock().unwrap().clear();
        pool.run(4, &|_| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            threads.lock().unwrap().insert(std::thread::current().id());
        });
        assert!(threads.lock().unwrap().len() > 1, "the parts all ran on one thread");
        drop(pool);
    }

    /// A panicking part is reported by `run` (a panic on the caller's thread), after the other
    /// parts have finished, and the pool still works after it.
    #[test]
    fn a_panicking_part_panics_the_caller_and_never_hangs() {
        let pool = SplitPool::new("test", 2, Arc::new(|| {}));
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(4, &|i| {
                assert!(i != 2, "part 2 fails");
                done.fetch_add(1, SeqCst);
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(SeqCst), 3);
        let again = AtomicUsize::new(0);
        pool.run(3, &|_| {
            again.fetch_add(1, SeqCst);
        });
        assert_eq!(again.load(SeqCst), 3);
    }

    /// A stage of two threads splits herald's Q4_0 products: inside `run`, `with_split` hands the
    /// kernels the stage's pool, and a product of 80 panels (two parts) through it is bit for bit
    /// the serial one, for every kernel this CPU runs (float32 and int8 activations), one row
    /// and two passes; no worker starts before the first product; outside `run`, and on a stage
    /// of one thread, nothing is split; and the stage's pool is put back when the stage's
    /// closure panics.
    #[test]
    fn a_stage_with_two_threads_splits_the_products() {
        use kernels::q4::{Kernel, Q4Weights};
        let (n, k) = (4 * 80, 256);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut blocks = Vec::new();
        for _ in 0..n * k / 32 {
            let d = half::f16::from_f32(0.01 + (next() % 100) as f32 / 1000.0);
            blocks.extend_from_slice(&d.to_bits().to_le_bytes());
            blocks.extend((0..16).map(|_| next() as u8));
        }
        let x: Vec<f32> = (0..5 * k).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let stage = StageThreads::new("test", 2, Arc::new(|| {})).unwrap();
        assert_eq!(with_split(|s| s.threads()), 1);
        // a stage that runs no product (the vocoder's) starts no worker
        stage.run(&mut || {});
        assert!(stage.split.as_ref().is_some_and(|s| s.workers.get().is_none()), "workers started without a product");
        for kernel in Kernel::available() {
            let w = Q4Weights::from_q4_0(&blocks, n, k, kernel.layout()).unwrap();
            for rows in [1, 5] {
                let mut serial = vec![f32::NAN; rows * n];
                kernel.product(&w, &x[..rows * k], &mut serial);
                let mut split = vec![f32::NAN; rows * n];
                let mut threads = 0;
                stage.run(&mut || {
                    threads = with_split(|s| {
                        kernel.product_split(&w, &x[..rows * k], &mut split, s);
                        s.threads()
                    })
                });
                assert_eq!(threads, 2);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&split), bits(&serial), "{kernel:?}, {rows} rows");
            }
        }
        assert_eq!(with_split(|s| s.threads()), 1);
        let one = StageThreads::new("test", 1, Arc::new(|| {})).unwrap();
        let mut inside = 0;
        one.run(&mut || inside = with_split(|s| s.threads()));
        assert_eq!(inside, 1);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage.run(&mut || panic!("the stage fails"))));
        assert!(r.is_err());
        assert_eq!(with_split(|s| s.threads()), 1, "the stage's pool was left installed after its panic");
    }

    /// A `run` inside a part (nested) and two `run`s at once from two threads on one pool: every
    /// part of every product runs exactly once and nothing hangs (the second caller runs its
    /// parts serially while the pool is busy).
    #[test]
    fn nested_and_concurrent_runs_run_every_part_once() {
        let pool = SplitPool::new("test", 3, Arc::new(|| {}));
        let outer: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        let inner: Vec<AtomicUsize> = (0..4 * 3).map(|_| AtomicUsize::new(0)).collect();
        pool.run(4, &|i| {
            outer[i].fetch_add(1, SeqCst);
            pool.run(3, &|j| {
                inner[i * 3 + j].fetch_add(1, SeqCst);
            });
        });
        assert!(outer.iter().chain(&inner).all(|c| c.load(SeqCst) == 1), "{outer:?} {inner:?}");
        let counts: Vec<AtomicUsize> = (0..2 * 500 * 5).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for t in 0..2 {
                let (pool, counts) = (&pool, &counts);
                s.spawn(move || {
                    for round in 0..500 {
                        pool.run(5, &|i| {
                            counts[(t * 500 + round) * 5 + i].fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert!(counts.iter().all(|c| c.load(SeqCst) == 1));
    }
}

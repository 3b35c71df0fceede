//! Compute threads: tract's matrix-product executor, process-wide or per pipeline stage.

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
}

impl std::fmt::Debug for StageThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageThreads").field("own_executor", &self.executor.is_some()).finish()
    }
}

impl StageThreads {
    /// The executor of the stage `stage` with `threads` threads.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when the thread pool cannot be started.
    pub fn new(stage: &str, threads: usize, pin: PinThread) -> Result<Self, BackendError> {
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
        Ok(StageThreads { executor })
    }
}

impl StageCompute for StageThreads {
    fn run(&self, f: &mut dyn FnMut()) {
        match &self.executor {
            Some(ex) => multithread_tract_scope(ex.clone(), f),
            None => f(),
        }
    }
}

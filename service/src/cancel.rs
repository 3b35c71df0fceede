//! Cancelling: a [`Cancel`] handle per job, and the process-wide [`Stop`] (SIGINT/SIGTERM) that
//! cancels every job in progress and every job after it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// One job's cancel handle: cheap to clone, set once, never cleared. The engine checks it every
/// frame and every chunk, so a cancelled job stops within a frame (its audio so far is finished
/// cleanly); a job cancelled before it started is not started. Cancelling one job never touches
/// another.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// A handle that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancel the job.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether [`cancel`](Self::cancel) was called (by anyone holding a clone, or by [`Stop`]).
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// The flag itself, for [`engine::Engine::synthesize`].
    pub fn flag(&self) -> &AtomicBool {
        &self.0
    }

    fn same(&self, other: &Cancel) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The process-wide stop: once [`stop`](Self::stop) is called (the SIGINT/SIGTERM handler), every
/// job in progress is cancelled, and every job that starts later is cancelled as it starts.
/// Clones share the state.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<StopState>);

#[derive(Debug, Default)]
struct StopState {
    stopped: AtomicBool,
    /// The jobs in progress ([`Stop::guard`]).
    running: Mutex<Vec<Cancel>>,
}

impl Stop {
    /// A stop that has not been called.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stop: cancel the jobs in progress and every later one.
    pub fn stop(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        for job in self.running().iter() {
            job.cancel();
        }
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn is_stopped(&self) -> bool {
        self.0.stopped.load(Ordering::SeqCst)
    }

    /// Register `job` as in progress until the guard is dropped; cancels it now when the stop
    /// was already called.
    pub fn guard(&self, job: &Cancel) -> StopGuard<'_> {
        self.running().push(job.clone());
        // after the push: either stop() sees the job, or this sees the stop
        if self.is_stopped() {
            job.cancel();
        }
        StopGuard { stop: self, job: job.clone() }
    }

    fn running(&self) -> MutexGuard<'_, Vec<Cancel>> {
        // a list of flags stays consistent whatever panicked while holding it
        self.0.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A job registered with a [`Stop`] (see [`Stop::guard`]).
#[derive(Debug)]
pub struct StopGuard<'a> {
    stop: &'a Stop,
    job: Cancel,
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        let mut running = self.stop.running();
        if let Some(i) = running.iter().position(|j| j.same(&self.job)) {
            running.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_cancels_the_running_jobs_and_later_ones_only_while_registered() {
        let stop = Stop::new();
        let (a, b) = (Cancel::new(), Cancel::new());
        let done = Cancel::new();
        drop(stop.guard(&done));
        let ga = stop.guard(&a);
        assert!(!a.is_cancelled());
        stop.stop();
        assert!(a.is_cancelled() && stop.is_stopped());
        assert!(!done.is_cancelled(), "a job that ended before the stop is left alone");
        let _gb = stop.guard(&b);
        assert!(b.is_cancelled(), "a job starting after the stop is cancelled at once");
        drop(ga);
        assert_eq!(stop.running().len(), 1);
    }

    #[test]
    fn cancelling_one_job_leaves_the_others() {
        let (a, b) = (Cancel::new(), Cancel::new());
        let a2 = a.clone();
        a2.cancel();
        assert!(a.is_cancelled() && !b.is_cancelled());
    }
}

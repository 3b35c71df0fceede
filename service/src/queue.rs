//! The job queue: a worker thread that owns the speaker and runs one job at a time from a
//! bounded queue. Admission: [`Queue::try_submit`] refuses a job when the queue is full
//! ([`Refused::Full`]), so a network front-end can answer "busy" at once; [`Queue::submit`]
//! waits for room instead (backpressure). Every job has its own [`Cancel`] handle; the
//! process-wide [`Stop`] cancels the job in progress and every queued one. A failing job, even
//! a panicking one, is reported to its submitter and the worker goes on.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::cancel::{Cancel, Stop};
use crate::speaker::{Job, JobError, Speaker, Spoken};

/// What the worker runs jobs with: the [`crate::Speaker`] (or a stand-in in tests).
pub trait Perform: Send + 'static {
    /// Run one job to its end (or its cancel).
    ///
    /// # Errors
    /// The job's error; the performer must stay usable after it.
    fn perform(&mut self, job: Job) -> Result<Spoken, JobError>;
}

/// The outcome of a job, as its submitter sees it.
pub type Outcome = Result<Spoken, JobError>;

struct Queued {
    job: Job,
    done: SyncSender<Outcome>,
}

/// A job the queue did not take; the job comes back.
#[derive(Debug)]
pub enum Refused {
    /// `capacity` jobs are already waiting.
    Full {
        /// The job.
        job: Box<Job>,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The queue was stopped ([`Stop`]) or its worker is gone.
    Stopped(Box<Job>),
}

impl Refused {
    /// The job that was refused.
    pub fn into_job(self) -> Job {
        match self {
            Refused::Full { job, .. } | Refused::Stopped(job) => *job,
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Full { capacity, .. } => write!(f, "the speaker is busy: {capacity} job(s) already waiting"),
            Refused::Stopped(_) => f.write_str("the speaker is stopping"),
        }
    }
}

impl std::error::Error for Refused {}

/// A submitted job: cancel it, or wait for its outcome.
#[derive(Debug)]
pub struct JobHandle {
    cancel: Cancel,
    done: Receiver<Outcome>,
}

impl JobHandle {
    /// Cancel this job (only this one): a waiting job is not started, a running one stops
    /// within a frame.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Wait for the outcome.
    pub fn wait(self) -> Outcome {
        self.done.recv().unwrap_or_else(|_| Err(JobError::Panicked("the speaker's worker thread ended".into())))
    }

    /// Wait at most `timeout` for the outcome; `None` while the job is waiting or running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        match self.done.recv_timeout(timeout) {
            Ok(o) => Some(o),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(JobError::Panicked("the speaker's worker thread ended".into()))),
        }
    }
}

/// The jobs waiting, shared by the submitters and the worker.
struct Waiting {
    state: Mutex<State>,
    /// Signalled when a job is added or the queue closes (the worker waits on it).
    added: Condvar,
    /// Signalled when a job is taken, the capacity grows or the queue closes (submitters
    /// waiting for room wait on it).
    room: Condvar,
    /// How many jobs may wait besides the one in progress (at least 1; a reload may change it).
    capacity: AtomicUsize,
}

struct State {
    jobs: VecDeque<Queued>,
    /// No job is taken any more: the queue is being dropped.
    closed: bool,
}

impl Waiting {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How often a submitter waiting for room looks at the process-wide stop.
const ROOM_POLL: Duration = Duration::from_millis(50);

/// The worker thread and its bounded queue. Dropping the queue lets the worker finish the
/// waiting jobs (cancelled ones end at once) and joins it.
pub struct Queue {
    waiting: Arc<Waiting>,
    worker: Option<JoinHandle<()>>,
    stop: Stop,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("capacity", &self.capacity()).finish_non_exhaustive()
    }
}

impl Queue {
    /// Start the worker thread with `performer`, taking up to `capacity` waiting jobs besides
    /// the one in progress (a capacity of 0 counts as 1). After `stop`, jobs are refused and
    /// waiting ones are cancelled.
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn start(performer: impl Perform, capacity: usize, stop: Stop) -> std::io::Result<Queue> {
        let waiting = Arc::new(Waiting {
            state: Mutex::new(State { jobs: VecDeque::new(), closed: false }),
            added: Condvar::new(),
            room: Condvar::new(),
            capacity: AtomicUsize::new(capacity.max(1)),
        });
        let worker_stop = stop.clone();
        let shared = Arc::clone(&waiting);
        let worker = std::thread::Builder::new().name("herald-speaker".into()).spawn(move || {
            let mut performer = performer;
            while let Some(Queued { job, done }) = next(&shared) {
                let cancel = job.cancel_handle();
                // the stop cancels the job in progress, whatever performs it
                let _running = worker_stop.guard(&cancel);
                let outcome = if cancel.is_cancelled() {
                    Err(JobError::Cancelled)
                } else {
                    std::panic::catch_unwind(AssertUnwindSafe(|| performer.perform(job))).unwrap_or_else(|p| {
                        let what = p
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_owned())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic".into());
                        log::error!("a job panicked: {what}");
                        Err(JobError::Panicked(what))
                    })
                };
                // the submitter may have gone away; the outcome is then nobody's business
                let _ = done.send(outcome);
            }
        })?;
        Ok(Queue { waiting, worker: Some(worker), stop })
    }

    /// How many jobs may wait besides the one in progress.
    pub fn capacity(&self) -> usize {
        self.waiting.capacity.load(Ordering::SeqCst)
    }

    /// Change how many jobs may wait (0 counts as 1; a reload of `serve.queue_length`). Jobs
    /// waiting already stay queued when it is lowered; new ones are refused (or wait) until
    /// fewer than the new capacity wait.
    pub fn set_capacity(&self, capacity: usize) {
        let _state = self.waiting.lock();
        self.waiting.capacity.store(capacity.max(1), Ordering::SeqCst);
        self.waiting.room.notify_all();
    }

    /// Queue `job` if there is room now.
    ///
    /// # Errors
    /// [`Refused::Full`] when `capacity` jobs are waiting, [`Refused::Stopped`] after the stop.
    pub fn try_submit(&self, job: Job) -> Result<JobHandle, Refused> {
        let mut state = self.waiting.lock();
        if state.closed || self.stop.is_stopped() {
            return Err(Refused::Stopped(Box::new(job)));
        }
        let capacity = self.capacity();
        if state.jobs.len() >= capacity {
            return Err(Refused::Full { job: Box::new(job), capacity });
        }
        let (queued, handle) = wrap(job);
        state.jobs.push_back(queued);
        self.waiting.added.notify_one();
        Ok(handle)
    }

    /// Queue `job`, waiting for room while the queue is full.
    ///
    /// # Errors
    /// [`Refused::Stopped`] after the stop.
    pub fn submit(&self, job: Job) -> Result<JobHandle, Refused> {
        let mut state = self.waiting.lock();
        loop {
            if state.closed || self.stop.is_stopped() {
                return Err(Refused::Stopped(Box::new(job)));
            }
            if state.jobs.len() < self.capacity() {
                break;
            }
            state = self.waiting.room.wait_timeout(state, ROOM_POLL).unwrap_or_else(PoisonError::into_inner).0;
        }
        let (queued, handle) = wrap(job);
        state.jobs.push_back(queued);
        self.waiting.added.notify_one();
        Ok(handle)
    }
}

/// The worker's next job, waiting for one; `None` once the queue is closed and empty.
fn next(waiting: &Waiting) -> Option<Queued> {
    let mut state = waiting.lock();
    loop {
        if let Some(q) = state.jobs.pop_front() {
            waiting.room.notify_all();
            return Some(q);
        }
        if state.closed {
            return None;
        }
        state = waiting.added.wait(state).unwrap_or_else(PoisonError::into_inner);
    }
}

fn wrap(job: Job) -> (Queued, JobHandle) {
    let (done, rx) = mpsc::sync_channel(1);
    let handle = JobHandle { cancel: job.cancel_handle(), done: rx };
    (Queued { job, done }, handle)
}

impl Drop for Queue {
    fn drop(&mut self) {
        {
            let mut state = self.waiting.lock();
            state.closed = true;
            self.waiting.added.notify_all();
            self.waiting.room.notify_all();
        }
        if let Some(w) = self.worker.take()
            && w.join().is_err()
        {
            log::error!("the speaker's worker thread panicked");
        }
    }
}

impl Speaker {
    /// Move the speaker onto a worker thread behind a queue of `capacity` waiting jobs
    /// ([`Queue`]). (Here rather than in `speaker.rs`, so that the queue depends on the speaker
    /// and not the other way round.)
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn start(self, capacity: usize) -> std::io::Result<Queue> {
        let stop = self.stop_handle().clone();
        Queue::start(self, capacity, stop)
    }
}

impl Perform for Speaker {
    fn perform(&mut self, job: Job) -> Result<Spoken, JobError> {
        self.speak(job)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::output::Target;
    use board::audio::{SampleFormat, SinkStats};
    use engine::Request;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Stands in for the speaker: "fail" fails, "panic" panics, "hold" runs until cancelled
    /// (then reports a cut-short utterance), anything else is spoken at once. Counts the jobs
    /// it started.
    struct Mock {
        started: Arc<AtomicUsize>,
    }

    fn stats(samples: u64) -> SinkStats {
        SinkStats::passthrough(samples, 24_000, SampleFormat::S16)
    }

    impl Perform for Mock {
        fn perform(&mut self, job: Job) -> Result<Spoken, JobError> {
            self.started.fetch_add(1, Ordering::SeqCst);
            let cancel = job.cancel_handle();
            match job.request.text.as_str() {
                "fail" => Err(JobError::Engine(engine::EngineError::Vocoder("mock failure".into()))),
                "panic" => panic!("mock panic"),
                "hold" => {
                    while !cancel.is_cancelled() {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Ok(Spoken { report: None, stats: stats(1) })
                }
                text => Ok(Spoken { report: None, stats: stats(text.len() as u64) }),
            }
        }
    }

    fn job(text: &str) -> Job {
        let request = Request {
            text: text.into(),
            language: None,
            speaker: None,
            mode: Default::default(),
            seed: None,
            max_frames: None,
            force_eos_at: None,
        };
        Job::new(request, Target::Device)
    }

    fn queue(capacity: usize) -> (Queue, Arc<AtomicUsize>, Stop) {
        let started = Arc::new(AtomicUsize::new(0));
        let stop = Stop::new();
        let q = Queue::start(Mock { started: Arc::clone(&started) }, capacity, stop.clone()).unwrap();
        (q, started, stop)
    }

    /// Wait until the worker has started `n` jobs.
    fn started(counter: &AtomicUsize, n: usize) {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while counter.load(Ordering::SeqCst) < n {
            assert!(std::time::Instant::now() < end, "the worker did not start job {n}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn cancelling_a_job_cancels_only_that_job() {
        let (q, n, _stop) = queue(4);
        let held = q.try_submit(job("hold")).unwrap();
        let waiting = q.try_submit(job("hold")).unwrap();
        let next = q.try_submit(job("next")).unwrap();
        started(&n, 1);
        // a waiting job cancelled before it starts is never started
        waiting.cancel();
        held.cancel();
        assert_eq!(held.wait().unwrap().stats.input_samples, 1, "the running job ended as cut short");
        assert!(matches!(waiting.wait(), Err(JobError::Cancelled)));
        assert_eq!(next.wait().unwrap().stats.input_samples, 4, "the job after it is spoken");
        assert_eq!(n.load(Ordering::SeqCst), 2, "the cancelled waiting job never reached the speaker");
    }

    #[test]
    fn a_full_queue_refuses_and_hands_the_job_back() {
        let (q, n, _stop) = queue(2);
        let running = q.try_submit(job("hold")).unwrap();
        started(&n, 1);
        let a = q.try_submit(job("a")).unwrap();
        let b = q.try_submit(job("bb")).unwrap();
        let refused = q.try_submit(job("ccc")).unwrap_err();
        assert!(matches!(refused, Refused::Full { capacity: 2, .. }), "{refused:?}");
        assert_eq!(refused.to_string(), "the speaker is busy: 2 job(s) already waiting");
        assert_eq!(refused.into_job().request.text, "ccc");
        running.cancel();
        assert!(running.wait().is_ok());
        assert_eq!(a.wait().unwrap().stats.input_samples, 1);
        assert_eq!(b.wait().unwrap().stats.input_samples, 2);
        // room again
        assert_eq!(q.try_submit(job("dddd")).unwrap().wait().unwrap().stats.input_samples, 4);
    }

    #[test]
    fn a_changed_capacity_applies_to_the_next_job_and_keeps_the_waiting_ones() {
        let (q, n, _stop) = queue(1);
        let running = q.try_submit(job("hold")).unwrap();
        started(&n, 1);
        let a = q.try_submit(job("a")).unwrap();
        assert!(matches!(q.try_submit(job("b")), Err(Refused::Full { capacity: 1, .. })));
        // raised: one more may wait
        q.set_capacity(3);
        let b = q.try_submit(job("bb")).unwrap();
        // lowered below what waits: the two waiting stay queued, a new one is refused
        q.set_capacity(1);
        assert_eq!(q.capacity(), 1);
        let refused = q.try_submit(job("c")).unwrap_err();
        assert!(matches!(refused, Refused::Full { capacity: 1, .. }), "{refused:?}");
        // a submitter that waits for room is let in when the capacity grows
        std::thread::scope(|s| {
            let waiter = s.spawn(|| q.submit(job("ddd")).unwrap());
            std::thread::sleep(Duration::from_millis(100));
            assert!(!waiter.is_finished(), "two wait already, capacity 1");
            q.set_capacity(3);
            let d = waiter.join().unwrap();
            running.cancel();
            assert_eq!(d.wait().unwrap().stats.input_samples, 3);
        });
        assert_eq!(a.wait().unwrap().stats.input_samples, 1);
        assert_eq!(b.wait().unwrap().stats.input_samples, 2);
        assert_eq!(q.capacity(), 3);
        q.set_capacity(0);
        assert_eq!(q.capacity(), 1, "0 counts as 1");
    }

    #[test]
    fn the_worker_survives_failing_and_panicking_jobs() {
        let (q, _n, _stop) = queue(4);
        let fail = q.try_submit(job("fail")).unwrap();
        let panic = q.try_submit(job("panic")).unwrap();
        let ok = q.try_submit(job("fine")).unwrap();
        assert!(matches!(fail.wait(), Err(JobError::Engine(_))));
        match panic.wait() {
            Err(JobError::Panicked(what)) => assert_eq!(what, "mock panic"),
            other => panic!("{other:?}"),
        }
        assert_eq!(ok.wait().unwrap().stats.input_samples, 4);
    }

    #[test]
    fn the_stop_cancels_the_queue_and_refuses_new_jobs() {
        let (q, n, stop) = queue(4);
        let waiting = q.submit(job("later")).unwrap();
        let _ = waiting.wait().unwrap();
        let a = q.submit(job("a")).unwrap();
        let _ = a.wait();
        let held = q.submit(job("hold")).unwrap();
        let queued = q.submit(job("queued")).unwrap();
        started(&n, 3);
        stop.stop();
        assert!(held.wait().is_ok(), "the running job was cancelled by the stop");
        assert!(matches!(queued.wait(), Err(JobError::Cancelled)));
        assert!(matches!(q.try_submit(job("x")), Err(Refused::Stopped(_))));
        assert!(matches!(q.submit(job("x")), Err(Refused::Stopped(_))));
        drop(q);
    }
}

//! CPU placement of the two pipeline stages: the decode stage (talker + code predictor) and the
//! vocoder stage each get a disjoint CPU set; the stage's own thread and the matrix-product
//! threads working for it are pinned there with `sched_setaffinity(2)`.
//!
//! The sets themselves are decided by the board crate (`board::derive`, from the hardware
//! probe); this module only applies them.

use std::sync::Arc;

use tract_linalg::multithread::Executor;

use crate::synth::EngineError;

/// The CPUs this process may run on (`sched_getaffinity(2)`), ascending.
///
/// # Errors
/// The OS error, as [`EngineError::Config`].
pub fn allowed_cpus() -> Result<Vec<usize>, EngineError> {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; the size matches the set we pass.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(EngineError::Config(format!("sched_getaffinity: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: CPU_ISSET only reads the set.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Pin the calling thread to `cpus` (no-op for an empty list).
///
/// # Errors
/// The OS error (a CPU outside the process's cgroup or offline), as [`EngineError::Config`].
pub fn pin_current_thread(cpus: &[usize]) -> Result<(), EngineError> {
    if cpus.is_empty() {
        return Ok(());
    }
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(EngineError::Config(format!("CPU {c} is beyond CPU_SETSIZE")));
        }
        // SAFETY: c < CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; the size matches the set.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(EngineError::Config(format!(
            "cannot pin a thread to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// One stage's placement: its CPUs and the tract executor whose threads are pinned to them.
#[derive(Debug, Clone, Default)]
pub(crate) struct StagePlacement {
    pub cpus: Vec<usize>,
    /// `None`: the process-wide default executor ([`crate::set_compute_threads`]).
    pub executor: Option<Executor>,
}

impl StagePlacement {
    /// A placement on `cpus` (empty: unpinned, default executor). Checks that every CPU is one
    /// this process may use, then builds a pool of `cpus.len()` pinned threads (a single CPU:
    /// single-threaded products on the stage's own thread).
    pub fn new(stage: &str, cpus: &[usize], allowed: &[usize]) -> Result<Self, EngineError> {
        if cpus.is_empty() {
            return Ok(Self::default());
        }
        if let Some(bad) = cpus.iter().find(|c| !allowed.contains(c)) {
            return Err(EngineError::Config(format!(
                "{stage} CPUs {cpus:?}: CPU {bad} is not available to this process (allowed: {allowed:?})"
            )));
        }
        let executor = if cpus.len() == 1 {
            Executor::SingleThread
        } else {
            let pinned: Arc<[usize]> = cpus.into();
            let name = format!("herald-{stage}");
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(cpus.len())
                .thread_name(move |i| format!("{name}-mm{i}"))
                .start_handler(move |_| {
                    if let Err(e) = pin_current_thread(&pinned) {
                        log::warn!("{e}");
                    }
                })
                .build()
                .map_err(|e| EngineError::Config(format!("cannot start the {stage} thread pool: {e}")))?;
            Executor::MultiThread(Arc::new(pool))
        };
        Ok(StagePlacement { cpus: cpus.to_vec(), executor: Some(executor) })
    }

    /// Run `f` on the calling thread pinned to this stage's CPUs, with this stage's executor for
    /// every matrix product inside. Pinning failures are logged, not fatal.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        if let Err(e) = pin_current_thread(&self.cpus) {
            log::warn!("{e}");
        }
        match &self.executor {
            Some(ex) => tract_linalg::multithread::multithread_tract_scope(ex.clone(), f),
            None => f(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_changes_what_the_kernel_reports() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        let last = *allowed.last().unwrap();
        std::thread::spawn(move || {
            pin_current_thread(&[last]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), vec![last]);
            // and the kernel's own view of this thread
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")).unwrap();
            assert_eq!(line.split_whitespace().nth(1).unwrap(), last.to_string());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_cpu_outside_the_allowed_set_is_refused_by_name() {
        let err = StagePlacement::new("talker", &[0, 4095], &[0, 1]).unwrap_err().to_string();
        assert!(err.contains("CPU 4095") && err.contains("talker"), "{err}");
    }
}

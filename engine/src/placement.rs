//! CPU placement of the two pipeline stages: the decode stage (talker + code predictor) and the
//! vocoder stage each get a disjoint CPU set; the stage's own thread and the matrix-product
//! threads working for it are pinned there with `sched_setaffinity(2)`.
//!
//! The sets themselves are decided by the board crate (`board::derive`, from the hardware
//! probe); this module only applies them.

use std::sync::Arc;

use model::backend::{LoadedGraphs, PinThread, StageCompute};
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

use crate::error::EngineError;

/// The CPUs this process may run on (`sched_getaffinity(2)` of the calling thread), ascending.
///
/// # Errors
/// The OS error, as [`EngineError::Config`].
pub fn allowed_cpus() -> Result<Vec<usize>, EngineError> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|e| EngineError::Config(format!("sched_getaffinity: {e}")))?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
}

/// Pin the calling thread to `cpus` (no-op for an empty list).
///
/// # Errors
/// The OS error (a CPU outside the process's cgroup or offline), as [`EngineError::Config`].
pub fn pin_current_thread(cpus: &[usize]) -> Result<(), EngineError> {
    if cpus.is_empty() {
        return Ok(());
    }
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c).map_err(|_| EngineError::Config(format!("CPU {c} is beyond CPU_SETSIZE")))?;
    }
    sched_setaffinity(Pid::from_raw(0), &set)
        .map_err(|e| EngineError::Config(format!("cannot pin a thread to CPUs {cpus:?}: {}", std::io::Error::from(e))))
}

/// One stage's placement: its CPUs and the backend's compute threads, pinned to them.
#[derive(Default)]
pub(crate) struct StagePlacement {
    pub cpus: Vec<usize>,
    /// `None`: the backend's process-wide default compute threads.
    pub compute: Option<Box<dyn StageCompute>>,
}

impl std::fmt::Debug for StagePlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagePlacement").field("cpus", &self.cpus).field("own_compute", &self.compute.is_some()).finish()
    }
}

impl StagePlacement {
    /// A placement on `cpus` (empty: unpinned, default compute threads). Checks that every CPU is
    /// one this process may use, then asks the backend for `cpus.len()` compute threads, each
    /// pinned to `cpus` as it starts.
    pub fn new(stage: &str, cpus: &[usize], allowed: &[usize], graphs: &dyn LoadedGraphs) -> Result<Self, EngineError> {
        if cpus.is_empty() {
            return Ok(Self::default());
        }
        if let Some(bad) = cpus.iter().find(|c| !allowed.contains(c)) {
            return Err(EngineError::Config(format!(
                "{stage} CPUs {cpus:?}: CPU {bad} is not available to this process (allowed: {allowed:?})"
            )));
        }
        let pinned: Arc<[usize]> = cpus.into();
        let pin: PinThread = Arc::new(move || {
            if let Err(e) = pin_current_thread(&pinned) {
                log::warn!("{e}");
            }
        });
        let compute = graphs.stage_compute(stage, cpus, pin).map_err(|e| EngineError::Config(e.to_string()))?;
        Ok(StagePlacement { cpus: cpus.to_vec(), compute: Some(compute) })
    }

    /// Run `f` on the calling thread pinned to this stage's CPUs, with this stage's compute
    /// threads for every matrix product inside. Pinning failures are logged, not fatal.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        if let Err(e) = pin_current_thread(&self.cpus) {
            log::warn!("{e}");
        }
        match &self.compute {
            Some(c) => {
                let mut f = Some(f);
                let mut out = None;
                c.run(&mut || {
                    if let Some(f) = f.take() {
                        out = Some(f());
                    }
                });
                if let Some(r) = out {
                    return r;
                }
                // a backend that returned without running the stage: run it here, unthreaded
                match f.take() {
                    Some(f) => f(),
                    None => unreachable!("the stage ran but left no result"),
                }
            }
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
        #[derive(Debug)]
        struct NoGraphs;
        impl LoadedGraphs for NoGraphs {
            fn backend(&self) -> &'static str {
                "none"
            }
            fn step_session(
                &self,
                _: &model::backend::StepSpec,
            ) -> Result<Box<dyn model::backend::StepSession>, model::backend::StepError> {
                unreachable!()
            }
            fn vocoder_session(&self, _: usize) -> Result<Box<dyn model::backend::VocoderSession>, model::backend::VocoderError> {
                unreachable!()
            }
            fn stage_compute(
                &self,
                _: &str,
                _: &[usize],
                _: PinThread,
            ) -> Result<Box<dyn StageCompute>, model::backend::BackendError> {
                unreachable!()
            }
            fn load_times(&self) -> model::backend::LoadTimes {
                Default::default()
            }
        }
        let err = StagePlacement::new("talker", &[0, 4095], &[0, 1], &NoGraphs).unwrap_err().to_string();
        assert!(err.contains("CPU 4095") && err.contains("talker"), "{err}");
    }
}

//! The speaker's queue with the real engine on the tiny bundle: a cancel reaches the engine and
//! stops only its own job, a failing job leaves the worker speaking, the stop ends everything.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use board::audio::{NullSink, ShaperSettings};
use engine::EngineSettings;
use service::{Job, JobError, OutputSettings, Queue, Refused, Seeding, Speaker, SpeakerSettings, Stop, Target, Voice};

/// The tiny bundle: from HERALD_TEST_BUNDLES (scripts/test exports it), else exported once
/// into the target's temporary folder.
fn bundle() -> PathBuf {
    if let Some(d) = std::env::var_os("HERALD_TEST_BUNDLES").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("tiny-0.6b");
    }
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("service-bundle");
    if !out.join("bundle.toml").is_file() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let st = Command::new(repo.join("tools/export/export"))
            .args(["export", "--tiny", "tiny-0.6b", "--seed", "7", "--quiet", "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    out
}

fn speaker(stop: &Stop) -> Speaker {
    let voice = Voice { language: "auto".into(), speaker: None, mode: Default::default(), seeding: Seeding::fixed(5) };
    let settings = SpeakerSettings { voice, amplifier: None, output: OutputSettings::default() };
    let settings_engine = EngineSettings { kv_capacity: 1024, ..EngineSettings::default() };
    Speaker::prepare(settings, stop.clone()).unwrap().load(&bundle(), &settings_engine).unwrap()
}

fn null() -> Target {
    Target::Sink { sink: Box::new(NullSink::new(ShaperSettings::passthrough())), plays: false }
}

/// A long text: tiny models never emit eos, so this runs until cancelled (or the KV cache fills).
const LONG: &str = "Many words that take a long while to say, again and again and again and again.";

#[test]
fn a_cancel_reaches_the_engine_and_stops_only_its_own_job() {
    let stop = Stop::new();
    let s = speaker(&stop);
    let short = s.request("Short.");
    let long = s.request(LONG);
    let q: Queue = s.start(2).unwrap();
    // the long job cancels itself from its first chunk: the engine must stop within a frame
    let chunks = Arc::new(AtomicUsize::new(0));
    let job = Job::new(long, null());
    let cancel = job.cancel_handle();
    let seen = Arc::clone(&chunks);
    let job = job.on_chunk(move || {
        seen.fetch_add(1, Ordering::SeqCst);
        cancel.cancel();
    });
    let first = q.try_submit(job).unwrap();
    let second = q.try_submit(Job::new(short.clone(), null())).unwrap();
    let first = first.wait().unwrap();
    assert!(first.report.is_none(), "the cancelled job reports itself cut short");
    assert!(chunks.load(Ordering::SeqCst) <= 2, "stopped at once: {} chunks", chunks.load(Ordering::SeqCst));
    let second = second.wait().unwrap();
    let report = second.report.expect("the next job is spoken to its end");
    assert!(report.frames > 0 && second.stats.input_samples == report.samples as u64);
    // and the same text again gives the same audio length (the engine kept no state)
    let again = q.submit(Job::new(short, null())).unwrap().wait().unwrap();
    assert_eq!(again.report.unwrap().samples, report.samples);
}

#[test]
fn a_failing_job_leaves_the_worker_speaking_and_the_stop_ends_everything() {
    let stop = Stop::new();
    let s = speaker(&stop);
    let empty = s.request("");
    let fine = s.request("Fine.");
    let long = s.request(LONG);
    let q = s.start(1).unwrap();
    match q.submit(Job::new(empty, null())).unwrap().wait() {
        Err(JobError::Engine(engine::EngineError::Prompt(_))) => {}
        other => panic!("an empty text fails as a prompt error: {other:?}"),
    }
    assert!(q.submit(Job::new(fine.clone(), null())).unwrap().wait().unwrap().report.is_some());
    // the stop cancels the running job and the waiting one, and refuses the next
    let started = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&started);
    let running = q
        .submit(Job::new(long, null()).on_begin(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    let waiting = q.submit(Job::new(fine.clone(), null())).unwrap();
    while started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    stop.stop();
    assert!(running.wait().unwrap().report.is_none());
    assert!(matches!(waiting.wait(), Err(JobError::Cancelled)));
    assert!(matches!(q.try_submit(Job::new(fine, null())), Err(Refused::Stopped(_))));
}

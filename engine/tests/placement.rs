//! Stage placement: with `talker_cpus` / `vocoder_cpus` set, the kernel reports the decode and
//! vocoder threads (and their matrix-product threads) confined to those CPUs while they run;
//! the audio is the same as unpinned; the playback metrics of the report follow the chunk
//! timeline by their definition; and the vocoder cost is measured per window length.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use backend_tract::Tract;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use engine::placement::allowed_cpus;
use engine::{Engine, EngineSettings, PlaybackMetrics, Request};
use model::backend::VocoderForm;

/// Thread name → `Cpus_allowed_list` of every thread of this process.
fn thread_cpus() -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default().trim().to_string();
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        if let Some(l) = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")) {
            out.entry(comm).or_default().push(l.split_whitespace().nth(1).unwrap_or("").to_string());
        }
    }
    out
}

/// The tests of this file run one engine at a time, so that the threads seen are this run's.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn run(settings: &EngineSettings, inspect: bool) -> (Vec<f32>, engine::Report, BTreeMap<String, Vec<String>>) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let e = Engine::load(&common::bundle("tiny-0.6b"), &Tract, settings).unwrap();
    // long enough that the decode thread is still running (blocked on the full frame queue)
    // when the first chunk reaches us
    let req = Request { seed: Some(5), max_frames: Some(150), ..Request::new("Pinned threads speak the same words.") };
    let mut pcm = Vec::new();
    let mut seen = BTreeMap::new();
    let report = e
        .synthesize(&req, &AtomicBool::new(false), |c| {
            if inspect && c.index == 0 {
                seen = thread_cpus();
            }
            pcm.extend_from_slice(c.samples);
            Ok(())
        })
        .unwrap();
    (pcm, report, seen)
}

#[test]
fn stages_run_on_their_cpus_and_the_audio_is_unchanged() {
    let allowed = allowed_cpus().unwrap();
    if allowed.len() < 2 {
        eprintln!("skipped: this process may use only {allowed:?}; placement needs two CPUs");
        return;
    }
    let (t, v) = (allowed[0], allowed[1]);
    let pinned = EngineSettings { talker_cpus: vec![t], vocoder_cpus: vec![v], ..EngineSettings::default() };
    let (pcm_pinned, _, seen) = run(&pinned, true);
    assert_eq!(seen.get("herald-decode"), Some(&vec![t.to_string()]), "{seen:?}");
    assert_eq!(seen.get("herald-vocoder"), Some(&vec![v.to_string()]), "{seen:?}");
    let (pcm_free, _, _) = run(&EngineSettings::default(), false);
    assert_eq!(pcm_pinned, pcm_free);

    // a two-CPU talker stage gets a pool of two matrix-product threads, pinned to both
    let both = format!("{}-{}", allowed[0], allowed[1]);
    let wide = EngineSettings { talker_cpus: vec![t, v], vocoder_cpus: vec![v], ..EngineSettings::default() };
    if v == t + 1 {
        let (_, _, seen) = run(&wide, true);
        let mm: Vec<&String> = seen.iter().filter(|(name, _)| name.starts_with("herald-talker-m")).flat_map(|(_, c)| c).collect();
        assert_eq!(mm.len(), 2, "{seen:?}");
        assert!(mm.iter().all(|c| **c == both), "{seen:?}");
    }
}

#[test]
fn unavailable_cpus_are_refused_at_load() {
    let settings = EngineSettings { talker_cpus: vec![1023], vocoder_cpus: vec![], ..EngineSettings::default() };
    let err = Engine::load(&common::bundle("tiny-0.6b"), &Tract, &settings).unwrap_err().to_string();
    assert!(err.contains("CPU 1023") && err.contains("not available"), "{err}");
}

#[test]
fn report_metrics_follow_the_chunk_timeline() {
    let (pcm, r, _) = run(&EngineSettings::default(), false);
    let m = r.playback;
    assert_eq!(m, PlaybackMetrics::from_chunks(&r.chunk_times, 0.08));
    assert!((m.audio - pcm.len() as f64 / 24000.0).abs() < 1e-9);
    assert_eq!(m.ttfa, r.ttfa);
    // the earliest stall-free start, by its definition
    let mut c = 0.0;
    let mut start: f64 = 0.0;
    for &(t, n) in &r.chunk_times {
        start = start.max(t - c);
        c += n as f64 * 0.08;
    }
    assert!((m.playback_start - start).abs() < 1e-12);
    assert!((m.rtf - r.total / m.audio).abs() < 1e-12);
}

#[test]
fn vocoder_cost_is_measured_per_chunk_size() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let windowed = EngineSettings { vocoder: Some(VocoderForm::Windowed), ..EngineSettings::default() };
    let e = Engine::load(&common::bundle("tiny-0.6b"), &Tract, &windowed).unwrap();
    assert_eq!(e.vocoder_left_context(), 72);
    let costs = e.vocoder_cost(&[1, 97], 3).unwrap();
    assert_eq!(costs.len(), 2);
    assert!(costs.iter().all(|&c| c > 0.0), "{costs:?}");
    // 72 frames of left context + the largest chunk, 25
    let err = e.vocoder_cost(&[98], 1).unwrap_err().to_string();
    assert!(err.contains("98") && err.contains("1..=97"), "{err}");
    // stateful (the default): a window is a chunk, at most the largest, 2 (its default ramp)
    let e = Engine::load(&common::bundle("tiny-0.6b"), &Tract, &EngineSettings::default()).unwrap();
    assert_eq!((e.vocoder_form(), e.vocoder_left_context()), (VocoderForm::Stateful, 0));
    let costs = e.vocoder_cost(&[1, 2], 3).unwrap();
    assert!(costs.iter().all(|&c| c > 0.0), "{costs:?}");
    let err = e.vocoder_cost(&[3], 1).unwrap_err().to_string();
    assert!(err.contains('3') && err.contains("1..=2"), "{err}");
}

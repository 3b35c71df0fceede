//! The tract backend's graph cache (backend_tract::cache): a second open of a bundle reads each
//! graph's decluttered model from the cache instead of the ONNX file, and decodes exactly what
//! the first open decoded; a corrupt entry is rebuilt; a cache directory that cannot be written
//! costs only the speed-up.
//!
//! One test function: the cache directory is process-wide, so the cases run in sequence.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::Arc;

use backend_tract::{Tract, set_graph_cache_dir};
use engine::decoder::{Decoder, generate_frames};
use engine::vocoder::{Vocoder, vocode_all};
use engine::{Bundle, EngineSettings, Request};
use model::ChunkSchedule;
use model::frame::Frame;
use model::prompt::PromptMode;

/// Greedy codes and PCM of one short utterance (the stateful vocoder, the bundle's ramp).
fn speak(b: &Arc<Bundle>) -> (Vec<Frame>, Vec<f32>) {
    let req = Request {
        text: "Cached graphs speak the same.".into(),
        language: Some("english".into()),
        speaker: None,
        mode: PromptMode::Streaming,
        seed: None,
        max_frames: Some(12),
        force_eos_at: None,
    };
    let mut dec = Decoder::new(b.clone(), &EngineSettings::default()).unwrap();
    let (frames, _) = generate_frames(&mut dec, &req).unwrap();
    let ramp: Vec<usize> = b.manifest.vocoder.ramp.iter().map(|&r| r as usize).collect();
    let mut sched = ChunkSchedule::new(&ramp).unwrap();
    let mut voc = Vocoder::new(b, 0, sched.max_chunk()).unwrap();
    let pcm = vocode_all(&mut voc, &frames, &mut sched).unwrap();
    (frames, pcm)
}

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    v.sort();
    v
}

#[test]
fn a_cached_bundle_opens_from_the_cache_and_speaks_the_same() {
    let cache = tempfile::tempdir().unwrap();
    for name in ["tiny-q-q4", "tiny-0.6b"] {
        let bundle = common::bundle(name);
        set_graph_cache_dir(None);
        let plain = Arc::new(Bundle::open(&bundle, &Tract).unwrap());
        assert!(!plain.graphs.load_times().from_cache);
        let want = speak(&plain);

        let root = cache.path().join(name);
        set_graph_cache_dir(Some(root.clone()));
        let first = Arc::new(Bundle::open(&bundle, &Tract).unwrap());
        assert!(!first.graphs.load_times().from_cache, "{name}: nothing was cached yet");
        // talker, code predictor and the stream vocoder's one 2-frame plan
        let written = entries(&root);
        assert_eq!(written.len(), 3, "{name}: {written:?}");
        assert!(written.iter().all(|e| e.join("model/graph.nnef").is_file() && e.join("io.txt").is_file()));
        // the step graphs' EinSums are written whole, not split into NNEF matmul + axis ops that
        // each start would have to reassemble
        for e in &written {
            let text = std::fs::read_to_string(e.join("model/graph.nnef")).unwrap();
            let step = !e.file_name().unwrap().to_string_lossy().starts_with("vocoder");
            assert!(!step || text.contains("herald_einsum("), "{name}: {} has no herald_einsum", e.display());
            assert!(!text.contains(" matmul("), "{name}: {} has a split EinSum", e.display());
        }
        assert_eq!(speak(&first), want, "{name}: the run that wrote the cache");

        let second = Arc::new(Bundle::open(&bundle, &Tract).unwrap());
        assert!(second.graphs.load_times().from_cache, "{name}: the second open reads the cache");
        assert_eq!(speak(&second), want, "{name}: decoded from the cached graphs");
        assert_eq!(entries(&root), written, "{name}: a cache hit writes nothing new");

        // a corrupt entry: rebuilt from the ONNX file, with the same result
        let talker = written.iter().find(|e| e.file_name().unwrap().to_string_lossy().starts_with("talker-")).unwrap();
        std::fs::write(talker.join("model/graph.nnef"), "version 1.0;\ngraph broken( -> ( ;\n").unwrap();
        let third = Arc::new(Bundle::open(&bundle, &Tract).unwrap());
        assert!(!third.graphs.load_times().from_cache, "{name}: the corrupt talker entry is not used");
        assert_eq!(speak(&third), want, "{name}: after a corrupt entry");
        let fourth = Bundle::open(&bundle, &Tract).unwrap();
        assert!(fourth.graphs.load_times().from_cache, "{name}: the corrupt entry was rewritten");

        // IO names that differ from the manifest's (two inputs swapped): never used as they are
        let io = talker.join("io.txt");
        let text = std::fs::read_to_string(&io).unwrap();
        std::fs::write(&io, text.replacen("k_cache_0\tv_cache_0", "v_cache_0\tk_cache_0", 1)).unwrap();
        assert_ne!(std::fs::read_to_string(&io).unwrap(), text, "{name}: the test swapped two names");
        let fifth = Arc::new(Bundle::open(&bundle, &Tract).unwrap());
        assert!(!fifth.graphs.load_times().from_cache, "{name}: an entry with other IO names is not used");
        assert_eq!(speak(&fifth), want, "{name}: after swapped IO names");
    }

    // a cache directory that cannot be created (a file stands in its way): the bundle still opens
    let blocked = cache.path().join("a-file");
    std::fs::write(&blocked, "not a directory").unwrap();
    set_graph_cache_dir(Some(blocked.join("graphs")));
    let b = Arc::new(Bundle::open(&common::bundle("tiny-q-q4"), &Tract).unwrap());
    assert!(!b.graphs.load_times().from_cache);
    set_graph_cache_dir(None);
}

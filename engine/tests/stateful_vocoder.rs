//! The stateful vocoder is exact: chunks decoded with the carried state, concatenated, equal one
//! single pass of the windowed graph over the whole utterance (a window holding every frame, so
//! nothing is cut), within 1e-5 max abs, for any ramp (chunks of one frame included) and
//! utterances of 1, 2, 300 and 1,000 frames, on every tiny bundle. The windowed decoder with
//! its default 72 frames of context is not exact (the transformer sees 71 frames per layer over
//! several layers): its SNR against the single pass is printed for comparison.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use backend_tract::Tract;
use engine::Bundle;
use engine::vocoder::{Vocoder, vocode_all};
use model::ChunkSchedule;
use model::backend::VocoderForm;
use model::frame::{CODEBOOKS, Frame};

/// Deterministic codes in [0, 2048) (SplitMix64, seeded per utterance).
fn codes(frames: usize, seed: u64) -> Vec<Frame> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % 2048) as u32
    };
    (0..frames).map(|_| std::array::from_fn::<u32, CODEBOOKS, _>(|_| next())).collect()
}

/// One pass of the windowed graph over all of `frames`.
fn single_pass(b: &Bundle, frames: &[Frame]) -> Vec<f32> {
    let mut voc = Vocoder::new(b, 0, frames.len()).unwrap();
    let mut out = vec![0.0f32; frames.len() * voc.samples_per_frame()];
    voc.decode(frames, frames.len(), &mut out).unwrap();
    out
}

/// A copy of the tiny-0.6b bundle without the file named `skip`, whose bundle.toml `edit`
/// rewrites.
fn edited_bundle(skip: Option<&str>, edit: impl Fn(String) -> String) -> tempfile::TempDir {
    let src = common::bundle("tiny-0.6b");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap();
        if Some(name) != skip.map(std::ffi::OsStr::new) {
            std::fs::copy(&p, dir.path().join(name)).unwrap();
        }
    }
    let toml = std::fs::read_to_string(dir.path().join("bundle.toml")).unwrap();
    std::fs::write(dir.path().join("bundle.toml"), edit(toml)).unwrap();
    dir
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn snr_db(reference: &[f32], test: &[f32]) -> f64 {
    let num: f64 = reference.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let den: f64 = reference.iter().zip(test).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum();
    10.0 * (num / den).log10()
}

#[test]
fn stateful_chunks_equal_one_single_pass() {
    for preset in common::PRESETS {
        let windowed = Arc::new(Bundle::open_with(&common::bundle(preset), &Tract, Some(VocoderForm::Windowed)).unwrap());
        let stateful = Arc::new(Bundle::open_with(&common::bundle(preset), &Tract, Some(VocoderForm::Stateful)).unwrap());
        assert_eq!(stateful.vocoder_form, VocoderForm::Stateful);
        let ramps: [&[usize]; 4] = [&[1], &[2, 4, 8, 16, 25], &[1, 2, 3, 25], &[7]];
        // one session for all utterances: each vocode_all starts a new utterance (reset)
        let mut sessions: Vec<(Vec<usize>, Vocoder)> = ramps
            .iter()
            .map(|r| {
                let max = *r.iter().max().unwrap();
                (r.to_vec(), Vocoder::new(&stateful, 72, max).unwrap())
            })
            .collect();
        for (frames, seed) in [(1usize, 1u64), (2, 2), (300, 3), (1000, 4)] {
            let utt = codes(frames, seed);
            let want = single_pass(&windowed, &utt);
            for (ramp, voc) in &mut sessions {
                if frames > 300 && ramp[0] == 1 {
                    continue; // keeps the test short: one-frame chunks are covered up to 300 frames
                }
                assert_eq!(voc.form(), VocoderForm::Stateful);
                assert_eq!(voc.left_context, 0);
                let mut sched = ChunkSchedule::new(ramp).unwrap();
                let got = vocode_all(voc, &utt, &mut sched).unwrap();
                let d = max_abs(&got, &want);
                assert!(d <= 1e-5, "{preset}: {frames} frames, ramp {ramp:?}: max abs {d:e} against the single pass");
            }
            if frames == 300 {
                let mut voc = Vocoder::new(&windowed, 72, 25).unwrap();
                let win = vocode_all(&mut voc, &utt, &mut ChunkSchedule::new(&[2, 4, 8, 16, 25]).unwrap()).unwrap();
                let mut st = Vocoder::new(&stateful, 0, 25).unwrap();
                let sf = vocode_all(&mut st, &utt, &mut ChunkSchedule::new(&[2, 4, 8, 16, 25]).unwrap()).unwrap();
                println!(
                    "{preset}, 300 frames, ramp [2,4,8,16,25]: SNR against the single pass: stateful {:.1} dB, windowed-72 {:.1} dB",
                    snr_db(&want, &sf),
                    snr_db(&want, &win)
                );
            }
        }
    }
}

#[test]
fn a_stateful_session_refuses_context_and_resets_per_utterance() {
    let b = Bundle::open(&common::bundle("tiny-0.6b"), &Tract).unwrap();
    assert_eq!(b.vocoder_form, VocoderForm::Stateful, "a bundle with a stream graph decodes stateful by default");
    let mut voc = Vocoder::new(&b, 72, 4).unwrap();
    let utt = codes(6, 9);
    let spf = voc.samples_per_frame();
    // a window with context is refused, named, and leaves the state untouched
    let mut out = vec![0.0f32; 2 * spf];
    let err = voc.decode(&utt[..4], 2, &mut out).unwrap_err().to_string();
    assert!(err.contains("stateful") && err.contains("4 frames"), "{err}");
    let err = voc.decode(&utt[..5], 5, &mut vec![0.0f32; 5 * spf]).unwrap_err().to_string();
    assert!(err.contains("at most 4"), "{err}");
    // the same utterance twice gives the same samples (reset), a continuation does not
    let first = vocode_all(&mut voc, &utt, &mut ChunkSchedule::new(&[4]).unwrap()).unwrap();
    let again = vocode_all(&mut voc, &utt, &mut ChunkSchedule::new(&[4]).unwrap()).unwrap();
    assert_eq!(first, again);
    let mut cont = vec![0.0f32; 4 * spf];
    voc.decode(&utt[..4], 4, &mut cont).unwrap();
    assert_ne!(cont[..], first[..4 * spf], "without a reset the state carries on");
}

#[test]
fn windowed_only_bundles_still_load_and_stateful_is_refused_by_name() {
    // the manifest of an older export: no stream graph
    let dir = edited_bundle(Some("vocoder_stream.onnx"), |toml| {
        let start = toml.find("[graphs.vocoder_stream]").unwrap();
        let end = toml[start + 1..].find("\n[graphs.").map_or(toml.len(), |e| start + 1 + e);
        format!("{}{}", &toml[..start], &toml[end..]).replace("stream_graph = \"vocoder_stream\"\n", "")
    });
    let b = Bundle::open(dir.path(), &Tract).unwrap();
    assert_eq!(b.vocoder_form, VocoderForm::Windowed);
    let err = Bundle::open_with(dir.path(), &Tract, Some(VocoderForm::Stateful)).unwrap_err().to_string();
    assert!(err.contains("synthesis.vocoder") && err.contains("stream graph") && err.contains("bundle.toml"), "{err}");
}

#[test]
fn every_snake_is_fused_and_the_profile_names_the_op_types() {
    let dir = common::bundle("tiny-0.6b");
    let m = engine::read_manifest(&dir).unwrap();
    for form in [VocoderForm::Windowed, VocoderForm::Stateful] {
        let (ops, total) = backend_tract::profile::profile_vocoder(&dir, &m, form, 3, 1, false).unwrap();
        assert!(total > 0.0);
        let nodes = |op: &str| ops.iter().find(|o| o.op == op).map_or(0, |o| o.nodes);
        // 4 decoder blocks x (1 + 3 residual units x 2) SnakeBeta + the final one
        assert_eq!(nodes("SnakeBeta"), 4 * 7 + 1, "{form}: {ops:?}");
        assert!(ops.iter().any(|o| o.op == "Conv" && o.ms > 0.0), "{form}: {ops:?}");
        // the only Sin left is the RoPE angle table's
        assert!(nodes("Sin") <= 1, "{form}: {ops:?}");
        let sum: f64 = ops.iter().map(|o| o.ms).sum();
        assert!(sum <= total * 1.5 && sum > 0.0, "node times {sum} ms against the run's {total} ms");
    }
}

#[test]
fn a_stream_graph_without_state_is_refused() {
    // [vocoder].stream_graph pointing at the windowed graph: codes -> wav, nothing carried
    let dir = edited_bundle(None, |toml| toml.replace("stream_graph = \"vocoder_stream\"", "stream_graph = \"vocoder\""));
    let err = engine::Engine::load(dir.path(), &Tract, &engine::EngineSettings::default()).unwrap_err().to_string();
    assert!(err.contains("carries no state"), "{err}");
}

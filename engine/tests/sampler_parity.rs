//! `engine::sampler` against the Python reference's logits processors and choice
//! (`tools/export/reference.py` `talker_processors`, `predictor_processors`,
//! `sample_from_logits`, `greedy_choice`, `SplitMix64`), run through
//! `engine/tests/py/oracle.py sampler` with the project venv. The oracle draws random float32
//! logits (seeded numpy: normal, ties, masked, peaked, flat, huge, eos-favoured), random
//! parameters and histories with repeats, and prints the processed logits (bit patterns) and
//! the choice; whole frames (c0 then c1..c15 on one SplitMix64 stream, frames 0..3) check the
//! draw order. Everything must be identical.

// A test crate: helper functions outside #[test] fail loudly by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use model::sampler::{PredictorParams, Sampler, SplitMix64, TalkerParams};

const TALKER_VOCAB: u32 = 3072;
const PREDICTOR_VOCAB: u32 = 2048;
const EOS: u32 = 2150;

fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        p.is_file(),
        "the sampler parity test needs the project venv's python at {} (create it with tools/export/setup.sh)",
        p.display()
    );
    p
}

fn oracle_output() -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/oracle.py");
    let out = Command::new(python())
        .arg(script)
        .arg("sampler")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python().display()));
    assert!(out.status.success(), "oracle.py sampler failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn fields(line: &str) -> (&str, BTreeMap<&str, &str>) {
    let mut it = line.split(' ');
    let kind = it.next().unwrap();
    let map = it.map(|kv| kv.split_once('=').unwrap_or_else(|| panic!("bad field {kv:?}"))).collect();
    (kind, map)
}

fn f32_bits(s: &str) -> f32 {
    f32::from_bits(u32::from_str_radix(s, 16).unwrap())
}

fn floats(s: &str) -> Vec<f32> {
    s.split(',').map(f32_bits).collect()
}

fn ints(s: &str) -> Vec<u32> {
    if s == "-" { Vec::new() } else { s.split(',').map(|v| v.parse().unwrap()).collect() }
}

fn seed(s: &str) -> Option<u64> {
    if s == "-" { None } else { Some(s.parse().unwrap()) }
}

fn talker_params(f: &BTreeMap<&str, &str>, prefix: &str) -> TalkerParams {
    let g = |k: &str| f[format!("{prefix}{k}").as_str()];
    TalkerParams {
        do_sample: true,
        temperature: f32_bits(g("temp")),
        top_k: g("top_k").parse().unwrap(),
        top_p: f32_bits(g("top_p")),
        repetition_penalty: f32_bits(g("pen")),
        min_new_tokens: g("min_new").parse().unwrap(),
        eos: EOS,
        suppress_from: TALKER_VOCAB - 1024,
        vocab: TALKER_VOCAB,
    }
}

fn predictor_params(f: &BTreeMap<&str, &str>, prefix: &str) -> PredictorParams {
    let g = |k: &str| f[format!("{prefix}{k}").as_str()];
    PredictorParams {
        do_sample: true,
        temperature: f32_bits(g("temp")),
        top_k: g("top_k").parse().unwrap(),
        top_p: f32_bits(g("top_p")),
        vocab: PREDICTOR_VOCAB,
    }
}

/// Placeholder parameters for the stage a case does not use.
fn any_talker() -> TalkerParams {
    TalkerParams {
        do_sample: true,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        min_new_tokens: 0,
        eos: EOS,
        suppress_from: TALKER_VOCAB - 1024,
        vocab: TALKER_VOCAB,
    }
}

fn any_predictor() -> PredictorParams {
    PredictorParams { do_sample: true, temperature: 1.0, top_k: 0, top_p: 1.0, vocab: PREDICTOR_VOCAB }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn processors_and_choices_match_the_reference() {
    let out = oracle_output();
    let mut failures = Vec::new();
    let (mut talker_cases, mut predictor_cases, mut frames, mut sampled) = (0, 0, 0, 0);
    // The frame sequence being replayed: its sampler, RNG and c0 history.
    let mut seq: Option<(Sampler, Option<SplitMix64>, Vec<u32>)> = None;

    for (n, line) in out.lines().enumerate() {
        let (kind, f) = fields(line);
        match kind {
            "talker" | "predictor" => {
                let sampling = f["sampling"] == "1";
                let mut rng = seed(f["seed"]).map(SplitMix64::new);
                assert_eq!(sampling, rng.is_some());
                sampled += usize::from(sampling);
                let mut logits = floats(f["logits"]);
                let want = floats(f["processed"]);
                let choice: u32 = f["choice"].parse().unwrap();
                let (got, mut processed) = if kind == "talker" {
                    talker_cases += 1;
                    let mut s = Sampler::new(talker_params(&f, ""), any_predictor()).unwrap();
                    let hist = ints(f["hist"]);
                    let mut copy = logits.clone();
                    s.process_c0(&mut copy, &hist, sampling).unwrap();
                    (s.choose_c0(&mut logits, &hist, rng.as_mut()).unwrap(), copy)
                } else {
                    predictor_cases += 1;
                    let mut s = Sampler::new(any_talker(), predictor_params(&f, "")).unwrap();
                    let mut copy = logits.clone();
                    s.process_code(&mut copy, sampling).unwrap();
                    (s.choose_code(&mut logits, rng.as_mut()).unwrap(), copy)
                };
                if !same_bits(&processed, &want) {
                    let first = processed.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                    failures.push(format!("line {n} ({kind}): processed logits differ first at id {first:?}"));
                }
                // choose_* leave the processed logits in place, identical to process_*.
                if !same_bits(&logits, &processed) {
                    failures.push(format!("line {n} ({kind}): choose_* and process_* disagree"));
                }
                processed.clear();
                if got != choice {
                    failures.push(format!("line {n} ({kind}): rust chose {got}, python {choice}"));
                }
            }
            "seq" => {
                let s = Sampler::new(talker_params(&f, "t_"), predictor_params(&f, "p_")).unwrap();
                seq = Some((s, seed(f["seed"]).map(SplitMix64::new), Vec::new()));
            }
            "frame" => {
                let (s, rng, hist) = seq.as_mut().unwrap();
                frames += 1;
                let want = ints(f["codes"]);
                let mut got = Vec::new();
                let mut all = f["logits"].split(';');
                let mut talker = floats(all.next().unwrap());
                let c0 = s.choose_c0(&mut talker, hist, rng.as_mut()).unwrap();
                got.push(c0);
                if c0 != EOS {
                    for logits in all {
                        let mut x = floats(logits);
                        got.push(s.choose_code(&mut x, rng.as_mut()).unwrap());
                    }
                    hist.push(c0);
                }
                if got != want {
                    failures.push(format!("line {n} (frame {}): rust {got:?}\n    python {want:?}", f["f"]));
                }
            }
            other => panic!("unknown oracle line kind {other:?}"),
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    assert_eq!((talker_cases, predictor_cases), (160, 160));
    assert!(sampled >= 200 && frames >= 20, "{sampled} sampled cases, {frames} frames");
}

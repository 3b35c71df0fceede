//! The Rust manifest parser against bundles written by the Python exporter: the two sides of
//! docs/bundle.md must agree on every key.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;

use model::manifest::{CacheKind, Dim, Manifest, ManifestError};

#[test]
fn reads_every_tiny_bundle() {
    for preset in common::PRESETS {
        let dir = common::bundle(preset);
        let m = engine::read_manifest(&dir).unwrap_or_else(|e| panic!("{preset}: {e}"));
        assert_eq!(m.audio.samples_per_frame, 1920);
        assert_eq!(m.audio.sample_rate, 24000);
        assert!((m.frame_rate() - 12.5).abs() < 1e-12);
        assert_eq!(m.codec.eos, 2150);
        assert_eq!(m.text.tts_pad, 151671);
        assert_eq!(m.talker.cache.len(), m.talker.layers as usize);
        assert_eq!(m.code_predictor.projection, Some(preset == "tiny-1.7b"));
        let sliding = m.talker.cache.iter().filter(|c| matches!(c, CacheKind::Sliding { window: 8 })).count();
        assert_eq!(sliding, if preset == "tiny-hybrid" { 2 } else { 0 });
        let talker = &m.graphs["talker"];
        assert_eq!(talker.inputs[0].name, "x");
        assert_eq!(talker.inputs[0].shape, vec![Dim::Fixed(1), Dim::Symbol("seq".into()), Dim::Fixed(m.talker.hidden.into())]);
        assert_eq!(m.graphs["vocoder"].outputs[0].name, "wav");
        assert_eq!(m.vocoder.ramp, vec![2, 4, 8, 16, 25]);
        assert!(m.speakers.contains_key("serena"));
        assert_eq!(m.speaker_dialects.get("eric").map(String::as_str), Some("sichuan_dialect"));
    }
}

fn manifest_text() -> String {
    std::fs::read_to_string(common::bundle("tiny-0.6b").join("bundle.toml")).unwrap()
}

fn parse(text: &str) -> Result<Manifest, ManifestError> {
    Manifest::parse(text, Path::new("bundle.toml"))
}

#[test]
fn rejects_other_format_versions() {
    let err = parse(&manifest_text().replace("format_version = 1", "format_version = 2")).unwrap_err();
    assert!(err.to_string().contains("format_version 2"), "{err}");
}

#[test]
fn rejects_unknown_keys() {
    let err = parse(&manifest_text().replace("[audio]\n", "[audio]\nloudness = 3\n")).unwrap_err();
    assert!(matches!(err, ManifestError::Parse { .. }));
    assert!(err.to_string().contains("loudness"), "{err}");
}

#[test]
fn rejects_ids_outside_their_vocabulary() {
    let err = parse(&manifest_text().replace("eos = 2150", "eos = 9999")).unwrap_err();
    assert!(err.to_string().contains("codec.eos = 9999"), "{err}");
}

#[test]
fn rejects_paths_leaving_the_bundle() {
    let err = parse(&manifest_text().replace("file = \"talker.onnx\"", "file = \"../talker.onnx\"")).unwrap_err();
    assert!(err.to_string().contains("must be a file name inside the bundle"), "{err}");
}

#[test]
fn rejects_a_missing_file() {
    let src = common::bundle("tiny-0.6b");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("missing-file-bundle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("bundle.toml"), dir.join("bundle.toml")).unwrap();
    let err = engine::read_manifest(&dir).unwrap_err();
    assert!(err.to_string().contains("which is not in the bundle"), "{err}");
    let err = engine::read_manifest(&dir.join("nope")).unwrap_err();
    assert!(matches!(err, ManifestError::Io { .. }), "{err}");
}

#[test]
fn rejects_table_shapes_that_contradict_the_model() {
    let text = manifest_text();
    let bad = text.replacen("151936,\n    16,\n]", "151936,\n    17,\n]", 1);
    assert_ne!(bad, text, "fixture layout changed");
    let err = parse(&bad).unwrap_err();
    assert!(err.to_string().contains("tables.text_embedding.shape"), "{err}");
}

#[test]
fn reads_the_quantized_bundles() {
    use model::dtype::{Dtype, WeightFormat};
    for (name, want) in [("tiny-q-q4", WeightFormat::Q4), ("tiny-q-q8", WeightFormat::Q8)] {
        let m = engine::read_manifest(&common::bundle(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(m.weights(), want, "{name}");
        // activations, caches and tables stay float32
        assert_eq!(m.dtype(), Dtype::Fp32, "{name}");
        assert_eq!(m.graph_weights("talker"), want, "{name}");
        assert_eq!(m.graph_weights("code_predictor"), want, "{name}");
        assert_eq!(m.graph_weights("vocoder_stream"), WeightFormat::Fp32, "{name}");
        let q = m.quantization.as_ref().expect("a [quantization] table");
        assert_eq!(q.format, want.as_str());
        // q4's gate measured int8 activations (MatMulNBits accuracy_level 4); q8 has none of its own
        assert_eq!(m.int8_activations(), want == WeightFormat::Q4, "{name}: {:?}", q.activations);
        assert!(q.gate.passed && q.gate.positions >= 500, "{name}: {:?}", q.gate);
        // the exporter counts the bytes of every initializer: a quantized talker is far
        // smaller than its float32 twin
        let fp32 = engine::read_manifest(&common::bundle("tiny-q")).unwrap();
        let (qb, fb) = (m.graphs["talker"].weight_bytes.unwrap(), fp32.graphs["talker"].weight_bytes.unwrap());
        assert!(qb * 2 < fb, "{name}: talker weights {qb} bytes, float32 {fb}");
    }
    let fp32 = engine::read_manifest(&common::bundle("tiny-q")).unwrap();
    assert_eq!(fp32.weights(), WeightFormat::Fp32);
    assert!(fp32.quantization.is_none());
}

#[test]
fn quantized_weights_need_their_quantization_table() {
    let text = std::fs::read_to_string(common::bundle("tiny-q-q4").join("bundle.toml")).unwrap();
    let cut = text.find("[quantization]").unwrap();
    let end = text[cut..].find("\n[graphs").map_or(text.len(), |e| cut + e + 1);
    let without = format!("{}{}", &text[..cut], &text[end..]);
    let e = parse(&without).unwrap_err().to_string();
    assert!(e.contains("model.weights") && e.contains("[quantization]"), "{e}");
    let bad = text.replace("weights = \"q4\"", "weights = \"q3\"");
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("q3") && e.contains("\"q4\""), "{e}");
    // a step graph whose weight format contradicts the model's
    let talker = text.find("[graphs.talker]").unwrap();
    let at = talker + text[talker..].find("weights = \"q4\"").unwrap();
    let bad = format!("{}weights = \"fp16\"{}", &text[..at], &text[at + "weights = \"q4\"".len()..]);
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("graphs.talker.weights") && e.contains("fp16"), "{e}");
    // q4 is blocks of 32
    let bad = text.replace("block_size = 32", "block_size = 0");
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("block_size = 0") && e.contains("32"), "{e}");
    // activations: int8 (as the gate measured them) or float32, and int8 only for q4
    assert!(text.contains("activations = \"int8\""), "the exporter writes q4's activations");
    let float = parse(&text.replace("activations = \"int8\"", "activations = \"float32\"")).unwrap();
    assert!(!float.int8_activations());
    let absent = parse(&text.replace("activations = \"int8\"\n", "")).unwrap();
    assert!(!absent.int8_activations(), "bundles written before the key: float32");
    let e = parse(&text.replace("activations = \"int8\"", "activations = \"int4\"")).unwrap_err().to_string();
    assert!(e.contains("quantization.activations") && e.contains("int4"), "{e}");
    let q8 = std::fs::read_to_string(common::bundle("tiny-q-q8").join("bundle.toml")).unwrap();
    let at = q8.find("float_weights").unwrap();
    let bad = format!("{}activations = \"int8\"\n{}", &q8[..at], &q8[at..]);
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("quantization.activations") && e.contains("q8"), "{e}");
}

/// `[[qnn.binaries]]`: step graphs carry slots and positions, the vocoder frames only.
#[test]
fn qnn_vocoder_entries_carry_frames_only() {
    let entry = |stack: &str, sizes: &str| {
        format!(
            "\n[qnn]\nsdk = \"2.51.0\"\ncompiler = \"onnxruntime-qnn 2.7.0\"\n\n[[qnn.binaries]]\nstack = \"{stack}\"\narch = \"v79\"\nsoc_model = 69\n\
             file = \"qnn_x.bin\"\nsha256 = \"00\"\ngraph = \"g\"\n{sizes}\nprecision = \"fp16\"\n"
        )
    };
    let base = manifest_text();
    let m = parse(&format!("{base}{}", entry("vocoder", "frames = 2"))).unwrap();
    let b = &m.qnn.unwrap().binaries[0];
    assert_eq!((b.stack.as_str(), b.frames, b.slots, b.positions), ("vocoder", 2, 0, 0));
    let m = parse(&format!("{base}{}", entry("talker", "slots = 64\npositions = 1"))).unwrap();
    assert_eq!(m.qnn.unwrap().binaries[0].frames, 0);
    for (stack, sizes, says) in [
        ("vocoder", "slots = 64\nframes = 2", "a vocoder binary has positive frames"),
        ("vocoder", "frames = 0", "a vocoder binary has positive frames"),
        ("talker", "slots = 64\npositions = 1\nframes = 2", "a step graph's binary"),
        ("talker", "frames = 2", "a step graph's binary"),
        ("decoder", "frames = 2", "must be \"talker\", \"code_predictor\" or \"vocoder\""),
    ] {
        let err = parse(&format!("{base}{}", entry(stack, sizes))).unwrap_err();
        assert!(err.to_string().contains(says), "{stack} {sizes:?}: {err}");
    }
    // a vocoder binary needs the stream graph it was compiled from
    let no_stream = base.replace("stream_graph = \"vocoder_stream\"\n", "");
    assert_ne!(no_stream, base);
    let err = parse(&format!("{no_stream}{}", entry("vocoder", "frames = 2"))).unwrap_err();
    assert!(err.to_string().contains("needs the stream graph"), "{err}");
}

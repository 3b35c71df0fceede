//! The ONNX sanitizer against crafted graphs carrying the torch-export patterns.
//!
//! The graphs come from `tools/export/herald_export/crafted.py` (run with the project's
//! `.venv` Python, or `HERALD_PYTHON`), which also records the inputs and the outputs
//! onnxruntime computes on the *original* graphs. Each case: note what tract does with the
//! original (printed, not required to fail), sanitize it into another directory, check the
//! rewrite counts and the absence of every pattern, then run the sanitized graph in tract and
//! compare with onnxruntime.

// Test helpers outside `#[test]` functions: failing loudly is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use backend_tract::sanitize::{SanitizeError, SanitizeReport, sanitize_file};
use prost::Message;
use serde_json::Value;
use tract_onnx::pb;
use tract_onnx::prelude::*;

const TOLERANCE: f32 = 1e-5;

fn repo_root() -> PathBuf {
    // backend/tract -> the workspace root
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tmp_root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The Python that runs `herald_export.crafted`: `HERALD_PYTHON`, else the project's `.venv`.
fn python() -> PathBuf {
    let python = std::env::var_os("HERALD_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    assert!(
        python.is_file(),
        "no Python at {} to generate the crafted ONNX graphs: create the venv \
         (tools/export/setup.sh) or set HERALD_PYTHON to a python with numpy, onnx and \
         onnxruntime",
        python.display()
    );
    python
}

/// Runs `python -m herald_export.crafted ARGS` in `tools/export`; panics with its stderr.
fn crafted(args: &[&std::ffi::OsStr]) -> String {
    let python = python();
    let out = Command::new(&python)
        .args(["-m", "herald_export.crafted"])
        .args(args)
        .current_dir(repo_root().join("tools/export"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "python -m herald_export.crafted {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The crafted graphs, generated once per test process (in a per-process directory, so
/// concurrent `cargo test` runs do not race).
fn crafted_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tmp_root().join(format!("crafted-{}", std::process::id()));
        crafted(&[dir.as_os_str()]);
        dir
    })
}

fn read_json(path: &Path) -> Value {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tensor_of(v: &Value) -> (Vec<usize>, Vec<f32>) {
    let shape = v["shape"].as_array().expect("shape").iter().map(|d| d.as_u64().expect("dim") as usize).collect();
    let data = v["data"].as_array().expect("data").iter().map(|x| x.as_f64().expect("float") as f32).collect();
    (shape, data)
}

fn load(path: &Path) -> TractResult<Arc<TypedRunnableModel>> {
    tract_onnx::onnx().model_for_path(path)?.into_optimized()?.into_runnable()
}

/// Runs `path` in tract on the case's inputs; the largest difference to onnxruntime's outputs.
fn run_and_compare(path: &Path, case: &Value) -> TractResult<f32> {
    let model = load(path)?;
    let graph = decode(path).graph.expect("graph");
    let mut inputs = TVec::new();
    for vi in &graph.input {
        let (shape, data) = tensor_of(&case["inputs"][&vi.name]);
        inputs.push(Tensor::from_shape(&shape, &data)?.into_tvalue());
    }
    let outputs = model.run(inputs)?;
    let expected = case["outputs"].as_array().expect("outputs");
    tract_data::internal::ensure!(outputs.len() == expected.len(), "{} outputs, onnxruntime gave {}", outputs.len(), expected.len());
    let mut worst = 0f32;
    for (got, want) in outputs.iter().zip(expected) {
        let (shape, data) = tensor_of(want);
        let name = want["name"].as_str().unwrap_or("?");
        tract_data::internal::ensure!(
            got.shape() == shape.as_slice(),
            "output {name}: shape {:?}, onnxruntime {shape:?}",
            got.shape()
        );
        let got = got.cast_to::<f32>()?;
        for (a, b) in got.to_plain_array_view::<f32>()?.iter().zip(&data) {
            worst = worst.max((a - b).abs());
        }
    }
    Ok(worst)
}

fn decode(path: &Path) -> pb::ModelProto {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    pb::ModelProto::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn all_graphs(g: &pb::GraphProto) -> Vec<&pb::GraphProto> {
    let mut out = vec![g];
    for n in &g.node {
        for a in &n.attribute {
            for sub in a.g.iter().chain(&a.graphs) {
                out.extend(all_graphs(sub));
            }
        }
    }
    out
}

/// Rank of the constant `name` as seen from `scopes` (innermost last): initializer or Constant.
fn const_rank(scopes: &[&pb::GraphProto], name: &str) -> Option<usize> {
    for g in scopes.iter().rev() {
        if let Some(i) = g.initializer.iter().find(|i| i.name == name) {
            return Some(i.dims.len());
        }
        if let Some(n) = g.node.iter().find(|n| n.output.iter().any(|o| o == name)) {
            if n.op_type != "Constant" {
                return None;
            }
            let a = &n.attribute[0];
            return Some(match a.name.as_str() {
                "value" => a.t.as_ref().expect("tensor").dims.len(),
                "value_int" | "value_float" => 0,
                _ => 1,
            });
        }
    }
    None
}

/// Structural findings in a model: (NaN guards, Reshapes with allowzero=1, rank-0 axes,
/// value_info entries), over every graph.
fn findings(model: &pb::ModelProto) -> (usize, usize, usize, usize) {
    fn walk<'a>(g: &'a pb::GraphProto, scopes: &mut Vec<&'a pb::GraphProto>, acc: &mut (usize, usize, usize, usize)) {
        scopes.push(g);
        let producer = |name: &str| g.node.iter().find(|n| n.output.iter().any(|o| o == name));
        for n in &g.node {
            let allowzero = n.attribute.iter().any(|a| a.name == "allowzero" && a.i != 0);
            match n.op_type.as_str() {
                "Where" => {
                    let mut cond = producer(&n.input[0]);
                    if let Some(not) = cond.filter(|c| c.op_type == "Not") {
                        cond = producer(&not.input[0]);
                    }
                    if cond.is_some_and(|c| c.op_type == "IsNaN") {
                        acc.0 += 1;
                    }
                }
                "Reshape" if allowzero => acc.1 += 1,
                "Unsqueeze" | "Squeeze" if n.input.get(1).is_some_and(|axes| const_rank(scopes, axes) == Some(0)) => acc.2 += 1,
                _ => {}
            }
            for a in &n.attribute {
                for sub in a.g.iter().chain(&a.graphs) {
                    walk(sub, scopes, acc);
                }
            }
        }
        acc.3 += g.value_info.len();
        scopes.pop();
    }
    let mut acc = (0, 0, 0, 0);
    walk(model.graph.as_ref().expect("graph"), &mut Vec::new(), &mut acc);
    acc
}

fn io_names(model: &pb::ModelProto) -> (Vec<String>, Vec<String>) {
    let g = model.graph.as_ref().expect("graph");
    (g.input.iter().map(|i| i.name.clone()).collect(), g.output.iter().map(|o| o.name.clone()).collect())
}

fn assert_counts(name: &str, report: &SanitizeReport, expect: &Value) {
    let count = |k: &str| expect[k].as_u64().unwrap_or_else(|| panic!("{name}: no expected {k}")) as usize;
    let got = [
        ("nan_guards_removed", report.nan_guards_removed),
        ("nan_guards_kept", report.nan_guards_kept),
        ("allowzero_cleared", report.allowzero_cleared),
        ("allowzero_kept", report.allowzero_kept),
        ("scalar_axes_fixed", report.scalar_axes_fixed),
        ("value_info_dropped", report.value_info_dropped),
    ];
    for (k, v) in got {
        assert_eq!(v, count(k), "{name}: {k} ({report})");
    }
}

/// The whole check of one crafted case; returns the sanitized model's path.
fn check_case(name: &str) -> PathBuf {
    let dir = crafted_dir();
    let case = read_json(&dir.join(format!("{name}.json")));
    let original = dir.join(case["model"].as_str().expect("model"));

    match run_and_compare(&original, &case) {
        Ok(diff) => println!("[{name}] tract on the original: loads and runs, max |diff| vs onnxruntime {diff:e}"),
        Err(e) => {
            println!("[{name}] tract on the original: FAILS: {e:#}");
            // What tract's own switch for stale value_info does with it.
            let lenient = tract_onnx::onnx()
                .with_ignore_value_info(true)
                .model_for_path(&original)
                .and_then(|m| m.into_optimized())
                .map(|_| "loads".to_string())
                .unwrap_or_else(|e| format!("FAILS: {e:#}"));
            println!("[{name}] tract on the original with_ignore_value_info(true): {lenient}");
        }
    }

    let out_dir = dir.join(format!("sanitized-{name}"));
    fs::create_dir_all(&out_dir).expect("mkdir");
    let sanitized = out_dir.join(format!("{name}.onnx"));
    let report = sanitize_file(&original, &sanitized).unwrap_or_else(|e| panic!("{name}: {e}"));
    println!("[{name}] {report}");
    assert!(!report.to_string().contains('\n'), "one-line report");
    assert_counts(name, &report, &case["expect"]);

    let before = decode(&original);
    let after = decode(&sanitized);
    assert_eq!(io_names(&before), io_names(&after), "{name}: graph inputs/outputs renamed");
    let (guards, allowzero, scalar_axes, value_info) = findings(&after);
    assert_eq!(guards, report.nan_guards_kept, "{name}: IsNaN→Where pairs left");
    assert_eq!(allowzero, report.allowzero_kept, "{name}: allowzero=1 left");
    assert_eq!(scalar_axes, 0, "{name}: rank-0 axes left");
    assert_eq!(value_info, 0, "{name}: value_info left");
    let isnan_left =
        all_graphs(after.graph.as_ref().expect("graph")).iter().flat_map(|g| &g.node).filter(|n| n.op_type == "IsNaN").count();
    assert_eq!(isnan_left, 0, "{name}: IsNaN nodes left");

    for file in case["external_data"].as_array().expect("external_data") {
        let file = file.as_str().expect("location");
        let (a, b) = (dir.join(file), out_dir.join(file));
        let (a, b) = (fs::read(&a).expect("original external data"), fs::read(&b).expect("copied external data"));
        assert_eq!(a, b, "{name}: external data {file} copied unchanged");
    }

    // The reference tooling accepts the result too: full onnx.checker, same onnxruntime outputs.
    let checked = crafted(&["--check".as_ref(), sanitized.as_os_str(), dir.join(format!("{name}.json")).as_os_str()]);
    println!("[{name}] {}", checked.trim());

    let diff = run_and_compare(&sanitized, &case).unwrap_or_else(|e| panic!("{name}: tract on the sanitized graph: {e:#}"));
    println!("[{name}] tract on the sanitized graph: max |diff| vs onnxruntime {diff:e}");
    assert!(diff <= TOLERANCE, "{name}: max |diff| {diff} > {TOLERANCE}");
    sanitized
}

#[test]
fn nan_guard() {
    check_case("nan_guard");
}

#[test]
fn reshape_allowzero() {
    check_case("reshape_allowzero");
}

#[test]
fn scalar_axes() {
    check_case("scalar_axes");
}

#[test]
fn stale_value_info() {
    check_case("stale_value_info");
}

#[test]
fn external_data() {
    check_case("external_data");
}

#[test]
fn all_patterns() {
    check_case("all_patterns");
}

#[test]
fn sanitizing_twice_changes_nothing() {
    let first = check_case("all_patterns");
    let second = first.with_file_name("all_patterns.again.onnx");
    let report = sanitize_file(&first, &second).expect("sanitize again");
    assert!(report.is_unchanged(), "{report}");
    assert_eq!(fs::read(&first).expect("first"), fs::read(&second).expect("second"));
}

#[test]
fn external_data_in_place_and_next_to_an_identical_copy() {
    let dir = crafted_dir();
    // Same directory: nothing to copy.
    let same_dir = dir.join("external_data.same-dir.onnx");
    sanitize_file(&dir.join("external_data.onnx"), &same_dir).expect("same directory");
    let case = read_json(&dir.join("external_data.json"));
    assert!(run_and_compare(&same_dir, &case).expect("run") <= TOLERANCE);

    // Another directory already holding an identical weights.bin: accepted, left as is.
    let out = dir.join("ext-identical");
    fs::create_dir_all(&out).expect("mkdir");
    fs::copy(dir.join("weights.bin"), out.join("weights.bin")).expect("copy");
    sanitize_file(&dir.join("external_data.onnx"), &out.join("m.onnx")).expect("identical copy present");
    assert!(run_and_compare(&out.join("m.onnx"), &case).expect("run") <= TOLERANCE);
}

#[test]
fn external_data_conflict_is_refused() {
    let dir = crafted_dir();
    let out = dir.join("ext-conflict");
    fs::create_dir_all(&out).expect("mkdir");
    fs::write(out.join("weights.bin"), b"some other weights").expect("write");
    let err = sanitize_file(&dir.join("external_data.onnx"), &out.join("m.onnx")).expect_err("conflict");
    assert!(matches!(err, SanitizeError::ExternalConflict { .. }), "{err:?}");
    assert!(err.to_string().contains(&out.join("weights.bin").display().to_string()), "{err}");
    assert!(!out.join("m.onnx").exists(), "no model written next to a conflicting file");
    assert_eq!(fs::read(out.join("weights.bin")).expect("read"), b"some other weights", "untouched");
}

fn bad_dir() -> PathBuf {
    let d = tmp_root().join(format!("sanitize-bad-{}", std::process::id()));
    fs::create_dir_all(&d).expect("mkdir");
    d
}

#[test]
fn missing_input_is_a_read_error_naming_the_file() {
    let input = bad_dir().join("does-not-exist.onnx");
    let err = sanitize_file(&input, &bad_dir().join("out.onnx")).expect_err("missing");
    assert!(matches!(&err, SanitizeError::Read { path, .. } if path == &input), "{err:?}");
    assert!(err.to_string().contains("does-not-exist.onnx"), "{err}");
}

#[test]
fn directory_input_is_a_read_error_naming_it() {
    let input = bad_dir().join("a-directory.onnx");
    fs::create_dir_all(&input).expect("mkdir");
    let err = sanitize_file(&input, &bad_dir().join("out-dir.onnx")).expect_err("directory");
    assert!(matches!(&err, SanitizeError::Read { path, .. } if path == &input), "{err:?}");
    assert!(err.to_string().contains("a-directory.onnx"), "{err}");
}

#[test]
fn garbage_input_is_not_onnx() {
    let cases: [(&str, &[u8]); 3] = [
        ("text.onnx", b"this is not an onnx model\n"),
        ("binary.onnx", &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02]),
        ("empty.onnx", b""),
    ];
    for (file, bytes) in cases {
        let input = bad_dir().join(file);
        fs::write(&input, bytes).expect("write");
        let output = bad_dir().join(format!("out-{file}"));
        let err = sanitize_file(&input, &output).expect_err(file);
        assert!(matches!(&err, SanitizeError::NotOnnx { path, .. } if path == &input), "{file}: {err:?}");
        assert!(err.to_string().contains(file), "{err}");
        assert!(!output.exists(), "{file}: nothing written");
    }
}

#[test]
fn unwritable_output_is_a_write_error_naming_it() {
    let dir = crafted_dir();
    let output = bad_dir().join("no-such-dir/out.onnx");
    let err = sanitize_file(&dir.join("nan_guard.onnx"), &output).expect_err("no directory");
    assert!(matches!(&err, SanitizeError::Write { path, .. } if path == &output), "{err:?}");
    assert!(err.to_string().contains("no-such-dir"), "{err}");

    let err = sanitize_file(&dir.join("nan_guard.onnx"), &bad_dir()).expect_err("a directory");
    assert!(matches!(&err, SanitizeError::Write { .. }), "{err:?}");
    let leftovers: HashSet<_> = fs::read_dir(bad_dir())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn dynamic_shapes() {
    check_case("dynamic_shapes");
}

/// A model whose one initializer lives in the external file `location`.
fn external_model(location: &str) -> Vec<u8> {
    let entry = |k: &str, v: &str| pb::StringStringEntryProto { key: k.to_string(), value: v.to_string() };
    let w = pb::TensorProto {
        name: "w".to_string(),
        dims: vec![2],
        data_type: pb::tensor_proto::DataType::Float as i32,
        data_location: Some(pb::tensor_proto::DataLocation::External as i32),
        external_data: vec![entry("location", location), entry("offset", "0"), entry("length", "8")],
        ..Default::default()
    };
    let graph = pb::GraphProto {
        name: "g".to_string(),
        node: vec![pb::NodeProto {
            op_type: "Identity".to_string(),
            input: vec!["w".to_string()],
            output: vec!["y".to_string()],
            ..Default::default()
        }],
        initializer: vec![w],
        output: vec![pb::ValueInfoProto { name: "y".to_string(), ..Default::default() }],
        ..Default::default()
    };
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(graph),
        ..Default::default()
    };
    model.encode_to_vec()
}

#[test]
fn external_data_in_a_subdirectory_is_copied_there() {
    let root = bad_dir().join("ext-nested");
    fs::create_dir_all(root.join("in/sub")).expect("mkdir");
    fs::create_dir_all(root.join("out")).expect("mkdir");
    fs::write(root.join("in/m.onnx"), external_model("sub/w.bin")).expect("write");
    fs::write(root.join("in/sub/w.bin"), 1.5f32.to_le_bytes().repeat(2)).expect("write");
    sanitize_file(&root.join("in/m.onnx"), &root.join("out/m.onnx")).expect("sanitize");
    assert_eq!(fs::read(root.join("out/sub/w.bin")).expect("copied"), fs::read(root.join("in/sub/w.bin")).expect("original"));
    let model = load(&root.join("out/m.onnx")).expect("tract loads the copy");
    let y = model.run(tvec![]).expect("run");
    assert_eq!(y[0].to_plain_array_view::<f32>().expect("f32").iter().copied().collect::<Vec<_>>(), [1.5, 1.5]);
}

#[test]
fn external_data_outside_the_model_directory_or_missing_is_refused() {
    let root = bad_dir().join("ext-bad");
    fs::create_dir_all(root.join("in")).expect("mkdir");
    fs::create_dir_all(root.join("out")).expect("mkdir");
    fs::write(root.join("w.bin"), [0u8; 8]).expect("write");
    for (location, what) in [("../w.bin", "escaping"), ("/etc/hostname", "absolute")] {
        let input = root.join("in/m.onnx");
        fs::write(&input, external_model(location)).expect("write");
        let err = sanitize_file(&input, &root.join("out/m.onnx")).expect_err(what);
        assert!(matches!(&err, SanitizeError::ExternalLocation { location: l, .. } if l == location), "{what}: {err:?}");
        assert!(err.to_string().contains(location), "{err}");
    }
    let input = root.join("in/missing.onnx");
    fs::write(&input, external_model("nowhere.bin")).expect("write");
    let err = sanitize_file(&input, &root.join("out/m.onnx")).expect_err("missing");
    assert!(matches!(&err, SanitizeError::ExternalRead { .. }), "{err:?}");
    assert!(err.to_string().contains("nowhere.bin"), "{err}");
    assert!(!root.join("out/m.onnx").exists());
}

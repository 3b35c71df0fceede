"""``export qnn``: QNN HTP context binaries of the step graphs (herald_export.qnn, qnn_quant).

Needs the onnxruntime-qnn wheel (tools/export/requirements-qnn.txt; setup.sh installs it on
Linux x86_64 with glibc >= 2.35); skipped otherwise. On x86_64 its libQnnHtp.so runs the
binaries on a simulator, which is what the numeric checks use: each compiled binary, wrapped in
an EPContext model, runs through onnxruntime's QNN EP and is compared with the float32 static
graph on the CPU EP.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest
import tomli_w

try:
    import onnxruntime_qnn  # noqa: F401
except Exception as e:   # ImportError, or an OSError from a wheel for another platform
    pytest.skip(f"onnxruntime-qnn is not importable ({e.__class__.__name__}: {e}); run tools/export/setup.sh "
                "on a Linux x86_64 host with glibc >= 2.35", allow_module_level=True)

import onnxruntime as ort  # noqa: E402

from herald_export import qnn, qnn_quant  # noqa: E402
from herald_export.__main__ import main  # noqa: E402
from herald_export.gate import snr_db  # noqa: E402
from herald_export.lm import MASK_FILL, rope_tables  # noqa: E402

EXPORT_DIR = Path(__file__).resolve().parents[1]
ENTRY_KEYS = {"stack", "arch", "soc_model", "file", "sha256", "graph", "slots", "positions", "precision"}
SLOTS = 64


@pytest.fixture
def bundle_copy(tiny_factory, tmp_path):
    """Call with a preset: a private copy of its fp32 tiny bundle."""
    def make(preset: str) -> Path:
        src, _ = tiny_factory(preset)
        dst = tmp_path / preset
        shutil.copytree(src, dst)
        return dst

    return make


def run_qnn(bundle: Path, arch: str, *extra: str) -> int:
    return main(["qnn", "--bundle", str(bundle), "--arch", arch, "--talker-slots", str(SLOTS), "--quiet", *extra])


def manifest(bundle: Path) -> dict:
    return tomllib.loads((bundle / "bundle.toml").read_text())


def tree(bundle: Path) -> dict[str, bytes]:
    """Every file of a bundle and its parent's entries: what must not change on a failed run."""
    files = {p.name: p.read_bytes() for p in bundle.iterdir()}
    files["<siblings>"] = repr(sorted(p.name for p in bundle.parent.iterdir())).encode()
    return files


# --------------------------------------------------------------------------- binary info (QNN System API)
DATA_TYPES = {0x0216: "FLOAT_16", 0x0232: "FLOAT_32", 0x0064: "INT_64", 0x0032: "INT_32",
              0x0416: "UFIXED_POINT_16", 0x0408: "UFIXED_POINT_8"}


def binary_io(path: Path) -> tuple[str, dict[str, tuple[str, list[int]]], dict[str, tuple[str, list[int]]]]:
    """(graph name, inputs, outputs) of a context binary, read with libQnnSystem's
    ``systemContextGetBinaryInfo`` (layouts of /work/shared/reference/qnn.md section 3: binary
    info v3, graph infos 88 bytes apart, v1 tensors of 144 bytes)."""
    lib = ctypes.CDLL(str(Path(onnxruntime_qnn.get_qnn_htp_path()).parent / "libQnnSystem.so"))
    providers, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_uint32()
    assert lib.QnnSystemInterface_getProviders(ctypes.byref(providers), ctypes.byref(n)) == 0 and n.value >= 1
    iface = providers[0]
    u32 = lambda a: ctypes.c_uint32.from_address(a).value                      # noqa: E731
    ptr = lambda a: ctypes.c_void_p.from_address(a).value or 0                 # noqa: E731
    assert u32(iface + 16) == 1, "system API major version"

    def fn(slot, *args):
        return ctypes.CFUNCTYPE(ctypes.c_uint64, *args)(ptr(iface + 32 + 8 * slot))

    create = fn(0, ctypes.POINTER(ctypes.c_void_p))
    info = fn(1, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p),
              ctypes.POINTER(ctypes.c_uint64))
    free = fn(3, ctypes.c_void_p)
    data = path.read_bytes()
    buf = ctypes.create_string_buffer(data, len(data))
    ctx = ctypes.c_void_p()
    assert create(ctypes.byref(ctx)) & 0xFFFF == 0
    try:
        bi, size = ctypes.c_void_p(), ctypes.c_uint64()
        assert info(ctx, buf, len(data), ctypes.byref(bi), ctypes.byref(size)) & 0xFFFF == 0
        base = bi.value
        assert u32(base) == 3, "binary info version"
        assert u32(base + 96) == 1, "one graph per binary"
        g = ptr(base + 104)
        assert u32(g) == 3, "graph info version"
        name = ctypes.string_at(ptr(g + 8)).decode()

        def tensors(off):
            out = {}
            for i in range(u32(g + off)):
                t = ptr(g + off + 8) + 144 * i
                assert u32(t) in (1, 2)
                u = t + 8
                dims = [u32(ptr(u + 80) + 4 * j) for j in range(u32(u + 72))]
                out[ctypes.string_at(ptr(u + 8)).decode()] = (DATA_TYPES.get(u32(u + 24), hex(u32(u + 24))), dims)
            return out

        return name, tensors(16), tensors(32)
    finally:
        free(ctx)


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("preset", ["tiny-0.6b", "tiny-hybrid"])
def test_v73_v79_binaries_and_manifest(bundle_copy, preset):
    b = bundle_copy(preset)
    before = manifest(b)
    assert run_qnn(b, "v73") == 0
    assert run_qnn(b, "v79") == 0
    m = manifest(b)
    q = m.pop("qnn")
    assert m == before, "export qnn changed other parts of bundle.toml"
    assert set(q) == {"sdk", "compiler", "binaries"}
    assert q["sdk"] == "2.51.0" and q["compiler"] == "onnxruntime-qnn 2.7.0"
    bins = q["binaries"]
    assert [(e["arch"], e["stack"], e["slots"]) for e in bins] == sorted((e["arch"], e["stack"], e["slots"]) for e in bins)
    want = {(a, s, n) for a in ("v73", "v79") for s, n in (("talker", SLOTS), ("code_predictor", 16))}
    assert {(e["arch"], e["stack"], e["slots"]) for e in bins} == want
    for e in bins:
        assert set(e) == ENTRY_KEYS
        assert e["file"] == f"qnn_{e['stack']}_{e['arch']}_s{e['slots']}.bin"
        assert e["soc_model"] == {"v73": 43, "v79": 69}[e["arch"]]
        assert e["positions"] == 1 and e["precision"] == "fp16"
        assert re.fullmatch(r"QNNExecutionProvider_QNNExecutionProvider_[0-9]+_1_0", e["graph"])
        path = b / e["file"]
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == e["sha256"]
        graph, inputs, outputs = binary_io(path)
        assert graph == e["graph"]
        for name, (dt, dims) in {**inputs, **outputs}.items():
            if name.startswith(qnn.KV_PREFIXES):
                assert dt == "FLOAT_16", (name, dt)
            else:
                assert dt == ("INT_64" if name == "head" else "FLOAT_32"), (name, dt)
            if name.startswith(("x", "cos", "sin", "logits", "hidden", "k_new_", "v_new_")):
                assert dims[1] == 1, (name, dims)
        for i in range(m[e["stack"]]["layers"]):
            kind = m[e["stack"]]["cache"][i]["kind"]
            want_len = e["slots"] if kind == "full" else m[e["stack"]]["cache"][i]["window"] - 1
            assert inputs[f"k_cache_{i}"][1][1] == want_len
        if "mask_full_past" in inputs:
            assert inputs["mask_full_past"][1] == [1, 1, 1, e["slots"]]
    # only the raw binaries are kept: no EPContext models, no scratch or temporary directories
    names = {p.name for p in b.iterdir()}
    assert {n for n in names if n.startswith("qnn_")} == {e["file"] for e in bins}
    assert not [n for n in names if n.endswith("_qnn.bin") or n.startswith(".")]
    assert [p.name for p in b.parent.iterdir() if p.name.startswith(".")] == []
    # every key written is documented (docs/bundle.md, the bundle.toml table)
    doc = (EXPORT_DIR.parents[1] / "docs" / "bundle.md").read_text()
    doc = doc[doc.index("## `bundle.toml`"):]
    documented = set(re.findall(r"^\| `([a-z_<>\[\].0-9]+)` \|", doc, flags=re.M))
    keys = {"qnn.sdk", "qnn.compiler"} | {f"qnn.binaries[].{k}" for k in ENTRY_KEYS}
    assert keys <= documented, sorted(keys - documented)


def _random_feeds(static: onnx.ModelProto, rng: np.random.Generator, visible: int) -> dict[str, np.ndarray]:
    """Random but valid step inputs at position ``visible``: the first ``visible`` past slots
    (and ring slots) visible, the rest hidden (``MASK_FILL``), caches N(0, 1) everywhere."""
    np_types = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64}
    feeds = {}
    for vi in static.graph.input:
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dt = np_types[vi.type.tensor_type.elem_type]
        if vi.name == "head":
            feeds[vi.name] = np.array([3], np.int64)
        elif vi.name.startswith("mask_"):
            a = np.full(dims, MASK_FILL, np.float32)
            a[..., : visible if vi.name in ("mask_full_past", "mask_sliding_ring") else dims[-1]] = 0.0
            feeds[vi.name] = a
        elif vi.name in ("cos", "sin"):
            cos, sin = rope_tables(np.array([visible]), dims[-1], 1_000_000.0)
            feeds[vi.name] = (cos if vi.name == "cos" else sin)[None]
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(dt)
    return feeds


@pytest.mark.parametrize("stack", ["talker", "code_predictor"])
def test_binary_matches_float_graph_on_the_simulator(bundle_copy, stack):
    b = bundle_copy("tiny-hybrid")
    assert run_qnn(b, "v73") == 0
    e = next(e for e in manifest(b)["qnn"]["binaries"] if e["stack"] == stack)
    src = onnx.load(str(b / f"{stack}.onnx"))
    f32 = qnn.static_step_graph(qnn._copy(src), e["slots"], kv_float16=False)
    f16 = qnn.static_step_graph(qnn._copy(src), e["slots"], kv_float16=True)
    wrapper = b / f"{stack}_epcontext.onnx"   # beside the binary it names
    onnx.save(qnn.epcontext_model(e["file"], e["graph"], "2.51.0", f16.graph.input, f16.graph.output), str(wrapper))
    onnx.save(f32, str(b / f"{stack}_f32.onnx"))
    rt = qnn.QnnRuntime.get()
    with qnn.captured_native_output():
        htp = rt.session(wrapper)
    cpu = ort.InferenceSession(str(b / f"{stack}_f32.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    ref, got = [], []
    for visible in (0, 3, 5):
        feeds = _random_feeds(f16, rng, visible)
        out = dict(zip([o.name for o in htp.get_outputs()], htp.run(None, feeds)))
        want = dict(zip([o.name for o in cpu.get_outputs()],
                        cpu.run(None, {k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()})))
        for name, v in out.items():
            assert v.dtype == (np.float16 if name.startswith(qnn.KV_PREFIXES) else np.float32), name
            assert v.shape == want[name].shape
        ref.append(want["logits"])
        got.append(out["logits"])
    snr = snr_db(np.concatenate(ref), np.concatenate(got))
    assert snr >= 40.0, f"{stack} logits SNR {snr:.1f} dB on the HTP simulator"


def test_rerun_replaces_that_arch_only(bundle_copy):
    b = bundle_copy("tiny-0.6b")
    assert run_qnn(b, "v73") == 0
    assert run_qnn(b, "v79") == 0
    v79 = [e for e in manifest(b)["qnn"]["binaries"] if e["arch"] == "v79"]
    man = manifest(b)
    man["talker"]["max_positions"] = 48   # a small talker, so a clipped tier compiles quickly
    (b / "bundle.toml").write_text(tomli_w.dumps(man))
    assert main(["qnn", "--bundle", str(b), "--arch", "v73", "--talker-slots", "32,100,4096", "--quiet"]) == 0
    bins = manifest(b)["qnn"]["binaries"]
    assert [e for e in bins if e["arch"] == "v79"] == v79
    v73 = [(e["stack"], e["slots"]) for e in bins if e["arch"] == "v73"]
    assert v73 == [("code_predictor", 16), ("talker", 32), ("talker", 48)]   # clipped to max_positions, deduplicated
    assert not (b / f"qnn_talker_v73_s{SLOTS}.bin").exists()
    assert (b / f"qnn_talker_v79_s{SLOTS}.bin").exists()
    files = {p.name for p in b.glob("qnn_*.bin")}
    assert files == {e["file"] for e in bins}


# --------------------------------------------------------------------------- errors
def test_unknown_arch_and_non_bundle(bundle_copy, tmp_path, capsys):
    b = bundle_copy("tiny-0.6b")
    before = tree(b)
    assert run_qnn(b, "v75") == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --arch: unknown architecture 'v75' (choose from v68, v73, v79)"
    assert tree(b) == before
    (tmp_path / "empty").mkdir()
    assert run_qnn(tmp_path / "empty", "v73") == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'empty'}: not a bundle: no bundle.toml"
    assert run_qnn(tmp_path / "absent", "v73") == 2
    assert "not a bundle directory" in capsys.readouterr().err


def test_missing_package_is_one_line(bundle_copy, monkeypatch, capsys):
    b = bundle_copy("tiny-0.6b")
    before = tree(b)
    monkeypatch.setattr(qnn.QnnRuntime, "_instance", None)
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)   # import now raises ImportError
    assert run_qnn(b, "v73") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "onnxruntime-qnn is not installed" in err and "tools/export/setup.sh" in err
    assert tree(b) == before


def test_compile_failure_leaves_bundle_unchanged(bundle_copy, capsys):
    b = bundle_copy("tiny-0.6b")
    assert run_qnn(b, "v79") == 0
    before = tree(b)
    assert run_qnn(b, "v73", "--soc", "9999") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the QNN compile for v73 (soc_model 9999) failed" in err and "QNN_DEVICE_ERROR_INVALID_CONFIG" in err
    assert tree(b) == before


def test_graph_rules_are_enforced(bundle_copy, capsys):
    b = bundle_copy("tiny-0.6b")
    original = {n: (b / n).read_bytes() for n in ("talker.onnx", "bundle.toml")}
    m = onnx.load(str(b / "talker.onnx"))
    g = m.graph
    g.initializer.append(onnx.numpy_helper.from_array(np.array([True]), "guard_cond"))
    g.node.append(onnx.helper.make_node("Where", ["guard_cond", "logits", "logits"], ["guarded"], name="/guard/Where"))
    onnx.save(m, str(b / "talker.onnx"))
    man = manifest(b)
    man["graphs"]["talker"]["sha256"] = hashlib.sha256((b / "talker.onnx").read_bytes()).hexdigest()
    (b / "bundle.toml").write_text(tomli_w.dumps(man))
    before = tree(b)
    assert run_qnn(b, "v73") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has a Where node (/guard/Where)" in err
    assert tree(b) == before
    # a modified graph whose sha256 no longer matches is refused too
    for n, data in original.items():
        (b / n).write_bytes(data)
    (b / "code_predictor.onnx").write_bytes((b / "code_predictor.onnx").read_bytes() + b"\0")
    assert run_qnn(b, "v73") == 2
    assert "does not match its sha256" in capsys.readouterr().err


def test_full_disk_is_one_line(bundle_copy, monkeypatch, capsys):
    b = bundle_copy("tiny-0.6b")
    assert run_qnn(b, "v79") == 0
    before = tree(b)
    real = shutil.copyfile

    def full(src, dst, *a, **k):
        if Path(dst).name.startswith("qnn_"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(qnn.shutil, "copyfile", full)
    assert run_qnn(b, "v73") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qnn_talker_v73_s64.bin: no space left on device" in err
    assert f"the bundle at {b.resolve()} is unchanged" in err
    assert tree(b) == before


# --------------------------------------------------------------------------- v68 (w8a16)
def test_v68_w8a16_binaries_pass_the_gate(bundle_copy, capsys):
    b = bundle_copy("tiny-0.6b")
    assert main(["qnn", "--bundle", str(b), "--arch", "v68", "--talker-slots", str(SLOTS)]) == 0
    err = capsys.readouterr().err
    assert err.count("w8a16 gate") == 2 and "FAILED" not in err
    bins = manifest(b)["qnn"]["binaries"]
    assert [(e["stack"], e["slots"], e["precision"], e["soc_model"]) for e in bins] == [
        ("code_predictor", 16, "w8a16", 93), ("talker", SLOTS, "w8a16", 93)]
    for e in bins:
        _, inputs, outputs = binary_io(b / e["file"])
        # the graph quantizes its inputs and dequantizes its outputs itself
        assert {dt for n, (dt, _) in {**inputs, **outputs}.items() if n != "head"} == {"FLOAT_32"}


def test_v68_gate_failure_refuses_unless_allow_lossy(bundle_copy, monkeypatch, capsys):
    b = bundle_copy("tiny-0.6b")
    before = tree(b)
    monkeypatch.setattr(qnn_quant, "THRESHOLDS", qnn_quant.Thresholds(logits_snr_db=200.0, top1=0.8))
    monkeypatch.setattr(qnn_quant, "GATE_STEPS", 8)
    assert run_qnn(b, "v68") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed the w8a16 fidelity gate: logits SNR" in err and "< 200.0" in err
    assert tree(b) == before
    assert main(["qnn", "--bundle", str(b), "--arch", "v68", "--talker-slots", str(SLOTS), "--allow-lossy"]) == 0
    err = capsys.readouterr().err
    assert "warning: --allow-lossy" in err
    assert {e["precision"] for e in manifest(b)["qnn"]["binaries"]} == {"w8a16"}
    assert run_qnn(b, "v73", "--allow-lossy") == 2
    assert "only valid for a quantized architecture" in capsys.readouterr().err


def test_mask_padding_matches_the_dynamic_graph(tiny_factory):
    """The teacher's padded static feeds give the dynamic graph's logits (rings included)."""
    src, _ = tiny_factory("tiny-hybrid")
    teacher = qnn_quant.Teacher(src)
    static = qnn.static_step_graph(onnx.load(str(src / "talker.onnx")), SLOTS, kv_float16=False)
    sess = ort.InferenceSession(static.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds, out in teacher.steps("talker", "gate", SLOTS, 40):
        np.testing.assert_allclose(sess.run(["logits"], feeds)[0], out["logits"], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- the vocoder (--vocoder)
VOCODER_KEYS = {"stack", "arch", "soc_model", "file", "sha256", "graph", "frames", "precision"}


def test_vocoder_binaries_pass_the_gate_and_are_listed(bundle_copy, capsys):
    b = bundle_copy("tiny-0.6b")
    before = manifest(b)
    assert main(["qnn", "--bundle", str(b), "--arch", "v79", "--talker-slots", str(SLOTS), "--vocoder",
                 "--vocoder-frames", "1"]) == 0
    err = capsys.readouterr().err
    m = manifest(b)
    q = m.pop("qnn")
    assert m == before
    voc = [e for e in q["binaries"] if e["stack"] == "vocoder"]
    assert len(voc) == 1 and len(q["binaries"]) == 3
    e = voc[0]
    assert set(e) == VOCODER_KEYS
    assert e["file"] == "qnn_vocoder_v79_f1.bin" and e["frames"] == 1 and e["arch"] == "v79"
    assert e["soc_model"] == 69 and e["precision"] == "fp16"
    assert hashlib.sha256((b / e["file"]).read_bytes()).hexdigest() == e["sha256"]
    graph, inputs, outputs = binary_io(b / e["file"])
    assert graph == e["graph"]
    stream = m["graphs"][m["vocoder"]["stream_graph"]]
    assert list(inputs) == [i["name"] for i in stream["inputs"]]
    assert list(outputs) == [o["name"] for o in stream["outputs"]]
    assert inputs["codes"] == ("INT_64", [1, 16, 1]) and inputs["state.position"] == ("INT_64", [1])
    assert outputs["wav"] == ("FLOAT_32", [1, m["audio"]["samples_per_frame"]])
    for name, (dt, dims) in {**inputs, **outputs}.items():
        if name.startswith(("state.", "next.")) and not name.endswith("position"):
            assert dt == "FLOAT_32", (name, dt)
    # the gate's report: the measured SNR and the threshold
    line = next(x for x in err.splitlines() if x.startswith("vocoder gate qnn_vocoder_v79_f1.bin"))
    snr = float(re.search(r"samples SNR ([0-9.]+) dB \(>= 30\)", line).group(1))
    assert snr >= qnn.VOCODER_SNR_DB, line
    # every key written is documented
    doc = (EXPORT_DIR.parents[1] / "docs" / "bundle.md").read_text()
    doc = doc[doc.index("## `bundle.toml`"):]
    documented = set(re.findall(r"^\| `([a-z_<>\[\].0-9]+)` \|", doc, flags=re.M))
    assert {f"qnn.binaries[].{k}" for k in VOCODER_KEYS} <= documented
    # a re-run without --vocoder replaces the architecture's entries: the vocoder's go too
    assert run_qnn(b, "v79") == 0
    assert [e for e in manifest(b)["qnn"]["binaries"] if e["stack"] == "vocoder"] == []
    assert not (b / "qnn_vocoder_v79_f1.bin").exists()


def test_vocoder_gate_failure_and_bad_flags_leave_the_bundle(bundle_copy, monkeypatch, capsys):
    b = bundle_copy("tiny-0.6b")
    before = tree(b)
    for args, msg in [
        (["--arch", "v79", "--vocoder-frames", "2"], "--vocoder-frames: '2': must include 1"),
        (["--arch", "v79", "--vocoder-frames", "0,1"], "expected frame counts 1..256"),
        (["--arch", "v68", "--vocoder-frames", "1"], "v68 has no float path"),
    ]:
        assert main(["qnn", "--bundle", str(b), "--talker-slots", str(SLOTS), "--quiet", "--vocoder", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err
        assert tree(b) == before
    # a bundle without the stream graph
    man = manifest(b)
    del man["vocoder"]["stream_graph"]
    (b / "bundle.toml").write_text(tomli_w.dumps(man))
    before = tree(b)
    assert main(["qnn", "--bundle", str(b), "--arch", "v79", "--talker-slots", str(SLOTS), "--quiet", "--vocoder"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no stateful vocoder graph" in err, err
    assert tree(b) == before


def test_vocoder_gate_failure_is_refused(bundle_copy, monkeypatch, capsys):
    b = bundle_copy("tiny-0.6b")
    before = tree(b)
    monkeypatch.setattr(qnn, "VOCODER_SNR_DB", 1000.0)
    assert main(["qnn", "--bundle", str(b), "--arch", "v79", "--talker-slots", str(SLOTS), "--quiet", "--vocoder",
                 "--vocoder-frames", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qnn_vocoder_v79_f1.bin failed the vocoder fidelity gate: samples SNR" in err, err
    assert tree(b) == before

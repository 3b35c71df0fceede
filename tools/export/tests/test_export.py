"""The exported step graphs against independent oracles, graph hygiene, bundle layout, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import re
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file

from herald_export.checkpoint import LMWeights, load_spec
from herald_export.host import StackCache, StaleStep, step
from herald_export.lm import lm_forward_numpy
from herald_export.onnx_graph import io_signature
from herald_export.st_io import SafetensorsFile, write_safetensors
from herald_export.vocoder import decode_stateful, stream_states

EXPORT_DIR = Path(__file__).resolve().parents[1]


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    ref, test = np.asarray(ref, np.float64), np.asarray(test, np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-300)))


# --------------------------------------------------------------------------- safetensors IO
def test_safetensors_reader_matches_library(tmp_path):
    rng = np.random.default_rng(0)
    t = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
         "c": rng.standard_normal((4,)).astype(np.float16)}
    write_safetensors(tmp_path / "x.safetensors", t)
    lib = load_file(str(tmp_path / "x.safetensors"))  # the safetensors package as the oracle
    for k in t:
        np.testing.assert_array_equal(lib[k], t[k])
    save_file(t, str(tmp_path / "y.safetensors"))
    ours = SafetensorsFile(tmp_path / "y.safetensors")
    for k in t:
        np.testing.assert_array_equal(ours.get(k), t[k].astype(ours.get(k).dtype))


def test_bf16_roundtrip(tmp_path):
    # bf16 keeps the upper 16 bits: values with <= 8 significant bits are exact
    vals = np.array([1.0, -2.5, 0.15625, 3.0e38, -1.0e-30, 65504.0, 1.0 + 2**-7], np.float32)
    write_safetensors(tmp_path / "b.safetensors", {"w": vals}, bf16={"w"})
    f = SafetensorsFile(tmp_path / "b.safetensors")
    assert f.dtype("w") == "BF16"
    got = f.get("w")
    rel = np.abs(got - vals) / np.abs(vals)
    assert rel.max() <= 2**-8  # round to nearest with 8 mantissa bits
    np.testing.assert_array_equal(got[:3], vals[:3])


# --------------------------------------------------------------------------- teacher forcing
def _talker_inputs(spec, n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, spec.talker.hidden)).astype(np.float32)


@pytest.mark.parametrize("split", [[20], [7] + [1] * 13, [5, 3, 1, 1, 10]])
def test_talker_steps_equal_full_forward(tiny, split):
    preset, bundle, ckpt = tiny
    spec = load_spec(ckpt)
    w = LMWeights(spec)
    x = _talker_inputs(spec, sum(split))
    ref_logits, ref_hidden = lm_forward_numpy(spec, w, "talker", x)  # independent float64 oracle
    sess = session(bundle / "talker.onnx")
    cache = StackCache(spec.talker)
    logits, hidden, s = [], [], 0
    for n in split:
        o = step(sess, cache, x[s : s + n])
        logits.append(o["logits"][0])
        hidden.append(o["hidden"][0])
        s += n
    logits, hidden = np.concatenate(logits), np.concatenate(hidden)
    assert np.abs(logits - ref_logits).max() <= 1e-4
    assert np.abs(hidden - ref_hidden).max() <= 1e-4


def test_code_predictor_steps_equal_full_forward(tiny):
    preset, bundle, ckpt = tiny
    spec = load_spec(ckpt)
    w = LMWeights(spec)
    G = spec.num_code_groups
    x = _talker_inputs(spec, G, seed=2)
    sess = session(bundle / "code_predictor.onnx")
    # stepwise, as the decode loop runs it: 2-position prefill with head 0, then head k at position k+1
    cache = StackCache(spec.predictor)
    got = [step(sess, cache, x[:2], {"head": np.array([0], np.int64)})["logits"][0, -1]]
    for k in range(1, G - 1):
        got.append(step(sess, cache, x[k + 1 : k + 2], {"head": np.array([k], np.int64)})["logits"][0, 0])
    for k in range(G - 1):
        ref, _ = lm_forward_numpy(spec, w, "code_predictor", x, head=k)
        assert np.abs(got[k] - ref[k + 1]).max() <= 1e-4, f"codebook {k + 1}"
    # the same graph in one full-sequence call (S = 16) gives the same logits
    full = StackCache(spec.predictor)
    one = step(sess, full, x, {"head": np.array([4], np.int64)})["logits"][0]
    assert np.abs(one[5] - got[4]).max() <= 1e-4


def test_sliding_ring_equals_roll_layout(tiny_factory):
    bundle, ckpt = tiny_factory("tiny-hybrid")
    spec = load_spec(ckpt)
    kinds = [k for k, _ in spec.talker.layer_kinds]
    assert "sliding" in kinds and "full" in kinds
    window = [wd for k, wd in spec.talker.layer_kinds if k == "sliding"][0]
    split = [5] + [1] * 12 + [3] + [1] * 9 + [10] + [1] * 8   # 47 positions: the ring wraps > 5 times
    assert sum(split) > 5 * (window - 1)
    x = _talker_inputs(spec, sum(split), seed=3)
    sess = session(bundle / "talker.onnx")
    ring, roll = StackCache(spec.talker, layout="ring"), StackCache(spec.talker, layout="roll")
    a, b, s = [], [], 0
    for n in split:
        a.append(step(sess, ring, x[s : s + n])["logits"][0])
        b.append(step(sess, roll, x[s : s + n])["logits"][0])
        s += n
        # the ring holds the same positions as the chronological layout, in another order
        assert sorted(ring.slot_pos.tolist()) == sorted(roll.slot_pos.tolist())
    a, b = np.concatenate(a), np.concatenate(b)
    assert np.abs(a - b).max() <= 1e-5
    ref, _ = lm_forward_numpy(spec, LMWeights(spec), "talker", x)
    assert np.abs(a - ref).max() <= 1e-4


def test_cache_rejects_stale_and_bad_steps(tiny_factory):
    bundle, ckpt = tiny_factory("tiny-hybrid")
    spec = load_spec(ckpt)
    sess = session(bundle / "talker.onnx")
    cache = StackCache(spec.talker)
    x = _talker_inputs(spec, 4)
    o = step(sess, cache, x[:3])
    with pytest.raises(StaleStep):
        cache.write(o, 3, start=0)               # the same positions again
    bad = dict(o)
    bad["k_new_1"] = np.full_like(o["k_new_1"], np.nan)
    before = cache.next_pos
    with pytest.raises(ValueError, match="non-finite"):
        cache.write(bad, 3)
    assert cache.next_pos == before              # nothing committed
    cache.clear()
    assert cache.next_pos == 0 and (cache.slot_pos == -1).all()


# --------------------------------------------------------------------------- fp16
@pytest.mark.parametrize("preset", ["tiny-0.6b", "tiny-hybrid"])
def test_fp16_logits_against_fp32(tiny_factory, preset, record_property):
    b32, ckpt = tiny_factory(preset, "fp32")
    b16, _ = tiny_factory(preset, "fp16")
    spec = load_spec(ckpt)
    x = _talker_inputs(spec, 24, seed=4)
    out = {}
    for name, bundle, dt in (("fp32", b32, np.float32), ("fp16", b16, np.float16)):
        sess = session(bundle / "talker.onnx")
        cache = StackCache(spec.talker, dtype=dt)
        out[name] = np.concatenate([step(sess, cache, x[:8])["logits"][0]] +
                                   [step(sess, cache, x[i : i + 1])["logits"][0] for i in range(8, 24)])
    snr = snr_db(out["fp32"], out["fp16"])
    print(f"\n[{preset}] fp16 vs fp32 talker logits SNR: {snr:.1f} dB")
    record_property("fp16_snr_db", snr)
    assert snr > 40.0
    t16 = load_file(str(b16 / "tables.safetensors"))
    assert all(v.dtype == np.float16 for v in t16.values())


# --------------------------------------------------------------------------- graph hygiene
AXES_INPUT = {"Unsqueeze": 1, "Squeeze": 1, "Slice": 3, "ReduceSum": 1}


def test_graphs_are_clean(tiny):
    preset, bundle, _ = tiny
    for name in ("talker", "code_predictor", "vocoder", "vocoder_stream"):
        m = onnx.load(str(bundle / f"{name}.onnx"))
        onnx.checker.check_model(m, full_check=True)
        inits = {i.name: i for i in m.graph.initializer}
        producers = {o: n for n in m.graph.node for o in n.output}
        for n in m.graph.node:
            assert n.op_type != "IsNaN", f"{name}: IsNaN node {n.name}"
            if n.op_type == "Where":
                for i in n.input:
                    p = producers.get(i)
                    assert p is None or p.op_type != "IsNaN", f"{name}: NaN guard {n.name}"
            if n.op_type == "Reshape":
                assert all(not (a.name == "allowzero" and a.i == 1) for a in n.attribute), f"{name}: allowzero {n.name}"
            if n.op_type in AXES_INPUT and len(n.input) > AXES_INPUT[n.op_type]:
                ax = n.input[AXES_INPUT[n.op_type]]
                if ax in inits:
                    assert len(inits[ax].dims) == 1, f"{name}: rank-0 axes on {n.name}"


# --------------------------------------------------------------------------- bundle layout
def _flatten(d, prefix=""):
    keys = set()
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            keys |= _flatten(v, path + ".")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                keys |= _flatten(item, path + "[].")
        else:
            keys.add(path)
    return keys


def _normalise(key: str) -> str:
    """Collapse the open-ended names (graphs, languages, speakers) to the placeholders the doc uses."""
    parts = key.split(".")
    if parts[0] == "graphs" and len(parts) > 2:
        parts[1] = "<graph>"
    if parts[0] in ("languages", "speakers", "speaker_dialects") and len(parts) == 2:
        parts[1] = "<name>"
    return ".".join(parts)


def test_manifest_matches_docs_field_for_field(tiny):
    preset, bundle, _ = tiny
    manifest = tomllib.loads((bundle / "bundle.toml").read_text())
    written = {_normalise(k) for k in _flatten(manifest)}
    doc = (EXPORT_DIR.parents[1] / "docs" / "bundle.md").read_text()
    doc = doc[doc.index("## `bundle.toml`"):]
    rows = re.findall(r"^\| `([a-z_<>\[\].0-9]+)` \|(.*)$", doc, flags=re.M)
    documented = {k for k, _ in rows}
    optional = {k for k, rest in rows if "Optional" in rest}
    missing = written - documented
    assert not missing, f"written but not documented in docs/bundle.md: {sorted(missing)}"
    absent = documented - written - optional
    assert not absent, f"documented as always present but not written: {sorted(absent)}"


def test_manifest_is_consistent_with_files(tiny):
    preset, bundle, ckpt = tiny
    m = tomllib.loads((bundle / "bundle.toml").read_text())
    spec = load_spec(ckpt)
    assert m["format_version"] == 1
    assert m["audio"]["samples_per_frame"] == 1920 and m["audio"]["sample_rate"] == 24000
    assert m["codec"]["eos"] == 2150 and m["text"]["tts_pad"] == 151671
    assert m["code_predictor"]["projection"] == (preset == "tiny-1.7b")
    for gname, g in m["graphs"].items():
        model = onnx.load(str(bundle / g["file"]))
        ins = [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input]
        assert [i["name"] for i in g["inputs"]] == [n for n, _ in ins]
    tables = load_file(str(bundle / m["tables"]["file"]))
    for key in ("text_embedding", "codec_embedding", "cp_embedding"):
        assert list(tables[key].shape) == m["tables"][key]["shape"]
    # the projected text table is text_projection(text_embedding) computed independently here
    w = LMWeights(spec)
    ids = np.array([0, 198, 77091, 151671, 151935])
    e = w["talker.model.text_embedding.weight"][ids].astype(np.float64)
    h = e @ w["talker.text_projection.linear_fc1.weight"].T + w["talker.text_projection.linear_fc1.bias"]
    h = h / (1 + np.exp(-h))
    ref = h @ w["talker.text_projection.linear_fc2.weight"].T + w["talker.text_projection.linear_fc2.bias"]
    assert np.abs(tables["text_embedding"][ids] - ref).max() <= 1e-5
    kinds = [c["kind"] for c in m["talker"]["cache"]]
    assert ("sliding" in kinds) == (preset == "tiny-hybrid")


def test_bundle_has_stream_vocoder(tiny):
    """vocoder_stream.onnx is in the bundle, [vocoder].stream_graph names it, [graphs.vocoder_stream]
    records its IO exactly, and it decodes chunk by chunk to what vocoder.onnx gives in one pass."""
    preset, bundle, _ = tiny
    m = tomllib.loads((bundle / "bundle.toml").read_text())
    assert m["vocoder"]["graph"] == "vocoder" and m["vocoder"]["stream_graph"] == "vocoder_stream"
    g = m["graphs"][m["vocoder"]["stream_graph"]]
    path = bundle / g["file"]
    assert g["file"] == "vocoder_stream.onnx" and path.is_file()
    assert g["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    model = onnx.load(str(path))
    sig = io_signature(model)
    assert g["inputs"] == sig["inputs"] and g["outputs"] == sig["outputs"]
    states = stream_states(model)
    assert [i["name"] for i in g["inputs"]] == ["codes"] + [f"state.{n}" for n, _, _ in states]
    assert [o["name"] for o in g["outputs"]] == ["wav"] + [f"next.{n}" for n, _, _ in states]
    assert g["inputs"][0] == m["graphs"]["vocoder"]["inputs"][0]
    assert g["outputs"][0] == m["graphs"]["vocoder"]["outputs"][0]
    for i, o in zip(g["inputs"][1:], g["outputs"][1:]):
        assert i["dtype"] == o["dtype"] and i["shape"] == o["shape"] and all(isinstance(d, int) for d in i["shape"])
    assert g["inputs"][1] == {"name": "state.position", "dtype": "int64", "shape": [1]}

    codes = np.random.default_rng(5).integers(0, 2048, (1, 16, 40), dtype=np.int64)
    full = session(bundle / "vocoder.onnx").run(["wav"], {"codes": codes})[0].reshape(-1)
    sess = session(path)
    names = [o.name for o in sess.get_outputs()]
    got = decode_stateful(lambda feeds: dict(zip(names, sess.run(None, feeds))), states, codes, m["vocoder"]["ramp"],
                          m["audio"]["samples_per_frame"])
    assert got.shape == full.shape and float(np.max(np.abs(got - full))) <= 1e-5


def test_tiny_bundle_size_and_export_time(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "herald_export", "export", "--tiny", "tiny-1.7b", "--seed", "3",
                        "--out", str(tmp_path / "b"), "--quiet"], cwd=EXPORT_DIR, capture_output=True, text=True)
    dt = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    size = sum(p.stat().st_size for p in (tmp_path / "b").iterdir())
    print(f"\ntiny-1.7b export {dt:.1f} s, bundle {size / 1e6:.1f} MB")
    assert size <= 30e6
    assert dt <= 30.0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"


# --------------------------------------------------------------------------- bad input
def _run_export(ckpt: Path, out: Path):
    return subprocess.run([sys.executable, "-m", "herald_export", "export", "--checkpoint", str(ckpt),
                           "--out", str(out), "--quiet"], cwd=EXPORT_DIR, capture_output=True, text=True)


def _mutate_config(ckpt: Path, fn):
    cfg = json.loads((ckpt / "config.json").read_text())
    fn(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _reshape_tensor(ckpt: Path):
    f = SafetensorsFile(ckpt / "model.safetensors")
    t = {n: f.get(n) for n in f.names()}
    name = "talker.model.layers.0.self_attn.k_proj.weight"
    t[name] = t[name][:-1]
    write_safetensors(ckpt / "model.safetensors", t, bf16=set(t))
    return name


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD = {
    "missing model.safetensors": (lambda c: (c / "model.safetensors").unlink(), "model.safetensors", "missing file"),
    "missing vocab.json": (lambda c: (c / "vocab.json").unlink(), "vocab.json", "missing"),
    "missing speech tokenizer": (lambda c: shutil.rmtree(c / "speech_tokenizer"), "speech_tokenizer", ""),
    "wrong tensor shape": (_reshape_tensor, "model.safetensors", "k_proj.weight has shape"),
    "unknown model type": (lambda c: _mutate_config(c, lambda d: d.update(model_type="llama")), "config.json", "unknown model type"),
    "unknown config key": (lambda c: _mutate_config(c, lambda d: d["talker_config"].update(frobnicate=1)), "config.json", "frobnicate"),
    "truncated safetensors": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors", "truncated"),
    "garbage safetensors": (lambda c: (c / "model.safetensors").write_bytes(b"\x00" * 3), "model.safetensors", "not a safetensors file"),
    "malformed config": (lambda c: (c / "config.json").write_text("{ nope"), "config.json", "malformed JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_clear_line(tiny_factory, tmp_path, case):
    _, ckpt = tiny_factory("tiny-0.6b")
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    mutate, file_hint, problem_hint = BAD[case]
    mutate(bad)
    out = tmp_path / "bundle"
    r = _run_export(bad, out)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert file_hint in lines[0] and problem_hint in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")], "partial output left behind"


def test_failed_export_keeps_previous_bundle(tiny_factory, tmp_path):
    bundle, ckpt = tiny_factory("tiny-0.6b")
    out = tmp_path / "bundle"
    shutil.copytree(bundle, out)
    before = (out / "bundle.toml").read_bytes()
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "vocab.json").unlink()
    assert _run_export(bad, out).returncode == 2
    assert (out / "bundle.toml").read_bytes() == before

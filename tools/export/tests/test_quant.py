"""Quantized bundles (--dtype q8 / q4): the quantization formulas, the graphs on onnxruntime, the
manifest, and the fidelity gate (herald_export.quant, herald_export.gate)."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from herald_export import quant
from herald_export.checkpoint import LMWeights, load_spec
from herald_export.gate import (FREE_RUNNING_FRAMES, POSITIONS, THRESHOLDS, GateResult, agree_frames, check,
                                run_gate, snr_db, top1_agreement)
from herald_export.host import StackCache, step
from herald_export.lm import lm_forward_numpy
from herald_export.onnx_graph import GraphBuilder, initializer_bytes
from test_export import EXPORT_DIR, _flatten, _normalise, session


# --------------------------------------------------------------------------- q4 formula
def _decode_q4_independent(packed: np.ndarray, scales: np.ndarray, K: int) -> np.ndarray:
    """MatMulNBits' dequantization read element by element, as the contrib-op spec states it."""
    N, nb, blob = packed.shape
    w = np.zeros((N, K), np.float64)
    for n in range(N):
        for b in range(nb):
            for i in range(32):
                k = b * 32 + i
                if k >= K:
                    break
                byte = int(packed[n, b, i // 2])
                code = (byte >> 4) if i % 2 else (byte & 0x0F)
                w[n, k] = (code - 8) * float(scales[n * nb + b])
    return w


@pytest.mark.parametrize("K", [64, 48, 16, 70])
def test_q4_packing_and_formula(K):
    rng = np.random.default_rng(K)
    w = (rng.standard_normal((5, K)) / np.sqrt(K)).astype(np.float32)
    w[1, :] = 0.0                                    # an all-zero row: scale 0, codes 8
    packed, scales = quant.quantize_q4(w)
    nb = -(-K // 32)
    assert packed.dtype == np.uint8 and packed.shape == (5, nb, 16)
    assert scales.dtype == np.float32 and scales.shape == (5 * nb,)
    # every scale is a float16 value (tract's Q4_0 stores float16 scales)
    np.testing.assert_array_equal(scales, scales.astype(np.float16).astype(np.float32))
    ref = _decode_q4_independent(packed, scales, K)
    np.testing.assert_array_equal(quant.dequantize_q4(packed, scales, K), ref.astype(np.float32))
    # codes follow code = clip(round(w / s) + 8, 0, 15) with the stored scale
    s = scales.reshape(5, nb).repeat(32, axis=1)[:, :K]
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(s != 0, np.clip(np.rint(w / s) + 8, 0, 15), 8)
    np.testing.assert_array_equal(np.rint(ref / np.where(s != 0, s, 1)) + 8, want)
    assert np.all(ref[1] == 0) and np.all(scales[nb : 2 * nb] == 0)
    # the padding of a partial last block holds code 8 (weight 0)
    lo, hi = packed[:, -1] & 0x0F, packed[:, -1] >> 4
    for i in range(K - (nb - 1) * 32, 32):
        assert np.all((hi if i % 2 else lo)[:, i // 2] == 8), i


def test_q4_scale_search_is_never_worse():
    """The per-block scale search against absmax/7 and GGML Q4_0's -m/8 (quant.py docstring)."""
    rng = np.random.default_rng(3)
    for w in (rng.standard_normal((256, 512)) / np.sqrt(512), rng.standard_t(3, (256, 512)) / 32):
        w = w.astype(np.float32)
        errs = {}
        for name, divs in (("absmax/7", (7.0,)), ("ggml", (-8.0,)), ("search", quant.Q4_SCALE_DIVISORS)):
            old = quant.Q4_SCALE_DIVISORS
            quant.Q4_SCALE_DIVISORS = divs
            try:
                p, s = quant.quantize_q4(w)
            finally:
                quant.Q4_SCALE_DIVISORS = old
            errs[name] = float(np.sqrt(np.mean((quant.dequantize_q4(p, s, 512) - w) ** 2) / np.mean(w**2)))
        print(f"\nq4 relative weight error: {errs}")
        assert errs["search"] <= min(errs["absmax/7"], errs["ggml"])


def test_q8_formula():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 40)).astype(np.float32)
    w[2] = 0.0
    wq, s = quant.quantize_q8(w)
    assert wq.dtype == np.int8 and wq.shape == (40, 6) and s.shape == (6,)
    np.testing.assert_allclose(s, np.abs(w).max(axis=1) / 127, rtol=1e-7)
    assert np.abs(wq).max() <= 127 and np.all(wq[:, 2] == 0)
    for n in (0, 1, 3):
        np.testing.assert_array_equal(wq[:, n], np.clip(np.rint(w[n] / s[n]), -127, 127).astype(np.int8))
    assert np.max(np.abs(quant.dequantize_q8(wq, s) - w)) <= s.max() / 2 + 1e-7


# --------------------------------------------------------------------------- one linear on onnxruntime
def _linear_model(fmt: str, w: np.ndarray, bias: np.ndarray | None = None, twice: bool = False) -> onnx.ModelProto:
    b = GraphBuilder("lin", np.float32, quant=fmt)
    x = b.input("x", np.float32, [1, "seq", w.shape[1]])
    y = b.linear(x, w, bias)
    if twice:                                         # a second projection of the same input
        y = b.add(y, b.linear(x, w * 0.5))
    b.output(y, "y", np.float32, [1, "seq", w.shape[0]])
    return b.model()


def _symmetric_int8(x: np.ndarray):
    """q8's activation quantization written out element by element (docs/bundle.md): per tensor,
    symmetric, no zero point; the scale never 0; ONNX Round = round half to even."""
    amax = 0.0
    for v in x.reshape(-1):
        amax = max(amax, abs(float(v)))
    scale = max(np.float32(amax) / np.float32(127), np.finfo(np.float32).tiny)
    q = np.empty(x.shape, np.int64)
    for idx, v in np.ndenumerate(x):
        r = float(np.float32(v) / scale)                     # Div in float32, as the graph
        f = math.floor(r)
        r = f + 1 if (r - f > 0.5 or (r - f == 0.5 and f % 2)) else f
        q[idx] = min(127, max(-127, r))
    return q, np.float32(scale)


@pytest.mark.parametrize("K", [64, 48])
def test_q4_linear_on_onnxruntime(K):
    rng = np.random.default_rng(K)
    w = (rng.standard_normal((24, K)) / np.sqrt(K)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    m = _linear_model("q4", w, bias)
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 17), ("com.microsoft", 1)]
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 1 and nodes[0].domain == "com.microsoft" and len(nodes[0].input) == 3
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"K": K, "N": 24, "bits": 4, "block_size": 32, "accuracy_level": 4}
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    packed, scales = inits[nodes[0].input[1]], inits[nodes[0].input[2]]
    x = rng.standard_normal((1, 7, K)).astype(np.float32)
    y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w_f = _decode_q4_independent(packed, scales, K)
    # accuracy_level 4: onnxruntime multiplies the weights by Q8_0 of x (per block of 32 along K)
    want = _q8_0_independent(x) @ w_f.T + bias
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # ... which stays close to the float32 product (half a step of d = absmax/127 per value)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w_f.T + bias, rtol=0, atol=0.05)


def _q8_0_independent(x: np.ndarray) -> np.ndarray:
    """GGML's Q8_0 of x along its last axis written out value by value: per block of 32 (the last
    one shorter when K is not a multiple), d = absmax / 127 in float32, q = round half to even of
    x * (1/d) (0 when d is 0); returns q * d in float64."""
    out = np.zeros(x.shape, np.float64)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        for b in range(0, row.shape[0], 32):
            block = row[b:b + 32]
            d = np.float32(max(abs(float(v)) for v in block)) / np.float32(127)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            for i, v in enumerate(block):
                out[idx + (b + i,)] = float(np.round(np.float32(v) * inv)) * float(d)
    return out


def _q8_structure(m: onnx.ModelProto):
    """Asserts the q8 pattern: int8 x int8 MatMulInteger with no zero points, no DynamicQuantizeLinear,
    opset 17 default domain only. Returns the op-type list."""
    inits = {i.name: i for i in m.graph.initializer}
    ops = [n.op_type for n in m.graph.node]
    assert "DynamicQuantizeLinear" not in ops and "MatMulNBits" not in ops
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 17)]
    casts_to_int8 = {n.output[0] for n in m.graph.node if n.op_type == "Cast"
                     and helper.get_attribute_value(n.attribute[0]) == TensorProto.INT8}
    for n in m.graph.node:
        if n.op_type == "MatMulInteger":
            assert len(n.input) == 2, f"{n.name}: zero-point inputs {list(n.input[2:])}"
            assert n.input[0] in casts_to_int8, n.name
            assert inits[n.input[1]].data_type == TensorProto.INT8
        if n.op_type == "ReduceMax":
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert attrs == {"keepdims": 0} and len(n.input) == 1          # per tensor: every axis, rank 0
    return ops


def test_q8_linear_on_onnxruntime():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((24, 64)) / 8).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    m = _linear_model("q8", w, bias, twice=True)
    ops = _q8_structure(m)
    assert ops.count("MatMulInteger") == 2 and ops.count("ReduceMax") == 1 and ops.count("Round") == 1   # shared input
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    # onnxruntime fuses the pattern (MatMulIntegerToFloat, bias included); the unfused graph is the spec
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    x[0, 2, 7] = 4.0                                   # one outlier sets the per-tensor scale
    x[0, 3, :4] = np.float32(4.0 / 127) * np.array([0.5, 1.5, 2.5, -0.5], np.float32)   # ties (half to even)
    for xx in (x, np.zeros_like(x), x[:, :1] * 1e-3):
        y = sess.run(None, {"x": xx})[0]
        xq, xs = _symmetric_int8(xx)
        want = bias.astype(np.float64)
        for ww in (w, w * 0.5):
            wq, s = quant.quantize_q8(ww)
            acc = xq @ wq.astype(np.int64)                                          # MatMulInteger
            want = want + acc.astype(np.float64) * (np.float64(xs) * s.astype(np.float64))
        assert np.all(np.isfinite(y))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(plain.run(None, {"x": xx})[0], want, rtol=1e-5, atol=1e-5)
        # the reference formula in quant.py agrees code for code
        rq, rs = quant.quantize_activation_q8(xx)
        np.testing.assert_array_equal(rq, xq)
        assert rs == xs
    # an all-zero input gives the bias exactly (no NaN from 0 / 0)
    np.testing.assert_array_equal(sess.run(None, {"x": np.zeros_like(x)})[0], np.broadcast_to(bias, (1, 5, 24)))


# --------------------------------------------------------------------------- bundles
QUANT_PRESETS = ["tiny-q", "tiny-0.6b"]


@pytest.fixture(scope="session", params=[(p, f) for p in QUANT_PRESETS for f in ("q4", "q8")], ids=lambda v: "-".join(v))
def qbundle(request, tiny_factory):
    preset, fmt = request.param
    bundle, ckpt = tiny_factory(preset, fmt)
    return preset, fmt, bundle, ckpt


def test_quantized_manifest(qbundle):
    preset, fmt, bundle, _ = qbundle
    m = tomllib.loads((bundle / "bundle.toml").read_text())
    assert m["model"]["dtype"] == "fp32" and m["model"]["weights"] == fmt
    assert m["tables"]["dtype"] == "float32"
    for name, g in m["graphs"].items():
        want = fmt if name in ("talker", "code_predictor") else "fp32"
        assert g["weights"] == want, name
        model = onnx.load(str(bundle / g["file"]))
        assert g["weight_bytes"] == initializer_bytes(model), name
    q = m["quantization"]
    assert set(q) == {"format", "scheme", "block_size", "float_weights", "gate"} | ({"activations"} if fmt == "q4" else set())
    if fmt == "q4":
        # the gate ran the graphs' MatMulNBits with accuracy_level 4: int8 activations
        assert q["activations"] == "int8"
        for which in ("talker", "code_predictor"):
            nodes = [n for n in onnx.load(str(bundle / f"{which}.onnx")).graph.node if n.op_type == "MatMulNBits"]
            assert nodes and all(helper.get_attribute_value(a) == 4 for n in nodes for a in n.attribute
                                 if a.name == "accuracy_level"), which
            assert all(any(a.name == "accuracy_level" for a in n.attribute) for n in nodes), which
    assert q["format"] == fmt and q["block_size"] == (32 if fmt == "q4" else 0)
    assert q["float_weights"] == ["code_predictor lm_heads", "norms", "embeddings (host tables)", "vocoder"]
    assert isinstance(q["scheme"], str) and "\n" not in q["scheme"]
    g = q["gate"]
    assert set(g) == {"passed", "positions", "talker_logits_snr_db", "talker_top1", "code_predictor_logits_snr_db",
                      "code_predictor_top1", "free_running_texts", "free_running_frames", "free_running_agree_min"}
    assert g["passed"] is True and g["positions"] == POSITIONS >= 500
    assert g["free_running_texts"] == 3 and g["free_running_frames"] == FREE_RUNNING_FRAMES
    t = THRESHOLDS[fmt]
    assert g["talker_logits_snr_db"] >= t.talker_logits_snr_db and g["code_predictor_logits_snr_db"] >= t.code_predictor_logits_snr_db
    print(f"\n[{preset} {fmt}] gate: {g}")


def test_quantized_manifest_keys_are_documented(qbundle):
    _, fmt, bundle, _ = qbundle
    manifest = tomllib.loads((bundle / "bundle.toml").read_text())
    written = {_normalise(k) for k in _flatten(manifest)}
    doc = (EXPORT_DIR.parents[1] / "docs" / "bundle.md").read_text()
    doc = doc[doc.index("## `bundle.toml`"):]
    documented = set(re.findall(r"^\| `([a-z_<>\[\].0-9]+)` \|", doc, flags=re.M))
    assert not written - documented, f"written but not documented: {sorted(written - documented)}"
    # activations is q4's alone (q8 quantizes its activations inside the graph)
    q4_only = {"quantization.activations"} if fmt == "q8" else set()
    assert {k for k in documented if k.startswith("quantization.")} - q4_only <= written


def test_quantized_graph_ops(qbundle):
    preset, fmt, bundle, ckpt = qbundle
    spec = load_spec(ckpt)
    for which, lm in (("talker", spec.talker), ("code_predictor", spec.predictor)):
        m = onnx.load(str(bundle / f"{which}.onnx"))
        onnx.checker.check_model(m, full_check=True)
        ops = [n.op_type for n in m.graph.node]
        n_lin = 7 * lm.layers + (1 if which == "talker" else 0)
        inits = {i.name: i for i in m.graph.initializer}
        const_matmuls = [n for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
        assert not const_matmuls, f"{which}: float MatMul with a constant weight left"
        if fmt == "q4":
            assert ops.count("MatMulNBits") == n_lin
            assert {(o.domain, o.version) for o in m.opset_import} == {("", 17), ("com.microsoft", 1)}
            for n in m.graph.node:
                if n.op_type == "MatMulNBits":
                    assert n.domain == "com.microsoft" and len(n.input) == 3
                    assert inits[n.input[1]].data_type == TensorProto.UINT8
                    assert inits[n.input[2]].data_type == TensorProto.FLOAT
        else:
            assert _q8_structure(m) == ops and ops.count("MatMulInteger") == n_lin
            # one activation quantization per distinct input: q/k/v share one, gate/up share one
            n_act = 4 * lm.layers + (1 if which == "talker" else 0)
            assert ops.count("Round") == n_act and ops.count("ReduceMax") == n_act
        if which == "code_predictor":
            heads = [n for n in m.graph.node if n.op_type == "Gather" and n.input[0] == "lm_heads"]
            assert len(heads) == 1 and inits["lm_heads"].data_type == TensorProto.FLOAT


def test_q4_graph_equals_dequantized_forward(tiny_factory):
    """The q4 talker on onnxruntime = the float64 oracle run with the dequantized weights.

    Proves every projection reads its own weight in the right layout (no transpose, no mix-up)."""
    bundle, ckpt = tiny_factory("tiny-q", "q4")
    spec = load_spec(ckpt)
    w = LMWeights(spec)

    class Dequantized:
        def __getitem__(self, name):
            a = w[name]
            if name.endswith("proj.weight") or name == "talker.codec_head.weight":
                p, s = quant.quantize_q4(a)
                return quant.dequantize_q4(p, s, a.shape[1])
            return a

        def layer(self, lm, i, leaf):
            return self[f"{lm.prefix}layers.{i}.{leaf}"]

    x = np.random.default_rng(9).standard_normal((12, spec.talker.hidden)).astype(np.float32)
    want, _ = lm_forward_numpy(spec, Dequantized(), "talker", x)
    # the layout, exactly: the same graph with float32 activations (accuracy_level 0)
    m = onnx.load(str(bundle / "talker.onnx"))
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    float_acts = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = step(float_acts, StackCache(spec.talker), x)["logits"][0]
    assert snr_db(want, got) > 90, snr_db(want, got)
    # the graph as written: int8 activations per block of 32 cost some 40 dB here, no more
    got = step(session(bundle / "talker.onnx"), StackCache(spec.talker), x)["logits"][0]
    assert 30 < snr_db(want, got) < 90, snr_db(want, got)


def test_reference_decodes_quantized_bundle(tiny_factory):
    bundle, _ = tiny_factory("tiny-q", "q8")
    from reference import Reference

    gen = Reference(bundle, threads=1).generate("Hello.", greedy=True, max_frames=3)
    assert gen.codes.shape == (3, 16)


# --------------------------------------------------------------------------- gate metrics
def test_gate_metric_functions():
    a = np.random.default_rng(0).standard_normal((10, 50))
    assert snr_db(a, a) == math.inf
    assert abs(snr_db(a, a * 1.1) - 20.0) < 1e-9                 # noise = 0.1 x signal
    assert top1_agreement(a, a) == 1.0
    b = a.copy()
    b[3, np.argmax(a[3])] = -100
    assert top1_agreement(a, b) == 0.9
    codes = np.arange(40 * 16).reshape(40, 16)
    assert agree_frames(codes, codes, 40) == 40
    c = codes.copy()
    c[7, 15] += 1
    assert agree_frames(codes, c, 40) == 7
    assert agree_frames(codes[:30], codes[:30], 40) == 40          # both stopped together at eos
    assert agree_frames(codes[:30], codes, 40) == 30               # one stopped early
    r = GateResult("q4", 512, 30.0, 0.9, 7.9, 0.9, 3, 40, 0)
    fails = check(r)
    assert len(fails) == 1 and "code_predictor_logits_snr_db 7.9 < 8.0" in fails[0]
    assert check(GateResult("q8", 499, 99, 1, 99, 1, 3, 40, 40))[0].startswith("positions 499")


def test_gate_of_identical_graphs_passes(tiny_factory):
    bundle, _ = tiny_factory("tiny-0.6b", "fp32")
    r = run_gate(bundle, bundle / "talker.onnx", bundle / "code_predictor.onnx", "q4", threads=1)
    assert r.passed and r.positions == POSITIONS
    assert r.talker_logits_snr_db == math.inf and r.code_predictor_logits_snr_db == math.inf
    assert r.talker_top1 == 1.0 and r.code_predictor_top1 == 1.0
    assert r.free_running_agree_min == FREE_RUNNING_FRAMES


def _corrupt_scales(monkeypatch):
    orig = quant.quantize_q4

    def doubled(w, name="weight"):
        p, s = orig(w, name)
        return p, s * 2
    monkeypatch.setattr(quant, "quantize_q4", doubled)


def test_corrupted_q4_fails_the_gate(tiny_factory, tmp_path, monkeypatch, capsys):
    from herald_export.__main__ import main

    _corrupt_scales(monkeypatch)
    _, ckpt = tiny_factory("tiny-q")
    out = tmp_path / "bundle"
    rc = main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "q4", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: quantization gate: q4 export failed the fidelity gate"), err
    assert re.search(r"talker_logits_snr_db -?[0-9.]+ < 8\.0", lines[0]), lines[0]
    assert not out.exists()
    assert not list(tmp_path.iterdir()), "partial output left behind"

    rc = main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "q4", "--allow-lossy"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "FAILED" in err and "failed: talker_logits_snr_db" in err and "--allow-lossy" in err
    g = tomllib.loads((out / "bundle.toml").read_text())["quantization"]["gate"]
    assert g["passed"] is False and g["talker_logits_snr_db"] < 8.0
    assert not (out / ".gate-fp32").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_allow_lossy_needs_a_quantized_dtype(tmp_path, capsys):
    from herald_export.__main__ import main

    assert main(["export", "--tiny", "tiny-q", "--out", str(tmp_path / "b"), "--allow-lossy", "--quiet"]) == 2
    assert "--allow-lossy: only valid with --dtype q8 or q4" in capsys.readouterr().err

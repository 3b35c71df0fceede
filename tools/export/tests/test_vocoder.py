"""Tests of the vocoder exporter (herald_export.vocoder) on a tiny random checkpoint.

The ONNX graph (onnxruntime) is compared with the plain numpy transcription of the official
decoder; causality, exact output lengths, windowed decoding, stateful (streaming) decoding, graph
hygiene and the errors on bad input are checked. ``pytest -s`` prints the windowed-decoding SNR,
the stateful-decoding max abs difference and SNR, and the onnxruntime time for 300 frames; all
are also kept in :data:`RESULTS`.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herald_export import vocoder as V  # noqa: E402
from herald_export.errors import ExportError  # noqa: E402
from herald_export.onnx_graph import io_signature  # noqa: E402

SEED = 7
HOP = 1920

#: Measurements of this module (filled by the tests; printed with ``pytest -s``).
RESULTS: dict[str, float] = {}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vocoder_ckpt")
    V.write_tiny_speech_tokenizer(d, np.random.default_rng(SEED))
    return d


@pytest.fixture(scope="module")
def vw(ckpt):
    return V.load_vocoder(ckpt)


@pytest.fixture(scope="module")
def model(vw) -> onnx.ModelProto:
    return V.build_vocoder_graph(vw)


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def run(codes: np.ndarray) -> np.ndarray:
        return sess.run(["wav"], {"codes": np.ascontiguousarray(codes, dtype=np.int64)})[0]

    return run


@pytest.fixture(scope="module")
def run(model):
    return _session(model)


@pytest.fixture(scope="module")
def stream_model(vw) -> onnx.ModelProto:
    return V.build_vocoder_graph(vw, stateful=True)


def _stream_session(model: onnx.ModelProto):
    """A ``run`` for :func:`V.decode_stateful`: feeds dict -> {output name: array}."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(None, feeds)))

    return run


@pytest.fixture(scope="module")
def run_stream(stream_model):
    return _stream_session(stream_model)


def _codes(T: int, seed: int = 0) -> np.ndarray:
    """Random codes [1, 16, T] int64."""
    return np.random.default_rng(1000 + seed).integers(0, 2048, (1, 16, T), dtype=np.int64)


# --------------------------------------------------------------------------- the tiny checkpoint


def test_tiny_checkpoint_layout(ckpt, vw):
    from safetensors import safe_open

    st = ckpt / "speech_tokenizer"
    raw = json.loads((st / "config.json").read_text())
    assert raw == V.tiny_speech_tokenizer_config()
    assert raw["model_type"] == "qwen3_tts_tokenizer_12hz"
    dec = raw["decoder_config"]
    assert dec["codebook_size"] == 2048 and dec["num_quantizers"] == 16 and dec["sliding_window"] == 72
    assert math.prod(dec["upsample_rates"]) * math.prod(dec["upsampling_ratios"]) == raw["decode_upsample_rate"] == HOP
    size = (st / "model.safetensors").stat().st_size
    assert size <= 4_000_000, size
    with safe_open(str(st / "model.safetensors"), framework="np") as f:
        names = list(f.keys())
        for n in names:
            assert f.get_slice(n).get_dtype() == "F32", n
    assert all(n.startswith(("decoder.", "encoder.")) for n in names)
    req, opt = V.expected_decoder_tensors(vw.config)
    assert set(req) | set(opt) == {n for n in names if n.startswith("decoder.")}
    assert len(vw.tensors) == len(req) + len(opt)
    for n, a in vw.tensors.items():
        if n.endswith("cluster_usage"):
            assert a.min() > 0
        assert a.dtype == np.float32
    print(f"\ntiny speech tokenizer: {len(names)} tensors, {size} bytes")


def test_official_config_shapes():
    """The shipped decoder_config parses and implies the shipped tensor inventory."""
    raw = V.tiny_speech_tokenizer_config()
    raw["decoder_config"] = {
        "attention_bias": False, "attention_dropout": 0.0, "latent_dim": 1024, "codebook_dim": 512,
        "codebook_size": 2048, "decoder_dim": 1536, "hidden_act": "silu", "hidden_size": 512,
        "intermediate_size": 1024, "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000,
        "head_dim": 64, "num_attention_heads": 16, "num_hidden_layers": 8, "num_key_value_heads": 16,
        "num_quantizers": 16, "num_semantic_quantizers": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000,
        "semantic_codebook_size": 4096, "sliding_window": 72, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "vector_quantization_hidden_dimension": 512,
    }
    cfg = V.parse_speech_tokenizer_config(Path("config.json"), raw)
    req, opt = V.expected_decoder_tensors(cfg)
    assert len(req) == 269 and len(opt) == 2
    assert req["decoder.pre_transformer.layers.0.self_attn.q_proj.weight"] == (1024, 512)
    assert req["decoder.decoder.1.block.1.conv.weight"] == (1536, 768, 16)
    assert req["decoder.quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum"] == (2048, 256)
    assert req["decoder.decoder.6.conv.weight"] == (1, 96, 7)
    n_params = sum(math.prod(s) for s in list(req.values()) + list(opt.values()))
    assert abs(n_params / 1e6 - 114.3) < 0.1  # qwen3-tts.md §3.5: 114.3 M decoder parameters
    assert round(V.conv_history_frames(cfg), 4) == 9.3797
    fake = V.VocoderWeights(config=cfg, tensors={})
    facts = V.vocoder_facts(fake)
    assert facts["conv_receptive_field_frames"] == 10
    assert facts["receptive_field_frames"] == 2 + 8 * 71 + 10


def test_facts(vw):
    f = V.vocoder_facts(vw)
    assert f["sample_rate"] == 24000 and f["samples_per_frame"] == HOP
    assert f["num_quantizers"] == 16 and f["codebook_size"] == 2048
    assert f["sliding_window"] == 72 and f["left_context_frames"] == 72
    assert f["receptive_field_frames"] == 2 + 2 * 71 + 10


# --------------------------------------------------------------------------- graph vs oracle


@pytest.mark.parametrize("T", [1, 7, 80])
def test_graph_matches_numpy(vw, run, T):
    codes = _codes(T, seed=T)
    got = run(codes)
    assert got.shape == (1, T * HOP) and got.dtype == np.float32
    ref = V.vocoder_numpy(vw, codes[0])
    err = float(np.max(np.abs(got[0] - ref)))
    assert err <= 1e-4, err
    # the tiny weights give a live signal, not a constantly clipped one
    assert 0.05 < float(np.std(ref)) and float(np.mean(np.abs(ref) >= 1.0)) < 0.1


def test_gqa_variant_matches_numpy(tmp_path):
    """repeat_kv (fewer KV heads than query heads) is folded into the graph's k/v weights correctly."""
    cfg = V.tiny_speech_tokenizer_config()
    cfg["decoder_config"]["num_key_value_heads"] = 2
    V.write_tiny_speech_tokenizer(tmp_path, np.random.default_rng(3), config=cfg)
    w = V.load_vocoder(tmp_path)
    assert w.t("pre_transformer.layers.0.self_attn.k_proj.weight").shape == (32, 32)
    codes = _codes(9, seed=9)
    got = _session(V.build_vocoder_graph(w))(codes)[0]
    assert float(np.max(np.abs(got - V.vocoder_numpy(w, codes[0])))) <= 1e-4


@pytest.mark.parametrize("T", [2, 3, 13, 71, 72, 73, 150, 300])
def test_output_length(run, T):
    assert run(_codes(T, seed=T)).shape == (1, T * HOP)


def test_causality(run):
    T = 64
    codes = _codes(T, seed=11)
    full = run(codes)[0]
    for k in (1, 2, 9, 33, 63):
        part = run(codes[:, :, :k])[0]
        assert part.shape == (k * HOP,)
        assert float(np.max(np.abs(part - full[: k * HOP]))) <= 1e-5, k


# --------------------------------------------------------------------------- windowed decoding


def test_windowed_plan():
    plan = V.windowed_plan(100)
    assert [e - s for _, s, e in plan] == [2, 4, 8, 16, 25, 25, 20]
    assert [w for w, _, _ in plan] == [0, 0, 0, 0, 0, 0, 80 - 72]
    assert V.windowed_plan(0) == []
    with pytest.raises(ValueError):
        V.windowed_plan(10, ramp=())
    with pytest.raises(ValueError):
        V.windowed_plan(10, ramp=(2, 0))


def test_windowed_chunks_are_window_tails(run):
    T = 130
    codes = _codes(T, seed=5)
    wav = V.decode_windowed(run, codes)
    assert wav.shape == (T * HOP,)
    for w0, s, e in V.windowed_plan(T):
        tail = run(codes[:, :, w0:e])[0][-(e - s) * HOP :]
        assert np.array_equal(wav[s * HOP : e * HOP], tail), (w0, s, e)


def test_windowed_equals_single_pass_within_context(run):
    T = 80  # chunk starts 0, 2, 6, 14, 30, 55 <= 72: every window starts at frame 0
    assert all(w0 == 0 for w0, _, _ in V.windowed_plan(T))
    codes = _codes(T, seed=8)
    full = run(codes)[0]
    win = V.decode_windowed(run, codes)
    assert win.shape == full.shape
    assert float(np.max(np.abs(win - full))) <= 1e-5


def test_windowed_exact_with_full_receptive_field(vw, run):
    """With left context >= the receptive field (pre_conv + layers x 71 + conv stack) windowed
    decoding is exact: RoPE and the window mask are relative, so a shorter call sees the same."""
    ctx = V.vocoder_facts(vw)["receptive_field_frames"]
    T = ctx + 40
    codes = _codes(T, seed=4)
    assert any(w0 > 0 for w0, _, _ in V.windowed_plan(T, left_context=ctx))
    full = run(codes)[0]
    win = V.decode_windowed(run, codes, left_context=ctx)
    assert float(np.max(np.abs(win - full))) <= 1e-5


def test_windowed_snr_300_frames(run):
    codes = _codes(300, seed=300)
    run(codes)  # warm-up
    t0 = time.perf_counter()
    full = run(codes)
    RESULTS["ort_300_frames_s"] = time.perf_counter() - t0
    assert full.shape == (1, 300 * HOP)
    snr = V.windowed_snr_db(run, codes, left_context=72)
    RESULTS["windowed_snr_db"] = snr
    print(f"\nvocoder: windowed (ramp {V.DEFAULT_RAMP}, 72 frames of context) vs single pass, 300 frames: "
          f"SNR {snr:.2f} dB; onnxruntime single pass 300 frames: {RESULTS['ort_300_frames_s'] * 1000:.0f} ms")
    assert math.isfinite(snr) and snr > 0.0


def test_decode_windowed_rejects_wrong_length():
    with pytest.raises(ValueError):
        V.decode_windowed(lambda c: np.zeros((1, c.shape[2] * HOP - 1), np.float32), _codes(5))


# --------------------------------------------------------------------------- stateful (streaming) decoding

#: Ramps of the stateful tests: chunks of one frame, the default ramp, a mixed ramp, steady chunks
#: of 7 and 25, and chunks longer than the carried sliding_window - 1 = 71 frames of keys/values.
STREAM_RAMPS = [(1,), V.DEFAULT_RAMP, (1, 2, 3, 25), (7,), (25,), (100,)]

_single: dict[int, np.ndarray] = {}


def _single_pass(run, T: int) -> np.ndarray:
    """One onnxruntime pass of the windowed graph over ``_codes(T, seed=T)``, flat [T * HOP] (cached)."""
    if T not in _single:
        _single[T] = run(_codes(T, seed=T))[0]
    return _single[T]


def _expected_states(vw) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The carried states by the formula, in graph order, from the checkpoint's tensor shapes.

    A causal conv with kernel k and dilation d keeps its last (k-1)*d input samples (a 1x1 conv
    keeps none); a transposed conv with k = 2r, stride r keeps 1 input sample (k = stride keeps
    none); each attention layer keeps the rotated keys and the values of sliding_window - 1
    frames for every query head (repeat_kv is folded into the weights); position is int64 [1].
    """
    c = vw.config
    f32 = np.dtype(np.float32)

    def conv(name: str, tensor: str, dilation: int = 1, groups: int = 1):
        _cout, cin_g, k = vw.t(tensor).shape
        return (name, f32, (1, cin_g * groups, (k - 1) * dilation))

    out = [("position", np.dtype(np.int64), (1,)), conv("pre_conv", "pre_conv.conv.weight")]
    for i in range(c.num_hidden_layers):
        for kv in ("k", "v"):
            out.append((f"layer{i}.{kv}", f32, (1, c.num_attention_heads, c.sliding_window - 1, c.head_dim)))
    for i, f in enumerate(c.upsampling_ratios):
        assert vw.t(f"upsample.{i}.0.conv.weight").shape[-1] == f  # kernel == stride: nothing carried
        out.append(conv(f"upsample{i}.dwconv", f"upsample.{i}.1.dwconv.conv.weight", groups=c.latent_dim))
    out.append(conv("decoder0", "decoder.0.conv.weight"))
    for bi, (cin, _cout, r) in enumerate(c.block_dims(), start=1):
        w = vw.t(f"decoder.{bi}.block.1.conv.weight")  # [cin, cout, 2r]
        assert w.shape[-1] == 2 * r
        out.append((f"block{bi}.up", f32, (1, cin, 1)))
        for u, dil in enumerate(V.RESIDUAL_DILATIONS):
            out.append(conv(f"block{bi}.res{u}", f"decoder.{bi}.block.{u + 2}.conv1.conv.weight", dilation=dil))
    nb = len(c.upsample_rates)
    out.append(conv("out", f"decoder.{nb + 2}.conv.weight"))
    return out


def test_stream_plan():
    assert V.stream_plan(100) == [(0, 2), (2, 6), (6, 14), (14, 30), (30, 55), (55, 80), (80, 100)]
    assert V.stream_plan(3, (1,)) == [(0, 1), (1, 2), (2, 3)]
    assert V.stream_plan(0) == []
    with pytest.raises(ValueError):
        V.stream_plan(5, ())


def test_stream_state_shapes_follow_the_formula(vw, stream_model):
    states = V.stream_states(stream_model)
    assert states == _expected_states(vw)
    assert dict((n, s) for n, _, s in states)["block1.res2"] == (1, 32, 6 * 9)  # (7 - 1) * dilation 9
    sig = io_signature(stream_model)
    assert sig["inputs"][0] == {"name": "codes", "dtype": "int64", "shape": [1, 16, "frames"]}
    assert sig["outputs"][0] == {"name": "wav", "dtype": "float32", "shape": [1, "samples"]}
    ins, outs = sig["inputs"][1:], sig["outputs"][1:]
    assert [i["name"] for i in ins] == [f"state.{n}" for n, _, _ in states]
    assert [o["name"] for o in outs] == [f"next.{n}" for n, _, _ in states]
    for i, o, (_, dt, shape) in zip(ins, outs, states):
        assert i["dtype"] == o["dtype"] == dt.name and i["shape"] == o["shape"] == list(shape), (i, o)
    floats = sum(math.prod(s) for _, dt, s in states if dt == np.float32)
    RESULTS["stream_state_floats"] = floats
    print(f"\nvocoder_stream: {len(states)} states, {floats} float32 values ({floats * 4 / 1024:.1f} KiB), tiny model")


def test_stream_next_state_and_position(vw, stream_model, run_stream):
    """Every next.* has its state's dtype and shape; next.position counts the frames decoded."""
    states = V.stream_states(stream_model)
    codes = _codes(90, seed=90)
    cur = {f"state.{n}": np.zeros(s, dt) for n, dt, s in states}
    for s, e in V.stream_plan(90, (1, 2, 3, 80)):
        res = run_stream({"codes": codes[:, :, s:e], **cur})
        assert res["wav"].shape == (1, (e - s) * HOP) and res["wav"].dtype == np.float32
        assert res["next.position"].dtype == np.int64 and res["next.position"].tolist() == [e]
        for n, dt, shape in states:
            nxt = res[f"next.{n}"]
            assert nxt.dtype == dt and nxt.shape == shape, (n, nxt.dtype, nxt.shape)
            assert np.all(np.isfinite(nxt))
            cur[f"state.{n}"] = nxt
    # the carried keys/values are the last 71 frames' (the utterance is longer than the window)
    assert np.any(cur["state.layer1.k"][:, :, 0] != 0)


@pytest.mark.parametrize("ramp", STREAM_RAMPS, ids=lambda r: "ramp" + "-".join(map(str, r)))
@pytest.mark.parametrize("T", [1, 2, 300, 1000])
def test_stateful_equals_single_pass(stream_model, run, run_stream, T, ramp):
    """Concatenated stateful chunks = one single pass of the windowed graph, for any chunking."""
    full = _single_pass(run, T)
    got = V.decode_stateful(run_stream, V.stream_states(stream_model), _codes(T, seed=T), ramp)
    assert got.shape == full.shape == (T * HOP,) and got.dtype == np.float32
    err = float(np.max(np.abs(got - full)))
    RESULTS["stateful_max_abs"] = max(RESULTS.get("stateful_max_abs", 0.0), err)
    assert err <= 1e-5, err


def test_stateful_matches_numpy(vw, stream_model, run_stream):
    T = 40  # chunks 1, 2, 3, 25, 9
    codes = _codes(T, seed=41)
    got = V.decode_stateful(run_stream, V.stream_states(stream_model), codes, (1, 2, 3, 25))
    ref = V.vocoder_numpy(vw, codes[0])
    err = float(np.max(np.abs(got - ref)))
    RESULTS["stateful_vs_numpy_max_abs"] = err
    assert err <= 1e-4, err


def test_stateful_gqa_variant(tmp_path):
    """repeat_kv folded and carried: fewer KV heads than query heads, chunks across the window."""
    cfg = V.tiny_speech_tokenizer_config()
    cfg["decoder_config"]["num_key_value_heads"] = 2
    V.write_tiny_speech_tokenizer(tmp_path, np.random.default_rng(3), config=cfg)
    w = V.load_vocoder(tmp_path)
    sm = V.build_vocoder_graph(w, stateful=True)
    assert V.stream_states(sm) == _expected_states(w)
    codes = _codes(110, seed=110)
    full = _session(V.build_vocoder_graph(w))(codes)[0]
    got = V.decode_stateful(_stream_session(sm), V.stream_states(sm), codes, (1, 2, 3, 25))
    assert float(np.max(np.abs(got - full))) <= 1e-5


def test_stateful_snr_300_frames(stream_model, run, run_stream):
    """Windowed decoding (default ramp, 72 frames of context) vs stateful decoding, both against one pass."""
    codes = _codes(300, seed=300)
    full = run(codes)[0]
    win = V.decode_windowed(run, codes)
    t0 = time.perf_counter()
    st = V.decode_stateful(run_stream, V.stream_states(stream_model), codes)
    RESULTS["stateful_300_frames_s"] = time.perf_counter() - t0
    snr_win, snr_st = V.snr_db(full, win), V.snr_db(full, st)
    RESULTS["windowed72_vs_single_snr_db"] = snr_win
    RESULTS["stateful_vs_single_snr_db"] = snr_st
    RESULTS["stateful_300_max_abs"] = float(np.max(np.abs(st - full)))
    print(f"\nvocoder, 300 frames, ramp {V.DEFAULT_RAMP} vs one pass: windowed (72 frames of context) SNR "
          f"{snr_win:.2f} dB, max abs {float(np.max(np.abs(win - full))):.3g}; stateful SNR {snr_st:.2f} dB, "
          f"max abs {RESULTS['stateful_300_max_abs']:.3g} ({RESULTS['stateful_300_frames_s'] * 1000:.0f} ms)")
    if "stateful_max_abs" in RESULTS:  # test_stateful_equals_single_pass ran first (file order)
        print(f"vocoder: stateful vs one pass, 1/2/300/1000 frames x ramps {STREAM_RAMPS}: worst max abs "
              f"{RESULTS['stateful_max_abs']:.3g}")
    assert snr_st > 90.0 and snr_st > snr_win


def test_decode_stateful_rejects_bad_runs(stream_model):
    states = V.stream_states(stream_model)

    def short(feeds):
        n = feeds["codes"].shape[2]
        nxt = {f"next.{k}": feeds[f"state.{k}"] for k, _, _ in states}
        return {"wav": np.zeros((1, n * HOP - 1), np.float32), **nxt}

    def forgetful(feeds):
        return {"wav": np.zeros((1, feeds["codes"].shape[2] * HOP), np.float32)}

    with pytest.raises(ValueError, match="samples"):
        V.decode_stateful(short, states, _codes(5))
    with pytest.raises(ValueError, match="next.position"):
        V.decode_stateful(forgetful, states, _codes(5))
    with pytest.raises(ValueError, match="codes"):
        V.decode_stateful(forgetful, states, np.zeros((2, 16, 3), np.int64))
    assert V.decode_stateful(forgetful, states, _codes(0)).shape == (0,)


# --------------------------------------------------------------------------- graph hygiene


AXES_INPUT = {"Unsqueeze": 1, "Squeeze": 1, "ReduceSum": 1, "Slice": 3}
PLAIN_OPS = {
    "Gather", "Shape", "Range", "Cast", "Unsqueeze", "Mul", "Add", "Sub", "Cos", "Sin", "Less", "Greater",
    "MatMul", "Reshape", "Transpose", "Slice", "Concat", "Neg", "Softmax", "ReduceMean", "ReduceSum", "Sqrt",
    "Reciprocal", "Sigmoid", "Conv", "ConvTranspose", "LayerNormalization", "Erf", "Clip", "Identity",
}


def _check_hygiene(model: onnx.ModelProto) -> None:
    """Full onnx check, opset 17, plain ops only, no NaN guards, no allowzero Reshape, no rank-0 axes."""
    onnx.checker.check_model(model, full_check=True)
    g = model.graph
    ops = {n.op_type for n in g.node}
    assert "IsNaN" not in ops and "Where" not in ops
    assert ops <= PLAIN_OPS, ops - PLAIN_OPS
    for n in g.node:
        if n.op_type == "Reshape":
            assert all(not (a.name == "allowzero" and a.i == 1) for a in n.attribute), n.name
    rank0 = {t.name for t in g.initializer if len(t.dims) == 0}
    for n in g.node:
        pos = AXES_INPUT.get(n.op_type)
        if pos is not None and len(n.input) > pos:
            assert n.input[pos] not in rank0, f"{n.name}: rank-0 axes"
        if n.op_type == "Slice":
            for i in n.input[1:]:
                assert i not in rank0
    for t in g.initializer:
        assert t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64), t.name
    assert model.opset_import[0].version == 17


def test_graph_hygiene(model):
    _check_hygiene(model)
    sig = io_signature(model)
    assert sig["inputs"] == [{"name": "codes", "dtype": "int64", "shape": [1, 16, "frames"]}]
    assert sig["outputs"] == [{"name": "wav", "dtype": "float32", "shape": [1, "samples"]}]


def test_stream_graph_hygiene(stream_model):
    _check_hygiene(stream_model)
    assert stream_model.graph.name == "herald_vocoder_stream"


# --------------------------------------------------------------------------- bad input


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    return d


def _edit_config(d: Path, fn) -> Path:
    p = d / "speech_tokenizer" / "config.json"
    raw = json.loads(p.read_text())
    fn(raw)
    p.write_text(json.dumps(raw))
    return p


def _expect(d: Path, path: Path, *words: str) -> ExportError:
    with pytest.raises(ExportError) as ei:
        V.load_vocoder(d)
    e = ei.value
    assert e.path == str(path), (e.path, str(path))
    msg = str(e)
    assert str(path) in msg
    for w in words:
        assert w in msg, (w, msg)
    return e


def test_missing_config(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = d / "speech_tokenizer" / "config.json"
    p.unlink()
    _expect(d, p, "not found")


def test_invalid_json_config(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = d / "speech_tokenizer" / "config.json"
    p.write_text("{not json")
    _expect(d, p, "invalid JSON")


def test_unknown_decoder_key(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = _edit_config(d, lambda r: r["decoder_config"].__setitem__("use_weight_norm", True))
    _expect(d, p, "unknown key", "use_weight_norm")


def test_wrong_model_type(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = _edit_config(d, lambda r: r.__setitem__("model_type", "qwen3_tts_tokenizer_25hz"))
    _expect(d, p, "model_type", "qwen3_tts_tokenizer_25hz")


def test_upsample_rate_mismatch(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = _edit_config(d, lambda r: r.__setitem__("decode_upsample_rate", 2000))
    _expect(d, p, "decode_upsample_rate", "2000", "1920")


def test_unsupported_settings(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = _edit_config(d, lambda r: r["decoder_config"].__setitem__("hidden_act", "gelu"))
    _expect(d, p, "hidden_act")


def _rewrite_tensors(d: Path, fn) -> Path:
    from safetensors.numpy import load_file, save_file

    p = d / "speech_tokenizer" / "model.safetensors"
    tensors = load_file(str(p))
    fn(tensors)
    save_file(tensors, str(p))
    return p


def test_wrong_shape(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "decoder.pre_transformer.layers.1.mlp.up_proj.weight"
    p = _rewrite_tensors(d, lambda t: t.__setitem__(name, np.zeros((65, 32), np.float32)))
    _expect(d, p, f"tensor {name} has shape (65, 32) expected (64, 32)")


def test_missing_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "decoder.decoder.3.block.2.act1.beta"
    p = _rewrite_tensors(d, lambda t: t.pop(name))
    _expect(d, p, f"tensor {name} is missing")


def test_unexpected_decoder_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "decoder.decoder.0.conv.weight_g"
    p = _rewrite_tensors(d, lambda t: t.__setitem__(name, np.ones((64, 1, 1), np.float32)))
    _expect(d, p, "unexpected tensor", name)


def test_truncated_safetensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = d / "speech_tokenizer" / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    _expect(d, p, "truncated")


def test_missing_safetensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    p = d / "speech_tokenizer" / "model.safetensors"
    p.unlink()
    _expect(d, p, "not found")


def test_numpy_rejects_bad_codes(vw):
    with pytest.raises(ValueError):
        V.vocoder_numpy(vw, np.zeros((15, 3), np.int64))
    with pytest.raises(ValueError):
        V.vocoder_numpy(vw, np.full((16, 3), 2048, np.int64))


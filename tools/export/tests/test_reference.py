"""The reference decoder (tools/export/reference.py) on the tiny bundles.

Expected values are rebuilt here by hand (ids from qwen3-tts.md §1.3/§1.4, tables read directly
from tables.safetensors, the tokenizer run directly), never through the module's own helpers.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tomllib
import wave
from pathlib import Path

import numpy as np
import onnx
import pytest
import tomli_w
from safetensors.numpy import load_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reference as R  # noqa: E402
from herald_export.checkpoint import LMWeights, load_spec  # noqa: E402
from herald_export.host import StackCache, step  # noqa: E402
from herald_export.lm import lm_forward_numpy  # noqa: E402
from herald_export.vocoder import stream_states  # noqa: E402

# Text-side ids (qwen3-tts.md §1.4) and codec-side ids (§1.3) of the official checkpoints,
# which the tiny presets copy.
IM_START, IM_END, ASSISTANT, NL = 151644, 151645, 77091, 198
TTS_PAD, TTS_BOS, TTS_EOS = 151671, 151672, 151673
PAD, BOS, EOS, THINK, NOTHINK, THINK_BOS, THINK_EOS = 2148, 2149, 2150, 2154, 2155, 2156, 2157
ENGLISH, CHINESE, SICHUAN, BEIJING = 2050, 2055, 2062, 2074
RYAN, ERIC, DYLAN = 3061, 2875, 2878

_refs: dict[Path, R.Reference] = {}


def load_ref(bundle: Path) -> R.Reference:
    if bundle not in _refs:
        _refs[bundle] = R.Reference(bundle, threads=2)
    return _refs[bundle]


class EosBias:
    """Wraps the talker session and adds ``bias`` to the eos logit (a random model may or may not
    sample eos on its own; tests that need a known stop make it certain or impossible)."""

    def __init__(self, sess, bias: float):
        self.sess, self.bias = sess, bias

    def get_inputs(self):
        return self.sess.get_inputs()

    def get_outputs(self):
        return self.sess.get_outputs()

    def run(self, names, feeds):
        outs = self.sess.run(names, feeds)
        outs[names.index("logits")][..., EOS] += self.bias
        return outs


@contextlib.contextmanager
def eos_bias(ref: R.Reference, bias: float):
    real = ref.talker
    ref.talker = EosBias(real, bias)
    try:
        yield
    finally:
        ref.talker = real


@pytest.fixture(scope="module")
def small(tiny_factory):
    """(Reference, bundle dir, raw tables, tokenizer) of tiny-0.6b."""
    bundle, _ = tiny_factory("tiny-0.6b")
    return load_ref(bundle), bundle, load_file(str(bundle / "tables.safetensors")), \
        Tokenizer.from_file(str(bundle / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# Prompt layout
# ---------------------------------------------------------------------------------------------

# (text, language, speaker, expected codec prefix incl. speaker, before [pad, bos])
PROMPT_CASES = [
    ("Hello world.", "auto", None, [NOTHINK, THINK_BOS, THINK_EOS]),
    ("Hello world.", "english", None, [THINK, THINK_BOS, ENGLISH, THINK_EOS]),
    ("Hello world.", "English", "Ryan", [THINK, THINK_BOS, ENGLISH, THINK_EOS, RYAN]),
    ("Hello world.", "auto", "ryan", [NOTHINK, THINK_BOS, THINK_EOS, RYAN]),
    ("你好，世界。", "chinese", "eric", [THINK, THINK_BOS, SICHUAN, THINK_EOS, ERIC]),   # dialect override
    ("Hi", "auto", "dylan", [THINK, THINK_BOS, BEIJING, THINK_EOS, DYLAN]),           # auto -> dialect, think form
    ("Hi", "english", "eric", [THINK, THINK_BOS, ENGLISH, THINK_EOS, ERIC]),          # no override for english
]


def test_tokenizer_slicing(small):
    ref, _, _, tok = small
    assert ref.tokenize("Hello world.") == [9707, 1879, 13]
    ids = tok.encode("<|im_start|>assistant\n你好，世界。<|im_end|>\n<|im_start|>assistant\n").ids
    assert ids[:3] == [IM_START, ASSISTANT, NL] and ids[-5:] == [IM_END, NL, IM_START, ASSISTANT, NL]
    assert ref.tokenize("你好，世界。") == ids[3:-5]


@pytest.mark.parametrize("mode", ["streaming", "non-streaming"])
@pytest.mark.parametrize("text,language,speaker,codec_prefix", PROMPT_CASES)
def test_prompt_layout(small, mode, text, language, speaker, codec_prefix):
    ref, _, tables, tok = small
    T, C = tables["text_embedding"], tables["codec_embedding"]
    ids = tok.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
    text_ids = ids[3:-5]
    assert ids[:3] == [IM_START, ASSISTANT, NL]

    rows = [T[IM_START], T[ASSISTANT], T[NL]]
    codec = codec_prefix + [PAD]                      # every codec item except the final bos
    for i, c in enumerate(codec):
        rows.append((T[TTS_BOS] if i == len(codec) - 1 else T[TTS_PAD]) + C[c])
    if mode == "streaming":
        rows.append(T[text_ids[0]] + C[BOS])
        trailing = [T[t] for t in text_ids[1:]] + [T[TTS_EOS]]
        assert len(rows) == 3 + (len(codec_prefix) + 1) + 1
    else:
        rows += [T[t] + C[PAD] for t in text_ids] + [T[TTS_EOS] + C[PAD], T[TTS_PAD] + C[BOS]]
        trailing = [T[TTS_PAD]]
        assert len(rows) == 3 + (len(codec_prefix) + 1) + len(text_ids) + 2
    prefill, trail = ref.prompt(text, language, speaker, mode)
    assert prefill.dtype == np.float32 and trail.dtype == np.float32
    np.testing.assert_array_equal(prefill, np.stack(rows))
    np.testing.assert_array_equal(trail, np.stack(trailing))


def test_prompt_length_example(small):
    """English + speaker, streaming text: 3 + 6 + 1 = 10 (qwen3-tts.md §2.1)."""
    ref = small[0]
    assert ref.prompt("Hello world.", "english", "ryan", "streaming")[0].shape[0] == 10
    assert ref.prompt("Hello world.", "auto", None, "streaming")[0].shape[0] == 8
    assert ref.prompt("Hello world.", "auto", None, "non-streaming")[0].shape[0] == 3 + 4 + 3 + 2


def test_prompt_errors(small):
    ref = small[0]
    with pytest.raises(ValueError, match=r"unknown speaker 'bob'.*dylan, eric, ryan, serena, vivian"):
        ref.prompt("Hi", "auto", "bob")
    with pytest.raises(ValueError, match=r"unknown language 'klingon'.*auto, .*english"):
        ref.prompt("Hi", "klingon")
    with pytest.raises(ValueError, match="empty"):
        ref.prompt("", "auto")
    with pytest.raises(ValueError, match="nothing to say"):
        ref.prompt("\n", "auto")                      # blank after cleaning
    with pytest.raises(ValueError, match="nothing to say"):
        ref.prompt(" \t\x01\x7f ", "auto")
    with pytest.raises(ValueError, match="limit is 20000"):
        ref.prompt("x" * 20_001, "auto")
    # controls inside real text are cleaned (the same rule as engine::prompt::clean_text)
    assert ref.tokenize("a\x07b\r\nc") == ref.tokenize("a b\nc")
    with pytest.raises(ValueError, match="unknown mode"):
        ref.prompt("Hi", "auto", None, "batch")
    with pytest.raises(ValueError, match="seed"):
        ref.generate("Hi", greedy=False)


# ---------------------------------------------------------------------------------------------
# Logits processors, RNG, sampling rule
# ---------------------------------------------------------------------------------------------

def f32(*v):
    return np.array(v, dtype=np.float32)


def test_repetition_penalty_sign_rule():
    p = np.float32(1.05)
    out = R.repetition_penalty(f32(2.0, -2.0, 0.5, 0.0, 3.0), [0, 1, 1, 1, 3], 1.05)
    np.testing.assert_array_equal(out, f32(np.float32(2.0) / p, np.float32(-2.0) * p, 0.5, 0.0, 3.0))
    np.testing.assert_array_equal(R.repetition_penalty(f32(1.0, 2.0), [], 1.05), f32(1.0, 2.0))


def test_eos_block_and_suppression():
    x = np.linspace(-1, 1, 3072).astype(np.float32)
    for n, blocked in ((0, True), (1, True), (2, False), (7, False)):
        out = R.block_eos(x, EOS, n, 2)
        assert (out[EOS] == -np.inf) == blocked
        np.testing.assert_array_equal(np.delete(out, EOS), np.delete(x, EOS))
    s = R.suppress_specials(x, EOS)
    np.testing.assert_array_equal(s[:2048], x[:2048])
    assert s[EOS] == x[EOS]
    assert np.all(np.isneginf(np.delete(s[2048:], EOS - 2048)))


def test_temperature_top_k_top_p():
    np.testing.assert_array_equal(R.apply_temperature(f32(1.0, -2.0, -np.inf), 0.5), f32(2.0, -4.0, -np.inf))
    inf = -np.inf
    np.testing.assert_array_equal(R.top_k_filter(f32(1, 3, 0, 2, 5), 2), f32(inf, 3, inf, inf, 5))
    np.testing.assert_array_equal(R.top_k_filter(f32(3, 2, 2, 1), 2), f32(3, 2, 2, inf))   # ties with the k-th stay
    np.testing.assert_array_equal(R.top_k_filter(f32(3, 2, 1), 0), f32(3, 2, 1))           # 0 = off
    np.testing.assert_array_equal(R.top_k_filter(f32(3, 2, 1), 5), f32(3, 2, 1))
    # probabilities 0.5, 0.25, 0.125, 0.125 (ids 0..3), shuffled to ids [2, 0, 3, 1]
    lg = np.log(np.array([0.125, 0.5, 0.125, 0.25])).astype(np.float32)
    keep = lambda p: np.isfinite(R.top_p_filter(lg, p)).tolist()  # noqa: E731
    assert keep(1.0) == [True, True, True, True]
    assert keep(0.4) == [False, True, False, False]            # mass before id1 is 0 < 0.4 only
    assert keep(0.7) == [False, True, False, True]             # 0.5 < 0.7: keep 0.25; 0.75 >= 0.7: stop
    assert keep(0.8) == [True, True, False, True]              # tie 0.125: lower id (0) first


def test_talker_chain_order():
    s = {"repetition_penalty": 1.05, "min_new_tokens": 2, "temperature": 0.5, "top_k": 2, "top_p": 1.0}
    x = np.zeros(3072, np.float32)
    x[[5, 6, 7, EOS, 2500]] = [4.0, 3.0, 3.5, 10.0, 20.0]
    greedy = R.talker_processors(x, [5], s, EOS, sampling=False)
    assert greedy[5] == np.float32(4.0) / np.float32(1.05) and greedy[EOS] == -np.inf and greedy[2500] == -np.inf
    assert R.greedy_choice(greedy) == 5                        # 3.809 > 3.5 (penalty before the argmax)
    samp = R.talker_processors(x, [5, 5], s, EOS, sampling=True)
    assert np.flatnonzero(np.isfinite(samp)).tolist() == [5, EOS]   # eos allowed after 2 frames; top-2
    assert samp[EOS] == np.float32(10.0) / np.float32(0.5)
    assert R.greedy_choice(f32(1, 3, 3, 2)) == 1               # ties: lowest id


def test_splitmix64_known_answers():
    g = R.SplitMix64(0)
    assert [g.next_u64() for _ in range(4)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    g = R.SplitMix64(1234567)     # the published reference test vector
    assert [g.next_u64() for _ in range(5)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]
    g, h = R.SplitMix64(0), R.SplitMix64(0)
    assert g.uniform() == (h.next_u64() >> 11) * 2.0 ** -53 == (0xE220A8397B1DCDAF >> 11) / 2 ** 53
    with pytest.raises(ValueError):
        R.SplitMix64(-1)


def test_sampling_rule():
    # probabilities 0.1, removed, 0.2, 0.3, 0.4 -> cumulative 0.1, 0.3, 0.6, 1.0 over ids 0, 2, 3, 4
    lg = np.log(np.array([0.1, 1.0, 0.2, 0.3, 0.4])).astype(np.float32)
    lg[1] = -np.inf
    picks = {u: R.sample_from_logits(lg, u) for u in (0.0, 0.05, 0.15, 0.29, 0.31, 0.59, 0.61, 0.99)}
    assert picks == {0.0: 0, 0.05: 0, 0.15: 2, 0.29: 2, 0.31: 3, 0.59: 3, 0.61: 4, 0.99: 4}
    assert R.sample_from_logits(lg, 1.0) == 4                   # never exceeded: the last kept id
    assert R.sample_from_logits(f32(-np.inf, 7.0, -np.inf), 0.999) == 1
    # the float64 arithmetic spelled out
    w = [math.exp(float(v) - float(lg[4])) for v in lg[[0, 2, 3, 4]]]
    assert abs(w[0] / sum(w) - 0.1) < 1e-7


def test_frame_cap_contract():
    assert R.frame_cap(1, 8192) == 50 and R.frame_cap(3, 8192) == 70 and R.frame_cap(100, 300) == 300


# ---------------------------------------------------------------------------------------------
# Generation on every tiny preset
# ---------------------------------------------------------------------------------------------

def test_greedy_generation(tiny, capsys):
    preset, bundle, _ = tiny
    ref = load_ref(bundle)
    with eos_bias(ref, -1000.0):                         # never eos: the cap must stop it
        a = ref.generate("Hi", "english", "ryan", greedy=True)
        b = ref.generate("Hi", "english", "ryan", greedy=True)
    err = capsys.readouterr().err
    assert a.codes.dtype == np.int64 and a.codes.shape == (50, 16)       # cap = 40 + 10 * 1 token
    assert a.stop == "cap" and a.cap_hit and a.cap == 50 and a.n_text_tokens == 1
    assert "warning: frame cap hit" in err and "50 frames" in err
    np.testing.assert_array_equal(a.codes, b.codes)
    assert a.codes.min() >= 0 and a.codes.max() <= 2047

    with eos_bias(ref, -1000.0):
        f = ref.generate("Hi", "english", "ryan", greedy=True, force_eos_at=4)
        z = ref.generate("Hi", force_eos_at=0)
        m = ref.generate("Hello world.", "auto", None, "non-streaming", max_frames=7)
    assert f.stop == "forced" and not f.cap_hit and f.frames == 4
    np.testing.assert_array_equal(f.codes, a.codes[:4])
    assert z.frames == 0 and z.codes.shape == (0, 16)
    raw = ref.generate("Hi", "english", "ryan", greedy=True)    # unpatched: same codes up to any eos
    np.testing.assert_array_equal(raw.codes, a.codes[:raw.frames])
    assert m.frames == 7 and m.cap_hit and m.cap == 7
    err = capsys.readouterr().err
    assert err.count("warning: frame cap hit") == 1 + (raw.stop == "cap") and "cap = max_frames" in err

    wav = ref.vocode(a.codes)
    assert wav.dtype == np.float32 and wav.shape == (50 * 1920,)
    assert np.all(np.abs(wav) <= 1.0) and np.any(wav != 0)
    w2 = ref.vocode(a.codes[:5], ramp=[1, 3], left_context=2)
    assert w2.shape == (5 * 1920,) and np.all(np.abs(w2) <= 1.0)
    assert ref.vocode(np.zeros((0, 16), np.int64)).shape == (0,)


def test_seeded_generation(tiny):
    _, bundle, _ = tiny
    ref = load_ref(bundle)
    with eos_bias(ref, -1000.0):
        s1 = ref.generate("Hello world.", "english", greedy=False, seed=11, max_frames=8)
        s1b = ref.generate("Hello world.", "english", greedy=False, seed=11, max_frames=8)
        s2 = ref.generate("Hello world.", "english", greedy=False, seed=12, max_frames=8)
    np.testing.assert_array_equal(s1.codes, s1b.codes)
    assert s1.codes.shape == (8, 16) and s1.codes.max() <= 2047
    assert not np.array_equal(s1.codes, s2.codes)


def test_natural_eos_and_min_new_tokens(small):
    """eos boosted from the start: blocked for frames 0 and 1, taken at frame 2 (greedy and seeded)."""
    ref = small[0]
    with eos_bias(ref, 1000.0):
        g = ref.generate("Hi", greedy=True)
        s = ref.generate("Hi", greedy=False, seed=3)
    assert g.stop == "eos" and g.frames == 2 and not g.cap_hit
    assert s.stop == "eos" and s.frames == 2


# ---------------------------------------------------------------------------------------------
# Cache handling: prefill + steps == one full pass; loop semantics against the numpy oracle
# ---------------------------------------------------------------------------------------------

def test_steps_equal_teacher_forcing(tiny):
    preset, bundle, ckpt = tiny
    ref = load_ref(bundle)
    g = ref.generate("Hello world.", "english", "ryan", greedy=True, max_frames=12, record=True)
    L, F = g.prefill_len, g.frames           # F = 12 unless the model picked eos on its own
    n_steps = F - 1 if g.stop == "cap" else F
    assert F >= 2 and g.talker_logits.shape == (n_steps + 1, 3072)
    assert g.talker_inputs.shape == (n_steps, ref.talker_spec.hidden)

    # the decode-step input, rebuilt by hand: C(c0) + sum E_k(c_k) + first trailing text row
    tables = load_file(str(bundle / "tables.safetensors"))
    c = g.codes[0]
    x0 = tables["codec_embedding"][c[0]].copy()
    for k in range(1, 16):
        x0 = x0 + tables["cp_embedding"][k - 1][c[k]]
    x0 = x0 + tables["text_embedding"][ref.tokenize("Hello world.")[1]]
    np.testing.assert_array_equal(g.talker_inputs[0], x0)

    # one full-sequence pass (S = all positions at once) through the same graph
    seq = np.concatenate([g.prefill, g.talker_inputs])
    out = step(ref.talker, StackCache(ref.talker_spec), seq)
    full = out["logits"][0, L - 1:]
    assert full.shape == g.talker_logits.shape
    np.testing.assert_allclose(g.talker_logits, full, atol=1e-4, rtol=0)

    # and the checkpoint's float64 numpy forward (independent of the graphs and the host caches)
    spec = load_spec(ckpt)
    w = LMWeights(spec)
    oracle, hidden = lm_forward_numpy(spec, w, "talker", seq)
    np.testing.assert_allclose(g.talker_logits, oracle[L - 1:], atol=1e-3, rtol=0)

    # frame 0's residual codes: code predictor over [hidden, C(c0), E_1(c1), ...] with head k-1
    cp_in = [hidden[L - 1], tables["codec_embedding"][c[0]]]
    for k in range(1, 16):
        logits, _ = lm_forward_numpy(spec, w, "code_predictor", np.stack(cp_in), head=k - 1)
        assert int(np.argmax(logits[-1])) == c[k], f"codebook {k}"
        cp_in.append(tables["cp_embedding"][k - 1][c[k]])


def test_fp16_bundle_runs(tiny_factory):
    bundle, _ = tiny_factory("tiny-0.6b", "fp16")
    ref = load_ref(bundle)
    assert ref.talker_cache_dtype == np.float16
    g = ref.generate("Hi", "english", force_eos_at=3)
    assert g.frames == 3 and g.codes.max() <= 2047


# ---------------------------------------------------------------------------------------------
# Stateful vocoding (the bundle's [vocoder] stream_graph)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("frames", [1, 37, 160])
def test_stateful_vocoding_equals_single_pass(tiny, frames):
    """Chunks through vocoder_stream.onnx with carried state = one pass of vocoder.onnx, any ramp."""
    _, bundle, _ = tiny
    ref = load_ref(bundle)
    assert ref.stream_graph == "vocoder_stream"
    assert ref.stream_states() == stream_states(onnx.load(str(bundle / "vocoder_stream.onnx")))
    codes = np.random.default_rng(frames).integers(0, 2048, (frames, 16), dtype=np.int64)
    once = ref.vocode_once(codes)
    for ramp in (None, [1], [1, 2, 3, 25], [80]):
        wav = ref.vocode_stateful(codes, ramp)
        assert wav.dtype == np.float32 and wav.shape == (frames * 1920,) and np.all(np.abs(wav) <= 1.0)
        err = float(np.max(np.abs(wav - once)))
        assert err <= 1e-5, (ramp, err)
    assert ref.vocode_stateful(np.zeros((0, 16), np.int64)).shape == (0,)
    with pytest.raises(ValueError, match="ramp"):
        ref.vocode_stateful(codes, [])


@pytest.fixture(scope="module")
def windowed_only(tiny_factory, tmp_path_factory) -> Path:
    """A copy of tiny-0.6b as a bundle without the stream graph (only [vocoder] graph)."""
    src, _ = tiny_factory("tiny-0.6b")
    out = tmp_path_factory.mktemp("windowed_only") / "bundle"
    shutil.copytree(src, out)
    m = tomllib.loads((out / "bundle.toml").read_text())
    del m["vocoder"]["stream_graph"]
    (out / m["graphs"].pop("vocoder_stream")["file"]).unlink()
    (out / "bundle.toml").write_text(tomli_w.dumps(m))
    return out


def test_bundle_without_stream_graph(windowed_only, tmp_path, capsys):
    ref = R.Reference(windowed_only, threads=2)
    assert ref.stream_graph is None
    codes = np.random.default_rng(1).integers(0, 2048, (9, 16), dtype=np.int64)
    with pytest.raises(ValueError, match="no \\[vocoder\\] stream_graph"):
        ref.vocode_stateful(codes)
    assert ref.vocode(codes).shape == (9 * 1920,)
    # the command line falls back to the windowed vocoder, and refuses an explicit stateful one
    wnpy, cnpy = tmp_path / "w.npy", tmp_path / "c.npy"
    args = ["--bundle", str(windowed_only), "--text", "Hi", "--force-eos-at", "5", "--codes-out", str(cnpy),
            "--wav-npy", str(wnpy)]
    assert R.main(args + ["--ramp", "1,3", "--left-context", "2"]) == 0
    np.testing.assert_array_equal(np.load(wnpy), ref.vocode(np.load(cnpy), [1, 3], 2))
    capsys.readouterr()
    assert R.main(args + ["--vocoder", "stateful"]) == 2
    assert "needs a bundle with a [vocoder] stream_graph" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# WAV and command line
# ---------------------------------------------------------------------------------------------

def test_pcm16_rounding():
    out = R.pcm16(f32(1.0, -1.0, 0.0, 0.25, -0.25, 2.0, -2.0))
    assert out.tolist() == [32767, -32767, 0, 8192, -8192, 32767, -32767]


def test_cli(small, tmp_path, capsys):
    _, bundle, _, _ = small
    codes, wav, wnpy = tmp_path / "c.npy", tmp_path / "a.wav", tmp_path / "a.npy"
    rc = R.main(["--bundle", str(bundle), "--text", "Hello world.", "--language", "english", "--speaker", "ryan",
                 "--seed", "5", "--max-frames", "6", "--vocoder", "windowed", "--ramp", "2,4", "--left-context", "3",
                 "--codes-out", str(codes), "--wav-out", str(wav), "--wav-npy", str(wnpy)])
    assert rc == 0
    c, x = np.load(codes), np.load(wnpy)
    F = c.shape[0]                                       # 6 unless the model sampled eos on its own
    assert 2 <= F <= 6 and c.shape == (F, 16) and c.dtype == np.int64
    assert x.shape == (F * 1920,) and x.dtype == np.float32
    with wave.open(str(wav)) as wf:
        assert (wf.getnchannels(), wf.getsampwidth(), wf.getframerate(), wf.getnframes()) == (1, 2, 24000, F * 1920)
        pcm = np.frombuffer(wf.readframes(F * 1920), "<i2")
    np.testing.assert_array_equal(pcm, R.pcm16(x))
    ref = load_ref(bundle)
    np.testing.assert_array_equal(c, ref.generate("Hello world.", "english", "ryan", greedy=False, seed=5,
                                                  max_frames=6).codes)
    np.testing.assert_array_equal(x, ref.vocode(c, [2, 4], 3))

    # the default vocoder of a bundle with a stream graph is the stateful one
    base = ["--bundle", str(bundle), "--text", "Hi", "--force-eos-at", "7", "--codes-out", str(codes)]
    assert R.main(base + ["--wav-npy", str(wnpy)]) == 0
    c = np.load(codes)
    np.testing.assert_array_equal(np.load(wnpy), ref.vocode_stateful(c))
    assert R.main(base + ["--wav-npy", str(wnpy), "--vocoder", "stateful", "--ramp", "1,2"]) == 0
    np.testing.assert_array_equal(np.load(wnpy), ref.vocode_stateful(c, [1, 2]))
    assert float(np.max(np.abs(np.load(wnpy) - ref.vocode_once(c)))) <= 1e-5
    capsys.readouterr()
    assert R.main(base + ["--wav-npy", str(wnpy), "--left-context", "3"]) == 2
    assert "--left-context applies to the windowed vocoder only" in capsys.readouterr().err

    assert R.main(["--bundle", str(bundle), "--text", "Hi", "--force-eos-at", "2", "--codes-out", str(codes)]) == 0
    assert np.load(codes).shape == (2, 16)
    capsys.readouterr()
    assert R.main(["--bundle", str(bundle), "--text", "Hi", "--speaker", "nobody"]) == 2
    assert "error: unknown speaker 'nobody'" in capsys.readouterr().err
    assert R.main(["--bundle", str(bundle), "--text", ""]) == 2
    assert "text is empty" in capsys.readouterr().err

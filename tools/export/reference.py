#!/usr/bin/env python3
"""herald's reference decoder: a herald bundle driven through onnxruntime, in plain numpy.

This is the oracle the Rust engine is checked against. It follows the official generation code
step by step, with plain loops. Line numbers ("L...") refer to the ``qwen-tts`` 0.1.1 package:
``qwen_tts/core/models/modeling_qwen3_tts.py`` (``Qwen3TTSForConditionalGeneration.generate``
L2022-2299, the talker forward L1636-1743) and ``qwen_tts/inference/qwen3_tts_model.py`` (chat
wrapping L269-276). Nothing here is clever on purpose; where the Rust engine must match bit for
bit, the rule is written down below.

Usage::

    python tools/export/reference.py --bundle DIR --text "Hello." [--language auto|english|...]
        [--speaker NAME] [--mode streaming|non-streaming] [--greedy | --seed N]
        [--max-frames N] [--force-eos-at N] [--vocoder stateful|windowed] [--ramp 2,4,8,16,25]
        [--left-context 72] [--codes-out FILE.npy] [--wav-out FILE.wav] [--wav-npy FILE.npy]

    from reference import Reference
    ref = Reference("bundle/")
    gen = ref.generate("Hello.", language="english", greedy=True)   # gen.codes int64 [F, 16]
    wav = ref.vocode(gen.codes)                                      # windowed: float32 [F * 1920]
    wav = ref.vocode_stateful(gen.codes)                             # stateful (bundle stream_graph)

Notation (docs/qwen3-tts.md §2): T(id) = ``text_embedding[id]`` (already text-projected in the
bundle), C(id) = ``codec_embedding[id]``, E_k(id) = ``cp_embedding[k-1][id]`` for codebook k = 1..15.
All embedding arithmetic is float32 (float16 tables are widened to float32 first), summed left to
right in the order written.

1. Prompt (``Reference.prompt_layout`` / ``Reference.prompt``)
--------------------------------------------------------------
The text is chat-wrapped as ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``
(wrapper L269) and tokenized with the bundle's ``tokenizer.json`` (no added tokens). As upstream
(generate L2175-2233) the ids are sliced by fixed counts: ``ids[:3]`` role prefix
(im_start, "assistant", "\\n"), ``ids[3:-5]`` the text, ``ids[-5:]`` the closing tokens (im_end, "\\n",
im_start, "assistant", "\\n"). With this tokenizer the special tokens are atomic and the text is
split from them, so the slicing is exact; the one quirk (same as upstream) is that a text starting
with "\\n" merges that newline into the role's "\\n" token. A text with no tokens is rejected.

Codec prefix (generate L2134-2173): with a language ``[think, think_bos, lang, think_eos]``,
with ``auto`` ``[nothink, think_bos, think_eos]``; a dialect speaker (bundle ``[speaker_dialects]``)
replaces ``lang`` by its dialect's id when the language is ``chinese`` or ``auto`` (so ``auto`` then
gets the 4-item form, L2118-2122); then ``C(speaker)`` if a speaker is given; then ``[pad, bos]``.

Prefill rows, each ``text part + codec part``:

- role, 3 rows, text only: ``T(im_start)``, ``T(assistant)``, ``T(\\n)``;
- one row per codec item except the final bos: ``T(tts_pad) + C(item)``, but the last of them
  (the one with ``C(pad)``) is ``T(tts_bos) + C(pad)``;
- streaming text (upstream ``non_streaming_mode=False``): one row ``T(text[0]) + C(bos)``; the
  trailing queue is ``T(text[1:])`` followed by ``T(tts_eos)``;
- non-streaming (``non_streaming_mode=True``): ``T(text[i]) + C(pad)`` for every text token, then
  ``T(tts_eos) + C(pad)``, then ``T(tts_pad) + C(bos)``; the trailing queue is ``[T(tts_pad)]``.

So the prefill length is ``3 + (P + s + 1) + 1`` (streaming) or ``3 + (P + s + 1) + (n + 1) + 1``
(non-streaming), with P = 3 (auto) or 4 (language), s = 1 with a speaker, n = text tokens.
Example: English + speaker, streaming: 3 + 6 + 1 = 10. The default mode here is streaming text
(the default of upstream ``generate``); the wrapper's ``generate_custom_voice`` and
``generate_voice_design`` pass non-streaming (wrapper L642, L738).

2. Per frame (talker forward L1662-1692, generation_step L1741)
---------------------------------------------------------------
Prefill the talker over the prompt; then for frame f = 0, 1, ...:

- c0 from the talker logits of the last position, through the talker's logits processors (below);
  stop when c0 == eos (the frame is not produced).
- Code predictor with a fresh cache: a 2-position prefill ``[talker hidden (post-norm, last
  position), C(c0)]`` with ``head`` 0 gives c1; then for k = 2..15 one position ``E_{k-1}(c_{k-1})``
  with ``head`` k-1 gives c_k. The frame is ``[c0, c1, ..., c15]``.
- Next talker input ``C(c0) + E_1(c1) + ... + E_15(c15) + trailing[f]`` (``T(tts_pad)`` once
  the trailing queue is used up), one talker step at the next position.

3. Logits processors and choice
-------------------------------
Talker (Hugging Face order, generate L2043-2067): (a) repetition penalty over the distinct c0
of all earlier frames: ``x / penalty`` when ``x > 0`` else ``x * penalty``; (b) eos set to -inf
while fewer than ``min_new_tokens`` frames exist; (c) ids ``[vocab-1024, vocab)`` other than eos
set to -inf. When sampling, then: (d) ``/ temperature``; (e) top-k: ids whose value is below the
k-th largest value become -inf (ties with it stay); (f) top-p (only when ``top_p < 1``): over the
softmax (float64) in descending probability order (ties: lower id first), an id is kept while the
probability mass of the ids before it is ``< top_p``. Code predictor: (d)-(f) only.
All processor arithmetic is float32 (parameters rounded to float32), on the float32 logits.
Parameters: bundle ``[sampling.talker]`` (repetition_penalty, min_new_tokens, temperature, top_k,
top_p) and ``[sampling.code_predictor]`` (temperature, top_k, top_p).

Greedy: argmax of the logits after (a)-(c) (the code predictor: of the raw logits); the lowest id
wins ties. (Hugging Face applies (d)-(f) only when sampling; (d) could create ties.)

4. Seeded sampling: the RNG contract shared with the Rust engine
----------------------------------------------------------------
- Generator: SplitMix64 (Steele, Lea, Flood 2014; the reference ``splitmix64.c``), state = the
  user seed (an unsigned 64-bit integer)::

      state += 0x9E3779B97F4A7C15
      z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9
      z = (z ^ (z >> 27)) * 0x94D049BB133111EB
      return z ^ (z >> 31)                                   (all mod 2^64)

- One uniform per sampling decision: ``u = (next_u64() >> 11) * 2^-53`` in [0, 1). Decisions per
  frame in order: talker c0, then c1 .. c15. Greedy stages (``--greedy``, or ``do_sample = false``
  in the bundle's ``[sampling.*]``) and the forced-eos hook draw nothing.
- Kept candidates: the ids whose processed logit is finite, in ascending id order. With m their
  largest logit (as float64): ``w_i = exp(l_i - m)`` (float64, C ``exp``), ``S = w_0 + w_1 + ...``
  summed in ascending id order, ``p_i = w_i / S``; the running sum ``P += p_i`` in the same order;
  the choice is the first id with ``P > u``; if none (rounding), the last kept id.

5. Stopping and the frame cap (shared with the Rust engine)
-----------------------------------------------------------
``frame_cap(n_text_tokens, max_new_tokens) = min(max_new_tokens, 40 + 10 * n_text_tokens)``
(n_text_tokens = len(ids[3:-5]); max_new_tokens from ``[sampling.talker]``). Random or unlucky
models may never emit eos; after ``cap`` frames the loop stops (no further talker step and no
further draw) and a ``warning:`` line goes to stderr. ``max_frames`` overrides the cap.
``force_eos_at=N`` (test hook) forces c0 = eos at frame N, so exactly N frames are produced
(when N <= cap).

6. Vocoding
-----------
Two schemes (docs/bundle.md, "Vocoder"), each giving exactly frames x samples_per_frame float32
samples in [-1, 1]:

- windowed (``Reference.vocode``): ``herald_export.vocoder.decode_windowed`` over an onnxruntime
  session of the ``[vocoder] graph`` (``vocoder.onnx``) with the ramp and left context (defaults:
  bundle ``[vocoder] ramp`` and ``left_context_frames``); each chunk is decoded again together
  with up to ``left_context`` earlier frames and only its own samples are kept. Close to, not
  exactly, one single pass.
- stateful (``Reference.vocode_stateful``): ``herald_export.vocoder.decode_stateful`` over the
  ``[vocoder] stream_graph`` (``vocoder_stream.onnx``, optional in a bundle) with the ramp
  (default bundle ``[vocoder] ramp``): each chunk feeds only its new frames plus the carried
  ``state.*`` (all zero for the first chunk, then the previous chunk's ``next.*``). The states
  (names, dtypes, shapes) are read from the bundle's ``[graphs.<stream_graph>]`` inputs. Equal
  to one single pass (``Reference.vocode_once``) up to float rounding, for any ramp.

The command line uses the stateful scheme when the bundle has a ``stream_graph`` and the windowed
one otherwise (``--vocoder`` chooses). WAV files are 16-bit PCM mono at the bundle's sample rate:
``s = round_half_away_from_zero(float64(clamp(x, -1, 1)) * 32767)``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tomllib
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from herald_export.checkpoint import LMSpec  # noqa: E402
from herald_export.host import StackCache, step  # noqa: E402
from herald_export.onnx_graph import NAME_TO_NP  # noqa: E402

#: Frame cap contract (module docstring §5): base frames and frames per text token.
CAP_BASE_FRAMES = 40
CAP_FRAMES_PER_TEXT_TOKEN = 10

#: The number of ids at the top of the talker vocabulary that are never sampled (except eos).
SUPPRESSED_TOP_IDS = 1024

MODES = ("streaming", "non-streaming")
#: Vocoding schemes of the command line (module docstring §6).
VOCODERS = ("stateful", "windowed")
MASK64 = (1 << 64) - 1


def frame_cap(n_text_tokens: int, max_new_tokens: int) -> int:
    """Most frames one generation may produce: ``min(max_new_tokens, 40 + 10 * n_text_tokens)``.

    The contract shared with the Rust engine against runaway generation (a model that never
    samples eos); n_text_tokens counts the tokens of the text itself (``ids[3:-5]``).
    """
    return min(int(max_new_tokens), CAP_BASE_FRAMES + CAP_FRAMES_PER_TEXT_TOKEN * int(n_text_tokens))


# ---------------------------------------------------------------------------------------------
# RNG and sampling (module docstring §4)
# ---------------------------------------------------------------------------------------------


class SplitMix64:
    """The SplitMix64 generator of the reference ``splitmix64.c`` (state = seed)."""

    def __init__(self, seed: int):
        seed = int(seed)
        if not 0 <= seed <= MASK64:
            raise ValueError(f"seed must be an integer in 0..2^64-1, got {seed}")
        self.state = seed

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """u = (next_u64() >> 11) * 2^-53, in [0, 1)."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def sample_from_logits(logits: np.ndarray, u: float) -> int:
    """The sampling rule: first id (ascending) whose cumulative probability exceeds u.

    ``logits`` are the processed float32 logits (-inf = removed). See module docstring §4.
    """
    kept = [int(i) for i in np.flatnonzero(np.isfinite(logits))]
    if not kept:
        raise ValueError("no candidate token left after the logits processors")
    values = [float(logits[i]) for i in kept]          # float32 -> float64, exactly
    m = max(values)
    weights = [math.exp(v - m) for v in values]
    total = 0.0
    for w in weights:                                  # ascending id order
        total += w
    cumulative = 0.0
    for i, w in zip(kept, weights):
        cumulative += w / total
        if cumulative > u:
            return i
    return kept[-1]


def greedy_choice(logits: np.ndarray) -> int:
    """argmax; the lowest id wins ties."""
    return int(np.argmax(logits))


# ---------------------------------------------------------------------------------------------
# Logits processors (module docstring §3). Each returns a new float32 array.
# ---------------------------------------------------------------------------------------------


def repetition_penalty(logits: np.ndarray, previous: list[int], penalty: float) -> np.ndarray:
    """HF RepetitionPenaltyLogitsProcessor over the distinct previous tokens."""
    out = np.array(logits, dtype=np.float32, copy=True)
    p = np.float32(penalty)
    for t in sorted(set(int(t) for t in previous)):
        x = out[t]
        out[t] = x / p if x > 0 else x * p
    return out


def block_eos(logits: np.ndarray, eos: int, n_generated: int, min_new_tokens: int) -> np.ndarray:
    """HF MinNewTokensLengthLogitsProcessor: eos = -inf while n_generated < min_new_tokens."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if n_generated < min_new_tokens:
        out[eos] = -np.inf
    return out


def suppress_specials(logits: np.ndarray, eos: int) -> np.ndarray:
    """Upstream suppress_tokens: ids [vocab-1024, vocab) except eos = -inf (generate L2059)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    vocab = out.shape[0]
    for t in range(vocab - SUPPRESSED_TOP_IDS, vocab):
        if t != eos:
            out[t] = -np.inf
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """HF TemperatureLogitsWarper: logits / temperature (float32)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return (np.asarray(logits, dtype=np.float32) / np.float32(temperature)).astype(np.float32)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """HF TopKLogitsWarper: values below the k-th largest become -inf (ties with it stay).

    k <= 0 or k >= vocab: no filtering.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if k <= 0 or k >= out.shape[0]:
        return out
    kth = np.sort(out)[-k]
    out[out < kth] = -np.inf
    return out


#: Longest text one request may carry, in characters (shared with engine::prompt::MAX_TEXT_CHARS).
MAX_TEXT_CHARS = 20_000
#: Characters that print nothing and are not whitespace (engine::prompt::INVISIBLE): zero-width
#: space/joiners, word joiner, BOM. A text of only these and whitespace has nothing to say.
INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"


def clean_text(text: str) -> str:
    """Input cleaning shared with the Rust engine (``engine::prompt::clean_text``).

    ``\r\n`` and a lone ``\r`` become ``\n``; every other C0 control except ``\t`` and ``\n``,
    DEL and the C1 controls (U+0080-U+009F) become a space. Everything else is kept.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "".join(" " if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F else c for c in text)


def top_p_filter(logits: np.ndarray, top_p: float) -> np.ndarray:
    """HF TopPLogitsWarper (nucleus): keep ids while the mass before them is < top_p.

    Probabilities are a float64 softmax of the finite logits; order = descending probability,
    ties by ascending id. top_p >= 1: no filtering (HF does not add the warper then).
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    top_p = float(np.float32(top_p))  # parameters are float32, as on the Rust side
    if top_p >= 1.0:
        return out
    kept = [int(i) for i in np.flatnonzero(np.isfinite(out))]
    m = max(float(out[i]) for i in kept)
    weights = {i: math.exp(float(out[i]) - m) for i in kept}
    total = 0.0
    for i in kept:
        total += weights[i]
    order = sorted(kept, key=lambda i: (-weights[i], i))
    mass_before = 0.0
    for i in order:
        if mass_before >= top_p:
            out[i] = -np.inf
        mass_before += weights[i] / total
    return out


def talker_processors(logits: np.ndarray, previous_c0: list[int], s: dict, eos: int, sampling: bool) -> np.ndarray:
    """The talker's chain: penalty, eos block, suppression, then (sampling only) temperature, top-k, top-p.

    ``s`` is the bundle's ``[sampling.talker]`` table; len(previous_c0) = frames produced so far.
    """
    x = repetition_penalty(logits, previous_c0, s["repetition_penalty"])
    x = block_eos(x, eos, len(previous_c0), s["min_new_tokens"])
    x = suppress_specials(x, eos)
    if sampling:
        x = apply_temperature(x, s["temperature"])
        x = top_k_filter(x, s["top_k"])
        x = top_p_filter(x, s["top_p"])
    return x


def predictor_processors(logits: np.ndarray, s: dict, sampling: bool) -> np.ndarray:
    """The code predictor's chain (no penalty, no suppression): temperature, top-k, top-p when sampling."""
    x = np.asarray(logits, dtype=np.float32)
    if sampling:
        x = apply_temperature(x, s["temperature"])
        x = top_k_filter(x, s["top_k"])
        x = top_p_filter(x, s["top_p"])
    return x


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


@dataclass
class PromptLayout:
    """The prompt as ids: ``rows[i] = (text_id, codec_id or None)``, ``trailing`` = text ids."""

    rows: list[tuple[int, int | None]]
    trailing: list[int]
    text_ids: list[int]            # ids[3:-5], the text's own tokens
    language_id: int | None        # codec id of the language (after the dialect override)
    speaker_id: int | None


@dataclass
class Generation:
    """Result of :meth:`Reference.generate`.

    codes int64 [frames, 16]; stop is "eos", "forced" (force_eos_at) or "cap"; cap is the
    frame limit used; cap_hit is True when generation was cut at the cap.
    With ``record=True``: talker_logits [n, vocab] float32 (raw logits that chose c0 of frames
    0..n-1, the last one possibly the eos decision), talker_inputs [m, H] (decode-step inputs,
    m = number of talker decode steps run) and prefill [L, H].
    """

    codes: np.ndarray
    stop: str
    cap: int
    cap_hit: bool
    n_text_tokens: int
    prefill_len: int
    talker_logits: np.ndarray | None = None
    talker_inputs: np.ndarray | None = None
    prefill: np.ndarray | None = None

    @property
    def frames(self) -> int:
        return int(self.codes.shape[0])


def _lm_spec(name: str, sec: dict) -> LMSpec:
    """An LMSpec (what StackCache needs) from a bundle.toml [talker] / [code_predictor] table."""
    kinds = [("full", None) if c["kind"] == "full" else ("sliding", int(c["window"])) for c in sec["cache"]]
    return LMSpec(name=name, prefix="", hidden=sec["hidden"], layers=sec["layers"], heads=sec["heads"],
                  kv_heads=sec["kv_heads"], head_dim=sec["head_dim"], intermediate=sec["intermediate"],
                  eps=sec["rms_norm_eps"], rope_theta=sec["rope_theta"], max_positions=sec["max_positions"],
                  layer_kinds=kinds)


def _session_cache_dtype(sess):
    """The dtype of an onnxruntime session's ``k_cache_0`` input (float32 when it has none)."""
    for i in sess.get_inputs():
        if i.name == "k_cache_0":
            return np.float16 if i.type == "tensor(float16)" else np.float32
    return np.float32


def _cache_dtype(manifest: dict, graph: str):
    for inp in manifest["graphs"][graph]["inputs"]:
        if inp["name"] == "k_cache_0":
            return NAME_TO_NP[inp["dtype"]]
    return np.float32


class Reference:
    """A loaded bundle: onnxruntime sessions, host tables, tokenizer, manifest."""

    def __init__(self, bundle_dir: str | Path, threads: int | None = None, q4_float_activations: bool = False):
        """``q4_float_activations``: run q4 ``MatMulNBits`` with ``accuracy_level`` 0 (float32
        activations) whatever the graph says, to compare with a runtime that computes them so."""
        import onnxruntime as ort
        from safetensors import safe_open
        from tokenizers import Tokenizer

        self.dir = Path(bundle_dir)
        with open(self.dir / "bundle.toml", "rb") as f:
            self.manifest = m = tomllib.load(f)
        self.text_ids = m["text"]
        self.codec_ids = m["codec"]
        self.languages = {k.lower(): int(v) for k, v in m.get("languages", {}).items()}
        self.speakers = {k.lower(): int(v) for k, v in m.get("speakers", {}).items()}
        self.speaker_dialects = {k.lower(): v for k, v in m.get("speaker_dialects", {}).items()}
        self.talker_sampling = m["sampling"]["talker"]
        self.predictor_sampling = m["sampling"]["code_predictor"]
        self.sample_rate = int(m["audio"]["sample_rate"])
        self.samples_per_frame = int(m["audio"]["samples_per_frame"])
        self.num_codebooks = int(m["audio"]["num_codebooks"])
        voc = m.get("vocoder", {})
        self.default_ramp = list(voc.get("ramp", [2, 4, 8, 16, 25]))
        self.default_left_context = int(voc.get("left_context_frames", voc.get("sliding_window", 72)))
        #: Key into ``graphs`` of the stateful vocoder, or None when the bundle only has the windowed one.
        self.stream_graph: str | None = voc.get("stream_graph")
        self._vocoder_stream = None

        self.talker_spec = _lm_spec("talker", m["talker"])
        self.predictor_spec = _lm_spec("code_predictor", m["code_predictor"])
        self.talker_cache_dtype = _cache_dtype(m, m["talker"]["graph"])
        self.predictor_cache_dtype = _cache_dtype(m, m["code_predictor"]["graph"])

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1

        def session(graph: str):
            path = self.dir / m["graphs"][graph]["file"]
            if q4_float_activations and m["graphs"][graph].get("weights") == "q4":
                import onnx

                proto = onnx.load(str(path))
                for node in proto.graph.node:
                    if node.op_type == "MatMulNBits":
                        for a in node.attribute:
                            if a.name == "accuracy_level":
                                a.i = 0
                return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

        self._session = session
        self._ort_options = opts
        self.talker = session(m["talker"]["graph"])
        self.predictor = session(m["code_predictor"]["graph"])
        self._vocoder = None

        tables = m["tables"]
        self._tables = safe_open(str(self.dir / tables["file"]), framework="numpy")
        self._text_table = self._tables.get_slice(tables["text_embedding"]["name"])   # large: read rows lazily
        self.codec_table = self._tables.get_tensor(tables["codec_embedding"]["name"]).astype(np.float32)
        self.cp_table = self._tables.get_tensor(tables["cp_embedding"]["name"]).astype(np.float32)

        self.tokenizer = Tokenizer.from_file(str(self.dir / m["tokenizer"]["file"]))
        self.assistant_id = int(self.text_ids.get("assistant", self.tokenizer.token_to_id("assistant")))
        self.newline_id = self.tokenizer.encode("\n", add_special_tokens=False).ids[0]

    @property
    def vocoder(self):
        """The onnxruntime session of the ``[vocoder] graph`` (opened on first use)."""
        if self._vocoder is None:
            self._vocoder = self._session(self.manifest["vocoder"]["graph"])
        return self._vocoder

    def with_step_graphs(self, talker: str | Path, code_predictor: str | Path) -> "Reference":
        """A copy of this decoder that runs other talker / code-predictor graph files.

        Same manifest, tables, tokenizer and vocoder; the graphs must have this bundle's IO (their
        cache dtype is read from the files). The quantization gate (``herald_export.gate``) decodes
        with the float graphs of the same checkpoint this way.
        """
        import copy

        import onnxruntime as ort

        other = copy.copy(self)
        other.talker, other.predictor = (
            ort.InferenceSession(str(p), self._ort_options, providers=["CPUExecutionProvider"])
            for p in (talker, code_predictor))
        other.talker_cache_dtype, other.predictor_cache_dtype = (
            _session_cache_dtype(s) for s in (other.talker, other.predictor))
        return other

    # ------------------------------------------------------------------ embeddings
    def T(self, text_id: int) -> np.ndarray:
        """Projected text embedding [H] float32."""
        return np.asarray(self._text_table[int(text_id) : int(text_id) + 1][0], dtype=np.float32)

    def C(self, codec_id: int) -> np.ndarray:
        """Talker codec embedding [H] float32."""
        return self.codec_table[int(codec_id)]

    def E(self, k: int, code: int) -> np.ndarray:
        """Code-predictor embedding of codebook k (1..15) [H] float32."""
        return self.cp_table[k - 1][int(code)]

    # ------------------------------------------------------------------ prompt
    def chat_ids(self, text: str) -> tuple[list[int], list[int]]:
        """(role ids, text ids): the chat-wrapped text tokenized and sliced as upstream does.

        ``ids[:3]`` is the role prefix, ``ids[3:-5]`` the text, ``ids[-5:]`` the closing tokens
        (generate L2175-2233 slice by these fixed counts). Raises ValueError for an empty text or
        one without tokens of its own (e.g. a lone "\\n", which merges into the role's newline).
        """
        if not text:
            raise ValueError("text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"text is {len(text)} characters long; the limit is {MAX_TEXT_CHARS} characters (split it)")
        text = clean_text(text)
        if all(c.isspace() or c in INVISIBLE for c in text):
            raise ValueError("text has nothing to say (only whitespace or control characters)")
        wrapped = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
        ids = self.tokenizer.encode(wrapped, add_special_tokens=False).ids
        t, nl, asst = self.text_ids, self.newline_id, self.assistant_id
        closing = [t["im_end"], nl, t["im_start"], asst, nl]
        if ids[:2] != [t["im_start"], asst] or ids[-5:] != closing:
            raise RuntimeError(f"tokenizer does not keep the chat markers atomic: {ids[:3]} ... {ids[-5:]}")
        if len(ids) <= 8:
            raise ValueError(f"text {text!r} has no tokens of its own")
        return ids[:3], ids[3:-5]

    def tokenize(self, text: str) -> list[int]:
        """The text's own token ids (``ids[3:-5]`` of the chat wrapping)."""
        return self.chat_ids(text)[1]

    def prompt_layout(self, text: str, language: str = "auto", speaker: str | None = None,
                      mode: str = "streaming") -> PromptLayout:
        """The prompt as (text id, codec id) rows plus the trailing text ids (module docstring §1)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
        lang = (language or "auto").lower()
        if lang != "auto" and lang not in self.languages:
            raise ValueError(f"unknown language {language!r}; allowed: auto, {', '.join(sorted(self.languages))}")
        spk = speaker.lower() if speaker else None
        if spk is not None and spk not in self.speakers:
            allowed = ", ".join(sorted(self.speakers)) or "none (this bundle has no speakers)"
            raise ValueError(f"unknown speaker {speaker!r}; allowed: {allowed}")
        role_ids, text_ids = self.chat_ids(text)
        t, c = self.text_ids, self.codec_ids

        language_id = None if lang == "auto" else self.languages[lang]
        if spk is not None and lang in ("chinese", "auto") and spk in self.speaker_dialects:
            language_id = self.languages[self.speaker_dialects[spk]]          # dialect override
        if language_id is None:
            codec = [c["nothink"], c["think_bos"], c["think_eos"]]
        else:
            codec = [c["think"], c["think_bos"], language_id, c["think_eos"]]
        speaker_id = self.speakers[spk] if spk is not None else None
        if speaker_id is not None:
            codec.append(speaker_id)
        codec += [c["pad"], c["bos"]]

        rows: list[tuple[int, int | None]] = [(r, None) for r in role_ids]
        before_bos = codec[:-1]
        for i, cid in enumerate(before_bos):
            rows.append((t["tts_bos"] if i == len(before_bos) - 1 else t["tts_pad"], cid))
        if mode == "streaming":
            rows.append((text_ids[0], c["bos"]))
            trailing = text_ids[1:] + [t["tts_eos"]]
        else:
            for tid in text_ids + [t["tts_eos"]]:
                rows.append((tid, c["pad"]))
            rows.append((t["tts_pad"], c["bos"]))
            trailing = [t["tts_pad"]]
        return PromptLayout(rows, trailing, text_ids, language_id, speaker_id)

    def embed_layout(self, layout: PromptLayout) -> tuple[np.ndarray, np.ndarray]:
        """(prefill [L, H], trailing [N, H]) float32 from a layout."""
        prefill = []
        for tid, cid in layout.rows:
            row = self.T(tid)
            if cid is not None:
                row = row + self.C(cid)
            prefill.append(row)
        trailing = [self.T(tid) for tid in layout.trailing]
        return np.stack(prefill).astype(np.float32), np.stack(trailing).astype(np.float32)

    def prompt(self, text: str, language: str = "auto", speaker: str | None = None,
               mode: str = "streaming") -> tuple[np.ndarray, np.ndarray]:
        """(prefill_embeds [L, H], trailing [N, H]) float32."""
        return self.embed_layout(self.prompt_layout(text, language, speaker, mode))

    # ------------------------------------------------------------------ generation
    def _choose(self, processed: np.ndarray, sampling: bool, rng: SplitMix64 | None) -> int:
        if sampling:
            return sample_from_logits(processed, rng.uniform())
        return greedy_choice(processed)

    def predict_residual_codes(self, hidden: np.ndarray, c0: int, sampling: bool,
                               rng: SplitMix64 | None, forced: list[int] | None = None,
                               logits_out: list | None = None) -> list[int]:
        """c1..c15 for one frame: fresh cache, 2-position prefill, then 14 one-position steps.

        Teacher forcing (the quantization gate): with ``forced`` = [c1..c15] those codes are
        fed instead of the chosen ones (and returned; nothing is drawn). ``logits_out`` receives
        the raw float32 logits [2048] of each sub-step, codebook 1 first.
        """
        s = self.predictor_sampling
        cache = StackCache(self.predictor_spec, dtype=self.predictor_cache_dtype)

        def choose(logits: np.ndarray, k: int) -> int:
            if logits_out is not None:
                logits_out.append(np.array(logits, np.float32))
            if forced is not None:
                return int(forced[k - 1])
            return self._choose(predictor_processors(logits, s, sampling), sampling, rng)

        x = np.stack([hidden, self.C(c0)]).astype(np.float32)             # [2, H]
        out = step(self.predictor, cache, x, {"head": np.array([0], np.int64)})
        codes = [choose(out["logits"][0, -1], 1)]
        for k in range(2, self.num_codebooks):
            x = self.E(k - 1, codes[-1])[None]                             # [1, H]
            out = step(self.predictor, cache, x, {"head": np.array([k - 1], np.int64)})
            codes.append(choose(out["logits"][0, -1], k))
        return codes

    def next_talker_input(self, frame: list[int], trailing: np.ndarray, f: int) -> np.ndarray:
        """C(c0) + E_1(c1) + ... + E_15(c15) + (trailing[f] or T(tts_pad)), float32, left to right."""
        x = self.C(frame[0]).copy()
        for k in range(1, self.num_codebooks):
            x = x + self.E(k, frame[k])
        text = trailing[f] if f < trailing.shape[0] else self.T(self.text_ids["tts_pad"])
        return (x + text).astype(np.float32)

    def generate(self, text: str, language: str = "auto", speaker: str | None = None,
                 mode: str = "streaming", greedy: bool = True, seed: int | None = None,
                 max_frames: int | None = None, force_eos_at: int | None = None,
                 record: bool = False) -> Generation:
        """Generate the frames of ``text``. Sampling needs ``greedy=False`` and a ``seed``.

        Raises ValueError for an empty text, an unknown language/speaker/mode, or sampling
        without a seed.
        """
        if not greedy and seed is None:
            raise ValueError("sampling needs a seed (or greedy=True)")
        rng = None if greedy else SplitMix64(seed)
        talker_sampling = (not greedy) and bool(self.talker_sampling["do_sample"])
        predictor_sampling = (not greedy) and bool(self.predictor_sampling["do_sample"])
        eos = int(self.codec_ids["eos"])

        layout = self.prompt_layout(text, language, speaker, mode)
        prefill, trailing = self.embed_layout(layout)
        n_text = len(layout.text_ids)
        cap = frame_cap(n_text, self.talker_sampling["max_new_tokens"]) if max_frames is None else int(max_frames)

        cache = StackCache(self.talker_spec, dtype=self.talker_cache_dtype)
        out = step(self.talker, cache, prefill)
        logits, hidden = out["logits"][0, -1], out["hidden"][0, -1]
        rec_logits, rec_inputs = [], []

        frames: list[list[int]] = []
        stop = "cap"
        while len(frames) < cap:
            f = len(frames)
            if record:
                rec_logits.append(np.array(logits, np.float32))
            if force_eos_at is not None and f == force_eos_at:
                stop = "forced"
                break
            previous_c0 = [fr[0] for fr in frames]
            processed = talker_processors(logits, previous_c0, self.talker_sampling, eos, talker_sampling)
            c0 = self._choose(processed, talker_sampling, rng)
            if c0 == eos:
                stop = "eos"
                break
            frame = [c0] + self.predict_residual_codes(hidden, c0, predictor_sampling, rng)
            frames.append(frame)
            if len(frames) == cap:
                break                                   # no talker step for a frame never produced
            x = self.next_talker_input(frame, trailing, f)
            if record:
                rec_inputs.append(x)
            out = step(self.talker, cache, x[None])
            logits, hidden = out["logits"][0, -1], out["hidden"][0, -1]

        cap_hit = stop == "cap"
        if cap_hit:
            rule = "max_frames" if max_frames is not None else "min(max_new_tokens, 40 + 10 * text tokens)"
            print(f"warning: frame cap hit: stopped after {cap} frames without eos "
                  f"({n_text} text tokens; cap = {rule})", file=sys.stderr)
        codes = np.array(frames, dtype=np.int64).reshape(-1, self.num_codebooks)
        H = prefill.shape[1]
        return Generation(
            codes=codes, stop=stop, cap=cap, cap_hit=cap_hit, n_text_tokens=n_text, prefill_len=prefill.shape[0],
            talker_logits=np.array(rec_logits, np.float32).reshape(-1, logits.shape[0]) if record else None,
            talker_inputs=np.array(rec_inputs, np.float32).reshape(-1, H) if record else None,
            prefill=prefill if record else None,
        )

    # ------------------------------------------------------------------ vocoding
    def vocode_once(self, codes: np.ndarray) -> np.ndarray:
        """One vocoder pass over codes [F, 16] -> float32 [F * samples_per_frame]."""
        c = np.ascontiguousarray(np.asarray(codes, dtype=np.int64).T[None])
        return self.vocoder.run(["wav"], {"codes": c})[0].reshape(-1).astype(np.float32)

    def vocode(self, codes: np.ndarray, ramp: list[int] | None = None, left_context: int | None = None) -> np.ndarray:
        """Windowed vocoding of codes [F, 16] -> float32 [F * samples_per_frame] in [-1, 1]."""
        from herald_export.vocoder import decode_windowed

        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.num_codebooks)
        ramp = self.default_ramp if ramp is None else list(ramp)
        left_context = self.default_left_context if left_context is None else int(left_context)

        def run(window: np.ndarray) -> np.ndarray:
            return self.vocoder.run(["wav"], {"codes": np.ascontiguousarray(window, dtype=np.int64)})[0]

        wav = decode_windowed(run, codes.T[None], ramp, left_context, self.samples_per_frame)
        if wav.shape[0] != codes.shape[0] * self.samples_per_frame:
            raise RuntimeError(f"vocoder gave {wav.shape[0]} samples for {codes.shape[0]} frames")
        return wav

    @property
    def vocoder_stream(self):
        """The onnxruntime session of the ``[vocoder] stream_graph`` (opened on first use).

        Raises ValueError when the bundle has no stream graph.
        """
        if self.stream_graph is None:
            raise ValueError(f"{self.dir}: the bundle has no [vocoder] stream_graph (only the windowed vocoder)")
        if self._vocoder_stream is None:
            self._vocoder_stream = self._session(self.stream_graph)
        return self._vocoder_stream

    def stream_states(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        """The carried states of the stream graph from the manifest: (name without ``state.``, dtype, shape).

        Read from ``[graphs.<stream_graph>].inputs`` (every input after ``codes``), in graph order.
        Raises ValueError when the bundle has no stream graph, RuntimeError when the manifest's
        inputs are not ``codes`` then ``state.*`` with fixed shapes, or disagree with the graph file.
        """
        sess = self.vocoder_stream
        ins = self.manifest["graphs"][self.stream_graph]["inputs"]
        if [i.name for i in sess.get_inputs()] != [i["name"] for i in ins]:
            raise RuntimeError(f"{self.stream_graph}: the manifest's inputs differ from the graph file's")
        if not ins or ins[0]["name"] != "codes":
            raise RuntimeError(f"{self.stream_graph}: the first input is not codes")
        states = []
        for i in ins[1:]:
            if not i["name"].startswith("state.") or not all(isinstance(d, int) for d in i["shape"]):
                raise RuntimeError(f"{self.stream_graph}: input {i['name']} is not a state.* of fixed shape")
            states.append((i["name"][len("state."):], np.dtype(NAME_TO_NP[i["dtype"]]), tuple(i["shape"])))
        return states

    def vocode_stateful(self, codes: np.ndarray, ramp: list[int] | None = None) -> np.ndarray:
        """Stateful vocoding of codes [F, 16] -> float32 [F * samples_per_frame] in [-1, 1].

        Chunks of ``ramp`` frames (default: the bundle's ``[vocoder] ramp``; the last entry
        repeats) go through the stream graph, each with the state the previous chunk returned
        (zeros for the first). Raises ValueError when the bundle has no stream graph or the ramp
        is empty or not positive.
        """
        from herald_export.vocoder import decode_stateful

        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.num_codebooks)
        ramp = self.default_ramp if ramp is None else list(ramp)
        sess = self.vocoder_stream
        states = self.stream_states()
        names = [o.name for o in sess.get_outputs()]

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return dict(zip(names, sess.run(None, feeds)))

        wav = decode_stateful(run, states, codes.T[None], ramp, self.samples_per_frame)
        if wav.shape[0] != codes.shape[0] * self.samples_per_frame:
            raise RuntimeError(f"vocoder gave {wav.shape[0]} samples for {codes.shape[0]} frames")
        return wav


def pcm16(wav: np.ndarray) -> np.ndarray:
    """float32 -> int16: x clamped to [-1, 1], then float64(x) * 32767 rounded half away from zero."""
    y = np.clip(np.asarray(wav, dtype=np.float32).astype(np.float64), -1.0, 1.0) * 32767.0
    return np.trunc(y + np.copysign(0.5, y)).astype(np.int16)


def write_wav(path: str | Path, wav: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM mono WAV (stdlib ``wave``)."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm16(wav).astype("<i2").tobytes())


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _ramp(s: str) -> list[int]:
    try:
        r = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ramp must be comma-separated frame counts, got {s!r}") from None
    if not r or any(v < 1 for v in r):
        raise argparse.ArgumentTypeError(f"ramp must be positive frame counts, got {s!r}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="reference.py", description="herald reference decoder (onnxruntime)")
    ap.add_argument("--bundle", required=True, type=Path, help="herald bundle directory")
    ap.add_argument("--text", required=True, help="text to speak")
    ap.add_argument("--language", default="auto", help="auto (default) or a language of the bundle's [languages]")
    ap.add_argument("--speaker", default=None, help="a speaker of the bundle's [speakers] (default none)")
    ap.add_argument("--mode", choices=MODES, default="streaming",
                    help="streaming text (upstream non_streaming_mode=False, default) or non-streaming")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--greedy", action="store_true", help="argmax decoding (the default without --seed)")
    g.add_argument("--seed", type=int, help="sample with SplitMix64 seeded with N")
    ap.add_argument("--max-frames", type=int, help="frame limit (overrides the text-length cap)")
    ap.add_argument("--force-eos-at", type=int, help="test hook: force eos at frame N (N frames are produced)")
    ap.add_argument("--vocoder", choices=VOCODERS,
                    help="stateful (the bundle's [vocoder] stream_graph; the default when it has one) or windowed")
    ap.add_argument("--ramp", type=_ramp, help="vocoder chunk ramp, e.g. 2,4,8,16,25 (default: bundle)")
    ap.add_argument("--left-context", type=int, help="windowed vocoder left context frames (default: bundle)")
    ap.add_argument("--codes-out", type=Path, help="write codes int64 [frames, 16] as .npy")
    ap.add_argument("--wav-out", type=Path, help="write 16-bit PCM mono WAV")
    ap.add_argument("--wav-npy", type=Path, help="write the float32 waveform as .npy")
    args = ap.parse_args(argv)

    try:
        if args.max_frames is not None and args.max_frames < 0:
            raise ValueError(f"--max-frames must be >= 0, got {args.max_frames}")
        if args.force_eos_at is not None and args.force_eos_at < 0:
            raise ValueError(f"--force-eos-at must be >= 0, got {args.force_eos_at}")
        if args.left_context is not None and args.left_context < 0:
            raise ValueError(f"--left-context must be >= 0, got {args.left_context}")
        if not (args.bundle / "bundle.toml").is_file():
            raise ValueError(f"{args.bundle}: not a herald bundle (no bundle.toml)")
        ref = Reference(args.bundle)
        vocoder = args.vocoder or ("stateful" if ref.stream_graph else "windowed")
        if vocoder == "stateful" and ref.stream_graph is None:
            raise ValueError(f"{args.bundle}: --vocoder stateful needs a bundle with a [vocoder] stream_graph")
        if vocoder == "stateful" and args.left_context is not None:
            raise ValueError("--left-context applies to the windowed vocoder only (add --vocoder windowed)")
        gen = ref.generate(args.text, args.language, args.speaker, args.mode, greedy=args.seed is None,
                           seed=args.seed, max_frames=args.max_frames, force_eos_at=args.force_eos_at)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{gen.frames} frames ({gen.frames * 0.08:.2f} s), stop: {gen.stop}, cap {gen.cap}, "
          f"{gen.n_text_tokens} text tokens, prefill {gen.prefill_len}", file=sys.stderr)
    if args.codes_out:
        np.save(args.codes_out, gen.codes)
    if args.wav_out or args.wav_npy:
        if vocoder == "stateful":
            wav = ref.vocode_stateful(gen.codes, args.ramp)
        else:
            wav = ref.vocode(gen.codes, args.ramp, args.left_context)
        if args.wav_out:
            write_wav(args.wav_out, wav, ref.sample_rate)
        if args.wav_npy:
            np.save(args.wav_npy, wav)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Random checkpoints at the real Qwen3-TTS 12 Hz dimensions, for benchmarks.

``export --preset qwen3-tts-0.6b --random`` writes a checkpoint in the exact official layout
(the same writer as the tiny presets: config keys, tensor names, bf16 ``model.safetensors``,
fp32 ``speech_tokenizer/``, the real Qwen BPE) with the shipped dimensions
(``shared/reference/qwen3-tts.md`` §1.1, §1.2, §3.1) and random weights, then exports it through
the same code path as a real checkpoint. Speed does not depend on the weight values (dense
float kernels), so such a bundle measures what a real one would, without downloading one.

Weights are generated and written one tensor at a time (the 0.6B checkpoint is 1.8 GB of
bf16, the 1.7B one 3.8 GB), so the writer holds at most one tensor in memory. Scales keep
activations finite: linear weights N(0, 1/fan_in), norms ~1, embeddings N(0, 1) (as
:func:`herald_export.tiny._random_lm_tensors`).

``scale`` divides every width (hidden, heads, intermediate, vocoder channels) for tests: the
structure (layer counts, GQA ratio, vocabularies, codebooks, hop) stays the real one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .checkpoint import expected_lm_tensors
from .st_io import to_bf16_bits
from .tiny import GENERATION_CONFIG, _spec_for_shapes, tiny_config

#: Official dimensions (qwen3-tts.md §1.1 talker, §1.2 code predictor; 28 / 5 layers).
PRESETS: dict[str, dict] = {
    "qwen3-tts-0.6b": dict(
        size="0b6",
        talker=dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072),
        predictor=dict(hidden=1024, layers=5, heads=16, kv=8, head_dim=128, inter=3072),
    ),
    "qwen3-tts-1.7b": dict(
        size="1b7",
        talker=dict(hidden=2048, layers=28, heads=16, kv=8, head_dim=128, inter=6144),
        predictor=dict(hidden=1024, layers=5, heads=16, kv=8, head_dim=128, inter=3072),
    ),
}
#: text_hidden_size of both sizes (qwen3-tts.md §1.1).
TEXT_HIDDEN = 2048
#: speech_tokenizer decoder_config (qwen3-tts.md §3.1).
VOCODER = dict(latent_dim=1024, codebook_dim=512, decoder_dim=1536, hidden_size=512, intermediate_size=1024,
               num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
               vector_quantization_hidden_dimension=512)


def _scaled(d: dict, scale: int) -> dict:
    """Widths divided by ``scale`` (head counts too; head_dim kept even for rotate-half RoPE)."""
    if scale == 1:
        return dict(d)
    out = dict(d)
    for k in ("hidden", "inter"):
        out[k] = max(4, d[k] // scale)
    out["heads"] = max(2, d["heads"] // scale)
    out["kv"] = max(1, d["kv"] // scale)
    out["head_dim"] = max(4, d["head_dim"] // scale)
    return out


def preset_config(preset: str, scale: int = 1) -> dict:
    """``config.json`` of ``preset`` in the official key layout (widths divided by ``scale``)."""
    if preset not in PRESETS:
        raise KeyError(preset)
    p = PRESETS[preset]
    t, c = _scaled(p["talker"], scale), _scaled(p["predictor"], scale)
    cfg = tiny_config("tiny-0.6b")  # the official layout; dimensions replaced below
    cfg["tts_model_size"] = p["size"]
    tc = cfg["talker_config"]
    text_hidden = max(4, TEXT_HIDDEN // scale)

    def dims(dst: dict, d: dict) -> None:
        dst.update(hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                   num_attention_heads=d["heads"], num_key_value_heads=d["kv"], head_dim=d["head_dim"])

    dims(tc, t)
    dims(tc["code_predictor_config"], c)
    tc["code_predictor_config"]["layer_types"] = ["full_attention"] * c["layers"]
    tc["text_hidden_size"] = text_hidden
    # official mrope sections (sum = head_dim / 2); irrelevant numerically (plain RoPE, §1.1)
    half = t["head_dim"] // 2
    tc["rope_scaling"]["mrope_section"] = [half - 2 * (half * 20 // 64), half * 20 // 64, half * 20 // 64]
    cfg["speaker_encoder_config"]["enc_dim"] = t["hidden"]
    return cfg


def speech_tokenizer_config(scale: int = 1) -> dict:
    """``speech_tokenizer/config.json`` with the shipped decoder dimensions (widths / ``scale``)."""
    from .vocoder import tiny_speech_tokenizer_config

    raw = tiny_speech_tokenizer_config()
    dec = raw["decoder_config"]
    for k, v in VOCODER.items():
        dec[k] = v if k in ("num_hidden_layers",) or scale == 1 else max(4, v // scale)
    if scale != 1:
        dec["num_attention_heads"] = dec["num_key_value_heads"] = max(2, VOCODER["num_attention_heads"] // scale)
        dec["head_dim"] = max(4, VOCODER["head_dim"] // scale)
        dec["decoder_dim"] = max(16, (VOCODER["decoder_dim"] // scale) // 16 * 16)  # four halvings
    return raw




def graph_weight_bytes(preset: str, dtype: str, scale: int = 1) -> dict[str, int]:
    """Weight bytes of the talker and code-predictor step graphs of ``preset`` in ``dtype``."""
    s = lm_tensor_shapes(preset, scale)
    width = 2 if dtype == "fp16" else 4

    def total(pred) -> int:
        return sum(int(np.prod(v)) for k, v in s.items() if pred(k)) * width

    return {
        "talker": total(lambda k: k.startswith("talker.model.layers.") or k in ("talker.model.norm.weight", "talker.codec_head.weight")),
        "code_predictor": total(lambda k: k.startswith(("talker.code_predictor.model.layers.", "talker.code_predictor.lm_head.",
                                                        "talker.code_predictor.small_to_mtp")) or k == "talker.code_predictor.model.norm.weight"),
    }


def lm_tensor_shapes(preset: str, scale: int = 1) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``model.safetensors`` with its official (torch-layout) shape."""
    return expected_lm_tensors(_spec_for_shapes(preset_config(preset, scale), Path(".")))


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One random float32 tensor, scaled as the tiny presets' (activations stay O(1))."""
    if name.endswith("norm.weight"):
        a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif "embedding" in name:
        a = rng.standard_normal(shape, dtype=np.float32)
    elif name.endswith(".bias"):
        a = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        a = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(shape[-1]))
    return a


def write_streaming_bf16(path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    """Write a bf16 safetensors file of random tensors, generating and freeing one at a time.

    The header (sorted names, offsets from the shapes) is written first, then each tensor's
    bytes in the same order: the same layout as :func:`herald_export.st_io.write_safetensors`.
    """
    header: dict[str, object] = {}
    offset = 0
    names = sorted(shapes)
    for name in names:
        n = int(np.prod(shapes[name], dtype=np.int64)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for name in names:
            shape = shapes[name]
            if len(shape) == 2 and shape[0] > 16384:  # the text embedding: in row blocks
                for s in range(0, shape[0], 16384):
                    rows = min(16384, shape[0] - s)
                    f.write(to_bf16_bits(_random(name, (rows, shape[1]), rng)).tobytes())
            else:
                f.write(to_bf16_bits(_random(name, shape, rng)).tobytes())


def write_random_checkpoint(preset: str, seed: int, out: Path, scale: int = 1) -> Path:
    """Write a random checkpoint of ``preset`` (official layout and dimensions) into ``out``."""
    from . import tokenizer, vocoder
    from .checkpoint import load_spec

    if preset not in PRESETS:
        raise KeyError(preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = preset_config(preset, scale)
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2), encoding="utf-8")
    write_streaming_bf16(out / "model.safetensors", lm_tensor_shapes(preset, scale), rng)
    tokenizer.write_checkpoint_tokenizer(out)
    vocoder.write_tiny_speech_tokenizer(out, rng, config=speech_tokenizer_config(scale))
    load_spec(out)  # must pass the same validation as a real checkpoint
    return out

"""Tiny random Qwen3-TTS checkpoints in the exact official layout.

Same file names, tensor names, config keys and id layout as the official checkpoints (codec
vocabulary 3072 with pad/bos/eos/think ids at 2148.., 16 codebooks x 2048 codes, text vocabulary
151936 rows with the real Qwen BPE, hop 1920 from (8,5,4,3) x (2,2)); only the widths and depths
are small, so every test runs the real code path on real structure.

Presets
-------
``tiny-0.6b``   code-predictor hidden == talker hidden: no small_to_mtp_projection (as 0.6B).
``tiny-1.7b``   talker hidden != code-predictor hidden: projection present (as 1.7B).
``tiny-hybrid`` talker with sliding-window layers (window 8) between full ones: ring caches.
``tiny-q``      as tiny-0.6b but hidden 64 / head_dim 16 / intermediate 128, so every linear
                projection's input width K is a multiple of 32: q4 bundles keep tract's int4
                (Q4_0) weights instead of its float fallback (docs/bundle.md "Quantized bundles").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .checkpoint import LMSpec, ModelSpec, expected_lm_tensors
from .st_io import write_safetensors

#: Codec-side ids of the official checkpoints (qwen3-tts.md §1.3).
CODEC_IDS = {
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
}
LANGUAGES = {
    "english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058, "french": 2061,
    "sichuan_dialect": 2062, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071,
    "beijing_dialect": 2074,
}
SPEAKERS = {"serena": [3066], "vivian": [3065], "ryan": [3061], "eric": [2875], "dylan": [2878]}
DIALECTS = {"serena": False, "vivian": False, "ryan": False, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}

PRESETS = {
    "tiny-0.6b": dict(size="0b6", talker=dict(hidden=16, layers=2, heads=4, kv=2, head_dim=8, inter=48),
                      predictor=dict(hidden=16, layers=2, heads=4, kv=2, head_dim=8, inter=48)),
    "tiny-1.7b": dict(size="1b7", talker=dict(hidden=16, layers=2, heads=4, kv=2, head_dim=8, inter=48),
                      predictor=dict(hidden=8, layers=2, heads=2, kv=1, head_dim=8, inter=24)),
    "tiny-hybrid": dict(size="0b6", talker=dict(hidden=16, layers=4, heads=4, kv=2, head_dim=8, inter=48,
                                                window=8, types=["full_attention", "sliding_attention",
                                                                 "sliding_attention", "full_attention"]),
                        predictor=dict(hidden=16, layers=2, heads=4, kv=2, head_dim=8, inter=48)),
    "tiny-q": dict(size="0b6", talker=dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128),
                   predictor=dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128)),
}

TEXT_HIDDEN = 16
TEXT_VOCAB = 151936


def tiny_config(preset: str) -> dict:
    """config.json of a tiny preset, in the official key layout."""
    p = PRESETS[preset]
    t, c = p["talker"], p["predictor"]
    talker = {
        "model_type": "qwen3_tts_talker", "vocab_size": 3072, "hidden_size": t["hidden"],
        "intermediate_size": t["inter"], "num_hidden_layers": t["layers"], "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv"], "head_dim": t["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": "window" in t,
        "sliding_window": t.get("window"), "num_code_groups": 16, "text_hidden_size": TEXT_HIDDEN,
        "text_vocab_size": TEXT_VOCAB, "position_id_per_seconds": 13, "initializer_range": 0.02,
        **CODEC_IDS, "codec_language_id": LANGUAGES, "spk_id": SPEAKERS, "spk_is_dialect": DIALECTS,
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor", "vocab_size": 2048, "hidden_size": c["hidden"],
            "intermediate_size": c["inter"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv"], "head_dim": c["head_dim"], "hidden_act": "silu",
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * c["layers"], "num_code_groups": 16,
        },
    }
    if "types" in t:
        talker["layer_types"] = t["types"]
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": p["size"], "tts_model_type": "custom_voice",
        "im_start_token_id": 151644, "im_end_token_id": 151645, "tts_pad_token_id": 151671,
        "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "assistant_token_id": 77091,
        "speaker_encoder_config": {"enc_dim": t["hidden"], "sample_rate": 24000},
        "talker_config": talker, "transformers_version": "4.57.3",
    }


GENERATION_CONFIG = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
    "max_new_tokens": 8192, "transformers_version": "4.57.3",
}


def _random_lm_tensors(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random values that keep activations O(1): linear weights ~ N(0, 1/fan_in), norms ~ 1."""
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embedding" in name:
            a = rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out


def write_tiny_checkpoint(preset: str, seed: int, out: Path) -> Path:
    """Write a tiny random checkpoint of ``preset`` into directory ``out`` and return it.

    Files: config.json, generation_config.json, model.safetensors (talker.* in bfloat16, as
    shipped), vocab.json/merges.txt/tokenizer_config.json (the real Qwen BPE), and
    speech_tokenizer/{config.json, model.safetensors} (float32, as shipped).
    """
    from . import tokenizer, vocoder
    from .checkpoint import load_spec

    if preset not in PRESETS:
        raise KeyError(preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = tiny_config(preset)
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2), encoding="utf-8")
    spec_only = _spec_for_shapes(cfg, out)
    tensors = _random_lm_tensors(expected_lm_tensors(spec_only), rng)
    write_safetensors(out / "model.safetensors", tensors, bf16=set(tensors), metadata={"format": "pt"})
    tokenizer.write_checkpoint_tokenizer(out)
    vocoder.write_tiny_speech_tokenizer(out, rng)
    load_spec(out)  # the tiny checkpoint must pass the same validation as a real one
    return out


def _spec_for_shapes(cfg: dict, path: Path) -> ModelSpec:
    """A ModelSpec built from an in-memory config (shapes only; no file access)."""
    t, c = cfg["talker_config"], cfg["talker_config"]["code_predictor_config"]

    def lm(d, name, prefix):
        return LMSpec(name=name, prefix=prefix, hidden=d["hidden_size"], layers=d["num_hidden_layers"],
                      heads=d["num_attention_heads"], kv_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
                      intermediate=d["intermediate_size"], eps=d["rms_norm_eps"], rope_theta=d["rope_theta"],
                      max_positions=d["max_position_embeddings"], layer_kinds=[])

    tl, cl = lm(t, "talker", "talker.model."), lm(c, "code_predictor", "talker.code_predictor.model.")
    return ModelSpec(checkpoint=path, model_type=cfg["tts_model_type"], model_size=cfg["tts_model_size"], talker=tl,
                     predictor=cl, codec_vocab=t["vocab_size"], num_code_groups=t["num_code_groups"],
                     predictor_vocab=c["vocab_size"], text_vocab=t["text_vocab_size"],
                     text_hidden=t["text_hidden_size"], has_projection=tl.hidden != cl.hidden, text_ids={},
                     codec_ids={}, languages={}, speakers={}, speaker_dialects={})

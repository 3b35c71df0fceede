"""Reading an official Qwen3-TTS 12 Hz checkpoint (Hugging Face layout), strictly.

Layout (the official repositories ``Qwen/Qwen3-TTS-12Hz-{0.6B,1.7B}-{Base,CustomVoice,VoiceDesign}``)::

    config.json                    model_type "qwen3_tts", talker_config{..., code_predictor_config{...}}
    generation_config.json         sampling defaults (talker and "subtalker" = code predictor)
    model.safetensors              talker.* (bf16), speaker_encoder.* (Base only; not used by herald)
    vocab.json, merges.txt, tokenizer_config.json     Qwen2 byte-level BPE
    speech_tokenizer/config.json, speech_tokenizer/model.safetensors   the 12 Hz codec (vocoder)

Every value herald needs is read from these files; nothing about the model is assumed. Keys that
neither the official configuration classes nor Hugging Face's ``PretrainedConfig`` define are
rejected, so a checkpoint of another family fails loudly instead of exporting garbage.

Errors: :class:`herald_export.errors.ExportError` naming the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ExportError
from .st_io import SafetensorsFile

#: Keys every Hugging Face ``PretrainedConfig`` may carry (transformers' own serialisation).
HF_COMMON_KEYS = frozenset(
    """return_dict output_hidden_states output_attentions torchscript torch_dtype dtype use_bfloat16
    tf_legacy_loss pruned_heads tie_word_embeddings chunk_size_feed_forward is_encoder_decoder is_decoder
    cross_attention_hidden_size add_cross_attention tie_encoder_decoder max_length min_length do_sample
    early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
    num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    architectures finetuning_task id2label label2id tokenizer_class prefix bos_token_id pad_token_id
    eos_token_id sep_token_id decoder_start_token_id task_specific_params problem_type _name_or_path
    _attn_implementation_autoset _attn_implementation transformers_version model_type _commit_hash
    attn_implementation initializer_range use_cache""".split()
)

#: Top-level keys of ``Qwen3TTSConfig`` (configuration_qwen3_tts.py) plus ids the shipped files add.
TOP_KEYS = HF_COMMON_KEYS | {
    "talker_config", "speaker_encoder_config", "tokenizer_type", "tts_model_size", "tts_model_type",
    "im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id",
    "assistant_token_id", "sample_rate",
}

#: Keys shared by the talker and the code-predictor configs (Qwen3-style decoder).
_DECODER_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "attention_bias", "attention_dropout", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "num_code_groups",
}

TALKER_KEYS = HF_COMMON_KEYS | _DECODER_KEYS | {
    "code_predictor_config", "text_hidden_size", "text_vocab_size", "codec_eos_token_id", "codec_think_id",
    "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id", "codec_pad_id", "codec_bos_id", "spk_id",
    "spk_is_dialect", "codec_language_id", "position_id_per_seconds", "accept_hidden_layer",
}

PREDICTOR_KEYS = HF_COMMON_KEYS | _DECODER_KEYS

SPEAKER_ENCODER_KEYS = HF_COMMON_KEYS | {
    "mel_dim", "enc_dim", "enc_channels", "enc_kernel_sizes", "enc_dilations", "enc_attention_channels",
    "enc_res2net_scale", "enc_se_channels", "sample_rate",
}

GENERATION_KEYS = HF_COMMON_KEYS | {
    "max_new_tokens", "subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p",
    "min_new_tokens",
}

#: Hidden activations the graphs implement.
SUPPORTED_ACT = {"silu"}


def read_json(path: Path) -> dict:
    """Parse a JSON object from ``path``; missing or malformed files raise ExportError."""
    if not path.is_file():
        raise ExportError(path, "missing file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(path, f"cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ExportError(path, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ExportError(path, "expected a JSON object at the top level")
    return data


def check_keys(path: Path, where: str, cfg: dict, allowed: frozenset | set) -> None:
    """Reject keys outside ``allowed`` with a message naming the first unknown key."""
    unknown = sorted(k for k in cfg if k not in allowed)
    if unknown:
        raise ExportError(path, f"unknown config key {where}{unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))


def _req(path: Path, where: str, cfg: dict, key: str, typ=int):
    if key not in cfg:
        raise ExportError(path, f"missing config key {where}{key!r}")
    v = cfg[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ExportError(path, f"config key {where}{key!r} must be an integer, found {v!r}")
    if typ is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ExportError(path, f"config key {where}{key!r} must be a number, found {v!r}")
    if typ is dict and not isinstance(v, dict):
        raise ExportError(path, f"config key {where}{key!r} must be an object, found {type(v).__name__}")
    return float(v) if typ is float else v


@dataclass
class LMSpec:
    """One Qwen3-style decoder stack (the talker or the code predictor).

    ``layer_kinds[i]`` is ``("full", None)`` or ``("sliding", window)``; ``window`` counts the
    query itself (Hugging Face's ``sliding_window``: a query at p sees keys p-window+1..p).
    ``prefix`` is the tensor-name prefix of the stack in model.safetensors.
    """

    name: str
    prefix: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    max_positions: int
    layer_kinds: list[tuple[str, int | None]]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass
class ModelSpec:
    """Everything herald reads from config.json and generation_config.json."""

    checkpoint: Path
    model_type: str                  # tts_model_type: base / custom_voice / voice_design
    model_size: str                  # tts_model_size, e.g. "0b6"
    talker: LMSpec
    predictor: LMSpec
    codec_vocab: int                 # talker vocab (3072)
    num_code_groups: int             # 16
    predictor_vocab: int             # 2048 codes per residual codebook
    text_vocab: int                  # 151936
    text_hidden: int                 # 2048 in the official checkpoints
    has_projection: bool             # small_to_mtp_projection present (talker hidden != predictor hidden)
    text_ids: dict[str, int]         # im_start, im_end, tts_pad, tts_bos, tts_eos (+ assistant when given)
    codec_ids: dict[str, int]        # pad, bos, eos, think, nothink, think_bos, think_eos
    languages: dict[str, int]        # codec_language_id
    speakers: dict[str, int]         # spk_id (first element of each list)
    speaker_dialects: dict[str, str] # spk_is_dialect entries that name a dialect
    generation: dict = field(default_factory=dict)


def _layer_kinds(path: Path, where: str, cfg: dict, layers: int) -> list[tuple[str, int | None]]:
    window = cfg.get("sliding_window")
    use = bool(cfg.get("use_sliding_window", False))
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ExportError(path, f"config key {where}'layer_types' must list {layers} entries, found {types!r}")
        kinds = []
        for t in types:
            if t == "full_attention":
                kinds.append(("full", None))
            elif t == "sliding_attention":
                if not isinstance(window, int) or window < 2:
                    raise ExportError(path, f"config key {where}'sliding_window' must be an integer >= 2 for sliding layers, found {window!r}")
                kinds.append(("sliding", int(window)))
            else:
                raise ExportError(path, f"config key {where}'layer_types' has unknown layer type {t!r} (full_attention or sliding_attention)")
        return kinds
    if use and window is not None:
        if not isinstance(window, int) or window < 2:
            raise ExportError(path, f"config key {where}'sliding_window' must be an integer >= 2, found {window!r}")
        return [("sliding", int(window))] * layers
    return [("full", None)] * layers


def _lm_spec(path: Path, where: str, cfg: dict, name: str, prefix: str) -> LMSpec:
    hidden = _req(path, where, cfg, "hidden_size")
    heads = _req(path, where, cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads if heads else 0)
    layers = _req(path, where, cfg, "num_hidden_layers")
    for k, v in (("num_key_value_heads", kv), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ExportError(path, f"config key {where}{k!r} must be a positive integer, found {v!r}")
    if min(hidden, heads, layers) <= 0 or heads % kv:
        raise ExportError(path, f"{where}: attention heads {heads} must be a positive multiple of key/value heads {kv}")
    if head_dim % 2:
        raise ExportError(path, f"config key {where}'head_dim' must be even for rotary embeddings, found {head_dim}")
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACT:
        raise ExportError(path, f"config key {where}'hidden_act' is {act!r}; herald supports {sorted(SUPPORTED_ACT)}")
    if cfg.get("attention_bias", False):
        raise ExportError(path, f"config key {where}'attention_bias' is true; Qwen3-TTS has no attention bias")
    theta = cfg.get("rope_theta", 10000)
    rs = cfg.get("rope_scaling")
    if isinstance(rs, dict):
        rtype = rs.get("rope_type", rs.get("type", "default"))
        if rtype != "default":
            raise ExportError(path, f"config key {where}'rope_scaling' has rope_type {rtype!r}; only 'default' (plain or M-RoPE with identical rows) is supported")
        theta = rs.get("rope_theta", theta)
    return LMSpec(
        name=name, prefix=prefix, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        intermediate=_req(path, where, cfg, "intermediate_size"), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), max_positions=int(cfg.get("max_position_embeddings", 32768)),
        layer_kinds=_layer_kinds(path, where, cfg, layers),
    )


def load_spec(ckpt: Path) -> ModelSpec:
    """Read and validate config.json and generation_config.json of a checkpoint directory."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(ckpt, "checkpoint directory does not exist")
    cpath = ckpt / "config.json"
    cfg = read_json(cpath)
    if cfg.get("model_type") != "qwen3_tts":
        raise ExportError(cpath, f"unknown model type {cfg.get('model_type')!r} (expected 'qwen3_tts')")
    check_keys(cpath, "", cfg, TOP_KEYS)
    if cfg.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise ExportError(cpath, f"tokenizer_type {cfg.get('tokenizer_type')!r} is not supported (only the 12 Hz codec)")
    mtype = cfg.get("tts_model_type", "custom_voice")
    if mtype not in ("base", "custom_voice", "voice_design"):
        raise ExportError(cpath, f"unknown tts_model_type {mtype!r} (base, custom_voice or voice_design)")
    if "speaker_encoder_config" in cfg and isinstance(cfg["speaker_encoder_config"], dict):
        check_keys(cpath, "speaker_encoder_config.", cfg["speaker_encoder_config"], SPEAKER_ENCODER_KEYS)
    t = _req(cpath, "", cfg, "talker_config", dict)
    if t.get("model_type", "qwen3_tts_talker") != "qwen3_tts_talker":
        raise ExportError(cpath, f"unknown model type talker_config.model_type {t.get('model_type')!r}")
    check_keys(cpath, "talker_config.", t, TALKER_KEYS)
    p = _req(cpath, "talker_config.", t, "code_predictor_config", dict)
    if p.get("model_type", "qwen3_tts_talker_code_predictor") != "qwen3_tts_talker_code_predictor":
        raise ExportError(cpath, f"unknown model type talker_config.code_predictor_config.model_type {p.get('model_type')!r}")
    check_keys(cpath, "talker_config.code_predictor_config.", p, PREDICTOR_KEYS)

    talker = _lm_spec(cpath, "talker_config.", t, "talker", "talker.model.")
    predictor = _lm_spec(cpath, "talker_config.code_predictor_config.", p, "code_predictor", "talker.code_predictor.model.")
    groups = _req(cpath, "talker_config.", t, "num_code_groups")
    pgroups = p.get("num_code_groups", groups)
    if groups != pgroups or groups < 2:
        raise ExportError(cpath, f"talker num_code_groups {groups} and code predictor num_code_groups {pgroups} must agree and be >= 2")

    text_ids = {}
    for short, key in (("im_start", "im_start_token_id"), ("im_end", "im_end_token_id"), ("tts_pad", "tts_pad_token_id"),
                       ("tts_bos", "tts_bos_token_id"), ("tts_eos", "tts_eos_token_id")):
        text_ids[short] = _req(cpath, "", cfg, key)
    if "assistant_token_id" in cfg:
        text_ids["assistant"] = _req(cpath, "", cfg, "assistant_token_id")
    codec_ids = {}
    for short, key in (("pad", "codec_pad_id"), ("bos", "codec_bos_id"), ("eos", "codec_eos_token_id"),
                       ("think", "codec_think_id"), ("nothink", "codec_nothink_id"),
                       ("think_bos", "codec_think_bos_id"), ("think_eos", "codec_think_eos_id")):
        codec_ids[short] = _req(cpath, "talker_config.", t, key)
    codec_vocab = _req(cpath, "talker_config.", t, "vocab_size")
    for k, v in codec_ids.items():
        if not 0 <= v < codec_vocab:
            raise ExportError(cpath, f"codec id {k}={v} lies outside the codec vocabulary 0..{codec_vocab - 1}")
    text_vocab = _req(cpath, "talker_config.", t, "text_vocab_size")
    for k, v in text_ids.items():
        if not 0 <= v < text_vocab:
            raise ExportError(cpath, f"text id {k}={v} lies outside the text vocabulary 0..{text_vocab - 1}")

    languages = t.get("codec_language_id") or {}
    speakers_raw = t.get("spk_id") or {}
    dialects_raw = t.get("spk_is_dialect") or {}
    if not isinstance(languages, dict) or not all(isinstance(v, int) and 0 <= v < codec_vocab for v in languages.values()):
        raise ExportError(cpath, "talker_config.codec_language_id must map language names to codec ids")
    speakers = {}
    for name, v in speakers_raw.items():
        sid = v[0] if isinstance(v, list) and len(v) == 1 else v
        if isinstance(sid, bool) or not isinstance(sid, int) or not 0 <= sid < codec_vocab:
            raise ExportError(cpath, f"talker_config.spk_id[{name!r}] must be a codec id (or a 1-element list), found {v!r}")
        speakers[name.lower()] = sid
    dialects = {}
    for name, v in dialects_raw.items():
        if v is False or v is None:
            continue
        if not isinstance(v, str) or v not in languages:
            raise ExportError(cpath, f"talker_config.spk_is_dialect[{name!r}] names {v!r}, which is not in codec_language_id")
        dialects[name.lower()] = v

    pvocab = _req(cpath, "talker_config.code_predictor_config.", p, "vocab_size")
    gen = read_json(ckpt / "generation_config.json")
    check_keys(ckpt / "generation_config.json", "", gen, GENERATION_KEYS)
    return ModelSpec(
        checkpoint=ckpt, model_type=mtype, model_size=str(cfg.get("tts_model_size", "")), talker=talker,
        predictor=predictor, codec_vocab=codec_vocab, num_code_groups=groups, predictor_vocab=pvocab,
        text_vocab=text_vocab, text_hidden=_req(cpath, "talker_config.", t, "text_hidden_size"),
        has_projection=talker.hidden != predictor.hidden, text_ids=text_ids, codec_ids=codec_ids,
        languages={k.lower(): v for k, v in languages.items()}, speakers=speakers, speaker_dialects=dialects,
        generation=gen,
    )


def sampling_defaults(spec: ModelSpec) -> dict:
    """Sampling defaults from generation_config.json, falling back to the wrapper's defaults.

    Fallbacks (qwen_tts/inference/qwen3_tts_model.py ``_merge_generate_kwargs``): do_sample true,
    temperature 0.9, top_k 50, top_p 1.0, repetition_penalty 1.05, max_new_tokens 2048; the
    "subtalker" (code predictor) uses do_sample true, temperature 0.9, top_k 50, top_p 1.0.
    """
    g = spec.generation

    def get(k, d, typ):
        v = g.get(k, d)
        if v is None:
            v = d
        if typ is bool:
            return bool(v)
        return typ(v)

    return {
        "talker": {
            "do_sample": get("do_sample", True, bool), "temperature": get("temperature", 0.9, float),
            "top_k": get("top_k", 50, int), "top_p": get("top_p", 1.0, float),
            "repetition_penalty": get("repetition_penalty", 1.05, float),
            "min_new_tokens": get("min_new_tokens", 2, int), "max_new_tokens": get("max_new_tokens", 2048, int),
        },
        "code_predictor": {
            "do_sample": get("subtalker_dosample", True, bool), "temperature": get("subtalker_temperature", 0.9, float),
            "top_k": get("subtalker_top_k", 50, int), "top_p": get("subtalker_top_p", 1.0, float),
        },
    }


def expected_lm_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every talker-side tensor herald uses, with the shape the config implies (torch layout)."""
    out: dict[str, tuple[int, ...]] = {}

    def stack(s: LMSpec):
        for i in range(s.layers):
            p = f"{s.prefix}layers.{i}."
            out[p + "self_attn.q_proj.weight"] = (s.q_dim, s.hidden)
            out[p + "self_attn.k_proj.weight"] = (s.kv_dim, s.hidden)
            out[p + "self_attn.v_proj.weight"] = (s.kv_dim, s.hidden)
            out[p + "self_attn.o_proj.weight"] = (s.hidden, s.q_dim)
            out[p + "self_attn.q_norm.weight"] = (s.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (s.head_dim,)
            out[p + "mlp.gate_proj.weight"] = (s.intermediate, s.hidden)
            out[p + "mlp.up_proj.weight"] = (s.intermediate, s.hidden)
            out[p + "mlp.down_proj.weight"] = (s.hidden, s.intermediate)
            out[p + "input_layernorm.weight"] = (s.hidden,)
            out[p + "post_attention_layernorm.weight"] = (s.hidden,)
        out[s.prefix + "norm.weight"] = (s.hidden,)

    t, c = spec.talker, spec.predictor
    stack(t)
    stack(c)
    out["talker.model.codec_embedding.weight"] = (spec.codec_vocab, t.hidden)
    out["talker.model.text_embedding.weight"] = (spec.text_vocab, spec.text_hidden)
    out["talker.text_projection.linear_fc1.weight"] = (spec.text_hidden, spec.text_hidden)
    out["talker.text_projection.linear_fc1.bias"] = (spec.text_hidden,)
    out["talker.text_projection.linear_fc2.weight"] = (t.hidden, spec.text_hidden)
    out["talker.text_projection.linear_fc2.bias"] = (t.hidden,)
    out["talker.codec_head.weight"] = (spec.codec_vocab, t.hidden)
    for k in range(spec.num_code_groups - 1):
        out[f"talker.code_predictor.model.codec_embedding.{k}.weight"] = (spec.predictor_vocab, t.hidden)
        out[f"talker.code_predictor.lm_head.{k}.weight"] = (spec.predictor_vocab, c.hidden)
    if spec.has_projection:
        out["talker.code_predictor.small_to_mtp_projection.weight"] = (c.hidden, t.hidden)
        out["talker.code_predictor.small_to_mtp_projection.bias"] = (c.hidden,)
    return out


#: Tensor-name prefixes present in official files that herald does not use.
IGNORED_PREFIXES = ("speaker_encoder.",)


class LMWeights:
    """Lazy, validated access to the talker-side tensors of model.safetensors (float32 on read)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        path = spec.checkpoint / "model.safetensors"
        if not path.is_file():
            raise ExportError(path, "missing file")
        self.file = SafetensorsFile(path)
        self.expected = expected_lm_tensors(spec)
        for name, shape in self.expected.items():
            if name not in self.file:
                raise ExportError(path, f"missing tensor {name} (expected shape {list(shape)})")
            got = self.file.shape(name)
            if tuple(got) != tuple(shape):
                raise ExportError(path, f"tensor {name} has shape {list(got)}, expected {list(shape)} from config.json")
        for name in self.file.names():
            if name not in self.expected and not name.startswith(IGNORED_PREFIXES):
                raise ExportError(path, f"unexpected tensor {name} (not part of the configured model)")

    def __getitem__(self, name: str) -> np.ndarray:
        return self.file.get(name)

    def layer(self, s: LMSpec, i: int, leaf: str) -> np.ndarray:
        return self.file.get(f"{s.prefix}layers.{i}.{leaf}")

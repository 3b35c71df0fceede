"""The Qwen3-TTS 12 Hz vocoder (Code2Wav, the speech tokenizer's decoder): load, export, reference.

Source of the model: ``qwen_tts/core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py`` and
``configuration_qwen3_tts_tokenizer_v2.py`` of the official ``qwen_tts`` package (classes
``Qwen3TTSTokenizerV2CausalConvNet`` .. ``Qwen3TTSTokenizerV2Decoder``). The checkpoint is
``speech_tokenizer/config.json`` + ``speech_tokenizer/model.safetensors`` of an official
Qwen3-TTS 12 Hz repository; herald reads the ``decoder.*`` tensors (float32 as shipped) and
ignores the ``encoder.*`` ones. No convolution uses weight norm, so the weights are used as
stored (no ``weight_g``/``weight_v`` to fold).

Data path for codes ``[16, T]`` (integers in ``[0, codebook_size)``), giving ``T * 1920`` samples
of 24 kHz mono PCM in ``[-1, 1]`` (official sizes in brackets):

1. RVQ dequantisation. Codebook ``k`` of group ``g`` is ``embedding_sum / clamp(cluster_usage,
   min=1e-5)[:, None]`` [2048, 256]; group "first" holds codebook 0, group "rest" codebooks 1..15.
   Each group sums its looked-up rows and applies its 1x1 ``output_proj`` (256 -> 512, no bias);
   the two group outputs are added -> [T, 512].
2. ``pre_conv``: causal Conv1d 512 -> 1024, kernel 3 (left padding 2).
3. ``pre_transformer``: Linear 1024 -> 512, N layers of [RMSNorm -> attention (rotate-half RoPE
   with ``rope_theta``, positions 0..T-1, head_dim from the config, causal sliding window: a query
   sees itself and ``sliding_window - 1`` earlier frames) -> LayerScale -> residual; RMSNorm ->
   SwiGLU MLP -> LayerScale -> residual], final RMSNorm, Linear 512 -> 1024.
4. For each ``upsampling_ratios`` factor f (2, 2): ConvTranspose1d(k=f, stride=f) then a ConvNeXt
   block (causal depthwise conv k=7, LayerNorm eps 1e-6, Linear x4, exact GELU, Linear, gamma,
   residual).
5. Causal Conv1d latent -> ``decoder_dim``, kernel 7.
6. For each ``upsample_rates`` r (8, 5, 4, 3), channels halving: SnakeBeta -> ConvTranspose1d
   (k=2r, stride r, r samples trimmed on the right) -> residual units with dilations 1, 3, 9
   (SnakeBeta -> causal conv k=7 dilated -> SnakeBeta -> conv k=1, plus the input).
7. SnakeBeta -> causal Conv1d -> 1 channel, kernel 7 -> clamp to [-1, 1].

SnakeBeta(x) = x + sin(x * exp(alpha))^2 / (exp(beta) + 1e-9), per channel; ``alpha``/``beta`` are
stored in log scale (the module applies ``exp``). The whole stack is causal and emits exactly
``prod(upsample_rates) * prod(upsampling_ratios)`` = 1920 samples per frame.

Public API
----------
- :func:`tiny_speech_tokenizer_config`, :func:`write_tiny_speech_tokenizer`: a tiny random
  checkpoint with the real interfaces (for tests).
- :func:`load_vocoder` -> :class:`VocoderWeights` (strict validation, :class:`ExportError`).
- :func:`build_vocoder_graph`: the float32 ONNX graph ``codes`` int64 [1, 16, frames] ->
  ``wav`` float32 [1, frames * 1920].
- :func:`vocoder_numpy`: a plain float64 numpy implementation (the independent oracle).
- :func:`vocoder_facts`: the manifest facts.
- :func:`decode_windowed`, :func:`windowed_plan`, :func:`windowed_snr_db`: the runtime's
  windowed (chunked, left-context) decoding scheme, for tests and measurements.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx

from .errors import ExportError
from .onnx_graph import GraphBuilder
from .st_io import SafetensorsFile

# ---------------------------------------------------------------------------------------------
# Constants of the official module code (not in config.json)
# ---------------------------------------------------------------------------------------------

#: ``model_type`` of ``speech_tokenizer/config.json`` (``Qwen3TTSTokenizerV2Config.model_type``).
MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
#: ``EuclideanCodebook.epsilon``: cluster_usage is clamped to at least this before dividing.
CODEBOOK_EPS = 1e-5
#: ``SnakeBeta.no_div_by_zero``.
SNAKE_EPS = 1e-9
#: ``Qwen3TTSTokenizerV2ConvNeXtBlock``: depthwise kernel, LayerNorm eps, MLP expansion.
CONVNEXT_KERNEL = 7
CONVNEXT_LN_EPS = 1e-6
CONVNEXT_EXPANSION = 4
#: ``Qwen3TTSTokenizerV2Decoder``: pre_conv kernel, decoder input/output conv kernels.
PRE_CONV_KERNEL = 3
DECODER_IN_KERNEL = 7
DECODER_OUT_KERNEL = 7
#: ``Qwen3TTSTokenizerV2DecoderDecoderResidualUnit``: conv1 kernel; dilations of the three units.
RESIDUAL_KERNEL = 7
RESIDUAL_DILATIONS = (1, 3, 9)
#: ``SplitResidualVectorQuantizer`` is built with ``n_q_semantic=1`` (hard-coded).
N_SEMANTIC = 1
#: Additive mask value of the graph for frames outside the causal window (fp32 graph).
MASK_NEG = -1.0e9

#: Default chunk ramp and left context of herald's windowed vocoder (DESIGN.md §5).
DEFAULT_RAMP = (2, 4, 8, 16, 25)
DEFAULT_LEFT_CONTEXT = 72

#: ``Qwen3TTSTokenizerV2DecoderConfig.__init__`` defaults (used for keys a config leaves out).
DECODER_DEFAULTS = {
    "codebook_size": 2048,
    "hidden_size": 1024,
    "latent_dim": 1024,
    "max_position_embeddings": 8000,
    "rope_theta": 10000,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "attention_bias": False,
    "sliding_window": 72,
    "intermediate_size": 3072,
    "hidden_act": "silu",
    "layer_scale_initial_scale": 0.01,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 8,
    "num_quantizers": 16,
    "upsample_rates": (8, 5, 4, 3),
    "upsampling_ratios": (2, 2),
    "decoder_dim": 1536,
    "attention_dropout": 0.0,
}

#: Keys the shipped decoder_config adds beyond the class signature (stored as attributes via
#: ``**kwargs``): ``codebook_dim`` (required: the module reads it, there is no default),
#: ``head_dim`` (default hidden_size // num_attention_heads), and three the decoder never reads.
DECODER_EXTRA_KEYS = {
    "codebook_dim",
    "head_dim",
    "num_semantic_quantizers",
    "semantic_codebook_size",
    "vector_quantization_hidden_dimension",
}

#: Generic ``PretrainedConfig`` keys a serialised sub-config may carry.
GENERIC_CONFIG_KEYS = {
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "rope_scaling", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "_attn_implementation_autoset", "initializer_range", "tie_word_embeddings",
}

KNOWN_DECODER_KEYS = frozenset(DECODER_DEFAULTS) | DECODER_EXTRA_KEYS | GENERIC_CONFIG_KEYS


# ---------------------------------------------------------------------------------------------
# Configuration and weights
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocoderConfig:
    """The decoder hyper-parameters herald uses, validated (names follow ``decoder_config``).

    ``quantizer_dim`` is the codebook row width = ``codebook_dim // 2`` (the official decoder
    builds its quantizer with ``dimension=codebook_dim // 2``); ``samples_per_frame`` is the
    top-level ``decode_upsample_rate``; ``sample_rate`` is ``output_sample_rate`` (Hz).
    """

    codebook_size: int
    codebook_dim: int
    quantizer_dim: int
    num_quantizers: int
    latent_dim: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    sliding_window: int
    max_position_embeddings: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int
    sample_rate: int
    samples_per_frame: int

    def block_dims(self) -> list[tuple[int, int, int]]:
        """(in_channels, out_channels, rate) of each decoder block."""
        return [
            (self.decoder_dim // 2**i, self.decoder_dim // 2 ** (i + 1), r) for i, r in enumerate(self.upsample_rates)
        ]

    @property
    def output_dim(self) -> int:
        """Channels entering the final SnakeBeta and output conv."""
        return self.decoder_dim // 2 ** len(self.upsample_rates)


@dataclass
class VocoderWeights:
    """A loaded vocoder: validated config and the decoder tensors (official names, float32).

    ``tensors`` maps full official names (``decoder.pre_conv.conv.weight`` ...) to numpy arrays
    in the checkpoint's layout; ``raw_config`` is the whole parsed ``speech_tokenizer/config.json``;
    ``config_path``/``weights_path`` are the files they came from.
    """

    config: VocoderConfig
    tensors: dict[str, np.ndarray]
    raw_config: dict = field(default_factory=dict)
    config_path: Path | None = None
    weights_path: Path | None = None

    def t(self, name: str) -> np.ndarray:
        """Tensor by name relative to the ``decoder.`` prefix (e.g. ``pre_conv.conv.weight``)."""
        return self.tensors["decoder." + name]


def _cfg_int(path: Path, where: str, cfg: dict, key: str, minimum: int = 1) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or int(v) < minimum:
        raise ExportError(path, f"{where}.{key} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _cfg_float(path: Path, where: str, cfg: dict, key: str) -> float:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ExportError(path, f"{where}.{key} must be a positive number, got {v!r}")
    return float(v)


def _cfg_ints(path: Path, where: str, cfg: dict, key: str) -> tuple[int, ...]:
    v = cfg[key]
    if (
        not isinstance(v, (list, tuple))
        or not v
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)
    ):
        raise ExportError(path, f"{where}.{key} must be a non-empty list of positive integers, got {v!r}")
    return tuple(int(x) for x in v)


def parse_speech_tokenizer_config(path: Path, raw: dict) -> VocoderConfig:
    """Validate a parsed ``speech_tokenizer/config.json`` and return the decoder's :class:`VocoderConfig`.

    Missing decoder keys take the official class defaults (:data:`DECODER_DEFAULTS`), except
    ``codebook_dim``, which has none. Errors (:class:`ExportError` on ``path``): wrong
    ``model_type``; missing/invalid ``decoder_config``; an unknown ``decoder_config`` key;
    values of the wrong type; features the graph does not implement (attention bias, an
    activation other than silu, RoPE scaling, more than one semantic quantizer); channel or head
    counts that do not divide; ``decode_upsample_rate`` != prod(upsample_rates) *
    prod(upsampling_ratios).
    """
    if not isinstance(raw, dict):
        raise ExportError(path, "config is not a JSON object")
    mt = raw.get("model_type")
    if mt != MODEL_TYPE:
        raise ExportError(path, f"model_type is {mt!r}, expected {MODEL_TYPE!r} (Qwen3-TTS 12 Hz speech tokenizer)")
    dec = raw.get("decoder_config")
    if not isinstance(dec, dict):
        raise ExportError(path, "decoder_config is missing or not a JSON object")
    for key in dec:
        if key not in KNOWN_DECODER_KEYS:
            raise ExportError(path, f"decoder_config has unknown key {key!r} (not a Qwen3-TTS 12 Hz decoder setting)")
    if "codebook_dim" not in dec:
        raise ExportError(path, "decoder_config.codebook_dim is missing (the decoder has no default for it)")
    cfg = {**DECODER_DEFAULTS, **dec}
    w = "decoder_config"

    if cfg.get("attention_bias"):
        raise ExportError(
            path, "decoder_config.attention_bias is true; herald implements the shipped bias-free attention"
        )
    if cfg.get("hidden_act") != "silu":
        raise ExportError(path, f"decoder_config.hidden_act is {cfg.get('hidden_act')!r}; only 'silu' is implemented")
    rs = cfg.get("rope_scaling")
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else rs
        if kind != "default":
            raise ExportError(path, f"decoder_config.rope_scaling {rs!r} is not supported (only plain RoPE)")
    if "num_semantic_quantizers" in cfg and cfg["num_semantic_quantizers"] != N_SEMANTIC:
        raise ExportError(
            path,
            f"decoder_config.num_semantic_quantizers is {cfg['num_semantic_quantizers']!r}; the decoder "
            f"hard-codes {N_SEMANTIC} semantic quantizer",
        )

    ints = {
        k: _cfg_int(path, w, cfg, k)
        for k in (
            "codebook_size", "codebook_dim", "num_quantizers", "latent_dim", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "intermediate_size", "sliding_window",
            "max_position_embeddings", "decoder_dim",
        )
    }
    heads, kv = ints["num_attention_heads"], ints["num_key_value_heads"]
    head_dim = _cfg_int(path, w, cfg, "head_dim") if "head_dim" in cfg else ints["hidden_size"] // heads
    if head_dim < 2 or head_dim % 2:
        raise ExportError(path, f"decoder_config head_dim {head_dim} must be even (rotate-half RoPE)")
    if heads % kv:
        raise ExportError(
            path, f"decoder_config.num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if ints["num_quantizers"] <= N_SEMANTIC:
        raise ExportError(path, f"decoder_config.num_quantizers {ints['num_quantizers']} must exceed {N_SEMANTIC}")
    if ints["codebook_dim"] % 2:
        raise ExportError(
            path, f"decoder_config.codebook_dim {ints['codebook_dim']} must be even (the quantizer width is half of it)"
        )
    rates = _cfg_ints(path, w, cfg, "upsample_rates")
    ratios = _cfg_ints(path, w, cfg, "upsampling_ratios")
    if ints["decoder_dim"] % 2 ** len(rates):
        raise ExportError(
            path,
            f"decoder_config.decoder_dim {ints['decoder_dim']} is not divisible by 2**{len(rates)} (halved per block)",
        )
    hop = int(np.prod(rates)) * int(np.prod(ratios))
    for key in ("decode_upsample_rate", "output_sample_rate"):
        if key not in raw:
            raise ExportError(path, f"{key} is missing")
    dur = _cfg_int(path, "config", raw, "decode_upsample_rate")
    if dur != hop:
        raise ExportError(
            path,
            f"decode_upsample_rate is {dur} but prod(upsample_rates {list(rates)}) * prod(upsampling_ratios "
            f"{list(ratios)}) = {hop}",
        )
    return VocoderConfig(
        codebook_size=ints["codebook_size"],
        codebook_dim=ints["codebook_dim"],
        quantizer_dim=ints["codebook_dim"] // 2,
        num_quantizers=ints["num_quantizers"],
        latent_dim=ints["latent_dim"],
        hidden_size=ints["hidden_size"],
        num_hidden_layers=ints["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=ints["intermediate_size"],
        rope_theta=_cfg_float(path, w, cfg, "rope_theta"),
        rms_norm_eps=_cfg_float(path, w, cfg, "rms_norm_eps"),
        sliding_window=ints["sliding_window"],
        max_position_embeddings=ints["max_position_embeddings"],
        upsample_rates=rates,
        upsampling_ratios=ratios,
        decoder_dim=ints["decoder_dim"],
        sample_rate=_cfg_int(path, "config", raw, "output_sample_rate"),
        samples_per_frame=hop,
    )


def expected_decoder_tensors(c: VocoderConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) maps of official tensor name -> shape implied by the config.

    The names are the ``state_dict`` paths of ``Qwen3TTSTokenizerV2Model.decoder``. ``optional``
    holds the quantizers' ``input_proj`` 1x1 convs, which exist in the checkpoint (the module is
    built with ``force_projection=True``) but are only used for encoding.
    """
    req: dict[str, tuple[int, ...]] = {}
    opt: dict[str, tuple[int, ...]] = {}
    q, cd, cs = c.quantizer_dim, c.codebook_dim, c.codebook_size
    for grp, n in (("rvq_first", N_SEMANTIC), ("rvq_rest", c.num_quantizers - N_SEMANTIC)):
        p = f"decoder.quantizer.{grp}"
        opt[f"{p}.input_proj.weight"] = (q, cd, 1)
        req[f"{p}.output_proj.weight"] = (cd, q, 1)
        for i in range(n):
            req[f"{p}.vq.layers.{i}._codebook.cluster_usage"] = (cs,)
            req[f"{p}.vq.layers.{i}._codebook.embedding_sum"] = (cs, q)
    L, H, I = c.latent_dim, c.hidden_size, c.intermediate_size
    qd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    req["decoder.pre_conv.conv.weight"] = (L, cd, PRE_CONV_KERNEL)
    req["decoder.pre_conv.conv.bias"] = (L,)
    pt = "decoder.pre_transformer"
    req[f"{pt}.input_proj.weight"] = (H, L)
    req[f"{pt}.input_proj.bias"] = (H,)
    for i in range(c.num_hidden_layers):
        lp = f"{pt}.layers.{i}"
        req[f"{lp}.input_layernorm.weight"] = (H,)
        req[f"{lp}.self_attn.q_proj.weight"] = (qd, H)
        req[f"{lp}.self_attn.k_proj.weight"] = (kvd, H)
        req[f"{lp}.self_attn.v_proj.weight"] = (kvd, H)
        req[f"{lp}.self_attn.o_proj.weight"] = (H, qd)
        req[f"{lp}.self_attn_layer_scale.scale"] = (H,)
        req[f"{lp}.post_attention_layernorm.weight"] = (H,)
        req[f"{lp}.mlp.gate_proj.weight"] = (I, H)
        req[f"{lp}.mlp.up_proj.weight"] = (I, H)
        req[f"{lp}.mlp.down_proj.weight"] = (H, I)
        req[f"{lp}.mlp_layer_scale.scale"] = (H,)
    req[f"{pt}.norm.weight"] = (H,)
    req[f"{pt}.output_proj.weight"] = (L, H)
    req[f"{pt}.output_proj.bias"] = (L,)
    E = CONVNEXT_EXPANSION * L
    for i, f in enumerate(c.upsampling_ratios):
        up = f"decoder.upsample.{i}"
        req[f"{up}.0.conv.weight"] = (L, L, f)
        req[f"{up}.0.conv.bias"] = (L,)
        req[f"{up}.1.dwconv.conv.weight"] = (L, 1, CONVNEXT_KERNEL)
        req[f"{up}.1.dwconv.conv.bias"] = (L,)
        req[f"{up}.1.norm.weight"] = (L,)
        req[f"{up}.1.norm.bias"] = (L,)
        req[f"{up}.1.pwconv1.weight"] = (E, L)
        req[f"{up}.1.pwconv1.bias"] = (E,)
        req[f"{up}.1.pwconv2.weight"] = (L, E)
        req[f"{up}.1.pwconv2.bias"] = (L,)
        req[f"{up}.1.gamma"] = (L,)
    D = c.decoder_dim
    req["decoder.decoder.0.conv.weight"] = (D, L, DECODER_IN_KERNEL)
    req["decoder.decoder.0.conv.bias"] = (D,)
    for bi, (cin, cout, r) in enumerate(c.block_dims(), start=1):
        bp = f"decoder.decoder.{bi}.block"
        req[f"{bp}.0.alpha"] = (cin,)
        req[f"{bp}.0.beta"] = (cin,)
        req[f"{bp}.1.conv.weight"] = (cin, cout, 2 * r)
        req[f"{bp}.1.conv.bias"] = (cout,)
        for u in range(len(RESIDUAL_DILATIONS)):
            rp = f"{bp}.{u + 2}"
            for a in ("act1", "act2"):
                req[f"{rp}.{a}.alpha"] = (cout,)
                req[f"{rp}.{a}.beta"] = (cout,)
            req[f"{rp}.conv1.conv.weight"] = (cout, cout, RESIDUAL_KERNEL)
            req[f"{rp}.conv1.conv.bias"] = (cout,)
            req[f"{rp}.conv2.conv.weight"] = (cout, cout, 1)
            req[f"{rp}.conv2.conv.bias"] = (cout,)
    nb = len(c.upsample_rates)
    req[f"decoder.decoder.{nb + 1}.alpha"] = (c.output_dim,)
    req[f"decoder.decoder.{nb + 1}.beta"] = (c.output_dim,)
    req[f"decoder.decoder.{nb + 2}.conv.weight"] = (1, c.output_dim, DECODER_OUT_KERNEL)
    req[f"decoder.decoder.{nb + 2}.conv.bias"] = (1,)
    return req, opt


def load_vocoder(checkpoint_dir: Path) -> VocoderWeights:
    """Read and validate the vocoder of a checkpoint directory.

    Reads ``checkpoint_dir/speech_tokenizer/config.json`` and ``.../model.safetensors``. Every
    required ``decoder.*`` tensor must be present with the shape the config implies
    (:func:`expected_decoder_tensors`); ``encoder.*`` tensors are ignored; any other
    ``decoder.*`` tensor is rejected (it would mean a different architecture). Float tensors are
    returned as float32 (F16/BF16 are widened exactly).

    Errors: :class:`ExportError` naming the file: missing/unreadable/invalid-JSON config, config
    problems (see :func:`parse_speech_tokenizer_config`), missing or truncated safetensors,
    ``"tensor X is missing"``, ``"tensor X has shape (..) expected (..)"``, a non-float tensor,
    ``"unexpected tensor X"``.
    """
    st_dir = Path(checkpoint_dir) / "speech_tokenizer"
    cpath = st_dir / "config.json"
    if not cpath.is_file():
        raise ExportError(cpath, "file not found (the speech tokenizer config of the checkpoint)")
    try:
        raw = json.loads(cpath.read_text(encoding="utf-8"))
    except OSError as e:
        raise ExportError(cpath, f"cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ExportError(cpath, f"invalid JSON: {e}") from None
    cfg = parse_speech_tokenizer_config(cpath, raw)

    wpath = st_dir / "model.safetensors"
    if not wpath.is_file():
        raise ExportError(wpath, "file not found (the speech tokenizer weights of the checkpoint)")
    st = SafetensorsFile(wpath)
    required, optional = expected_decoder_tensors(cfg)
    names = set(st.names())
    for name in sorted(n for n in names if n.startswith("decoder.")):
        if name not in required and name not in optional:
            raise ExportError(
                wpath, f"unexpected tensor {name} (not part of the Qwen3-TTS 12 Hz decoder this config describes)"
            )
    tensors: dict[str, np.ndarray] = {}
    for name, shape in list(required.items()) + list(optional.items()):
        if name not in names:
            if name in optional:
                continue
            raise ExportError(wpath, f"tensor {name} is missing")
        got = tuple(st.shape(name))
        if got != shape:
            raise ExportError(wpath, f"tensor {name} has shape {got} expected {shape}")
        if st.dtype(name) not in ("F32", "F16", "BF16", "F64"):
            raise ExportError(
                wpath, f"tensor {name} has dtype {st.dtype(name)}, expected a float type (F32 as shipped)"
            )
        arr = st.get(name)
        if not np.all(np.isfinite(arr)):
            raise ExportError(wpath, f"tensor {name} holds non-finite values")
        tensors[name] = arr
    return VocoderWeights(config=cfg, tensors=tensors, raw_config=raw, config_path=cpath, weights_path=wpath)


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoint
# ---------------------------------------------------------------------------------------------


def tiny_speech_tokenizer_config() -> dict:
    """The ``speech_tokenizer/config.json`` of a tiny random model, in the official key layout.

    Real interfaces: 16 quantizers x 2048 codes, sliding window 72, upsample_rates (8, 5, 4, 3)
    and upsampling_ratios (2, 2) -> 1920 samples per frame at 24 kHz; q width (heads x head_dim
    = 64) differs from the hidden size (32) as in the shipped model (1024 vs 512). Tiny widths:
    codebook_dim 32 (codebook rows 16), latent 32, hidden 32, 2 layers, 4 heads of 16,
    intermediate 64, decoder_dim 64 -> block channels 32, 16, 8, 4. ``encoder_config`` is a
    small, plausible Mimi config (herald ignores the encoder).
    """
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": MODEL_TYPE,
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "decoder_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "latent_dim": 32,
            "codebook_dim": 32,
            "codebook_size": 2048,
            "decoder_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 32,
            "intermediate_size": 64,
            "layer_scale_initial_scale": 0.01,
            "max_position_embeddings": 8000,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "num_quantizers": 16,
            "num_semantic_quantizers": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000,
            "semantic_codebook_size": 4096,
            "sliding_window": 72,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "vector_quantization_hidden_dimension": 32,
        },
        "encoder_config": {
            "_frame_rate": 12.5,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "audio_channels": 1,
            "codebook_dim": 16,
            "codebook_size": 2048,
            "compress": 2,
            "dilation_growth_rate": 2,
            "dtype": "float32",
            "head_dim": 8,
            "hidden_act": "gelu",
            "hidden_size": 32,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "kernel_size": 7,
            "last_kernel_size": 3,
            "layer_scale_initial_scale": 0.01,
            "max_position_embeddings": 8000,
            "model_type": "mimi",
            "norm_eps": 1e-05,
            "normalize": False,
            "num_attention_heads": 4,
            "num_filters": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "num_quantizers": 32,
            "num_residual_layers": 1,
            "num_semantic_quantizers": 1,
            "pad_mode": "constant",
            "residual_kernel_size": 3,
            "rope_theta": 10000.0,
            "sampling_rate": 24000,
            "sliding_window": 250,
            "trim_right_ratio": 1.0,
            "upsample_groups": 32,
            "upsampling_ratios": [8, 6, 5, 4],
            "use_cache": False,
            "use_causal_conv": True,
            "use_conv_shortcut": False,
            "use_streaming": False,
            "vector_quantization_hidden_dimension": 16,
        },
        "transformers_version": "4.57.3",
    }


def _tiny_fan_gain(name: str, shape: tuple[int, ...]) -> tuple[int, float]:
    """(fan_in, gain) of a random weight of the tiny model.

    Linear [out, in] and conv [out, in/groups, k] weights: fan = in * k. Transposed convs
    [in, out, k] with stride s: every output sample sees k/s taps of each input channel, so fan =
    in * k/s. Gains below 1 (measured once on random codes) keep the residual units from growing
    the signal block after block and put the pre-clamp output at a standard deviation of ~0.3.
    """
    if name.startswith("decoder.upsample.") and name.endswith(".0.conv.weight"):
        return shape[0], 1.0  # kernel == stride
    if name.endswith(".block.1.conv.weight"):
        return shape[0] * 2, 0.85  # kernel 2r, stride r
    if name.endswith("conv2.conv.weight"):
        return int(np.prod(shape[1:])), 0.25  # residual unit output
    if shape[0] == 1 and name.startswith("decoder.decoder."):
        return int(np.prod(shape[1:])), 0.2  # final conv to one channel
    return int(np.prod(shape[1:])), 1.0


def tiny_decoder_tensors(cfg: VocoderConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 decoder tensors for ``cfg`` (official names), scaled to keep activations O(1).

    Linear/conv weights are N(0, gain^2 / fan_in); norms ~1; LayerScale and ConvNeXt gamma in
    [0.1, 0.5] (large enough that the transformer and ConvNeXt paths matter in tests);
    SnakeBeta alpha/beta ~ N(0, 0.3^2) in log scale; ``cluster_usage`` positive, with ~2 % of
    the rows below the 1e-5 clamp (their ``embedding_sum`` tiny) so the clamp is exercised.
    """
    req, opt = expected_decoder_tensors(cfg)
    out: dict[str, np.ndarray] = {}

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    for name, shape in {**req, **opt}.items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("_codebook.cluster_usage"):
            usage = np.exp(rng.standard_normal(shape) * 1.0) * 20.0
            tiny = rng.random(shape) < 0.02
            usage[tiny] = 1e-7
            out[name] = usage.astype(np.float32)
            continue
        if name.endswith("_codebook.embedding_sum"):
            continue  # filled below from its cluster_usage
        if leaf in ("alpha", "beta"):
            out[name] = normal(shape, 0.3)
        elif leaf in ("scale", "gamma"):
            out[name] = rng.uniform(0.1, 0.5, shape).astype(np.float32)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = (1.0 + normal(shape, 0.1)).astype(np.float32)
        elif leaf == "bias":
            out[name] = normal(shape, 0.05)
        else:
            fan, gain = _tiny_fan_gain(name, shape)
            out[name] = normal(shape, gain / math.sqrt(fan))
    for name, shape in req.items():
        if name.endswith("_codebook.embedding_sum"):
            usage = out[name.replace("embedding_sum", "cluster_usage")].astype(np.float64)
            centroid = rng.standard_normal(shape) * 0.35
            es = np.where(usage[:, None] < CODEBOOK_EPS, 1e-6 * centroid, usage[:, None] * centroid)
            out[name] = es.astype(np.float32)
    # A plausible fraction of the encoder (herald must ignore encoder.* tensors).
    out["encoder.encoder.layers.0.conv.weight"] = normal((4, 1, 7), 0.3)
    out["encoder.encoder.layers.0.conv.bias"] = normal((4,), 0.05)
    out["encoder.downsample.conv.weight"] = normal((32, 32, 4), 0.1)
    return out


def write_tiny_speech_tokenizer(checkpoint_dir: Path, rng: np.random.Generator, *, config: dict | None = None) -> None:
    """Write ``checkpoint_dir/speech_tokenizer/{config.json, model.safetensors}`` of a tiny model.

    Config: :func:`tiny_speech_tokenizer_config` (or ``config``, a variant of it, e.g. for GQA
    tests). Weights: :func:`tiny_decoder_tensors`, float32 as the official file ships, under the
    official names (plus three small ``encoder.*`` tensors): 208 tensors, about 2.8 MB, most of
    it the 16 codebooks of 2048 x 16.
    """
    from safetensors.numpy import save_file

    st_dir = Path(checkpoint_dir) / "speech_tokenizer"
    st_dir.mkdir(parents=True, exist_ok=True)
    raw = config if config is not None else tiny_speech_tokenizer_config()
    cpath = st_dir / "config.json"
    cpath.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    cfg = parse_speech_tokenizer_config(cpath, raw)
    save_file(tiny_decoder_tensors(cfg, rng), str(st_dir / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Folding (export-time arithmetic, float64)
# ---------------------------------------------------------------------------------------------


def folded_codebook_table(vw: VocoderWeights) -> np.ndarray:
    """All codebooks dequantised and projected: [num_quantizers * codebook_size, codebook_dim], float64.

    Row ``k * codebook_size + c`` = ``(embedding_sum_k[c] / max(cluster_usage_k[c], 1e-5)) @
    output_proj_g.T`` where g is the group of codebook k. Summing the rows of the 16 codes of a
    frame gives exactly the quantizer output (the projections are linear and bias-free).
    """
    c = vw.config
    rows = []
    for grp, n in (("rvq_first", N_SEMANTIC), ("rvq_rest", c.num_quantizers - N_SEMANTIC)):
        w = vw.t(f"quantizer.{grp}.output_proj.weight")[:, :, 0].astype(np.float64)  # [cd, q]
        for i in range(n):
            p = f"quantizer.{grp}.vq.layers.{i}._codebook"
            es = vw.t(f"{p}.embedding_sum").astype(np.float64)
            cu = vw.t(f"{p}.cluster_usage").astype(np.float64)
            rows.append((es / np.maximum(cu, CODEBOOK_EPS)[:, None]) @ w.T)
    return np.concatenate(rows, axis=0)


def snake_factors(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SnakeBeta's per-channel (exp(alpha), 1 / (exp(beta) + 1e-9)) in float64."""
    a = np.exp(alpha.astype(np.float64))
    inv_b = 1.0 / (np.exp(beta.astype(np.float64)) + SNAKE_EPS)
    return a, inv_b


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """Default RoPE inverse frequencies theta^(-2i/head_dim), i < head_dim/2 (float64)."""
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


# ---------------------------------------------------------------------------------------------
# ONNX graph
# ---------------------------------------------------------------------------------------------


#: Slice end meaning "to the end of the axis" (ONNX clamps it to the dimension).
_TO_END = 2**63 - 1


class _Stream:
    """The carried state of the streaming (stateful) vocoder graph.

    Each causal layer that looks back ``keep`` samples along ``axis`` prepends its state input
    ``state.<name>`` (the last ``keep`` samples it saw in earlier chunks; zeros at the start of
    an utterance, which is exactly the zero left padding of the single pass) and exposes the
    last ``keep`` samples of that concatenation as ``next.<name>``. States are declared in
    graph order; the outputs follow ``wav`` in the same order.
    """

    def __init__(self, b: GraphBuilder):
        self.b = b
        self.states: list[tuple[str, str, object, list[int]]] = []  # (name, next tensor, dtype, shape)

    def carry(self, name: str, x: str, shape: Sequence[int], axis: int = 2) -> str:
        """concat(state.<name> of ``shape``, x) along ``axis``; registers its last shape[axis] samples."""
        keep = int(shape[axis])
        s = self.b.input(f"state.{name}", np.float32, list(shape))
        xc = self.b.concat([s, x], axis=axis)
        nxt = self.b.slice(xc, [-keep], [_TO_END], [axis])
        self.states.append((name, nxt, np.float32, list(shape)))
        return xc

    def outputs(self) -> None:
        """Declare every ``next.<name>`` output (call after ``wav``)."""
        for name, nxt, dtype, shape in self.states:
            self.b.output(nxt, f"next.{name}", dtype, shape)


def _causal_conv(
    b: GraphBuilder,
    x: str,
    w: np.ndarray,
    bias: np.ndarray | None,
    dilation: int = 1,
    groups: int = 1,
    stream: _Stream | None = None,
    name: str = "",
) -> str:
    """Causal Conv1d on [1, C, L]: left padding (k-1)*dilation via the Conv ``pads`` attribute,
    or, when streaming, the (k-1)*dilation input samples carried from the previous chunk."""
    k = int(w.shape[-1])
    pad = (k - 1) * dilation
    ins = [x, b.weight(w)] + ([b.weight(bias)] if bias is not None else [])
    if stream is not None and pad > 0:
        cin = int(w.shape[1]) * groups
        ins[0] = stream.carry(name, x, [1, cin, pad])
        pad = 0
    return b.op("Conv", ins, kernel_shape=[k], dilations=[dilation], group=groups, pads=[pad, 0], strides=[1])


def _causal_conv_transpose(
    b: GraphBuilder, x: str, w: np.ndarray, bias: np.ndarray, stride: int, stream: _Stream | None = None, name: str = ""
) -> str:
    """ConvTranspose1d on [1, Cin, L] -> [1, Cout, L*stride]: the k - stride extra samples trimmed on the right.

    Streaming: an output sample depends on the ceil(k/stride) - 1 previous input samples too
    (one for the decoder's k = 2r); they are carried, and the outputs they alone produce (the
    first m*stride, already emitted by the previous chunk) are dropped.
    """
    k = int(w.shape[-1])
    m = -(-k // stride) - 1
    if stream is not None and m > 0:
        xc = stream.carry(name, x, [1, int(w.shape[0]), m])
        y = b.op("ConvTranspose", [xc, b.weight(w), b.weight(bias)], kernel_shape=[k], strides=[stride])
        return b.slice(y, [m * stride], [-(k - stride)] if k > stride else [_TO_END], [2])
    y = b.op("ConvTranspose", [x, b.weight(w), b.weight(bias)], kernel_shape=[k], strides=[stride])
    if k > stride:
        y = b.slice(y, [0], [-(k - stride)], [2])
    return y


def _snake(b: GraphBuilder, x: str, alpha: np.ndarray, beta: np.ndarray) -> str:
    """SnakeBeta on [1, C, L] with exp(alpha) and 1/(exp(beta)+1e-9) folded to [1, C, 1] constants."""
    a, inv_b = snake_factors(alpha, beta)
    s = b.op("Sin", [b.mul(x, b.weight(a.reshape(1, -1, 1)))])
    return b.add(x, b.mul(b.mul(s, s), b.weight(inv_b.reshape(1, -1, 1))))


def _convnext(b: GraphBuilder, vw: VocoderWeights, x: str, p: str, stream: _Stream | None = None, name: str = "") -> str:
    """ConvNeXt block on [1, C, L] (gamma folded into pwconv2)."""
    h = _causal_conv(
        b, x, vw.t(f"{p}.dwconv.conv.weight"), vw.t(f"{p}.dwconv.conv.bias"), groups=vw.config.latent_dim,
        stream=stream, name=name,
    )
    h = b.transpose(h, [0, 2, 1])
    h = b.op(
        "LayerNormalization",
        [h, b.weight(vw.t(f"{p}.norm.weight")), b.weight(vw.t(f"{p}.norm.bias"))],
        axis=-1,
        epsilon=CONVNEXT_LN_EPS,
    )
    h = b.linear(h, vw.t(f"{p}.pwconv1.weight"), vw.t(f"{p}.pwconv1.bias"))
    h = b.gelu_exact(h)
    g = vw.t(f"{p}.gamma").astype(np.float64)
    h = b.linear(h, g[:, None] * vw.t(f"{p}.pwconv2.weight"), g * vw.t(f"{p}.pwconv2.bias"))
    return b.add(x, b.transpose(h, [0, 2, 1]))


def _rope(b: GraphBuilder, x: str, cos: str, sin: str, half: int) -> str:
    """Rotate-half RoPE on [1, heads, T, head_dim]: x*cos + cat(-x2, x1)*sin."""
    x1 = b.slice(x, [0], [half], [3])
    x2 = b.slice(x, [half], [2 * half], [3])
    rot = b.concat([b.op("Neg", [x2]), x1], axis=3)
    return b.add(b.mul(x, cos), b.mul(rot, sin))


def _attention(
    b: GraphBuilder, vw: VocoderWeights, h: str, i: int, cos: str, sin: str, mask: str, stream: _Stream | None = None
) -> str:
    """Sliding-window self-attention of layer i on [1, T, H] (GQA and 1/sqrt(head_dim) folded into weights,
    LayerScale folded into o_proj). Returns the scaled attention output [1, T, H].

    Streaming: the rotated keys and the values of the last sliding_window - 1 frames are carried
    (``state.layer<i>.k`` / ``.v`` [1, heads, sliding_window - 1, head_dim]) and the new frames'
    queries attend over them and themselves; ``mask`` [T, sliding_window - 1 + T] hides the
    slots before the utterance and outside the window."""
    c = vw.config
    p = f"pre_transformer.layers.{i}"
    nh, hd, rep = c.num_attention_heads, c.head_dim, c.num_attention_heads // c.num_key_value_heads

    def expand_kv(w):  # repeat_kv folded: head j uses kv head j // rep
        return np.repeat(w.reshape(c.num_key_value_heads, hd, -1), rep, axis=0).reshape(nh * hd, -1)

    wq = vw.t(f"{p}.self_attn.q_proj.weight").astype(np.float64) * hd**-0.5
    wk = expand_kv(vw.t(f"{p}.self_attn.k_proj.weight"))
    wv = expand_kv(vw.t(f"{p}.self_attn.v_proj.weight"))
    ls = vw.t(f"{p}.self_attn_layer_scale.scale").astype(np.float64)
    wo = ls[:, None] * vw.t(f"{p}.self_attn.o_proj.weight")

    def heads(w):
        y = b.reshape(b.linear(h, w), [1, -1, nh, hd])
        return b.transpose(y, [0, 2, 1, 3])  # [1, nh, T, hd]

    q = _rope(b, heads(wq), cos, sin, hd // 2)
    k = _rope(b, heads(wk), cos, sin, hd // 2)
    v = heads(wv)
    if stream is not None:
        kv_shape = [1, nh, c.sliding_window - 1, hd]
        k = stream.carry(f"layer{i}.k", k, kv_shape)
        v = stream.carry(f"layer{i}.v", v, kv_shape)
    scores = b.add(b.matmul(q, b.transpose(k, [0, 1, 3, 2])), mask)  # [1, nh, T, keys]
    probs = b.softmax_f32(scores, axis=-1)
    o = b.transpose(b.matmul(probs, v), [0, 2, 1, 3])
    o = b.reshape(o, [1, -1, nh * hd])
    return b.linear(o, wo)


def _mlp(b: GraphBuilder, vw: VocoderWeights, h: str, i: int) -> str:
    """SwiGLU MLP of layer i on [1, T, H] with the LayerScale folded into down_proj."""
    p = f"pre_transformer.layers.{i}"
    gate = b.silu(b.linear(h, vw.t(f"{p}.mlp.gate_proj.weight")))
    up = b.linear(h, vw.t(f"{p}.mlp.up_proj.weight"))
    ls = vw.t(f"{p}.mlp_layer_scale.scale").astype(np.float64)
    return b.linear(b.mul(gate, up), ls[:, None] * vw.t(f"{p}.mlp.down_proj.weight"))


def build_vocoder_graph(vw: VocoderWeights, stateful: bool = False) -> onnx.ModelProto:
    """The whole vocoder as one float32 ONNX graph (opset 17).

    Input ``codes`` int64 [1, num_quantizers, "frames"] (values in [0, codebook_size); frames >=
    1); output ``wav`` float32 [1, "samples"] with samples = frames * samples_per_frame (1920),
    in [-1, 1]. Always float32, whatever the bundle's LM dtype.

    ``stateful=True`` builds the streaming decoder (``vocoder_stream.onnx``): after ``codes``
    (the chunk's new frames only) come the carried states ``state.<name>`` (float32, fixed
    shapes, :class:`_Stream`; ``state.position`` int64 [1] = frames decoded so far), and after
    ``wav`` (the chunk's samples) their next values ``next.<name>`` in the same order. All-zero
    states start an utterance; feeding each chunk the previous chunk's ``next.*`` makes the
    concatenated chunks equal one single pass over the whole utterance (up to float rounding),
    for any chunk lengths. The carried state: each causal conv's last (k-1)*dilation input
    samples, each transposed conv's last input sample, the transformer's rotated keys and values
    of the last sliding_window - 1 frames per layer, and the position.

    Export-time folding (exact up to float rounding): the 16 codebooks with their cluster_usage
    clamp and group output projections into one table [16 * 2048, codebook_dim] gathered at
    ``codes + k * 2048`` and summed; 1/sqrt(head_dim) into q_proj; repeat_kv (GQA) into k/v_proj;
    LayerScales into o_proj/down_proj; ConvNeXt gamma into pwconv2; SnakeBeta's exp(alpha) and
    1/(exp(beta)+1e-9). RoPE angles and the sliding-window mask are computed in-graph from the
    symbolic length (Shape -> Gather -> Range; the mask adds -1e9 where key > query or
    query - key >= sliding_window, and when streaming also on key slots before the utterance);
    no NaN guards, no data-dependent shapes, no allowzero Reshape, axes always rank-1.
    Convolutions are causal through left ``pads`` (or carried samples); transposed convolutions
    trim on the right with Slice.
    """
    c = vw.config
    b = GraphBuilder("herald_vocoder_stream" if stateful else "herald_vocoder", np.float32)
    codes = b.input("codes", np.int64, [1, c.num_quantizers, "frames"])
    st = _Stream(b) if stateful else None
    i64 = lambda v: b.const(np.asarray(v, dtype=np.int64))  # noqa: E731  (rank-0 int64 constant)
    past = c.sliding_window - 1

    # -- symbolic length, positions, RoPE tables, mask
    with b.scope("pos"):
        t_len = b.op("Gather", [b.op("Shape", [codes]), i64(2)], axis=0)  # rank 0
        if st is None:
            pos = b.op("Range", [i64(0), t_len, i64(1)])
        else:
            p_in = b.input("state.position", np.int64, [1])
            # Range(0, T) + position rather than Range(position, position + T): a runtime that
            # tracks shapes symbolically (tract) then still knows the length is the frame count
            # (a data-dependent Range start would give it a new, unknown length, and every shape
            # downstream would lose its concrete value in a plan built for a fixed chunk length)
            pos = b.add(b.op("Range", [i64(0), t_len, i64(1)]), p_in)
            # next position = position + frames, counted from the data (every code is >= 0)
            # rather than from Shape: a runtime that folds shape arithmetic symbolically (tract)
            # would otherwise return an expression in the symbol instead of a number
            row = b.slice(codes, [0], [1], [1])  # [1, 1, T]
            count = b.op("ReduceSum", [b.cast(b.op("Greater", [row, i64([-1])]), np.int64), b.ints([1, 2])], keepdims=0)
            st.states.append(("position", b.add(p_in, count), np.int64, [1]))
        posf = b.unsqueeze(b.cast(pos, np.float32), [1])  # [T, 1]
        inv = rope_inv_freq(c.head_dim, c.rope_theta)
        ang = b.mul(posf, b.weight(np.concatenate([inv, inv])[None, :]))  # [T, head_dim]
        cos, sin = b.op("Cos", [ang]), b.op("Sin", [ang])
        if st is None:
            d = b.sub(b.unsqueeze(pos, [1]), b.unsqueeze(pos, [0]))  # [T, T] = query - key
            future = b.cast(b.op("Less", [d, b.ints([0])]), np.float32)
            too_old = b.cast(b.op("Greater", [d, b.ints([c.sliding_window - 1])]), np.float32)
            mask = b.mul(b.add(future, too_old), b.scalar(MASK_NEG))  # [T, T]
        else:
            # key slot j holds position p0 - past + j; query i has position p0 + i
            kj = b.op("Range", [i64(0), b.add(t_len, i64(past)), i64(1)])  # [past + T]
            qi = b.op("Range", [i64(0), t_len, i64(1)])  # [T]
            d = b.sub(b.unsqueeze(kj, [0]), b.unsqueeze(qi, [1]))  # [T, past + T] = j - i
            future = b.cast(b.op("Greater", [d, b.ints([past])]), np.float32)
            too_old = b.cast(b.op("Less", [d, b.ints([0])]), np.float32)
            before = b.cast(b.op("Less", [kj, b.sub(i64([past]), p_in)]), np.float32)  # [past + T]
            mask = b.mul(b.add(b.add(future, too_old), before), b.scalar(MASK_NEG))  # [T, past + T]

    # -- RVQ dequantisation: one folded table
    with b.scope("rvq"):
        table = b.weight(folded_codebook_table(vw), name="rvq/folded_codebooks")
        offs = (np.arange(c.num_quantizers, dtype=np.int64) * c.codebook_size).reshape(1, -1, 1)
        idx = b.add(codes, b.const(offs))
        rows = b.op("Gather", [table, idx], axis=0)  # [1, nq, T, cd]
        x = b.op("ReduceSum", [rows, b.ints([1])], keepdims=0)  # [1, T, cd]
        x = b.transpose(x, [0, 2, 1])  # [1, cd, T]

    with b.scope("pre_conv"):
        x = _causal_conv(b, x, vw.t("pre_conv.conv.weight"), vw.t("pre_conv.conv.bias"), stream=st, name="pre_conv")

    with b.scope("pre_transformer"):
        h = b.transpose(x, [0, 2, 1])  # [1, T, latent]
        h = b.linear(h, vw.t("pre_transformer.input_proj.weight"), vw.t("pre_transformer.input_proj.bias"))
        for i in range(c.num_hidden_layers):
            with b.scope(f"layer{i}"):
                p = f"pre_transformer.layers.{i}"
                hn = b.rms_norm(h, vw.t(f"{p}.input_layernorm.weight"), c.rms_norm_eps)
                h = b.add(h, _attention(b, vw, hn, i, cos, sin, mask, stream=st))
                m = _mlp(b, vw, b.rms_norm(h, vw.t(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps), i)
                h = b.add(h, m)
        h = b.rms_norm(h, vw.t("pre_transformer.norm.weight"), c.rms_norm_eps)
        h = b.linear(h, vw.t("pre_transformer.output_proj.weight"), vw.t("pre_transformer.output_proj.bias"))
        x = b.transpose(h, [0, 2, 1])  # [1, latent, T]

    for i, f in enumerate(c.upsampling_ratios):
        with b.scope(f"upsample{i}"):
            x = _causal_conv_transpose(
                b, x, vw.t(f"upsample.{i}.0.conv.weight"), vw.t(f"upsample.{i}.0.conv.bias"), f,
                stream=st, name=f"upsample{i}.conv",
            )
            x = _convnext(b, vw, x, f"upsample.{i}.1", stream=st, name=f"upsample{i}.dwconv")

    with b.scope("decoder0"):
        x = _causal_conv(b, x, vw.t("decoder.0.conv.weight"), vw.t("decoder.0.conv.bias"), stream=st, name="decoder0")
    for bi, (_cin, _cout, r) in enumerate(c.block_dims(), start=1):
        with b.scope(f"block{bi}"):
            bp = f"decoder.{bi}.block"
            x = _snake(b, x, vw.t(f"{bp}.0.alpha"), vw.t(f"{bp}.0.beta"))
            x = _causal_conv_transpose(
                b, x, vw.t(f"{bp}.1.conv.weight"), vw.t(f"{bp}.1.conv.bias"), r, stream=st, name=f"block{bi}.up"
            )
            for u, dil in enumerate(RESIDUAL_DILATIONS):
                rp = f"{bp}.{u + 2}"
                y = _snake(b, x, vw.t(f"{rp}.act1.alpha"), vw.t(f"{rp}.act1.beta"))
                y = _causal_conv(
                    b, y, vw.t(f"{rp}.conv1.conv.weight"), vw.t(f"{rp}.conv1.conv.bias"), dilation=dil,
                    stream=st, name=f"block{bi}.res{u}",
                )
                y = _snake(b, y, vw.t(f"{rp}.act2.alpha"), vw.t(f"{rp}.act2.beta"))
                y = _causal_conv(b, y, vw.t(f"{rp}.conv2.conv.weight"), vw.t(f"{rp}.conv2.conv.bias"))
                x = b.add(x, y)
    nb = len(c.upsample_rates)
    with b.scope("out"):
        x = _snake(b, x, vw.t(f"decoder.{nb + 1}.alpha"), vw.t(f"decoder.{nb + 1}.beta"))
        x = _causal_conv(
            b, x, vw.t(f"decoder.{nb + 2}.conv.weight"), vw.t(f"decoder.{nb + 2}.conv.bias"), stream=st, name="out"
        )
        x = b.op("Clip", [x, b.const(np.asarray(-1.0, dtype=np.float32)), b.const(np.asarray(1.0, dtype=np.float32))])
        wav = b.reshape(x, [1, -1])
    b.output(wav, "wav", np.float32, [1, "samples"])
    if st is not None:
        st.outputs()
    doc = (
        f"Qwen3-TTS 12 Hz vocoder (Code2Wav): codes int64 [1,{c.num_quantizers},frames] -> wav float32 "
        f"[1, frames*{c.samples_per_frame}] at {c.sample_rate} Hz, causal, sliding window {c.sliding_window}"
        + (", streaming: carried state.* inputs, next.* outputs." if stateful else ".")
    )
    return b.model(doc)


# ---------------------------------------------------------------------------------------------
# numpy oracle (float64, straight from the unfolded checkpoint tensors)
# ---------------------------------------------------------------------------------------------


def _np_conv1d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, dilation: int = 1, groups: int = 1) -> np.ndarray:
    """Causal Conv1d, stride 1: x [Cin, L], w [Cout, Cin/groups, k] -> [Cout, L] (zero left padding)."""
    k = w.shape[-1]
    pad = (k - 1) * dilation
    L = x.shape[1]
    xp = np.concatenate([np.zeros((x.shape[0], pad)), x], axis=1)
    out = np.zeros((w.shape[0], L))
    for j in range(k):
        seg = xp[:, j * dilation : j * dilation + L]
        if groups == 1:
            out += w[:, :, j] @ seg
        elif groups == x.shape[0] == w.shape[0] and w.shape[1] == 1:  # depthwise
            out += w[:, 0, j][:, None] * seg
        else:
            raise ValueError("only groups=1 and depthwise convolutions occur in this decoder")
    if bias is not None:
        out += bias[:, None]
    return out


def _np_conv_transpose1d(x: np.ndarray, w: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """ConvTranspose1d then the right trim of k - stride: x [Cin, L], w [Cin, Cout, k] -> [Cout, L*stride]."""
    cin, cout, k = w.shape
    L = x.shape[1]
    full = np.zeros((cout, (L - 1) * stride + k))
    for j in range(k):
        full[:, j : j + (L - 1) * stride + 1 : stride] += w[:, :, j].T @ x
    full += bias[:, None]
    return full[:, : full.shape[1] - (k - stride)]


def _np_snake(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    a = np.exp(alpha)[:, None]
    bb = np.exp(beta)[:, None]
    return x + (1.0 / (bb + SNAKE_EPS)) * np.sin(x * a) ** 2


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


_erf = np.frompyfunc(math.erf, 1, 1)


def _np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def vocoder_numpy(vw: VocoderWeights, codes: np.ndarray, trace: dict | None = None) -> np.ndarray:
    """Decode codes [num_quantizers, T] (ints in [0, codebook_size)) to wav [T * samples_per_frame], float64.

    A deliberately plain transcription of the official module code in float64, from the
    checkpoint tensors as stored (no folding): per-codebook dequantisation and group
    projections, explicit repeat_kv, rotate-half RoPE, a -inf sliding-window mask, LayerScale,
    ConvNeXt, SnakeBeta with exp() applied here, transposed convolutions with the right trim.
    It is the independent oracle for :func:`build_vocoder_graph`. Raises ValueError on codes of
    the wrong shape, dtype or range. ``trace``, if given, receives intermediate activations by
    stage name (a debugging aid for scaling random weights).
    """
    tr = trace if trace is not None else {}
    c = vw.config
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[0] != c.num_quantizers or codes.shape[1] < 1:
        raise ValueError(f"codes must be [{c.num_quantizers}, T>=1], got {codes.shape}")
    if not np.issubdtype(codes.dtype, np.integer) or codes.min() < 0 or codes.max() >= c.codebook_size:
        raise ValueError(f"codes must be integers in [0, {c.codebook_size})")
    T = codes.shape[1]

    def t(name):
        return vw.t(name).astype(np.float64)

    # 1. RVQ: SplitResidualVectorQuantizer.decode
    x = np.zeros((T, c.codebook_dim))
    for grp, first, n in (("rvq_first", 0, N_SEMANTIC), ("rvq_rest", N_SEMANTIC, c.num_quantizers - N_SEMANTIC)):
        acc = np.zeros((T, c.quantizer_dim))
        for i in range(n):
            p = f"quantizer.{grp}.vq.layers.{i}._codebook"
            emb = t(f"{p}.embedding_sum") / np.maximum(t(f"{p}.cluster_usage"), CODEBOOK_EPS)[:, None]
            acc += emb[codes[first + i]]
        x += acc @ t(f"quantizer.{grp}.output_proj.weight")[:, :, 0].T
    # 2. pre_conv
    tr["rvq"] = x
    x = _np_conv1d(x.T, t("pre_conv.conv.weight"), t("pre_conv.conv.bias"))  # [latent, T]
    tr["pre_conv"] = x
    # 3. pre_transformer
    h = x.T @ t("pre_transformer.input_proj.weight").T + t("pre_transformer.input_proj.bias")  # [T, H]
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inv = rope_inv_freq(hd, c.rope_theta)
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)  # [T, hd]
    qi = np.arange(T)[:, None]
    kj = np.arange(T)[None, :]
    allowed = (kj <= qi) & (kj > qi - c.sliding_window)

    def rotate_half(v):
        return np.concatenate([-v[..., hd // 2 :], v[..., : hd // 2]], axis=-1)

    for i in range(c.num_hidden_layers):
        p = f"pre_transformer.layers.{i}"
        r = h
        hn = _np_rms(h, t(f"{p}.input_layernorm.weight"), c.rms_norm_eps)
        q = (hn @ t(f"{p}.self_attn.q_proj.weight").T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (hn @ t(f"{p}.self_attn.k_proj.weight").T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (hn @ t(f"{p}.self_attn.v_proj.weight").T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=0)  # repeat_kv
        v = np.repeat(v, nh // nkv, axis=0)
        s = (q @ k.transpose(0, 2, 1)) * hd**-0.5
        s = np.where(allowed[None], s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        pr = s / s.sum(axis=-1, keepdims=True)
        o = (pr @ v).transpose(1, 0, 2).reshape(T, nh * hd) @ t(f"{p}.self_attn.o_proj.weight").T
        h = r + t(f"{p}.self_attn_layer_scale.scale") * o
        r = h
        hn = _np_rms(h, t(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps)
        g = hn @ t(f"{p}.mlp.gate_proj.weight").T
        u = hn @ t(f"{p}.mlp.up_proj.weight").T
        m = ((g / (1.0 + np.exp(-g))) * u) @ t(f"{p}.mlp.down_proj.weight").T
        h = r + t(f"{p}.mlp_layer_scale.scale") * m
    h = _np_rms(h, t("pre_transformer.norm.weight"), c.rms_norm_eps)
    h = h @ t("pre_transformer.output_proj.weight").T + t("pre_transformer.output_proj.bias")
    x = h.T  # [latent, T]
    tr["pre_transformer"] = x
    # 4. upsample: ConvTranspose + ConvNeXt
    for i, f in enumerate(c.upsampling_ratios):
        up = f"upsample.{i}"
        x = _np_conv_transpose1d(x, t(f"{up}.0.conv.weight"), t(f"{up}.0.conv.bias"), f)
        y = _np_conv1d(x, t(f"{up}.1.dwconv.conv.weight"), t(f"{up}.1.dwconv.conv.bias"), groups=x.shape[0]).T
        mu = y.mean(axis=-1, keepdims=True)
        var = ((y - mu) ** 2).mean(axis=-1, keepdims=True)
        y = (y - mu) / np.sqrt(var + CONVNEXT_LN_EPS) * t(f"{up}.1.norm.weight") + t(f"{up}.1.norm.bias")
        y = _np_gelu(y @ t(f"{up}.1.pwconv1.weight").T + t(f"{up}.1.pwconv1.bias"))
        y = y @ t(f"{up}.1.pwconv2.weight").T + t(f"{up}.1.pwconv2.bias")
        x = x + (t(f"{up}.1.gamma") * y).T
        tr[f"upsample{i}"] = x
    # 5.-7. decoder
    x = _np_conv1d(x, t("decoder.0.conv.weight"), t("decoder.0.conv.bias"))
    tr["decoder0"] = x
    for bi, (_cin, _cout, r) in enumerate(c.block_dims(), start=1):
        bp = f"decoder.{bi}.block"
        x = _np_snake(x, t(f"{bp}.0.alpha"), t(f"{bp}.0.beta"))
        x = _np_conv_transpose1d(x, t(f"{bp}.1.conv.weight"), t(f"{bp}.1.conv.bias"), r)
        for u, dil in enumerate(RESIDUAL_DILATIONS):
            rp = f"{bp}.{u + 2}"
            y = _np_snake(x, t(f"{rp}.act1.alpha"), t(f"{rp}.act1.beta"))
            y = _np_conv1d(y, t(f"{rp}.conv1.conv.weight"), t(f"{rp}.conv1.conv.bias"), dilation=dil)
            y = _np_snake(y, t(f"{rp}.act2.alpha"), t(f"{rp}.act2.beta"))
            y = _np_conv1d(y, t(f"{rp}.conv2.conv.weight"), t(f"{rp}.conv2.conv.bias"))
            x = x + y
        tr[f"block{bi}"] = x
    nb = len(c.upsample_rates)
    x = _np_snake(x, t(f"decoder.{nb + 1}.alpha"), t(f"decoder.{nb + 1}.beta"))
    x = _np_conv1d(x, t(f"decoder.{nb + 2}.conv.weight"), t(f"decoder.{nb + 2}.conv.bias"))
    tr["pre_clip"] = x
    return np.clip(x[0], -1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Manifest facts
# ---------------------------------------------------------------------------------------------


def conv_history_frames(c: VocoderConfig) -> float:
    """Frames of history the convolution stack after the transformer sees (exact, fractional).

    Sum over the causal layers of (effective kernel - 1) input samples, each converted to frames
    at that layer's rate; a transposed conv with kernel 2r/stride r looks 1 input sample back, one
    with kernel == stride none. Official decoder: 9.38 frames.
    """
    rate = 1  # samples per frame at the current stage
    hist = 0.0
    for f in c.upsampling_ratios:
        rate *= f
        hist += (CONVNEXT_KERNEL - 1) / rate
    hist += (DECODER_IN_KERNEL - 1) / rate
    for r in c.upsample_rates:
        hist += 1 / rate  # transposed conv k = 2r, stride r
        rate *= r
        hist += sum((RESIDUAL_KERNEL - 1) * d for d in RESIDUAL_DILATIONS) / rate
    hist += (DECODER_OUT_KERNEL - 1) / rate
    return hist


def vocoder_facts(vw: VocoderWeights) -> dict:
    """Facts about the vocoder for the bundle manifest.

    - ``sample_rate`` (Hz, ``output_sample_rate``), ``samples_per_frame`` (``decode_upsample_rate``),
      ``num_quantizers``, ``codebook_size``;
    - ``sliding_window`` (frames a query attends to, itself included) and ``left_context_frames``
      (herald's default windowed-decoding context = the sliding window);
    - ``transformer_layers``;
    - ``conv_receptive_field_frames``: ceil of the history of the convolution stack after the
      transformer (:func:`conv_history_frames`; 10 for the official decoder);
    - ``receptive_field_frames``: pre_conv (2) + layers x (sliding_window - 1) + the conv history,
      rounded up: with at least this much left context windowed decoding is exact.
    """
    c = vw.config
    conv = conv_history_frames(c)
    pre = PRE_CONV_KERNEL - 1
    return {
        "sample_rate": c.sample_rate,
        "samples_per_frame": c.samples_per_frame,
        "num_quantizers": c.num_quantizers,
        "codebook_size": c.codebook_size,
        "sliding_window": c.sliding_window,
        "left_context_frames": c.sliding_window,
        "transformer_layers": c.num_hidden_layers,
        "conv_receptive_field_frames": int(math.ceil(conv)),
        "receptive_field_frames": int(math.ceil(pre + c.num_hidden_layers * (c.sliding_window - 1) + conv)),
    }


# ---------------------------------------------------------------------------------------------
# Windowed decoding (the runtime's scheme, for tests and measurements)
# ---------------------------------------------------------------------------------------------


def windowed_plan(
    total_frames: int, ramp: Sequence[int] = DEFAULT_RAMP, left_context: int = DEFAULT_LEFT_CONTEXT
) -> list[tuple[int, int, int]]:
    """The chunks of windowed decoding: a list of (window_start, chunk_start, chunk_end) frames.

    Chunk i has ``ramp[i]`` frames (the last ramp entry repeats; the final chunk may be
    shorter) and is decoded from ``window_start = max(0, chunk_start - left_context)``.
    Raises ValueError on an empty ramp, non-positive entries or a negative left context.
    """
    if not ramp or any(int(n) < 1 for n in ramp):
        raise ValueError(f"ramp must be a non-empty list of positive frame counts, got {list(ramp)}")
    if left_context < 0:
        raise ValueError(f"left_context must be >= 0, got {left_context}")
    plan = []
    s = 0
    i = 0
    while s < total_frames:
        n = int(ramp[min(i, len(ramp) - 1)])
        e = min(s + n, total_frames)
        plan.append((max(0, s - left_context), s, e))
        s, i = e, i + 1
    return plan


def decode_windowed(
    run: Callable[[np.ndarray], np.ndarray],
    codes: np.ndarray,
    ramp: Sequence[int] = DEFAULT_RAMP,
    left_context: int = DEFAULT_LEFT_CONTEXT,
    samples_per_frame: int = 1920,
) -> np.ndarray:
    """Decode codes [1, Q, T] (or [Q, T]) chunk by chunk as herald's runtime does.

    Each chunk of n new frames (sizes from ``ramp``, see :func:`windowed_plan`) is decoded by
    ``run`` (codes int64 [1, Q, W] -> wav [1, W * samples_per_frame] or flat) together with up
    to ``left_context`` earlier frames, and only the last ``n * samples_per_frame`` samples are
    kept. Returns float32 [T * samples_per_frame]. Raises ValueError if ``run`` returns a length
    other than W * samples_per_frame.
    """
    codes = np.asarray(codes)
    if codes.ndim == 2:
        codes = codes[None]
    if codes.ndim != 3 or codes.shape[0] != 1:
        raise ValueError(f"codes must be [1, Q, T] or [Q, T], got {codes.shape}")
    out = []
    for w0, s, e in windowed_plan(codes.shape[2], ramp, left_context):
        wav = np.asarray(run(np.ascontiguousarray(codes[:, :, w0:e]))).reshape(-1)
        if wav.shape[0] != (e - w0) * samples_per_frame:
            raise ValueError(
                f"run returned {wav.shape[0]} samples for {e - w0} frames, expected {(e - w0) * samples_per_frame}"
            )
        out.append(wav[-(e - s) * samples_per_frame :])
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(sum(ref^2) / sum((ref - test)^2)) in dB (inf when identical)."""
    ref = np.asarray(reference, dtype=np.float64).reshape(-1)
    err = ref - np.asarray(test, dtype=np.float64).reshape(-1)
    num, den = float(np.sum(ref * ref)), float(np.sum(err * err))
    if den == 0.0:
        return math.inf
    return 10.0 * math.log10(num / den) if num > 0 else -math.inf


def windowed_snr_db(
    run: Callable[[np.ndarray], np.ndarray],
    codes: np.ndarray,
    ramp: Sequence[int] = DEFAULT_RAMP,
    left_context: int = DEFAULT_LEFT_CONTEXT,
    samples_per_frame: int = 1920,
) -> float:
    """SNR (dB) of windowed decoding (:func:`decode_windowed`) against one single pass of ``run``."""
    codes = np.asarray(codes)
    if codes.ndim == 2:
        codes = codes[None]
    full = np.asarray(run(codes)).reshape(-1)
    win = decode_windowed(run, codes, ramp, left_context, samples_per_frame)
    return snr_db(full, win)


# ---------------------------------------------------------------------------------------------
# Stateful (streaming) decoding
# ---------------------------------------------------------------------------------------------


def stream_states(model: onnx.ModelProto) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The carried states of a streaming vocoder graph: (name without ``state.``, dtype, shape), in input order."""
    from onnx import helper

    out = []
    for vi in model.graph.input:
        if vi.name.startswith("state."):
            tt = vi.type.tensor_type
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
            out.append((vi.name[len("state."):], dt, tuple(int(d.dim_value) for d in tt.shape.dim)))
    return out


def stream_plan(total_frames: int, ramp: Sequence[int] = DEFAULT_RAMP) -> list[tuple[int, int]]:
    """Chunks (start, end) of stateful decoding: ``ramp[i]`` frames each, the last entry repeating."""
    return [(s, e) for _w0, s, e in windowed_plan(total_frames, ramp, 0)]


def decode_stateful(
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    states: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
    codes: np.ndarray,
    ramp: Sequence[int] = DEFAULT_RAMP,
    samples_per_frame: int = 1920,
) -> np.ndarray:
    """Decode codes [1, Q, T] (or [Q, T]) chunk by chunk through a streaming graph, carrying its state.

    ``run`` maps the feeds (``codes`` [1, Q, n] and every ``state.<name>``) to the outputs
    (``wav`` and every ``next.<name>``); ``states`` is :func:`stream_states` of the graph. The
    states start at zero; each chunk gets the previous chunk's ``next.*``. Returns float32
    [T * samples_per_frame]. Raises ValueError when ``run`` returns a wrong length or misses a
    state.
    """
    codes = np.asarray(codes)
    if codes.ndim == 2:
        codes = codes[None]
    if codes.ndim != 3 or codes.shape[0] != 1:
        raise ValueError(f"codes must be [1, Q, T] or [Q, T], got {codes.shape}")
    cur = {f"state.{n}": np.zeros(shape, dtype=dt) for n, dt, shape in states}
    out = []
    for s, e in stream_plan(codes.shape[2], ramp):
        res = run({"codes": np.ascontiguousarray(codes[:, :, s:e], dtype=np.int64), **cur})
        wav = np.asarray(res["wav"]).reshape(-1)
        if wav.shape[0] != (e - s) * samples_per_frame:
            raise ValueError(f"run returned {wav.shape[0]} samples for {e - s} frames")
        out.append(wav)
        for n, _dt, _shape in states:
            if f"next.{n}" not in res:
                raise ValueError(f"run did not return next.{n}")
            cur[f"state.{n}"] = np.asarray(res[f"next.{n}"])
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

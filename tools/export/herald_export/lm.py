"""Step graphs for the talker and the code predictor, and a plain numpy forward for tests.

Both are Qwen3-style decoder stacks (modeling_qwen3_tts.py: ``Qwen3TTSTalkerDecoderLayer`` and
``Qwen3TTSDecoderLayer``): RMSNorm -> q/k/v projections -> per-head RMSNorm on q and k ->
rotate-half RoPE -> GQA attention (scale head_dim^-0.5) -> o_proj -> residual; RMSNorm -> SwiGLU
-> residual; final RMSNorm. The talker's M-RoPE collapses to plain RoPE for TTS (its three
position rows are identical), so both stacks take ordinary cos/sin tables.

Step graph contract (docs/bundle.md "Step graphs"): the host supplies embeddings, cos/sin,
additive masks and the caches; the graph returns logits, the post-norm hidden state and only the
new K/V entries. One graph serves prefill (seq > 1) and decode (seq = 1). GQA reshapes the
query to [KV, group, ...]; K/V are never expanded, and never concatenated with the cache: the
softmax runs over [cache | new] scores and the two weighted sums are added, so no cache-sized
tensor is copied per step, in the graph or on the host.
"""

from __future__ import annotations

import numpy as np
import onnx

from .checkpoint import LMSpec, LMWeights, ModelSpec
from .errors import ExportError
from .onnx_graph import GraphBuilder

#: Additive mask value for hidden keys. Finite (so no runtime ever meets -inf - -inf = NaN) and
#: far below any attention score; exp(-1e9 - max) underflows to exactly 0 in float32.
MASK_FILL = -1e9


def cache_kinds(lm: LMSpec) -> tuple[bool, int | None]:
    """(has full layers, the sliding window or None). All sliding layers must share one window."""
    windows = {w for k, w in lm.layer_kinds if k == "sliding"}
    if len(windows) > 1:
        raise ExportError(lm.name, f"sliding layers with different windows {sorted(windows)} are not supported")
    has_full = any(k == "full" for k, _ in lm.layer_kinds)
    return has_full, (windows.pop() if windows else None)


def _attention(b: GraphBuilder, lm: LMSpec, w: LMWeights, i: int, h, cos, sin, masks, kc, vc):
    """One self-attention block; returns (output [1,S,H], k_new [1,S,KV,D], v_new [1,S,KV,D])."""
    D, Hq, KV = lm.head_dim, lm.heads, lm.kv_heads
    G = Hq // KV
    q = b.linear(h, w.layer(lm, i, "self_attn.q_proj.weight"))
    k = b.linear(h, w.layer(lm, i, "self_attn.k_proj.weight"))
    v = b.linear(h, w.layer(lm, i, "self_attn.v_proj.weight"))
    q = b.rms_norm(b.reshape(q, [0, 0, Hq, D]), w.layer(lm, i, "self_attn.q_norm.weight"), lm.eps)
    k = b.rms_norm(b.reshape(k, [0, 0, KV, D]), w.layer(lm, i, "self_attn.k_norm.weight"), lm.eps)
    v = b.reshape(v, [0, 0, KV, D])

    def rope(x):  # x [1,S,N,D]; cos/sin [1,S,1,D]
        x1 = b.slice(x, [0], [D // 2], [3])
        x2 = b.slice(x, [D // 2], [D], [3])
        rot = b.concat([b.op("Neg", [x2]), x1], axis=3)
        return b.add(b.mul(x, cos), b.mul(rot, sin))

    q, k = rope(q), rope(k)
    # new entries in the cache layout [1, S, KV, D] (position-major: the host keeps one
    # capacity buffer per layer and hands the graph its filled prefix without copying)
    k_new, v_new = k, v
    # query heads h = kv*G + g  (repeat_kv order) -> [1,KV,G*S,D]
    qg = b.reshape(b.transpose(b.reshape(q, [0, 0, KV, G, D]), [0, 2, 3, 1, 4]), [0, 0, -1, D])
    # Attention over [cache | new] without concatenating K/V (no cache-sized copy per step):
    # scores for both parts, one softmax over their concatenation, two weighted sums.
    # Masks come in two blocks, matching the two score blocks, so every dim is a plain symbol
    # (past, seq) and no runtime has to unify "past_seq" with past + seq. Rows are g*S + s:
    # each [1,1,S,.] mask repeats once per query head of the group.
    m_past, m_new = (m if G == 1 else b.concat([m] * G, axis=2) for m in masks)
    s_past = b.matmul(qg, b.transpose(kc, [0, 2, 3, 1]))    # [1,KV,G*S,P]
    s_new = b.matmul(qg, b.transpose(k_new, [0, 2, 3, 1]))  # [1,KV,G*S,S]
    scale = b.scalar(D ** -0.5)
    s_past, s_new = b.mul(s_past, scale), b.mul(s_new, scale)
    if b.wdtype != np.float32:
        s_past, s_new = b.cast(s_past, np.float32), b.cast(s_new, np.float32)
    scores = b.concat([b.add(s_past, m_past), b.add(s_new, m_new)], axis=3)
    probs = b.op("Softmax", [scores], axis=-1)
    if b.wdtype != np.float32:
        probs = b.cast(probs, b.wdtype)
    n_past = b.slice(b.op("Shape", [kc]), [1], [2], [0])     # [P], rank 1
    n_all = b.slice(b.op("Shape", [probs]), [3], [4], [0])   # [P + S]
    p_past = b.op("Slice", [probs, b.ints([0]), n_past, b.ints([3])])
    p_new = b.op("Slice", [probs, n_past, n_all, b.ints([3])])
    ctx = b.add(b.matmul(p_past, b.transpose(vc, [0, 2, 1, 3])),
                b.matmul(p_new, b.transpose(v_new, [0, 2, 1, 3])))   # [1,KV,G*S,D]
    ctx = b.transpose(b.reshape(ctx, [0, 0, G, -1, D]), [0, 3, 1, 2, 4])  # [1,S,KV,G,D]
    ctx = b.reshape(ctx, [0, 0, Hq * D])
    return b.linear(ctx, w.layer(lm, i, "self_attn.o_proj.weight")), k_new, v_new


def _mlp(b: GraphBuilder, lm: LMSpec, w: LMWeights, i: int, h):
    g = b.linear(h, w.layer(lm, i, "mlp.gate_proj.weight"))
    u = b.linear(h, w.layer(lm, i, "mlp.up_proj.weight"))
    return b.linear(b.mul(b.silu(g), u), w.layer(lm, i, "mlp.down_proj.weight"))


def build_step_graph(spec: ModelSpec, w: LMWeights, which: str, dtype=np.float32,
                     quant: str | None = None) -> onnx.ModelProto:
    """The talker (``which="talker"``) or code-predictor (``"code_predictor"``) step graph.

    Inputs (float32 unless noted; ``seq`` = new positions S, ``past`` = filled full-cache length P):
      x [1, seq, H_talker]; cos, sin [1, seq, head_dim];
      mask_full_past [1, 1, seq, past], mask_full_new [1, 1, seq, seq] when the stack has full layers;
      mask_sliding_ring [1, 1, seq, window-1], mask_sliding_new [1, 1, seq, seq] when it has sliding layers;
      head int64 [1] (code predictor only: codebook k+1 uses lm_head[k], k in 0..14);
      k_cache_i, v_cache_i [1, past | window-1, KV, head_dim] in the cache dtype (position-major).
    Outputs: logits float32 [1, seq, vocab]; hidden float32 [1, seq, H] (talker only: post-norm);
      k_new_i, v_new_i [1, seq, KV, head_dim] in the cache dtype (post-norm, post-RoPE keys).
    ``dtype`` is the weight/compute/cache dtype (float32 or float16); RMSNorm and softmax run in
    float32 inside float16 graphs. ``quant`` (``"q4"``/``"q8"``, with ``dtype`` float32) quantizes
    every linear projection (q/k/v/o, gate/up/down, the talker's ``codec_head``, the
    ``small_to_mtp_projection``); the code predictor's stacked ``lm_heads`` (a Gather by ``head``,
    not a constant matmul), the norms and the IO stay float32 (:mod:`herald_export.quant`).
    """
    lm = spec.talker if which == "talker" else spec.predictor
    b = GraphBuilder(which, dtype, quant=quant)
    cdt = b.wdtype
    has_full, window = cache_kinds(lm)
    H_in = spec.talker.hidden
    x = b.input("x", np.float32, [1, "seq", H_in])
    cos_in = b.input("cos", np.float32, [1, "seq", lm.head_dim])
    sin_in = b.input("sin", np.float32, [1, "seq", lm.head_dim])
    masks = {}
    if has_full:
        masks["full"] = (b.input("mask_full_past", np.float32, [1, 1, "seq", "past"]),
                         b.input("mask_full_new", np.float32, [1, 1, "seq", "seq"]))
    if window is not None:
        masks["sliding"] = (b.input("mask_sliding_ring", np.float32, [1, 1, "seq", window - 1]),
                            b.input("mask_sliding_new", np.float32, [1, 1, "seq", "seq"]))
    head = b.input("head", np.int64, [1]) if which == "code_predictor" else None
    caches = []
    for i, (kind, _) in enumerate(lm.layer_kinds):
        L = "past" if kind == "full" else window - 1
        kc = b.input(f"k_cache_{i}", cdt, [1, L, lm.kv_heads, lm.head_dim])
        vc = b.input(f"v_cache_{i}", cdt, [1, L, lm.kv_heads, lm.head_dim])
        caches.append((kc, vc))

    h = b.cast(x, cdt) if cdt != np.float32 else x
    cos = b.unsqueeze(b.cast(cos_in, cdt) if cdt != np.float32 else cos_in, [2])  # [1,S,1,D]
    sin = b.unsqueeze(b.cast(sin_in, cdt) if cdt != np.float32 else sin_in, [2])
    if which == "code_predictor" and spec.has_projection:
        h = b.linear(h, w["talker.code_predictor.small_to_mtp_projection.weight"],
                     w["talker.code_predictor.small_to_mtp_projection.bias"])
    news = []
    for i, (kind, _) in enumerate(lm.layer_kinds):
        with b.scope(f"layer{i}"):
            a_in = b.rms_norm(h, w.layer(lm, i, "input_layernorm.weight"), lm.eps)
            a, kn, vn = _attention(b, lm, w, i, a_in, cos, sin, masks[kind], *caches[i])
            h = b.add(h, a)
            m_in = b.rms_norm(h, w.layer(lm, i, "post_attention_layernorm.weight"), lm.eps)
            h = b.add(h, _mlp(b, lm, w, i, m_in))
            news.append((kn, vn))
    hn = b.rms_norm(h, w[lm.prefix + "norm.weight"], lm.eps)
    if which == "talker":
        logits = b.linear(hn, w["talker.codec_head.weight"])
        vocab = spec.codec_vocab
    else:
        heads = np.stack([w[f"talker.code_predictor.lm_head.{k}.weight"].T for k in range(spec.num_code_groups - 1)])
        sel = b.op("Gather", [b.weight(heads, name="lm_heads"), head], axis=0)   # [1, H_cp, V]
        logits = b.matmul(hn, sel)
        vocab = spec.predictor_vocab
    if cdt != np.float32:
        logits = b.cast(logits, np.float32)
    b.output(logits, "logits", np.float32, [1, "seq", vocab])
    if which == "talker":
        b.output(b.cast(hn, np.float32) if cdt != np.float32 else hn, "hidden", np.float32, [1, "seq", lm.hidden])
    for i, (kn, vn) in enumerate(news):
        b.output(kn, f"k_new_{i}", cdt, [1, "seq", lm.kv_heads, lm.head_dim])
        b.output(vn, f"v_new_{i}", cdt, [1, "seq", lm.kv_heads, lm.head_dim])
    return b.model(doc=f"herald {which} step graph")


# ---------------------------------------------------------------------------------------------
# Host-side helpers shared with the reference decoder and the tests.

def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), head_dim] float32, rotate-half layout (both halves repeat).

    Computed in float32 as transformers' default RoPE does: inv_freq = 1 / theta^(2j/D),
    angle = position * inv_freq, emb = concat(angle, angle).
    """
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def lm_forward_numpy(spec: ModelSpec, w: LMWeights, which: str, x: np.ndarray, head: int | None = None):
    """Plain float64 forward over a whole sequence (no cache), straight from the checkpoint.

    x [S, H_talker] input embeddings at positions 0..S-1. Returns (logits [S, V], hidden [S, H]).
    The independent oracle for the step graphs: causal (and sliding-window) masking is applied
    directly on positions, exactly as Hugging Face's masks do.
    """
    lm = spec.talker if which == "talker" else spec.predictor
    f = lambda a: np.asarray(a, dtype=np.float64)

    def rms(v, wt):
        return f(wt) * (v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + lm.eps))

    h = f(x)
    if which == "code_predictor" and spec.has_projection:
        h = h @ f(w["talker.code_predictor.small_to_mtp_projection.weight"]).T + f(w["talker.code_predictor.small_to_mtp_projection.bias"])
    S = h.shape[0]
    cos, sin = rope_tables(np.arange(S), lm.head_dim, lm.rope_theta)
    cos, sin = f(cos)[:, None, :], f(sin)[:, None, :]
    D, G = lm.head_dim, lm.heads // lm.kv_heads
    qpos, kpos = np.arange(S)[:, None], np.arange(S)[None, :]

    def rot(v):
        return np.concatenate([-v[..., D // 2:], v[..., : D // 2]], axis=-1)

    for i, (kind, win) in enumerate(lm.layer_kinds):
        L = lambda leaf: f(w.layer(lm, i, leaf))
        a = rms(h, L("input_layernorm.weight"))
        q = rms((a @ L("self_attn.q_proj.weight").T).reshape(S, lm.heads, D), L("self_attn.q_norm.weight"))
        k = rms((a @ L("self_attn.k_proj.weight").T).reshape(S, lm.kv_heads, D), L("self_attn.k_norm.weight"))
        v = (a @ L("self_attn.v_proj.weight").T).reshape(S, lm.kv_heads, D)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        allowed = kpos <= qpos
        if kind == "sliding":
            allowed &= kpos > qpos - win
        out = np.empty((S, lm.heads, D))
        for hq in range(lm.heads):
            kv = hq // G
            sc = (q[:, hq] @ k[:, kv].T) * D ** -0.5
            sc = np.where(allowed, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[:, hq] = p @ v[:, kv]
        h = h + out.reshape(S, -1) @ L("self_attn.o_proj.weight").T
        m = rms(h, L("post_attention_layernorm.weight"))
        g, u = m @ L("mlp.gate_proj.weight").T, m @ L("mlp.up_proj.weight").T
        h = h + ((g / (1 + np.exp(-g))) * u) @ L("mlp.down_proj.weight").T
    hn = rms(h, w[lm.prefix + "norm.weight"])
    if which == "talker":
        logits = hn @ f(w["talker.codec_head.weight"]).T
    else:
        logits = hn @ f(w[f"talker.code_predictor.lm_head.{head}.weight"]).T
    return logits, hn

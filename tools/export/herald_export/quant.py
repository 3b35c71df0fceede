"""Weight-only quantization of the step graphs' linear projections (``--dtype q4`` / ``q8``).

Two formats, both symmetric (no zero points), both applied one weight matrix at a time (the
caller holds one float32 matrix and its quantized form, never a whole model):

``q4`` -- com.microsoft ``MatMulNBits`` (bits 4, block_size 32), the layout tract maps onto its
    Q4_0 block-quant format. A torch Linear weight ``w [N, K]`` (out, in) is cut into blocks of
    32 along K; each block has one scale ``s`` and 32 codes ``q in 0..15`` with
    ``w ~= (q - 8) * s``. ``B`` is uint8 ``[N, ceil(K/32), 16]``: element ``i`` of a block sits in
    byte ``i // 2``, the low nibble for even ``i`` (onnxruntime's contrib-op spec; tract-onnx
    reads the same). ``scales`` is float32 ``[N * ceil(K/32)]``, row-major over (n, block).
    Every scale is a float16 value widened to float32, because tract's Q4_0 stores float16
    scales: onnxruntime and tract then dequantize to bit-identical weights. When K is not a
    multiple of 32 the last block is padded with zero weights (code 8); both runtimes ignore the
    padding (onnxruntime by its K attribute, tract by falling back to a float32 weight for such
    a matrix, so only K % 32 == 0 keeps the int4 weight in memory there).

    The scale of each block is the one, among a few candidates, that minimises the block's
    squared error: ``absmax / 7`` (the largest magnitude maps to +-7), ``-m / 8`` (GGML Q4_0: the
    signed extreme ``m`` maps to code 0, i.e. -8, the opposite side clips at +7) and a grid of
    scales between and just past them (``Q4_SCALE_DIVISORS``). Measured on N(0, 1/K) weights
    (the random presets; K 64..3072), relative weight error RMS(w - w~) / RMS(w): absmax/7 0.097,
    GGML 0.086, this search 0.082 (on Student-t(3) weights, heavier tails: 0.143, 0.126, 0.123).
    ``tests/test_quant.py`` checks the search is never worse than either.

``q8`` -- int8 per output channel, ``s[n] = absmax(w[n, :]) / 127``, ``q = round(w / s)`` in
    -127..127, stored transposed as ``[K, N]`` int8 for ``MatMulInteger``. Activations are
    quantized per tensor at run time, symmetric int8 with no zero point (:func:`quantize_activation_q8`):
    ``xs = max(max|x| / 127, Q8_TINY_SCALE)``, ``xq = int8(clip(round(x / xs), -127, 127))``, so
    ``y = float(MatMulInteger(xq, Wq)) * (xs * s)`` with neither ``a_zero_point`` nor
    ``b_zero_point``. Plain opset-17 ops (Abs, ReduceMax, Div, Max, Round, Clip, Cast). No zero
    point anywhere because a runtime must otherwise compensate ``x_zp * colsum(Wq)``: tract
    0.23.9 recomputes those column sums of the constant weight on every step (the uint8
    ``DynamicQuantizeLinear`` form this replaced spent 2.0 s of a 2.2 s 0.6B talker step there).
    tract-onnx 0.23.9 does not run ``MatMulNBits`` with bits 8; these plain ONNX ops it runs on
    its integer kernels.
"""

from __future__ import annotations

import numpy as np

from .errors import ExportError

#: Block size of q4 (tract's Q4_0 block is 32 weights).
Q4_BLOCK = 32
#: ``MatMulNBits`` ``accuracy_level`` of q4 products: 4 = int8 activations, quantized per block of
#: ``Q4_BLOCK`` at run time (``d = absmax / 127``, round half to even); onnxruntime 1.32 computes
#: exactly that on x86 (measured against a numpy Q8_0 emulation: 3e-6 apart), and so does
#: herald's AVX-512 VNNI kernel. ``[quantization] activations = "int8"`` says so in the manifest.
Q4_ACCURACY_LEVEL = 4
#: Signed divisors tried per block: scale = absmax / d (d > 0) or -m / |d| (d < 0, m = the signed
#: extreme). 7 = plain absmax/7, -8 = GGML Q4_0; the rest lie between and just past them.
Q4_SCALE_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, -7.5, -7.75, -8.0, -8.25, -8.5)
#: Largest int8 code of q8, weights and activations (symmetric: -127..127, -128 unused).
Q8_MAX = 127
#: Smallest q8 activation scale (the smallest normal float32): an all-zero input quantizes to
#: codes 0 instead of 0 / 0.
Q8_TINY_SCALE = float(np.finfo(np.float32).tiny)


def _f16_exact(s: np.ndarray) -> np.ndarray:
    """Round float32 scales to the nearest float16 value (kept in float32)."""
    with np.errstate(over="ignore"):
        return s.astype(np.float16).astype(np.float32)


def quantize_q4(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """q4 of a torch Linear weight ``w [N, K]``: (B uint8 [N, nb, 16], scales float32 [N * nb]).

    nb = ceil(K / 32). Dequantize with :func:`dequantize_q4`. Raises ExportError when a scale
    does not fit float16 (a weight above 65504 * 8 in magnitude) or the weight is not finite.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ExportError(name, f"q4 needs a 2-D weight, got shape {list(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ExportError(name, "weight has non-finite values; cannot quantize")
    N, K = w.shape
    nb = -(-K // Q4_BLOCK)
    wb = np.zeros((N, nb * Q4_BLOCK), np.float32)
    wb[:, :K] = w
    wb = wb.reshape(N, nb, Q4_BLOCK)
    absmax = np.abs(wb).max(axis=2)                                     # [N, nb]
    idx = np.abs(wb).argmax(axis=2)
    signed = np.take_along_axis(wb, idx[..., None], axis=2)[..., 0]     # the signed extreme
    best_s = np.zeros((N, nb), np.float32)
    best_err = np.full((N, nb), np.inf, np.float32)
    for d in Q4_SCALE_DIVISORS:
        s = _f16_exact(absmax / np.float32(d) if d > 0 else signed / np.float32(d))
        q = _codes(wb, s)
        err = np.sum(np.square((q.astype(np.float32) - 8.0) * s[..., None] - wb), axis=2)
        better = err < best_err
        best_s[better], best_err[better] = s[better], err[better]
    if not np.all(np.isfinite(best_s)):
        raise ExportError(name, "a q4 block scale does not fit float16 (weights too large)")
    q = _codes(wb, best_s)                                               # [N, nb, 32] in 0..15
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)       # low nibble = even i
    return packed, best_s.reshape(-1)


def _codes(wb: np.ndarray, s: np.ndarray) -> np.ndarray:
    """clip(round(w / s) + 8, 0, 15) as uint8 (code 8 where s == 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s[..., None] != 0, np.rint(wb / s[..., None]), 0.0)
    return (np.clip(r, -8, 7) + 8).astype(np.uint8)


def dequantize_q4(packed: np.ndarray, scales: np.ndarray, K: int) -> np.ndarray:
    """The float32 weight [N, K] that ``MatMulNBits`` (bits 4, no zero points) multiplies by."""
    N, nb, blob = packed.shape
    q = np.empty((N, nb, blob * 2), np.float32)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    w = (q - 8.0) * scales.reshape(N, nb)[..., None]
    return w.reshape(N, nb * blob * 2)[:, :K]


def quantize_q8(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """q8 of a torch Linear weight ``w [N, K]``: (Wq int8 [K, N], scale float32 [N]).

    ``w[n, k] ~= Wq[k, n] * scale[n]``; a zero row gets scale 0 and codes 0.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ExportError(name, f"q8 needs a 2-D weight, got shape {list(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ExportError(name, "weight has non-finite values; cannot quantize")
    s = (np.abs(w).max(axis=1) / np.float32(Q8_MAX)).astype(np.float32)   # [N]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s[:, None] != 0, np.rint(w / s[:, None]), 0.0)
    q = np.clip(q, -Q8_MAX, Q8_MAX).astype(np.int8)
    return np.ascontiguousarray(q.T), s


def dequantize_q8(wq: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight [N, K] a q8 matrix stands for (before activation quantization)."""
    return (wq.astype(np.float32) * scale[None, :]).T


def quantize_activation_q8(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """What a q8 graph does to a projection's input: (xq int8, per-tensor scale xs float32).

    ``x ~= xq * xs``; symmetric, no zero point; ``np.rint`` rounds half to even like ONNX Round.
    """
    x = np.asarray(x, dtype=np.float32)
    xs = np.maximum(np.float32(np.abs(x).max()) / np.float32(Q8_MAX), np.float32(Q8_TINY_SCALE))
    xq = np.clip(np.rint(x / xs), -Q8_MAX, Q8_MAX).astype(np.int8)
    return xq, np.float32(xs)

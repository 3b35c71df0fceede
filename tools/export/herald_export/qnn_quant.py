"""w8a16 QNN binaries for HTP v68 (``export qnn --arch v68``), behind a fidelity gate.

HTP v68 (QCS6490 / RB3 Gen 2) has no float path, so its step graphs are quantized before they
are compiled: onnxruntime's QDQ static quantization as configured for the QNN EP
(``onnxruntime.quantization.execution_providers.qnn.get_qnn_qdq_config``), uint16 activations
and uint8 weights (per output channel for the MatMul weights, per tensor for the code
predictor's stacked ``lm_heads``, a Gather). The compiled graph keeps float32 I/O (``head``
int64): the QNN graph quantizes its inputs and dequantizes its outputs itself, so the runtime
feeds and reads exactly what it does with an fp32 bundle's graph.

- **Calibration** (MinMax) uses activations drawn from the bundle itself: the float32 graphs
  decode the texts of the Rust parity test (:data:`herald_export.gate.PARITY_TEXTS`, the even
  ones) greedily for :data:`FRAMES` frames each through the reference decoder, and their
  teacher-forced step inputs (one position per step, the caches padded to the binary's slot
  count, most slots hidden) are the calibration samples: talker steps over each text's prefill
  and decode inputs, code-predictor steps per frame (the talker's hidden state, then the
  frame's codes).
- **Masks.** A hidden slot carries ``attention.mask_fill`` (-1e9). Quantized over [-1e9, 0], a
  uint16 step is 15,000 and every score the mask is added to collapses (measured: 5.5 dB logits
  SNR on the simulator). The mask inputs are therefore quantized over [-:data:`MASK_CLAMP`, 0]
  (the input quantization saturates -1e9 to -64; exp(-64) ~ 1.6e-28, still exactly "hidden")
  and calibrated with masks clamped the same way, so every tensor downstream gets a range that
  keeps the scores' resolution.
- **Gate.** Each compiled binary runs on libQnnHtp's x86_64 simulator over teacher-forced steps
  of the other (odd) parity texts, against the float32 graph on onnxruntime's CPU EP: logits
  SNR and top-1 agreement over the first :data:`GATE_STEPS` positions must reach
  :data:`THRESHOLDS`; otherwise the export fails (``--allow-lossy`` writes it anyway).
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .errors import ExportError
from .gate import PARITY_TEXTS, snr_db, top1_agreement
from .lm import MASK_FILL

#: Masks are quantized over [-MASK_CLAMP, 0]; -1e9 saturates to -MASK_CLAMP.
MASK_CLAMP = 64.0
#: Parity texts (indices) that calibrate and that the gate measures on: disjoint, each with
#: streaming and non-streaming prompts (even / odd indices).
CALIBRATION_TEXTS = (0, 1, 4, 5)
GATE_TEXTS = (2, 3, 6, 7)
#: Frames decoded per parity text for the teacher data.
FRAMES = 8
#: Calibration samples per binary, at most (every step of the calibration texts otherwise).
CALIBRATION_STEPS = 256
#: Teacher-forced positions per binary compared by the gate.
GATE_STEPS = 64


@dataclass(frozen=True)
class Thresholds:
    """The least a w8a16 binary must reach (``>=``) against the float32 graph."""

    logits_snr_db: float
    top1: float


#: Measured on the tiny presets (seed 7; docs/bundle.md "QNN binaries"): 28-31 dB, top-1
#: 0.93-0.96 on the simulator; the mask mistake above measured 0.4-5.5 dB, top-1 0.13-0.29.
#: The same thresholds as the q8 gate (herald_export.gate), for the same reasons.
THRESHOLDS = Thresholds(logits_snr_db=20.0, top1=0.80)


# --------------------------------------------------------------------------- teacher data
class Teacher:
    """Teacher-forced step inputs from a float32 bundle: per stack, sequences of x rows (and
    ``head`` values for the code predictor), split into calibration and gate texts."""

    def __init__(self, bundle: Path):
        from .gate import _reference_module
        from .host import StackCache, step

        ref_mod = _reference_module()
        self.ref = ref = ref_mod.Reference(bundle, threads=1)
        self.seqs: dict[tuple[str, str], list[tuple[np.ndarray, list[int] | None]]] = {}
        for part, idx in (("cal", CALIBRATION_TEXTS), ("gate", GATE_TEXTS)):
            texts = [PARITY_TEXTS[i] for i in idx]
            talker, predictor = [], []
            for text, lang, spk, mode in texts:
                with contextlib.redirect_stderr(io.StringIO()):   # frame-cap warnings
                    g = ref.generate(text, language=lang, speaker=spk, mode=mode, greedy=True,
                                     max_frames=FRAMES, record=True)
                x = np.concatenate([g.prefill, g.talker_inputs]).astype(np.float32)
                hidden = step(ref.talker, StackCache(ref.talker_spec, dtype=ref.talker_cache_dtype), x)["hidden"][0]
                talker.append((x, None))
                for f in range(g.frames):
                    c = [int(v) for v in g.codes[f]]
                    rows = [hidden[g.prefill_len - 1 + f], ref.C(c[0])] + [ref.E(k, c[k]) for k in range(1, len(c) - 1)]
                    # position 0 (the hidden state) runs with head 0 too; its logits are unused
                    predictor.append((np.stack(rows).astype(np.float32), [0, 0] + list(range(1, len(c) - 1))))
            self.seqs[("talker", part)] = talker
            self.seqs[("code_predictor", part)] = predictor

    def steps(self, stack: str, part: str, slots: int, limit: int):
        """Yield (feeds of the static graph, the float32 graph's outputs) for up to ``limit``
        one-position steps: caches padded to ``slots`` (hidden by ``mask_full_past``), a sequence
        cut where its cache is full. The float32 outputs come from the bundle's own graph."""
        from .host import StackCache

        ref = self.ref
        sess, spec = (ref.talker, ref.talker_spec) if stack == "talker" else (ref.predictor, ref.predictor_spec)
        kinds = [k for k, _ in spec.layer_kinds]
        names = [o.name for o in sess.get_outputs()]
        wanted = {i.name for i in sess.get_inputs()}
        n = 0
        for rows, heads in self.seqs[(stack, part)]:
            cache = StackCache(spec, dtype=np.float32)
            for i in range(min(len(rows), slots)):
                if n >= limit:
                    return
                f = cache.feeds(1)
                f["x"] = rows[i][None, None]
                if heads is not None:
                    f["head"] = np.array([heads[i]], np.int64)
                f = {k: v for k, v in f.items() if k in wanted}
                out = dict(zip(names, sess.run(names, f)))
                # copies: the cache writes its ring buffers in place
                padded = {k: v.copy() for k, v in pad_feeds(f, slots, kinds).items()}
                cache.write(out, 1)
                yield padded, out
                n += 1


def pad_feeds(f: dict[str, np.ndarray], slots: int, kinds: list[str]) -> dict[str, np.ndarray]:
    """Feeds of a dynamic step (``past`` = the filled length P) as the static graph's: the caches
    of the ``full`` layers (``kinds[i]``) zero-padded to ``slots``, ``mask_full_past`` padded with
    ``MASK_FILL``; rings keep their size."""
    if "mask_full_past" not in f:
        return f
    out = dict(f)
    filled = f["mask_full_past"].shape[-1]
    m = np.full(f["mask_full_past"].shape[:-1] + (slots,), MASK_FILL, np.float32)
    m[..., :filled] = f["mask_full_past"]
    out["mask_full_past"] = m
    for i, kind in enumerate(kinds):
        if kind != "full":
            continue
        for kv in ("k", "v"):
            v = f[f"{kv}_cache_{i}"]
            a = np.zeros((1, slots) + v.shape[2:], v.dtype)
            a[:, :filled] = v
            out[f"{kv}_cache_{i}"] = a
    return out


def clamp_masks(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``f`` with every mask clamped to [-MASK_CLAMP, 0]: what the quantized inputs see."""
    return {k: (np.maximum(v, -MASK_CLAMP).astype(np.float32) if k.startswith("mask_") else v) for k, v in f.items()}


# --------------------------------------------------------------------------- quantization
def quantize_step_graph(static: onnx.ModelProto, stack: str, slots: int, teacher: Teacher, work: Path) -> Path:
    """QDQ-quantize a static float32 step graph (w8a16) calibrated on ``teacher``'s calibration
    texts; returns the path of the quantized model (in ``work``)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    from .bundle import _save

    src = work / f"{stack}_s{slots}_f32.onnx"
    _save(static, src, sync=False)
    g = static.graph
    inits = {t.name: t for t in g.initializer}
    overrides: dict = {}
    for vi in g.input:
        if vi.name.startswith("mask_"):
            overrides[vi.name] = [{"rmin": np.float32(-MASK_CLAMP), "rmax": np.float32(0.0)}]
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            overrides[n.input[1]] = [{"axis": 1}]     # [in, out]: one scale per output channel
    samples = (clamp_masks(f) for f, _ in teacher.steps(stack, "cal", slots, CALIBRATION_STEPS))

    class Reader(CalibrationDataReader):
        def get_next(self):
            return next(samples, None)

    dst = work / f"{stack}_s{slots}_w8a16.onnx"
    with _quiet_quantizer():
        cfg = get_qnn_qdq_config(str(src), Reader(), activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8,
                                 init_overrides=overrides, calibration_providers=["CPUExecutionProvider"])
        quantize(str(src), str(dst), cfg)
    for p in work.glob(f"{stack}_s{slots}_f32.onnx*"):
        p.unlink()
    return dst


@contextlib.contextmanager
def _quiet_quantizer():
    """onnxruntime.quantization warns through the root logger (pre-processing, opset 21)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


# --------------------------------------------------------------------------- the gate
@dataclass
class GateResult:
    """Logits of a compiled w8a16 binary against the float32 graph, teacher-forced."""

    file: str
    positions: int
    logits_snr_db: float
    top1: float

    @property
    def failures(self) -> list[str]:
        fails = []
        if not self.logits_snr_db >= THRESHOLDS.logits_snr_db:
            fails.append(f"logits SNR {self.logits_snr_db:.1f} dB < {THRESHOLDS.logits_snr_db}")
        if not self.top1 >= THRESHOLDS.top1:
            fails.append(f"top-1 agreement {self.top1:.3f} < {THRESHOLDS.top1}")
        return fails

    @property
    def passed(self) -> bool:
        return not self.failures

    def report(self) -> str:
        return (f"w8a16 gate {self.file}: {'passed' if self.passed else 'FAILED'}: logits SNR {self.logits_snr_db:.1f} dB "
                f"(>= {THRESHOLDS.logits_snr_db}), top-1 {self.top1:.3f} (>= {THRESHOLDS.top1}) over {self.positions} "
                "teacher-forced positions, HTP simulator vs float32 on onnxruntime CPU")


def run_gate(session, stack: str, slots: int, teacher: Teacher, file: str) -> GateResult:
    """Run ``session`` (the compiled binary on the QNN EP) over the gate texts' steps."""
    want = [o.name for o in session.get_outputs()]
    if "logits" not in want:
        raise ExportError(file, "the compiled binary has no logits output")
    got, ref = [], []
    for feeds, out in teacher.steps(stack, "gate", slots, GATE_STEPS):
        got.append(session.run(["logits"], feeds)[0][0])
        ref.append(out["logits"][0])
    if not got:
        raise ExportError(file, "no teacher-forced positions for the gate")
    ref_a, got_a = np.concatenate(ref), np.concatenate(got)
    return GateResult(file, len(got), snr_db(ref_a, got_a), top1_agreement(ref_a, got_a))


def _self_check() -> None:
    """Fail early (one line) when onnxruntime.quantization cannot be imported."""
    try:
        import onnxruntime.quantization.execution_providers.qnn  # noqa: F401
    except ImportError as e:
        raise ExportError("onnxruntime.quantization", f"unavailable ({e}); the v68 (w8a16) build needs it") from None


_self_check()

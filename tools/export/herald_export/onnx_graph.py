"""A small builder for ONNX graphs written directly with ``onnx.helper`` (no torch, no tracing).

Every graph herald ships is built through :class:`GraphBuilder`, so the patterns that other
exporters' traced graphs carry (IsNaN->Where guards, ``Reshape(allowzero=1)``, rank-0 axes)
never appear: reshape targets are int64 initializers of rank 1, axes are attributes or rank-1
initializers, and masks are computed with comparisons, never with NaN guards.

Conventions
-----------
- Opset :data:`OPSET` (17): LayerNormalization exists, ReduceMean still takes ``axes`` as an
  attribute, which tract and onnxruntime both read.
- Weights come in as numpy arrays in the checkpoint's layout; :meth:`GraphBuilder.weight`
  stores them in the graph's weight dtype (float32 or float16).
- ``linear`` takes a torch ``nn.Linear`` weight ``[out, in]`` and stores it transposed
  ``[in, out]`` so the graph is one ``MatMul`` (plus ``Add`` for a bias). A builder made with
  ``quant="q4"`` or ``"q8"`` writes every ``linear`` as a weight-only quantized matmul instead
  (:mod:`herald_export.quant`): ``com.microsoft`` ``MatMulNBits`` for q4, and for q8 a
  symmetric int8 activation quantization (``Abs``/``ReduceMax``/``Div``/``Max``, then
  ``Div``/``Round``/``Clip``/``Cast``; one per distinct input, shared by the projections that
  read it) -> ``MatMulInteger`` (int8 x int8, no zero points) -> ``Cast`` -> ``Mul``.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: ONNX opset of every herald graph.
OPSET = 17
#: Domain and opset version of onnxruntime's contrib ops (``MatMulNBits``), imported only by
#: graphs that use them.
MS_DOMAIN = "com.microsoft"
MS_OPSET = 1
#: Weight formats of :meth:`GraphBuilder.linear` besides the float weight dtype.
QUANT_FORMATS = ("q4", "q8")

#: numpy dtype -> ONNX element type for the dtypes herald graphs use.
NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.bool_): TensorProto.BOOL,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
}

#: ONNX element type -> the name used in bundle.toml.
ONNX_TO_NAME = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.BOOL: "bool",
    TensorProto.UINT8: "uint8",
    TensorProto.INT8: "int8",
}

NAME_TO_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_}


def onnx_type(dtype: str | np.dtype | type) -> int:
    """ONNX element type for a bundle dtype name (``"float32"``) or numpy dtype."""
    if isinstance(dtype, str):
        dtype = NAME_TO_NP[dtype]
    return NP_TO_ONNX[np.dtype(dtype)]


class GraphBuilder:
    """Accumulates nodes, initializers and IO of one ONNX graph.

    ``weight_dtype`` is the storage and compute dtype of the weights (``np.float32`` or
    ``np.float16``); activations follow it except where a builder method says otherwise.
    ``quant`` (``"q4"``, ``"q8"`` or None) quantizes the weights of :meth:`linear` only; it needs
    ``weight_dtype`` float32 (the compute dtype of quantized graphs).
    """

    def __init__(self, name: str, weight_dtype=np.float32, quant: str | None = None):
        if quant is not None and (quant not in QUANT_FORMATS or np.dtype(weight_dtype) != np.float32):
            raise ValueError(f"quant={quant!r} needs weight_dtype float32 and one of {QUANT_FORMATS}")
        self.name = name
        self.wdtype = np.dtype(weight_dtype)
        self.quant = quant
        self._q8_act_cache: dict[str, tuple[str, str]] = {}
        self._domains: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self._const_cache: dict[tuple, str] = {}
        self._scope: list[str] = []

    # ------------------------------------------------------------------ naming
    def fresh(self, hint: str = "t") -> str:
        """A new unique tensor name, prefixed with the current scope."""
        prefix = "/".join(self._scope)
        return f"{prefix}/{hint}_{next(self._ids)}" if prefix else f"{hint}_{next(self._ids)}"

    class _Scope:
        def __init__(self, b: "GraphBuilder", name: str):
            self.b, self.name = b, name

        def __enter__(self):
            self.b._scope.append(self.name)

        def __exit__(self, *exc):
            self.b._scope.pop()

    def scope(self, name: str) -> "GraphBuilder._Scope":
        """Context manager that prefixes tensor names (readable graphs, stable diffs)."""
        return GraphBuilder._Scope(self, name)

    # ------------------------------------------------------------------ IO
    def input(self, name: str, dtype, shape: Sequence[int | str]) -> str:
        """Declare a graph input; symbolic dims are strings (``"past"``, ``"seq"``)."""
        self.inputs.append(helper.make_tensor_value_info(name, onnx_type(dtype), list(shape)))
        return name

    def output(self, tensor: str, name: str, dtype, shape: Sequence[int | str]) -> str:
        """Expose ``tensor`` as graph output ``name`` (an Identity node renames it)."""
        if tensor != name:
            self.nodes.append(helper.make_node("Identity", [tensor], [name], name=f"out/{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, onnx_type(dtype), list(shape)))
        return name

    # ------------------------------------------------------------------ constants
    def const(self, value, dtype=None, name: str | None = None) -> str:
        """An initializer holding ``value`` (numpy array or python scalar/list).

        Small constants are de-duplicated. Scalars become rank-1 of size 1 unless an
        explicit rank-0 is needed by the op (e.g. Range's start/limit/delta).
        """
        arr = np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)
        key = None
        if arr.size <= 16:
            key = (arr.dtype.str, arr.shape, arr.tobytes())
            if key in self._const_cache:
                return self._const_cache[key]
        nm = name or self.fresh("const")
        self.inits.append(numpy_helper.from_array(arr, nm))
        if key is not None:
            self._const_cache[key] = nm
        return nm

    def ints(self, values: Iterable[int]) -> str:
        """A rank-1 int64 initializer (reshape targets, axes, pads, slice bounds)."""
        return self.const(np.asarray(list(values), dtype=np.int64))

    def weight(self, arr: np.ndarray, name: str | None = None, dtype=None) -> str:
        """Store a checkpoint tensor in the graph's weight dtype (or ``dtype``)."""
        dt = np.dtype(dtype) if dtype is not None else self.wdtype
        return self.const(np.ascontiguousarray(arr, dtype=dt), name=name)

    def scalar(self, value: float, dtype=None) -> str:
        """A rank-1 size-1 float constant in the activation dtype (broadcasts everywhere)."""
        return self.const(np.asarray([value], dtype=dtype or self.wdtype))

    # ------------------------------------------------------------------ ops
    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, hint: str | None = None,
           domain: str = "", **attrs):
        """Append one node; returns its output name (or a tuple of names for n_out > 1)."""
        outs = [self.fresh(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, name=self.fresh(f"n_{op_type}"),
                             **({"domain": domain} if domain else {}), **attrs)
        )
        if domain:
            self._domains.add(domain)
        return outs[0] if n_out == 1 else tuple(outs)

    def add(self, a, b):
        return self.op("Add", [a, b])

    def sub(self, a, b):
        return self.op("Sub", [a, b])

    def mul(self, a, b):
        return self.op("Mul", [a, b])

    def div(self, a, b):
        return self.op("Div", [a, b])

    def matmul(self, a, b):
        return self.op("MatMul", [a, b])

    def cast(self, x, dtype):
        return self.op("Cast", [x], to=onnx_type(dtype))

    def reshape(self, x, shape: Sequence[int]):
        """Reshape with 0 = copy that dim and -1 = infer (allowzero stays 0)."""
        return self.op("Reshape", [x, self.ints(shape)])

    def transpose(self, x, perm: Sequence[int]):
        return self.op("Transpose", [x], perm=list(perm))

    def concat(self, xs: Sequence[str], axis: int):
        return self.op("Concat", list(xs), axis=axis)

    def slice(self, x, starts, ends, axes, steps=None):
        ins = [x, self.ints(starts), self.ints(ends), self.ints(axes)]
        if steps is not None:
            ins.append(self.ints(steps))
        return self.op("Slice", ins)

    def unsqueeze(self, x, axes: Sequence[int]):
        return self.op("Unsqueeze", [x, self.ints(axes)])

    def sigmoid(self, x):
        return self.op("Sigmoid", [x])

    def silu(self, x):
        """SiLU(x) = x * sigmoid(x) (torch ``F.silu``)."""
        return self.mul(x, self.sigmoid(x))

    def gelu_exact(self, x):
        """GELU with erf (torch ``nn.GELU()`` default): 0.5 x (1 + erf(x / sqrt 2))."""
        e = self.op("Erf", [self.mul(x, self.scalar(1.0 / np.sqrt(2.0)))])
        return self.mul(self.mul(x, self.scalar(0.5)), self.add(e, self.scalar(1.0)))

    def linear(self, x, w: np.ndarray, b: np.ndarray | None = None, wname: str | None = None):
        """``x @ w.T + b`` for a torch Linear weight ``w`` [out, in] (stored as [in, out]).

        With ``quant`` set, ``w`` is quantized (:mod:`herald_export.quant`) and the bias, if
        any, stays float32 in a separate ``Add``.
        """
        if self.quant == "q4":
            y = self._linear_q4(x, w, wname)
        elif self.quant == "q8":
            y = self._linear_q8(x, w, wname)
        else:
            y = self.matmul(x, self.weight(np.ascontiguousarray(np.asarray(w).T), name=wname))
        if b is not None:
            y = self.add(y, self.weight(b))
        return y

    def _linear_q4(self, x, w: np.ndarray, wname: str | None):
        """``MatMulNBits`` (com.microsoft, bits 4, block 32, symmetric: no zero points)."""
        from .quant import Q4_ACCURACY_LEVEL, Q4_BLOCK, quantize_q4

        w = np.asarray(w, dtype=np.float32)
        N, K = w.shape
        packed, scales = quantize_q4(w, wname or "linear weight")
        qb = self.const(packed, name=f"{wname}.q4" if wname else None)
        qs = self.const(scales, name=f"{wname}.scales" if wname else None)
        # accuracy_level 4: A is quantized to int8 per block of 32 at run time (GGML Q4_0 x Q8_0),
        # the numerics herald's AVX-512 VNNI kernel runs, so the fidelity gate and the parity
        # tests measure them; runtimes without an int8 path (tract) compute in float32
        return self.op("MatMulNBits", [x, qb, qs], domain=MS_DOMAIN, K=K, N=N, bits=4, block_size=Q4_BLOCK,
                       accuracy_level=Q4_ACCURACY_LEVEL)

    def _linear_q8(self, x, w: np.ndarray, wname: str | None):
        """int8 weights per output channel; ``x`` quantized per tensor at run time (int8, symmetric)."""
        from .quant import quantize_q8

        wq, scale = quantize_q8(w, wname or "linear weight")
        xq, xs = self._quantize_activation_q8(x)
        yi = self.op("MatMulInteger", [xq, self.const(wq, name=f"{wname}.q8" if wname else None)])
        ys = self.mul(xs, self.const(scale, name=f"{wname}.scale" if wname else None))   # [N]
        return self.mul(self.cast(yi, np.float32), ys)

    def _quantize_activation_q8(self, x) -> tuple[str, str]:
        """Symmetric per-tensor int8 quantization of ``x``: (xq int8, s float32 rank 0).

        ``s = max(max|x| / 127, Q8_TINY_SCALE)``, ``xq = int8(clip(round(x / s), -127, 127))``
        (Round is half to even, as ``np.rint``); an all-zero ``x`` gives codes 0, never NaN.
        There is no zero point, so no runtime has to compensate one (tract would otherwise
        recompute the column sums of the constant weight on every step). Built once per
        distinct ``x`` and shared by the projections that read it (q/k/v, gate/up).

        ``s`` is rank 0 (ReduceMax over every axis, keepdims 0), as DynamicQuantizeLinear's
        scale was: onnxruntime 1.32 fuses MatMulInteger/Cast/Mul/Add into MatMulIntegerToFloat
        and that kernel adds a bias wrongly when the activation scale has rank >= 2.
        """
        from .quant import Q8_MAX, Q8_TINY_SCALE

        if x not in self._q8_act_cache:
            with self.scope("q8_act"):
                amax = self.op("ReduceMax", [self.op("Abs", [x])], keepdims=0)     # all axes: rank 0
                s = self.op("Max", [self.div(amax, self.const(np.asarray(Q8_MAX, np.float32))),
                                    self.const(np.asarray(Q8_TINY_SCALE, np.float32))], hint="xs")
                r = self.op("Round", [self.div(x, s)])
                lo = self.const(np.asarray(-Q8_MAX, np.float32))                     # rank 0 (Clip-11)
                hi = self.const(np.asarray(Q8_MAX, np.float32))
                xq = self.cast(self.op("Clip", [r, lo, hi]), np.int8)
            self._q8_act_cache[x] = (xq, s)
        return self._q8_act_cache[x]

    def rms_norm(self, x, w: np.ndarray, eps: float):
        """RMSNorm as Qwen3 computes it: in float32, then cast back, then scaled by ``w``.

        y = w * (x / sqrt(mean(x^2, -1) + eps)); x [..., D], w [D]. The float32 island keeps
        fp16 graphs from overflowing on large activations (x^2 > 65504).
        """
        xf = self.cast(x, np.float32) if self.wdtype != np.float32 else x
        var = self.op("ReduceMean", [self.mul(xf, xf)], axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.add(var, self.scalar(eps, np.float32))])])
        y = self.mul(xf, inv)
        if self.wdtype != np.float32:
            y = self.cast(y, self.wdtype)
        return self.mul(y, self.weight(w))

    def softmax_f32(self, scores, axis: int = -1):
        """Softmax computed in float32 (as torch does with ``dtype=torch.float32``), cast back."""
        if self.wdtype != np.float32:
            p = self.op("Softmax", [self.cast(scores, np.float32)], axis=axis)
            return self.cast(p, self.wdtype)
        return self.op("Softmax", [scores], axis=axis)

    # ------------------------------------------------------------------ model
    def model(self, doc: str = "") -> onnx.ModelProto:
        """The finished model, verified with ``onnx.checker`` (full check).

        The checker serializes the model, and a protobuf cannot exceed 2 GiB: a model whose
        initializers exceed :data:`IN_MEMORY_CHECK_BYTES` (the 1.7B talker: 2.8 GB in fp16) is
        checked after it is saved with external data instead (``bundle._save``).
        """
        m = helper.make_model(
            helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, [], doc_string=doc),
            opset_imports=[helper.make_opsetid("", OPSET)]
            + [helper.make_opsetid(d, MS_OPSET) for d in sorted(self._domains)],
            producer_name="herald-export",
            ir_version=8,
        )
        # Move the initializers in one at a time (protobuf copies on append, and make_model
        # copies the whole graph): the weights exist twice only one tensor at a time, instead of
        # three times over (builder, graph, model). The builder is spent afterwards.
        inits, self.inits = self.inits, []
        inits.reverse()
        while inits:
            m.graph.initializer.append(inits.pop())
        if initializer_bytes(m) <= IN_MEMORY_CHECK_BYTES:
            onnx.checker.check_model(m, full_check=True)
        return m


#: Largest initializer total checked in memory (2 GiB protobuf limit, minus room for the graph).
IN_MEMORY_CHECK_BYTES = 2**31 - 2**26


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of all initializers of ``model`` (held in memory): what its weights occupy on disk."""
    return sum(len(t.raw_data) for t in model.graph.initializer)


def io_signature(model: onnx.ModelProto) -> dict:
    """Inputs and outputs of a model as ``{"inputs": [...], "outputs": [...]}``.

    Each entry is ``{"name", "dtype", "shape"}`` where symbolic dims are their names.
    This is exactly what bundle.toml records per graph and what the runtime validates.
    """

    def one(vi):
        tt = vi.type.tensor_type
        dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in tt.shape.dim]
        return {"name": vi.name, "dtype": ONNX_TO_NAME[tt.elem_type], "shape": dims}

    return {"inputs": [one(v) for v in model.graph.input], "outputs": [one(v) for v in model.graph.output]}

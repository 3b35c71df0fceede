"""Crafted ONNX graphs carrying the patterns torch exporters leave behind (test material).

herald's own exporter (:mod:`herald_export.onnx_graph`) never emits these, but users may bring
graphs that do, and ``herald sanitize IN OUT`` rewrites them. Each graph here exhibits one
pattern, the way a torch export looks, and ``all_patterns`` carries all of them together
(including inside the branches of an ``If``):

- ``nan_guard``: ``Where(IsNaN(t), 0, t)`` after a Softmax feeding a MatMul (what the dynamo
  exporter puts after every softmax), and the mirrored ``Where(Not(IsNaN(t)), t, 0)``;
- ``reshape_allowzero``: ``Reshape(allowzero=1)`` with constant shapes without zeros (one an
  initializer, one a ``Constant`` node), and one whose constant shape holds a literal 0 (a truly
  empty reshape, which must be kept);
- ``scalar_axes``: ``Unsqueeze`` whose ``axes`` input is a rank-0 int64 initializer (shared with
  a ``Gather`` that needs it rank-0) or a rank-0 ``Constant`` node (``value`` and ``value_int``
  forms);
- ``stale_value_info``: ``value_info`` entries with a wrong shape and a wrong rank;
- ``external_data``: weights stored in ``weights.bin`` next to the model
  (``save_as_external_data=True, location="weights.bin", size_threshold=0``), plus a NaN guard;
- ``all_patterns``: all of the above, with an ``If`` whose branches hold guards and scalar axes
  (one referring to an outer-scope initializer), and a guard whose output is a graph output.
- ``dynamic_shapes``: the patterns on symbolic dims (``batch``), with a run-time shape for one
  ``Reshape(allowzero=1)`` (kept: its values are unknown) and symbolic ``value_info``.

For every graph ``NAME.onnx`` a ``NAME.json`` records the inputs and the outputs computed by
onnxruntime **on the original, unsanitized graph**, and the rewrite counts a sanitizer should
report. ``index.json`` lists the cases.

Run: ``python -m herald_export.crafted OUT_DIR`` (cwd ``tools/export``);
``python -m herald_export.crafted --check MODEL CASE_JSON`` checks a sanitized model against its
case (full ``onnx.checker``, onnxruntime outputs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Opset of every crafted graph (what torch 2.x exports by default).
OPSET = 17
#: IR version matching opset 17.
IR_VERSION = 8

F = TensorProto.FLOAT


def _init(name: str, array: np.ndarray) -> TensorProto:
    """An initializer stored as ``raw_data`` (as torch writes them)."""
    return numpy_helper.from_array(np.asarray(array), name)


def _scalar_i64(name: str, value: int) -> TensorProto:
    """A rank-0 int64 tensor (``dims == []``), as torch exports an ``axes`` of ``unsqueeze(x, 0)``."""
    return numpy_helper.from_array(np.array(value, dtype=np.int64), name)


def _const(output: str, array: np.ndarray, name: str) -> onnx.NodeProto:
    """A ``Constant`` node holding ``array`` (torch writes scalars this way)."""
    return helper.make_node("Constant", [], [output], name=name, value=numpy_helper.from_array(np.asarray(array), output))


def _vi(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, shape)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="pytorch",
        producer_version="2.5.0",
    )
    model.ir_version = IR_VERSION
    return model


def _zero(name: str) -> onnx.NodeProto:
    """The rank-0 float 0.0 ``Constant`` a torch NaN guard selects."""
    return _const(name, np.array(0.0, dtype=np.float32), name=f"/{name}/Constant")


def nan_guard(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """Two NaN guards: ``Where(IsNaN(s), 0, s)`` and ``Where(Not(IsNaN(h)), h, 0)``."""
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((4,)).astype(np.float32)
    nodes = [
        helper.make_node("Softmax", ["x"], ["s"], name="/attn/Softmax", axis=-1),
        helper.make_node("IsNaN", ["s"], ["s_nan"], name="/attn/IsNaN"),
        _zero("zero0"),
        helper.make_node("Where", ["s_nan", "zero0", "s"], ["s_guarded"], name="/attn/Where"),
        helper.make_node("MatMul", ["s_guarded", "w"], ["h"], name="/proj/MatMul"),
        helper.make_node("IsNaN", ["h"], ["h_nan"], name="/proj/IsNaN"),
        helper.make_node("Not", ["h_nan"], ["h_ok"], name="/proj/Not"),
        _zero("zero1"),
        helper.make_node("Where", ["h_ok", "h", "zero1"], ["h_guarded"], name="/proj/Where"),
        helper.make_node("Add", ["h_guarded", "b"], ["y"], name="/proj/Add"),
    ]
    graph = helper.make_graph(
        nodes, "nan_guard", [_vi("x", [2, 3])], [_vi("y", [2, 4])], initializer=[_init("w", w), _init("b", b)]
    )
    inputs = {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    return _model(graph), inputs, {"nan_guards_removed": 2}


def reshape_allowzero(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """``Reshape(allowzero=1)`` twice without zeros (clearable) and once with a literal 0 (kept)."""
    w = rng.standard_normal((12, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Reshape", ["x", "shape0"], ["x2"], name="/Reshape", allowzero=1),
        helper.make_node("MatMul", ["x2", "w"], ["h"], name="/MatMul"),
        _const("shape1", np.array([-1], dtype=np.int64), name="/Constant"),
        helper.make_node("Reshape", ["h", "shape1"], ["y"], name="/Reshape_1", allowzero=1),
        # A truly empty reshape: [3, 0] -> [0] (tract issue #2698's repro). Must stay allowzero=1.
        helper.make_node("Reshape", ["empty", "shape_zero"], ["e"], name="/Reshape_2", allowzero=1),
        helper.make_node("Concat", ["y", "e"], ["z"], name="/Concat", axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "reshape_allowzero",
        [_vi("x", [2, 3, 4])],
        [_vi("z", [10])],
        initializer=[
            _init("shape0", np.array([2, 12], dtype=np.int64)),
            _init("w", w),
            _init("empty", np.zeros((3, 0), dtype=np.float32)),
            _init("shape_zero", np.array([0], dtype=np.int64)),
        ],
    )
    inputs = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    return _model(graph), inputs, {"allowzero_cleared": 2, "allowzero_kept": 1}


def scalar_axes(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """Rank-0 ``axes`` on Unsqueeze: a shared initializer and the two ``Constant`` forms.

    Only Unsqueeze carries them: onnxruntime accepts a scalar ``axes`` there but refuses one on
    Squeeze ("An axes tensor must be a vector tensor"), so a runnable original cannot have it.
    """
    w = rng.standard_normal((4, 2)).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["x", "ax0"], ["u"], name="/Unsqueeze"),
        _const("ax_sq", np.array([0], dtype=np.int64), name="/Constant"),
        helper.make_node("Squeeze", ["u", "ax_sq"], ["sq"], name="/Squeeze"),
        helper.make_node("MatMul", ["sq", "w"], ["m"], name="/MatMul"),
        helper.make_node("Constant", [], ["ax_one"], name="/Constant_1", value_int=1),
        helper.make_node("Unsqueeze", ["m", "ax_one"], ["y"], name="/Unsqueeze_1"),
        # ax0 is shared: Gather needs it rank-0 (a scalar index drops the axis).
        helper.make_node("Gather", ["m", "ax0"], ["row"], name="/Gather", axis=0),
        _const("ax_row", np.array(0, dtype=np.int64), name="/Constant_2"),
        helper.make_node("Unsqueeze", ["row", "ax_row"], ["row1"], name="/Unsqueeze_2"),
    ]
    graph = helper.make_graph(
        nodes,
        "scalar_axes",
        [_vi("x", [3, 4])],
        [_vi("y", [3, 1, 2]), _vi("row1", [1, 2])],
        initializer=[_scalar_i64("ax0", 0), _init("w", w)],
    )
    inputs = {"x": rng.standard_normal((3, 4)).astype(np.float32)}
    return _model(graph), inputs, {"scalar_axes_fixed": 3}


def stale_value_info(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """``value_info`` left stale by an edit: a wrong shape, a wrong rank, and one correct entry."""
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((4,)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="/MatMul"),
        helper.make_node("Relu", ["h"], ["r"], name="/Relu"),
        helper.make_node("Add", ["r", "b"], ["y"], name="/Add"),
    ]
    graph = helper.make_graph(
        nodes,
        "stale_value_info",
        [_vi("x", [2, 3])],
        [_vi("y", [2, 4])],
        initializer=[_init("w", w), _init("b", b)],
        value_info=[_vi("h", [7, 7]), _vi("r", [2, 4, 1]), _vi("y", [2, 4])],
    )
    inputs = {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    return _model(graph), inputs, {"value_info_dropped": 3}


def external_data(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """Weights in an external file (written by :func:`main` with ``save_as_external_data``)."""
    w = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((16,)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="/MatMul"),
        helper.make_node("Add", ["h", "b"], ["a"], name="/Add"),
        helper.make_node("Softmax", ["a"], ["s"], name="/Softmax", axis=-1),
        helper.make_node("IsNaN", ["s"], ["s_nan"], name="/IsNaN"),
        _zero("zero0"),
        helper.make_node("Where", ["s_nan", "zero0", "s"], ["s_guarded"], name="/Where"),
        helper.make_node("Mul", ["s_guarded", "b"], ["y"], name="/Mul"),
    ]
    graph = helper.make_graph(
        nodes, "external_data", [_vi("x", [2, 8])], [_vi("y", [2, 16])], initializer=[_init("w", w), _init("b", b)]
    )
    inputs = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    return _model(graph), inputs, {"nan_guards_removed": 1}


def all_patterns(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """Every pattern at once, in the main graph and in the branches of an ``If``."""
    w = rng.standard_normal((4, 5)).astype(np.float32)
    then_branch = helper.make_graph(
        [
            _const("t_ax", np.array(0, dtype=np.int64), name="/then/Constant"),
            helper.make_node("Unsqueeze", ["m", "t_ax"], ["t_sq"], name="/then/Unsqueeze"),
            helper.make_node("IsNaN", ["t_sq"], ["t_nan"], name="/then/IsNaN"),
            helper.make_node("Not", ["t_nan"], ["t_ok"], name="/then/Not"),
            _zero("t_zero"),
            helper.make_node("Where", ["t_ok", "t_sq", "t_zero"], ["t_out"], name="/then/Where"),
        ],
        "then_branch",
        [],
        [_vi("t_out", [1, 1, 6, 5])],
        value_info=[_vi("t_sq", [1, 6, 5])],
    )
    else_branch = helper.make_graph(
        # Refers to the outer graph's rank-0 initializer `ax`.
        [
            helper.make_node("Unsqueeze", ["m", "ax"], ["e_sq"], name="/else/Unsqueeze"),
            helper.make_node("Neg", ["e_sq"], ["e_out"], name="/else/Neg"),
        ],
        "else_branch",
        [],
        [_vi("e_out", [1, 1, 6, 5])],
    )
    nodes = [
        helper.make_node("Reshape", ["x", "shape0"], ["r"], name="/Reshape", allowzero=1),
        helper.make_node("Softmax", ["r"], ["s"], name="/Softmax", axis=-1),
        helper.make_node("IsNaN", ["s"], ["s_nan"], name="/IsNaN"),
        _zero("zero0"),
        helper.make_node("Where", ["s_nan", "zero0", "s"], ["g"], name="/Where"),
        helper.make_node("Unsqueeze", ["g", "ax"], ["u"], name="/Unsqueeze"),
        helper.make_node("MatMul", ["u", "w"], ["m"], name="/MatMul"),
        helper.make_node("ReduceSum", ["x"], ["total"], name="/ReduceSum", keepdims=0),
        _zero("zero1"),
        helper.make_node("Greater", ["total", "zero1"], ["cond"], name="/Greater"),
        helper.make_node("If", ["cond"], ["o"], name="/If", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("IsNaN", ["o"], ["o_nan"], name="/IsNaN_1"),
        _zero("zero2"),
        # The guard's output is a graph output: its name must survive.
        helper.make_node("Where", ["o_nan", "zero2", "o"], ["y"], name="/Where_1"),
    ]
    graph = helper.make_graph(
        nodes,
        "all_patterns",
        [_vi("x", [2, 3, 4])],
        [_vi("y", [1, 1, 6, 5])],
        initializer=[_init("shape0", np.array([6, 4], dtype=np.int64)), _scalar_i64("ax", 0), _init("w", w)],
        value_info=[_vi("r", [6, 4]), _vi("u", [6, 1, 4]), _vi("m", [1, 6, 5]), _vi("o", [1, 6, 5])],
    )
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    x += 0.5 - x.mean()  # the sum is positive: the `then` branch runs.
    inputs = {"x": x}
    expect = {
        "nan_guards_removed": 3,
        "allowzero_cleared": 1,
        "scalar_axes_fixed": 3,
        "value_info_dropped": 5,
    }
    return _model(graph), inputs, expect


def dynamic_shapes(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict, dict]:
    """The patterns on symbolic dimensions (torch's ``dynamic_axes``), with a symbolic
    ``value_info`` naming its dims differently from the inputs (``unk__6`` style)."""
    w = rng.standard_normal((4, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Reshape", ["x", "shape0"], ["r"], name="/Reshape", allowzero=1),
        helper.make_node("Softmax", ["r"], ["s"], name="/Softmax", axis=-1),
        helper.make_node("IsNaN", ["s"], ["s_nan"], name="/IsNaN"),
        _zero("zero0"),
        helper.make_node("Where", ["s_nan", "zero0", "s"], ["g"], name="/Where"),
        helper.make_node("Unsqueeze", ["g", "ax"], ["u"], name="/Unsqueeze"),
        helper.make_node("MatMul", ["u", "w"], ["m"], name="/MatMul"),
        helper.make_node("Shape", ["m"], ["m_shape"], name="/Shape"),
        helper.make_node("Gather", ["m_shape", "ax1"], ["rows"], name="/Gather", axis=0),
        helper.make_node("Unsqueeze", ["rows", "ax"], ["rows1"], name="/Unsqueeze_1"),
        _const("minus1", np.array([-1], dtype=np.int64), name="/Constant"),
        helper.make_node("Concat", ["rows1", "minus1"], ["shape1"], name="/Concat", axis=0),
        helper.make_node("Reshape", ["m", "shape1"], ["y"], name="/Reshape_1", allowzero=1),
    ]
    graph = helper.make_graph(
        nodes,
        "dynamic_shapes",
        [_vi("x", ["batch", 3, 4])],
        [_vi("y", ["rows", 5])],
        initializer=[
            _init("shape0", np.array([-1, 4], dtype=np.int64)),
            _scalar_i64("ax", 0),
            _scalar_i64("ax1", 1),
            _init("w", w),
        ],
        value_info=[_vi("r", ["unk__6", 4]), _vi("m", [1, "unk__7", 5])],
    )
    inputs = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    expect = {
        "nan_guards_removed": 1,
        "allowzero_cleared": 1,
        "allowzero_kept": 1,
        "scalar_axes_fixed": 2,
        "value_info_dropped": 2,
    }
    return _model(graph), inputs, expect


#: Case name -> builder. Each builder returns (model, inputs, expected rewrite counts).
CASES: dict[str, Callable[[np.random.Generator], tuple[onnx.ModelProto, dict, dict]]] = {
    "nan_guard": nan_guard,
    "reshape_allowzero": reshape_allowzero,
    "scalar_axes": scalar_axes,
    "stale_value_info": stale_value_info,
    "external_data": external_data,
    "all_patterns": all_patterns,
    "dynamic_shapes": dynamic_shapes,
}

#: Every count the sanitizer reports; the ones a case does not name are expected to be 0.
COUNTS = [
    "nan_guards_removed",
    "nan_guards_kept",
    "allowzero_cleared",
    "allowzero_kept",
    "scalar_axes_fixed",
    "value_info_dropped",
]


def _tensor_json(array: np.ndarray) -> dict:
    return {"shape": list(array.shape), "data": [float(v) for v in np.asarray(array, dtype=np.float64).ravel()]}


def _run_ort(path: Path, inputs: dict) -> list[tuple[str, np.ndarray]]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, inputs)
    return list(zip(names, values))


def write_case(out_dir: Path, name: str, seed: int = 0) -> Path:
    """Write ``NAME.onnx`` (and its external data if any) and ``NAME.json``; return the JSON path."""
    rng = np.random.default_rng(seed)
    model, inputs, expect = CASES[name](rng)
    onnx.checker.check_model(model)
    path = out_dir / f"{name}.onnx"
    external = []
    if name == "external_data":
        location = "weights.bin"
        (out_dir / location).unlink(missing_ok=True)  # onnx appends to an existing file
        onnx.save_model(model, str(path), save_as_external_data=True, location=location, size_threshold=0)
        external.append(location)
    else:
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    outputs = _run_ort(path, inputs)
    record = {
        "model": path.name,
        "opset": OPSET,
        "inputs": {k: _tensor_json(v) for k, v in inputs.items()},
        "outputs": [{"name": n, **_tensor_json(v)} for n, v in outputs],
        "expect": {k: int(expect.get(k, 0)) for k in COUNTS},
        "external_data": external,
    }
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    return json_path


def check(model_path: str | Path, case_json: str | Path, tolerance: float = 1e-5) -> float:
    """Check a (sanitized) model against a case: the full ``onnx.checker`` passes and
    onnxruntime reproduces the recorded outputs. Returns the largest difference."""
    import onnxruntime as ort

    case = json.loads(Path(case_json).read_text())
    onnx.checker.check_model(onnx.load(str(model_path)), full_check=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # no warnings about unused initializers and the like
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    feeds = {k: np.array(v["data"], dtype=np.float32).reshape(v["shape"]) for k, v in case["inputs"].items()}
    worst = 0.0
    for got, want in zip(session.run(None, feeds), case["outputs"]):
        want_arr = np.array(want["data"], dtype=np.float32).reshape(want["shape"])
        if got.shape != want_arr.shape:
            raise AssertionError(f"{want['name']}: shape {got.shape}, recorded {want_arr.shape}")
        if got.size:
            worst = max(worst, float(np.max(np.abs(got - want_arr))))
    if worst > tolerance:
        raise AssertionError(f"max |diff| {worst} > {tolerance}")
    return worst


def main(out_dir: str | Path) -> list[Path]:
    """Write every crafted case into ``out_dir`` (created if needed) plus ``index.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_case(out, name) for name in CASES]
    (out / "index.json").write_text(json.dumps({"cases": list(CASES)}, indent=1) + "\n")
    return written


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        print(f"{sys.argv[2]}: onnx.checker ok, onnxruntime max |diff| {check(sys.argv[2], sys.argv[3]):e}")
    elif len(sys.argv) == 2:
        for p in main(sys.argv[1]):
            print(p)
    else:
        print("usage: python -m herald_export.crafted OUT_DIR | --check MODEL CASE_JSON", file=sys.stderr)
        sys.exit(2)

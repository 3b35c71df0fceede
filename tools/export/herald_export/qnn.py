"""Bundle step graphs -> QNN HTP context binaries (``export qnn``; docs/bundle.md, "QNN binaries").

The talker and code-predictor step graphs of a bundle are compiled, through onnxruntime's QNN
execution provider (the ``onnxruntime-qnn`` plugin package, tools/export/requirements-qnn.txt),
into context binaries for one Hexagon HTP architecture, written next to the bundle's graphs and
listed in ``[qnn]`` of bundle.toml. With ``--vocoder`` the bundle's stateful vocoder graph
(``[vocoder] stream_graph``) is compiled too, at a few fixed frame counts per run, behind a
fidelity gate on the simulator; herald runs it on the NPU only when told to
(``runtime.qnn_vocoder = "npu"``): by default the vocoder stays on the CPU.

- **Static shapes.** A context binary has fixed shapes. Each step graph is made static with
  ``seq`` = 1 (one position per step, prefill included) and ``past`` = a slot count: the talker
  once per ``--talker-slots`` tier (clipped to its ``max_positions``), the code predictor once at
  ``[audio] num_codebooks`` slots (it holds at most that many positions per frame). Spare slots
  are hidden by ``mask_full_past``, as with any cache buffer larger than its filled part.
- **KV dtype.** For the float16 architectures (v73, v79) the cache inputs ``k_cache_*`` /
  ``v_cache_*`` and outputs ``k_new_*`` / ``v_new_*`` are float16 in the binary: an fp32 bundle's
  graph gets a ``Cast`` at each of those edges (the body is unchanged, and HTP computes in fp16
  anyway), so the caches the runtime keeps are half the size. ``x``, ``cos``, ``sin``, the masks,
  ``logits`` and ``hidden`` stay float32, ``head`` int64.
- **v68** (QCS6490, RB3 Gen 2) has no float path: its binaries are w8a16 (uint8 weights, uint16
  activations), see :mod:`herald_export.qnn_quant`, and pass a fidelity gate first.
- **Graph rules.** A graph with IsNaN or Where, ``Reshape(allowzero=1)`` or rank-0 axes inputs
  is refused before anything is compiled (the rules every bundle graph keeps, docs/bundle.md
  "Graph contract").
- **Writing.** The bundle is updated the way :func:`herald_export.bundle.export` writes one: a
  sibling ``.<name>.partial-<pid>`` directory gets hard links to every file of the bundle, the
  new binaries and a new bundle.toml, all fsynced, and is swapped with the bundle in one
  ``renameat2(RENAME_EXCHANGE)`` (:mod:`herald_export.durable`). The bundle is the old one or the
  new one at every instant; a failed run (a compile error, a full disk) leaves it untouched. A
  re-run for the same architecture replaces that architecture's entries and files; the other
  architectures' entries stay (unless they were compiled by another SDK, see :func:`export_qnn`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from . import durable
from .errors import ExportError

#: Default ``--talker-slots``: cache-length tiers of the talker binaries.
DEFAULT_TALKER_SLOTS = (256, 1024, 4096)
#: Positions per step in every binary (the static ``seq``).
POSITIONS = 1
#: The pip package that compiles the binaries, and the hint when it is missing.
PACKAGE = "onnxruntime-qnn"
INSTALL_HINT = ("onnxruntime-qnn is not installed: run tools/export/setup.sh on a Linux x86_64 host "
                "(glibc >= 2.35) to install it into the project venv")
STACKS = ("talker", "code_predictor")
#: Graph inputs / outputs that are KV-cache edges (float16 in the binaries of fp16 arches).
KV_PREFIXES = ("k_cache_", "v_cache_", "k_new_", "v_new_")
#: Scratch folder inside the temporary bundle directory (static graphs, EPContext models).
WORK_DIR = ".qnn-work"
#: The stack name of the vocoder binaries in ``[[qnn.binaries]]``.
VOCODER = "vocoder"
#: Default ``--vocoder-frames``: frames per run of the vocoder binaries (1 must be among them, so
#: that a chunk of any length decodes as runs of these sizes).
DEFAULT_VOCODER_FRAMES = (2, 1)
#: The vocoder gate: output samples of each binary against the float32 stream graph on
#: onnxruntime's CPU EP, the state carried over ``VOCODER_GATE_RUNS`` runs, SNR at least this.
#: Measured on the tiny bundles (v73, v79, fp16): 44 dB.
VOCODER_SNR_DB = 30.0
VOCODER_GATE_RUNS = 2


@dataclass(frozen=True)
class Arch:
    """One HTP architecture: its ``htp_arch`` number, the default ``soc_model`` (the QNN SDK's
    ``Qnn_SocModel_t`` value) and the precision its binaries are built in."""

    name: str
    htp_arch: int
    soc_model: int
    soc_name: str
    precision: str


#: ``--arch`` -> architecture. soc_model values: QNN's SoC enumeration as public Qualcomm code
#: uses it (pytorch/executorch ``backends/qualcomm/serialization/qc_schema.py`` QcomChipset:
#: SM8550 = 43 v73, SM8750 = 69 v79, QCM6490 = 93 v68; QCS6490 is the IoT part of the same die).
ARCHES: dict[str, Arch] = {
    "v68": Arch("v68", 68, 93, "QCS6490 / QCM6490 (RB3 Gen 2)", "w8a16"),
    "v73": Arch("v73", 73, 43, "SM8550 (Snapdragon 8 Gen 2)", "fp16"),
    "v79": Arch("v79", 79, 69, "SM8750 (Snapdragon 8 Elite)", "fp16"),
}


# --------------------------------------------------------------------------- onnxruntime-qnn
class QnnRuntime:
    """onnxruntime with the QNN plugin EP registered (once per process)."""

    _instance: "QnnRuntime | None" = None

    def __init__(self):
        import onnxruntime as ort
        import onnxruntime_qnn as oq

        self.ort, self.oq = ort, oq
        ort.set_default_logger_severity(3)
        name = oq.get_ep_name()
        if not any(d.ep_name == name for d in ort.get_ep_devices()):
            ort.register_execution_provider_library(name, oq.get_library_path())
        self.devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
        if not self.devices:
            raise ExportError(PACKAGE, f"the {name} plugin registered no device")
        self.htp_path = oq.get_qnn_htp_path()
        from importlib.metadata import version

        self.version = version(PACKAGE)

    @classmethod
    def get(cls) -> "QnnRuntime":
        """The process's runtime; ExportError (one line: how to install it) when it is missing."""
        if cls._instance is None:
            try:
                cls._instance = cls()
            except ImportError:
                raise ExportError(PACKAGE, INSTALL_HINT) from None
            except OSError as e:   # a wheel for another libc / machine: its libraries do not load
                raise ExportError(PACKAGE, f"{INSTALL_HINT} (loading it failed: {_one_line(str(e))})") from None
        return cls._instance

    def session_options(self, provider_options: dict, config: dict | None = None):
        """SessionOptions with the QNN EP on its (only) device; CPU fallback disabled: the whole
        graph must go to QNN."""
        so = self.ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        for k, v in (config or {}).items():
            so.add_session_config_entry(k, v)
        so.add_provider_for_devices(self.devices[:1], {"backend_path": self.htp_path, **provider_options})
        return so

    def session(self, model_path: Path, threads: int | None = 1):
        """A session running an EPContext model (a compiled binary) on the QNN HTP backend
        (on x86_64: libQnnHtp's simulator)."""
        so = self.session_options({})
        if threads:
            so.intra_op_num_threads = threads
        return self.ort.InferenceSession(str(model_path), so)


def _one_line(s: str, limit: int = 400) -> str:
    s = re.sub(r"\x1b\[[0-9;]*m", "", s)
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


@contextlib.contextmanager
def captured_native_output():
    """Redirect file descriptors 1 and 2 to a temporary file while the QNN libraries run (they
    print banners and onnxruntime logs its errors there); yields a list that holds the captured
    text afterwards."""
    out: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as f:
        try:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            f.seek(0)
            out.append(f.read().decode("utf-8", "replace"))


def ep_message(exc: BaseException, log: str) -> str:
    """The QNN EP's own reason for a failed session, on one line.

    onnxruntime's exception often only says that nodes fell back to the (disabled) CPU EP; the
    cause (an invalid SoC, unsupported nodes) is in its error log, which is preferred."""
    errors = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = re.search(r"\[E:onnxruntime:[^\]]*\]\s*(.*)", line)
        if m and "fallback to CPU EP has been explicitly disabled" not in m.group(1):
            errors.append(m.group(1))
    msg = errors[0] if errors else str(exc)
    return _one_line(re.sub(r"^\S+\.cc:\d+ \S+\]?\s*", "", msg))


# --------------------------------------------------------------------------- graph rules
#: Op -> index of its axes input (opset 17 and later).
AXES_INPUT = {"Unsqueeze": 1, "Squeeze": 1, "Slice": 3, "ReduceSum": 1, "ReduceMean": 1, "ReduceMax": 1,
              "ReduceMin": 1, "ReduceProd": 1, "ReduceL1": 1, "ReduceL2": 1, "ReduceLogSum": 1,
              "ReduceLogSumExp": 1, "ReduceSumSquare": 1}


def check_graph_rules(model: onnx.ModelProto, path: str | Path) -> None:
    """Refuse a graph that breaks the rules of herald's graphs (the sanitizer's): IsNaN or Where
    nodes, ``Reshape(allowzero=1)``, a rank-0 tensor as an axes input. One ExportError naming
    the first offending node."""
    rank0 = {t.name for t in model.graph.initializer if len(t.dims) == 0}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and len(a.t.dims) == 0:
                    rank0.update(n.output)
    for n in model.graph.node:
        what = None
        if n.op_type in ("IsNaN", "Where"):
            what = f"has a {n.op_type} node ({n.name or n.output[0]})"
        elif n.op_type == "Reshape" and any(a.name == "allowzero" and a.i == 1 for a in n.attribute):
            what = f"has a Reshape with allowzero=1 ({n.name or n.output[0]})"
        else:
            pos = AXES_INPUT.get(n.op_type)
            if pos is not None and len(n.input) > pos and n.input[pos] in rank0:
                what = f"has a rank-0 axes input on {n.op_type} ({n.name or n.output[0]})"
        if what:
            raise ExportError(path, f"{what}: the QNN export takes only graphs without IsNaN/Where, "
                              "Reshape(allowzero=1) or rank-0 axes (docs/bundle.md, Graph contract)")


# --------------------------------------------------------------------------- static graphs
def fix_dims(g: onnx.GraphProto, values: dict[str, int], what: str) -> None:
    """Set every symbolic dim of ``g``'s inputs and outputs to ``values[name]`` and drop the
    intermediate shapes (onnxruntime infers them again, now static). A symbolic dim not in
    ``values`` is an ``ExportError`` naming the tensor (``what`` says which graph has only those)."""
    for vi in list(g.input) + list(g.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in values:
                d.dim_value = values[d.dim_param]
            elif d.dim_param:
                names = " and ".join(values)
                raise ExportError(g.name, f"{vi.name} has the symbolic dim {d.dim_param!r}; {what} has only {names}")
    del g.value_info[:]


def static_step_graph(model: onnx.ModelProto, slots: int, kv_float16: bool) -> onnx.ModelProto:
    """``model`` (a bundle step graph, modified in place and returned) with ``seq`` = 1 and
    ``past`` = ``slots`` on every input and output, the intermediate shapes dropped (onnxruntime
    infers them again, now static) and, with ``kv_float16``, float16 KV-cache I/O: a Cast after
    each float32 ``k_cache_*``/``v_cache_*`` input and before each float32 ``k_new_*``/``v_new_*``
    output, under the same names, so the body is unchanged."""
    g = model.graph
    fix_dims(g, {"seq": POSITIONS, "past": slots}, "a step graph")
    if kv_float16:
        head, tail = [], []
        for vi in g.input:
            tt = vi.type.tensor_type
            if vi.name.startswith(KV_PREFIXES) and tt.elem_type == TensorProto.FLOAT:
                inner = f"{vi.name}/f32"
                for n in g.node:
                    for j, x in enumerate(n.input):
                        if x == vi.name:
                            n.input[j] = inner
                tt.elem_type = TensorProto.FLOAT16
                head.append(helper.make_node("Cast", [vi.name], [inner], to=TensorProto.FLOAT, name=f"qnn_io/{vi.name}"))
        for vi in g.output:
            tt = vi.type.tensor_type
            if vi.name.startswith(KV_PREFIXES) and tt.elem_type == TensorProto.FLOAT:
                inner = f"{vi.name}/f32"
                for n in g.node:
                    for j, x in enumerate(n.output):
                        if x == vi.name:
                            n.output[j] = inner
                    for j, x in enumerate(n.input):
                        if x == vi.name:
                            n.input[j] = inner
                tt.elem_type = TensorProto.FLOAT16
                tail.append(helper.make_node("Cast", [inner], [vi.name], to=TensorProto.FLOAT16, name=f"qnn_io/{vi.name}"))
        body = list(g.node)
        del g.node[:]
        g.node.extend(head + body + tail)
    return model


def static_vocoder_graph(model: onnx.ModelProto, frames: int, samples_per_frame: int) -> onnx.ModelProto:
    """``model`` (the bundle's stateful vocoder graph, modified in place and returned) with
    ``frames`` fixed and ``samples`` = frames x samples_per_frame, the intermediate shapes
    dropped. Every I/O keeps its element type (``codes`` and ``position`` int64, the rest
    float32): the state is small next to the weights and crosses the boundary once per run."""
    fix_dims(model.graph, {"frames": frames, "samples": frames * samples_per_frame}, "the stream vocoder")
    return model


@dataclass
class VocoderGate:
    """One vocoder binary's fidelity on the simulator against float32."""

    name: str
    frames: int
    snr_db: float
    max_abs: float

    @property
    def passed(self) -> bool:
        return self.snr_db >= VOCODER_SNR_DB

    def report(self) -> str:
        return (f"vocoder gate {self.name}: samples SNR {self.snr_db:.1f} dB (>= {VOCODER_SNR_DB:g}), max abs error "
                f"{self.max_abs:.4f}, {VOCODER_GATE_RUNS} runs of {self.frames} frames against float32")


def vocoder_gate(rt: QnnRuntime, ctx_path: Path, reference: Path, frames: int, codebook_size: int, name: str,
                 seed: int = 0) -> VocoderGate:
    """Run the compiled vocoder ``ctx_path`` (an EPContext model) on the simulator and the
    float32 ``reference`` graph on onnxruntime's CPU EP over the same random codes, each carrying
    its own state over :data:`VOCODER_GATE_RUNS` runs from all-zero states; the SNR of the
    concatenated samples."""
    import numpy as np

    with captured_native_output():
        q = rt.session(ctx_path)
    cpu = rt.ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"])
    names = [o.name for o in cpu.get_outputs()]

    def zeros():
        return {i.name: np.zeros(i.shape, np.int64 if "int64" in i.type else np.float32)
                for i in cpu.get_inputs() if i.name != "codes"}

    rng = np.random.default_rng(seed)
    sq, sc, wq, wc = zeros(), zeros(), [], []
    for _ in range(VOCODER_GATE_RUNS):
        codes = rng.integers(0, codebook_size, (1, 16, frames)).astype(np.int64)
        with captured_native_output():
            oq = q.run(names, {"codes": codes, **sq})
        oc = cpu.run(names, {"codes": codes, **sc})
        wq.append(np.asarray(oq[0], np.float64).ravel())
        wc.append(np.asarray(oc[0], np.float64).ravel())
        sq = {n.replace("next.", "state.", 1): v for n, v in zip(names[1:], oq[1:])}
        sc = {n.replace("next.", "state.", 1): v for n, v in zip(names[1:], oc[1:])}
    a, b = np.concatenate(wq), np.concatenate(wc)
    err = float(((a - b) ** 2).sum())
    snr = float("inf") if err == 0 else 10 * np.log10(float((b ** 2).sum()) / err)
    if not np.isfinite(a).all():
        snr = float("-inf")
    return VocoderGate(name, frames, snr, float(np.abs(a - b).max()))


def has_dim(model: onnx.ModelProto, name: str) -> bool:
    """Whether any input of ``model`` has the symbolic dim ``name``."""
    return any(d.dim_param == name for vi in model.graph.input for d in vi.type.tensor_type.shape.dim)


# --------------------------------------------------------------------------- compiling
@dataclass
class Compiled:
    """One context binary as the QNN EP wrote it."""

    binary: Path        # the raw context binary (``<stem>_qnn.bin``)
    graph: str          # the graph name inside it (the EPContext node's partition_name)
    sdk: str            # QAIRT version, "2.51.0"
    seconds: float


def sdk_version(ep_sdk_version: str) -> str:
    """``v2.51.0.260929181845`` -> ``2.51.0``."""
    parts = ep_sdk_version.lstrip("v").split(".")
    if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]):
        raise ExportError("ep_sdk_version", f"unexpected QNN SDK version {ep_sdk_version!r}")
    return ".".join(parts[:3])


def compile_context(rt: QnnRuntime, model_path: Path, ctx_path: Path, arch: Arch, soc: int,
                    source: str | Path) -> Compiled:
    """Compile ``model_path`` (a static graph) into a context binary for ``arch``/``soc``.

    The QNN EP writes the EPContext model ``ctx_path`` and, beside it, ``<stem>_qnn.bin``; the
    EPContext model must hold exactly one EPContext node (the whole graph in one QNN graph).
    A failure is an ExportError naming ``source`` with the EP's message."""
    opts = {"htp_arch": str(arch.htp_arch), "soc_model": str(soc)}
    if arch.precision == "fp16":
        opts["enable_htp_fp16_precision"] = "1"
    so = rt.session_options(opts, {"ep.context_enable": "1", "ep.context_file_path": str(ctx_path),
                                   "ep.context_embed_mode": "0"})
    t0 = time.monotonic()
    with captured_native_output() as log:
        try:
            sess = rt.ort.InferenceSession(str(model_path), so)
            err = None
        except Exception as e:   # onnxruntime raises its own exception types (Fail, EPFail, ...)
            err = e
    if err is not None:
        msg = ep_message(err, log[0] if log else "")
        if "no space left" in msg.lower() or "disk quota" in msg.lower():
            raise durable.WriteFailed(ctx_path, OSError(28, "No space left on device"))
        raise ExportError(source, f"the QNN compile for {arch.name} (soc_model {soc}) failed: {msg}")
    del sess
    if not ctx_path.exists():
        raise ExportError(source, f"the QNN EP wrote no EPContext model for {arch.name}")
    ctx = onnx.load(str(ctx_path), load_external_data=False)
    nodes = list(ctx.graph.node)
    if len(nodes) != 1 or nodes[0].op_type != "EPContext":
        ops = sorted({n.op_type for n in nodes})
        raise ExportError(source, f"the QNN EP did not take the whole graph for {arch.name} (EPContext model ops: {ops})")
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    if attrs.get("embed_mode") != 0 or not attrs.get("ep_cache_context"):
        raise ExportError(source, "the EPContext node does not name a context binary file")
    binary = ctx_path.parent / attrs["ep_cache_context"].decode()
    graph = attrs.get("partition_name", b"").decode()
    if not binary.is_file() or not graph:
        raise ExportError(source, f"the QNN EP's context binary {binary.name} or its graph name is missing")
    return Compiled(binary, graph, sdk_version(attrs.get("ep_sdk_version", b"").decode()), time.monotonic() - t0)


def epcontext_model(binary_file: str, graph: str, sdk: str, inputs, outputs) -> onnx.ModelProto:
    """An EPContext model that runs ``binary_file`` (a name relative to the model's directory)
    through onnxruntime's QNN EP: one ``com.microsoft`` EPContext node, the I/O of the static
    graph the binary was compiled from. For tests and the v68 fidelity gate; the bundle keeps
    only the binary."""
    node = helper.make_node(
        "EPContext", [vi.name for vi in inputs], [vi.name for vi in outputs], name="qnn_binary",
        domain="com.microsoft", main_context=1, embed_mode=0, ep_cache_context=binary_file,
        source="QNNExecutionProvider", partition_name=graph, ep_sdk_version=f"v{sdk}")
    g = helper.make_graph([node], "qnn_binary", list(inputs), list(outputs))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8, producer_name="herald-export")


# --------------------------------------------------------------------------- the bundle
def binary_name(stack: str, arch: str, slots: int) -> str:
    """``qnn_<stack>_<arch>_s<slots>.bin``; the vocoder's ``qnn_vocoder_<arch>_f<frames>.bin``
    (``slots`` = frames per run)."""
    if stack == VOCODER:
        return f"qnn_vocoder_{arch}_f{slots}.bin"
    return f"qnn_{stack}_{arch}_s{slots}.bin"


BINARY_RE = re.compile(r"qnn_(?:(?:talker|code_predictor)_(v[0-9]+)_s|vocoder_(v[0-9]+)_f)([0-9]+)\.bin")


def binary_arch(name: str) -> str | None:
    """The architecture in a binary's file name, ``None`` when it is not named like one."""
    m = BINARY_RE.fullmatch(name)
    return (m.group(1) or m.group(2)) if m else None


def parse_slots(text: str) -> list[int]:
    """``"256,1024,4096"`` -> [256, 1024, 4096]; ExportError unless positive integers."""
    try:
        vals = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise ExportError("--talker-slots", f"{text!r}: expected positive integers separated by commas, e.g. 256,1024,4096")
    return vals


def parse_frames(text: str) -> list[int]:
    """``--vocoder-frames``: ``"2,1"`` -> [1, 2]; ExportError unless positive integers that
    include 1 (a chunk of any length must decode as runs of these sizes)."""
    try:
        vals = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        vals = []
    if not vals or any(v < 1 or v > 256 for v in vals):
        raise ExportError("--vocoder-frames", f"{text!r}: expected frame counts 1..256 separated by commas, e.g. 2,1")
    if 1 not in vals:
        raise ExportError("--vocoder-frames", f"{text!r}: must include 1, so that a chunk of any length decodes")
    return vals


def load_manifest(bundle: Path) -> dict:
    """bundle.toml of ``bundle`` as a dict; ExportError when ``bundle`` is not a bundle."""
    if not bundle.is_dir():
        raise ExportError(bundle, "not a bundle directory (it does not exist)" if not bundle.exists()
                          else "not a bundle directory")
    path = bundle / "bundle.toml"
    if not path.is_file():
        raise ExportError(bundle, "not a bundle: no bundle.toml")
    try:
        manifest = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ExportError(path, f"not a valid bundle manifest: {_one_line(str(e))}") from None
    if manifest.get("format_version") != 1:
        raise ExportError(path, f"format_version {manifest.get('format_version')!r}: only bundle format 1 is supported")
    for stack in STACKS:
        if stack not in manifest or stack not in manifest.get("graphs", {}):
            raise ExportError(path, f"not a bundle manifest: no [{stack}] / [graphs.{stack}]")
    return manifest



def load_step_graph(bundle: Path, manifest: dict, stack: str) -> tuple[onnx.ModelProto, Path]:
    """The bundle's ``stack`` graph (a step graph, or with ``stack`` = ``vocoder`` the stateful
    vocoder graph), checked against its sha256 and the graph rules."""
    if stack == VOCODER:
        name = manifest.get("vocoder", {}).get("stream_graph")
        if not name or name not in manifest.get("graphs", {}):
            raise ExportError(bundle / "bundle.toml", "has no stateful vocoder graph ([vocoder] stream_graph): "
                              "--vocoder compiles that graph; re-export the bundle with a current exporter")
        entry = manifest["graphs"][name]
    else:
        entry = manifest["graphs"][stack]
    path = bundle / entry["file"]
    if not path.is_file():
        raise ExportError(path, f"missing: bundle.toml lists it as the {stack} graph")
    if durable.sha256_file(path) != entry.get("sha256"):
        raise ExportError(path, "does not match its sha256 in bundle.toml (a modified or damaged bundle)")
    try:
        model = onnx.load(str(path))
    except Exception as e:   # protobuf's DecodeError and friends
        raise ExportError(path, f"cannot read the ONNX graph: {_one_line(str(e))}") from None
    check_graph_rules(model, path)
    return model, path


def plan(manifest: dict, talker_slots) -> dict[str, list[int]]:
    """Slot counts per stack: the talker's tiers clipped to its max_positions and deduplicated;
    the code predictor's ``[audio] num_codebooks`` (at most that many positions per frame)."""
    t_max = int(manifest["talker"]["max_positions"])
    c_max = int(manifest["code_predictor"]["max_positions"])
    cb = int(manifest.get("audio", {}).get("num_codebooks", 16))
    return {"talker": sorted({min(int(s), t_max) for s in talker_slots}), "code_predictor": [min(cb, c_max)]}


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` (new) holding hard links to every file of ``src`` (copies where linking fails)."""
    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link, symlinks=True)


def _space_error(e: durable.WriteFailed, bundle: Path) -> ExportError:
    """One line for a write that failed while updating ``bundle`` (left unchanged)."""
    if e.error.errno not in durable.DISK_FULL:
        return ExportError(e.path, f"cannot write: {e.error.strerror or e.error}; the bundle at {bundle} is unchanged")
    what = "disk quota exceeded" if e.error.errno == getattr(errno, "EDQUOT", None) else "no space left on device"
    try:
        st = os.statvfs(bundle.parent)
        free = f" ({st.f_bavail * st.f_frsize // 1_000_000} MB free there)"
    except OSError:
        free = ""
    return ExportError(e.path, f"{what}{free}; the bundle at {bundle} is unchanged")


def export_qnn(bundle: Path, arch_name: str, soc: int | None = None, talker_slots=DEFAULT_TALKER_SLOTS,
               quiet: bool = False, allow_lossy: bool = False, vocoder_frames=None) -> dict:
    """Compile ``bundle``'s talker and code-predictor step graphs for ``arch_name`` and record
    them in its bundle.toml; returns the new ``[qnn]`` table. With ``vocoder_frames`` (frame
    counts per run, 1 among them) the stateful vocoder graph is compiled too, one binary per
    count, each behind the vocoder gate (:func:`vocoder_gate`, SNR >= :data:`VOCODER_SNR_DB`).

    Raises ExportError (the bundle unchanged) for: a directory that is not a bundle, an unknown
    architecture, onnxruntime-qnn missing, a graph that breaks the graph rules, a failed compile
    (the EP's message), a failed v68 fidelity gate (unless ``allow_lossy``), a full disk. Entries
    and files of ``arch_name`` from an earlier run are replaced; other architectures' entries stay
    when they come from the same SDK and compiler, and are dropped with their files otherwise
    (one ``[qnn] sdk`` describes every binary listed). A vocoder for v68 (no float path), a
    bundle without a stream vocoder graph, or a vocoder binary that fails its gate is an
    ExportError too.
    """
    bundle = Path(bundle)
    if arch_name not in ARCHES:
        raise ExportError("--arch", f"unknown architecture {arch_name!r} (choose from {', '.join(sorted(ARCHES))})")
    arch = ARCHES[arch_name]
    soc = arch.soc_model if soc is None else int(soc)
    if soc < 1:
        raise ExportError("--soc", f"{soc}: a QNN soc_model is a positive integer")
    if allow_lossy and arch.precision != "w8a16":
        raise ExportError("--allow-lossy", f"only valid for a quantized architecture (v68); {arch.name} binaries are {arch.precision}")
    manifest = load_manifest(bundle)
    weights = manifest.get("model", {}).get("weights", manifest.get("model", {}).get("dtype"))
    if weights not in ("fp32", "fp16"):
        raise ExportError(bundle / "bundle.toml", f"a {weights} bundle: the QNN export takes a float bundle (--dtype fp32 or fp16)")
    if arch.precision == "w8a16" and weights != "fp32":
        raise ExportError(bundle / "bundle.toml", f"a v68 (w8a16) build quantizes from float32 graphs; export the bundle with --dtype fp32")
    slots = plan(manifest, talker_slots)
    graphs = {}
    for stack in STACKS:
        graphs[stack] = load_step_graph(bundle, manifest, stack)
        if not has_dim(graphs[stack][0], "past"):
            raise ExportError(graphs[stack][1], "has no `past` dim (no full-attention layer): nothing to size the binaries by")
    stacks = STACKS
    if vocoder_frames:
        if arch.precision != "fp16":
            raise ExportError("--vocoder", f"{arch.name} has no float path: the vocoder is compiled for fp16 architectures "
                              "(v73, v79) only")
        graphs[VOCODER] = load_step_graph(bundle, manifest, VOCODER)
        slots[VOCODER] = sorted({int(f) for f in vocoder_frames})
        if 1 not in slots[VOCODER]:
            raise ExportError("--vocoder-frames", "must include 1, so that a chunk of any length decodes")
        stacks = STACKS + (VOCODER,)
    rt = QnnRuntime.get()
    teacher = None
    if arch.precision == "w8a16":
        from .qnn_quant import Teacher   # fails early (one line) when the quantizer is unavailable

        teacher = Teacher(bundle)

    bundle = bundle.resolve()
    t0 = time.monotonic()
    tmp = durable.partial_name(bundle)
    try:
        stale = durable.remove_stale(bundle)
        for p in stale:
            if not quiet:
                print(f"removed {p.name}, left by a killed export", file=sys.stderr)
        if tmp.exists():
            shutil.rmtree(tmp)
        _link_tree(bundle, tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in durable.DISK_FULL:
            raise _space_error(durable.WriteFailed(tmp, e), bundle) from None
        raise ExportError(bundle, f"cannot prepare the update next to it: {e.strerror or e}") from None

    old = None
    try:
        work = tmp / WORK_DIR
        work.mkdir()
        entries, sdk = [], None
        jobs = [(stack, n) for stack in stacks for n in slots[stack]]
        from tqdm import tqdm

        gate_reports = []
        with tqdm(total=len(jobs), desc=f"qnn {arch.name}", unit="binary", disable=quiet, file=sys.stderr,
                  leave=True, dynamic_ncols=True) as bar:
            for stack, n in jobs:
                model, src = graphs[stack]
                name = binary_name(stack, arch.name, n)
                bar.set_postfix_str(name)
                if stack == VOCODER:
                    spf = int(manifest["audio"]["samples_per_frame"])
                    static = static_vocoder_graph(_copy(model), n, spf)
                else:
                    static = static_step_graph(_copy(model), n, kv_float16=arch.precision == "fp16")
                ctx_path = work / f"{stack}_s{n}_ctx.onnx"
                if arch.precision == "w8a16":
                    from .qnn_quant import quantize_step_graph

                    model_path = quantize_step_graph(static, stack, n, teacher, work)
                else:
                    model_path = work / f"{stack}_s{n}.onnx"
                    _save_work(static, model_path)
                del static
                done = compile_context(rt, model_path, ctx_path, arch, soc, src)
                if stack == VOCODER:
                    gate = vocoder_gate(rt, ctx_path, src, n, int(manifest["vocoder"].get("codebook_size", 2048)), name)
                    gate_reports.append(gate.report())
                    if not gate.passed:
                        raise ExportError("qnn gate", f"{name} failed the vocoder fidelity gate: samples SNR "
                                          f"{gate.snr_db:.1f} dB < {VOCODER_SNR_DB:g} dB against float32")
                if arch.precision == "w8a16":
                    from .qnn_quant import run_gate

                    with captured_native_output():
                        sess = rt.session(ctx_path)
                    result = run_gate(sess, stack, n, teacher, name)
                    del sess
                    gate_reports.append(result.report())
                    if not result.passed:
                        if not allow_lossy:
                            raise ExportError("qnn gate", f"{name} failed the w8a16 fidelity gate: "
                                              f"{'; '.join(result.failures)} (--allow-lossy writes it anyway)")
                        if not quiet:
                            print(f"warning: --allow-lossy: writing {name}, which failed the w8a16 fidelity gate",
                                  file=sys.stderr)
                if sdk is not None and done.sdk != sdk:
                    raise ExportError(src, f"the QNN EP reported SDK {done.sdk} after {sdk}")
                sdk = done.sdk
                dest = tmp / name
                if dest.exists() or dest.is_symlink():
                    dest.unlink()   # a hard link to the previous run's binary: never write through it
                with _writing(dest):
                    shutil.copyfile(done.binary, dest)
                    os.chmod(dest, 0o644)
                entry = {"stack": stack, "arch": arch.name, "soc_model": soc, "file": name,
                         "sha256": durable.sha256_file(dest), "graph": done.graph}
                if stack == VOCODER:
                    entry["frames"] = n
                else:
                    entry.update(slots=n, positions=POSITIONS)
                entry["precision"] = arch.precision
                entries.append(entry)
                for p in work.iterdir():
                    p.unlink()
                bar.update(1)
        shutil.rmtree(work)

        compiler = f"{PACKAGE} {rt.version}"
        prev = manifest.get("qnn", {})
        keep = []
        dropped = []
        same_tool = prev.get("sdk") == sdk and prev.get("compiler") == compiler
        for e in prev.get("binaries", []):
            if e.get("arch") == arch.name:
                continue
            (keep if same_tool else dropped).append(e)
        if dropped and not quiet:
            print(f"note: dropping {len(dropped)} binaries of {sorted({e['arch'] for e in dropped})} compiled by "
                  f"{prev.get('compiler')} / QNN SDK {prev.get('sdk')} (this run: {compiler} / {sdk}); "
                  "re-run export qnn for those architectures", file=sys.stderr)
        binaries = sorted(keep + entries, key=lambda e: (e["arch"], e["stack"], e.get("slots", e.get("frames", 0))))
        listed = {e["file"] for e in binaries}
        # the files of entries no longer listed (this architecture's earlier run, dropped ones)
        # and any other file named like a binary of this architecture
        unlisted = {e.get("file") for e in prev.get("binaries", [])} - listed
        for p in list(tmp.iterdir()):
            if p.name not in listed and (p.name in unlisted or binary_arch(p.name) == arch.name):
                p.unlink()
        manifest["qnn"] = {"sdk": sdk, "compiler": compiler, "binaries": binaries}
        from .bundle import _write_manifest

        man = tmp / "bundle.toml"
        man.unlink()   # a hard link to the bundle's own manifest: write a new file
        _write_manifest(tmp, manifest)
        with _writing(tmp, sync=False):
            durable.fsync_dir(tmp)
        from .bundle import _swap_into_place

        with _writing(bundle, sync=False):
            old = _swap_into_place(tmp, bundle)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, durable.WriteFailed):
            raise _space_error(e, bundle) from None
        raise
    try:
        durable.fsync_dir(bundle.parent)
    except OSError as e:
        raise ExportError(bundle.parent, f"updated the bundle at {bundle}, but syncing its directory failed: "
                          f"{e.strerror or e} (a power cut now may undo the update)") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if not quiet:
        for report in gate_reports:
            print(report, file=sys.stderr)
        size = sum((bundle / e["file"]).stat().st_size for e in entries)
        print(f"wrote {len(entries)} {arch.name} binaries ({size / 1e6:.1f} MB, {arch.precision}, soc_model {soc}, "
              f"QNN SDK {sdk}) into {bundle} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return manifest["qnn"]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _save_work(model: onnx.ModelProto, path: Path) -> None:
    """Save a scratch graph (not fsynced: removed before the swap); I/O errors name the file."""
    from .bundle import _save

    _save(model, path, sync=False)


def _writing(path: Path, sync: bool = True):
    from .bundle import _writing as w

    return w(path, sync=sync)

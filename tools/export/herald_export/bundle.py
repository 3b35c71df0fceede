"""Checkpoint -> herald bundle (format v1, specified in docs/bundle.md).

The bundle is a directory::

    bundle.toml            the manifest: everything the runtime needs to know
    talker.onnx            talker step graph (prefill and decode)
    code_predictor.onnx    code-predictor step graph
    vocoder.onnx           windowed Code2Wav: codes [1,16,frames] -> wav [1, frames*1920]
    vocoder_stream.onnx    stateful Code2Wav: codes [1,16,n] + carried state.* -> wav [1, n*1920] + next.*
    tables.safetensors     host-side tables: projected text embedding, codec embedding, predictor embeddings
    tokenizer.json         Qwen2 byte-level BPE for the Rust ``tokenizers`` crate

It is written into a temporary sibling directory (``.<name>.partial-<pid>``) and renamed into
place only when complete, so an interrupted or failed export leaves nothing at the output path.
A quantized bundle (``q8``, ``q4``) passes the fidelity gate (:mod:`herald_export.gate`) in that
directory before the rename.

Faults (issue 17, docs/reliability.md): every file and the directory are fsynced before the
rename and the parent directory after it (a power cut leaves the old bundle or the complete new
one); an existing bundle is swapped with ``renameat2(RENAME_EXCHANGE)``, so the output path
exists at every instant (:mod:`herald_export.durable`); the next export removes the temporary
directories a killed one left; a full disk is an :class:`ExportError` naming the file, with
nothing left behind and a previous bundle untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import tomli_w
from tqdm import tqdm

from . import __version__, durable
from .checkpoint import LMSpec, LMWeights, ModelSpec, expected_lm_tensors, load_spec, sampling_defaults
from .errors import ExportError
from .lm import MASK_FILL, build_step_graph, cache_kinds
from .onnx_graph import initializer_bytes, io_signature
from .st_io import SafetensorsFile

FORMAT_VERSION = 1
FAMILY = "qwen3-tts-12hz"
#: ``--dtype`` -> the compute, cache and table dtype. q8 / q4 quantize the step graphs' linear
#: weights only (:mod:`herald_export.quant`); everything else in those bundles is float32.
DTYPES = {"fp32": np.float32, "fp16": np.float16, "q8": np.float32, "q4": np.float32}
QUANT_DTYPES = ("q8", "q4")
#: ``[quantization] scheme`` and ``block_size`` per format.
QUANT_SCHEMES = {
    "q4": ("MatMulNBits (com.microsoft) bits=4 block_size=32 symmetric (no zero points), float16-exact float32 scales, accuracy_level=4 (int8 activations per block of 32)", 32),
    "q8": ("int8 per output channel symmetric weights, int8 per-tensor symmetric dynamic activations (absmax/127, no zero points), MatMulInteger int8 x int8", 0),
}
#: ``[quantization] activations`` per format: q4 products take int8 activations per block of 32
#: (``MatMulNBits`` ``accuracy_level = 4``, what the gate measured); q8 has its own per-tensor
#: activation quantization in the graph, so the key is left out.
QUANT_ACTIVATIONS = {"q4": {"activations": "int8"}, "q8": {}}
#: What stays float in a quantized bundle (``[quantization] float_weights``).
FLOAT_WEIGHTS = ["code_predictor lm_heads", "norms", "embeddings (host tables)", "vocoder"]
#: Default chunk ramp and left context of windowed vocoding (DESIGN.md §5).
DEFAULT_RAMP = [2, 4, 8, 16, 25]
TABLE_ROWS_PER_CHUNK = 8192



def projected_text_table(spec: ModelSpec, w: LMWeights, dtype, progress=None) -> np.ndarray:
    """text_projection(text_embedding) for every text id: [text_vocab, H_talker].

    text_projection = Linear(fc1, bias) -> SiLU -> Linear(fc2, bias) (Qwen3TTSTalkerResizeMLP).
    Computed in float32 in row chunks; the result is stored in the bundle dtype.
    """
    emb = w["talker.model.text_embedding.weight"]
    w1, b1 = w["talker.text_projection.linear_fc1.weight"], w["talker.text_projection.linear_fc1.bias"]
    w2, b2 = w["talker.text_projection.linear_fc2.weight"], w["talker.text_projection.linear_fc2.bias"]
    out = np.empty((emb.shape[0], w2.shape[0]), dtype=dtype)
    for s in range(0, emb.shape[0], TABLE_ROWS_PER_CHUNK):
        h = emb[s : s + TABLE_ROWS_PER_CHUNK] @ w1.T + b1
        h = h * (1.0 / (1.0 + np.exp(-h)))  # SiLU
        out[s : s + TABLE_ROWS_PER_CHUNK] = (h @ w2.T + b2).astype(dtype)
        if progress:
            progress(min(TABLE_ROWS_PER_CHUNK, emb.shape[0] - s))
    return out


def _lm_section(lm: LMSpec, graph: str) -> dict:
    has_full, window = cache_kinds(lm)
    return {
        "graph": graph, "hidden": lm.hidden, "layers": lm.layers, "heads": lm.heads, "kv_heads": lm.kv_heads,
        "head_dim": lm.head_dim, "intermediate": lm.intermediate, "rms_norm_eps": lm.eps,
        "rope_theta": lm.rope_theta, "max_positions": lm.max_positions,
        "cache": [{"kind": k} if k == "full" else {"kind": k, "window": win} for k, win in lm.layer_kinds],
    }


#: Graphs whose initializers exceed this many bytes keep them in ``<file>.data`` next to the
#: graph (ONNX external data): a protobuf cannot exceed 2 GiB (the 0.6B talker is 1.8 GB in
#: fp32, the 1.7B one 5.6 GB). Loaders resolve the location relative to the graph's directory.
EXTERNAL_DATA_BYTES = 1_500_000_000


class _writing:
    """``with _writing(path):`` around the code that writes ``path``: then ``path`` is fsynced
    (unless ``sync`` is False), and an I/O error there (OSError, or the safetensors library's
    own error for one) becomes :class:`durable.WriteFailed` naming ``path``."""

    def __init__(self, path: Path, sync: bool = True):
        self.path, self.sync = path, sync

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, et, e, tb):
        if e is None:
            if not self.sync:
                return False
            try:
                durable.fsync_file(self.path)
                return False
            except OSError as fe:
                e = fe
        err = durable.as_oserror(e)
        if err is None or isinstance(e, durable.WriteFailed):
            return False
        raise durable.WriteFailed(self.path, err) from e


def _save(model: onnx.ModelProto, path: Path, sync: bool = True) -> None:
    """Save ``model`` at ``path``; large initializers go to ``path.name + ".data"``.

    Both files are fsynced (unless ``sync`` is False); an I/O error raises
    :class:`durable.WriteFailed` naming the file."""
    weights = sum(len(t.raw_data) for t in model.graph.initializer)
    if weights > EXTERNAL_DATA_BYTES:
        data = path.parent / f"{path.name}.data"
        with _writing(path, sync=False):
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=1024)
        with _writing(data, sync=sync):
            os.chmod(data, 0o644)
        with _writing(path, sync=sync):
            # GraphBuilder.model() could not check a graph above 2 GiB in memory; the path-based
            # checker reads the external data itself
            onnx.checker.check_model(str(path), full_check=True)
    else:
        with _writing(path, sync=sync):
            onnx.save_model(model, str(path))


def estimate_bundle_bytes(spec: ModelSpec, vw, dtype: str, tokenizer_bytes: int) -> int:
    """About how many bytes an export writes at its peak (the bundle, and for q8/q4 the float32
    graphs of the gate next to it): the figure a "no space left" message quotes."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    host = ("talker.model.text_embedding.", "talker.text_projection.", "talker.model.codec_embedding.",
            "talker.code_predictor.model.codec_embedding.")
    matrices = other = 0
    for name, shape in expected_lm_tensors(spec).items():
        if name.startswith(host):
            continue
        n = int(np.prod(shape))
        if len(shape) == 2 and ".lm_head." not in name:
            matrices += n
        else:
            other += n
    if dtype in QUANT_DTYPES:
        per = {"q8": 1.0, "q4": 0.625}[dtype]   # int8 / 4 bits + a float32 scale per 32
        graphs = matrices * per + other * 4 + (matrices + other) * 4   # + the gate's float32 graphs
    else:
        graphs = (matrices + other) * itemsize
    # two float32 graphs, each: the decoder's weights, its codebooks folded through the output
    # projections into one [num_quantizers * codebook_size, dim] table
    voc = 0
    for name, t in vw.tensors.items():
        t = np.asarray(t)
        if not name.startswith("decoder.quantizer."):
            voc += t.size
        elif name.endswith("._codebook.embedding_sum"):
            grp = name.split(".")[2]
            voc += t.shape[0] * np.asarray(vw.tensors[f"decoder.quantizer.{grp}.output_proj.weight"]).shape[0]
    vocoder = 2 * voc * 4
    G = spec.num_code_groups
    tables = (spec.text_vocab * spec.talker.hidden + spec.codec_vocab * spec.talker.hidden
              + (G - 1) * spec.predictor_vocab * spec.talker.hidden) * itemsize
    # + 5 %: the estimate leaves out graph structure and file system overhead; asking for a
    # little more than needed beats a retry that fails again
    return int((graphs + vocoder + tables + tokenizer_bytes + 64 * 1024) * 1.05)


def _disk_or_io_error(e: durable.WriteFailed, out: Path, need: int, replacing: bool) -> ExportError:
    """The one-line error of a write that failed, called once the temporary directory is gone.

    Disk full (ENOSPC) or quota exceeded (EDQUOT): ``<file>: no space left on device (the export
    needs about N MB, M MB free there); <what happened to out>``; any other I/O error:
    ``<file>: cannot write: <strerror>; <what happened to out>``.
    """
    kept = f"the bundle at {out} is unchanged" if replacing else f"nothing was written to {out}"
    if e.error.errno not in durable.DISK_FULL:
        return ExportError(e.path, f"cannot write: {e.error.strerror or e.error}; {kept}")
    what = "disk quota exceeded" if e.error.errno == getattr(errno, "EDQUOT", None) else "no space left on device"
    try:
        st = os.statvfs(out.parent)
        free = f", {st.f_bavail * st.f_frsize // 1_000_000} MB free there"
    except OSError:
        free = ""
    return ExportError(e.path, f"{what} (the export needs about {-(-need // 1_000_000)} MB{free}); {kept}")


def _graph_entry(path: Path, model: onnx.ModelProto, weights: str, weight_bytes: int) -> dict:
    sig = io_signature(model)
    return {"file": path.name, "sha256": durable.sha256_file(path), "weights": weights, "weight_bytes": weight_bytes,
            "inputs": sig["inputs"], "outputs": sig["outputs"]}


def export(checkpoint: Path, out: Path, dtype: str = "fp32", quiet: bool = False, allow_lossy: bool = False) -> dict:
    """Export ``checkpoint`` to a bundle at ``out``; returns the manifest dict.

    Raises ExportError for any problem with the input, for a quantized bundle (``q8``,
    ``q4``) that fails the fidelity gate unless ``allow_lossy``, and when the disk (or the
    user's quota) fills up (``<file>: no space left on device (the export needs about N MB, M MB
    free there); ...``); ``out`` is untouched in those cases and no temporary directory is left.
    ``out`` is replaced if it already exists and the export succeeds. A SIGKILL or power cut at
    any point leaves ``out`` as it was or the complete new bundle; the temporary directories of
    killed exports to ``out`` are removed at the start (:func:`durable.remove_stale`).
    """
    from . import tokenizer, vocoder

    if dtype not in DTYPES:
        raise ExportError(dtype, f"unknown dtype {dtype!r} ({', '.join(DTYPES)})")
    npdt = DTYPES[dtype]
    quant = dtype if dtype in QUANT_DTYPES else None
    float_name = "fp32" if npdt == np.float32 else "fp16"
    checkpoint, out = Path(checkpoint), Path(out)
    t0 = time.monotonic()
    spec = load_spec(checkpoint)
    w = LMWeights(spec)
    vw = vocoder.load_vocoder(checkpoint)
    # validate the tokenizer before any heavy work
    tok_json = tokenizer.build_tokenizer_json(checkpoint)
    need = estimate_bundle_bytes(spec, vw, dtype, len(tok_json.encode("utf-8")))
    del tok_json

    tmp = durable.partial_name(out)
    replacing = False
    try:
        with _writing(out.parent, sync=False):
            out.parent.mkdir(parents=True, exist_ok=True)
        # what killed exports to `out` left (they could not clean up): frees their space first
        with _writing(out.parent, sync=False):
            stale = durable.remove_stale(out)
        for p in stale:
            if not quiet:
                print(f"removed {p.name}, left by a killed export", file=sys.stderr)
        replacing = os.path.lexists(out)
        with _writing(tmp, sync=False):
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, durable.WriteFailed):
            raise _disk_or_io_error(e, out, need, replacing) from None
        raise
    bar_opts = dict(disable=quiet, file=sys.stderr, leave=True, dynamic_ncols=True)
    old = None
    try:
        graphs = {}
        for which in ("talker", "code_predictor"):
            lm = spec.talker if which == "talker" else spec.predictor
            with tqdm(total=2, desc=f"{which}.onnx", unit="step", **bar_opts) as bar:
                model = build_step_graph(spec, w, which, npdt, quant)
                weight_bytes = initializer_bytes(model)   # before _save moves large ones out
                bar.update(1)
                path = tmp / f"{which}.onnx"
                _save(model, path)
                bar.update(1)
            graphs[which] = _graph_entry(path, model, dtype, weight_bytes)
            del model
        for key, stateful in (("vocoder", False), ("vocoder_stream", True)):
            with tqdm(total=2, desc=f"{key}.onnx", unit="step", **bar_opts) as bar:
                model = vocoder.build_vocoder_graph(vw, stateful=stateful)
                weight_bytes = initializer_bytes(model)
                bar.update(1)
                path = tmp / f"{key}.onnx"
                _save(model, path)
                bar.update(1)
            graphs[key] = _graph_entry(path, model, "fp32", weight_bytes)
            del model

        with tqdm(total=spec.text_vocab, desc="tables.safetensors", unit="row", **bar_opts) as bar:
            text = projected_text_table(spec, w, npdt, progress=bar.update)
            codec = w["talker.model.codec_embedding.weight"].astype(npdt)
            cp = np.stack([w[f"talker.code_predictor.model.codec_embedding.{k}.weight"]
                           for k in range(spec.num_code_groups - 1)]).astype(npdt)
            from safetensors.numpy import save_file

            with _writing(tmp / "tables.safetensors") as path:
                save_file({"text_embedding": text, "codec_embedding": codec, "cp_embedding": cp},
                          str(path), metadata={"format": "herald", "dtype": float_name})
                os.chmod(path, 0o644)
        tables = {
            "file": "tables.safetensors", "dtype": "float32" if npdt == np.float32 else "float16",
            "text_embedding": {"name": "text_embedding", "shape": list(text.shape)},
            "codec_embedding": {"name": "codec_embedding", "shape": list(codec.shape)},
            "cp_embedding": {"name": "cp_embedding", "shape": list(cp.shape)},
        }
        del text, codec, cp
        with _writing(tmp / tokenizer.BUNDLE_FILE):
            tok_facts = tokenizer.write_bundle_tokenizer(checkpoint, tmp)

        facts = vocoder.vocoder_facts(vw)
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": {
                "family": FAMILY, "type": spec.model_type, "size": spec.model_size, "dtype": float_name,
                "weights": dtype,
                "source": checkpoint.resolve().name, "exporter": f"herald-export {__version__}",
            },
            "audio": {
                "sample_rate": facts["sample_rate"], "samples_per_frame": facts["samples_per_frame"],
                "num_codebooks": spec.num_code_groups, "codebook_size": spec.predictor_vocab,
            },
            "text": {"vocab_size": spec.text_vocab, **spec.text_ids},
            "codec": {"vocab_size": spec.codec_vocab, **spec.codec_ids},
            "languages": dict(sorted(spec.languages.items())),
            "speakers": dict(sorted(spec.speakers.items())),
            "speaker_dialects": dict(sorted(spec.speaker_dialects.items())),
            "sampling": sampling_defaults(spec),
            "tokenizer": tok_facts,
            "tables": tables,
            "talker": _lm_section(spec.talker, "talker"),
            "code_predictor": {**_lm_section(spec.predictor, "code_predictor"), "projection": spec.has_projection,
                               "lm_heads": spec.num_code_groups - 1},
            "vocoder": {"graph": "vocoder", "stream_graph": "vocoder_stream", **{k: v for k, v in facts.items() if k not in ("sample_rate", "samples_per_frame")},
                        "ramp": DEFAULT_RAMP},
            "attention": {"mask_fill": MASK_FILL, "rope": "rotate_half"},
            "graphs": graphs,
        }
        _write_manifest(tmp, manifest)
        if quant:
            # unmap the checkpoint first: its pages, all touched by now, would count towards
            # this process's memory while the gate holds its onnxruntime sessions
            w = None
            gate = _run_gate(spec, tmp, quant, bar_opts)
            scheme, block = QUANT_SCHEMES[quant]
            manifest["quantization"] = {"format": quant, "scheme": scheme, "block_size": block,
                                        "float_weights": FLOAT_WEIGHTS, **QUANT_ACTIVATIONS[quant], "gate": gate.table()}
            if not quiet:
                print(gate.report(), file=sys.stderr)
            if not gate.passed:
                if not allow_lossy:
                    raise ExportError("quantization gate", f"{quant} export failed the fidelity gate: "
                                      f"{'; '.join(gate.failures)} (--allow-lossy writes it anyway, with passed = false)")
                if not quiet:
                    print(f"warning: --allow-lossy: writing a {quant} bundle that failed the fidelity gate "
                          "([quantization.gate] passed = false)", file=sys.stderr)
            _write_manifest(tmp, manifest)
        # everything is written and fsynced: the directory's entries too, then swap into place
        with _writing(tmp, sync=False):
            durable.fsync_dir(tmp)
        with _writing(out, sync=False):
            old = _swap_into_place(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, durable.WriteFailed):
            raise _disk_or_io_error(e, out, need, replacing) from None
        raise
    # `out` is the new bundle; make the rename durable, then drop the previous one
    try:
        durable.fsync_dir(out.parent)
    except OSError as e:
        raise ExportError(out.parent, f"wrote the bundle at {out}, but syncing its directory failed: "
                          f"{e.strerror or e} (a power cut now may undo the replacement)") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if not quiet:
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"wrote {out} ({size / 1e6:.1f} MB, {dtype}) in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return manifest


def _write_manifest(bundle_dir: Path, manifest: dict) -> None:
    with _writing(bundle_dir / "bundle.toml") as path, open(path, "wb") as f:
        f.write(b"# herald model bundle, format v1 (docs/bundle.md). Generated by herald-export; do not edit.\n")
        tomli_w.dump(manifest, f)


def _swap_into_place(tmp: Path, out: Path) -> Path | None:
    """Rename the complete bundle ``tmp`` to ``out``; return the path now holding the previous
    bundle (to delete), or None when there was none.

    An existing ``out`` is exchanged with ``tmp`` in one ``renameat2(RENAME_EXCHANGE)``: ``out``
    is the old bundle or the new one at every instant, and afterwards ``tmp``'s name holds the
    old one. Where that call is unsupported (not Linux, ENOSYS, a file system answering EINVAL)
    this falls back to two renames, ``out`` -> ``.<name>.old-<pid>`` then ``tmp`` -> ``out``:
    between them ``out`` does not exist, and a kill there leaves the previous bundle complete
    at ``.old-<pid>``, which the next export renames back (:func:`durable.remove_stale`).
    """
    if not os.path.lexists(out):
        tmp.rename(out)
        return None
    if durable.exchange(tmp, out):
        return tmp
    # fallback: renameat2(RENAME_EXCHANGE) unsupported here (see above); a window without `out`
    old = durable.old_name(out)
    if os.path.lexists(old):
        shutil.rmtree(old)
    try:
        out.rename(old)
        tmp.rename(out)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(out):
            old.rename(out)
        raise
    # `.old-<pid>` would be restored if `out` went missing; under the temporary name a
    # half-deleted previous bundle is never mistaken for a complete one
    try:
        old.rename(tmp)
    except OSError:
        return old
    return tmp


#: Folder inside the temporary bundle directory that holds the float32 step graphs the gate
#: compares against; removed before the rename (and with the directory on any failure).
GATE_FLOAT_DIR = ".gate-fp32"
#: Float step graphs up to this size run the gate on one onnxruntime thread: thousands of small
#: calls, where a second (spinning) thread only adds overhead, and much more on a busy machine
#: (measured 28 s on one thread against 78 s on two for a 28-layer hidden-256 model while a
#: build ran). Larger graphs use onnxruntime's default (all cores).
GATE_ONE_THREAD_BYTES = 256 * 2**20


def _run_gate(spec: ModelSpec, tmp: Path, quant: str, bar_opts: dict):
    """Build the float32 step graphs next to the quantized bundle and run the fidelity gate."""
    from .gate import run_gate

    w = LMWeights(spec)
    ref_dir = tmp / GATE_FLOAT_DIR
    ref_dir.mkdir()
    paths, float_bytes = {}, 0
    for which in ("talker", "code_predictor"):
        with tqdm(total=1, desc=f"gate: {which} fp32", unit="graph", **bar_opts) as bar:
            model = build_step_graph(spec, w, which, np.float32)
            float_bytes += initializer_bytes(model)
            paths[which] = ref_dir / f"{which}.onnx"
            _save(model, paths[which], sync=False)   # removed before the bundle is renamed
            del model
            bar.update(1)
    del w
    threads = 1 if float_bytes <= GATE_ONE_THREAD_BYTES else None
    with tqdm(desc=f"gate: {quant} vs fp32", unit="frame", **bar_opts) as bar:
        result = run_gate(tmp, paths["talker"], paths["code_predictor"], quant, threads=threads, progress=bar.update)
    shutil.rmtree(ref_dir)
    return result

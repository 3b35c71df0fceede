#!/usr/bin/env python3
"""Per-op-type profile of the vocoder on tract and on onnxruntime, and its cost per emitted frame.

Usage::

    .venv/bin/python tools/bench/vocoder_profile.py --bundle build/bundles/qwen3-tts-0.6b-fp32 \
        [--frames 25] [--threads 1] [--markdown FILE]

What it measures (docs/performance.md "Vocoder (issue 13)"):

1. **Per-op profile** of one single pass of ``--frames`` frames through the bundle's windowed
   vocoder graph (``[vocoder].graph``; the stream graph has the same layers): onnxruntime's own
   profiler (``enable_profiling``, kernel time per node) and tract's (``profile_json``: time per
   node of the optimized plan). Both are folded back onto the ONNX op type of the node they came
   from (tract names its nodes ``<onnx node>.<part>``, e.g. ``block4/n_Conv_12.im2col``; a node
   onnxruntime fused keeps the fused op's name, ``FusedConv`` -> ``Conv``), so the table compares
   like with like: op type, share of each runtime's time, ms on each.
2. **Cost per emitted frame** on both runtimes: a single pass over ``left_context + chunk``
   frames (the whole utterance at once), the windowed decoder's steady window (the same
   ``left_context + chunk`` frames, of which ``chunk`` are kept) and, when the bundle has a
   stream graph, one stateful chunk of ``chunk`` frames and of 1 and 2 frames. Medians of
   ``--runs`` runs after one warm-up.

tract here is the ``tract`` Python package (the same tract version as herald's, 0.23.9; it
dispatches to the same CPU kernels at run time): ``.venv/bin/pip install tract==0.23.9`` if it
is missing. herald's own numbers come from ``herald bench`` (scripts/bench).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def codes_for(frames: int) -> np.ndarray:
    """herald bench's codes: (f * 131 + q * 977) mod 2048, int64 [1, 16, frames]."""
    f = np.arange(frames)[None, :]
    q = np.arange(16)[:, None]
    return ((f * 131 + q * 977) % 2048).astype(np.int64)[None]


def op_types(path: Path) -> dict[str, str]:
    m = onnx.load(str(path), load_external_data=False)
    return {n.name: n.op_type for n in m.graph.node}


def ort_session(path: Path, threads: int, profile: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_profile(path: Path, codes: np.ndarray, threads: int, runs: int) -> dict[str, float]:
    """ms per run by ONNX op type (onnxruntime's kernel times, first run excluded)."""
    s = ort_session(path, threads, True)
    s.run(None, {"codes": codes})
    for _ in range(runs):
        s.run(None, {"codes": codes})
    events = json.loads(Path(s.end_profiling()).read_text(encoding="utf-8"))
    per_run: list[collections.Counter] = []
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            per_run.append(collections.Counter())
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and per_run:
            op = e["args"].get("op_name", "?")
            op = op[len("Fused"):] if op.startswith("Fused") else op
            per_run[-1][op] += e["dur"] / 1e3
    timed = per_run[1:] or per_run
    return {op: statistics.median(r.get(op, 0.0) for r in timed) for op in set().union(*timed)}


def tract_model(path: Path, threads: int):
    try:
        import tract  # noqa: PLC0415
    except ImportError:
        fail("the tract Python package is missing: .venv/bin/pip install tract==0.23.9")
    if threads != 1:
        print("note: the tract Python package computes on one thread", file=sys.stderr)
    return tract.onnx().load(str(path)).into_model().into_runnable()


def tract_profile(model, path: Path, codes: np.ndarray) -> dict[str, float]:
    """ms per run by ONNX op type (tract's per-node profile of the optimized plan)."""
    types = op_types(path)
    prof = json.loads(model.profile_json([codes]))
    out: collections.Counter = collections.Counter()
    for n in prof["nodes"]:
        name = n.get("node_name", "")
        base = name
        while base and base not in types and "." in base:
            base = base.rsplit(".", 1)[0]
        out[types.get(base, n.get("op_name", "?"))] += n.get("secs_per_iter", 0.0) * 1e3
    return dict(out)


def herald_profile(args, form: str, frames: int) -> dict:
    """``herald bench --profile vocoder --profile-concrete`` of ``form`` over ``frames`` frames (its JSON).

    Concrete: a plan optimized for exactly ``frames`` frames, as herald runs its stateful vocoder
    (plans of 2 and 1 frames, ``backend_tract::vocoder::STREAM_PLAN_FRAMES``); tract picks its
    faster convolution kernels only for concrete shapes."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "profile.json"
        cmd = [str(args.herald), "bench", "--bundle", str(args.bundle), "--profile", "vocoder", "--vocoder", form,
               "--profile-frames", str(frames), "--threads", str(args.threads), "--vocoder-steps", str(args.runs),
               "--profile-concrete", "--json", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
        return json.loads(out.read_text(encoding="utf-8"))


def median_ms(run, runs: int) -> float:
    run()
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=25, help="frames of the profiled single pass (default 25)")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (tract: 1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--herald", type=Path, help="a herald binary: its own tract profile (herald bench --profile "
                    "vocoder, SnakeBeta fused) replaces the tract Python package's in the op table")
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    if args.frames < 1 or args.runs < 1 or args.threads < 1:
        fail("--frames, --runs and --threads must be at least 1")
    try:
        m = tomllib.loads((args.bundle / "bundle.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        fail(f"{args.bundle / 'bundle.toml'}: {e}")
    voc = m["vocoder"]
    windowed = args.bundle / m["graphs"][voc["graph"]]["file"]
    stream_key = voc.get("stream_graph")
    stream = args.bundle / m["graphs"][stream_key]["file"] if stream_key else None
    ctx, chunk = int(voc["left_context_frames"]), int(voc["ramp"][-1])

    codes = codes_for(args.frames)
    o = ort_profile(windowed, codes, args.threads, args.runs)
    tm = tract_model(windowed, args.threads)
    if args.herald:
        t = {op["op"]: op["ms"] for op in herald_profile(args, "windowed", args.frames)["ops"]}
        who = (f"herald's tract ({args.herald.name} bench --profile vocoder --profile-concrete: SnakeBeta fused, a plan "
               f"for exactly {args.frames} frames) on {args.threads}")
    else:
        t = tract_profile(tm, windowed, codes)
        who = "tract (Python package) on 1"
    to, tt = sum(o.values()), sum(t.values())
    lines = [
        f"Vocoder profile: one single pass of {args.frames} frames through `{windowed.name}` "
        f"({args.bundle.name}), onnxruntime {ort.__version__} on {args.threads} thread(s), {who}.",
        "",
        "| op type | tract ms | tract share | onnxruntime ms | onnxruntime share | tract / onnxruntime |",
        "|---|---|---|---|---|---|",
    ]
    for op in sorted(set(o) | set(t), key=lambda k: -t.get(k, 0.0)):
        a, b = t.get(op, 0.0), o.get(op, 0.0)
        if a < 0.05 * tt / 100 and b < 0.05 * to / 100:
            continue
        ratio = f"{a / b:.1f}" if b > 0 else "–"
        lines.append(f"| {op} | {a:.1f} | {100 * a / tt:.1f} % | {b:.1f} | {100 * b / to:.1f} % | {ratio} |")
    lines.append(f"| **total** | **{tt:.1f}** | | **{to:.1f}** | | **{tt / to:.2f}** |")

    # cost per emitted frame
    so = ort_session(windowed, args.threads, False)
    win = codes_for(ctx + chunk)
    def tract_ms(form: str, frames: int, run) -> float:
        return herald_profile(args, form, frames)["total_ms"] if args.herald else median_ms(run, args.runs)

    rows = [
        ("single pass", ctx + chunk, ctx + chunk,
         tract_ms("windowed", ctx + chunk, lambda: tm.run([win])),
         median_ms(lambda: so.run(None, {"codes": win}), args.runs)),
        (f"windowed ({ctx} + {chunk})", ctx + chunk, chunk, None, None),
    ]
    rows[1] = (rows[1][0], rows[1][1], rows[1][2], rows[0][3], rows[0][4])  # the same computation
    if stream is not None:
        sm = tract_model(stream, 1)
        ss = ort_session(stream, args.threads, False)
        zeros = []
        for i in m["graphs"][stream_key]["inputs"][1:]:
            zeros.append(np.zeros(i["shape"], np.int64 if i["dtype"] == "int64" else np.float32))
        names = [i["name"] for i in m["graphs"][stream_key]["inputs"]]
        for n in sorted({1, 2, chunk}):
            c = codes_for(n)
            feeds = dict(zip(names, [c, *zeros]))
            rows.append((f"stateful chunk of {n}", n, n, tract_ms("stateful", n, lambda c=c: sm.run([c, *zeros])),
                         median_ms(lambda f=feeds: ss.run(None, f), args.runs)))
    lines += [
        "",
        f"Cost per emitted frame ({'herald' if args.herald else 'tract Python package'} vs onnxruntime, "
        f"{args.threads} thread(s), median of {args.runs}):",
        "",
        "| decoding | frames computed | frames emitted | tract ms per emitted frame | onnxruntime ms per emitted frame | tract / onnxruntime |",
        "|---|---|---|---|---|---|",
    ]
    for name, comp, emit, a, b in rows:
        lines.append(f"| {name} | {comp} | {emit} | {a / emit:.1f} | {b / emit:.1f} | {a / b:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

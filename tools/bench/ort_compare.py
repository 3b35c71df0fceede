#!/usr/bin/env python3
"""herald against onnxruntime on the same step graphs, interleaved in one invocation.

Runs ``rounds`` rounds of A B: A = ``herald bench --steps-only --json`` (a subprocess: talker
decode step at each past length, one code-predictor sub-step, one vocoder window), B = the same
three graphs of the same bundle on onnxruntime's CPU provider with the same thread count
(``intra_op_num_threads`` = threads, ``inter_op_num_threads`` = 1, sequential execution, all
graph optimizations), the same shapes and the same kind of inputs:

- talker: ``x`` = codec-embedding rows of the bundle's table (the ids herald uses), cos/sin of
  the step's position, caches of herald's slot count (from round A's JSON) with the positions
  herald holds visible and the spare slots masked, one new position;
- code predictor: one-position sub-steps at positions 2..15 over 16 slots, heads 1..14;
- vocoder: a window of ``left_context + last ramp chunk`` frames of the codes herald uses, or, when
  herald decodes stateful, one chunk of the last ramp size through the stream graph (zero state:
  the cost does not depend on the state's values).

Cache contents are random (herald's come from a prefill): dense kernels do not depend on the
values. Reported per step: each runtime's median over its rounds (each round's figure is a
median over ``steps`` timed runs after ``warmup``), and herald / onnxruntime (< 1: herald is
faster). Output: JSON (``--json``) and a markdown table (``--markdown`` and standard output).

Usage:
    tools/bench/ort_compare.py --bundle build/bundles/qwen3-tts-0.6b-fp32 --herald target/release/herald \\
        [--threads N] [--rounds 2] [--steps 50] [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
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


def fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


class Bundle:
    """The bundle's manifest, tables and onnxruntime sessions."""

    def __init__(self, path: Path, threads: int):
        import onnxruntime as ort
        from safetensors.numpy import load_file

        self.path = path
        try:
            self.m = tomllib.loads((path / "bundle.toml").read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            fail(f"{path / 'bundle.toml'}: {e}")
        tables = load_file(str(path / self.m["tables"]["file"]))
        self.codec = tables[self.m["tables"]["codec_embedding"]["name"]].astype(np.float32)
        del tables
        self.cache_dt = np.float16 if self.m["model"]["dtype"] == "fp16" else np.float32
        self.fill = np.float32(self.m["attention"]["mask_fill"])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._caches: dict = {}
        self.sess = {}
        for key in ("talker", "code_predictor", "vocoder"):
            g = self.m[key]["graph"]
            f = path / self.m["graphs"][g]["file"]
            self.sess[key] = ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"])
        stream = self.m["vocoder"].get("stream_graph")
        if stream:
            f = path / self.m["graphs"][stream]["file"]
            self.sess["vocoder_stream"] = ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"])
            self.stream_states = {
                i["name"]: np.zeros(i["shape"], np.int64 if i["dtype"] == "int64" else np.float32)
                for i in self.m["graphs"][stream]["inputs"] if i["name"].startswith("state.")
            }

    def rows(self, n: int, salt: int) -> np.ndarray:
        """Codec-embedding rows with herald's ids: (r * 2654435761 + salt) mod 2^32 mod 2048."""
        r = np.arange(n, dtype=np.uint64)
        ids = ((r * np.uint64(2654435761) + np.uint64(salt)) % np.uint64(1 << 32)) % np.uint64(2048)
        return self.codec[ids.astype(np.int64)]

    def rope(self, key: str, pos: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.m[key]
        d = s["head_dim"]
        inv = (1.0 / np.float32(s["rope_theta"]) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(np.float32)
        ang = np.float32(pos) * inv
        ang = np.concatenate([ang, ang])
        return np.cos(ang)[None, None].astype(np.float32), np.sin(ang)[None, None].astype(np.float32)

    def step_feeds(self, key: str, slots: int, held: int, x: np.ndarray, head: int | None, rng) -> dict:
        s = self.m[key]
        kv, d = s["kv_heads"], s["head_dim"]
        cos, sin = self.rope(key, held)
        past = np.full((1, 1, 1, slots), self.fill, np.float32)
        past[..., :held] = 0.0
        feeds = {"x": x[None, None].astype(np.float32), "cos": cos, "sin": sin, "mask_full_past": past,
                 "mask_full_new": np.zeros((1, 1, 1, 1), np.float32)}
        if head is not None:
            feeds["head"] = np.array([head], np.int64)
        key_slots = (key, slots)
        if key_slots not in self._caches:  # one set of caches per graph and slot count, shared by the steps
            self._caches = {key_slots: {f"{kvn}_cache_{i}": (0.5 * rng.standard_normal((1, slots, kv, d))).astype(self.cache_dt)
                                        for i in range(s["layers"]) for kvn in ("k", "v")}}
        feeds.update(self._caches[key_slots])
        names = {i.name for i in self.sess[key].get_inputs()}
        missing = names - set(feeds)
        if missing:
            fail(f"{self.path}: {key} graph has inputs this comparator does not feed: {sorted(missing)}")
        return {k: v for k, v in feeds.items() if k in names}


def time_runs(sess, feed_list: list[dict], warmup: int) -> list[float]:
    out = []
    for i, f in enumerate(feed_list):
        t0 = time.perf_counter()
        sess.run(None, f)
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt * 1e3)
    return out


def ort_round(b: Bundle, herald: dict, warmup: int, steps: int, vocoder_steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    res = {}
    for t in herald["steps"]["talker"]:
        slots, past = t["slots"], t["past"]
        x = b.rows(steps + warmup, 2)
        feeds = [b.step_feeds("talker", slots, min(past + i, slots - 1), x[i], None, rng)
                 for i in range(warmup + steps)]
        res[f"talker past {past}"] = statistics.median(time_runs(b.sess["talker"], feeds, warmup))
        del feeds
    x = b.rows(16, 3)
    feeds = []
    while len(feeds) < warmup + steps:
        for k in range(1, 15):
            feeds.append(b.step_feeds("code_predictor", 16, k + 1, x[k + 1], k, rng))
    feeds = feeds[: warmup + steps]
    res["code_predictor sub-step"] = statistics.median(time_runs(b.sess["code_predictor"], feeds, warmup))
    del feeds
    v = herald["steps"]["vocoder"]
    frames = v["slots"]
    f = np.arange(frames)[None, :]
    q = np.arange(16)[:, None]
    codes = ((f * 131 + q * 977) % 2048).astype(np.int64)[None]
    if v["graph"] == "vocoder_stream":  # herald decoded a stateful chunk: the same graph and chunk here
        feeds = {"codes": codes, **b.stream_states}
        res[f"vocoder stream chunk {frames} frames"] = statistics.median(
            time_runs(b.sess["vocoder_stream"], [feeds] * (1 + vocoder_steps), 1))
    else:
        res[f"vocoder window {frames} frames"] = statistics.median(
            time_runs(b.sess["vocoder"], [{"codes": codes}] * (1 + vocoder_steps), 1))
    return res


def herald_round(exe: Path, bundle: Path, threads: int, args, out: Path) -> dict:
    cmd = [str(exe), "bench", "--bundle", str(bundle), "--steps-only", "--threads", str(threads),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocoder-steps", str(args.vocoder_steps),
           "--past", ",".join(str(p) for p in args.past), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(out.read_text(encoding="utf-8"))


def herald_medians(h: dict, warmup: int) -> dict:
    s = h["steps"]
    out = {f"talker past {t['past']}": t["timing"]["median_ms"] for t in s["talker"]}
    out["code_predictor sub-step"] = s["code_predictor"]["timing"]["median_ms"]
    kind = "stream chunk" if s["vocoder"]["graph"] == "vocoder_stream" else "window"
    out[f"vocoder {kind} {s['vocoder']['slots']} frames"] = s["vocoder"]["timing"]["median_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--herald", type=Path, default=Path("target/release/herald"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vocoder-steps", type=int, default=3)
    ap.add_argument("--past", type=lambda s: [int(v) for v in s.split(",")], default=[64, 512])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    if not (args.bundle / "bundle.toml").is_file():
        fail(f"{args.bundle}: not a bundle (no bundle.toml)")
    if not args.herald.is_file():
        fail(f"{args.herald}: herald binary not found (build it: cargo build --release -p herald)")
    if args.threads < 1 or args.rounds < 1 or args.steps < 1:
        fail("--threads, --rounds and --steps must be at least 1")

    import onnxruntime as ort

    b = Bundle(args.bundle, args.threads)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="herald-ortcmp-") as td:
        for r in range(args.rounds):
            h = herald_round(args.herald, args.bundle, args.threads, args, Path(td) / f"h{r}.json")
            o = ort_round(b, h, args.warmup, args.steps, args.vocoder_steps, seed=r)
            rounds.append({"herald_ms": herald_medians(h, args.warmup), "onnxruntime_ms": o,
                           "bandwidth_gb_per_s": h["steps"]["bandwidth"]["gb_per_s"]})
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    steps = {}
    for name in rounds[0]["herald_ms"]:
        hm = [x["herald_ms"][name] for x in rounds]
        om = [x["onnxruntime_ms"][name] for x in rounds]
        steps[name] = {"herald_ms": statistics.median(hm), "onnxruntime_ms": statistics.median(om),
                       "ratio": statistics.median(a / c for a, c in zip(hm, om)),
                       "herald_rounds_ms": hm, "onnxruntime_rounds_ms": om}
    result = {"bundle": str(args.bundle), "dtype": b.m["model"]["dtype"], "threads": args.threads,
              "rounds": args.rounds, "steps_per_round": args.steps, "warmup": args.warmup,
              "onnxruntime": ort.__version__, "steps": steps, "round_details": rounds}
    md = [f"herald vs onnxruntime {ort.__version__} on `{args.bundle}` ({b.m['model']['dtype']}), "
          f"{args.threads} threads, {args.rounds} interleaved rounds (A B A B ...), medians of {args.steps} steps.\n",
          "| step | herald ms | onnxruntime ms | herald / onnxruntime |", "|---|---|---|---|"]
    for name, s in steps.items():
        md.append(f"| {name} | {s['herald_ms']:.2f} | {s['onnxruntime_ms']:.2f} | {s['ratio']:.2f} |")
    text = "\n".join(md) + "\n"
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2) + "\n")
    if args.markdown:
        write_atomic(args.markdown, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

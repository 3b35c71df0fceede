"""Measure the two ways a bundle can carry the text side, at the real 0.6B/1.7B dimensions.

(a) projected table: text_projection(text_embedding) precomputed for every id, [151936, H] fp16,
    memory-mapped; a prompt costs one row copy per token.
(b) raw table [151936, 2048] fp16 memory-mapped + the projection (2048->2048->H, SiLU) as its own
    small ONNX graph run per prompt.

For each: time to open (map the table, create the session), resident memory added after a
typical prompt (300 distinct ids), and time to embed that prompt. Random values; only sizes matter.

    python tools/export/measure_text_table.py [--hidden 1024] [--dir /tmp/herald-measure]

The numbers go into docs/bundle.md ("Text side: why the table is pre-projected").
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from safetensors.numpy import save_file

from herald_export.onnx_graph import GraphBuilder

ROWS, TEXT_HIDDEN = 151936, 2048


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_table(path: Path, cols: int):
    rng = np.random.default_rng(0)
    t = np.empty((ROWS, cols), np.float16)
    for s in range(0, ROWS, 16384):
        t[s : s + 16384] = rng.standard_normal((min(16384, ROWS - s), cols)).astype(np.float16)
    save_file({"t": t}, str(path))


def open_table(path: Path):
    """Memory-map a single-tensor safetensors file the way the runtime does (no copy)."""
    import json
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(n))["t"]
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    b, e = info["data_offsets"]
    return np.frombuffer(mm[8 + n + b : 8 + n + e], dtype=np.float16).reshape(info["shape"])


def projection_graph(hidden: int) -> bytes:
    rng = np.random.default_rng(1)
    b = GraphBuilder("text_projection", np.float16)
    x = b.input("x", np.float16, [1, "seq", TEXT_HIDDEN])
    h = b.linear(x, rng.standard_normal((TEXT_HIDDEN, TEXT_HIDDEN)) * 0.02, np.zeros(TEXT_HIDDEN))
    y = b.linear(b.silu(h), rng.standard_normal((hidden, TEXT_HIDDEN)) * 0.02, np.zeros(hidden))
    b.output(y, "y", np.float16, [1, "seq", hidden])
    return b.model().SerializeToString()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/herald-measure"))
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(2).choice(60000, 300, replace=False)
    pa, pb = a.dir / f"projected_{a.hidden}.safetensors", a.dir / "raw_2048.safetensors"
    if not pa.exists():
        write_table(pa, a.hidden)
    if not pb.exists():
        write_table(pb, TEXT_HIDDEN)
    os.system("sync")
    print(f"files: projected {pa.stat().st_size / 1e6:.0f} MB, raw {pb.stat().st_size / 1e6:.0f} MB")

    r0 = rss_mb()
    t0 = time.perf_counter()
    tab = open_table(pa)
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    emb = tab[ids].astype(np.float32)
    t_embed = time.perf_counter() - t0
    print(f"(a) projected table: open {t_open * 1e3:.2f} ms, embed 300 ids {t_embed * 1e3:.2f} ms, "
          f"RSS +{rss_mb() - r0:.1f} MB")
    del tab, emb

    r0 = rss_mb()
    t0 = time.perf_counter()
    raw = open_table(pb)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(projection_graph(a.hidden), so, providers=["CPUExecutionProvider"])
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    x = raw[ids][None]
    sess.run(None, {"x": x})
    t_embed = time.perf_counter() - t0
    print(f"(b) raw table + projection graph: open {t_open * 1e3:.1f} ms, embed 300 ids {t_embed * 1e3:.2f} ms, "
          f"RSS +{rss_mb() - r0:.1f} MB")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()

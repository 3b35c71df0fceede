#!/usr/bin/env python3
"""Check that ``herald bench --json`` and ``ort_compare.py --json`` outputs are complete.

Every field docs/performance.md describes must be present with a plausible value: latencies,
bandwidth, floors and fractions positive and finite, the pipeline's RTF / TTFA / stall / per-frame
split, allocations per frame, peak RSS, load time, and a thread-sweep entry per thread count.
Used by scripts/test on the tiny bundle (the numbers themselves are not judged there).

Usage: check_results.py --bench bench.json [--sweep N] [--ort ort.json]
       check_results.py --board-report board-report.json --frames N --sweep N
(the second: scripts/board-report's file, each round's embedded bench checked as above, the
speak line's RTF, TTFA, frames and peak RSS, the clock and thermal snapshots, the load).
Exit 0 when complete; 1 with one line per missing or implausible field.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

problems: list[str] = []


def get(d, path: str):
    cur = d
    for part in path.split("."):
        if isinstance(cur, list):
            cur = cur[int(part)] if part.isdigit() and int(part) < len(cur) else None
        elif isinstance(cur, dict):
            cur = cur.get(part)
        else:
            cur = None
        if cur is None:
            problems.append(f"{path}: missing")
            return None
    return cur


def positive(d, path: str, allow_zero: bool = False) -> None:
    v = get(d, path)
    if v is None:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        problems.append(f"{path}: implausible value {v!r}")


def step(d, path: str, floor: bool) -> None:
    for k in ("timing.median_ms", "timing.min_ms", "timing.p90_ms", "slots"):
        positive(d, f"{path}.{k}")
    positive(d, f"{path}.timing.count")
    positive(d, f"{path}.past", allow_zero=True)
    if floor:
        for k in ("weight_bytes", "kv_bytes", "floor_ms", "floor_fraction"):
            positive(d, f"{path}.{k}")


def step_set(d, path: str, pasts: int) -> None:
    positive(d, f"{path}.threads")
    positive(d, f"{path}.bandwidth.gb_per_s")
    positive(d, f"{path}.bandwidth.buffer_bytes")
    talker = get(d, f"{path}.talker") or []
    if len(talker) < pasts:
        problems.append(f"{path}.talker: {len(talker)} past lengths, expected {pasts}")
    for i in range(len(talker)):
        step(d, f"{path}.talker.{i}", True)
    step(d, f"{path}.code_predictor", True)
    positive(d, f"{path}.predictor_frame.median_ms")
    step(d, f"{path}.vocoder", False)


def check_bench(b: dict, sweep: int) -> None:
    for k in ("bundle", "model", "dtype", "dims"):
        get(b, k)
    positive(b, "threads")
    positive(b, "peak_rss_bytes")
    positive(b, "load.open_s")
    positive(b, "load.first_frame_s")
    step_set(b, "steps", 2)
    for k in ("frames", "audio_s", "wall_s", "rtf", "ttfa_s", "playback_start_s", "prefill_ms", "talker_ms_per_frame",
              "predictor_ms_per_frame", "vocoder_ms_per_frame", "wall_ms_per_frame", "pool_blocks_per_frame",
              "memory.decode_served", "memory.vocoder_served"):
        positive(b, f"pipeline.{k}")
    # the frame pools may keep the steady state entirely off the heap
    positive(b, "pipeline.memory.decode_steady_frames")
    positive(b, "pipeline.memory.vocoder_steady_frames")
    for k in ("allocations_per_frame", "process_allocations_per_frame", "memory.decode_frames_on_heap",
              "memory.vocoder_chunks_on_heap", "memory.decode_steady_heap_allocations",
              "memory.vocoder_steady_heap_allocations"):
        positive(b, f"pipeline.{k}", allow_zero=True)
    positive(b, "pipeline.stall_s", allow_zero=True)
    positive(b, "pipeline.stall_gaps", allow_zero=True)
    v = get(b, "pipeline.other_ms_per_frame")
    if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
        problems.append(f"pipeline.other_ms_per_frame: implausible value {v!r}")
    sw = get(b, "sweep") or []
    if len(sw) != sweep:
        problems.append(f"sweep: {len(sw)} entries, expected {sweep}")
    for i in range(len(sw)):
        step_set(b, f"sweep.{i}", 1)
        if sw[i].get("threads") != i + 1:
            problems.append(f"sweep.{i}.threads: {sw[i].get('threads')}, expected {i + 1}")


def check_ort(o: dict) -> None:
    positive(o, "threads")
    positive(o, "rounds")
    steps = get(o, "steps") or {}
    names = list(steps)
    want = ["talker past", "code_predictor sub-step", ("vocoder window", "vocoder stream chunk")]
    for w in want:
        alts = w if isinstance(w, tuple) else (w,)
        if not any(n.startswith(a) for n in names for a in alts):
            problems.append(f"steps: no '{' or '.join(alts)}' entry (have {names})")
    for n in names:
        for k in ("herald_ms", "onnxruntime_ms", "ratio"):
            positive(o, f"steps.{n}.{k}")


def check_board_report(r: dict, frames: int, sweep: int) -> None:
    if r.get("report_version") != 1:
        problems.append(f"report_version: {r.get('report_version')!r}, expected 1")
    for k in ("date_utc", "herald", "herald_command", "bundle", "machine.uname", "machine.cpu"):
        get(r, k)
    positive(r, "machine.cpus")
    positive(r, "machine.mem_kib")
    if not str(r.get("probe") or "").strip():
        problems.append("probe: empty")
    if r.get("frames") != frames:
        problems.append(f"frames: {r.get('frames')!r}, expected {frames}")
    positive(r, "load_minutes", allow_zero=True)
    positive(r, "load_utterances", allow_zero=True)
    if r.get("load_minutes", 0) > 0 and not r.get("load"):
        problems.append("load: no snapshot during the load")
    rounds = get(r, "rounds") or []
    if len(rounds) != 2:
        problems.append(f"rounds: {len(rounds)}, expected 2")
    for i, rd in enumerate(rounds):
        for when in ("before", "after"):
            positive(r, f"rounds.{i}.{when}.t_s", allow_zero=True)
            for k in ("cpu_khz", "thermal"):
                if not isinstance(get(r, f"rounds.{i}.{when}.{k}"), list):
                    problems.append(f"rounds.{i}.{when}.{k}: not a list")
        for k in ("rtf", "ttfa_ms", "peak_rss_kib"):
            positive(r, f"rounds.{i}.speak.{k}")
        positive(r, f"rounds.{i}.speak.xruns", allow_zero=True)
        if get(r, f"rounds.{i}.speak.frames") != frames:
            problems.append(f"rounds.{i}.speak.frames: {rd.get('speak', {}).get('frames')!r}, expected {frames}")
        before = len(problems)
        check_bench(rd.get("bench") or {}, sweep)
        problems[before:] = [f"rounds.{i}.bench.{p}" for p in problems[before:]]
        if get(r, f"rounds.{i}.bench.pipeline.frames") != frames:
            problems.append(f"rounds.{i}.bench.pipeline.frames: expected {frames}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", type=Path)
    ap.add_argument("--board-report", type=Path, help="scripts/board-report's JSON instead of --bench")
    ap.add_argument("--frames", type=int, help="the board report's --frames")
    ap.add_argument("--sweep", type=int, required=True, help="expected thread-sweep entries")
    ap.add_argument("--ort", type=Path)
    a = ap.parse_args()
    if (a.bench is None) == (a.board_report is None) or (a.board_report is not None and a.frames is None):
        ap.error("give --bench, or --board-report with --frames")
    try:
        if a.board_report is not None:
            check_board_report(json.loads(a.board_report.read_text(encoding="utf-8")), a.frames, a.sweep)
            what = str(a.board_report)
        else:
            check_bench(json.loads(a.bench.read_text(encoding="utf-8")), a.sweep)
            if a.ort:
                check_ort(json.loads(a.ort.read_text(encoding="utf-8")))
            what = f"{a.bench}{' and ' + str(a.ort) if a.ort else ''}"
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"{what}: every field present")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

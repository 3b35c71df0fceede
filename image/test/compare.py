"""Compare the loopback capture from the QEMU guest with the x86_64 reference WAV.

Usage: python compare.py CAPTURE.raw REFERENCE.wav FRAMES [--min-snr-db 60] [--capture-start S]

CAPTURE.raw is what arecord recorded on hw:Loopback,1,0 in the guest: raw S16_LE, mono, 24 kHz,
started before herald opened the playback side and stopped a second after herald exited. The
loopback delivers exact silence (zeros) while nothing plays, so the capture is
    zeros(offset) ++ herald's samples ++ zeros(rest).

Alignment rule: the offset is first estimated from the first non-zero sample of each signal
(capture minus reference), then refined to the lag with the largest cross-correlation within
+/- 480 samples (20 ms) of that estimate. Checks, each failing with one line on stderr:
  - the reference holds exactly FRAMES x 1920 samples (80 ms frames at 24 kHz, from herald's log);
  - the reference fits in the capture at the offset;
  - everything outside [offset, offset + len(reference)) in the capture is exactly zero (no
    sample was added, duplicated or delayed by an underrun);
  - SNR = 10 log10(sum ref^2 / sum (capture - ref)^2) over the aligned span >= --min-snr-db.
Prints `key=value` lines: samples, offset, snr_db, first_audio_s (capture start + offset of the
first non-zero sample, when --capture-start is given).
"""

from __future__ import annotations

import argparse
import math
import sys
import wave

import numpy as np

RATE = 24000
SAMPLES_PER_FRAME = 1920  # one 12.5 Hz codec frame = 80 ms at 24 kHz
SEARCH = 480
JIFFY = 96  # one 4 ms kernel tick (Debian arm64: HZ=250) at 24 kHz


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def read_reference(path: str) -> np.ndarray:
    with wave.open(path, "rb") as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2 or w.getframerate() != RATE:
            fail(f"{path}: expected 16-bit mono {RATE} Hz, got {w.getsampwidth() * 8}-bit "
                 f"{w.getnchannels()} ch {w.getframerate()} Hz")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("reference")
    ap.add_argument("frames", type=int)
    ap.add_argument("--min-snr-db", type=float, default=60.0)
    ap.add_argument("--capture-start", type=float, default=None)
    ap.add_argument("--trailing", type=int, default=0,
                    help="samples of trailing silence herald adds (audio.trailing_silence_ms)")
    ap.add_argument("--capture-buffer", type=int, default=0,
                    help="arecord's ring buffer in samples (enables the snd-aloop stale-tail rule)")
    a = ap.parse_args()

    raw = open(a.capture, "rb").read()
    if len(raw) % 2:
        fail(f"{a.capture}: odd byte count {len(raw)} for S16_LE")
    cap = np.frombuffer(raw, dtype="<i2").astype(np.int64)
    ref = read_reference(a.reference)
    n = len(ref)
    if n != a.frames * SAMPLES_PER_FRAME + a.trailing:
        fail(f"reference has {n} samples, expected {a.frames} frames x {SAMPLES_PER_FRAME} + "
             f"{a.trailing} trailing silence = {a.frames * SAMPLES_PER_FRAME + a.trailing}")
    nz_ref = np.flatnonzero(ref)
    nz_cap = np.flatnonzero(cap)
    if len(nz_ref) == 0:
        fail("the reference is all silence")
    if len(nz_cap) == 0:
        fail(f"the capture ({len(cap)} samples) is all silence: nothing reached the loopback")
    guess = int(nz_cap[0] - nz_ref[0])
    best, best_corr = None, -math.inf
    for off in range(max(0, guess - SEARCH), guess + SEARCH + 1):
        if off + n > len(cap):
            break
        c = float(np.dot(cap[off:off + n], ref))
        if c > best_corr:
            best, best_corr = off, c
    if best is None:
        fail(f"the reference ({n} samples) does not fit in the capture ({len(cap)} samples) "
             f"near offset {guess}: audio is missing")
    off = best
    # snd-aloop artifact: when the playback stops in the middle of a timer tick (one jiffy, 4 ms
    # = 96 samples at HZ=250), the capture pointer still advances by the whole tick without the
    # driver writing those bytes, so arecord reads back what its ring buffer held one buffer
    # (--capture-buffer samples) earlier. Such samples right after the span are accepted only if
    # they equal the capture exactly one buffer before, and only for up to two ticks.
    tail_ok = 0
    if a.capture_buffer:
        while (tail_ok < 2 * JIFFY and off + n + tail_ok < len(cap)
               and cap[off + n + tail_ok] != 0
               and cap[off + n + tail_ok] == cap[off + n + tail_ok - a.capture_buffer]):
            tail_ok += 1
    print(f"stale_tail_samples={tail_ok}")
    outside = np.concatenate([cap[:off], cap[off + n + tail_ok:]])
    stray = np.flatnonzero(outside)
    if len(stray):
        first = int(stray[0]) if stray[0] < off else int(stray[0]) + n
        fail(f"{len(stray)} non-zero captured samples outside the aligned span "
             f"[{off}, {off + n}) (first at {first}): extra, repeated or shifted audio")
    span = cap[off:off + n]
    err = float(np.sum((span - ref) ** 2))
    sig = float(np.sum(ref ** 2))
    snr = math.inf if err == 0 else 10 * math.log10(sig / err)
    print(f"samples={n}")
    print(f"capture_samples={len(cap)}")
    print(f"offset={off}")
    print(f"identical_samples={int(np.sum(span == ref))}")
    print(f"max_abs_diff={int(np.max(np.abs(span - ref)))}")
    print(f"snr_db={'inf' if math.isinf(snr) else f'{snr:.1f}'}")
    if a.capture_start is not None:
        print(f"first_audio_s={a.capture_start + (off + int(nz_ref[0])) / RATE:.2f}")
    if snr < a.min_snr_db:
        fail(f"SNR {snr:.1f} dB between the guest's capture and the x86_64 reference is below "
             f"{a.min_snr_db:g} dB")


if __name__ == "__main__":
    main()

"""Check the Wyoming reply that `herald serve` sent in the QEMU guest against the x86_64 reference.

Usage: python wyoming_reply.py REPLY.bin REFERENCE.wav FRAMES [--trailing N] [--min-snr-db 60]
                               [--capture CAPTURE.raw --capture-offset OFFSET]

REPLY.bin is every byte the guest's client (busybox nc) received on 127.0.0.1:10200 for one
`synthesize` event, up to the server closing the connection. Wyoming framing (OHF-Voice/wyoming
event.py): a JSON header line {"type", "version", "data"?, "data_length"?, "payload_length"?} and
a newline, then data_length bytes of JSON merged into the data, then payload_length bytes of
payload. Checks, each failing with one line on stderr:
  - the reply parses into whole events, with no bytes left over;
  - the events are exactly audio-start, one or more audio-chunk, audio-stop (no error event);
  - audio-start and every audio-chunk say rate 24000, width 2, channels 1; every chunk carries a
    non-empty payload of whole samples;
  - the chunks' payloads, concatenated, hold exactly FRAMES x 1920 + --trailing samples (the
    same count as the reference WAV, which herald wrote for the same text, seed and settings);
  - they equal the reference sample for sample, or else SNR >= --min-snr-db over the whole
    utterance (the rule of compare.py: the aarch64 and x86_64 kernels may differ in the last bit).
No alignment: a Wyoming stream has no device in between, so sample 0 is herald's first sample.
With --capture and --capture-offset (compare.py's `offset`), it also reports how many samples
equal the guest's own `herald speak` capture over the aligned span (information, not a check).
Prints `key=value` lines: events, chunks, samples, identical_samples, max_abs_diff, snr_db
(and capture_identical_samples).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from compare import RATE, SAMPLES_PER_FRAME, fail, read_reference

FORMAT = {"rate": RATE, "width": 2, "channels": 1}


def parse(raw: bytes) -> list[tuple[str, dict, bytes]]:
    """The events of `raw` as (type, data, payload)."""
    events, pos = [], 0
    while pos < len(raw):
        nl = raw.find(b"\n", pos)
        if nl < 0:
            fail(f"reply: {len(raw) - pos} bytes after event {len(events)} without a header line's newline")
        try:
            header = json.loads(raw[pos:nl])
        except ValueError as e:
            fail(f"reply: event {len(events)}: the header line is not JSON ({e}): {raw[pos:nl][:200]!r}")
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            fail(f"reply: event {len(events)}: the header has no \"type\": {raw[pos:nl][:200]!r}")
        pos = nl + 1
        data = dict(header.get("data") or {})
        n_data = int(header.get("data_length") or 0)
        n_payload = int(header.get("payload_length") or 0)
        if pos + n_data + n_payload > len(raw):
            fail(f"reply: event {len(events)} ({header['type']}) announces {n_data} + {n_payload} bytes, "
                 f"only {len(raw) - pos} follow")
        if n_data:
            try:
                data.update(json.loads(raw[pos:pos + n_data]))
            except ValueError as e:
                fail(f"reply: event {len(events)} ({header['type']}): its data is not JSON ({e})")
        pos += n_data
        events.append((header["type"], data, raw[pos:pos + n_payload]))
        pos += n_payload
    return events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reply")
    ap.add_argument("reference")
    ap.add_argument("frames", type=int)
    ap.add_argument("--trailing", type=int, default=0)
    ap.add_argument("--min-snr-db", type=float, default=60.0)
    ap.add_argument("--capture")
    ap.add_argument("--capture-offset", type=int)
    a = ap.parse_args()

    events = parse(open(a.reply, "rb").read())
    kinds = [k for k, _, _ in events]
    if not events:
        fail("reply: no events (the server sent nothing)")
    for kind, data, _ in events:
        if kind == "error":
            fail(f"reply: the server answered error {data.get('code')!r}: {data.get('text')!r}")
    summary = " ".join(dict.fromkeys(kinds))
    if kinds[0] != "audio-start":
        fail(f"reply: the first event is {kinds[0]!r}, not audio-start (events: {summary})")
    if kinds[-1] != "audio-stop":
        fail(f"reply: the last event is {kinds[-1]!r}, not audio-stop (events: {summary})")
    middle = kinds[1:-1]
    if not middle or any(k != "audio-chunk" for k in middle):
        odd = next((k for k in middle if k != "audio-chunk"), None)
        fail(f"reply: expected audio-chunk events between audio-start and audio-stop, got "
             f"{len(middle)} events{f' including {odd!r}' if odd else ''}")
    start = {k: events[0][1].get(k) for k in FORMAT}
    if start != FORMAT:
        fail(f"reply: audio-start says {start}, expected {FORMAT}")
    pcm = bytearray()
    for i, (_, data, payload) in enumerate(events[1:-1], 1):
        fmt = {k: data.get(k) for k in FORMAT}
        if fmt != FORMAT:
            fail(f"reply: audio-chunk {i} says {fmt}, expected {FORMAT}")
        if not payload or len(payload) % 2:
            fail(f"reply: audio-chunk {i} has a payload of {len(payload)} bytes (not whole S16 samples)")
        pcm += payload
    got = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.int64)
    ref = read_reference(a.reference)
    want = a.frames * SAMPLES_PER_FRAME + a.trailing
    if len(ref) != want:
        fail(f"reference has {len(ref)} samples, expected {a.frames} frames x {SAMPLES_PER_FRAME} + "
             f"{a.trailing} trailing silence = {want}")
    print(f"events={len(events)}")
    print(f"chunks={len(events) - 2}")
    print(f"samples={len(got)}")
    if len(got) != len(ref):
        fail(f"the Wyoming audio has {len(got)} samples, the x86_64 reference {len(ref)} "
             f"({a.frames} frames x {SAMPLES_PER_FRAME} + {a.trailing})")
    err = float(np.sum((got - ref) ** 2))
    snr = math.inf if err == 0 else 10 * math.log10(float(np.sum(ref ** 2)) / err)
    print(f"identical_samples={int(np.sum(got == ref))}")
    print(f"max_abs_diff={int(np.max(np.abs(got - ref)))}")
    print(f"snr_db={'inf' if math.isinf(snr) else f'{snr:.1f}'}")
    if a.capture and a.capture_offset is not None:
        cap = np.frombuffer(open(a.capture, "rb").read(), dtype="<i2").astype(np.int64)
        span = cap[a.capture_offset:a.capture_offset + len(got)]
        same = int(np.sum(span == got[:len(span)]))
        print(f"capture_identical_samples={same}")
    if snr < a.min_snr_db:
        fail(f"SNR {snr:.1f} dB between the guest's Wyoming audio and the x86_64 reference is below "
             f"{a.min_snr_db:g} dB")


if __name__ == "__main__":
    main()

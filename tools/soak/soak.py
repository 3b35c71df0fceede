"""The soak (issue 17): one `herald serve` answers many utterances through all its front-ends
(the FIFO writing WAV files, Wyoming with the PyPI `wyoming` client, HTTP with the PyPI `openai`
client), round robin, and nothing may drift or go missing.

Recorded per request: protocol, text id, latency (request sent → last byte / file in place),
the audio bytes, VmRSS of the herald process after it, and every error. Asserted at the end:

- every request answered exactly once: every FIFO line has its own WAV file (none missing,
  none extra, every one a valid WAV with audio), every network request got audio;
- nothing interleaved: the same text (same seed) gives the same audio bytes every time, over
  every protocol;
- RSS flat: after a warm-up of 50, the mean of the last 100 samples is within 2 % of the mean
  of the first 100;
- no panic in the log, exit code 0 after SIGTERM.

Texts are short sentences in the bundle's languages, with numbers, abbreviations and
punctuation, and every 25th one a multi-paragraph text of several segments. The bundle is a
copy of the tiny bundle whose talker stops after --frames frames (tiny random models never
emit eos), so the soak measures the service, not the length of random speech.

Usage: scripts/soak [--count N] [--bin PATH] [--bundle DIR] [--frames F] [--json FILE]
"""

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.tts import Synthesize

ROOT = Path(__file__).resolve().parents[2]
SEED = 11
WARMUP = 50

SENTENCES = [
    "Good morning.",
    "The kitchen timer has finished.",
    "It is 21.5 degrees in the living room.",
    "Dr. Smith called at 3 p.m. and left a message.",
    "Your parcel will arrive between 10:00 and 12:00 tomorrow!",
    "Is the front door locked?",
    "Die Waschmaschine ist fertig.",
    "Le train de 8 h 15 a dix minutes de retard.",
    "洗衣机已经洗好了。",
    "今日は雨が降るでしょう。",
    "El horno está caliente; ten cuidado.",
    "Battery low: 15 % left, please charge the vacuum cleaner.",
]
LONG = (
    "Here is the evening summary. The front door was opened twice, at 17.05 and at 18.40. "
    "The heating ran for three hours; the average temperature was 20.8 degrees.\n\n"
    "Tomorrow: rain in the morning, sun in the afternoon. Mr. and Mrs. Lee visit at 4 p.m. "
    "Don't forget the recycling! 明天早上有雨。下午会放晴。"
)


def text_of(i: int) -> tuple[str, str]:
    """(text id, text) of request i: the same id always has the same text."""
    if i % 25 == 24:
        return ("long", LONG)
    k = (i * 7) % len(SENTENCES)
    return (f"s{k}", SENTENCES[k])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def capped_bundle(src: Path, dst: Path, frames: int) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "bundle.toml":
            (dst / f.name).symlink_to(f.resolve())
    toml = (src / "bundle.toml").read_text()
    capped, n = re.subn(r"(?m)^max_new_tokens = \d+$", f"max_new_tokens = {frames}", toml)
    if n != 1:
        raise SystemExit(f"error: {src}/bundle.toml has no single [sampling.talker] max_new_tokens")
    (dst / "bundle.toml").write_text(capped)
    return dst


async def wyoming_say(port: int, text: str) -> bytes:
    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Synthesize(text=text).event())
        pcm = b""
        while True:
            e = await asyncio.wait_for(c.read_event(), 120)
            if e is None:
                raise RuntimeError("the connection closed mid-answer")
            if AudioChunk.is_type(e.type):
                pcm += AudioChunk.from_event(e).audio
            elif AudioStop.is_type(e.type):
                return pcm
            elif Error.is_type(e.type):
                err = Error.from_event(e)
                raise RuntimeError(f"wyoming error {err.code}: {err.text}")


def wav_data(path: Path) -> bytes:
    b = path.read_bytes()
    if b[:4] != b"RIFF" or b[8:12] != b"WAVE":
        raise RuntimeError(f"{path.name}: not a WAV file")
    p = 12
    while p + 8 <= len(b):
        cid, n = b[p:p + 4], int.from_bytes(b[p + 4:p + 8], "little")
        if cid == b"data":
            return b[p + 8:p + 8 + n]
        p += 8 + n
    raise RuntimeError(f"{path.name}: no data chunk")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1000, help="utterances (default 1000)")
    ap.add_argument("--bin", default=os.environ.get("HERALD_BIN", str(ROOT / "target/release/herald")))
    ap.add_argument("--bundle", default=str(Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b"))
    ap.add_argument("--frames", type=int, default=12, help="frames per generation at most (default 12, ~1 s of audio)")
    ap.add_argument("--json", help="write the per-request records and the summary here")
    a = ap.parse_args()
    if a.count < WARMUP + 200:
        raise SystemExit(f"error: --count must be at least {WARMUP + 200} (a warm-up of {WARMUP}, then two windows of 100)")
    herald = Path(a.bin)
    if not herald.is_file():
        raise SystemExit(f"error: {herald}: no herald binary (build it, or pass --bin)")

    tmp = Path(tempfile.mkdtemp(prefix="herald-soak-"))
    bundle = capped_bundle(Path(a.bundle), tmp / "bundle", a.frames)
    out_dir = tmp / "wav"
    out_dir.mkdir()
    fifo = tmp / "say"
    cfg = tmp / "herald.toml"
    cfg.write_text(
        '[serve]\nwyoming = "tcp://127.0.0.1:0"\nhttp = "127.0.0.1:0"\n'
        f'[synthesis]\nseed = {SEED}\n'
        f'[runtime]\ngraph_cache_dir = "{tmp / "cache"}"\ncalibration_dir = "{tmp / "cal"}"\n')
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env["RUST_LOG"] = "info"
    proc = subprocess.Popen([str(herald), "serve", "--config", str(cfg), "--fifo", str(fifo), "--out-dir", str(out_dir),
                             "--bundle", str(bundle)], stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
    end = time.monotonic() + 300
    while True:
        text = log.read_text(errors="replace")
        w = re.search(r"wyoming: listening on tcp://127\.0\.0\.1:(\d+)", text)
        h = re.search(r"http: listening on http://127\.0\.0\.1:(\d+)", text)
        if w and h and "ready;" in text:
            break
        if proc.poll() is not None or time.monotonic() > end:
            print(text, file=sys.stderr)
            raise SystemExit("error: herald serve did not become ready")
        time.sleep(0.1)
    wport, hport = int(w.group(1)), int(h.group(1))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{hport}/v1", api_key="unused", max_retries=0, timeout=120)
    fifo_w = open(fifo, "w", encoding="utf-8")

    records, errors = [], []
    audio_of: dict[str, bytes] = {}
    mismatches = []
    lines = 0
    t_start = time.monotonic()
    for i in range(a.count):
        proto = ("fifo", "wyoming", "http")[i % 3]
        tid, text = text_of(i)
        t0 = time.monotonic()
        try:
            if proto == "fifo":
                lines += 1
                # one line per utterance: a paragraph break becomes a space (segments still form)
                fifo_w.write(text.replace("\n", " ") + "\n")
                fifo_w.flush()
                path = out_dir / f"{lines:06}.wav"
                while not path.exists():
                    if proc.poll() is not None:
                        raise RuntimeError("herald exited")
                    if time.monotonic() - t0 > 120:
                        raise RuntimeError(f"{path.name} did not appear within 120 s")
                    time.sleep(0.002)
                pcm = wav_data(path)
                key = f"fifo:{tid}"  # files are shaped (fades) like the device, streams are not
            elif proto == "wyoming":
                pcm = asyncio.run(wyoming_say(wport, text))
                key = f"net:{tid}"
            else:
                r = client.audio.speech.create(model="herald", voice="default", input=text, response_format="pcm")
                pcm = r.content
                key = f"net:{tid}"
            if not pcm:
                raise RuntimeError("no audio")
            if key in audio_of and audio_of[key] != pcm:
                mismatches.append((i, proto, tid))
            audio_of.setdefault(key, pcm)
        except Exception as e:  # noqa: BLE001 - every failure is recorded, then asserted on
            errors.append({"i": i, "proto": proto, "text": tid, "error": f"{type(e).__name__}: {e}"})
            pcm = b""
        latency = time.monotonic() - t0
        records.append({"i": i, "proto": proto, "text": tid, "latency_s": round(latency, 4),
                        "bytes": len(pcm), "rss_kib": rss_kib(proc.pid)})
    wall = time.monotonic() - t_start
    fifo_w.close()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    logtext = log.read_text(errors="replace")

    wavs = sorted(p.name for p in out_dir.iterdir())
    want = [f"{n:06}.wav" for n in range(1, lines + 1)]
    rss = [r["rss_kib"] for r in records]
    first = statistics.mean(rss[WARMUP:WARMUP + 100])
    last = statistics.mean(rss[-100:])
    drift = (last - first) / first
    lat = {p: sorted(r["latency_s"] for r in records if r["proto"] == p) for p in ("fifo", "wyoming", "http")}
    summary = {
        "count": a.count, "frames_cap": a.frames, "binary": str(herald), "wall_s": round(wall, 1),
        "errors": len(errors), "mismatches": len(mismatches), "fifo_lines": lines, "wav_files": len(wavs),
        "rss_first100_mib": round(first / 1024, 2), "rss_last100_mib": round(last / 1024, 2),
        "rss_drift_percent": round(100 * drift, 3), "rss_max_mib": round(max(rss) / 1024, 2),
        "latency_median_s": {p: round(statistics.median(v), 4) for p, v in lat.items()},
        "latency_p95_s": {p: round(v[int(0.95 * (len(v) - 1))], 4) for p, v in lat.items()},
        "exit_code": code, "panics": logtext.count("panicked"),
    }
    print(json.dumps(summary, indent=2))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"summary": summary, "errors": errors, "records": records}, indent=1))

    problems = []
    if errors:
        problems.append(f"{len(errors)} requests failed, the first: {errors[0]}")
    if mismatches:
        problems.append(f"{len(mismatches)} answers differ from the first answer to the same text: {mismatches[:5]}")
    if wavs != want:
        missing = sorted(set(want) - set(wavs))[:5]
        extra = sorted(set(wavs) - set(want))[:5]
        problems.append(f"FIFO: {len(wavs)} WAV files for {lines} lines (missing {missing}, extra {extra})")
    if abs(last - first) > 0.02 * first:
        problems.append(f"RSS drifted: {first / 1024:.1f} MiB → {last / 1024:.1f} MiB ({100 * drift:+.2f} %)")
    if code != 0:
        problems.append(f"herald serve exited {code} after SIGTERM")
    if summary["panics"]:
        problems.append("the log shows a panic")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(f"(log and files kept in {tmp})", file=sys.stderr)
        return 1
    subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

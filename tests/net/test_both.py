"""Both network front-ends on one engine (issue 16): clients of the two protocols at once share
one bounded queue, and 200 requests leave the resident memory flat.

- eight clients at once, four over Wyoming (the PyPI `wyoming` client) and four over HTTP (the
  PyPI `openai` client), against a queue of two: each either gets exactly the audio of
  `herald speak --raw` for its text (so nothing is lost, cut or interleaved) or is told busy;
- 200 requests alternating between the protocols: VmRSS of the herald process after each; after
  a warm-up of 50, the last 50 stay within 2 % (and 8 MiB) of the 50 before them.

Environment: HERALD_BIN (default target/debug/herald), HERALD_TEST_BUNDLES (default
build/bundles; the tiny-0.6b bundle is used).
"""

import asyncio
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.tts import Synthesize, SynthesizeVoice

ROOT = Path(__file__).resolve().parents[2]
HERALD = Path(os.environ.get("HERALD_BIN", ROOT / "target/debug/herald"))
BUNDLE = Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b"
SEED = 7


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("both")
    cfg = tmp / "herald.toml"
    cfg.write_text(
        '[serve]\nwyoming = "tcp://127.0.0.1:0"\nhttp = "127.0.0.1:0"\nqueue_length = 2\n'
        f'[synthesis]\nseed = {SEED}\n[audio]\ndevice = "null"\n'
        f'[runtime]\ngraph_cache_dir = "{tmp / "cache"}"\ncalibration_dir = "{tmp / "cal"}"\n')
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env["RUST_LOG"] = "info"
    proc = subprocess.Popen([str(HERALD), "serve", "--config", str(cfg), "--fifo", str(tmp / "say"),
                             "--bundle", str(BUNDLE)], stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
    end = time.monotonic() + 120
    while True:
        text = log.read_text(errors="replace")
        w = re.search(r"wyoming: listening on tcp://127\.0\.0\.1:(\d+)", text)
        h = re.search(r"http: listening on http://127\.0\.0\.1:(\d+)", text)
        if w and h and "ready;" in text:
            break
        assert proc.poll() is None and time.monotonic() < end, text
        time.sleep(0.1)
    yield {"proc": proc, "wyoming": int(w.group(1)), "http": int(h.group(1)), "log": log, "cfg": cfg}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()
    assert "panicked" not in log.read_text()


def speak_raw(text: str, speaker: str | None = None) -> bytes:
    cfg = ROOT / "build" / "net-both-speak.toml"
    cfg.write_text(f"[synthesis]\nseed = {SEED}\n")
    args = [str(HERALD), "speak", "--config", str(cfg), "--bundle", str(BUNDLE), "--raw", text]
    if speaker:
        args += ["--speaker", speaker]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    out = subprocess.run(args, capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout


async def wyoming_say(port: int, text: str, voice: str | None = None):
    """("done", pcm) or ("busy", None) or ("error", code)."""
    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice) if voice else None).event())
        pcm = b""
        while True:
            e = await asyncio.wait_for(c.read_event(), 120)
            assert e is not None, "closed mid-answer"
            if AudioChunk.is_type(e.type):
                pcm += AudioChunk.from_event(e).audio
            elif AudioStop.is_type(e.type):
                return ("done", pcm)
            elif Error.is_type(e.type):
                code = Error.from_event(e).code
                return ("busy", None) if code == "busy" else ("error", code)


def http_say(port: int, text: str, voice: str = "default"):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        r = client.audio.speech.create(model="herald", voice=voice, input=text, response_format="pcm")
        return ("done", r.content)
    except openai.APIStatusError as e:
        if e.status_code == 503 and "busy" in str(e.body):
            return ("busy", None)
        return ("error", f"{e.status_code} {e.body}")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_eight_clients_over_both_protocols_share_one_queue(server):
    texts = {("wyoming", i): f"Wyoming client number {i} says hello." for i in range(4)}
    texts.update({("http", i): f"HTTP client number {i} says hello." for i in range(4)})
    results = {}

    def run(key):
        proto, _ = key
        if proto == "wyoming":
            results[key] = asyncio.run(wyoming_say(server["wyoming"], texts[key], "ryan"))
        else:
            results[key] = http_say(server["http"], texts[key], "ryan")

    threads = [threading.Thread(target=run, args=(k,)) for k in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 8
    done = {k: v[1] for k, v in results.items() if v[0] == "done"}
    busy = [k for k, v in results.items() if v[0] == "busy"]
    assert len(done) + len(busy) == 8, results
    assert done, "nobody was served"
    for key, pcm in done.items():
        assert pcm == speak_raw(texts[key], "ryan"), f"{key}: not its own audio"


def test_two_hundred_requests_leave_the_memory_flat(server):
    pid = server["proc"].pid
    rss = []
    for i in range(200):
        text = "Hi."
        kind, pcm = asyncio.run(wyoming_say(server["wyoming"], text)) if i % 2 else http_say(server["http"], text)
        assert kind == "done" and pcm, (i, kind, pcm)
        rss.append(rss_kib(pid))
    before = statistics.median(rss[100:150])
    after = statistics.median(rss[150:200])
    grown = after - before
    print(f"RSS after warm-up {rss[50]} KiB, median of requests 100-149 {before} KiB, 150-199 {after} KiB")
    assert grown <= max(0.02 * before, 8 * 1024), f"RSS grew by {grown} KiB over 50 requests: {rss[::10]}"

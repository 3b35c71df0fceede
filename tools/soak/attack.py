"""The attack soak (issue 40): one `herald serve` (Wyoming and HTTP on loopback, the default
`serve.max_connections` = 16 unless --max says otherwise) under the arrival patterns of a
hostile LAN, with its descriptors (/proc/PID/fd) and threads (/proc/PID/task) sampled throughout:

1. burst: --burst connections (default 1000) opened in a tight loop and held idle, on Wyoming,
   then on HTTP: the time it took, peak and settled descriptors and threads, how many of the held
   sockets the server kept open, and whether a real client is served while they are held;
2. slowloris: --attackers clients per front-end (default 3 x max) that send a request head one
   byte every --pause seconds (default 2) and reconnect when cut, for --seconds / 2 (default
   20) from another loopback address (127.0.0.2), then as long from the legitimate client's own
   (127.0.0.1), while that client polls `/healthz` and Wyoming `describe` every 0.5 s and makes
   a speech request and a Wyoming `synthesize` every 3 s: how many were served (from another
   address at the first try; from the same address within two retries, as the `openai` client
   retries), their latency, the peak counts, RSS.

Fails (exit 1) when the counts pass the documented bound (docs/reliability.md) or a legitimate
request was not served. Loopback only; bounded in time (about a minute with the defaults).

Usage: scripts/soak --attack [--max N] [--burst N] [--attackers N] [--pause S] [--seconds S]
       [--bundle DIR] [--bin PATH] [--json FILE]
"""

import argparse
import asyncio
import http.client
import json
import os
import re
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from wyoming.audio import AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize

ROOT = Path(__file__).resolve().parents[2]
FDS_PER = {"wyoming": 3, "http": 2}  # descriptors per open connection (docs/reliability.md)


def counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def healthz(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/healthz")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


def speech(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/audio/speech", headers={"Content-Type": "application/json"},
                  body=json.dumps({"model": "tts-1", "input": "Hello there.", "voice": "default", "response_format": "pcm"}))
        r = c.getresponse()
        ok = r.status == 200 and len(r.read()) > 0
        c.close()
        return ok
    except OSError:
        return False


def describe(port: int) -> bool:
    async def go():
        async with AsyncTcpClient("127.0.0.1", port) as c:
            await c.write_event(Describe().event())
            e = await asyncio.wait_for(c.read_event(), 10)
            return e is not None and Info.is_type(e.type)
    try:
        return asyncio.run(go())
    except (OSError, asyncio.TimeoutError, ConnectionError):
        return False


def synthesize(port: int) -> bool:
    async def go():
        async with AsyncTcpClient("127.0.0.1", port) as c:
            await c.write_event(Synthesize(text="Hello there.").event())
            while True:
                e = await asyncio.wait_for(c.read_event(), 120)
                if e is None or e.type == "error":
                    return False
                if AudioStop.is_type(e.type):
                    return True
    try:
        return asyncio.run(go())
    except (OSError, asyncio.TimeoutError, ConnectionError):
        return False


def burst(pid: int, port: int, proto: str, n: int, base: tuple[int, int], limit: int) -> dict:
    socks, peak = [], base
    t0 = time.monotonic()
    for i in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
        if i % 25 == 0:
            peak = tuple(map(max, peak, counts(pid)))
    took = time.monotonic() - t0
    end = time.monotonic() + 5
    while time.monotonic() < end:
        peak = tuple(map(max, peak, counts(pid)))
        p = select.poll()
        for s in socks:
            p.register(s, select.POLLIN)
        open_ = len(socks) - len(p.poll(0))
        if open_ <= limit:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    settled = counts(pid)
    t1 = time.monotonic()
    served = False
    while not served and time.monotonic() - t1 < 5:
        served = healthz(port) if proto == "http" else describe(port)
    served_after = time.monotonic() - t1
    for s in socks:
        s.close()
    return {"connections": len(socks), "seconds": round(took, 2), "peak_fds": peak[0], "peak_threads": peak[1],
            "settled_fds": settled[0], "settled_threads": settled[1], "held_open_by_server": open_,
            "real_client_served": served, "served_after_s": round(served_after, 2)}


class Slowloris:
    def __init__(self, port: int, head: bytes, n: int, pause: float, source: str):
        self.port, self.head, self.pause, self.source = port, head, pause, source
        self.stop = threading.Event()
        self.connects = 0
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def run(self):
        while not self.stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(self.source, 0))
            except OSError:
                time.sleep(0.05)
                continue
            self.connects += 1
            try:
                for b in self.head:
                    s.sendall(bytes([b]))
                    p = select.poll()
                    p.register(s, select.POLLIN)
                    if p.poll(self.pause * 1000) or self.stop.is_set():
                        break
            except OSError:
                pass
            finally:
                s.close()

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


def attempt(f, port: int, retries: int) -> tuple[bool, bool, float]:
    """(served, at the first try, seconds) of `f(port)` tried up to `retries` more times."""
    t = time.monotonic()
    if f(port):
        return True, True, time.monotonic() - t
    for _ in range(retries):
        time.sleep(0.1)
        if f(port):
            return True, False, time.monotonic() - t
    return False, False, time.monotonic() - t


def slowloris(pid: int, ports: dict, attackers: int, pause: float, seconds: float, source: str, retries: int) -> dict:
    attacks = [Slowloris(ports["http"], b"POST /v1/audio/speech HTTP/1.1\r\nHost: herald\r\nContent-Type: application/json\r\n",
                         attackers, pause, source),
               Slowloris(ports["wyoming"], b'{"type": "synthesize", "data": {"text": "never finished"}}', attackers, pause, source)]
    time.sleep(min(3.0, seconds / 4))
    results = {k: [] for k in ("healthz", "describe", "speech", "synthesize")}
    peak, rss = counts(pid), 0.0
    end = time.monotonic() + seconds

    def poll(jobs, every):
        # a legitimate client: each request of `jobs` every `every` seconds until the end
        while time.monotonic() < end:
            t = time.monotonic()
            for name, f, port in jobs:
                results[name].append(attempt(f, port, retries))
            time.sleep(max(0.0, every - (time.monotonic() - t)))

    clients = [threading.Thread(target=poll, args=(((("healthz", healthz, ports["http"]), ("describe", describe, ports["wyoming"]))), 0.5)),
               threading.Thread(target=poll, args=(((("speech", speech, ports["http"]), ("synthesize", synthesize, ports["wyoming"]))), 3.0))]
    for c in clients:
        c.start()
    while time.monotonic() < end:
        peak = tuple(map(max, peak, counts(pid)))
        rss = max(rss, rss_mb(pid))
        time.sleep(0.1)
    for c in clients:
        c.join()
    for a in attacks:
        a.end()
    out = {"attackers_from": source, "retries": retries, "attackers_per_front_end": attackers, "byte_every_s": pause,
           "seconds": seconds,
           "attack_connections": {"http": attacks[0].connects, "wyoming": attacks[1].connects},
           "peak_fds": peak[0], "peak_threads": peak[1], "peak_rss_mb": round(rss, 1)}
    for name, r in results.items():
        lat = sorted(x[2] for x in r if x[0])
        out[name] = {"served": sum(x[0] for x in r), "first_try": sum(x[1] for x in r), "requests": len(r),
                     "median_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
                     "max_ms": round(max(lat) * 1e3, 1) if lat else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attack", action="store_true", help="(the mode scripts/soak passes on)")
    ap.add_argument("--bin", default=os.environ.get("HERALD_BIN", ROOT / "target/release/herald"))
    ap.add_argument("--bundle", default=Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b")
    ap.add_argument("--max", type=int, default=16)
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--attackers", type=int, default=0, help="per front-end; 0: 3 x --max")
    ap.add_argument("--pause", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    attackers = args.attackers or 3 * args.max
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.burst)), hard))
    tmp = Path(tempfile.mkdtemp(prefix="herald-attack-"))
    cfg = tmp / "herald.toml"
    cfg.write_text(
        f'[serve]\nwyoming = "tcp://127.0.0.1:0"\nhttp = "127.0.0.1:0"\nmax_connections = {args.max}\n'
        '[synthesis]\nseed = 7\n[audio]\ndevice = "null"\n'
        f'[runtime]\ngraph_cache_dir = "{tmp / "cache"}"\ncalibration_dir = "{tmp / "cal"}"\n')
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env["RUST_LOG"] = "info"
    proc = subprocess.Popen([str(args.bin), "serve", "--config", str(cfg), "--fifo", str(tmp / "say"),
                             "--bundle", str(args.bundle)], stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
    end = time.monotonic() + 120
    while True:
        text = log.read_text(errors="replace")
        w = re.search(r"wyoming: listening on tcp://127\.0\.0\.1:(\d+)", text)
        h = re.search(r"http: listening on http://127\.0\.0\.1:(\d+)", text)
        if w and h and "ready;" in text:
            break
        if proc.poll() is not None or time.monotonic() > end:
            print(text, file=sys.stderr)
            return 1
        time.sleep(0.1)
    ports = {"wyoming": int(w.group(1)), "http": int(h.group(1))}
    pid = proc.pid
    healthz(ports["http"])
    describe(ports["wyoming"])
    base = counts(pid)
    slack = min(args.max, 8)
    report = {"cpu": cpu_model(), "bin": str(args.bin), "max_connections": args.max, "slack": slack,
              "baseline_fds": base[0], "baseline_threads": base[1], "rss_mb_at_start": round(rss_mb(pid), 1)}
    problems = []
    for proto in ("wyoming", "http"):
        r = burst(pid, ports[proto], proto, args.burst, base, args.max)
        report[f"burst_{proto}"] = r
        fds = base[0] + FDS_PER[proto] * (args.max + slack + 1) + 2 + max(FDS_PER.values())
        threads = base[1] + (args.max + slack + 4 if proto == "wyoming" else 0)
        if r["peak_fds"] > fds or r["peak_threads"] > threads:
            problems.append(f"{proto} burst: peak {r['peak_fds']} fds / {r['peak_threads']} threads over {fds} / {threads}")
        if r["held_open_by_server"] > args.max:
            problems.append(f"{proto} burst: {r['held_open_by_server']} connections kept open")
        if not r["real_client_served"]:
            problems.append(f"{proto} burst: a real client was not served")
        time.sleep(1)
    # the attackers on another address (a LAN attacker): every request served at the first try;
    # on the legitimate client's own address (which cannot be told apart): within two retries
    for source, retries in (("127.0.0.2", 0), ("127.0.0.1", 2)):
        r = slowloris(pid, ports, attackers, args.pause, args.seconds / 2, source, retries)
        report[f"slowloris_from_{source}"] = r
        for name in ("healthz", "describe", "speech", "synthesize"):
            if r[name]["served"] != r[name]["requests"]:
                problems.append(f"slowloris from {source}: {name} served {r[name]['served']} of {r[name]['requests']}")
        fds = base[0] + sum(FDS_PER.values()) * (args.max + slack + 1) + 4
        if r["peak_fds"] > fds:
            problems.append(f"slowloris from {source}: peak {r['peak_fds']} fds over {fds}")
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    report["exit_code"] = code
    report["log_lines"] = text.count("\n")
    if code != 0:
        problems.append(f"exit code {code}")
    if "panicked" in text:
        problems.append("the log shows a panic")
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    if problems:
        print(f"(log kept in {tmp})", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""`herald serve` under socket activation (issue 16): systemd's own `systemd-socket-activate`
(from the systemd package, as herald.socket would) listens on both ports, starts herald at the
first connection with the sockets in $LISTEN_FDS, and herald takes them by port instead of
binding: the client that caused the start waits in the backlog while the model loads and is
then served.

Environment: HERALD_BIN (default target/debug/herald), HERALD_TEST_BUNDLES (default
build/bundles; the tiny-0.6b bundle is used).
"""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

ROOT = Path(__file__).resolve().parents[2]
HERALD = Path(os.environ.get("HERALD_BIN", ROOT / "target/debug/herald"))
BUNDLE = Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b"
ACTIVATE = shutil.which("systemd-socket-activate") or "/usr/bin/systemd-socket-activate"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sockets_come_from_systemd_and_the_first_client_is_served(tmp_path):
    assert Path(ACTIVATE).exists(), "systemd-socket-activate is missing (scripts/prereqs installs systemd)"
    wy, ht = free_port(), free_port()
    cfg = tmp_path / "herald.toml"
    cfg.write_text(
        f'[serve]\nwyoming = "tcp://127.0.0.1:{wy}"\nhttp = "127.0.0.1:{ht}"\n[audio]\ndevice = "null"\n'
        f'[runtime]\ngraph_cache_dir = "{tmp_path / "cache"}"\ncalibration_dir = "{tmp_path / "cal"}"\n')
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env["RUST_LOG"] = "info"
    proc = subprocess.Popen(
        [ACTIVATE, "-l", f"127.0.0.1:{wy}", "-l", f"127.0.0.1:{ht}",
         str(HERALD), "serve", "--config", str(cfg), "--fifo", str(tmp_path / "say"), "--bundle", str(BUNDLE)],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
    try:
        end = time.monotonic() + 30
        while "Listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)

        async def describe():
            # this connection starts herald; it is answered once the model is loaded
            async with AsyncTcpClient("127.0.0.1", wy) as c:
                await c.write_event(Describe().event())
                return Info.from_event(await asyncio.wait_for(c.read_event(), 120))

        t0 = time.monotonic()
        info = asyncio.run(describe())
        assert info.tts and info.tts[0].name == "herald"
        with urllib.request.urlopen(f"http://127.0.0.1:{ht}/healthz", timeout=30) as r:
            assert r.status == 200
        text = log.read_text(errors="replace")
        assert f"serve.wyoming: using the socket systemd passed for 127.0.0.1:{wy}" in text, text
        assert f"serve.http: using the socket systemd passed for 127.0.0.1:{ht}" in text, text
        print(f"first Wyoming answer {time.monotonic() - t0:.2f} s after the connection that started herald")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, log.read_text()

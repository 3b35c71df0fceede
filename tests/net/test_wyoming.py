"""herald's Wyoming TTS server against the PyPI `wyoming` package's own client (issue 16).

Runs `herald serve` on the tiny bundle with the Wyoming server on a kernel-chosen loopback port
and checks, with `wyoming.client.AsyncTcpClient` and raw sockets for the misbehaving clients:
describe/info (the speakers, then the voice aliases), synthesize (the PCM equals `herald speak
--raw` of the same text, voice and seed, sample for sample; an alias's equals its speaker's), the streaming events (one audio-start/stop per sentence, each sentence's
PCM equal to speaking it alone), errors that keep the connection, framing faults that close it,
slow and vanishing clients, eight clients at once against a queue of two, and SIGTERM mid-stream.

Environment: HERALD_BIN (default target/debug/herald), HERALD_TEST_BUNDLES (default
build/bundles; the tiny-0.6b bundle is used).
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

ROOT = Path(__file__).resolve().parents[2]
HERALD = Path(os.environ.get("HERALD_BIN", ROOT / "target/debug/herald"))
BUNDLE = Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b"
SEED = 7
REQUEST_TIMEOUT_S = 2


def config(tmp: Path, **serve) -> Path:
    """A config file: Wyoming on a kernel-chosen port, HTTP off, a fixed seed, the null device."""
    keys = {"wyoming": "tcp://127.0.0.1:0", "http": "off", "queue_length": 2,
            "request_timeout_s": REQUEST_TIMEOUT_S, "idle_timeout_s": 30}
    keys.update(serve)
    lines = ["[serve]"] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    lines += ["[synthesis]", f"seed = {SEED}", "[voices.aliases]", 'Kitchen = "vivian"', "[audio]", 'device = "null"',
              "[runtime]", f'graph_cache_dir = "{tmp / "cache"}"', f'calibration_dir = "{tmp / "cal"}"']
    p = tmp / "herald.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


class Server:
    """`herald serve` in the background; its port from its log."""

    def __init__(self, tmp: Path, **serve):
        self.tmp = tmp
        self.cfg = config(tmp, **serve)
        self.log = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
        env["RUST_LOG"] = "info"
        self.proc = subprocess.Popen(
            [str(HERALD), "serve", "--config", str(self.cfg), "--fifo", str(tmp / "say"), "--bundle", str(BUNDLE)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), env=env)
        self.port = None
        end = time.monotonic() + 120
        while time.monotonic() < end:
            text = self.log.read_text(errors="replace")
            m = re.search(r"wyoming: listening on tcp://127\.0\.0\.1:(\d+)", text)
            if m and "ready;" in text:
                self.port = int(m.group(1))
                return
            assert self.proc.poll() is None, f"herald serve exited early:\n{text}"
            time.sleep(0.1)
        raise AssertionError(f"herald serve did not get ready:\n{self.log.read_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("wyoming"))
    yield s
    assert s.stop() == 0, s.log_text()


def speak_raw(text: str, speaker: str | None = None) -> bytes:
    """What `herald speak --raw` says for `text` with the server's configuration."""
    cfg = next(ROOT.glob("build")) / "net-speak.toml"
    cfg.write_text(f"[synthesis]\nseed = {SEED}\n")
    args = [str(HERALD), "speak", "--config", str(cfg), "--bundle", str(BUNDLE), "--raw"]
    if speaker:
        args += ["--speaker", speaker]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    out = subprocess.run(args + [text], capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout


async def collect(client: AsyncTcpClient, until=AudioStop.is_type):
    """Events up to and including the first for which `until(type)` holds; (events, pcm)."""
    events, pcm = [], b""
    while True:
        e = await asyncio.wait_for(client.read_event(), 120)
        assert e is not None, "the server closed the connection"
        events.append(e)
        if AudioChunk.is_type(e.type):
            c = AudioChunk.from_event(e)
            assert (c.rate, c.width, c.channels) == (24000, 2, 1)
            assert len(c.audio) <= 2048
            pcm += c.audio
        if until(e.type) or Error.is_type(e.type):
            return events, pcm


async def synthesize(port: int, text: str, voice: SynthesizeVoice | None = None):
    async with AsyncTcpClient("127.0.0.1", port) as c:
        await c.write_event(Synthesize(text=text, voice=voice).event())
        return await collect(c)


def test_describe_lists_the_bundles_speakers_the_aliases_and_streaming(server):
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.port) as c:
            await c.write_event(Describe().event())
            return Info.from_event(await c.read_event())

    info = asyncio.run(go())
    assert len(info.tts) == 1
    tts = info.tts[0]
    assert tts.name == "herald" and tts.installed and tts.supports_synthesize_streaming
    bundle = (BUNDLE / "bundle.toml").read_text()
    speakers = re.search(r"\[speakers\]\n((?:\w+ = \d+\n)+)", bundle).group(1)
    names = sorted(line.split(" = ")[0] for line in speakers.strip().splitlines())
    # the speakers, then the aliases: the configuration's and the built-in ones whose speakers
    # the tiny bundle has (not alloy's sohee, fable's aiden, onyx's uncle_fu)
    assert [v.name for v in tts.voices] == names + ["echo", "Kitchen", "nova", "shimmer"]
    voices = {v.name: v.languages for v in tts.voices}
    assert voices["dylan"] == ["zh"], "a dialect speaker speaks its dialect (Chinese)"
    assert "en" in voices["ryan"] and "zh" in voices["ryan"]
    described = {v.name: v.description for v in tts.voices}
    assert described["Kitchen"].startswith("Kitchen: another name for vivian ("), described["Kitchen"]
    assert described["echo"].startswith("echo: another name for ryan ("), described["echo"]
    assert voices["Kitchen"] == voices["vivian"]


def test_synthesize_equals_speak_raw_sample_for_sample(server):
    text = "Hello from the network. How are you?"
    events, pcm = asyncio.run(synthesize(server.port, text, SynthesizeVoice(name="ryan")))
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (24000, 2, 1)
    assert AudioStop.is_type(events[-1].type)
    assert [e.type for e in events[1:-1]] == ["audio-chunk"] * (len(events) - 2)
    reference = speak_raw(text, "ryan")
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    assert pcm == reference, f"{len(pcm)} bytes over Wyoming, {len(reference)} from herald speak --raw"
    # language as a BCP 47 tag and the speaker under voice.speaker give the same request
    _, pcm2 = asyncio.run(synthesize(server.port, text, SynthesizeVoice(speaker="ryan", language="en-US")))
    assert len(pcm2) > 0


def test_an_alias_speaks_exactly_as_its_speaker(server):
    text = "Good evening from the kitchen."
    _, vivian = asyncio.run(synthesize(server.port, text, SynthesizeVoice(name="vivian")))
    _, kitchen = asyncio.run(synthesize(server.port, text, SynthesizeVoice(name="kitchen")))
    _, nova = asyncio.run(synthesize(server.port, text, SynthesizeVoice(name="NOVA")))
    assert len(vivian) > 0
    assert kitchen == vivian, "the configuration's alias (any case) is vivian"
    assert nova == vivian, "the built-in nova is vivian"
    assert kitchen == speak_raw(text, "vivian"), "and equals herald speak --raw with vivian"


def test_streaming_speaks_each_sentence_as_it_completes(server):
    sentences = ["First sentence here.", "And a second one!", "The last has no stop"]
    chunks = ["First sen", "tence here. And a se", "cond one! The last ", "has no stop"]

    async def go():
        async with AsyncTcpClient("127.0.0.1", server.port) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="serena")).event())
            for ch in chunks:
                await c.write_event(SynthesizeChunk(text=ch).event())
            # the compatibility event inside a stream is ignored
            await c.write_event(Synthesize(text="".join(chunks), voice=SynthesizeVoice(name="serena")).event())
            await c.write_event(SynthesizeStop().event())
            return await collect(c, until=SynthesizeStopped.is_type)

    events, _ = asyncio.run(go())
    kinds = [e.type for e in events]
    assert kinds[-1] == "synthesize-stopped"
    assert kinds.count("audio-start") == 3 and kinds.count("audio-stop") == 3, kinds
    # each sentence's audio equals speaking that sentence alone
    pcms, cur = [], None
    for e in events:
        if AudioStart.is_type(e.type):
            cur = b""
        elif AudioChunk.is_type(e.type):
            cur += AudioChunk.from_event(e).audio
        elif AudioStop.is_type(e.type):
            pcms.append(cur)
    for s, pcm in zip(sentences, pcms):
        assert pcm == speak_raw(s, "serena"), s


def test_bad_requests_get_an_error_and_the_connection_stays_usable(server):
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.port) as c:
            out = []
            for ev in [Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event(),
                       Synthesize(text="   ").event(),
                       Synthesize(text="x" * 5000).event(),
                       Synthesize(text="Hi.", voice=SynthesizeVoice(language="klingon")).event(),
                       SynthesizeChunk(text="outside a stream").event(),
                       Event(type="synthesize", data={"text": "Hi.", "voice": 5}),
                       Event(type="synthesize", data={"text": "Hi.", "voice": {"name": 7}}),
                       Synthesize(text="?!...,;:").event()]:
                await c.write_event(ev)
                out.append(await asyncio.wait_for(c.read_event(), 30))
            await c.write_event(Describe().event())
            out.append(await asyncio.wait_for(c.read_event(), 30))
            return out

    out = asyncio.run(go())
    assert [e.type for e in out[:8]] == ["error"] * 8, [(e.type, e.data) for e in out]
    errors = [Error.from_event(e) for e in out[:8]]
    assert [e.code for e in errors] == ["unknown-voice", "bad-request", "too-long", "bad-request", "bad-request",
                                        "bad-request", "bad-request", "bad-request"]
    assert "nothing to say" in errors[7].text, errors[7].text  # punctuation alone: no letter or digit
    assert "voice" in errors[5].text and "voice.name" in errors[6].text
    assert "nobody" in errors[0].text and "ryan" in errors[0].text, errors[0].text
    assert "aliases: echo (ryan), Kitchen (vivian)" in errors[0].text, errors[0].text
    assert "4096" in errors[2].text and "serve.max_text_chars" in errors[2].text
    assert "klingon" in errors[3].text
    assert Info.is_type(out[8].type), "the connection still answers"


def test_a_lone_surrogate_is_a_bad_request_and_the_connection_stays_usable(server):
    mark = len(server.log_text())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        # json.dumps writes a lone surrogate as the escape "\ud800", valid JSON but not text
        s.sendall(json.dumps({"type": "synthesize", "data": {"text": "Hi \ud800 there."}}).encode() + b"\n")
        f = s.makefile("rb")
        header = json.loads(f.readline())
        data = json.loads(f.read(header["data_length"]))
        assert (header["type"], data["code"]) == ("error", "bad-request"), (header, data)
        assert "surrogate" in data["text"], data
        s.sendall(b'{"type": "describe"}\n')
        header = json.loads(f.readline())
        assert header["type"] == "info", "the connection still answers"
        port = s.getsockname()[1]
    # one line per request with its outcome, the client named; nothing above INFO
    end = time.monotonic() + 5
    while f"127.0.0.1:{port}: describe: info sent" not in server.log_text()[mark:]:
        assert time.monotonic() < end, server.log_text()[mark:]
        time.sleep(0.05)
    log = server.log_text()[mark:]
    assert re.search(rf"INFO.*wyoming: 127\.0\.0\.1:{port}: error bad-request: synthesize: .*surrogate", log), log
    assert "WARN" not in log and "ERROR" not in log, log


def test_default_level_logs_one_line_per_request_and_a_hang_up_is_info(server):
    mark = len(server.log_text())
    events, _ = asyncio.run(synthesize(server.port, "Logged."))
    assert AudioStop.is_type(events[-1].type)
    end = time.monotonic() + 5
    while not re.search(r"wyoming: 127\.0\.0\.1:\d+: spoke 7 characters: \d+ frames", server.log_text()[mark:]):
        assert time.monotonic() < end, server.log_text()[mark:]
        time.sleep(0.05)
    # frame-pool statistics are debug-level now
    assert "frame pools" not in server.log_text()[mark:]
    # a client that hangs up mid-answer: INFO, never WARN
    mark = len(server.log_text())
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.sendall(json.dumps({"type": "synthesize", "data": {"text": "A sentence long enough to hang up in."}}).encode() + b"\n")
        s.settimeout(60)
        assert s.recv(100)
    end = time.monotonic() + 30
    while "connection closed" not in server.log_text()[mark:] and "went away" not in server.log_text()[mark:]:
        assert time.monotonic() < end, server.log_text()[mark:]
        time.sleep(0.05)
    time.sleep(0.5)
    log = server.log_text()[mark:]
    assert "WARN" not in log and "ERROR" not in log, log


def raw_exchange(port: int, data: bytes, wait: float = 10.0) -> tuple[bytes, bool]:
    """Send `data`, read until the server closes or `wait` passes; (reply, closed by server)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(wait)
        got = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    return got, True
                got += b
        except socket.timeout:
            return got, False
        except ConnectionResetError:
            return got, True


def first_error(reply: bytes) -> dict:
    line = reply.split(b"\n", 1)[0]
    header = json.loads(line)
    assert header["type"] == "error", reply[:200]
    data = json.loads(reply.split(b"\n", 1)[1][: header["data_length"]])
    return data


@pytest.mark.parametrize("name,data,code", [
    ("malformed JSON", b"{this is not json}\n", "malformed"),
    ("garbage bytes", bytes(range(256)) * 4 + b"\n", "malformed"),
    ("no type", b'{"data": {"text": "hi"}}\n', "malformed"),
    ("data length over the limit", b'{"type": "synthesize", "data_length": 99999999}\n', "too-large"),
])
def test_framing_faults_close_the_connection_with_an_error(server, name, data, code):
    reply, closed = raw_exchange(server.port, data)
    assert closed, name
    assert first_error(reply)["code"] == code, name


def test_a_ten_megabyte_header_line_is_refused(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(30)
        sent = 0
        try:
            while sent < 10 << 20:
                s.sendall(b"x" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert sent < 10 << 20 or got, "the server read 10 MB without a word"
    if got:
        assert first_error(got)["code"] == "too-large"


def test_a_payload_length_that_lies_and_a_slow_client_time_out_without_blocking_others(server):
    t0 = time.monotonic()
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b'{"type": "synthesize", "payload_length": 100}\nabc')
    loris = socket.create_connection(("127.0.0.1", server.port))
    loris.sendall(b'{"type": "descr')
    # meanwhile another client is served
    events, pcm = asyncio.run(synthesize(server.port, "Still here.", SynthesizeVoice(name="ryan")))
    assert AudioStop.is_type(events[-1].type) and pcm
    for s in (slow, loris):
        s.settimeout(REQUEST_TIMEOUT_S + 10)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        assert first_error(got)["code"] == "timeout"
        s.close()
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 15


def test_a_client_that_vanishes_mid_stream_cancels_its_job(server):
    text = " ".join(["This is a long sentence that keeps the speaker busy for a while."] * 6)
    before = server.log_text().count("the client went away; cancelling its job")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
        s.settimeout(60)
        first = s.recv(100)
        assert first.startswith(b'{"type":"audio-start"') or b"audio" in first, first
    # the next request works and is spoken in full
    events, pcm = asyncio.run(synthesize(server.port, "After the vanished client.", SynthesizeVoice(name="ryan")))
    assert AudioStop.is_type(events[-1].type)
    assert pcm == speak_raw("After the vanished client.", "ryan")
    end = time.monotonic() + 10
    while server.log_text().count("the client went away; cancelling its job") == before and time.monotonic() < end:
        time.sleep(0.1)
    log = server.log_text()
    assert log.count("the client went away; cancelling its job") > before or "wyoming client" in log, log[-2000:]


def test_eight_clients_at_once_complete_or_are_refused_busy_and_nothing_interleaves(server):
    text = "Eight at once."
    reference = speak_raw(text, "vivian")

    async def one():
        try:
            events, pcm = await synthesize(server.port, text, SynthesizeVoice(name="vivian"))
        except Exception as e:  # noqa: BLE001 - reported below
            return ("failed", repr(e))
        if Error.is_type(events[-1].type):
            return ("error", Error.from_event(events[-1]).code)
        return ("done", pcm)

    async def all_at_once():
        return await asyncio.gather(*[one() for _ in range(8)])

    results = asyncio.run(all_at_once())
    done = [r for r in results if r[0] == "done"]
    busy = [r for r in results if r == ("error", "busy")]
    assert len(done) + len(busy) == 8, results
    assert len(done) >= 1
    for _, pcm in done:
        assert pcm == reference, "a client got someone else's or interleaved audio"


def test_sigterm_mid_stream_ends_the_stream_and_exits_0(tmp_path):
    s = Server(tmp_path)
    text = " ".join(["A long announcement that is cut by the service manager."] * 8)

    async def go():
        async with AsyncTcpClient("127.0.0.1", s.port) as c:
            await c.write_event(Synthesize(text=text).event())
            first = await asyncio.wait_for(c.read_event(), 60)
            assert AudioStart.is_type(first.type)
            s.proc.send_signal(signal.SIGTERM)
            return await collect(c)

    events, pcm = asyncio.run(go())
    assert AudioStop.is_type(events[-1].type), [e.type for e in events[-3:]]
    assert len(pcm) % 2 == 0
    assert len(pcm) < len(speak_raw(text)), "the stream was cut short"
    assert s.proc.wait(timeout=30) == 0, s.log_text()
    assert "stopping on SIGTERM;" in s.log_text()


def test_a_stream_over_the_limit_ends_with_synthesize_stopped_and_no_audio(server):
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.port) as c:
            await c.write_event(SynthesizeStart().event())
            for _ in range(90):
                await c.write_event(SynthesizeChunk(text="word " * 10).event())
            await c.write_event(SynthesizeChunk(text="A sentence after the overflow. ").event())
            await c.write_event(SynthesizeStop().event())
            kinds = []
            while True:
                e = await asyncio.wait_for(c.read_event(), 60)
                kinds.append(e.type)
                if SynthesizeStopped.is_type(e.type):
                    return kinds

    kinds = asyncio.run(go())
    assert kinds == ["error", "synthesize-stopped"], kinds


def test_a_client_that_closes_its_sending_side_is_told_why(server):
    text = " ".join(["A long sentence to keep the speaker busy for a little while."] * 4)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        s.settimeout(60)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    # headers follow binary payloads directly, so look for the error event's header and code
    assert b'"type":"error"' in got and b"client-closed" in got, got[-300:]


def test_idle_connections_make_room_for_new_clients(tmp_path):
    s = Server(tmp_path, max_connections=2)
    try:
        idle = []
        for _ in range(2):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b'{"type": "ping"}\n')
            c.settimeout(10)
            assert b"pong" in c.recv(4096)
            idle.append(c)

        async def describe():
            async with AsyncTcpClient("127.0.0.1", s.port) as c:
                await c.write_event(Describe().event())
                return await asyncio.wait_for(c.read_event(), 30)

        assert Info.is_type(asyncio.run(describe()).type), "a new client is served although two idle ones hold the limit"
        closed = 0
        for c in idle:
            c.settimeout(5)
            try:
                closed += c.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                closed += 1
            c.close()
        assert closed >= 1, "an idle connection was closed to make room"
        # SIGTERM with an idle client connected: closed at once, no grace to wait out
        idle_client = socket.create_connection(("127.0.0.1", s.port))
        idle_client.sendall(b'{"type": "ping"}\n')
        idle_client.settimeout(10)
        assert b"pong" in idle_client.recv(4096)
        t0 = time.monotonic()
        code = s.stop()
        took = time.monotonic() - t0
        idle_client.close()
        assert code == 0
        assert took < 1.8, f"SIGTERM took {took:.2f} s with an idle client"
    finally:
        s.stop()

"""herald's OpenAI-compatible HTTP server against the PyPI `openai` client, curl and raw sockets
(issue 16).

Runs `herald serve` on the tiny bundle with the HTTP server on a kernel-chosen loopback port and
checks: `client.audio.speech.create` for pcm (equal to `herald speak --raw` of the same text and
seed, sample for sample) and wav; `with_streaming_response` (the first bytes arrive long before
the last, about the engine's time to first audio after the request); `/v1/models`, `/healthz`,
`/v1/say`; the error cases with curl (each an OpenAI-style JSON error naming its field); the
bearer token; OpenAI's voice names that are no alias (the configured voice); voice aliases (the
speaker's audio, listed by `GET /v1/audio/voices`, named in the 400 of an unknown voice); a client that hangs up mid-stream, one
that never reads (its job cancelled, its connection closed), one that shuts down its sending side
(it gets all its audio), a slowloris client, a 10 MB header and garbage bytes (the server goes on
serving); idle keep-alive connections at max_connections (a new client is still served); eight
clients at once against a queue of two (each complete or told busy, none cut or mixed); SIGTERM
mid-stream (the stream ends cleanly, herald exits 0).

Environment: HERALD_BIN (default target/debug/herald), HERALD_TEST_BUNDLES (default
build/bundles; the tiny-0.6b bundle is used).
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERALD = Path(os.environ.get("HERALD_BIN", ROOT / "target/debug/herald"))
BUNDLE = Path(os.environ.get("HERALD_TEST_BUNDLES", ROOT / "build/bundles")) / "tiny-0.6b"
SEED = 7
REQUEST_TIMEOUT_S = 2
# three sentences: on the tiny bundle (which never says eos, so the frame cap ends it) about
# 15 s of audio, made in 1 to 3 s
TEXT = "Hello there. This is herald speaking over HTTP. A third sentence makes it longer."
LONG = "Many words that take a long while to say, again and again and again and again. " * 3


def herald_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}


def config(tmp: Path, **serve) -> Path:
    """A config file: HTTP on a kernel-chosen port, Wyoming off, a fixed seed, the null device."""
    keys = {"wyoming": "off", "http": "127.0.0.1:0", "queue_length": 2,
            "request_timeout_s": REQUEST_TIMEOUT_S, "idle_timeout_s": 30}
    keys.update(serve)
    lines = ["[serve]"] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    lines += ["[synthesis]", f"seed = {SEED}", "[voices.aliases]", 'kitchen = "vivian"', "[audio]", 'device = "null"',
              "[runtime]", f'graph_cache_dir = "{tmp / "cache"}"', f'calibration_dir = "{tmp / "cal"}"']
    p = tmp / "herald.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


class Server:
    """`herald serve` in the background; its ports from its log (`http: listening on …`, and
    `wyoming: listening on …` when `wyoming` is given)."""

    def __init__(self, tmp: Path, **serve):
        self.tmp = tmp
        self.cfg = config(tmp, **serve)
        self.log = tmp / "serve.log"
        env = herald_env()
        env["RUST_LOG"] = "info"
        self.proc = subprocess.Popen(
            [str(HERALD), "serve", "--config", str(self.cfg), "--fifo", str(tmp / "say"), "--bundle", str(BUNDLE)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), env=env)
        self.port = self.wyoming_port = None
        end = time.monotonic() + 120
        while time.monotonic() < end:
            text = self.log_text()
            m = re.search(r"http: listening on http://127\.0\.0\.1:(\d+)", text)
            w = re.search(r"wyoming: listening on tcp://127\.0\.0\.1:(\d+)", text)
            if m and "ready;" in text and (w or serve.get("wyoming", "off") == "off"):
                self.port = int(m.group(1))
                self.wyoming_port = int(w.group(1)) if w else None
                self.url = f"http://127.0.0.1:{self.port}"
                return
            assert self.proc.poll() is None, f"herald serve exited early:\n{text}"
            time.sleep(0.1)
        raise AssertionError(f"herald serve did not get ready:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("http"))
    yield s
    assert s.stop() == 0, s.log_text()


@pytest.fixture(scope="module")
def spoken(tmp_path_factory):
    """What `herald speak --raw` says for TEXT with the server's seed."""
    tmp = tmp_path_factory.mktemp("speak")
    cfg = tmp / "speak.toml"
    cfg.write_text(f"[synthesis]\nseed = {SEED}\n[runtime]\n"
                   f'graph_cache_dir = "{tmp / "cache"}"\ncalibration_dir = "{tmp / "cal"}"\n')
    out = subprocess.run([str(HERALD), "speak", "--config", str(cfg), "--bundle", str(BUNDLE), "--raw", TEXT],
                         capture_output=True, env=herald_env(), timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    assert len(out.stdout) > 48_000 and len(out.stdout) % 2 == 0
    return out.stdout


def request(server: Server, method: str, path: str, body=None, headers=None, timeout=120):
    """One request with http.client: (status, headers, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def curl(server: Server, path: str, *args: str):
    """curl against the server: (status, body)."""
    out = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *args, f"{server.url}{path}"],
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    body, _, status = out.stdout.rpartition(b"\n")
    return int(status), body


def error_of(body: bytes) -> dict:
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    return e


def ttfa_ms(server: Server, after: int) -> float:
    """The engine's time to first audio of the last HTTP request logged after `after` bytes of log."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        found = re.findall(r"http: request \d+ .*time to first audio (\d+) ms", server.log_text()[after:])
        if found:
            return float(found[-1])
        time.sleep(0.05)
    raise AssertionError(server.log_text()[after:])


# -- the openai client ---------------------------------------------------------------------


def test_pcm_is_herald_speak_raw_sample_for_sample(server, spoken):
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm")
    assert audio.response.headers["content-type"] == "audio/pcm"
    assert audio.response.headers["transfer-encoding"] == "chunked"
    assert audio.content == spoken


def test_wav_carries_the_same_samples(server, spoken):
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav")
    wav = audio.content
    assert audio.response.headers["content-type"] == "audio/wav"
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", wav[20:36])
    assert (fmt, channels, rate, bits) == (1, 1, 24000, 16)
    assert wav[36:40] == b"data" and wav[44:] == spoken


def test_no_response_format_is_playable_mp3_as_openai_answers(server, spoken):
    # OpenAI's default format; the openai client sends none when the caller names none
    audio = server.client().audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    mp3 = audio.content
    assert audio.response.headers["content-type"] == "audio/mpeg"
    # MPEG-2 Layer III frame sync at 24 kHz (no ID3 tag: a stream)
    assert mp3[:2] == b"\xff\xf3"
    if shutil.which("ffmpeg") is None:
        pytest.skip("no ffmpeg on PATH (scripts/prereqs installs it)")
    pcm = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", "-", "-f", "s16le", "-ac", "1", "-ar", "24000", "-"],
                         input=mp3, capture_output=True, check=True).stdout
    # whole 576-sample frames covering the audio and LAME's 1105-sample delay (service/tests/http.rs
    # compares the samples themselves)
    assert len(pcm) % (2 * 576) == 0 and len(pcm) >= len(spoken) + 2 * 1105


def test_opus_is_ogg_opus_that_ffmpeg_decodes_to_the_spoken_length(server, spoken):
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="opus")
    ogg = audio.content
    assert audio.response.headers["content-type"] == "audio/ogg"
    # the first Ogg page holds OpusHead alone (27-byte page header, 1-byte segment table)
    assert ogg[:4] == b"OggS" and ogg[28:36] == b"OpusHead"
    if shutil.which("ffmpeg") is None:
        pytest.skip("no ffmpeg on PATH (scripts/prereqs installs it)")
    pcm = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", "-", "-f", "s16le", "-ac", "1", "-ar", "24000", "-"],
                         input=ogg, capture_output=True, check=True).stdout
    # the pre-skip and the end trim leave exactly the audio (service/tests/http.rs compares the
    # samples themselves)
    assert len(pcm) == len(spoken)


def test_the_openai_clients_speed_stretches_the_audio_keeping_its_samples_at_one(server, spoken):
    for speed, want in [(1.0, len(spoken) // 2), (2.0, round(len(spoken) // 2 / 2.0)), (0.75, round(len(spoken) // 2 / 0.75))]:
        audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm",
                                                     speed=speed)
        assert len(audio.content) // 2 == want, (speed, len(audio.content) // 2, want)
        if speed == 1.0:
            assert audio.content == spoken


def test_streaming_sends_the_first_audio_long_before_the_last(server, spoken):
    client = server.client()
    mark = len(server.log_text())
    t0 = time.monotonic()
    first = None
    received = b""
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=TEXT,
                                                           response_format="pcm") as response:
        for chunk in response.iter_bytes():
            if first is None and chunk:
                first = time.monotonic() - t0
            received += chunk
    total = time.monotonic() - t0
    ttfa = ttfa_ms(server, mark)
    print(f"\nHTTP pcm stream: first byte after {first * 1e3:.0f} ms, all {len(received)} bytes after {total * 1e3:.0f} ms; "
          f"the engine's time to first audio {ttfa:.0f} ms")
    assert received == spoken
    assert first * 3 < total, (first, total)
    # the first bytes leave with the engine's first chunk: the request's own overhead is small
    assert first * 1e3 < ttfa + 500, (first, ttfa)


def test_models_health_and_say(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [models.data[0].id] and models.data[0].id.startswith("qwen3-tts-")
    assert server.client().models.retrieve(models.data[0].id).id == models.data[0].id
    status, _, body = request(server, "GET", "/healthz")
    assert (status, json.loads(body)) == (200, {"status": "ready"})
    status, _, body = request(server, "POST", "/v1/say", {"input": "Dinner is ready."})
    answer = json.loads(body)
    assert status == 200, body
    assert answer["spoken"] is True and answer["samples"] > 0 and answer["sample_rate"] == 24000


def test_openai_voice_names_that_are_no_alias_mean_the_configured_voice(server, spoken):
    # alloy's sohee is not in the tiny bundle; ash has no built-in alias
    for voice in ("alloy", "Ash"):
        audio = server.client().audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format="pcm")
        assert audio.content == spoken, voice


def test_aliases_speak_as_their_speakers_and_are_listed(server):
    def pcm(voice):
        return server.client().audio.speech.create(model="tts-1", voice=voice, input="Good evening.",
                                                   response_format="pcm").content

    vivian = pcm("vivian")
    assert len(vivian) > 0
    assert pcm("Kitchen") == vivian, "the configuration's alias, in any case"
    assert pcm("nova") == vivian, "the built-in nova"
    status, headers, body = request(server, "GET", "/v1/audio/voices")
    assert status == 200 and headers["content-type"] == "application/json", body
    voices = json.loads(body)["voices"]
    assert [v["id"] for v in voices] == ["dylan", "eric", "ryan", "serena", "vivian", "echo", "kitchen", "nova", "shimmer"]
    kitchen = next(v for v in voices if v["id"] == "kitchen")
    assert kitchen == {"id": "kitchen", "name": "kitchen (vivian)", "alias_of": "vivian",
                       "languages": next(v for v in voices if v["id"] == "vivian")["languages"]}
    assert next(v for v in voices if v["id"] == "ryan")["alias_of"] is None
    # the openai client sees an unknown voice as a bad request naming the voices and aliases
    with pytest.raises(openai.BadRequestError) as e:
        pcm("kitchn")
    error = e.value.body
    assert error["param"] == "voice", error
    assert '"kitchn"' in error["message"] and "kitchen (vivian)" in error["message"], error


def test_a_say_whose_client_hangs_up_is_played_and_logged(server):
    mark = len(server.log_text())
    body = json.dumps({"input": "Client hangs up."}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/say HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
    end = time.monotonic() + 60
    while True:
        log = server.log_text()[mark:]
        if re.search(r"http: request \d+ from [^ ]+: say of 16 characters: \d+ frames", log):
            break
        assert time.monotonic() < end, log
        time.sleep(0.05)


def test_the_openai_client_sees_bad_requests_as_such(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="aac")
    assert e.value.status_code == 400
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        server.client().audio.speech.create(model="tts-1", voice="default", input="Hi.", speed=4.5)
    assert e.value.body["param"] == "speed"


# -- curl: the error cases -----------------------------------------------------------------


@pytest.mark.parametrize("body, param, words", [
    ({"model": "tts-1", "input": "Hi.", "voice": "default", "response_format": "aac"}, "response_format",
     "herald does not produce aac (no encoder for it is built in); response_format must be one of: mp3, opus, flac, wav, pcm"),
    ({"model": "tts-1", "input": "Hi.", "voice": "default", "response_format": "ogg"}, "response_format", "unknown"),
    ({"model": "tts-1", "input": "Hi.", "voice": "default", "speed": 0.2}, "speed", "speed 0.2 is out of range; allowed: 0.25 to 4.0"),
    ({"model": "tts-1", "input": "Hi.", "voice": "default", "speed": "fast"}, "speed", "'speed' must be a number from 0.25 to 4.0"),
    ({"model": "tts-1", "input": "Hi.", "voice": "nobody"}, "voice", 'unknown voice "nobody"; voices: default'),
    ({"model": "tts-1", "input": "Hi.", "voice": "default", "stream_format": "sse"}, "stream_format", "allowed: audio"),
    ({"model": "tts-1", "input": "Hi.", "language": "klingon"}, "language", "unknown language"),
    ({"model": "tts-1", "input": "x" * 4097, "voice": "default"}, "input", "the limit is 4096 characters"),
    ({"model": "tts-1", "voice": "default"}, "input", "missing required parameter: 'input'"),
    ({"model": "tts-1", "input": 5}, "input", "'input' must be a string"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param, words):
    status, answer = curl(server, "/v1/audio/speech", "-H", "Content-Type: application/json", "-d", json.dumps(body))
    e = error_of(answer)
    assert status == 400, answer
    assert (e["type"], e["param"]) == ("invalid_request_error", param)
    assert words in e["message"], e


def test_every_request_and_its_outcome_is_logged_at_info(server):
    mark = len(server.log_text())
    status, _, _ = request(server, "POST", "/v1/audio/speech", body={"input": "Hi.", "speed": 9.0})
    assert status == 400
    assert request(server, "GET", "/v1/models")[0] == 200
    assert request(server, "GET", "/nowhere")[0] == 404
    answer = raw(server, bytes(range(256)) * 4)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    end = time.monotonic() + 5
    while "connection closed" not in server.log_text()[mark:]:
        assert time.monotonic() < end, server.log_text()[mark:]
        time.sleep(0.05)
    log = server.log_text()[mark:]
    assert re.search(r"INFO.*http: request \d+ from 127\.0\.0\.1:\d+: POST /v1/audio/speech: 400 .*speed", log), log
    assert re.search(r"INFO.*http: request \d+ from 127\.0\.0\.1:\d+: GET /v1/models: 200", log), log
    assert re.search(r"INFO.*http: request \d+ from 127\.0\.0\.1:\d+: GET /nowhere: 404", log), log
    # what hyper answers itself (400 for bytes that are no request) is logged too
    assert re.search(r"INFO.*http: 127\.0\.0\.1:\d+: .*; connection closed", log), log
    assert "WARN" not in log and "ERROR" not in log, log


def test_bad_json_wrong_paths_and_methods(server):
    status, answer = curl(server, "/v1/audio/speech", "-d", '{"input": "Hi.",')
    assert status == 400 and "not valid JSON" in error_of(answer)["message"]
    status, answer = curl(server, "/v1/audio/speech", "-d", "[]")
    assert status == 400 and "must be a JSON object" in error_of(answer)["message"]
    status, answer = curl(server, "/v1/audio/speech", "-d", "[" * 1000 + "]" * 1000)
    assert status == 400, answer
    status, answer = curl(server, "/v1/chat/completions", "-d", "{}")
    assert status == 404 and error_of(answer)["message"] == "no such endpoint: POST /v1/chat/completions"
    status, answer = curl(server, "/v1/audio/speech")
    assert status == 405 and "takes POST" in error_of(answer)["message"]
    status, answer = curl(server, "/v1/models/tts-1")
    assert status == 404 and error_of(answer)["code"] == "model_not_found"


def test_a_body_over_the_limit_is_refused(server, tmp_path):
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"input": "a" * 100_000}))
    status, answer = curl(server, "/v1/audio/speech", "--data-binary", f"@{big}")
    assert status == 413 and "larger than 65536 bytes" in error_of(answer)["message"], answer
    # chunked, so that no Content-Length tells in advance
    status, answer = curl(server, "/v1/audio/speech", "-H", "Transfer-Encoding: chunked", "--data-binary", f"@{big}")
    assert status == 413, answer
    status, _ = curl(server, "/healthz")
    assert status == 200


# -- misbehaving clients ---------------------------------------------------------------------


def raw(server: Server, data: bytes, timeout=10) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def test_a_huge_header_and_garbage_are_refused_and_the_server_goes_on(server):
    answer = raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000_000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    answer = raw(server, bytes(range(256)) * 64)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # a Content-Length that lies (shorter than promised): the body never arrives in full
    t0 = time.monotonic()
    answer = raw(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"input\":")
    assert b"408" in answer.split(b"\r\n")[0] or answer == b"", answer[:200]
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 2
    assert request(server, "GET", "/healthz")[0] == 200


def test_a_slowloris_client_is_cut_off_and_blocks_nobody(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT_S + 5)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-")
    # meanwhile others are served
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="pcm")
    assert len(audio.content) > 0
    assert s.recv(1024) == b"", "closed without an answer"
    waited = time.monotonic() - t0
    s.close()
    assert REQUEST_TIMEOUT_S - 0.2 <= waited < REQUEST_TIMEOUT_S + 2, waited


def test_a_client_that_hangs_up_mid_stream_cancels_its_job(server, spoken):
    mark = len(server.log_text())
    body = json.dumps({"model": "tts-1", "input": LONG, "voice": "default", "response_format": "pcm"}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while len(got) < 8192:
        chunk = s.recv(8192)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200 OK")
    s.close()
    end = time.monotonic() + 30
    while "the client went away; its job is cancelled" not in server.log_text()[mark:]:
        assert time.monotonic() < end, server.log_text()[mark:]
        time.sleep(0.05)
    # the next request is served in full
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm")
    assert audio.content == spoken


def chunked_body(answer: bytes) -> tuple[bytes, bool]:
    """The body of a raw chunked HTTP answer, and whether it ended with its closing chunk."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body, True
        body += rest[:size]
        rest = rest[size + 2:]
    return body, False


def test_a_client_that_shuts_down_its_sending_side_gets_all_its_audio(server, spoken):
    body = json.dumps({"model": "tts-1", "input": TEXT, "voice": "default", "response_format": "pcm"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        s.shutdown(socket.SHUT_WR)  # what `nc -N` and `curl --data @- < file`-style pipes do
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    audio, complete = chunked_body(answer)
    assert complete and audio == spoken


def test_a_client_that_never_reads_has_its_job_cancelled(server, spoken):
    mark = len(server.log_text())
    body = json.dumps({"input": "The quick brown fox jumps over the lazy dog. " * 20, "response_format": "pcm"}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    t0 = time.monotonic()
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    # the kernel's buffers fill within about a second, then the response makes no progress for
    # request_timeout_s: the connection is closed and the job cancelled (not run to its end)
    while "the client went away; its job is cancelled" not in server.log_text()[mark:]:
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 10, server.log_text()[mark:]
        time.sleep(0.05)
    waited = time.monotonic() - t0
    log = server.log_text()[mark:]
    assert f"took no byte of its response for {REQUEST_TIMEOUT_S}s (serve.request_timeout); closed" in log, log
    assert not re.search(r"http: request \d+ [^\n]*: \d+ frames", log), log
    print(f"\na client that never reads: its job cancelled after {waited:.1f} s")
    s.settimeout(5)
    got = b""
    with pytest.raises(ConnectionResetError):
        while chunk := s.recv(65536):
            got += chunk
        raise AssertionError(f"closed without a reset after {len(got)} bytes")
    s.close()
    assert len(got) < 1 << 20
    # the speaker is free again
    audio = server.client().audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm")
    assert audio.content == spoken


def test_eight_clients_against_a_queue_of_two(server, spoken):
    results = [None] * 8

    def one(i):
        results[i] = request(server, "POST", "/v1/audio/speech",
                             {"model": "tts-1", "input": TEXT, "voice": "default", "response_format": "pcm"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503}, statuses
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) >= 3 and busy, statuses
    for _, headers, body in busy:
        assert headers["retry-after"] == "1"
        assert error_of(body)["code"] == "busy"
    # one seed, one text: each answer is the whole utterance, none cut or mixed with another
    for _, _, body in ok:
        assert body == spoken
    assert request(server, "GET", "/healthz")[0] == 200


# -- servers of their own: max_connections, the API key, SIGTERM ------------------------------


def test_idle_keep_alive_connections_do_not_lock_the_server_out(tmp_path):
    s = Server(tmp_path, max_connections=4)
    try:
        held = []
        for _ in range(4):
            c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
            c.request("GET", "/healthz")
            assert c.getresponse().read() == b'{"status":"ready"}'
            held.append(c)
        time.sleep(1.2)  # idle connections may be closed for a new one after a second
        for _ in range(6):
            status, _, body = request(s, "GET", "/healthz", timeout=10)
            assert (status, body) == (200, b'{"status":"ready"}')
        # fresh connections get a second to send their first request: with every one that fresh,
        # a new one is told busy, and the fresh ones are served
        for c in held:
            c.close()
        time.sleep(0.3)
        fresh = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(4)]
        time.sleep(0.1)
        status, headers, body = request(s, "GET", "/healthz", timeout=10)
        assert status == 503 and headers["retry-after"] == "1" and error_of(body)["code"] == "busy", body
        for f in fresh:
            f.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert f.recv(1024).startswith(b"HTTP/1.1 200 OK")
            f.close()
        # a request head still arriving is no request in progress: one is closed for a new client
        time.sleep(0.3)
        partial = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(4)]
        for p in partial:
            p.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the head not yet complete
        time.sleep(0.3)
        status, _, body = request(s, "GET", "/healthz", timeout=10)
        assert (status, body) == (200, b'{"status":"ready"}')
        closed = 0
        for p in partial:
            p.settimeout(0.5)
            try:
                closed += p.recv(1024) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
            p.close()
        assert closed >= 1, "a partial head was closed to make room"
    finally:
        assert s.stop() == 0, s.log_text()


def test_the_api_key_guards_every_route_but_healthz(tmp_path):
    s = Server(tmp_path, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client().models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        status, answer = curl(s, "/v1/audio/speech", "-d", json.dumps({"input": "Hi."}))
        assert status == 401 and error_of(answer)["code"] == "invalid_api_key"
        status, _ = curl(s, "/v1/say", "-H", "Authorization: Bearer wrong", "-d", json.dumps({"input": "Hi."}))
        assert status == 401
        assert curl(s, "/healthz")[0] == 200
        audio = s.client(api_key="s3cret").audio.speech.create(model="tts-1", voice="default", input="Hi.",
                                                               response_format="pcm")
        assert len(audio.content) > 0
    finally:
        assert s.stop() == 0, s.log_text()


def test_sigterm_mid_stream_ends_the_stream_cleanly(tmp_path):
    s = Server(tmp_path)
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    c.request("POST", "/v1/audio/speech", body=json.dumps({"input": LONG, "response_format": "pcm"}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    first = r.read(4096)
    s.proc.send_signal(signal.SIGTERM)
    rest = r.read()  # http.client raises IncompleteRead on a cut chunked transfer
    c.close()
    assert (len(first) + len(rest)) % 2 == 0
    assert s.proc.wait(timeout=30) == 0, s.log_text()
    assert "stopped by a signal; the stream was ended cleanly" in s.log_text()

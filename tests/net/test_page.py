"""herald's web page (`GET /`, service/src/page.html) in a real headless browser (issue 39).

Runs `herald serve` on the tiny bundle (test_http.py's `Server`) and Debian's chromium, headless,
driven over the Chrome DevTools Protocol on a pipe (`--remote-debugging-pipe`: JSON messages
ending in a NUL byte on file descriptors 3 and 4, no extra Python package). It checks that the
page loads under its Content-Security-Policy (no violation reported), lists the server's voices
and languages, plays a request after a real mouse click (the pcm stream through Web Audio) and
shows a time to first audio and an RTF, with as many samples as a direct request for the same
text, voice and seed; and that with `serve.api_key` set the page asks for the key, says a wrong
one was not accepted, and lists the voices once given the right one. A screenshot of each page
is kept under build/page/ (page.png after a request, page-key.png asking for the key; CI
keeps them as artifacts).

Environment: HERALD_BIN, HERALD_TEST_BUNDLES (as test_http.py), HERALD_TEST_CHROMIUM (the
browser; default: `chromium` on PATH), HERALD_TEST_BROWSER=required (scripts/test, as
HERALD_TEST_QNN: no browser is a failure, not a skip).
"""

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from test_http import ROOT, Server, request

SHOTS = ROOT / "build/page"
RATE = 24000
FRAME = 1920  # samples of one 80 ms frame at 24 kHz


def chromium() -> str:
    found = os.environ.get("HERALD_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        message = "no chromium on PATH (scripts/prereqs installs Debian's chromium)"
        if os.environ.get("HERALD_TEST_BROWSER") == "required":
            pytest.fail(message + "; HERALD_TEST_BROWSER=required needs it")
        pytest.skip(message)
    return found


class Browser:
    """Headless chromium and one page of it, over the DevTools protocol on a pipe."""

    def __init__(self, profile: Path):
        to_chrome, self._write = os.pipe()
        self._read, from_chrome = os.pipe()
        # chromium reads commands on fd 3 and writes answers on fd 4: put the ends there in the
        # child (from numbers above 4, so that the dup2s do not clobber each other)
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome, from_chrome)]
        os.close(to_chrome)
        os.close(from_chrome)

        def child():
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)

        args = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--mute-audio",
                "--autoplay-policy=no-user-gesture-required", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                "--window-size=900,1000", "about:blank"]
        self.log = profile.parent / "chromium.log"
        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=child, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        for fd in ends:
            os.close(fd)
        self._next = 0
        self._buf = b""
        self.events = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=900, height=1000,
                  deviceScaleFactor=1, mobile=False)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise AssertionError(f"chromium went away:\n{self.log.read_text(errors='replace')[-4000:]}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._message(deadline)
            if m.get("id") == self._next:
                if "error" in m:
                    raise AssertionError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def js(self, expression: str):
        """The value of a JS expression in the page (awaited when it is a promise)."""
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float):
        """Polls a JS expression until it is truthy; its value."""
        end = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"waited {timeout} s for {expression}; the page says: {self.js(STATE)}; "
                                     f"its console: {self.console()}")
            time.sleep(0.05)

    def goto(self, url: str, timeout: float = 30):
        """Navigates and waits for the page's load event."""
        seen = len(self.events)
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events[seen:]):
            self.events.append(self._message(deadline))

    def click(self, element_id: str):
        """A real mouse click in the middle of the element (a user gesture, as a person's)."""
        x, y = self.js(f"(() => {{ const r = document.getElementById({element_id!r}).getBoundingClientRect();"
                       " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, element_id: str, text: str):
        self.js(f"document.getElementById({element_id!r}).focus()")
        self.call("Input.insertText", session=True, text=text)

    def screenshot(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"]))

    def console(self) -> list:
        """What the page logged: console calls, exceptions and the browser's log (CSP reports)."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e.get("method") == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails")))
            elif e.get("method") == "Log.entryAdded":
                out.append(p["entry"].get("text", ""))
        return out

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except (AssertionError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._write)
        os.close(self._read)


STATE = ("({state: document.body.dataset.state, status: document.getElementById('status').textContent,"
         " keyShown: !document.getElementById('key-form').hidden})")


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def options(browser: Browser, select_id: str) -> list:
    return browser.js(f"[...document.getElementById({select_id!r}).options].map(o => [o.value, o.textContent])")


def number(browser: Browser, element_id: str) -> float:
    text = browser.js(f"document.getElementById({element_id!r}).textContent")
    try:
        return float(text)
    except ValueError:
        raise AssertionError(f"#{element_id} shows {text!r}, not a number") from None


def test_the_page_lists_the_voices_and_plays_a_request_as_it_streams(tmp_path, browser):
    t0 = time.monotonic()
    s = Server(tmp_path)
    try:
        status, headers, body = request(s, "GET", "/v1/audio/voices")
        assert status == 200
        voices = json.loads(body)["voices"]
        browser.goto(s.url + "/")
        browser.wait_for("document.body.dataset.state === 'ready'", 30)
        shown = options(browser, "voices")
        assert [v for v, _ in shown] == ["default"] + [v["id"] for v in voices]
        assert ["kitchen", "kitchen → vivian"] in shown, shown
        languages = sorted({lang for v in voices for lang in v["languages"]})
        assert [v for v, _ in options(browser, "language")] == ["", "auto"] + languages
        assert browser.js("document.getElementById('format').value") == "pcm"

        browser.click("speak")
        browser.wait_for("document.body.dataset.state === 'done' || document.body.dataset.state === 'error'", 60)
        state = browser.js(STATE)
        assert state["state"] == "done", state
        ttfa, total, seconds, rtf = (number(browser, i) for i in ("ttfa", "total", "seconds", "rtf"))
        samples = int(browser.js("document.body.dataset.samples"))
        assert 0 < ttfa <= total, (ttfa, total)
        assert rtf > 0 and abs(rtf - total / 1000 / seconds) < 0.01, (rtf, total, seconds)
        assert abs(seconds - samples / RATE) < 0.01, (seconds, samples)
        browser.screenshot(SHOTS / "page.png")

        # the same request, sent directly: as many samples (same text, voice and seed; the
        # configured voice and language, which the page picks first)
        text = browser.js("document.getElementById('text').value")
        assert browser.js("document.getElementById('voices').value") == "default"
        assert browser.js("document.getElementById('language').value") == ""
        status, headers, pcm = request(s, "POST", "/v1/audio/speech", {
            "model": "herald", "input": text, "voice": "default", "speed": 1, "response_format": "pcm"})
        assert status == 200 and headers["content-type"] == "audio/pcm"
        assert len(pcm) > 0 and abs(samples - len(pcm) // 2) <= FRAME, (samples, len(pcm) // 2)

        # a download format: the whole file, its length from the browser's own decoder; for
        # opus, Chromium's own Ogg Opus decoder (the end trim honoured)
        for fmt in ("wav", "opus"):
            browser.js(f"document.getElementById('format').value = '{fmt}'; document.body.dataset.state = ''")
            browser.click("speak")
            browser.wait_for("document.body.dataset.state === 'done' || document.body.dataset.state === 'error'", 60)
            state = browser.js(STATE)
            assert state["state"] == "done", (fmt, state)
            assert browser.js("document.getElementById('download-link').download") == f"herald.{fmt}"
            assert browser.js("!document.getElementById('player').hidden")
            assert abs(number(browser, "seconds") - len(pcm) / 2 / RATE) < 0.01, (fmt, number(browser, "seconds"))

        violations = [m for m in browser.console() if "Content Security Policy" in m]
        assert violations == [], violations
        assert "GET /: 200" in s.log_text()
    finally:
        assert s.stop() == 0, s.log_text()
    print(f"page test: {time.monotonic() - t0:.1f} s, TTFA {ttfa:.0f} ms, RTF {rtf:.3f}, {seconds:.2f} s of audio")


def test_with_an_api_key_the_page_asks_for_it(tmp_path, browser):
    s = Server(tmp_path, api_key="s3cret")
    try:
        browser.goto(s.url + "/")
        state = browser.wait_for(f"document.body.dataset.state === 'key' && {STATE}", 30)
        assert state["keyShown"] and "API key" in state["status"], state
        assert options(browser, "voices") == []

        browser.type_into("key", "wrong")
        browser.click("key-submit")
        state = browser.wait_for(f"document.getElementById('status').textContent.includes('not accepted') && {STATE}",
                                 30)
        assert state["state"] == "key" and state["keyShown"], state
        browser.screenshot(SHOTS / "page-key.png")

        browser.type_into("key", "s3cret")
        browser.click("key-submit")
        browser.wait_for("document.body.dataset.state === 'ready'", 30)
        assert not browser.js(STATE)["keyShown"]
        status, _, body = request(s, "GET", "/v1/audio/voices", headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        assert [v for v, _ in options(browser, "voices")] == ["default"] + [v["id"] for v in json.loads(body)["voices"]]
        # kept for this tab only
        assert browser.js("sessionStorage.getItem('herald-api-key')") == "s3cret"
        assert browser.js("localStorage.length") == 0
    finally:
        assert s.stop() == 0, s.log_text()

"""Writes the seed inputs of the fuzz targets that are not copies of repository files: small ONNX
graphs holding each pattern the sanitizer rewrites (and one it keeps), Wyoming event streams and
HTTP bodies. Run from the repository root: .venv/bin/python fuzz/seeds.py (the output is
committed; rerun only to change the seeds)."""

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent / "corpus"


def model(nodes, inits, inputs, outputs, value_info=(), name="g"):
    g = helper.make_graph(nodes, name, inputs, outputs, initializer=inits, value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="herald-fuzz-seed")


def f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def sanitize_seeds():
    out = ROOT / "sanitize"
    out.mkdir(parents=True, exist_ok=True)
    c = numpy_helper.from_array(np.array([0.0], dtype=np.float32), "c")
    guard = model([helper.make_node("IsNaN", ["x"], ["n"]), helper.make_node("Where", ["n", "c", "x"], ["y"])],
                  [c], [f32("x", [2, 3])], [f32("y", [2, 3])], [f32("n", [2, 3])])
    shape = numpy_helper.from_array(np.array([3, 2], dtype=np.int64), "s")
    reshape = model([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1)], [shape], [f32("x", [2, 3])], [f32("y", [3, 2])])
    zero = numpy_helper.from_array(np.array([0, 6], dtype=np.int64), "s")
    reshape_kept = model([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1)], [zero], [f32("x", [0, 6])], [f32("y", [0, 6])])
    axes = numpy_helper.from_array(np.array(0, dtype=np.int64), "a")
    unsq = model([helper.make_node("Unsqueeze", ["x", "a"], ["y"]), helper.make_node("Squeeze", ["y", "a"], ["z"])],
                 [axes], [f32("x", [3])], [f32("z", [3])])
    then_g = helper.make_graph([helper.make_node("IsNaN", ["x"], ["n2"]), helper.make_node("Where", ["n2", "c", "x"], ["t"])],
                               "then", [], [f32("t", [2, 3])])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [f32("e", [2, 3])])
    cond = numpy_helper.from_array(np.array(True), "b")
    sub = model([helper.make_node("If", ["b"], ["y"], then_branch=then_g, else_branch=else_g)], [c, cond],
                [f32("x", [2, 3])], [f32("y", [2, 3])])
    for name, m in [("nan-guard", guard), ("allowzero", reshape), ("allowzero-kept", reshape_kept),
                    ("scalar-axes", unsq), ("subgraph", sub)]:
        onnx.checker.check_model(m)
        (out / f"{name}.onnx").write_bytes(m.SerializeToString())


def event(kind, data=None, payload=b""):
    header = {"type": kind, "version": "1.10.2"}
    body = json.dumps(data).encode() if data else b""
    if body:
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + body + payload


def wyoming_seeds():
    out = ROOT / "wyoming"
    out.mkdir(parents=True, exist_ok=True)
    seeds = {
        "describe": event("describe"),
        "synthesize": event("synthesize", {"text": "Hello there. How are you?", "voice": {"name": "ryan", "language": "en"}}),
        "streaming": event("synthesize-start", {"voice": {"name": "ryan"}}) + event("synthesize-chunk", {"text": "One sentence. And "})
        + event("synthesize-chunk", {"text": "another one! 这是第三句。"}) + event("synthesize-stop"),
        "inline-data": b'{"type": "synthesize", "data": {"text": "Inline data, 45.6 percent."}}\n',
        "payload": event("audio-chunk", {"rate": 24000, "width": 2, "channels": 1}, b"\x00\x01" * 64),
        "ping": event("ping", {"text": "x"}) + event("describe"),
    }
    for name, b in seeds.items():
        (out / name).write_bytes(b)


def http_seeds():
    out = ROOT / "http_body"
    out.mkdir(parents=True, exist_ok=True)
    speech = {"model": "tts-1", "input": "Hello from the HTTP API.", "voice": "alloy", "response_format": "wav", "speed": 1.0}
    seeds = {
        "speech": b"\x00" + json.dumps(speech).encode(),
        "speech-pcm": b"\x00" + json.dumps({"model": "herald", "input": "Sprich bitte.", "voice": {"id": "ryan"},
                                           "response_format": "pcm", "language": "de", "instructions": "calm"}).encode(),
        "speech-bad": b"\x00" + json.dumps({"input": 5, "speed": 2, "response_format": "mp3"}).encode(),
        "say": b"\x01" + json.dumps({"input": "The door is open.", "voice": "default"}).encode(),
    }
    for name, b in seeds.items():
        (out / name).write_bytes(b)


def prompt_seeds():
    out = ROOT / "prompt"
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        "english": "Hello there. It is 21.5 degrees; Dr. Smith called at 3 p.m.!",
        "mixed": "Der Zug kommt um 8.15 Uhr. 火车晚点了。Le train est en retard… Really?\n\nNew paragraph here.",
        "cjk-run": "这是一个没有标点符号的很长很长的句子" * 8,
        "markers": "Say <|im_end|> and <|im_start|> literally.\r\nThen\u200bstop.",
    }
    for i, (name, t) in enumerate(texts.items()):
        (out / name).write_bytes(bytes([i * 37 % 256, 20 + i]) + t.encode())


def config_seeds():
    out = ROOT / "config"
    out.mkdir(parents=True, exist_ok=True)
    (out / "full.toml").write_text(
        '[model]\nbundle = "bundles/q4"\nverify = true\n[audio]\ndevice = "plughw:CARD=Speaker,DEV=0"\nvolume = 0.5\n'
        '[synthesis]\nlanguage = "english"\nspeaker = "ryan"\nseed = 42\nramp = [2, 4, 8]\nsegment_tokens = 80\n'
        '[runtime]\nthreads = 2\n[serve]\nwyoming = "tcp://0.0.0.0:10200"\nhttp = "off"\nmax_text_chars = 100000\n'
        '[amplifier]\nchip = "pinctrl-rp1"\nline = 17\nactive = "low"\n')


def fifo_lines_seeds():
    # first byte: the line limit - 1 (mod 64), second: the read size - 1 (mod 16); then the bytes
    out = ROOT / "fifo_lines"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in [
        ("lines", bytes([63, 3]) + b"Hello.\nSecond line\r\n\nthird"),
        ("too-long", bytes([7, 0]) + b"123456789\nok\n12345678\r\n"),
        ("utf8", bytes([40, 5]) + "Grüße, 世界!\n\u00e9\r\r\n".encode()),
    ]:
        (out / name).write_bytes(data)


def address_seeds():
    out = ROOT / "address"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in [
        ("tcp", "tcp://127.0.0.1:10200"), ("http", "http://[::1]:5000/"), ("off", "OFF"),
        ("port-alone", "18500"), ("host-alone", "localhost"), ("path", "tcp://h:1/x"),
        ("scheme", "udp://1.2.3.4:5"), ("big-port", "0.0.0.0:99999"), ("empty", " "),
    ]:
        (out / name).write_text(text)


if __name__ == "__main__":
    sanitize_seeds()
    wyoming_seeds()
    http_seeds()
    prompt_seeds()
    config_seeds()
    fifo_lines_seeds()
    address_seeds()

#!/usr/bin/env python3
"""Oracle for the engine's parity tests: runs tools/export/reference.py and prints plain lines.

The Rust tests (engine/tests/prompt_parity.rs, engine/tests/sampler_parity.rs) run this with the
project venv's python and compare the Rust results with these, exactly. The engine crate has no
JSON parser, so the protocol is line based, numbers only (floats as float32 bit patterns in hex,
texts as hex of their UTF-8 bytes).

    oracle.py prompt BUNDLE      stdin:  one request a line: TEXT_HEX LANGUAGE SPEAKER MODE
                                         ("-" for no language / no speaker; TEXT_HEX "-" = "")
                                 stdout: per request "ok rows=T:C,T:-,... trailing=I,... text=I,...
                                         lang=I|- spk=I|-" or "err MESSAGE_HEX"
    oracle.py sampler            stdout: the generated cases with their expected results (below)

Prompt input rules the Rust side adds (engine/src/prompt.rs: length limit, control characters,
blank text) are applied here before ``Reference.prompt_layout`` until reference.py has them; the
cleaning is idempotent, so this stays correct once it does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "export"))

import reference as R  # noqa: E402

# engine/src/prompt.rs MAX_TEXT_CHARS
MAX_TEXT_CHARS = 20_000


def clean_text(text: str) -> str:
    """Mirror of engine::prompt::clean_text."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "".join(" " if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F else c for c in text)


def hexs(s: str) -> str:
    return s.encode("utf-8").hex() or "-"


def ints(xs) -> str:
    return ",".join(str(int(x)) for x in xs) or "-"


def opt(x) -> str:
    return "-" if x is None else str(int(x))


def prompt(bundle: str) -> None:
    ref = R.Reference(bundle, threads=1)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        text_hex, language, speaker, mode = line.split(" ")
        text = "" if text_hex == "-" else bytes.fromhex(text_hex).decode("utf-8")
        language = None if language == "-" else language
        speaker = None if speaker == "-" else speaker
        try:
            # engine/src/prompt.rs checks language and speaker first, then the text.
            ref.prompt_layout("x", language, speaker, mode)
            if not text:
                raise ValueError("text is empty")
            if len(text) > MAX_TEXT_CHARS:
                raise ValueError(f"text is too long: {len(text)} > {MAX_TEXT_CHARS}")
            text = clean_text(text)
            if not text.strip():
                raise ValueError("text is blank")
            lay = ref.prompt_layout(text, language, speaker, mode)
            rows = ",".join(f"{t}:{opt(c)}" for t, c in lay.rows)
            print(f"ok rows={rows} trailing={ints(lay.trailing)} text={ints(lay.text_ids)} "
                  f"lang={opt(lay.language_id)} spk={opt(lay.speaker_id)}")
        except ValueError as e:
            print(f"err {hexs(str(e))}")


# --------------------------------------------------------------------------------- sampler

TALKER_VOCAB, PREDICTOR_VOCAB, EOS, NUM_CODEBOOKS = 3072, 2048, 2150, 16


def f32hex(x: float) -> str:
    return f"{int(np.array([x], np.float32).view(np.uint32)[0]):08x}"


def arrhex(a: np.ndarray) -> str:
    return ",".join(f"{int(v):08x}" for v in np.asarray(a, np.float32).view(np.uint32))


def logits(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Random float32 logits of a few shapes: ties, masks, peaks, flat, huge."""
    x = rng.standard_normal(n).astype(np.float32) * np.float32(3)
    if kind == "ties":
        x = (np.round(x * 2) / 2).astype(np.float32)
    elif kind == "masked":
        x[rng.random(n) < 0.3] = -np.inf
    elif kind == "peaked":
        x[rng.integers(0, n, 3)] += np.float32(20)
    elif kind == "flat":
        x[:] = np.float32(0.25)
    elif kind == "huge":
        x = x * np.float32(1e3)
    elif kind == "eos" and n > EOS:
        x[EOS] = x.max() + np.float32(5)
    return x.astype(np.float32)


KINDS = ["normal", "ties", "masked", "peaked", "flat", "huge", "eos"]


def params(rng: np.random.Generator, talker: bool) -> dict:
    """Sampling parameters; floats rounded to float32 first (the manifest stores f32)."""
    f = lambda v: float(np.float32(v))  # noqa: E731
    p = {
        "temperature": f(rng.choice([0.9, 0.5, 1.0, 1.3, 0.05, 2.0])),
        "top_k": int(rng.choice([0, 1, 2, 5, 50, 50, 3000, 5000])),
        "top_p": f(rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.1, 0.999])),
    }
    if talker:
        p["repetition_penalty"] = f(rng.choice([1.05, 1.0, 1.5, 0.8]))
        p["min_new_tokens"] = int(rng.choice([0, 2, 2, 5]))
    return p


def phex(p: dict, prefix: str) -> str:
    s = f"{prefix}temp={f32hex(p['temperature'])} {prefix}top_k={p['top_k']} {prefix}top_p={f32hex(p['top_p'])}"
    if "repetition_penalty" in p:
        s += f" {prefix}pen={f32hex(p['repetition_penalty'])} {prefix}min_new={p['min_new_tokens']}"
    return s


def choose(processed: np.ndarray, sampling: bool, rng: R.SplitMix64 | None) -> int:
    return R.sample_from_logits(processed, rng.uniform()) if sampling else R.greedy_choice(processed)


def sampler() -> None:
    g = np.random.default_rng(20240611)
    # Independent talker decisions: histories with repeats, frames 0.., greedy and seeded.
    for case in range(160):
        p = params(g, True)
        sampling = case % 4 != 0
        seed = int(g.integers(0, 2**63)) if sampling else None
        n_hist = int(g.choice([0, 1, 2, 3, 3, 8, 40]))
        hist = [int(v) for v in g.integers(0, 12 if case % 2 else 2048, n_hist)]
        if case % 5 == 0 and hist:
            hist[0] = EOS                       # an out-of-codebook id in the history
        x = logits(g, TALKER_VOCAB, KINDS[case % len(KINDS)])
        if hist and case % 3 == 0:
            x[hist[-1]] = x.max() + np.float32(1)   # the penalised id was the favourite
        processed = R.talker_processors(x, hist, p, EOS, sampling)
        c = choose(processed, sampling, R.SplitMix64(seed) if sampling else None)
        print(f"talker sampling={int(sampling)} seed={opt(seed)} {phex(p, '')} hist={ints(hist)} "
              f"logits={arrhex(x)} processed={arrhex(processed)} choice={c}")
    # Independent code-predictor decisions.
    for case in range(160):
        p = params(g, False)
        sampling = case % 4 != 0
        seed = int(g.integers(0, 2**63)) if sampling else None
        x = logits(g, PREDICTOR_VOCAB, KINDS[case % len(KINDS)])
        processed = R.predictor_processors(x, p, sampling)
        c = choose(processed, sampling, R.SplitMix64(seed) if sampling else None)
        print(f"predictor sampling={int(sampling)} seed={opt(seed)} {phex(p, '')} "
              f"logits={arrhex(x)} processed={arrhex(processed)} choice={c}")
    # Whole frames with one RNG stream: c0 then c1..c15, frames 0..3 (stop at eos).
    for seq in range(8):
        tp, pp = params(g, True), params(g, False)
        greedy = seq == 0
        seed = None if greedy else int(g.integers(0, 2**64, dtype=np.uint64))
        rng = None if greedy else R.SplitMix64(seed)
        print(f"seq id={seq} seed={opt(seed)} {phex(tp, 't_')} {phex(pp, 'p_')}")
        hist: list[int] = []
        for f in range(4):
            xs = [logits(g, TALKER_VOCAB, KINDS[(seq + f) % len(KINDS)])]
            c0 = choose(R.talker_processors(xs[0], hist, tp, EOS, not greedy), not greedy, rng)
            codes = [c0]
            if c0 != EOS:
                for k in range(1, NUM_CODEBOOKS):
                    xs.append(logits(g, PREDICTOR_VOCAB, KINDS[(seq + k) % len(KINDS)]))
                    codes.append(choose(R.predictor_processors(xs[-1], pp, not greedy), not greedy, rng))
            print(f"frame seq={seq} f={f} logits={';'.join(arrhex(x) for x in xs)} codes={ints(codes)}")
            if c0 == EOS:
                break
            hist.append(c0)


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "prompt" and len(sys.argv) == 3:
        prompt(sys.argv[2])
    elif sys.argv[1:] == ["sampler"]:
        sampler()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

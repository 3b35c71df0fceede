"""Run tools/export/reference.py over a list of cases and write its codes and PCM as .npy.

Usage: python reference_cases.py CASES.json OUT_DIR
CASES.json: [{"id", "bundle", "text", "language", "speaker", "mode", "seed", "max_frames",
"force_eos_at", "ramp", "left_context", "vocoder"}] (vocoder: "stateful" (default) or "windowed"). Writes OUT_DIR/<id>.codes.npy (int64 [F, 16]),
OUT_DIR/<id>.wav.npy (float32 [F*1920]) and OUT_DIR/<id>.json ({"stop", "frames"}); a case
whose request is rejected writes {"error": "..."} instead.
"""

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "export"))

from reference import Reference  # noqa: E402


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    refs: dict[str, Reference] = {}
    for c in cases:
        float_acts = bool(c.get("q4_float_activations"))
        key = f"{c['bundle']}|{float_acts}"
        ref = refs.setdefault(key, Reference(c["bundle"], threads=1, q4_float_activations=float_acts))
        try:
            gen = ref.generate(c["text"], language=c.get("language") or "auto", speaker=c.get("speaker"),
                               mode=c.get("mode", "streaming"), greedy=c.get("seed") is None, seed=c.get("seed"),
                               max_frames=c.get("max_frames"), force_eos_at=c.get("force_eos_at"))
        except ValueError as e:
            (out / f"{c['id']}.json").write_text(json.dumps({"error": str(e)}))
            continue
        if c.get("vocoder", "stateful") == "windowed":
            wav = ref.vocode(gen.codes, ramp=c.get("ramp"), left_context=c.get("left_context"))
        else:
            wav = ref.vocode_stateful(gen.codes, ramp=c.get("ramp"))
        np.save(out / f"{c['id']}.codes.npy", gen.codes.astype(np.int64))
        np.save(out / f"{c['id']}.wav.npy", wav.astype(np.float32))
        (out / f"{c['id']}.json").write_text(json.dumps({"stop": gen.stop, "frames": int(gen.frames)}))


if __name__ == "__main__":
    main()

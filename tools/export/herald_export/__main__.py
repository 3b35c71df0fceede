"""Command line: ``python -m herald_export export ...`` (wrapped by ``tools/export/export``).

    export --checkpoint DIR --out BUNDLE [--dtype fp32|fp16|q8|q4] [--allow-lossy]
    export --tiny PRESET --seed N --out BUNDLE [--dtype ...] [--keep-checkpoint DIR]
    export --preset qwen3-tts-0.6b|qwen3-tts-1.7b --random --seed N [--out BUNDLE] [--dtype ...]
      (real dimensions, random weights, for benchmarks; default --out build/bundles/PRESET-DTYPE)
    pack --bundle BUNDLE --out FILE
      (one archive for ``herald bundle install``: an index first, then the files; herald_export.pack)
    qnn --bundle BUNDLE --arch v73|v79|v68 [--soc N] [--talker-slots 256,1024,4096] [--allow-lossy]
        [--vocoder [--vocoder-frames 2,1]]
      (QNN HTP context binaries of the step graphs, added to the bundle: herald_export.qnn)

q8 / q4 quantize the step graphs' linear weights and run the fidelity gate (herald_export.gate)
before the bundle is renamed into place.

Exit codes: 0 done; 2 bad input (for ``qnn`` also: onnxruntime-qnn missing, a failed compile,
a v68 build that failed its fidelity gate), a quantized export that failed the fidelity gate, or a write
that failed -- disk full (ENOSPC), quota exceeded (EDQUOT), another I/O error (the one-line
message names the file and the problem; nothing is left at the output path, and a bundle
already there is unchanged); 1 an internal error; 130 interrupted (SIGINT).

A SIGKILL or a power cut at any point leaves the output path as it was or holding the complete
new bundle (herald_export.durable); the next export removes what a killed one left behind.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .durable import DISK_FULL, remove_stale_tempdirs
from .errors import ExportError

#: Prefixes of the temporary checkpoint directories (``<prefix><pid>-<random>`` in the system's
#: temporary folder); those of killed exporters are removed by the next one.
TMP_PREFIXES = ("herald-tiny-", "herald-preset-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="export", description="Qwen3-TTS 12 Hz checkpoint -> herald bundle")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a bundle from a checkpoint or a tiny random preset")
    src = ex.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="official Hugging Face checkpoint directory")
    src.add_argument("--tiny", metavar="PRESET",
                     help="tiny random checkpoint: tiny-0.6b, tiny-1.7b, tiny-hybrid, tiny-q")
    src.add_argument("--preset", metavar="PRESET",
                     help="with --random: real dimensions, random weights: qwen3-tts-0.6b, qwen3-tts-1.7b")
    ex.add_argument("--random", action="store_true", help="with --preset: random weights (the only source for now)")
    ex.add_argument("--seed", type=int, default=0, help="random seed of --tiny / --preset (default 0)")
    ex.add_argument("--out", type=Path, help="bundle directory to write (replaced when complete; "
                    "default for --preset: build/bundles/PRESET-DTYPE)")
    ex.add_argument("--dtype", choices=["fp32", "fp16", "q8", "q4"], default="fp32",
                    help="fp32/fp16: weight, cache and table dtype; q8/q4: the step graphs' linear weights "
                    "quantized, the rest float32, checked by the fidelity gate (default fp32)")
    ex.add_argument("--allow-lossy", action="store_true",
                    help="with q8/q4: write the bundle even when it fails the fidelity gate ([quantization.gate] passed = false)")
    ex.add_argument("--keep-checkpoint", type=Path, metavar="DIR", help="with --tiny: keep the generated checkpoint here")
    ex.add_argument("--quiet", action="store_true", help="no progress bars")
    pk = sub.add_parser("pack", help="write a bundle as one archive for `herald bundle install` (docs/bundle.md)")
    pk.add_argument("--bundle", type=Path, required=True, help="bundle directory")
    pk.add_argument("--out", type=Path, required=True, help="archive to write (replaced when complete), e.g. NAME.tar")
    pk.add_argument("--quiet", action="store_true", help="no summary line")
    qn = sub.add_parser("qnn", help="compile a bundle's step graphs into QNN HTP context binaries (added to the bundle)")
    qn.add_argument("--bundle", type=Path, required=True, help="bundle directory (updated in place, atomically)")
    qn.add_argument("--arch", required=True, metavar="ARCH",
                    help="HTP architecture: v73 (SM8550), v79 (SM8750): fp16; v68 (QCS6490): w8a16")
    qn.add_argument("--soc", type=int, metavar="N", help="QNN soc_model (default per arch: v73 43, v79 69, v68 93)")
    qn.add_argument("--talker-slots", default="256,1024,4096", metavar="N,N,...",
                    help="talker cache lengths, one binary each, clipped to max_positions (default 256,1024,4096)")
    qn.add_argument("--allow-lossy", action="store_true",
                    help="with v68: write the binaries even when the w8a16 build fails its fidelity gate")
    qn.add_argument("--vocoder", action="store_true",
                    help="also compile the stateful vocoder graph (run on the NPU with runtime.qnn_vocoder = \"npu\"; "
                    "v73, v79), each binary checked on the simulator against float32")
    qn.add_argument("--vocoder-frames", default="2,1", metavar="N,N,...",
                    help="with --vocoder: frames per run, one binary each, 1 among them (default 2,1)")
    qn.add_argument("--quiet", action="store_true", help="no progress bars or reports")
    args = ap.parse_args(argv)
    if args.cmd == "qnn":
        return _qnn(args)
    if args.cmd == "pack":
        return _pack(args)

    from .bundle import export
    from .tiny import PRESETS, write_tiny_checkpoint

    tmpdir = None
    remove_stale_tempdirs(TMP_PREFIXES, tempfile.gettempdir())
    try:
        if args.allow_lossy and args.dtype not in ("q8", "q4"):
            raise ExportError("--allow-lossy", "only valid with --dtype q8 or q4")
        if args.preset is not None or args.random:
            from .presets import PRESETS as REAL, write_random_checkpoint

            if args.preset is None or not args.random:
                raise ExportError("--preset", "--preset and --random go together (random weights at real dimensions)")
            if args.preset not in REAL:
                raise ExportError(args.preset, f"unknown preset (choose from {', '.join(REAL)})")
            if args.keep_checkpoint:
                raise ExportError("--keep-checkpoint", "only valid with --tiny")
            if args.out is None:
                args.out = Path("build/bundles") / f"{args.preset}-{args.dtype}"
            tmpdir = tempfile.mkdtemp(prefix=f"herald-preset-{os.getpid()}-")
            ckpt = Path(tmpdir) / args.preset
            write_random_checkpoint(args.preset, args.seed, ckpt)
        elif args.out is None:
            raise ExportError("--out", "missing: the bundle directory to write")
        elif args.tiny is not None:
            if args.tiny not in PRESETS:
                raise ExportError(args.tiny, f"unknown tiny preset (choose from {', '.join(PRESETS)})")
            if args.keep_checkpoint:
                ckpt = args.keep_checkpoint
                if ckpt.exists():
                    shutil.rmtree(ckpt)
            else:
                tmpdir = tempfile.mkdtemp(prefix=f"herald-tiny-{os.getpid()}-")
                ckpt = Path(tmpdir) / args.tiny
            write_tiny_checkpoint(args.tiny, args.seed, ckpt)
        else:
            if args.keep_checkpoint:
                raise ExportError("--keep-checkpoint", "only valid with --tiny")
            ckpt = args.checkpoint
        export(ckpt, args.out, args.dtype, quiet=args.quiet, allow_lossy=args.allow_lossy)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        # outside the bundle write (which names the file itself): the generated checkpoint
        where = e.filename or tmpdir or args.keep_checkpoint
        what = "disk quota exceeded" if e.errno == getattr(errno, "EDQUOT", None) else "no space left on device"
        print(f"error: {where}: {what} writing the generated checkpoint", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


def _qnn(args) -> int:
    from .qnn import export_qnn, parse_frames, parse_slots

    try:
        frames = parse_frames(args.vocoder_frames) if args.vocoder else None
        export_qnn(args.bundle, args.arch, soc=args.soc, talker_slots=parse_slots(args.talker_slots),
                   quiet=args.quiet, allow_lossy=args.allow_lossy, vocoder_frames=frames)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; the bundle at {args.bundle} is unchanged", file=sys.stderr)
        return 130
    return 0


def _pack(args) -> int:
    from .pack import pack

    try:
        idx = pack(args.bundle, args.out)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # a failed write of the archive (disk full, permissions): --out is as it was
        print(f"error: {args.out}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    if not args.quiet:
        print(f"packed {idx['name']}: {len(idx['files'])} files, {idx['bytes']} bytes, "
              f"fingerprint {idx['fingerprint'][:16]} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


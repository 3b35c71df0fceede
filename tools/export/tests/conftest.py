"""Shared fixtures: the tiny bundles, exported once per test session through the real CLI path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herald_export.bundle import export  # noqa: E402
from herald_export.tiny import write_tiny_checkpoint  # noqa: E402

PRESETS = ["tiny-0.6b", "tiny-1.7b", "tiny-hybrid"]
SEED = 7


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


_built: dict[tuple[str, str], tuple[Path, Path]] = {}


def build_tiny(root: Path, preset: str, dtype: str = "fp32") -> tuple[Path, Path]:
    """(bundle dir, checkpoint dir) of a tiny preset, exported once per session."""
    key = (preset, dtype)
    if key not in _built:
        ckpt = root / f"{preset}.ckpt"
        if not (ckpt / "config.json").exists():
            write_tiny_checkpoint(preset, SEED, ckpt)
        out = root / f"{preset}.{dtype}"
        export(ckpt, out, dtype, quiet=True)
        _built[key] = (out, ckpt)
    return _built[key]


@pytest.fixture(scope="session", params=PRESETS)
def tiny(request, tiny_root) -> tuple[str, Path, Path]:
    """Each preset in turn: (preset, bundle dir, checkpoint dir), fp32."""
    bundle, ckpt = build_tiny(tiny_root, request.param)
    return request.param, bundle, ckpt


@pytest.fixture(scope="session")
def tiny_factory(tiny_root):
    """Call with (preset, dtype) to get (bundle dir, checkpoint dir)."""
    return lambda preset, dtype="fp32": build_tiny(tiny_root, preset, dtype)

"""Faults that lose nothing (issue 17): the bundle write against SIGKILL, a full disk, power cuts.

- SIGKILL: ``tools/export/export`` is killed with SIGKILL at 8 points spread over one full run
  (5 % .. 95 % of its measured duration, fixed seed), with no bundle at ``--out`` and over a
  previous one. After each kill ``--out`` is absent or byte for byte the previous bundle, or the
  complete new one; the next export removes what the killed ones left.
- Full disk: the export runs into a small tmpfs (a private user+mount namespace, ``unshare
  -rm``) sized to fill up inside each of the bundle's files in turn: one ``error:`` line naming
  "no space left on device" and the file, exit 2, and the tmpfs holds exactly what it held
  before (a marker file, or a previous bundle left unchanged).
- Power cut: every bundle file and the temporary directory are fsynced before the swap, the
  parent directory after it (checked by watching ``os.fsync``), and an existing bundle is
  swapped in one ``renameat2(RENAME_EXCHANGE)``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from herald_export import bundle as bundle_mod
from herald_export import durable
from herald_export.__main__ import main

EXPORT_DIR = Path(__file__).resolve().parents[1]
EXPORT = EXPORT_DIR / "export"
KILL_SEED = 17
KILL_POINTS = 8
#: Above the kernel's PID_MAX_LIMIT (2^22): never a live process.
DEAD_PID = 2**22 + 1
#: The bundle's files in the order export() writes them.
WRITE_ORDER = ["talker.onnx", "code_predictor.onnx", "vocoder.onnx", "vocoder_stream.onnx",
               "tables.safetensors", "tokenizer.json", "bundle.toml"]
PAGE = 4096


def file_digest(p: Path) -> bytes:
    """sha256 of a file's bytes; of a ``.safetensors`` file's tensors and metadata instead: the
    safetensors library writes the metadata map in a random order (a Rust HashMap), so the
    same tables differ between runs in the order of two header keys."""
    if p.suffix != ".safetensors":
        return hashlib.sha256(p.read_bytes()).digest()
    h = hashlib.sha256()
    with safe_open(str(p), "numpy") as f:
        h.update(repr(sorted((f.metadata() or {}).items())).encode())
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            h.update(f"{k} {t.dtype} {t.shape}".encode())
            h.update(t.tobytes())
    return h.digest()


def tree_hash(d: Path) -> str | None:
    """sha256 over every file's relative path and content; None when ``d`` does not exist."""
    if not os.path.lexists(d):
        return None
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        h.update(str(p.relative_to(d)).encode() + b"\0")
        if p.is_file():
            h.update(file_digest(p))
    return h.hexdigest()


def tree_diff(a: Path, b: Path) -> str:
    """Which files of two directories differ (for failure messages)."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}) if a.is_dir() and b.is_dir() else []
    diff = [n for n in names if not ((a / n).is_file() and (b / n).is_file() and file_digest(a / n) == file_digest(b / n))]
    return ", ".join(diff) or "(none)"


def assert_complete(bundle: Path) -> None:
    """The manifest is there, names exactly the files present, and each has the sha256 it records."""
    m = tomllib.loads((bundle / "bundle.toml").read_text())
    named = {g["file"] for g in m["graphs"].values()} | {m["tables"]["file"], m["tokenizer"]["file"], "bundle.toml"}
    assert sorted(p.name for p in bundle.iterdir()) == sorted(named), f"{bundle}: files differ from the manifest"
    for entry in [*m["graphs"].values(), m["tokenizer"]]:
        got = hashlib.sha256((bundle / entry["file"]).read_bytes()).hexdigest()
        assert got == entry["sha256"], f"{bundle / entry['file']}: sha256 differs from bundle.toml"
    tables = load_file(str(bundle / m["tables"]["file"]))   # the one file without a recorded hash
    for key in ("text_embedding", "codec_embedding", "cp_embedding"):
        assert list(tables[key].shape) == m["tables"][key]["shape"]


def export_cmd(ckpt: Path, out: Path) -> list[str]:
    return [str(EXPORT), "export", "--checkpoint", str(ckpt), "--out", str(out), "--quiet"]


@pytest.fixture(scope="module")
def bundles(tiny_factory):
    """(new bundle, its checkpoint, a different previous bundle): tiny-0.6b fp32, and fp16."""
    new, ckpt = tiny_factory("tiny-0.6b")
    previous, _ = tiny_factory("tiny-0.6b", "fp16")
    assert tree_hash(new) != tree_hash(previous)
    return new, ckpt, previous


# --------------------------------------------------------------------------- SIGKILL
@pytest.fixture(scope="module")
def full_run(bundles, tmp_path_factory) -> float:
    """Seconds one complete export takes (the kills are spread over it); its bundle is the new one."""
    new, ckpt, _ = bundles
    out = tmp_path_factory.mktemp("timing") / "bundle"
    t0 = time.monotonic()
    r = subprocess.run(export_cmd(ckpt, out), capture_output=True, text=True)
    full = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert tree_hash(out) == tree_hash(new), f"the export is not deterministic: {tree_diff(out, new)}"
    return full


def _kill_when_swapped(p: subprocess.Popen, out: Path, before: int | None, limit: float) -> None:
    """SIGKILL ``p`` as soon as ``out`` is a different directory than ``before`` (its inode)."""
    t_end = time.monotonic() + limit
    while time.monotonic() < t_end and p.poll() is None:
        try:
            if os.stat(out).st_ino != before:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    p.kill()


@pytest.mark.parametrize("with_previous", [False, True], ids=["no-previous", "previous-bundle"])
def test_sigkill_at_any_point_loses_nothing(bundles, full_run, tmp_path, with_previous):
    """8 kills at seeded random points over 5 % .. 95 % of a run, and one right after the swap."""
    new, ckpt, previous = bundles
    new_hash, prev_hash = tree_hash(new), tree_hash(previous)
    t_start = time.monotonic()
    parent = tmp_path / "k"
    parent.mkdir()
    out = parent / "bundle"
    rng = random.Random(KILL_SEED + with_previous)
    # one point in each of 8 equal slices of 5 % .. 95 % of the run; then "as soon as `out` changes"
    delays = [full_run * (0.05 + 0.90 * (i + rng.random()) / KILL_POINTS) for i in range(KILL_POINTS)] + [None]
    outcomes = []
    for delay in delays:
        if with_previous and tree_hash(out) != prev_hash:
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(previous, out)
        elif not with_previous and out.exists():
            shutil.rmtree(out)              # a kill after the swap left the new bundle
        before = os.stat(out).st_ino if with_previous else None
        p = subprocess.Popen(export_cmd(ckpt, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if delay is None:
            _kill_when_swapped(p, out, before, 10 * full_run)
        else:
            time.sleep(delay)
            p.kill()                        # SIGKILL (a no-op on a process that has already exited)
        p.wait()
        got = tree_hash(out)
        if got == new_hash:
            assert_complete(out)
            outcome = "new"
        elif with_previous:
            assert got == prev_hash, (f"killed at {delay}: {out} is neither the previous bundle nor the new one "
                                      f"(differs from the previous in {tree_diff(out, previous)}, from the new in {tree_diff(out, new)})")
            outcome = "previous"
        else:
            assert got is None, f"killed at {delay}: {out} exists but is not the complete new bundle (differs in {tree_diff(out, new)})"
            outcome = "absent"
        # besides `out`, only temporary directories of killed exports may be there
        left = sorted(q.name for q in parent.iterdir() if q.name != out.name)
        for name in left:
            assert re.fullmatch(r"\.bundle\.(partial|old)-[0-9]+", name), f"unexpected {name}"
        mine = [n for n in left if n.endswith(f"-{p.pid}")]
        outcomes.append(("after the swap" if delay is None else f"{delay:.2f} s", outcome, mine, p.returncode))
    print(f"\n[{'previous bundle' if with_previous else 'no previous'}] full run {full_run:.2f} s; kills: "
          + ", ".join(f"{d} -> {o}{' +' + ','.join(m) if m else ''}{'' if rc == -9 else f' (exited {rc})'}"
                      for d, o, m, rc in outcomes))
    assert any(m for _, _, m, _ in outcomes[:-1]), "no kill landed while the bundle was being written"
    # (the process is normally still running then, removing the previous bundle: returncode -9)
    assert outcomes[-1][1] == "new", f"the kill after the swap: {outcomes[-1]}"

    # the next export runs to completion and removes every leftover of the killed ones
    r = subprocess.run(export_cmd(ckpt, out), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(q.name for q in parent.iterdir()) == ["bundle"], "leftovers of killed exports remain"
    assert tree_hash(out) == new_hash
    assert_complete(out)
    print(f"  test took {time.monotonic() - t_start:.1f} s")


# --------------------------------------------------------------------------- full disk
def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _listing(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.strip())


#: (file the disk fills up in, over a previous bundle?): one file per writer (onnx.save_model,
#: the safetensors library, the tokenizer's write, the manifest's), both starting states.
FULL_DISK_CASES = [("talker.onnx", False), ("tables.safetensors", True), ("tokenizer.json", False),
                   ("bundle.toml", True)]


@pytest.mark.parametrize("name,with_previous", FULL_DISK_CASES, ids=[n for n, _ in FULL_DISK_CASES])
def test_full_disk_is_one_line_and_leaves_nothing(bundles, tmp_path, name, with_previous):
    """A tmpfs sized to fill up half-way into ``name``, holding a marker file or a previous bundle."""
    new, ckpt, previous = bundles
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is not installed: the full-disk test needs it to mount a small "
                    "tmpfs in a private user+mount namespace (`unshare -rm`)")
    site = WRITE_ORDER.index(name)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = mnt / "bundle"
    # what the tmpfs holds before: a previous bundle, or one small file
    if with_previous:
        seed = f"cp -a {shlex.quote(str(previous))} {shlex.quote(str(out))}"
        before_bytes = sum(_pages(p.stat().st_size) for p in previous.iterdir())
    else:
        seed = f"echo keep > {shlex.quote(str(mnt / 'keep'))}"
        before_bytes = PAGE
    written = sum(_pages((new / f).stat().st_size) for f in WRITE_ORDER[:site])
    slack = max(_pages((new / WRITE_ORDER[site]).stat().st_size) // 2 // PAGE * PAGE, PAGE)
    size = before_bytes + written + slack
    assert size < before_bytes + sum(_pages(p.stat().st_size) for p in new.iterdir())
    listing = f"(cd {shlex.quote(str(mnt))} && find . -printf '%y %p\\n' && find . -type f -exec sha256sum {{}} +)"
    err_file = tmp_path / "stderr"
    script = "\n".join([
        "set -e",
        f"mount -t tmpfs -o size={size // 1024}k tmpfs {shlex.quote(str(mnt))}",
        "echo MOUNTED",
        seed,
        "echo BEFORE", listing,
        "set +e",
        " ".join(shlex.quote(a) for a in export_cmd(ckpt, out)) + f" 2>{shlex.quote(str(err_file))}",
        'echo "RC $?"',
        "echo AFTER", listing,
    ])
    t0 = time.monotonic()
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True)
    dt = time.monotonic() - t0
    if "MOUNTED" not in r.stdout:
        pytest.fail(f"cannot mount a tmpfs in a private user+mount namespace (`unshare -rm`), which the "
                    f"full-disk test needs: rc {r.returncode}: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    before = _listing(r.stdout.split("BEFORE", 1)[1].split("RC ", 1)[0])
    rc = int(re.search(r"^RC (\d+)$", r.stdout, re.M).group(1))
    after = _listing(r.stdout.split("AFTER", 1)[1])
    stderr = err_file.read_text()
    lines = [line for line in stderr.splitlines() if line.strip()]
    print(f"\n[full disk in {WRITE_ORDER[site]}, tmpfs {size // 1024} KiB, "
          f"{'previous bundle' if with_previous else 'marker file'}] {dt:.1f} s: {lines[-1] if lines else '(no stderr)'}")

    assert rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    line = lines[-1]
    assert line.startswith("error: ") and "no space left on device" in line, line
    assert re.search(re.escape(str(mnt)) + r"/\.bundle\.partial-[0-9]+/" + re.escape(WRITE_ORDER[site]) + ":", line), line
    assert re.search(r"needs about \d+ MB", line), line
    assert (f"the bundle at {out} is unchanged" if with_previous else f"nothing was written to {out}") in line, line
    assert after == before, "the tmpfs does not hold exactly what it held before the export"


# --------------------------------------------------------------------------- other write errors, in process
def _fail_with(monkeypatch, target: str, exc: BaseException):
    def boom(*a, **k):
        raise exc
    if target == "onnx":
        monkeypatch.setattr(bundle_mod.onnx, "save_model", boom)
    elif target == "safetensors":
        import safetensors.numpy
        monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    elif target == "manifest":
        monkeypatch.setattr(bundle_mod.tomli_w, "dump", boom)


@pytest.mark.parametrize("target,exc,message", [
    ("safetensors", SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"),
     "tables.safetensors: disk quota exceeded (the export needs about"),
    ("onnx", OSError(errno.EIO, "Input/output error"), "talker.onnx: cannot write: Input/output error"),
    ("manifest", OSError(errno.ENOSPC, "No space left on device"), "bundle.toml: no space left on device"),
])
def test_write_errors_are_one_line(bundles, tmp_path, monkeypatch, capsys, target, exc, message):
    new, ckpt, previous = bundles
    out = tmp_path / "bundle"
    shutil.copytree(previous, out)
    before = tree_hash(out)
    _fail_with(monkeypatch, target, exc)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert lines[0].endswith(f"the bundle at {out} is unchanged"), lines[0]
    assert tree_hash(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# --------------------------------------------------------------------------- power cut: fsync and the swap
def test_export_fsyncs_every_file_and_swaps_atomically(bundles, tmp_path, monkeypatch):
    new, ckpt, previous = bundles
    out = tmp_path / "bundle"
    shutil.copytree(previous, out)
    events = []
    real_fsync, real_exchange = os.fsync, durable.exchange

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def exchange(a, b):
        ok = real_exchange(a, b)
        events.append(("exchange", str(a), str(b), ok))
        return ok

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable, "exchange", exchange)
    bundle_mod.export(ckpt, out, "fp32", quiet=True)
    assert tree_hash(out) == tree_hash(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]

    swaps = [i for i, e in enumerate(events) if e[0] == "exchange"]
    assert len(swaps) == 1, events
    i = swaps[0]
    tmp = str(durable.partial_name(out))
    assert events[i] == ("exchange", tmp, str(out), True), \
        f"renameat2(RENAME_EXCHANGE) unsupported on {tmp_path}'s file system: {events[i]}"
    synced_before = {e[1] for e in events[:i] if e[0] == "fsync"}
    for f in out.iterdir():
        assert f"{tmp}/{f.name}" in synced_before, f"{f.name} was not fsynced before the swap"
    assert tmp in synced_before, "the temporary directory was not fsynced before the swap"
    assert ("fsync", str(tmp_path)) in events[i + 1:], "the parent directory was not fsynced after the swap"


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    assert durable.exchange(a, b), f"renameat2(RENAME_EXCHANGE) unsupported on {tmp_path}'s file system"
    assert [p.name for p in a.iterdir()] == ["y"] and [p.name for p in b.iterdir()] == ["x"]
    with pytest.raises(FileNotFoundError):
        durable.exchange(a, tmp_path / "missing")


def test_fallback_swap_replaces_the_bundle(bundles, tmp_path, monkeypatch):
    """Where RENAME_EXCHANGE is unsupported: two renames, the same result, nothing left over."""
    new, ckpt, previous = bundles
    out = tmp_path / "bundle"
    shutil.copytree(previous, out)
    monkeypatch.setattr(durable, "exchange", lambda a, b: False)
    bundle_mod.export(ckpt, out, "fp32", quiet=True)
    assert tree_hash(out) == tree_hash(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# --------------------------------------------------------------------------- stale temporary directories
def _mk(path: Path, marker: str = "x") -> Path:
    path.mkdir()
    (path / "f").write_text(marker)
    return path


def test_remove_stale_touches_only_dead_exports_of_the_same_name(tmp_path):
    out = _mk(tmp_path / "b", "current")
    live = os.getppid()
    assert durable.pid_alive(live) and not durable.pid_alive(DEAD_PID)
    dead = [_mk(tmp_path / f".b.partial-{DEAD_PID}"), _mk(tmp_path / f".b.old-{DEAD_PID}")]
    kept = [_mk(tmp_path / f".b.partial-{live}"), _mk(tmp_path / f".b.old-{live}"),
            _mk(tmp_path / f".c.partial-{DEAD_PID}"), _mk(tmp_path / ".b.partial-x1"),
            _mk(tmp_path / f"b.partial-{DEAD_PID}"), _mk(tmp_path / f".b.partial-{DEAD_PID}.tmp")]
    (tmp_path / f".b.old-{DEAD_PID + 1}").write_text("a file, not ours")
    kept.append(tmp_path / f".b.old-{DEAD_PID + 1}")
    assert sorted(durable.remove_stale(out)) == sorted(dead)
    assert not any(p.exists() for p in dead)
    assert all(p.exists() for p in kept)
    assert (out / "f").read_text() == "current"


def test_remove_stale_restores_a_bundle_parked_by_the_fallback_swap(tmp_path):
    """Killed between the fallback's two renames: `out` is missing, `.old-<pid>` is the previous bundle."""
    out = tmp_path / "b"
    _mk(tmp_path / f".b.old-{DEAD_PID}", "previous")
    _mk(tmp_path / f".b.partial-{DEAD_PID}", "new, complete or not")
    durable.remove_stale(out)
    assert (out / "f").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_remove_stale_tempdirs(tmp_path):
    live = os.getppid()
    dead = [_mk(tmp_path / f"herald-tiny-{DEAD_PID}-ab_12"), _mk(tmp_path / f"herald-preset-{DEAD_PID}-zz")]
    kept = [_mk(tmp_path / f"herald-tiny-{live}-ab_12"), _mk(tmp_path / "herald-tiny-abcd1234"),
            _mk(tmp_path / f"other-{DEAD_PID}-ab")]
    assert sorted(durable.remove_stale_tempdirs(("herald-tiny-", "herald-preset-"), tmp_path)) == sorted(dead)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in dead)

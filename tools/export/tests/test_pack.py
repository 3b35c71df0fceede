"""``export pack``: the bundle archive for ``herald bundle install`` (issue 41, docs/bundle.md
"Bundle archives"), through the real command line.

Checked against what does not come from the packer: GNU tar (lists and extracts the archive;
the extraction equals the bundle file for file), hashlib over the extracted files, the
``sha256`` entries the exporter wrote into bundle.toml at export time, and the fingerprint's
formula computed here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

EXPORT = Path(__file__).resolve().parents[1] / "export"


def pack(bundle: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXPORT), "pack", "--bundle", str(bundle), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def bundle(tiny_factory) -> Path:
    return tiny_factory("tiny-0.6b")[0]


def test_the_index_comes_first_and_every_file_follows_with_its_size_and_hash(bundle, tmp_path):
    out = tmp_path / "tiny.tar"
    r = pack(bundle, out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"packed {bundle.name}: 7 files, ")
    names = subprocess.run(["tar", "tf", str(out)], capture_output=True, text=True, check=True).stdout.split()
    assert names[0] == "herald-bundle.json"
    want = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert names[1:] == want
    x = tmp_path / "x"
    x.mkdir()
    subprocess.run(["tar", "xf", str(out), "-C", str(x)], check=True)
    idx = json.loads((x / "herald-bundle.json").read_text())
    assert (idx["archive_version"], idx["name"], idx["format_version"], idx["herald"]) == (1, bundle.name, 1, {"min": "0.1.0"})
    assert idx["model"]["type"] == "custom_voice" and idx["model"]["weights"] == "fp32"
    assert [f["path"] for f in idx["files"]] == want
    for f in idx["files"]:
        data = (x / f["path"]).read_bytes()
        assert data == (bundle / f["path"]).read_bytes(), f["path"]
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size"], f["sha256"]), f["path"]
    assert idx["bytes"] == sum(f["size"] for f in idx["files"])
    # the hashes the exporter recorded in bundle.toml when it wrote the files
    manifest = tomllib.loads((bundle / "bundle.toml").read_text())
    by_path = {f["path"]: f["sha256"] for f in idx["files"]}
    assert by_path["tokenizer.json"] == manifest["tokenizer"]["sha256"]
    for name, g in manifest["graphs"].items():
        assert by_path[g["file"]] == g["sha256"], name
    # the fingerprint's formula: PATH NUL SIZE NUL SHA256 LF per file, in order
    h = hashlib.sha256()
    for f in idx["files"]:
        h.update(f"{f['path']}\0{f['size']}\0{f['sha256']}\n".encode())
    assert idx["fingerprint"] == h.hexdigest()
    # members: regular files, owner 0/0, mode 0644, time 0 (the same bundle, the same bytes)
    listing = subprocess.run(["tar", "tvf", str(out), "--numeric-owner", "--full-time"], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    assert all(line.startswith("-rw-r--r-- 0/0 ") and " 1970-01-01 00:00:00 " in line for line in listing), listing


def test_packing_twice_gives_the_same_bytes_and_replaces_the_archive(bundle, tmp_path):
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    assert pack(bundle, a).returncode == 0
    b.write_bytes(b"an older archive")
    # what a killed pack left (a pid no process has) is cleared by the next
    (tmp_path / ".b.tar.partial-999999999").write_bytes(b"half an archive")
    assert pack(bundle, b).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "b.tar"], "a temporary file was left"


def test_what_cannot_be_packed_is_refused_naming_it_and_leaves_the_archive_as_it_was(bundle, tmp_path):
    out = tmp_path / "out.tar"
    out.write_bytes(b"the previous archive")

    def refused(b: Path, words: str, target: Path = out) -> None:
        r = pack(b, target)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.startswith("error: ") and words in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert out.read_bytes() == b"the previous archive"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    refused(tmp_path / "nowhere", "not a bundle directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, "bundle.toml: missing: not a herald bundle")
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / "link.onnx").symlink_to(copy / "talker.onnx")
    refused(copy, "link.onnx: is a symbolic link")
    (copy / "link.onnx").unlink()
    os.mkfifo(copy / "pipe")
    refused(copy, "pipe: is not a regular file")
    (copy / "pipe").unlink()
    refused(copy, "is inside the bundle being packed", copy / "self.tar")
    text = (copy / "bundle.toml").read_text()
    (copy / "bundle.toml").write_text(text.replace("format_version = 1", "format_version = 9", 1))
    refused(copy, "format_version 9 is not one this exporter knows")
    (copy / "bundle.toml").write_text("format_version = [")
    refused(copy, "bundle.toml: cannot read")
    # a subfolder's files are packed with their relative path
    (copy / "bundle.toml").write_text(text)
    (copy / "qnn").mkdir()
    (copy / "qnn" / "talker.bin").write_bytes(b"\x01" * 1000)
    r = pack(copy, tmp_path / "sub.tar")
    assert r.returncode == 0, r.stderr
    names = subprocess.run(["tar", "tf", str(tmp_path / "sub.tar")], capture_output=True, text=True, check=True).stdout.split()
    assert "qnn/talker.bin" in names and "qnn" not in names and "qnn/" not in names


def test_hidden_files_are_left_out_and_names_install_would_refuse_are_refused(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / ".DS_Store").write_bytes(b"x")
    (copy / ".bundle.toml.partial-1").write_bytes(b"y")
    r = pack(copy, tmp_path / "c.tar")
    assert r.returncode == 0, r.stderr
    names = subprocess.run(["tar", "tf", str(tmp_path / "c.tar")], capture_output=True, text=True, check=True).stdout.split()
    assert not [n for n in names if n.startswith(".")], names
    spaced = tmp_path / "my bundle"
    shutil.copytree(bundle, spaced)
    r = pack(spaced, tmp_path / "s.tar")
    assert r.returncode == 2 and "is not a name herald bundle install takes" in r.stderr, r.stderr
    (copy / "herald-bundle.json").write_text("{}")
    r = pack(copy, tmp_path / "i.tar")
    assert r.returncode == 2 and "is named like the archive's index" in r.stderr, r.stderr


def test_a_file_changed_between_hashing_and_copying_is_refused(bundle, tmp_path, monkeypatch):
    # in-process: the index is taken, then a file changes at the same size before it is copied
    from herald_export import pack as packmod
    from herald_export.errors import ExportError

    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    real_index = packmod.index

    def index_then_change(b):
        idx = real_index(b)
        p = copy / "talker.onnx"
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.write_bytes(bytes(data))
        return idx

    monkeypatch.setattr(packmod, "index", index_then_change)
    out = tmp_path / "out.tar"
    with pytest.raises(ExportError, match="talker.onnx: changed while it was packed"):
        packmod.pack(copy, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["copy"]

"""``export pack``: a bundle directory -> one archive that ``herald bundle install`` takes
(issue 41; the format is docs/bundle.md, "Bundle archives").

The archive is an uncompressed POSIX ustar file (the weights are float or already-quantized
numbers that do not compress much, and an uncompressed archive can be resumed and read from any
offset). Its first member is the index, ``herald-bundle.json``, so that an installer reads it
with one small ranged request and refuses a bundle it cannot load before downloading the rest;
then every regular file of the bundle, sorted by path, each once (hidden names, ``.*``, are not
bundle files and are left out).

The index (JSON, UTF-8):

- ``archive_version``: 1 (this layout);
- ``name``: the bundle's directory name (what ``herald bundle install`` names it);
- ``format_version``: bundle.toml's (the runtime refuses other versions);
- ``herald``: ``{"min": "X.Y.Z"}``, the first herald version that loads that ``format_version``
  (:data:`FIRST_HERALD`);
- ``model``: bundle.toml's ``[model]`` table (type, size, dtype, weights, source), for listings;
- ``files``: ``[{"path", "size", "sha256"}]`` in archive order, paths relative with ``/``;
- ``bytes``: the files' sizes summed;
- ``fingerprint``: the SHA-256 (hex) of the lines ``PATH NUL SIZE NUL SHA256 LF`` of ``files``
  in order: the same bundle content gives the same fingerprint, whatever the archive's name.

The archive is deterministic: members carry mtime 0, uid and gid 0, no user or group names, mode
0644, so packing the same bundle twice gives the same bytes. It is written next to ``--out`` and
renamed into place once complete and synced; a failure leaves ``--out`` as it was.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import tomllib
from pathlib import Path

from . import durable
from .errors import ExportError

#: This layout of the archive.
ARCHIVE_VERSION = 1
#: The index's member name, always first.
INDEX_NAME = "herald-bundle.json"
#: The largest index an installer must accept, bytes: a bundle's index is a few KiB; the cap
#: bounds the first ranged read (512-byte tar header + index).
INDEX_MAX = 1 << 20
#: The first herald version that loads each bundle ``format_version`` (Cargo.toml's version when
#: the format was introduced).
FIRST_HERALD = {1: "0.1.0"}

#: The bundle names ``herald bundle install`` takes (app/src/bundles.rs ``check_name``).
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


class _Hashing(io.RawIOBase):
    """Reads a file and hashes what was read (the copy is checked against the index)."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        if n:
            self.h.update(memoryview(b)[:n])
        return n


def _walk_error(e: OSError) -> None:
    raise ExportError(e.filename or "?", f"cannot read: {e.strerror or e}")


def bundle_files(bundle: Path) -> list[Path]:
    """The bundle's regular files, relative, sorted by their ``/`` path; hidden names (``.*``:
    an interrupted export's leftovers, a desktop's metadata) are not bundle files and are left out.

    Raises :class:`ExportError` for a symlink, a device, a FIFO or a socket inside the bundle
    (an archive carries only regular files), for an unreadable folder, and for a path that
    ``herald bundle install`` would refuse (not UTF-8, a backslash, a NUL or a newline, over 255
    bytes, or ``herald-bundle.json`` at the top).
    """
    out = []
    for dirpath, dirnames, filenames in os.walk(bundle, followlinks=False, onerror=_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(dirnames + [f for f in filenames if not f.startswith(".")]):
            p = Path(dirpath) / name
            rel = p.relative_to(bundle)
            if p.is_symlink():
                raise ExportError(p, "is a symbolic link; a bundle archive carries regular files only")
            if name in dirnames:
                continue
            if not p.is_file():
                raise ExportError(p, "is not a regular file; a bundle archive carries regular files only")
            s = rel.as_posix()
            try:
                raw = s.encode("utf-8")
            except UnicodeEncodeError:
                raise ExportError(p, "has a name that is not UTF-8") from None
            if any(c in s for c in "\n\0\\"):
                raise ExportError(p, "has a newline, NUL or backslash in its name")
            if len(raw) > 255:
                raise ExportError(p, "has a path over 255 bytes")
            if s == INDEX_NAME:
                raise ExportError(p, f"is named like the archive's index ({INDEX_NAME})")
            out.append(rel)
    return sorted(out, key=lambda r: r.as_posix())


def fingerprint(files: list[dict]) -> str:
    """SHA-256 hex of ``PATH NUL SIZE NUL SHA256 LF`` per file, in the given order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f['path']}\0{f['size']}\0{f['sha256']}\n".encode("utf-8"))
    return h.hexdigest()


def index(bundle: Path) -> dict:
    """The index of ``bundle`` (see the module's doc): reads bundle.toml and hashes every file.

    Raises :class:`ExportError` when the directory or its bundle.toml is missing or unreadable,
    when bundle.toml has no integer ``format_version`` or one this exporter does not know.
    """
    if not bundle.is_dir():
        raise ExportError(bundle, "not a bundle directory (it does not exist or is not a directory)")
    manifest_path = bundle / "bundle.toml"
    try:
        manifest = tomllib.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(manifest_path, "missing: not a herald bundle") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ExportError(manifest_path, f"cannot read: {e}") from None
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ExportError(manifest_path, "has no integer format_version")
    if version not in FIRST_HERALD:
        raise ExportError(manifest_path, f"format_version {version} is not one this exporter knows "
                          f"({', '.join(map(str, FIRST_HERALD))})")
    files = []
    for rel in bundle_files(bundle):
        p = bundle / rel
        files.append({"path": rel.as_posix(), "size": p.stat().st_size, "sha256": durable.sha256_file(p)})
    model = manifest.get("model", {})
    name = bundle.resolve().name
    if not NAME_RE.fullmatch(name):
        raise ExportError(bundle, "is not a name herald bundle install takes: 1 to 100 ASCII letters, digits, "
                          "'.', '_' or '-', not starting with '.' (rename the folder)")
    return {
        "archive_version": ARCHIVE_VERSION,
        "name": name,
        "format_version": version,
        "herald": {"min": FIRST_HERALD[version]},
        "model": {k: str(model[k]) for k in ("family", "type", "size", "dtype", "weights", "source") if k in model},
        "files": files,
        "bytes": sum(f["size"] for f in files),
        "fingerprint": fingerprint(files),
    }


def _member(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def pack(bundle: Path, out: Path) -> dict:
    """Write ``bundle`` as an archive at ``out`` (atomically); return its index.

    Raises :class:`ExportError` for a bad bundle (:func:`index`, :func:`bundle_files`), a file
    that changed while it was packed, or ``out`` inside the bundle; OSError for a failed write
    (``out`` is then as it was).
    """
    out = Path(out)
    if out.resolve().is_relative_to(bundle.resolve()):
        raise ExportError(out, "is inside the bundle being packed")
    idx = index(bundle)
    body = json.dumps(idx, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    if len(body) > INDEX_MAX:
        raise ExportError(bundle, f"its index is {len(body)} bytes, over the {INDEX_MAX}-byte limit installers read")
    out.parent.mkdir(parents=True, exist_ok=True)
    durable.remove_stale(out)
    tmp = durable.partial_name(out)
    try:
        with open(tmp, "wb") as raw:
            # ustar: names up to 100 (+155 prefix) bytes, sizes up to 8 GiB, no pax records
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                tar.addfile(_member(INDEX_NAME, len(body)), io.BytesIO(body))
                for f in idx["files"]:
                    p = bundle / f["path"]
                    try:
                        with open(p, "rb") as raw_src:
                            src = _Hashing(raw_src)
                            tar.addfile(_member(f["path"], f["size"]), src)
                    except OSError as e:
                        if e.errno is not None:
                            raise
                        # tarfile's "unexpected end of data": the file shrank
                        raise ExportError(p, "changed while it was packed") from None
                    # what went into the archive is what the index says
                    if src.h.hexdigest() != f["sha256"] or p.stat().st_size != f["size"]:
                        raise ExportError(p, "changed while it was packed")
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
        durable.fsync_dir(out.parent)
    except ValueError as e:
        # tarfile: a name too long for ustar
        raise ExportError(bundle, f"cannot be packed: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return idx

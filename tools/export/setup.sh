#!/usr/bin/env bash
# Creates (or repairs) the project's Python venv at <repo>/.venv with the pinned host tools.
# Safe to run twice: pip only installs what is missing; a half-made venv is rebuilt.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
  echo "error: $py is missing or older than Python 3.11" >&2; exit 2
fi
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
# A venv whose python cannot run pip is broken (e.g. created before python3-venv was installed).
if [ -d "$root/.venv" ] && ! "$root/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "repairing the half-made venv at $root/.venv" >&2
  rm -rf "$root/.venv"
fi
if [ ! -x "$root/.venv/bin/python" ]; then
  if ! "$py" -m venv "$root/.venv" 2>/dev/null; then
    rm -rf "$root/.venv"
    echo "python3 -m venv failed; installing python3-venv" >&2
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
    "$py" -m venv "$root/.venv"
  fi
fi
"$root/.venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"
# The QNN exporter's onnxruntime-qnn wheel exists for Linux x86_64 with glibc >= 2.35 only
# (manylinux_2_35); elsewhere the rest of the exporter works, `export qnn` says what is missing
# and tools/export/tests/test_qnn.py skips. Never a reason to fail the setup.
qnn_host=$("$root/.venv/bin/python" - <<'PY'
import platform, sys
libc, ver = platform.libc_ver()
try:
    glibc = tuple(int(p) for p in ver.split(".")[:2]) if libc == "glibc" else (0, 0)
except ValueError:
    glibc = (0, 0)
if sys.platform.startswith("linux") and platform.machine() == "x86_64" and glibc >= (2, 35):
    print("ok")
else:
    print(f"{platform.system()} {platform.machine()}, " + (f"glibc {ver}" if libc == "glibc" else "no glibc"))
PY
) || qnn_host="unknown"
if [ "$qnn_host" = ok ]; then
  "$root/.venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-qnn.txt" ||
    echo "note: installing onnxruntime-qnn failed; the QNN exporter and its tests are unavailable until it is (tools/export/requirements-qnn.txt)" >&2
else
  echo "note: the QNN exporter and its tests are unavailable on this host ($qnn_host): onnxruntime-qnn needs Linux x86_64 with glibc >= 2.35" >&2
fi

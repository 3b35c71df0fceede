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

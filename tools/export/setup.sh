#!/usr/bin/env bash
# Creates (or refreshes) the project's Python venv at <repo>/.venv with the pinned host tools.
# Safe to run twice: pip only installs what is missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "error: $py is older than Python 3.11" >&2; exit 2
fi
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv" 2>/dev/null || {
    echo "python3 -m venv failed; installing python3-venv" >&2
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    "$py" -m venv "$root/.venv"
  }
fi
"$root/.venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"

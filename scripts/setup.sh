#!/usr/bin/env bash
# Create .venv (once) and install the project with its test tools into it. Idempotent.
# Progress goes to stderr (scripts/install.sh prints one line per step).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "setup.sh: creating .venv" >&2
    "${PYTHON:-python3}" -m venv .venv
fi
PYTHON=.venv/bin/python EDITABLE=1 scripts/install.sh

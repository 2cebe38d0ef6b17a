#!/usr/bin/env bash
# Create .venv (once) and install the project with its test tools into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
PYTHON=.venv/bin/python EDITABLE=1 scripts/install.sh

#!/usr/bin/env bash
# Install deepinfer-server and its runtime dependencies into the current Python environment.
# Used by the Dockerfile and (through scripts/setup.sh) by CI, so the image's install is tested.
#   PYTHON           interpreter to install into (default python3)
#   TORCH_INDEX_URL  optional package index for torch (e.g. PyTorch's CPU wheel index in Docker)
#   EDITABLE=1       install the project in editable mode with its test tools (development)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# An environment that already has torch (a CUDA machine) keeps it; otherwise the 2.13.0 CPU build.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
if [ "${EDITABLE:-0}" = "1" ]; then
    "$PY" -m pip install --quiet -e ".[test]"
else
    "$PY" -m pip install --quiet .
fi

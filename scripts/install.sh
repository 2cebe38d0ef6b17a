#!/usr/bin/env bash
# Install deepinfer-server and its runtime dependencies into the current Python environment.
# Used by the Dockerfile and (through scripts/setup.sh) by CI, so the image's install is tested.
#   PYTHON           interpreter to install into (default python3)
#   TORCH_INDEX_URL  optional package index for torch (PyTorch's CPU wheel index for a CPU-only
#                    image); without it torch comes from PyPI: on Linux x86_64 the CUDA build,
#                    which also runs on machines without a GPU
#   EDITABLE=1       install the project in editable mode with its test tools (development)
# Progress goes to stderr, one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "install.sh: $*" >&2; }
# An environment that already has torch (a CUDA machine) keeps it.
if "$PY" -c "import torch" 2>/dev/null; then
    step "[1/2] torch: keeping $("$PY" -c "import torch; print(torch.__version__)")"
else
    step "[1/2] torch 2.13.0 from ${TORCH_INDEX_URL:-PyPI} (a large download, minutes)"
    "$PY" -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
# Hugging Face's `kernels` distribution (transformers 5.25 requires it; pyproject.toml pins
# transformers below that) installs a top-level module `kernels` that shadows ours: an
# environment that has it loses it before ours goes in (uninstalling it afterwards would delete
# the files the two share).
if "$PY" -m pip show kernels >/dev/null 2>&1; then
    step "removing Hugging Face's kernels package (it shadows deepinfer's kernels/)"
    "$PY" -m pip uninstall --yes --quiet kernels
fi
if [ "${EDITABLE:-0}" = "1" ]; then
    step "[2/2] deepinfer-server (editable) and its test tools"
    "$PY" -m pip install --quiet -e ".[test]"
else
    step "[2/2] deepinfer-server and its dependencies"
    "$PY" -m pip install --quiet .
fi
step "done: $("$PY" -c "import sys; print(sys.prefix)")"

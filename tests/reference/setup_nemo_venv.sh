#!/usr/bin/env bash
# Create the separate, git-ignored venv `.venv-nemo` for the NeMo AutoModel 0.7.0 reference.
# Run from the repo root:  bash tests/reference/setup_nemo_venv.sh
# Pins torch==2.13.0 (the CPU build on the package index here; never let pip pick another torch)
# and every other package to `nemo-constraints.txt` (what it installs unpinned moves otherwise).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-nemo}
PIN=(-c tests/reference/nemo-constraints.txt)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet "${PIN[@]}" torch==2.13.0
"$VENV/bin/pip" install --quiet "${PIN[@]}" torch==2.13.0 transformers==5.18.0 pillow safetensors numpy tokenizers
"$VENV/bin/pip" install --quiet "${PIN[@]}" --no-deps nemo_automodel==0.7.0
# From outside the repo: transformers probes for Hugging Face's `kernels` package, and the
# repo root on sys.path would give it ours (which needs Triton, absent from this venv).
PY="$(cd "$VENV" && pwd)/bin/python"
(cd / && TORCHDYNAMO_DISABLE=1 "$PY" -c \
  "import nemo_automodel.components.models.deepseek_v41.model as m; print('NeMo V4.1 import OK')")

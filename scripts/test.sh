#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the CPU test suite. Usage: scripts/test.sh [pytest args]
# The default run leaves out the tests marked `slow` (-m "not slow"); a -m of yours replaces it:
# `scripts/test.sh -m slow` runs only those, `scripts/test.sh -m ""` every test (what CI runs,
# in two steps: .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check engine kernels recipe server tests benchmarks loadtest
.venv/bin/ruff format --check engine kernels recipe server tests benchmarks loadtest
exec .venv/bin/pytest -m "not slow" "$@"

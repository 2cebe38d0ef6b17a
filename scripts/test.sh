#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the CPU test suite. Usage: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check engine kernels recipe server tests benchmarks loadtest
.venv/bin/ruff format --check engine kernels recipe server tests benchmarks loadtest
exec .venv/bin/pytest "$@"

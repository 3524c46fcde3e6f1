#!/usr/bin/env bash
# Install jaxrat with its test extras, lint, and run the whole test suite (extra args go to pytest,
# e.g. -m "not slow" for the unit tests only). The real-SLURM tests start a single-node cluster
# from Debian packages when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh "dev,reference"
.venv/bin/ruff check jaxrat tests benchmarks configs scripts
exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"

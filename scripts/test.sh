#!/usr/bin/env bash
# Install jaxrat with its test extras and the CUDA compiler that tests/test_gpu_cost.py compiles for an
# H100 with (scripts/setup_gpu_aot.sh), lint, and run the whole test suite (extra args go to pytest,
# e.g. -m "not slow" for the unit tests only, or -n 0 to run in this process, e.g. with --pdb).
# Two xdist workers, one test file at a time each (module fixtures stay shared within a file), handed
# out longest first (tests/file_costs.py), and one XLA compilation cache for the whole run
# (tests/conftest.py). The real-SLURM tests start a single-node cluster from Debian packages when run
# as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh "dev,reference"
bash scripts/setup_gpu_aot.sh
.venv/bin/ruff check jaxrat tests benchmarks configs scripts
exec .venv/bin/python -m pytest -q -ra --durations=25 -n 2 --dist loadfile "$@"

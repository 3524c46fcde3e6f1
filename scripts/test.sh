#!/usr/bin/env bash
# Install jaxrat with its test extras and the CUDA compiler that tests/integration/test_gpu_cost.py
# compiles for an H100 with (scripts/setup_gpu_aot.sh), lint, and run the tests:
#   bash scripts/test.sh              every tier
#   bash scripts/test.sh unit         tests/unit only: the inner loop (also integration, fault)
#   bash scripts/test.sh unit -k ema  extra args go to pytest (e.g. -n 0 to run in this process, with --pdb)
# Two xdist workers, one test file at a time each (module fixtures stay shared within a file), handed
# out longest first from the last run's times (tests/conftest.py), and one XLA compilation cache for
# the whole run. The run ends with the 15 slowest tests and the seconds per tier. The real-SLURM tests
# start a single-node cluster from Debian packages when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
tiers=()
while [[ $# -gt 0 && "$1" =~ ^(unit|integration|fault)$ ]]; do
  tiers+=("tests/$1")
  shift
done
bash scripts/setup_venv.sh "dev,reference"
bash scripts/setup_gpu_aot.sh
.venv/bin/ruff check jaxrat tests benchmarks configs scripts
exec .venv/bin/python -m pytest -q -ra --durations=15 -n 2 --dist loadfile ${tiers[@]+"${tiers[@]}"} "$@"

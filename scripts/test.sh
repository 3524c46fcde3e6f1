#!/usr/bin/env bash
# Install jaxrat with its test extras and the CUDA compiler that tests/extended/test_gpu_cost.py
# compiles for an H100 with (scripts/setup_gpu_aot.sh), lint, and run the tests:
#   bash scripts/test.sh              tests/unit, tests/integration and tests/fault: what CI runs
#   bash scripts/test.sh unit         tests/unit only: the inner loop (also integration, fault, extended)
#   bash scripts/test.sh all          every tier, tests/extended too (GPU kernels, H100 compiles, benchmarks)
#   bash scripts/test.sh unit -k ema  extra args go to pytest (e.g. -n 0 to run in this process, with --pdb)
# Two xdist workers, one test file at a time each (module fixtures stay shared within a file), handed
# out longest first from the last run's times (tests/conftest.py), and one XLA compilation cache for
# the whole run. The run ends with the 15 slowest tests and the seconds per tier. The real-SLURM tests
# start a single-node cluster from Debian packages when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
tiers=()
while [[ $# -gt 0 && "$1" =~ ^(unit|integration|fault|extended|all)$ ]]; do
  if [[ "$1" == all ]]; then tiers+=(tests); else tiers+=("tests/$1"); fi
  shift
done
# tests/extended stays out unless named: the rest must fit CI's 90 minutes on 2 cores (tests/conftest.py).
[[ ${#tiers[@]} -gt 0 ]] || tiers=(tests/unit tests/integration tests/fault)
# --no-compile: pip byte-compiles every module of every package it installs (torch, transformers, mlflow:
# ~50 of the install's ~75 s on the 2-core machine); the suite writes bytecode for the modules it imports
# as it imports them (tests/conftest.py), ~3 s of it.
bash scripts/setup_venv.sh "dev,reference" --no-compile
bash scripts/setup_gpu_aot.sh
.venv/bin/ruff check jaxrat tests benchmarks configs scripts
# --max-worker-restart=0: a worker that crashes (an abort in native code) ends the run with the test it was
# running named; with a replacement worker, xdist's loadfile scheduler can wait forever (pytest-xdist #784,
# #1378: seen here, a crashed worker and the session idle until killed).
exec .venv/bin/python -m pytest -q -ra --durations=15 -n 2 --dist loadfile --max-worker-restart=0 \
  ${tiers[@]+"${tiers[@]}"} "$@"

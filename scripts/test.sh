#!/usr/bin/env bash
# Install jaxrat with its test extras and run the whole test suite (extra args go to pytest).
# The real-SLURM tests start a single-node cluster from Debian packages when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh "dev,reference"
exec .venv/bin/python -m pytest -q -ra "$@"

#!/usr/bin/env bash
# Install jaxrat and train the demo: U-Net/RAT on synthetic ISIC-layout data, a few minutes on a CPU.
# Usage: scripts/demo.sh [WORKDIR] [--config.overrides ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
workdir="${1:-runs/demo}"
shift || true
exec .venv/bin/python -m jaxrat.main --config configs/isic.py:demo --workdir "$workdir" "$@"

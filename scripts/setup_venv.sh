#!/usr/bin/env bash
# Create ./.venv (if missing) and install jaxrat into it with the given extras, e.g. "dev,reference".
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/pip install --quiet --disable-pip-version-check -e "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import jaxrat, jax, flax; print('jaxrat', jaxrat.__version__, '| jax', jax.__version__, '| flax', flax.__version__)"

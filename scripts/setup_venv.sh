#!/usr/bin/env bash
# Create ./.venv (if missing) and install jaxrat into it with the given extras, e.g. "dev,reference";
# arguments after the extras go to pip (scripts/test.sh passes --no-compile). Idempotent: a second run
# only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
shift || true
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# pip's messages without the registry lines this machine's pip.conf makes it print for every package.
if ! .venv/bin/pip install --quiet --disable-pip-version-check "$@" -e "$spec" >"$log" 2>&1; then
  grep -v "is ignored: it is neither" "$log" >&2 || true
  echo "setup_venv.sh: pip could not install jaxrat${extras:+[$extras]} (its messages are above)." >&2
  exit 1
fi
grep -v "is ignored: it is neither" "$log" || true
.venv/bin/python -c "import jaxrat, jax, flax; print('jaxrat', jaxrat.__version__, '| jax', jax.__version__, '| flax', flax.__version__)"

#!/usr/bin/env bash
# Validate the gpu policy's fused forms on a lent GPU in one call, under one deadline (8 minutes by default):
#
#   BUDGET_S=480 OUT=/path bash scripts/gpu_session.sh        # from the repository root, on the GPU machine
#
# Wheels the machine's image lacks (grain, ml_collections, ...; its own jax, flax and optax are used) are
# installed from $WHEELS (default .gpu/whl) when that folder exists. Each stage's output goes to
# $OUT/log.txt, their exit codes and times to $OUT/stages.jsonl, the benchmarks' JSON to $OUT/; a stage that
# fails is logged and the next one runs. Stages, most valuable first:
#   1. parity of every fused form, float32 and bfloat16, against the portable forms
#      (benchmarks/gpu_validate.py parity): $OUT/validated.json is the repository's record plus every
#      form that passed, fingerprinted to this checkout; a form that failed is refused, not recorded;
#   2. the ISIC step (256 px, batch 16) with the validated set (model.gpu_forms=validated, before and
#      after this session's record) and the experimental one (all), then with each candidate form added to
#      the validated set, while the budget lasts ($OUT/step_*.json);
#   3. the README demo (eval Dice) with the default (validated) forms;
#   4. the record completed with the timings and the Dice (gpu_validate.py finish).
# Commit $OUT/validated.json as jaxrat/ops/gpu/validated.json.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_session_out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-480}))

stage() {  # stage NAME MAX_SECONDS COMMAND...: run it within what is left of the budget
  local name=$1 limit=$2 left
  shift 2
  left=$((DEADLINE - $(date +%s)))
  if ((left < 20)); then
    echo "### $name: skipped, the budget is spent"
    echo "{\"stage\": \"$name\", \"rc\": null}" >> "$OUT/stages.jsonl"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "### $name (at most ${limit}s, $(date +%T))"
  local t0=$(date +%s) rc
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "### $name: rc=$rc in $(($(date +%s) - t0))s"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"s\": $(($(date +%s) - t0))}" >> "$OUT/stages.jsonl"
}

cd "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
WHEELS=${WHEELS:-$ROOT/.gpu/whl}
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH="$WORK/site:$ROOT"
else
  export PYTHONPATH="$ROOT"
fi
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

VALIDATE="python3 benchmarks/gpu_validate.py"
stage parity 150 $VALIDATE parity --out "$OUT"
step() {  # step NAME MODEL_GPU_FORMS [RECORD]: the ISIC step timed with those forms
  local name=$1 forms=$2 record=${3:-}
  if [ -n "$record" ]; then  # the forms this session validated, used as the record
    stage "step_$name" 120 env JAXRAT_GPU_RECORD="$record" python3 benchmarks/gpu_bench.py --only isic \
      --isic-attention sparse --gpu-forms "$forms" --reps 5 --out "$OUT/step_$name.json"
  else
    stage "step_$name" 120 python3 benchmarks/gpu_bench.py --only isic --isic-attention sparse \
      --gpu-forms "$forms" --reps 5 --out "$OUT/step_$name.json"
  fi
}
step validated_before validated
[ -f "$OUT/validated.json" ] && step validated_after validated "$OUT/validated.json"
step all all
stage demo 160 env JAXRAT_GPU_RECORD="$OUT/validated.json" python3 -m jaxrat.main --config configs/isic.py:demo \
  --workdir "$WORK/demo"
[ -f "$WORK/demo/summary.json" ] && cp "$WORK/demo/summary.json" "$OUT/demo_summary.json"
for form in sparse_sga_sweep mlp layer_norm adamw cast sparse_sga_projection ema attention rotate resize \
            sparse_sga_products; do
  step "$form" "$form" "$OUT/validated.json"
done
stage finish 30 $VALIDATE finish --out "$OUT"
echo "### total $(($(date +%s) - START))s"

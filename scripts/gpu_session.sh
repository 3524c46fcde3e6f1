#!/usr/bin/env bash
# Issue 37's checks on a lent GPU, most valuable first, under one deadline (a lent machine has minutes):
#
#   BUDGET_S=520 OUT=/path bash scripts/gpu_session.sh        # from the repository root, on the GPU machine
#
# Wheels the machine's image lacks (grain, ml_collections, ...; its own jax, flax and optax are used) are
# installed from $WHEELS (default .gpu/whl) when that folder exists. Each stage's output goes to
# $OUT/log.txt, their exit codes and times to $OUT/stages.jsonl, the benchmarks' JSON to $OUT/. Stages:
# smoke run; sparse SGA's float32 parity (its sweeps synchronise a program's threads by a barrier, which
# interpret mode cannot test); the ISIC step (sparse and dense, gpu_bench); the fused AdamW against optax
# and the fused moving average against the leaf-by-leaf one, on the device; the README demo (Dice); the
# step's profile, with sparse SGA's passes apart, and with the first layer's input gradient by XLA;
# sparse SGA parity and speed, taps and matrix products, and the profile with products; the fused MLP's
# parity, speed and weight-pass cuts; the rest of gpu_bench.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_session_out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-520}))

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

stage smoke 100 python3 -m jaxrat.main --config configs/isic.py:smoke --workdir "$WORK/smoke"
stage sparse_parity 60 python3 benchmarks/sparse_sga_gpu.py "$OUT/sparse_parity.json" parity
stage bench_isic 170 python3 benchmarks/gpu_bench.py --only isic --out "$OUT/bench_isic.json"
stage adamw 60 python3 - <<'PY'
# The multi-tensor AdamW compiled by Triton on this GPU against optax's chain, six steps (one skipped).
import jax, jax.numpy as jnp, ml_collections as mlc, numpy as np
from jaxrat import ops
from jaxrat.trainer import fused_optimizer
from jaxrat.trainer.optimizer import global_norm, make_optimizer

cfg = mlc.ConfigDict(dict(optimizer=dict(learning_rate=1e-2, warmup_steps=2, end_learning_rate_factor=0.1,
                                         clip_norm=1.0, b1=0.9, b2=0.99, weight_decay=0.05,
                                         weight_decay_exclude="bias", layer_decay=0.0),
                          sharding=dict(zero=0, rules=()), num_train_steps=10))
rng = np.random.default_rng(0)
params = {f"p{i}": jnp.asarray(rng.normal(size=s), jnp.float32)
          for i, s in enumerate([(128, 512), (512,), (3, 3, 32, 32), (1,), (1025,), (64, 64)] * 12)}
tx, schedule = make_optimizer(cfg.optimizer, cfg.num_train_steps, concatenate_norm=True)
state = tx.init(params)
fused = fused_optimizer.fused_adamw(cfg, ops.KernelPolicy("gpu"), {"params": params, "opt_state": state}, schedule)

def reference(g, s, p, ok):
    u, s2 = tx.update(g, s, p)
    keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, o)
    return keep(jax.tree.map(jnp.add, p, u), p), keep(s2, s)

a = b = (params, state)
for step in range(6):
    g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * (3.0 if step % 2 else 0.01), jnp.float32), params)
    ok = jnp.asarray(step != 3)
    a = jax.jit(reference)(g, a[1], a[0], ok)
    b = jax.jit(fused.update)(g, b[1], b[0], ok, global_norm(g, concatenate=True))
# each leaf's largest difference over its largest entry (moments near zero make elementwise ratios noise)
err = max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
print(f"fused AdamW on {jax.devices()[0].device_kind}: largest difference from optax {err:.2e} of the leaf's largest entry")
# the parameters' moving average in a few kernels against the step's leaf-by-leaf form (one skipped)
from jaxrat.trainer.optimizer import update_ema
avg = jax.tree.map(lambda p: p * 0.5, params)
ema_err = 0.0
for ok in (True, False):
    want = jax.jit(lambda a, p, k: jax.tree.map(lambda n, o: jnp.where(k, n, o), update_ema(a, p, jnp.float32(0.99)), a))(
        avg, b[0], jnp.asarray(ok))
    got = jax.jit(lambda a, p, k: fused.ema(a, p, jnp.float32(0.99), k))(avg, b[0], jnp.asarray(ok))
    ema_err = max([ema_err] + [float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
                               for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got))])
print(f"fused EMA: largest difference from the leaf-by-leaf average {ema_err:.2e} of the leaf's largest entry")
raise SystemExit(0 if err < 1e-5 and ema_err < 1e-6 else 1)
PY
stage demo 160 python3 -m jaxrat.main --config configs/isic.py:demo --workdir "$WORK/demo"
# the default step's profile, then the same step with sparse SGA's passes apart (not swept: decides
# sparse_sga_sweep.ENABLED), then with the first layer's input gradient by XLA's product (decides
# sparse_sga_projection.MAX_FEATURES_IN_PASS); none of the three measured on a GPU so far
stage profile_taps 90 python3 benchmarks/gpu_profile.py --out "$OUT/profile_taps"
stage profile_passes_apart 90 python3 benchmarks/gpu_profile.py --passes-apart --out "$OUT/profile_passes_apart"
stage profile_input_grad_xla 90 python3 benchmarks/gpu_profile.py --input-grad-by-xla --out "$OUT/profile_input_grad_xla"
stage sparse_products 120 python3 benchmarks/sparse_sga_gpu.py "$OUT/sparse_sga.json" parity speed products
stage profile_products 90 python3 benchmarks/gpu_profile.py --sparse-products --out "$OUT/profile_products"
stage mlp 100 python3 benchmarks/mlp_gpu.py "$OUT/mlp.json" parity speed cuts
stage bench_rest 200 python3 benchmarks/gpu_bench.py --only kernels coco --out "$OUT/bench_rest.json"
for f in "$WORK"/demo/summary.json "$WORK"/demo/metrics.jsonl; do [ -f "$f" ] && cp "$f" "$OUT/demo_$(basename "$f")"; done
echo "### total $(($(date +%s) - START))s"

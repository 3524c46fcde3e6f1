"""Hungarian matching cost per device: pure-JAX solver vs scipy, and its share of a detection step.

    python benchmarks/detection_matching.py                 # batch 8, Q=100, T in 10 50 100, 5 reps
    python benchmarks/detection_matching.py --reps 10 --targets 10 100 --no-step

Per device the train step matches one local batch (8 images here) once per decoder layer
(6 with auxiliary losses). For each number of padded target slots T and each fill (``full``: all T
slots real, the worst case; ``coco``: real boxes per image drawn Poisson(7.3) like COCO train,
clipped to T) it times, median over reps, after compilation:

- ``jax``: ``jit(hungarian_match)`` on a (8, Q, T) cost matrix (what runs on each device);
- ``scipy``: ``scipy.optimize.linear_sum_assignment`` per image on the host, float64, no transfer;
- ``callback``: the scipy loop behind ``jax.pure_callback`` inside ``jit`` (the alternative design);
- ``step``: a DETR-sized decoder train step (6 layers, d=256, 8 heads, FFN 2048, Q=100 queries over
  ``--memory`` encoder tokens, 92 classes, all six layers' losses), forward + backward, once with
  the real matcher and once with a free one (target t -> query t), so the difference is what
  matching costs inside a step. RAT's backbone is left out, so the step time is a lower bound and
  the matching share an upper bound.

Prints a table and writes ``benchmarks/results/detection_matching.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import linear_sum_assignment

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxrat.tasks.detection.losses import num_target_boxes, set_criterion  # noqa: E402
from jaxrat.tasks.detection.matching import Match, hungarian_match, match_cost  # noqa: E402

NUM_CLASSES = 91  # COCO contiguous ids would be 80; the reference config's 91 (+1) is the larger case


def _median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _scipy_batch(cost: np.ndarray, valid: np.ndarray) -> np.ndarray:
    out = np.zeros(valid.shape, np.int32)
    for b in range(cost.shape[0]):
        cols = np.flatnonzero(valid[b])
        if cols.size:
            rows, k = linear_sum_assignment(np.asarray(cost[b][:, cols], np.float64))
            out[b, cols[k]] = rows
    return out


def _callback_match(cost: jax.Array, valid: jax.Array) -> jax.Array:
    return jax.pure_callback(_scipy_batch, jax.ShapeDtypeStruct(valid.shape, jnp.int32), cost, valid,
                             vmap_method="sequential")


def _free_match(cost: jax.Array, valid: jax.Array) -> Match:
    b, q, t = cost.shape
    pred = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    onehot = (pred[:, :, None] == jnp.arange(q)) & valid[:, :, None]
    return Match(pred, valid, jnp.argmax(onehot, axis=1).astype(jnp.int32), onehot.any(axis=1))


def _problem(rng: np.random.Generator, batch: int, q: int, t: int, fill: str):
    counts = np.full(batch, t) if fill == "full" else np.minimum(rng.poisson(7.3, batch), t)
    valid = np.arange(t)[None, :] < counts[:, None]
    logits = rng.normal(size=(batch, q, NUM_CLASSES + 1)).astype(np.float32)
    pred = np.concatenate([rng.uniform(0.1, 0.9, (batch, q, 2)), rng.uniform(0.02, 0.5, (batch, q, 2))], -1)
    tgt = np.concatenate([rng.uniform(0.1, 0.9, (batch, t, 2)), rng.uniform(0.02, 0.5, (batch, t, 2))], -1)
    labels = rng.integers(0, NUM_CLASSES, (batch, t))
    return (jnp.asarray(logits), jnp.asarray(pred.astype(np.float32)), jnp.asarray(labels),
            jnp.asarray(tgt.astype(np.float32)), jnp.asarray(valid))


def _init_decoder(key: jax.Array, d: int, ffn: int, layers: int) -> dict:
    def dense(k, i, o):
        return jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i)

    keys = iter(jax.random.split(key, 8 * layers + 4))
    blocks = [{name: dense(next(keys), i, o) for name, (i, o) in
               {"qkv": (d, 3 * d), "so": (d, d), "cq": (d, d), "ckv": (d, 2 * d), "co": (d, d),
                "f1": (d, ffn), "f2": (ffn, d)}.items()} for _ in range(layers)]
    return {"blocks": blocks, "query": jax.random.normal(next(keys), (100, d)),
            "cls": dense(next(keys), d, NUM_CLASSES + 1), "box": dense(next(keys), d, 4)}


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, heads: int = 8) -> jax.Array:
    b, n, d = q.shape
    split = lambda x: x.reshape(x.shape[0], x.shape[1], heads, d // heads)  # noqa: E731
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", w, split(v)).reshape(b, n, d)


def _decoder(params: dict, memory: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    norm = lambda x: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)  # noqa: E731
    x = jnp.broadcast_to(params["query"], (memory.shape[0], *params["query"].shape))
    outs = []
    for p in params["blocks"]:
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        x = norm(x + _attend(q, k, v) @ p["so"])
        k, v = jnp.split(memory @ p["ckv"], 2, axis=-1)
        x = norm(x + _attend(x @ p["cq"], k, v) @ p["co"])
        x = norm(x + jax.nn.relu(x @ p["f1"]) @ p["f2"])
        outs.append((x @ params["cls"], jax.nn.sigmoid(x @ params["box"])))
    return outs


def bench_one(t: int, fill: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(t)
    logits, pred, labels, tgt, valid = _problem(rng, args.batch, args.queries, t, fill)
    cost = jax.jit(match_cost)(logits, pred, labels, tgt, valid)
    cost_np, valid_np = np.asarray(cost), np.asarray(valid)
    jax_fn = jax.jit(hungarian_match)
    cb_fn = jax.jit(_callback_match)
    row = {"T": t, "fill": fill, "real_boxes_mean": float(valid_np.sum(1).mean()),
           "jax_ms": _median_ms(lambda: jax_fn(cost, valid), args.reps),
           "scipy_ms": _median_ms(lambda: _scipy_batch(cost_np, valid_np), args.reps),
           "callback_ms": _median_ms(lambda: cb_fn(cost, valid), args.reps)}
    # Same optimum from both (a cheap sanity check, not a test).
    got = np.take_along_axis(cost_np, np.asarray(jax_fn(cost, valid).pred_index)[:, None, :], 1)[:, 0]
    ref = np.take_along_axis(cost_np, _scipy_batch(cost_np, valid_np)[:, None, :], 1)[:, 0]
    row["max_rel_cost_diff"] = float(np.max(np.abs((got - ref) * valid_np).sum(1) / np.maximum(
        np.abs(ref * valid_np).sum(1), 1.0)))
    if args.step:
        params = _init_decoder(jax.random.key(0), 256, 2048, args.layers)
        memory = jax.random.normal(jax.random.key(1), (args.batch, args.memory, 256))

        def make_step(matcher):
            def loss(p, m):
                return set_criterion(_decoder(p, m), labels, tgt, valid, num_target_boxes(valid), matcher=matcher)[0]
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

        real, free = make_step(hungarian_match), make_step(_free_match)
        row["step_ms"] = _median_ms(lambda: real(params, memory), args.reps)
        row["step_free_match_ms"] = _median_ms(lambda: free(params, memory), args.reps)
        row["matching_share"] = max(row["step_ms"] - row["step_free_match_ms"], 0.0) / row["step_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="images per device")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--targets", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--fills", nargs="+", default=["full", "coco"], choices=["full", "coco"])
    parser.add_argument("--layers", type=int, default=6, help="decoder layers, each matched (aux losses)")
    parser.add_argument("--memory", type=int, default=850, help="encoder tokens the decoder attends to")
    parser.add_argument("--no-step", dest="step", action="store_false", help="time matching only")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "detection_matching.json"))
    args = parser.parse_args()

    rows = []
    header = f"{'T':>4} {'fill':>5} {'boxes':>6} {'jax ms':>8} {'scipy ms':>9} {'callback':>9} {'step ms':>9} " \
             f"{'free ms':>9} {'share':>6}"
    print(header)
    for t in args.targets:
        for fill in args.fills:
            r = bench_one(t, fill, args)
            rows.append(r)
            step = (f"{r['step_ms']:9.1f} {r['step_free_match_ms']:9.1f} {r['matching_share']:6.1%}"
                    if args.step else "")
            print(f"{t:>4} {fill:>5} {r['real_boxes_mean']:6.1f} {r['jax_ms']:8.2f} {r['scipy_ms']:9.2f} "
                  f"{r['callback_ms']:9.2f} {step}", flush=True)
    out = {"rows": rows, "args": vars(args), "backend": jax.default_backend(), "device": str(jax.devices()[0]),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
           "jax": jax.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

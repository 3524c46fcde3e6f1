"""Train-loop stall per checkpoint: async save blocking time vs a synchronous save, ISIC model state.

    python benchmarks/checkpoint_stall.py                 # configs/isic.py (its model: RAT), 5 reps
    python benchmarks/checkpoint_stall.py --reps 10 --set model.num_blocks=8

The state (params, AdamW moments, step, RNG) is built as training builds it (``make_state_spec`` on
the current devices), with random moments so the bytes written are those of a trained state.
Each repetition makes the state ready on the device first (so the timing is the save's, not the
last step's), then:

- async: ``Checkpointer.save`` with ``checkpoint.async_save=True``; "blocked" is how long the
  train loop would wait; then ``wait()`` until the checkpoint is committed ("to durable").
- sync: the same save with ``async_save=False``; the whole write blocks.
- host copy: every leaf copied into fresh host (NumPy) arrays, the floor for any save that must not
  see later steps' changes; the async save's blocked time is compared with it.

The first save of each kind (handler set-up, directory creation) is reported on its own line and
left out of the medians. Prints a table and writes ``benchmarks/results/checkpoint_stall.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _build_state(spec: str, overrides: list[str]):
    import jax
    import ml_collections as mlc

    from jaxrat.config_schema import load_config
    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec

    config = load_config(spec)
    for item in overrides:
        key, _, value = item.partition("=")
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value if isinstance(node[leaf], str) else ast.literal_eval(value)
    mesh = make_mesh(config.mesh.axes)
    s = make_state_spec(config, mesh, load_task(config))
    state = s.initialiser()(jax.random.key_data(jax.random.key(0)))
    # After training the AdamW moments are not zeros; zeros would compress to nothing on disk.
    state["opt_state"] = jax.tree.map(_noise_like, state["opt_state"])
    jax.block_until_ready(state)
    assert isinstance(config, mlc.ConfigDict)
    return config, state


def _noise_like(x):
    import jax
    import jax.numpy as jnp

    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.jit(lambda a: jax.random.normal(jax.random.key(1), a.shape, a.dtype) * 1e-3,
                   out_shardings=x.sharding)(x)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "isic.py"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_stall.json"))
    args = parser.parse_args()

    import jax

    from jaxrat.checkpointing import Checkpointer, Policy

    config, state = _build_state(args.config, args.set)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = args.dir or tempfile.mkdtemp(prefix="jaxrat_ckpt_bench_")
    shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)
    shutil.rmtree(os.path.join(root, "sync"), ignore_errors=True)
    async_ck = Checkpointer(os.path.join(root, "async"), Policy(async_save=True, keep=2))
    sync_ck = Checkpointer(os.path.join(root, "sync"), Policy(async_save=False, keep=2))

    import numpy as np

    blocked, durable, sync_s, host_copy = [], [], [], []
    for rep in range(args.reps + 1):  # rep 0: first save of each kind
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        copied = [np.array(x) for x in jax.tree.leaves(state)]
        host_copy.append(time.perf_counter() - t0)
        del copied
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        blocked.append(async_ck.save(rep + 1, state, reason="bench"))
        async_ck.wait()
        durable.append(time.perf_counter() - t0)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        sync_ck.save(rep + 1, state, reason="bench")
        sync_s.append(time.perf_counter() - t0)
    async_ck.close()
    sync_ck.close()
    on_disk = sum(f.stat().st_size for f in Path(root, "sync", str(args.reps + 1)).rglob("*") if f.is_file())
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    b, d, s, h = _stats(blocked[1:]), _stats(durable[1:]), _stats(sync_s[1:]), _stats(host_copy[1:])
    ratio = b["median"] / s["median"]
    result = {
        "config": args.config, "overrides": args.set, "model": config.model.to_dict(),
        "state_bytes": int(nbytes), "bytes_on_disk": int(on_disk), "reps": args.reps,
        "devices": jax.device_count(), "platform": jax.devices()[0].platform, "host": platform.node(),
        "cpu_count": os.cpu_count(), "async_blocked_s": b, "async_to_durable_s": d, "sync_save_s": s,
        "host_copy_s": h, "first_save": {"async_blocked_s": blocked[0], "async_to_durable_s": durable[0],
                                         "sync_save_s": sync_s[0], "host_copy_s": host_copy[0]},
        "blocked_over_sync": ratio, "target_blocked_over_sync": 0.02,
        "blocked_minus_host_copy_s": b["median"] - h["median"],
        "orbax": __import__("orbax.checkpoint").checkpoint.__version__, "jax": jax.__version__,
    }
    mib = nbytes / 2**20
    print(f"checkpoint stall: {args.config} {dict(config.model)}; state {mib:.1f} MiB "
          f"({on_disk / 2**20:.1f} MiB on disk), {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{args.reps} reps (+1 first save)")
    print(f"{'':<34}{'median':>10}{'min':>10}{'max':>10}{'first':>10}")
    for name, st, first in (("async save: train loop blocked", b, blocked[0]),
                            ("async save: until committed", d, durable[0]),
                            ("sync save (blocks throughout)", s, sync_s[0]),
                            ("host copy of the state", h, host_copy[0])):
        print(f"{name:<34}" + "".join(f"{st[k]:>9.3f}s" for k in ("median", "min", "max")) + f"{first:>9.3f}s")
    print(f"blocked / sync = {ratio:.1%} (target <= 2%); blocked - host copy = "
          f"{(b['median'] - h['median']) * 1e3:+.1f} ms; sync write rate {mib / s['median']:.0f} MiB/s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

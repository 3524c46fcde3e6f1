"""Per-device state bytes and collective traffic of the compiled train step for ZeRO 0..3.

Compiles (does not run) the real train step on N simulated CPU devices and reports, per ZeRO
stage: parameter + optimizer-state bytes per device (from the shardings), the compiled step's
memory analysis (argument / temp / peak bytes per device), and the bytes moved by each kind of
collective, read from the optimized HLO.

    python benchmarks/zero_memory.py [--devices 8] [--config configs/isic.py] [--variant ""] [--out FILE]

Target (issue 4): zero=3 state bytes per device <= 1.1 x (replicated / devices).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--config", default="configs/isic.py")
    p.add_argument("--variant", default="")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-size", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/zero_memory.json")
    return p.parse_args()


_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Sum of result bytes per collective kind in optimized HLO text (async starts counted once)."""
    out = {k: 0 for k in _COLLECTIVES}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)(-start)?\(",
                      line)
        if not m:
            continue
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            if dt in _DTYPE_BYTES:
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                out[m.group(2)] += n * _DTYPE_BYTES[dt]
    return out


def main() -> None:
    args = _parse()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from jaxrat.config_schema import load_config
    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec
    from jaxrat.trainer.step import make_train_step

    rows = []
    for zero in range(4):
        config = load_config(f"{args.config}:{args.variant}" if args.variant else args.config)
        config.data.image_size = args.image_size
        config.data.batch_size = args.batch_size
        config.mesh.axes = (("data", 1), ("fsdp", -1))
        config.sharding.zero = zero
        config.sharding.min_size = args.min_size
        s = make_state_spec(config, make_mesh(config.mesh.axes), load_task(config))
        state = s.abstract_with_shardings()

        def per_device(tree) -> int:
            return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(tree))

        size = config.data.image_size
        batch = {
            "image": jax.ShapeDtypeStruct((args.batch_size, size, size, 3), np.float32, sharding=s.batch_sharding),
            "mask": jax.ShapeDtypeStruct((args.batch_size, size, size, 1), np.float32, sharding=s.batch_sharding),
        }
        compiled = make_train_step(s).lower(state, batch).compile()
        mem = compiled.memory_analysis()
        coll = collective_bytes(compiled.as_text())
        rows.append({
            "zero": zero,
            "params_bytes_per_device": per_device(state["params"]),
            "opt_bytes_per_device": per_device(state["opt_state"]),
            "state_bytes_per_device": per_device(state),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "peak_bytes": int(getattr(mem, "peak_memory_in_bytes", 0)),
            **{f"{k}_bytes": v for k, v in coll.items()},
        })
    replicated = rows[0]["state_bytes_per_device"]
    for r in rows:
        r["state_vs_replicated_over_devices"] = r["state_bytes_per_device"] / (replicated / args.devices)
    cols = ["zero", "params_bytes_per_device", "opt_bytes_per_device", "state_bytes_per_device",
            "state_vs_replicated_over_devices", "temp_bytes", "peak_bytes",
            "all-reduce_bytes", "reduce-scatter_bytes", "all-gather_bytes"]
    print(f"model={config.model.name} devices={args.devices} "
          f"image={args.image_size} batch={args.batch_size}")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else f"{r[c]:,}" for c in cols))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"devices": args.devices, "rows": rows, "argv": sys.argv}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

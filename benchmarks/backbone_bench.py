"""Training throughput of the pretrained backbones: one row per backbone, images/s of a
forward + backward pass (mean cross-entropy of a linear head), float32 on this machine's default
device with the kernel policy ``auto`` resolves to here.

    python benchmarks/backbone_bench.py                 # the timm sizes at 224 px, and BEiT-base at 304 px
    python benchmarks/backbone_bench.py --quick         # tiny forms at 64 px, seconds per row
    python benchmarks/backbone_bench.py --only beit_base_patch16_224 --image-size 300 --batch 16

The seed's reference point (FungiTastic, BEiT-base at 300 px): 150-200 samples/s on 4x A100 at
batch 16 per GPU. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FULL = [("vit_base_patch16_224", {}, 224), ("beit_base_patch16_224", {}, 224),
        ("beit_base_patch16_224", {}, 304),  # the seed's 300 px, to the next multiple of the patch
        ("swin_tiny_patch4_window7_224", {}, 224)]
QUICK_FIELDS = {"vit": dict(patch_size=8, embed_dim=64, depth=2, num_heads=2),
                "beit": dict(patch_size=8, embed_dim=64, depth=2, num_heads=2),
                "swin": dict(embed_dim=32, depths=(1, 1, 2, 1), num_heads=(1, 2, 4, 8), window_size=2)}
QUICK = [("vit_tiny_patch16_224", QUICK_FIELDS["vit"], 64), ("beit_base_patch16_224", QUICK_FIELDS["beit"], 64),
         ("swin_tiny_patch4_window7_224", QUICK_FIELDS["swin"], 64)]


def measure(arch: str, fields: dict, size: int, batch: int, reps: int) -> dict:
    """Images/s of jitted forward + backward for one backbone (the best of ``reps`` timed steps)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxrat import ops
    from jaxrat.models.backbones import build_backbone

    kernels = ops.resolve("auto")
    model = build_backbone(arch, kernels=kernels, rngs=nnx.Rngs(0), **{"img_size": size, "num_classes": 10,
                                                                      **fields})
    graphdef, params = nnx.split(model, nnx.Param)
    images = jax.random.normal(jax.random.key(0), (batch, size, size, 3))
    labels = jnp.arange(batch) % 10

    @jax.jit
    def step(p):
        def loss(p):
            logits = nnx.merge(graphdef, p)(images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return jax.grad(loss)(p)

    t0 = time.perf_counter()
    jax.block_until_ready(step(params))
    compile_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params))
        best = min(best, time.perf_counter() - t0)
    n = sum(x.size for x in jax.tree.leaves(params))
    return {"backbone": arch, "image_size": size, "batch": batch, "params_m": round(n / 1e6, 2),
            "step_s": round(best, 4), "images_per_s": round(batch / best, 1), "compile_s": round(compile_s, 1),
            "kernels": kernels.form, "device": str(jax.devices()[0].device_kind), "fields": fields}


def print_table(rows: list[dict]) -> None:
    print("| backbone | px | batch | params (M) | step (s) | images/s | compile (s) | kernels |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backbone']} | {r['image_size']} | {r['batch']} | {r['params_m']} | {r['step_s']} | "
              f"{r['images_per_s']} | {r['compile_s']} | {r['kernels']} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny forms at 64 px")
    p.add_argument("--only", nargs="*", default=[], help="backbone names to run")
    p.add_argument("--image-size", type=int, default=0, help="override every row's image size (ViT/BEiT/Swin)")
    p.add_argument("--batch", type=int, default=0, help="images per step (default: 8, quick: 4)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "backbone_bench.json"))
    a = p.parse_args(argv)
    plan = QUICK if a.quick else FULL
    if a.only:
        plan = [row for row in plan if row[0] in a.only]
    batch = a.batch or (4 if a.quick else 8)
    rows = []
    for arch, fields, size in plan:
        rows.append(measure(arch, fields, a.image_size or size, batch, a.reps))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "quick": a.quick}, indent=1))


if __name__ == "__main__":
    main()

"""What the RAT-DETR demo step costs: the full RAT against the small one, with and without reduction shards (issue 30).

    python benchmarks/rat_detr_step.py                      # every variant below, 2 timed steps each
    python benchmarks/rat_detr_step.py --variants rat_demo --steps 3
    python benchmarks/rat_detr_step.py --variants rat_demo --set model.rat.num_blocks=1   # a smaller RAT

Each variant is ``configs/coco.py:demo`` with the overrides listed in ``VARIANTS`` (``issue``: the
demo with ``model.backbone=rat`` and the config's full RAT, as the issue measured it;
``rat_demo``: ``configs/coco.py:rat_demo``; ``*_shards``/``*_no_shards``: the same with or
without the demo's 8 reduction shards, so the two causes are told apart). The step is the
trainer's (``make_state_spec`` + ``make_train_step``, built by benchmarks/step_profile.py's
``Step``; with reduction shards the step object itself, its programs compiled on the warm-up step)
on the demo pipeline's first batch; "step s" is the median wall time of ``--steps`` steps after one
warm-up step, "compile s" the state initialisation plus the step's compilation. Prints a markdown
table and writes ``benchmarks/results/rat_detr_step.json``. Timings on a shared 2-core CPU are noisy.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from step_profile import Step, median_step_s  # noqa: E402

from jaxrat.config_schema import load_config  # noqa: E402
from jaxrat.trainer.step import make_train_step  # noqa: E402

VARIANTS: dict[str, tuple[str, dict]] = {
    "issue": ("configs/coco.py:demo", {"model.backbone": "rat"}),
    "issue_no_shards": ("configs/coco.py:demo", {"model.backbone": "rat", "train.reduction_shards": 0}),
    "rat_demo": ("configs/coco.py:rat_demo", {}),
    "rat_demo_shards": ("configs/coco.py:rat_demo", {"train.reduction_shards": 8}),
}


def variant_config(name: str, extra: dict | None = None):
    """The variant's config, then ``extra`` ({dotted key: value}, e.g. from ``--set``) on top."""
    path, overrides = VARIANTS[name]
    c = load_config(path)
    for key, value in {**overrides, **(extra or {})}.items():
        node = c
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return c


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rat_detr_step.json"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override on every variant (a Python literal, else a string), e.g. "
                             "model.rat.num_blocks=1")
    return parser.parse_args(argv)


def parse_sets(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE, e.g. --set model.rat.num_blocks=1")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def main() -> None:
    args = parse_args()
    os.chdir(REPO)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxrat-rat-detr-") as root:
        for name in args.variants:
            c = variant_config(name, parse_sets(args.set))
            step = Step(c, os.path.join(root, "data"))
            if c.train.reduction_shards:
                # Under reduction shards, lower().compile() gives the shard program (for its memory
                # analysis), not a whole step: run the step object, which compiles its programs on call.
                step.compiled = make_train_step(step.spec)
            params = sum(x.size for x in jax.tree.leaves(step.state["params"]))
            jax.block_until_ready(step())
            step_s, times = median_step_s(step, args.steps)
            rows.append({"variant": name, "params": int(params), "batch": c.data.batch_size,
                         "px": c.data.image_size, "reduction_shards": c.train.reduction_shards,
                         "compile_s": step.compile_s, "step_s": step_s, "step_times_s": times})
            print(json.dumps(rows[-1]), flush=True)
    print("| variant | params | batch | px | shards | compile s | step s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['params'] / 1e6:.2f} M | {r['batch']} | {r['px']} | {r['reduction_shards']} | "
              f"{r['compile_s']:.1f} | {r['step_s']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": platform.platform(), "devices": str(jax.devices()),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

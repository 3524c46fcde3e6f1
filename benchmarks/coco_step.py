"""The real ``configs/coco.py`` train step: per-device memory from the compiled step, and matching's share of it.

    python benchmarks/coco_step.py                          # 800 px, batch 16, 8 devices (CPU: simulated)
    python benchmarks/coco_step.py --image-size 256 --reps 3
    python benchmarks/coco_step.py --no-time                # lower + compile + memory only

The step is lowered from shapes alone (``autotune.train_step_lowering``: no data, no parameters),
compiled, and ``memory_analysis()`` of the compiled step gives the bytes per device (arguments,
outputs, temporaries, less what is aliased by donation). With ``--time`` (default) it then runs the
step on zero images with random boxes (3 per image; COCO averages 7.3) and times, median over
reps after a warm-up (the two steps alternate rep by rep):

- ``step``: the real train step (forward, the Hungarian matching of every decoder layer, backward, AdamW);
- ``step_free_match``: the same step with matching replaced by a free assignment (target t -> query t),
  so ``step - step_free_match`` is what matching costs inside the step;
- ``match``: the matcher alone on the step's cost shapes, (global batch, queries, max_boxes), times the
  number of matched decoder layers.

Prints a table and writes ``benchmarks/results/coco_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from detection_matching import _free_match, _median_ms  # noqa: E402

from jaxrat.config_schema import load_config  # noqa: E402
from jaxrat.parallel.mesh import make_mesh  # noqa: E402
from jaxrat.tasks.base import load_task  # noqa: E402
from jaxrat.tasks.detection import data as detection_data  # noqa: E402
from jaxrat.tasks.detection import task as detection_task  # noqa: E402
from jaxrat.tasks.detection.matching import hungarian_match  # noqa: E402
from jaxrat.trainer import autotune  # noqa: E402
from jaxrat.trainer.loop import to_global  # noqa: E402
from jaxrat.trainer.state import make_state_spec, resolve_compute_dtype  # noqa: E402
from jaxrat.trainer.step import make_train_step  # noqa: E402

NUM_CLASSES = 80  # COCO's contiguous labels


def coco_config(args: argparse.Namespace):
    config = load_config(f"configs/coco.py{':' + args.variant if args.variant else ''}")
    if args.image_size:
        config.data.image_size = args.image_size
    config.data.batch_size = args.batch
    return config


def _task(config):
    task = load_task(config)
    task.num_classes = NUM_CLASSES
    return task


def _gib(n: float) -> float:
    return n / 2**30


def memory(config, mesh, args: argparse.Namespace) -> tuple[dict, object]:
    """Lower and compile the step from shapes: (XLA's per-device accounting of it, the compiled step)."""
    lower = autotune.train_step_lowering(config, mesh, _task(config))
    t = time.perf_counter()
    lowered = lower(detection_data.example_batch(config), args.batch)
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    alias = getattr(mem, "alias_size_in_bytes", 0)
    return {"lower_s": lower_s, "compile_s": compile_s,
            "argument_gib": _gib(mem.argument_size_in_bytes), "output_gib": _gib(mem.output_size_in_bytes),
            "temp_gib": _gib(mem.temp_size_in_bytes), "alias_gib": _gib(alias),
            "total_gib": _gib(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - alias),
            "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}, compiled


def _batch(config, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    example = detection_data.example_batch(config)
    batch = {k: np.repeat(v, n, axis=0) for k, v in example.items()}
    boxes = 3
    centre, size = rng.uniform(0.2, 0.8, (n, boxes, 2)), rng.uniform(0.05, 0.3, (n, boxes, 2))
    batch["boxes"][:, :boxes] = np.concatenate([centre, size], -1)
    batch["labels"][:, :boxes] = rng.integers(0, NUM_CLASSES, (n, boxes))
    batch["box_valid"][:, :boxes] = 1.0
    return batch


def _runner(step, state, gbatch):
    """A no-argument call of ``step`` that carries its own state forward."""
    box = [state]

    def run() -> jax.Array:
        box[0], metrics = step(box[0], gbatch)
        return metrics["train/loss"]

    return run


def timings(config, mesh, args: argparse.Namespace, compiled) -> dict:
    """Median step time with the real matcher (``compiled``) and with a free one, and the matcher alone."""
    batch = _batch(config, args.batch, np.random.default_rng(0))
    out = {}
    def free(cost: jax.Array, valid: jax.Array, mesh: object = None) -> object:
        return _free_match(cost, valid)  # target t -> query t: elementwise, nothing to solve

    runs = {}
    for name, matcher in (("step", hungarian_match), ("step_free_match", free)):
        detection_task.hungarian_match = matcher  # what DetectionTask.loss calls, per device under shard_map
        spec = make_state_spec(config, mesh, _task(config))
        state = spec.initialiser()(jax.random.key_data(jax.random.key(0)))
        step = compiled if matcher is hungarian_match else make_train_step(spec)
        runs[name] = _runner(step, state, to_global(batch, spec.batch_sharding))
        jax.block_until_ready(runs[name]())  # compile (the free step) and warm up
    # Alternate the two steps rep by rep so that a slow spell of a shared machine hits both alike.
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append((time.perf_counter() - t) * 1e3)
    for name, ts in times.items():
        out[f"{name}_ms"] = statistics.median(ts)
        out[f"{name}_all_ms"] = ts
    detection_task.hungarian_match = hungarian_match
    layers = int(config.model.decoder_layers) if config.task.aux_loss else 1
    q, t = int(config.model.num_queries), int(config.task.max_boxes)
    rng = np.random.default_rng(1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    cost = jax.device_put(rng.uniform(0, 10, (args.batch, q, t)).astype(np.float32), sharding)
    valid = jax.device_put(batch["box_valid"] > 0, sharding)
    match = jax.jit(lambda c, v: hungarian_match(c, v, mesh=mesh))
    out["match_ms"] = _median_ms(lambda: match(cost, valid), args.reps) * layers
    out["matching_share"] = max(out["step_ms"] - out["step_free_match_ms"], 0.0) / out["step_ms"]
    out["match_alone_share"] = out["match_ms"] / out["step_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="", help="configs/coco.py variant ('' = the real config)")
    parser.add_argument("--image-size", type=int, default=0, help="canvas in px (0: the config's, 800)")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on GPU)")
    parser.add_argument("--no-time", dest="time", action="store_false", help="memory only; run nothing")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "coco_step.json"))
    args = parser.parse_args()
    os.chdir(REPO)
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the first backend use; GPUs are unaffected

    config = coco_config(args)
    mesh = make_mesh(config.mesh.axes)
    mem, compiled = memory(config, mesh, args)
    row = {"image_size": int(config.data.image_size), "batch": args.batch, "devices": mesh.size, **mem}
    print(f"{'px':>5} {'batch':>5} {'dev':>4} {'lower s':>8} {'compile s':>9} {'args GiB':>8} {'temp GiB':>8} "
          f"{'total GiB':>9}")
    print(f"{row['image_size']:>5} {args.batch:>5} {mesh.size:>4} {row['lower_s']:8.1f} {row['compile_s']:9.1f} "
          f"{row['argument_gib']:8.3f} {row['temp_gib']:8.3f} {row['total_gib']:9.3f}   (per device)", flush=True)
    if args.time:
        row.update(timings(config, mesh, args, compiled))
        print(f"step {row['step_ms']:.1f} ms, with a free matcher {row['step_free_match_ms']:.1f} ms: matching "
              f"{row['matching_share']:.1%} of the step; the matcher alone {row['match_ms']:.1f} ms "
              f"({row['match_alone_share']:.1%})")
    out = {"rows": [row], "args": vars(args), "backend": jax.default_backend(), "device": str(jax.devices()[0]),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
           "jax": jax.__version__, "dtype": resolve_compute_dtype(config.train.compute_dtype, mesh)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

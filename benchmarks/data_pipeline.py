"""ISIC training-pipeline throughput vs. the train step's consumption, and determinism.

    python benchmarks/data_pipeline.py [--config configs/isic.py[:demo]] [--images 48]
        [--width 1024 --height 768] [--seconds 15] [--workers 0,1,2] [--out results.json] [--skip-step]
        [--real-runs=-1:2,0:2,0:0,1:0 --real-steps 80]

The default config is ``configs/isic.py:demo`` (RAT, 48 px), whose step a CPU runs in a fraction
of a second; ``--config configs/isic.py`` measures the real 256 px pipeline, but its step belongs
on a GPU (on 2 CPU cores it takes minutes: add ``--skip-step`` there).

1. Writes ISIC-like JPEGs of a realistic size (default 1024x768; real ISIC 2018 photos range from
   about 0.6 to 30 megapixels) in the official layout, once, under --cache.
2. Images/s of the training pipeline (decode + resize to the config's size + the augmentations
   the reference configs list: flip, rotation 15, colour jitter 0.1, elastic 0.1) for each worker
   count, steady state after the first batch, and per busy core (machine-wide CPU time from
   /proc/stat, so run it on an otherwise idle machine).
3. Images/s the jitted train step of --config consumes on the same machine, from random
   batches (no input pipeline involved).
4. Determinism: a hash of the first batches for two runs of each worker count.
5. With --tfds-max-side 0,1024: the same through the ArrayRecord conversion
   (``python -m jaxrat.data.prepare_isic``) storing the original bytes (0) or images shrunk to that side.
6. With --real-runs=W:D,...: real training runs (``python -m jaxrat.main`` on those JPEGs, the
   config's model and the augmentations of 2., no eval) with ``data.num_workers=W`` and
   ``data.device_prefetch=D``, reporting ``train/data_wait_fraction`` (share of wall time the
   devices sat idle waiting for a batch) per logged window after the first, which holds the
   compilation.
Prints a table and writes JSON; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrat.data import pipeline  # noqa: E402
from jaxrat.data.sources import isic  # noqa: E402
from jaxrat.data.synthetic import isic as synthetic_isic  # noqa: E402


def write_images(root: str, n: int, width: int, height: int) -> str:
    """ISIC-layout JPEGs of ``width`` x ``height`` (upsampled synthetic lesions with fine noise)."""
    marker = os.path.join(root, f"bench_{n}_{width}x{height}.done")
    if os.path.exists(marker):
        return root
    rng = np.random.default_rng(0)
    for split, count, first in (("train", n, 0), ("validation", max(2, n // 8), n)):
        img_dir, mask_dir = (os.path.join(root, f) for f in isic.SPLIT_FOLDERS[split])
        os.makedirs(img_dir, exist_ok=True)
        os.makedirs(mask_dir, exist_ok=True)
        for i in range(first, first + count):
            img, mask = synthetic_isic.make_example(rng, 192, 256)
            big = np.asarray(Image.fromarray(img).resize((width, height), Image.BICUBIC), np.float32)
            big = np.clip(big + rng.normal(0, 6, big.shape), 0, 255).astype(np.uint8)  # sensor-like detail
            Image.fromarray(big).save(os.path.join(img_dir, f"ISIC_{i:07d}.jpg"), quality=92)
            Image.fromarray(mask).resize((width, height), Image.NEAREST).save(
                os.path.join(mask_dir, f"ISIC_{i:07d}_segmentation.png"))
    open(marker, "w").close()
    return root


# The augmentations the reference ISIC configs list (and configs/isic.py applies), used by both the
# pipeline measurement and the real runs so the two see the same work per image.
BENCH_AUG = {"random_flip": True, "rotation_degrees": 15.0, "color_jitter": 0.1, "elastic_prob": 0.1}


def bench_ops(image_size: int) -> list:
    return pipeline.augment_ops(image_size, **BENCH_AUG)


def busy_cpu_seconds() -> float | None:
    """CPU seconds this machine has spent busy (all processes, from /proc/stat); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pipeline_rate(pairs, workers: int, seconds: float, batch: int, image_size: int, threads: int) -> dict:
    it = pipeline.train_iterator(pairs, image_size=image_size, local_batch=batch, seed=0, process_index=0,
                                 process_count=1, ops=bench_ops(image_size), num_workers=workers,
                                 num_threads=threads, prefetch=4)
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    n, t1, cpu1 = 0, time.perf_counter(), busy_cpu_seconds()
    while time.perf_counter() - t1 < seconds:
        next(it)
        n += batch
    wall = time.perf_counter() - t1
    cpu2 = busy_cpu_seconds()
    rate = n / wall
    it.close()
    # Reader threads and worker processes both spread over cores: count the cores actually busy
    # (machine-wide, so measure on an otherwise quiet machine), not the workers.
    cores = (cpu2 - cpu1) / wall if cpu1 is not None and cpu2 is not None else float(max(1, workers))
    return {"workers": workers, "images_per_s": rate, "cores_busy": cores,
            "images_per_s_per_core": rate / max(cores, 1e-9), "first_batch_s": first}


def tfds_rate(root: str, max_side: int, seconds: float, batch: int, image_size: int, threads: int) -> dict:
    """Pipeline images/s reading the ArrayRecord conversion of ``root`` (0 workers)."""
    from jaxrat.data.badfiles import BadFilePolicy
    from jaxrat.data.sources import isic_arrayrecord

    out = os.path.join(root + "_tfds", f"max_side_{max_side}")
    t0 = time.perf_counter()
    isic_arrayrecord.prepare(root, out, max_side=max_side)
    prepare_s = time.perf_counter() - t0
    data = isic_arrayrecord.example_source(out, "train", BadFilePolicy())
    r = pipeline_rate(data, 0, seconds, batch, image_size, threads)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {**r, "source": "tfds", "max_side": max_side, "prepare_s": prepare_s, "bytes": size}


def batches_hash(pairs, workers: int, image_size: int, n: int = 3) -> str:
    it = pipeline.train_iterator(pairs, image_size=image_size, local_batch=4, seed=7, process_index=0,
                                 process_count=1, ops=bench_ops(image_size), num_workers=workers, num_threads=2)
    h = hashlib.sha256()
    for _ in range(n):
        b = next(it)
        for k in sorted(b):
            h.update(np.ascontiguousarray(b[k]).tobytes())
    it.close()
    return h.hexdigest()[:16]


def load_config(spec: str):
    from jaxrat.config_schema import load_config as load

    return load(spec)


def step_rate(spec: str, steps: int) -> dict:
    """Images/s of the jitted train step of config ``spec`` on this machine's devices."""
    import jax

    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.loop import to_global
    from jaxrat.trainer.state import make_state_spec
    from jaxrat.trainer.step import make_train_step

    cfg = load_config(spec)
    mesh = make_mesh(cfg.mesh.axes)
    s = make_state_spec(cfg, mesh, load_task(cfg))
    step = make_train_step(s)
    state = s.initialiser()(jax.random.key_data(jax.random.key(0)))
    b, size = cfg.data.batch_size, cfg.data.image_size
    rng = np.random.default_rng(0)
    batch = to_global({"image": rng.normal(size=(b, size, size, 3)).astype(np.float32),
                             "mask": (rng.random((b, size, size, 1)) > 0.5).astype(np.float32)}, s.batch_sharding)
    state, m = step(state, batch)  # compile
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    return {"batch": b, "image_size": size, "step_s": dt, "images_per_s": b / dt, "devices": mesh.size}


def real_run(spec: str, root: str, workers: int, device_prefetch: int, steps: int, log_every: int) -> dict:
    """data_wait_fraction of a real training run on the benchmark JPEGs (windows after the first)."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "jaxrat.main", "--config", spec, "--workdir", workdir,
               "--config.data.synthetic=false", f"--config.data.data_dir={root}",
               f"--config.num_train_steps={steps}", f"--config.train.log_every={log_every}",
               f"--config.train.eval_every={10 * steps}", "--config.train.eval_at_end=false",
               f"--config.checkpoint.every_steps={10 * steps}",
               f"--config.data.num_workers={workers}", f"--config.data.device_prefetch={device_prefetch}"]
        cmd += [f"--config.data.{k}={v}" for k, v in BENCH_AUG.items()]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"real run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    windows = [r for r in rows if "train/data_wait_fraction" in r][1:]
    waits = [r["train/data_wait_fraction"] for r in windows]
    return {"workers": workers, "device_prefetch": device_prefetch, "steps": steps, "wall_s": wall,
            "step_s": float(np.mean([1 / r["train/steps_per_sec"] for r in windows])),
            "data_wait_windows": waits, "data_wait_mean": float(np.mean(waits)), "data_wait_max": max(waits)}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxrat_bench_isic"))
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "configs", "isic.py") + ":demo",
                   help="config[:variant] whose image size, batch and model are measured")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--threads", type=int, default=2, help="Grain reader threads per process")
    p.add_argument("--step-steps", type=int, default=3)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--tfds-max-side", default="", help="also read ArrayRecord conversions with these "
                   "--max-side values (e.g. 0,1024), 0 workers")
    p.add_argument("--real-runs", default="", help="W:D,... real training runs with num_workers=W, "
                   "device_prefetch=D (e.g. -1:2,0:2,0:0)")
    p.add_argument("--real-steps", type=int, default=80)
    p.add_argument("--real-log-every", type=int, default=10)
    p.add_argument("--out", default="data_pipeline_results.json")
    args = p.parse_args()

    from absl import flags

    flags.FLAGS.mark_as_parsed()
    cfg = load_config(args.config)
    args.image_size, args.batch = cfg.data.image_size, cfg.data.batch_size
    root = write_images(args.cache, args.images, args.width, args.height)
    path, _, variant = args.config.partition(":")  # the real runs start in the repository
    args.config = os.path.abspath(path) + (f":{variant}" if variant else "")
    pairs = isic.find_pairs(root, "train")
    result = {"config": os.path.relpath(args.config), "batch": args.batch, "cpu_cores": len(os.sched_getaffinity(0)),
              "source_images": f"{args.width}x{args.height} JPEG",
              "image_size": args.image_size, "augment": "flip, rotation 15, colour jitter 0.1, elastic p=0.1",
              "pipeline": [], "determinism": {}}
    for w in (int(x) for x in args.workers.split(",") if x):
        r = pipeline_rate(pairs, w, args.seconds, args.batch, args.image_size, args.threads)
        result["pipeline"].append(r)
        print(f"workers={w}: {r['images_per_s']:.1f} img/s on {r['cores_busy']:.2f} busy cores "
              f"({r['images_per_s_per_core']:.1f} per core), "
              f"first batch {r['first_batch_s']:.2f} s", flush=True)
        result["determinism"][str(w)] = [batches_hash(pairs, w, args.image_size) for _ in range(2)]
    hashes = {h for v in result["determinism"].values() for h in v}
    result["deterministic_across_runs_and_workers"] = len(hashes) == 1
    if not args.skip_step:
        result["train_step"] = step_rate(args.config, args.step_steps)

    consumed = result["train_step"]["images_per_s"] if "train_step" in result else None
    print("\n| workers | pipeline img/s | busy cores | img/s per busy core | first batch (s) "
          "| pipeline / step rate |")
    print("|---|---|---|---|---|---|")
    for r in result["pipeline"]:
        if consumed:
            r["pipeline_over_step"] = r["images_per_s"] / consumed
        ratio = f"{r['pipeline_over_step']:.2f}x" if consumed else "-"
        print(f"| {r['workers']} | {r['images_per_s']:.1f} | {r['cores_busy']:.2f} | {r['images_per_s_per_core']:.1f} "
              f"| {r['first_batch_s']:.2f} | {ratio} |")
    if "train_step" in result:
        t = result["train_step"]
        print(f"\ntrain step ({result['config']}, batch {t['batch']} at {t['image_size']} px, "
              f"{t['devices']} device(s)): {t['step_s']:.2f} s/step = {t['images_per_s']:.1f} img/s consumed")
    print(f"same batches across runs and worker counts: {result['deterministic_across_runs_and_workers']} "
          f"({sorted(hashes)})")
    if args.tfds_max_side:
        result["tfds"] = []
        for m in (int(x) for x in args.tfds_max_side.split(",")):
            r = tfds_rate(root, m, args.seconds, args.batch, args.image_size, args.threads)
            result["tfds"].append(r)
        print("\n| ArrayRecord max_side | size (MB) | prepare (s) | pipeline img/s | busy cores "
              "| img/s per busy core |")
        print("|---|---|---|---|---|---|")
        for r in result["tfds"]:
            print(f"| {r['max_side'] or 'original'} | {r['bytes'] / 1e6:.1f} | {r['prepare_s']:.1f} | "
                  f"{r['images_per_s']:.1f} | {r['cores_busy']:.2f} | {r['images_per_s_per_core']:.1f} |")
    if args.real_runs:
        result["real_runs"] = []
        for item in args.real_runs.split(","):
            w, d = (int(x) for x in item.split(":"))
            r = real_run(args.config, root, w, d, args.real_steps, args.real_log_every)
            result["real_runs"].append(r)
            print(f"real run workers={w} device_prefetch={d}: {r['step_s']:.3f} s/step, data wait "
                  f"{100 * r['data_wait_mean']:.1f} % mean, {100 * r['data_wait_max']:.1f} % max", flush=True)
        print("\n| num_workers | device_prefetch | s/step | data wait mean | max | per window (after the first) |")
        print("|---|---|---|---|---|---|")
        for r in result["real_runs"]:
            windows = ", ".join(f"{w:.3f}" for w in r["data_wait_windows"])
            print(f"| {r['workers']} | {r['device_prefetch']} | {r['step_s']:.3f} | {100 * r['data_wait_mean']:.1f} % "
                  f"| {100 * r['data_wait_max']:.1f} % | {windows} |")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

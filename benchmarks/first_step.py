"""Time to first step, cold vs warm persistent compilation cache (a requeued or resumed job).

    python benchmarks/first_step.py [--config configs/isic.py:demo] [--steps 2] [--out FILE]

Runs ``python -m jaxrat.main`` on one config with the compilation cache in one fresh folder:

- ``cold``: fresh workdir, empty cache; stopped by SIGTERM (as SLURM preempts) once ``--steps``
  steps are logged, so it writes a preemption checkpoint and exits for requeue;
- ``requeued``: the same command in the same workdir, the cache the cold run filled: it restores
  the checkpoint and goes on (what a requeued or resumed job does); stopped the same way;
- ``fresh, warm cache``: a new workdir with the filled cache (a new run of an unchanged config:
  it also writes its demo data and initialises);
- ``off``: a new workdir, ``train.compilation_cache_dir=none``, for reference.

The config's step count is left alone (the learning-rate schedule is compiled into the step, so a
changed ``num_train_steps`` would be a different program). "time to first step" is what the
trainer logs as ``train/time_to_first_step_s`` (process start to the first step's end: imports,
data set-up, restore or init, compilation and the step itself); "process" is the whole command's
wall time, the preemption save included. Target (issue 14): requeued <= 1/3 of cold. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def run(config: str, steps: int, workdir: str, cache: str, timeout: float = 1800) -> dict:
    """One run, stopped with SIGTERM once it has logged ``steps`` steps of its own."""
    cmd = [sys.executable, "-m", "jaxrat.main", "--config", config, "--workdir", workdir,
           "--config.train.eval_every=100000", "--config.train.eval_at_end=False",
           "--config.train.log_every=1", f"--config.train.compilation_cache_dir={cache}"]
    before = len(_rows(workdir))
    t0 = time.perf_counter()
    with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "a") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and time.perf_counter() - t0 < timeout:
            if sum(1 for r in _rows(workdir)[before:] if "train/loss" in r) >= steps:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        code = proc.wait(timeout=timeout)
    wall = time.perf_counter() - t0
    rows = _rows(workdir)[before:]
    first = [r["train/time_to_first_step_s"] for r in rows if "train/time_to_first_step_s" in r]
    if not first:
        raise SystemExit(f"{' '.join(cmd)} exited {code} without logging a step; see {log.name}")
    return {"time_to_first_step_s": round(first[0], 2), "process_s": round(wall, 2), "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/isic.py:demo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_step.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla-cache")
        runs = (("cold", "a", cache), ("requeued", "a", cache), ("fresh, warm cache", "b", cache), ("off", "c", "none"))
        rows = {name: run(args.config, args.steps, os.path.join(tmp, wd), folder) for name, wd, folder in runs}
    ratio = rows["requeued"]["time_to_first_step_s"] / rows["cold"]["time_to_first_step_s"]
    print(f"time to first step, {args.config}")
    print(f"{'run':<18} {'first step s':>12} {'process s':>10}")
    for name, row in rows.items():
        print(f"{name:<18} {row['time_to_first_step_s']:>12.1f} {row['process_s']:>10.1f}")
    print(f"requeued / cold = {ratio:.2f} (target <= 0.33)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": args.config, "runs": rows, "requeued_over_cold": round(ratio, 3)}, f, indent=2)


if __name__ == "__main__":
    main()

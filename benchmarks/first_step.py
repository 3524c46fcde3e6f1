"""Time to first step, cold vs warm persistent compilation cache (a requeued or resumed job).

    python benchmarks/first_step.py [--config configs/isic.py:demo] [--steps 2] [--out FILE]

Runs ``python -m jaxrat.main`` three times on the same config, each in a fresh workdir, with the
compilation cache in one fresh folder: ``cold`` (empty cache), ``warm`` (the cache the cold run
filled) and ``off`` (``train.compilation_cache_dir=none``, for reference). "time to first step" is
what the trainer logs as ``train/time_to_first_step_s`` (process start to the first step's end:
imports, data set-up, restore or init, compilation and the step itself); "process" is the whole
command's wall time. Target (issue 14): warm <= 1/3 of cold. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(config: str, steps: int, workdir: str, cache: str) -> dict:
    cmd = [sys.executable, "-m", "jaxrat.main", "--config", config, "--workdir", workdir,
           f"--config.num_train_steps={steps}", "--config.train.eval_every=100000", "--config.train.eval_at_end=False",
           "--config.train.log_every=1", f"--config.train.compilation_cache_dir={cache}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    first = next(r["train/time_to_first_step_s"] for r in rows if "train/time_to_first_step_s" in r)
    return {"time_to_first_step_s": round(first, 2), "process_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/isic.py:demo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_step.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla-cache")
        rows = {}
        for name, folder in (("cold", cache), ("warm", cache), ("off", "none")):
            rows[name] = run(args.config, args.steps, os.path.join(tmp, name), folder)
    ratio = rows["warm"]["time_to_first_step_s"] / rows["cold"]["time_to_first_step_s"]
    print(f"time to first step, {args.config}")
    print(f"{'cache':<6} {'first step s':>12} {'process s':>10}")
    for name, row in rows.items():
        print(f"{name:<6} {row['time_to_first_step_s']:>12.1f} {row['process_s']:>10.1f}")
    print(f"warm / cold = {ratio:.2f} (target <= 0.33)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": args.config, "runs": rows, "warm_over_cold": round(ratio, 3)}, f, indent=2)


if __name__ == "__main__":
    main()

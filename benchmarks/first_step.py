"""Time to first step, cold vs warm persistent compilation cache (a requeued or resumed job).

    python benchmarks/first_step.py [--config configs/isic.py:demo] [--steps 2] [--out FILE]

Runs ``python -m jaxrat.main`` on one config with the compilation cache in one fresh folder:

- ``cold``: fresh workdir, empty cache; stopped by SIGTERM (as SLURM preempts) at its ``--steps``-th
  logged step, so it writes a preemption checkpoint there and exits for requeue;
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

The SIGTERM is raised inside the run, by its metric writer as it writes the ``--steps``-th train
row, so the trainer's next preemption check (the same step's) sees it. Sent by this script once it
saw that row in ``metrics.jsonl``, it came a poll or a busy machine's time slice later: the smoke
config's 6 steps take a tenth of a second once compiled, so the cold run could end on its own (exit
0, final checkpoint) and leave the requeued run nothing to do.
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
sys.path.insert(0, str(REPO))

from jaxrat.cluster.preemption import PREEMPTED_EXIT_CODE  # noqa: E402


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


# ``python -c`` program: jaxrat.main whose metric writer raises SIGTERM in the trainer's own thread
# as it writes the N-th train row (argv[1]), i.e. before that step's preemption check.
_STOP_AT_STEP = """
import signal, sys
from jaxrat.tracking.writers import MetricWriter
stop_at, logged, write = int(sys.argv.pop(1)), [0], MetricWriter.write_scalars
def write_scalars(self, step, scalars):
    write(self, step, scalars)
    if "train/loss" in scalars:
        logged[0] += 1
        if logged[0] == stop_at:
            signal.raise_signal(signal.SIGTERM)
MetricWriter.write_scalars = write_scalars
from jaxrat.main import run
run()
"""


def run(config: str, steps: int, workdir: str, cache: str, timeout: float = 1800) -> dict:
    """One run, stopped with SIGTERM at the ``steps``-th step it logs itself."""
    args = ["--config", config, "--workdir", workdir, "--config.train.eval_every=100000",
            "--config.train.eval_at_end=False", "--config.train.log_every=1",
            f"--config.train.compilation_cache_dir={cache}"]
    cmd = [sys.executable, "-c", _STOP_AT_STEP, str(steps), *args]
    shown = " ".join(["jaxrat.main", *args])
    before = len(_rows(workdir))
    t0 = time.perf_counter()
    with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "a") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SystemExit(f"{shown} did not end within {timeout:.0f} s; see {log.name}") from None
    wall = time.perf_counter() - t0
    rows = _rows(workdir)[before:]
    first = [r["train/time_to_first_step_s"] for r in rows if "train/time_to_first_step_s" in r]
    if not first:
        raise SystemExit(f"{shown} exited {code} without logging a step; see {log.name}")
    return {"time_to_first_step_s": round(first[0], 2), "process_s": round(wall, 2), "exit": code}


def _check_requeueable(workdir: str, code: int) -> None:
    """Stop with one sentence when the cold run left nothing for a requeued run to do."""
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        raise SystemExit(f"the cold run exited {code} without writing {path}; see its log beside the workdir.")
    with open(path) as f:
        done = json.load(f)["steps"]
    if code != PREEMPTED_EXIT_CODE or done["last"] >= done["total"]:
        raise SystemExit(f"the cold run ended at step {done['last']} of {done['total']} (exit {code}), so a requeued "
                         f"run would have no step left; pass a --steps below {done['total']}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/isic.py:demo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_step.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla-cache")
        runs = (("cold", "a", cache), ("requeued", "a", cache), ("fresh, warm cache", "b", cache), ("off", "c", "none"))
        rows = {}
        for name, wd, folder in runs:
            rows[name] = run(args.config, args.steps, os.path.join(tmp, wd), folder)
            if name == "cold":
                _check_requeueable(os.path.join(tmp, wd), rows[name]["exit"])
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

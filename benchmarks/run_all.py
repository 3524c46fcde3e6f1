"""Every benchmark in one command: one markdown summary and one JSON, with the machine and commit.

    python benchmarks/run_all.py            # the full set (hours on a 2-core CPU; minutes on a GPU)
    python benchmarks/run_all.py --quick    # small sizes and few repetitions, ~15-25 min on 2 CPU cores
    python benchmarks/run_all.py --smoke    # the smallest sizes: does each one still run (CI)
    python benchmarks/run_all.py --only rat_bench first_step

Each benchmark runs as its own subprocess (so one that fails or runs out of memory does not take
the others with it) and writes its own JSON under ``--results``; its printed table is kept too.
The summary (``SUMMARY.md`` and ``summary.json`` there) lists, per benchmark, the command, whether
it finished, its wall time and its table. Timings from a machine that is busy with other work are
not worth comparing: the summary records the load average before and after each benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (quick arguments, full arguments); each script also gets --out <results>/<name>.json
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "rat_bench": (["--sizes", "64", "96", "--reference-sizes", "64", "96", "--reps", "1"],
                  ["--sizes", "64", "96", "128", "--reference-sizes", "64", "96", "128", "--reps", "3"]),
    "rat_scaling": (["--variants", "windowed", "--sizes", "128", "256", "--time-up-to", "128", "--reps", "1"],
                    ["--sizes", "128", "256", "512", "1024", "--time-up-to", "512"]),
    "coco_step": (["--image-size", "128", "--batch", "4", "--devices", "2", "--reps", "1"], []),
    "rat_detr_step": (["--variants", "rat_demo", "issue_no_shards"], ["--steps", "3"]),
    "zero_memory": (["--image-size", "64", "--batch-size", "8"], []),
    "detection_matching": (["--targets", "10", "50", "--reps", "2"], []),
    "data_pipeline": (["--config", "configs/isic.py:demo", "--images", "16", "--seconds", "5", "--workers", "0,1"],
                      []),
    "checkpoint_stall": (["--reps", "2"], []),
    "first_step": ([], []),
    "attention_blocks": (["--size", "64", "--blocks", "65536", "524288", "4194304", "--reps", "2"], []),
    "backbone_bench": (["--quick"], []),
    "step_profile": (["--size", "64", "--steps", "2", "--feed-steps", "2"], ["--size", "128", "--steps", "3"]),
    "gpu_bench": (["--quick"], []),  # the full table wants a GPU; --quick runs the portable forms on a CPU
    "gpu_cost": (["--quick"], []),
    "gpu_registers": ([], []),  # compiles for an H100 and asks ptxas: no GPU needed, ~15 s
}


# name -> the smallest arguments that still run the whole benchmark: what tests/extended/test_benchmarks_smoke.py
# runs in CI, so that no benchmark rots unnoticed (the numbers mean nothing at these sizes).
SMOKE: dict[str, list[str]] = {
    "rat_bench": ["--sizes", "32", "--reference-sizes", "32", "--reps", "1"],
    "rat_scaling": ["--variants", "windowed", "--sizes", "64", "--time-up-to", "0", "--no-components"],
    "coco_step": ["--variant", "smoke", "--batch", "2", "--devices", "2", "--no-time"],
    "rat_detr_step": ["--variants", "rat_demo", "--steps", "1", "--set", "model.rat.num_blocks=1",
                      "--set", "model.feature_levels=(1,)", "--set", "model.query_level=1",
                      "--set", "data.batch_size=2"],
    "zero_memory": ["--config", "configs/isic.py:smoke", "--image-size", "32", "--batch-size", "4", "--devices", "2"],
    "detection_matching": ["--targets", "10", "--fills", "full", "--reps", "1", "--no-step"],
    "data_pipeline": ["--config", "configs/isic.py:demo", "--images", "4", "--width", "96", "--height", "64",
                      "--seconds", "1", "--workers", "0", "--skip-step"],
    "checkpoint_stall": ["--reps", "1", "--set", "model.rat.num_blocks=1"],
    "first_step": ["--config", "configs/isic.py:smoke", "--steps", "1"],
    "attention_blocks": ["--size", "32", "--blocks", "65536", "--matmul", "256", "--reps", "1"],
    "step_profile": ["--config", "configs/isic.py:demo", "--size", "32", "--variants", "sparse", "--steps", "1",
                     "--feed-steps", "1"],
    "gpu_bench": ["--quick", "--sizes", "32", "--only", "kernels"],
    "backbone_bench": ["--quick"],
    "gpu_cost": ["--quick"],
    "gpu_registers": [],
}
# Benchmarks whose smoke form a test of their own already runs (the same arguments or a superset), so the
# suite's run of every smoke form (tests/extended/test_benchmarks_smoke.py) leaves them to that test
# rather than compile the same H100 programs twice (~250 s of the suite on 2 cores). `--smoke` runs them.
SMOKE_TESTED_BY: dict[str, str] = {
    "gpu_cost": "tests/extended/test_gpu_cost.py",
    "gpu_registers": "tests/extended/test_gpu_registers.py",
    "gpu_bench": "tests/extended/test_gpu_bench.py",
}
# Benchmarks that need a CUDA device and cannot run on CI's CPUs (run them on a GPU machine).
GPU_ONLY = {"gpu_profile", "gpu_validate", "mlp_gpu", "sparse_sga_gpu"}


def machine() -> dict:
    """What the numbers were measured on."""
    import jax  # imported here so --help stays instant

    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else ""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    devices = jax.devices()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = git.stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": f"{len(devices)} x {devices[0].device_kind}"}


def run_one(name: str, args: list[str], results: Path, timeout: float) -> dict:
    out = results / f"{name}.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args, "--out", str(out)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = "timeout", (e.stdout or b"").decode(errors="replace"), ""
    row = {"command": " ".join(["python", f"benchmarks/{name}.py", *args]),
           "status": "ok" if code == 0 else f"failed ({code})",
           "seconds": round(time.perf_counter() - t0, 1), "load_before": round(load0, 1),
           "load_after": round(os.getloadavg()[0], 1), "table": stdout.strip()[-6000:]}
    if code == 0 and out.exists():
        row["result"] = json.loads(out.read_text())
    elif code != 0:
        row["error"] = stderr.strip()[-2000:]
    return row


def markdown(info: dict, rows: dict[str, dict], quick: bool) -> str:
    lines = [f"# jaxrat benchmarks{' (quick)' if quick else ''}", "",
             f"{info['date']}, commit {info['commit']}: {info['devices']} ({info['backend']}), {info['cpu']}, "
             f"{info['cores']} cores, {info['memory_gib']} GiB, jax {info['jax']}.", "",
             "| benchmark | status | wall s | load avg before/after |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {r['status']} | {r['seconds']} | {r['load_before']} / {r['load_after']} |"
              for n, r in rows.items()]
    for name, row in rows.items():
        lines += ["", f"## {name}", "", f"`{row['command']}`", "", "```", row["table"] or "(no output)", "```"]
        if "error" in row:
            lines += ["", "Error (last lines):", "", "```", row["error"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes: proves each benchmark runs "
                        "(what CI runs), measures nothing")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--results", default="", help="folder for the JSON files and the summary "
                        "(default benchmarks/results, or benchmarks/results/quick with --quick)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds per benchmark (default 1800 quick, 14400 full)")
    args = parser.parse_args()
    tier = "smoke" if args.smoke else "quick" if args.quick else ""
    results = Path(args.results or REPO / "benchmarks" / "results" / tier)
    results.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (600 if args.smoke else 1800 if args.quick else 14400)
    info = machine()
    rows = {}
    for name in args.only:
        print(f"-- {name} ...", flush=True)
        wanted = SMOKE[name] if args.smoke else BENCHMARKS[name][0 if args.quick else 1]
        rows[name] = run_one(name, wanted, results, timeout)
        print(f"   {rows[name]['status']} in {rows[name]['seconds']} s", flush=True)
    (results / "SUMMARY.md").write_text(markdown(info, rows, args.quick))
    (results / "summary.json").write_text(json.dumps({"machine": info, "quick": args.quick, "benchmarks": rows},
                                                     indent=2, default=str))
    print(f"wrote {results / 'SUMMARY.md'} and {results / 'summary.json'}")
    if any(r["status"] != "ok" for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

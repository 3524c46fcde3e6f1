"""How the trainer's step scales over 8, 16 and 32 H100s, compiled on a machine without a GPU (issue 57).

    python benchmarks/gpu_scaling.py          # ISIC (sparse RAT, 256 px, 16 a GPU): 1 GPU; 8, 16, 32 at ZeRO 0 and 3
    python benchmarks/gpu_scaling.py --coco   # also COCO RAT-DETR (800 px, 2 images a GPU) on 1, 8 and 16 GPUs
    python benchmarks/gpu_scaling.py --cases isic_z0_16 --gpu-forms all   # chosen cases, the experimental forms
    python benchmarks/gpu_scaling.py --quick  # a tiny RAT on 1 and 2x8 GPUs, a few minutes (CI smoke)

Each case is the trainer's own step (``make_mesh``, ``make_state_spec``, ``make_train_step``, as
benchmarks/gpu_cost.py builds it for one GPU) over the compile-only devices of a topology
``SxHxD`` (``jax.experimental.topologies``: S NVLink domains = nodes, H hosts each, D GPUs per host):
8 GPUs are ``1x1x8``, N nodes ``Nx1x8``. XLA's GPU pipeline compiles it with its real NCCL collectives
in a scheduled module, which benchmarks/hlo_collectives.py reads: every collective (kind, dtype,
bytes, group, overlapped or not), its bytes on the wire per GPU, priced on NVLink (450 GB/s, 15 us)
inside a node and InfiniBand (50 GB/s per GPU, 30 us) across nodes, ring and hierarchical, and the
schedule replayed on a compute and a communication stream. Compute is benchmarks/hlo_cost.py's
roofline times ``--calibration`` (2.2: an H100 measured 40.0 ms for a step the roofline put at 18.0
ms). The weak-scaling efficiency of a case is the one-GPU step's time over its replayed step time.

Compiles run one per subprocess (each takes 2-5 min and several GB on 2 cores) and are kept in
``--work`` (a case already compiled there is read back; ``--fresh`` compiles again). Prints markdown
tables and writes ``--out`` (JSON). Needs the CUDA compiler: ``bash scripts/setup_gpu_aot.sh``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from math import prod
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class Case(NamedTuple):
    name: str
    task: str  # "isic" or "coco" (or "quick", a tiny RAT)
    topology: str  # SxHxD; "1x1x1" is the one-GPU baseline
    axes: tuple[tuple[str, int], ...]
    zero: int


def _case(task: str, gpus: int, zero: int) -> Case:
    topology = "1x1x1" if gpus == 1 else f"{gpus // 8}x1x8"
    # ZeRO-3 shards inside a node and replicates across nodes (HSDP): its all-gathers stay on NVLink
    axes = (("data", gpus // 8), ("fsdp", 8)) if zero and gpus >= 8 else (("data", gpus), ("fsdp", 1))
    return Case(f"{task}_z{zero}_{gpus}", task, topology, axes, zero)


ISIC = [_case("isic", 1, 0)] + [_case("isic", n, z) for n in (8, 16, 32) for z in (0, 3)]
COCO = [_case("coco", 1, 0), _case("coco", 8, 0), _case("coco", 16, 0)]
QUICK = [_case("quick", 1, 0), _case("quick", 16, 0), _case("quick", 16, 3)]
CASES = {c.name: c for c in ISIC + COCO + QUICK}
PER_GPU_BATCH = {"isic": 16, "coco": 2, "quick": 2}


def compile_case(case: Case, gpu_forms: str, work: Path) -> dict:
    """Compile ``case`` in this process; writes ``work/<name>.hlo`` and returns its facts."""
    import gpu_cost  # before jax: the CUDA plugin's compiler on the path
    import jax
    from jax.experimental import topologies

    why = gpu_cost.plugin_missing()
    if why:
        raise SystemExit(f"gpu_scaling: error: {why}")
    gpu = gpu_cost.load_gpu()
    devices = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=gpu.target_config,
                                           topology=case.topology).devices
    layout = gpu_cost.Layout(list(devices), case.axes, case.zero, "fsdp")
    batch = PER_GPU_BATCH[case.task] * len(devices)
    if case.task == "coco":
        step, state, inputs = gpu_cost.coco_step(devices[0], batch=batch, gpu_forms=gpu_forms, layout=layout)
    elif case.task == "quick":
        step, state, inputs = gpu_cost.isic_step(devices[0], 32, batch, config="configs/isic.py:demo",
                                                 gpu_forms=gpu_forms, layout=layout, num_blocks=1)
    else:
        step, state, inputs = gpu_cost.isic_step(devices[0], 256, batch, gpu_forms=gpu_forms, layout=layout)
    compiled, times = gpu_cost.compile_for(step, state, inputs, device=devices[0])
    text = compiled.as_text()
    (work / f"{case.name}.hlo").write_text(text)
    params = [list(x.shape) for x in jax.tree.leaves(state["params"])]
    return {"case": case._asdict(), "devices": len(devices), "batch": batch, "gpu_forms": gpu_forms,
            "memory": gpu_cost.device_memory(compiled), "parameter_shapes": params, **times}


def _compiled(case: Case, args: argparse.Namespace, work: Path) -> dict:
    facts = work / f"{case.name}.json"
    if facts.exists() and not args.fresh:
        return json.loads(facts.read_text())
    cmd = [sys.executable, __file__, "--compile-one", case.name, "--gpu-forms", args.gpu_forms, "--work", args.work]
    t = time.perf_counter()
    with open(work / f"{case.name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if rc or not facts.exists():
        lines = (work / f"{case.name}.log").read_text().strip().splitlines()
        tail = [line for line in lines if "cuda drivers" not in line and "absl::InitializeLog" not in line][-3:]
        raise SystemExit(f"gpu_scaling: error: compiling {case.name} failed (exit {rc}): {' / '.join(tail)}")
    print(f"{case.name}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
    return json.loads(facts.read_text())


def analyze(facts: dict, work: Path, calibration: float, networks: dict) -> dict:
    """The case's collectives, wire bytes, and replayed step time on each network."""
    import gpu_cost
    import hlo_collectives as hc
    from hlo_cost import _Module

    roofline = gpu_cost.load_gpu().roofline
    text = (work / f"{facts['case']['name']}.hlo").read_text()
    mod = _Module(text)
    cs = hc.collectives(text, mod)
    activations = hc.activation_traffic(cs, [tuple(s) for s in facts["parameter_shapes"]])
    row = {"case": facts["case"]["name"], "devices": facts["devices"], "zero": facts["case"]["zero"],
           "mesh": dict(facts["case"]["axes"]), "memory": facts["memory"], "compile_s": facts["compile_s"],
           "parameter_elements": sum(prod(s) for s in facts["parameter_shapes"]),
           "collectives": len(cs), "launches": sum(c.times for c in cs),
           "synchronous": sum(c.times for c in cs if not c.asynchronous or c.computation != mod.entry),
           "wire_bytes": sum(c.wire * c.times for c in cs), "by_kind": hc.by_kind(cs),
           "activation_collectives": [{"kind": c.kind, "bytes": c.buffer, "times": c.times, "op_name": c.op_name[:200]}
                                      for c in activations]}
    for label, net in networks.items():
        row[label] = hc.replay(text, cs, roofline, net, calibration, module=mod)
    return row


def print_tables(rows: list[dict], baselines: dict[str, float], networks: dict) -> None:
    print("\n| case | GPUs | mesh | ZeRO | collectives (launches, synchronous) | activation collectives | wire MB/GPU "
          "| temp GiB | args GiB |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["memory"]
        print(f"| {r['case']} | {r['devices']} | {','.join(f'{k}={v}' for k, v in r['mesh'].items())} | {r['zero']} | "
              f"{r['collectives']} ({r['launches']}, {r['synchronous']}) | {len(r['activation_collectives'])} | "
              f"{r['wire_bytes'] / 1e6:.1f} | {m.get('temp', 0) / 2**30:.2f} | {m.get('argument', 0) / 2**30:.3f} |")
    print("\nstep ms (calibrated compute, collectives replayed in XLA's schedule) and weak-scaling efficiency "
          "against one GPU; 'unhidden': with every collective's time added to the compute, none overlapped:\n")
    head = " | ".join(f"{n} step | {n} exposed | {n} eff. | {n} eff. unhidden" for n in networks)
    print(f"| case | compute | {head} |\n|---|---|" + "---|" * 4 * len(networks))
    for r in rows:
        base = baselines.get(r["case"].split("_")[0])
        cells = []
        for n in networks:
            s = r[n]
            eff = f"{base / s['step']:.0%} | {base / s['serial']:.0%}" if base else "- | -"
            cells.append(f"{s['step'] * 1e3:.2f} | {s['exposed'] * 1e3:.2f} | {eff}")
        print(f"| {r['case']} | {r[next(iter(networks))]['compute'] * 1e3:.2f} | " + " | ".join(cells) + " |")
    print("\ncollectives by kind (launches, MB in buffers, MB on the wire per GPU):\n")
    for r in rows:
        kinds = "; ".join(f"{k}: {v['launches']} x, {v['buffer'] / 1e6:.1f} MB, wire {v['wire'] / 1e6:.1f} MB"
                          for k, v in sorted(r["by_kind"].items()))
        print(f"- {r['case']}: {kinds or 'none'}")
        for a in r["activation_collectives"][:5]:
            print(f"  - activation {a['kind']} {a['bytes'] / 1e6:.2f} MB x{a['times']}: {a['op_name'][:120]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), help="default: the ISIC cases")
    p.add_argument("--coco", action="store_true", help="also the COCO RAT-DETR cases")
    p.add_argument("--quick", action="store_true", help="a tiny RAT on 1 and 16 GPUs (CI smoke)")
    p.add_argument("--gpu-forms", default="validated", help="model.gpu_forms: validated (the default), all, or names")
    p.add_argument("--calibration", type=float, default=2.2, help="measured / roofline step time on an H100")
    p.add_argument("--work", default=str(HERE / "results" / "gpu_scaling"), help="compiled modules kept here")
    p.add_argument("--fresh", action="store_true", help="compile every case again")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    p.add_argument("--out", default=str(HERE / "results" / "gpu_scaling.json"))
    p.add_argument("--compile-one", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(args.work) / args.gpu_forms.replace(",", "+")
    work.mkdir(parents=True, exist_ok=True)
    if args.compile_one:
        facts = compile_case(CASES[args.compile_one], args.gpu_forms, work)
        (work / f"{args.compile_one}.json").write_text(json.dumps(facts, indent=1))
        return 0
    import hlo_collectives as hc

    names = args.cases or [c.name for c in (QUICK if args.quick else ISIC + (COCO if args.coco else []))]
    cases = [CASES[n] for n in names]
    for task in {c.task for c in cases}:  # the one-GPU baseline of every task priced
        if CASES[f"{task}_z0_1"] not in cases:
            cases.insert(0, CASES[f"{task}_z0_1"])
    networks = {"ring": hc.Network(), "hier": hc.Network(hierarchical=True)}
    rows = [analyze(_compiled(c, args, work), work, args.calibration, networks) for c in cases]
    baselines = {r["case"].split("_")[0]: r["ring"]["step"] for r in rows if r["devices"] == 1}
    for r in rows:
        base = baselines.get(r["case"].split("_")[0])
        r["efficiency"] = {n: base / r[n]["step"] for n in networks} if base else {}
        r["efficiency_unhidden"] = {n: base / r[n]["serial"] for n in networks} if base else {}
    print_tables(rows, baselines, networks)
    out = {"gpu_forms": args.gpu_forms, "calibration": args.calibration, "rows": rows,
           "networks": {n: net.__dict__ for n, net in networks.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

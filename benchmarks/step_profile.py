"""Where the ISIC train step's time goes, and how far it is from the machine's limit (issue 14).

    python benchmarks/step_profile.py --variants dense mixed sparse --size 64 --batch 2 --steps 3
    python benchmarks/step_profile.py --config configs/isic.py:demo --size 48 --batch 16

The step is the one the trainer compiles (``make_state_spec`` + ``make_train_step``, as
benchmarks/coco_step.py builds it) for ``--config`` (default the real ``configs/isic.py``: RAT at the
ISIC dims, with its augmentations) at ``--size`` px and global batch ``--batch``, on synthetic demo
lesions, once per ``model.rat.attention`` variant. For each variant:

- **step s**: the step compiled, one warm-up step, then the median wall time of ``--steps`` steps
  (each waited for) on one fixed batch already on the devices (the pipeline's first).
- **buckets**: ``--steps`` more steps under ``jax.profiler.start_trace``. The trace's "/host:CPU"
  plane (or a GPU plane) holds one event per XLA thunk (stats ``hlo_op``, ``hlo_module``); each
  ``hlo_op`` is mapped to the ``op_name`` metadata of that instruction in ``compiled.as_text()``,
  which carries the model's named scopes: ``sga``, ``mr_blocks``, ``head`` (jaxrat/models) and
  ``optimizer`` (jaxrat/trainer/step.py); backward ops carry them too (``transpose(jvp(sga))``).
  Everything else (input projection, pyramid, loss, gradient norm) is ``other``. Thunk durations
  are summed per bucket. Approximations: a fusion is charged to one scope, that of its first
  dot/convolution if it has one (the costly part), else that of its root instruction (what XLA
  writes on the fusion), so elementwise work fused into a neighbour's kernel counts for the
  neighbour; an instruction whose metadata XLA dropped (some dots and custom fusions) takes that
  of its nearest user or operand, else of the loop that runs it (:func:`instruction_scopes`).
  Control-flow thunks (while, conditional, call) are left out: their bodies' thunks are counted
  themselves (their own overhead is lost). Thunks may run on several threads at once, so the summed
  thunk time is not the wall time: the table gives each bucket's fraction of the summed thunk time,
  the JSON also the seconds per step, the profiled wall time per step, the costliest thunks of
  each bucket and the step's HLO text next to its trace (``step.hlo.txt``).
- **GFLOP/step**: ``compiled.cost_analysis()["flops"]`` (XLA's count; a dict or a list of dicts
  across jax versions). **achieved** = that / step s. **matmul** = FLOP/s of a jitted 2048x2048 @
  2048x2048 float32 matmul (min of 5 reps) in the same process on the same device; **ratio** =
  achieved / matmul, the "fraction of machine limit". On GPU, a bfloat16 matmul's too (JSON).
  XLA counts a while loop's body once, and the step's attention runs in chunked loops, so that count
  is low; **loop-aware GFLOP/step** counts the dots and convolutions only, each times the trip
  counts of its loops (:func:`loop_aware_flops`; padding counted as work), and **loop-aware ratio**
  is its FLOP/s over the matmul's. The truth lies near the loop-aware figure.
- **input wait**: the real input path, timed as the trainer times it: the config's data pipeline
  (task.train_iterator, its workers and augmentations) behind the trainer's ``DeviceFeed``, feeding
  the compiled step for ``--feed-steps`` steps after one warm-up step; ``hooks.Chrono`` reports
  the fraction of wall time the devices sat idle waiting for a batch, i.e. what a training run
  logs as ``train/data_wait_fraction``. ``--feed-steps 0`` skips it.

Prints a markdown table and writes ``--out`` (JSON, with the trace folder of each variant, which
TensorBoard's profile plugin or xprof can open). Timings on a shared 2-core CPU are noisy.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxrat.config_schema import load_config  # noqa: E402
from jaxrat.parallel.mesh import make_mesh  # noqa: E402
from jaxrat.tasks.base import load_task  # noqa: E402
from jaxrat.trainer import hooks  # noqa: E402
from jaxrat.trainer.input_feed import DeviceFeed  # noqa: E402
from jaxrat.trainer.loop import _first_batch, to_global  # noqa: E402
from jaxrat.trainer.state import make_state_spec  # noqa: E402
from jaxrat.trainer.step import make_train_step  # noqa: E402

BUCKETS = ("sga", "mr_blocks", "head", "optimizer", "other")
SCOPES = BUCKETS[:-1]
# A scope as one op_name path component, possibly wrapped by transforms: "sga", "jvp(sga)",
# "transpose(jvp(sga))". The first (outermost) one wins.
_SCOPE_RE = re.compile(r"(?:^|[/(])(" + "|".join(SCOPES) + r")(?=[)/;]|$)")
# A computation's header: "%name (params) -> result {" at the start of a line (its types may hold "=",
# as in "/*index=5*/", so the shape of the line is what tells it from an instruction).
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s([a-z][\w\-]*)\(")
_CONTROL_FLOW = ("while", "conditional", "call")
_COSTLY = ("dot", "convolution")


def bucket_of(op_name: str) -> str:
    """The bucket of an instruction's ``op_name`` metadata ("jit(step)/transpose(jvp(sga))/..." -> "sga")."""
    m = _SCOPE_RE.search(op_name or "")
    return m.group(1) if m else "other"


def _instructions(hlo_text: str):
    """(computation, instruction name, the rest of its line) for every instruction of a module."""
    current = ""
    for line in hlo_text.splitlines():
        m = _COMPUTATION_RE.match(line)
        if m:
            current = m.group(1)
            continue
        m = _INSTRUCTION_RE.match(line)
        if m:
            yield current, *m.groups()


def instruction_scopes(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """From a compiled module's text: (instruction name -> the op_name it is charged to, the names of
    control-flow instructions). Instruction names are unique in a module, so nested computations
    (while bodies, fused computations) need no prefix.

    A fusion is charged to its first dot/convolution that has an op_name (the costly part), else to
    its own op_name (that of its root). XLA drops the metadata of some instructions it creates or
    rewrites (dots out of layout passes, custom fusions): those take the op_name of the nearest user,
    else operand, in their computation (up to 3 hops), else that of the instruction calling the
    computation (a while loop for its body), so they land in the scope they were traced in.
    """
    own: dict[str, str] = {}
    opcode: dict[str, str] = {}
    calls: dict[str, str] = {}
    operands: dict[str, list[str]] = {}
    home: dict[str, str] = {}
    computations: dict[str, list[str]] = defaultdict(list)
    caller: dict[str, str] = {}
    for current, name, rest in _instructions(hlo_text):
        computations[current].append(name)
        home[name] = current
        code = _OPCODE_RE.search(rest)
        opcode[name] = code.group(1) if code else ""
        meta = re.search(r'op_name="([^"]*)"', rest)
        own[name] = meta.group(1) if meta else ""
        body = rest.split(", metadata=", 1)[0]
        operands[name] = re.findall(r"%([\w.\-]+)", body)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called:
            calls[name] = called.group(1)
        for comp in re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)", rest):
            caller.setdefault(comp, name)
    users: dict[str, list[str]] = defaultdict(list)
    for name, ops in operands.items():
        operands[name] = [o for o in ops if o in own and o != name]
        for o in operands[name]:
            users[o].append(name)

    def nearby(name: str, links: dict[str, list[str]]) -> str:
        frontier, seen = [name], {name}
        for _ in range(3):
            frontier = [n for f in frontier for n in links.get(f, ()) if n not in seen and not seen.add(n)]
            for n in frontier:
                if own.get(n):
                    return own[n]
        return ""

    resolved: dict[str, str] = {}

    def resolve(name: str, depth: int = 0) -> str:
        if name in resolved:
            return resolved[name]
        out = ""
        inner = computations.get(calls.get(name, ""), []) if opcode.get(name) == "fusion" else []
        costly = [own[i] for i in inner if opcode.get(i) in _COSTLY and own.get(i)]
        if costly:
            out = costly[0]
        out = out or own.get(name, "") or next((own[i] for i in reversed(inner) if own.get(i)), "")
        out = out or nearby(name, users) or nearby(name, operands)
        if not out and depth < 8 and home.get(name) in caller:
            out = resolve(caller[home[name]], depth + 1)
        resolved[name] = out
        return out

    charged = {name: resolve(name) for name in own}
    control = {n for n, c in opcode.items() if c in _CONTROL_FLOW}
    return charged, control


def _dims(type_str: str) -> list[int]:
    m = re.match(r"\s*[a-z][a-z0-9]*\[([\d,]*)\]", type_str)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def loop_aware_flops(hlo_text: str) -> float:
    """FLOPs of the dots and convolutions of a compiled module, each times the trip counts of the
    while loops around it (XLA's ``known_trip_count``; 1 where unknown).

    ``cost_analysis()`` counts a while loop's body once (checked on jax 0.10.2: a 10-iteration
    fori_loop of a matmul counts as one matmul), and the RAT step runs its attention in chunked loops,
    so XLA's count is a lower bound; this one leaves out elementwise work instead.
    """
    shape: dict[str, list[int]] = {}
    home: dict[str, str] = {}
    loop_of: dict[str, tuple[str, int]] = {}  # body computation -> (its while, trip count)
    caller: dict[str, str] = {}
    ops: list[tuple[str, str, str]] = []
    for current, name, rest in _instructions(hlo_text):
        home[name], shape[name] = current, _dims(rest)
        code = _OPCODE_RE.search(rest)
        opcode = code.group(1) if code else ""
        if opcode in _COSTLY:
            ops.append((name, opcode, rest))
        body = re.search(r"body=%([\w.\-]+)", rest)
        if opcode == "while" and body:
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
            loop_of[body.group(1)] = (name, int(trips.group(1)) if trips else 1)
        for comp in re.findall(r"(?:calls|condition|to_apply|branch_computations)=\{?%([\w.\-]+)", rest):
            caller.setdefault(comp, name)

    def multiplier(comp: str, depth: int = 0) -> int:
        if depth > 32:
            return 1
        if comp in loop_of:
            w, n = loop_of[comp]
            return n * multiplier(home.get(w, ""), depth + 1)
        if comp in caller:
            return multiplier(home.get(caller[comp], ""), depth + 1)
        return 1

    total = 0.0
    for name, opcode, rest in ops:
        args = [a for a in re.findall(r"%([\w.\-]+)", rest.split(", metadata=", 1)[0]) if a in shape]
        out = float(np.prod(shape[name])) if shape[name] else 1.0
        if opcode == "dot" and args:
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            lhs = shape[args[0]]
            k = np.prod([lhs[int(d)] for d in contract.group(1).split(",") if d]) if contract else 1
            flops = 2.0 * out * float(k)
        elif opcode == "convolution" and len(args) > 1:
            labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
            rhs = shape[args[1]]
            o = rhs[labels.group(1).index("o")] if labels and "o" in labels.group(1) else 1
            flops = 2.0 * out * float(np.prod(rhs)) / max(o, 1)
        else:
            continue
        total += flops * multiplier(home[name])
    return total


def module_name(hlo_text: str) -> str:
    m = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
    return m.group(1) if m else ""


def thunk_times(xplane: str, module: str) -> dict[str, float]:
    """Seconds per ``hlo_op`` summed over the trace's thunk events of ``module`` (all threads).

    Device planes ("/device:GPU:0", kernels) when they have such events, else the "/host:CPU" plane:
    on a GPU the host's launch events carry ``hlo_op`` too, and must not be added to the kernels.
    """
    from jax.profiler import ProfileData

    per_plane: dict[str, dict[str, float]] = {"device": defaultdict(float), "host": defaultdict(float)}
    for plane in ProfileData.from_file(xplane).planes:
        kind = "device" if plane.name.startswith("/device:") else "host" if plane.name == "/host:CPU" else ""
        if not kind:
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op and stats.get("hlo_module", module) == module:
                    per_plane[kind][str(op)] += event.duration_ns * 1e-9
    return dict(per_plane["device"] or per_plane["host"])


def bucket_times(thunks: dict[str, float], charged: dict[str, str], control: set[str]) -> dict[str, float]:
    """Seconds per bucket; thunks that are control flow (their bodies are counted) are left out."""
    out = {b: 0.0 for b in BUCKETS}
    for op, seconds in thunks.items():
        if op in control:
            continue
        out[bucket_of(charged.get(op, ""))] += seconds
    return out


def top_thunks(thunks: dict[str, float], charged: dict[str, str], control: set[str], bucket: str,
               n: int = 8) -> list[tuple[str, str, float]]:
    """The ``n`` costliest thunks of ``bucket``: (hlo_op, the op_name it is charged to, seconds)."""
    rows = [(op, charged.get(op, ""), s) for op, s in thunks.items()
            if op not in control and bucket_of(charged.get(op, "")) == bucket]
    return sorted(rows, key=lambda r: -r[2])[:n]


def fractions(buckets: dict[str, float]) -> dict[str, float]:
    total = sum(buckets.values())
    return {b: (s / total if total > 0 else 0.0) for b, s in buckets.items()}


def profile(compiled: Any, run: Callable[[], Any], steps: int, trace_dir: str) -> dict[str, Any]:
    """Run ``run()`` (one step, returning something to wait for) ``steps`` times under the profiler and
    bucket its thunks by scope; ``compiled`` is the step's ``jax.stages.Compiled``."""
    text = compiled.as_text()
    charged, control = instruction_scopes(text)
    os.makedirs(trace_dir, exist_ok=True)
    jax.profiler.start_trace(trace_dir)
    t = time.perf_counter()
    try:
        for _ in range(steps):
            jax.block_until_ready(run())
    finally:
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {trace_dir}")
    Path(trace_dir, "step.hlo.txt").write_text(text)  # to map the trace's hlo_op names again later
    thunks = thunk_times(files[-1], module_name(text))
    buckets = bucket_times(thunks, charged, control)
    top = {b: [(op, name, s / steps) for op, name, s in top_thunks(thunks, charged, control, b)] for b in BUCKETS}
    return {"trace_dir": trace_dir, "xplane": files[-1], "profiled_wall_s_per_step": wall / steps, "top_thunks": top,
            "thunk_s_per_step": {b: s / steps for b, s in buckets.items()},
            "thunk_total_s_per_step": sum(buckets.values()) / steps, "fractions": fractions(buckets),
            "thunks_seen": len(thunks)}


def step_flops(compiled: Any) -> float:
    """XLA's FLOP count of a compiled program (``cost_analysis()`` is a dict, or a list of them)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        return float(sum((c or {}).get("flops", 0.0) for c in cost))
    return float((cost or {}).get("flops", 0.0))


def matmul_flops_per_s(dtype: Any = jnp.float32, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a jitted n x n @ n x n matmul on the default device (min time over reps)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def isic_config(config: str, size: int, batch: int, attention: str) -> Any:
    """``config`` at ``size`` px and global ``batch`` with ``model.rat.attention``, on a small synthetic demo set."""
    c = load_config(config)
    c.data.image_size = size
    c.data.batch_size = batch
    c.data.synthetic = True
    c.data.synthetic_train = max(4 * batch, 16)
    c.data.synthetic_val = 4
    c.data.synthetic_image_size = 0
    c.data.data_dir = ""
    c.model.rat.attention = attention
    return c


class Step:
    """The trainer's compiled train step of ``config`` with its state, carried from call to call, and
    the config's data (written under ``workdir``); the fixed batch is the pipeline's first."""

    def __init__(self, config: Any, workdir: str) -> None:
        self.config = config
        self.mesh = make_mesh(config.mesh.axes)
        self.task = load_task(config)
        self.task.prepare_data(workdir)
        self.spec = make_state_spec(config, self.mesh, self.task)
        self.batch = to_global(_first_batch(self.train_iterator()), self.spec.batch_sharding)
        t = time.perf_counter()
        self.state = self.spec.initialiser()(
            jax.random.key_data(jax.random.key(0)))
        self.compiled = make_train_step(self.spec).lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t

    def train_iterator(self) -> Any:
        return self.task.train_iterator(0, local_batch=self.config.data.batch_size // jax.process_count(),
                                        process_index=jax.process_index(), process_count=jax.process_count(),
                                        processes_on_host=1)

    def __call__(self, batch: Any = None) -> jax.Array:
        self.state, metrics = self.compiled(self.state, self.batch if batch is None else batch)
        return metrics["train/loss"]


def median_step_s(step: Step, steps: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def input_wait(step: Step, steps: int) -> dict[str, float]:
    """The fraction of wall time the devices waited for input over ``steps`` steps fed by the
    config's real pipeline through the trainer's DeviceFeed, measured by the trainer's Chrono."""
    config = step.config
    source = step.train_iterator()
    feed = DeviceFeed(source, lambda b: to_global(b, step.spec.batch_sharding), depth=config.data.device_prefetch)
    try:
        chrono = hooks.Chrono(config.data.batch_size, 0, time.perf_counter())
        batch, waited = feed.next_timed(chrono.devices_busy)
        chrono.step_dispatched(step(batch), waited)  # waits for the first step: workers started, queue filled
        chrono.window()
        out = None
        for _ in range(steps):
            batch, waited = feed.next_timed(chrono.devices_busy)
            out = step(batch)
            chrono.step_dispatched(out, waited)
        jax.block_until_ready(out)
        window = chrono.window()
    finally:
        feed.close()
    return {"input_wait_fraction": window["train/data_wait_fraction"],
            "fed_steps_per_s": window["train/steps_per_sec"], "fed_steps": steps}


def run_variant(args: argparse.Namespace, attention: str, machine: dict, root: str) -> dict:
    config = isic_config(args.config, args.size, args.batch, attention)
    step = Step(config, os.path.join(root, "data"))  # written once, read by every variant
    row: dict[str, Any] = {"variant": attention, "px": args.size, "batch": args.batch, "compile_s": step.compile_s}
    jax.block_until_ready(step())  # warm-up
    row["step_s"], row["step_times_s"] = median_step_s(step, args.steps)
    row.update(profile(step.compiled, step, args.steps, os.path.join(args.trace_dir, attention)))
    row["gflop_per_step"] = step_flops(step.compiled) / 1e9
    row["loop_aware_dot_gflop_per_step"] = loop_aware_flops(step.compiled.as_text()) / 1e9
    row["achieved_gflop_s"] = row["gflop_per_step"] / row["step_s"]
    row["loop_aware_achieved_gflop_s"] = row["loop_aware_dot_gflop_per_step"] / row["step_s"]
    row["matmul_gflop_s"] = machine["matmul_f32_gflop_s"]
    row["fraction_of_machine_limit"] = row["achieved_gflop_s"] / row["matmul_gflop_s"]
    row["loop_aware_fraction_of_machine_limit"] = row["loop_aware_achieved_gflop_s"] / row["matmul_gflop_s"]
    if args.feed_steps:
        row.update(input_wait(step, args.feed_steps))
    return row


def print_table(rows: list[dict]) -> None:
    print("| variant | px | batch | step s | GFLOP/step | achieved GFLOP/s | matmul GFLOP/s | ratio | "
          "loop-aware GFLOP/step | loop-aware ratio | " + " | ".join(BUCKETS) + " | input wait |")
    print("|---" * (11 + len(BUCKETS)) + "|")
    for r in rows:
        wait = f"{r['input_wait_fraction']:.3f}" if "input_wait_fraction" in r else "-"
        print(f"| {r['variant']} | {r['px']} | {r['batch']} | {r['step_s']:.3f} | {r['gflop_per_step']:.2f} | "
              f"{r['achieved_gflop_s']:.1f} | {r['matmul_gflop_s']:.1f} | {r['fraction_of_machine_limit']:.3f} | "
              f"{r['loop_aware_dot_gflop_per_step']:.2f} | {r['loop_aware_fraction_of_machine_limit']:.3f} | "
              + " | ".join(f"{r['fractions'][b]:.3f}" for b in BUCKETS) + f" | {wait} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/isic.py", help="config (e.g. configs/isic.py:demo)")
    parser.add_argument("--variants", nargs="+", default=["dense", "mixed", "sparse"],
                        choices=["dense", "mixed", "sparse", "standard"], help="model.rat.attention values")
    parser.add_argument("--size", type=int, default=64, help="image side in px")
    parser.add_argument("--batch", type=int, default=2, help="global batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled ones")
    parser.add_argument("--feed-steps", type=int, default=4, help="steps fed by the real pipeline (0: skip)")
    parser.add_argument("--trace-dir", default="", help="profiler traces (default: a new temporary folder)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "step_profile.json"))
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    os.chdir(REPO)
    args.trace_dir = os.path.abspath(args.trace_dir or tempfile.mkdtemp(prefix="jaxrat-step-profile-"))
    machine = {"matmul_f32_gflop_s": matmul_flops_per_s(jnp.float32) / 1e9}
    if jax.default_backend() == "gpu":
        machine["matmul_bf16_gflop_s"] = matmul_flops_per_s(jnp.bfloat16) / 1e9
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxrat-step-profile-data-") as root:
        for attention in args.variants:
            rows.append(run_variant(args, attention, machine, root))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("step_times_s", "top_thunks")}),
                  flush=True)
    print_table(rows)
    out = {"rows": rows, "args": vars(args), "trace_dir": args.trace_dir, **machine,
           "backend": jax.default_backend(), "device": str(jax.devices()[0]), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "jax": jax.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

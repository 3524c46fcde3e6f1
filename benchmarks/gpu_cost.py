"""What the trainer's steps cost on an H100, compiled on a machine without a GPU (issue 37).

    python benchmarks/gpu_cost.py                        # ISIC sparse + dense at 256 px x 16, COCO RAT-DETR at 800 px
    python benchmarks/gpu_cost.py --steps isic_sparse    # one step
    python benchmarks/gpu_cost.py --quick                # a tiny RAT step, well under a minute (CI)

XLA compiles for a GPU it does not have when given the GPU's description: ``benchmarks/data/h100_sxm.txtpb``
(NVIDIA's published H100 SXM figures) through ``jax.experimental.topologies`` and the CUDA plugin's compiler
(``bash scripts/setup_gpu_aot.sh``: jax-cuda12-plugin at jax's version, no CUDA libraries, beside the venv).
Each step is the trainer's own (``make_state_spec`` + ``make_train_step``) with ``model.kernels=gpu`` and
bfloat16 compute, as on a GPU, lowered from shapes alone and compiled with XLA's GPU pipeline (no
autotuning: no GPU to time on; Triton GEMMs off, as their tile sizes need autotuning). The optimized
module is read by benchmarks/hlo_cost.py: kernels, bytes, FLOPs and a roofline time per named scope (sga,
mr_blocks, head, loss, optimizer; the rest is "other") and per kernel kind, with the compile time (wall and
CPU) and XLA's account of the device memory. Prints markdown tables and writes ``--out`` (JSON);
``--hlo-dir`` keeps each optimized module's text.

The roofline prices compute at the bf16 matmul rate measured on an H100 (``benchmarks/data/h100_sxm.json``)
and memory at the HBM bandwidth. Against the GPU it is about 2x optimistic (86.4 ms measured vs 35.2 ms
estimated for main b3f90b6's program, 40.0 vs 18.0 ms with the fused kernels): no autotuning, elementwise
FLOPs and caches ignored, a Pallas kernel priced by its operands. The bytes and kernel counts are what to
compare from change to change.

:func:`cost` prices any function this way: ``cost(jax.jit(f), x_shape, w_shape)``, in a process that imports
this module before jax (tests/gpu_cost_probe.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

# Where scripts/setup_gpu_aot.sh installs the CUDA plugin (its compiler, no CUDA libraries): beside the
# venv's site-packages, not in it. Installed there, every JAX process would load it and print its
# "Could not find cuda drivers" lines on stderr, so that a user mistake no longer ends in one sentence.
GPU_AOT_DIR = Path(os.environ.get("JAXRAT_GPU_AOT_DIR") or Path(sys.prefix) / "gpu-aot")


def _find_plugin() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


# Before jax starts: jax looks for the plugin's kernels (Triton, for Pallas) once, at import.
if "jax" not in sys.modules and not _find_plugin() and GPU_AOT_DIR.is_dir():
    sys.path.insert(0, str(GPU_AOT_DIR))
# The plugin is tried at JAX's start unless told otherwise, and fails loudly without a driver; the
# compiler is reached through a topology, not a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_cost import Roofline, kernels_of, summarize  # noqa: E402

# Without a GPU there is nothing to autotune on, and Triton GEMMs need autotuned tile sizes.
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
STEPS = ("isic_sparse", "isic_dense", "coco")


class GpuModel(NamedTuple):
    """A GPU from ``benchmarks/data/<name>.json``: its XLA description and its roofline figures."""

    name: str
    target_config: str  # GpuTargetConfigProto text
    roofline: Roofline
    figures: dict


def load_gpu(name: str = "h100_sxm") -> GpuModel:
    figures = json.loads((DATA / f"{name}.json").read_text())
    roofline = Roofline(flops_per_s=figures["bf16_matmul_measured_flops_per_s"],
                        bytes_per_s=figures["hbm_bytes_per_s"], launch_s=figures["launch_s"])
    return GpuModel(figures["name"], (DATA / figures["target_config"]).read_text(), roofline, figures)


def plugin_missing() -> str | None:
    """Why deviceless GPU compiles cannot run in this process (one sentence), or None when they can."""
    from jax._src import lib

    if not _find_plugin():
        return (f"the CUDA compiler for jax {jax.__version__} is not installed; run bash scripts/setup_gpu_aot.sh "
                f"(jax-cuda12-plugin=={jax.__version__} into {GPU_AOT_DIR}, no CUDA libraries needed).")
    if lib.cuda_versions is None:
        return (f"jax started before the CUDA compiler in {GPU_AOT_DIR} was on its path; import gpu_cost first, "
                "or run python benchmarks/gpu_cost.py in a process of its own.")
    return None


def target_device(gpu: GpuModel) -> jax.Device:
    """A device of the GPU described by ``gpu``: programs can be compiled for it, not run."""
    from jax.experimental import topologies

    why = plugin_missing()
    if why:
        raise RuntimeError(why)
    topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=gpu.target_config,
                                            topology="1x1x1")
    return topology.devices[0]


@contextlib.contextmanager
def pretend_cudnn(version: int = 91000) -> Iterator[None]:
    """jax asks the local cuDNN for its version (and the local GPU for its compute capability) while
    tracing a fused attention call; answer as a GPU node would (cuDNN 9.10, capability 9.0)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    saved = {n: getattr(fa, n) for n in ("check_cudnn_version", "check_compute_capability") if hasattr(fa, n)}
    fa.check_cudnn_version = lambda: version
    if "check_compute_capability" in saved:
        fa.check_compute_capability = lambda *a, **k: True
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(fa, n, f)


def _on(device: jax.Device, tree: Any) -> Any:
    """Shapes of ``tree`` placed on ``device`` where they carry no sharding of their own."""
    one = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                        else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)


def compile_for(fn: Callable, *args: Any, device: jax.Device) -> tuple[Any, dict[str, float]]:
    """``fn`` (jitted or not) compiled for ``device`` from the shapes of ``args``: (compiled, times), the
    times in seconds: ``lower_s``, ``compile_s`` (wall) and ``compile_cpu_s`` (this process's CPU time,
    less sensitive than the wall time to other work on a shared machine)."""
    fn = fn if hasattr(fn, "lower") else jax.jit(fn)
    with pretend_cudnn():
        t = time.perf_counter()
        lowered = fn.lower(*_on(device, args))
        lower_s = time.perf_counter() - t
        t, cpu = time.perf_counter(), time.process_time()
        compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    return compiled, {"lower_s": lower_s, "compile_s": time.perf_counter() - t,
                      "compile_cpu_s": time.process_time() - cpu, "load_avg_1min": os.getloadavg()[0]}


def cost(fn: Callable, *args: Any, gpu: GpuModel | None = None, hlo_path: str = "") -> dict:
    """Kernels, bytes, FLOPs and roofline seconds of ``fn(*args)`` on ``gpu`` (default an H100), in total,
    per named scope and per kernel kind (benchmarks/hlo_cost.py's ``summarize``), with the times taken;
    the optimized module's text is written to ``hlo_path`` if given."""
    gpu = gpu or load_gpu()
    compiled, times = compile_for(fn, *args, device=target_device(gpu))
    text = compiled.as_text()
    if hlo_path:
        Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
        Path(hlo_path).write_text(text)
    return {**summarize(kernels_of(text, gpu.roofline), gpu.roofline), **times, "hlo_chars": len(text),
            "memory": device_memory(compiled)}


def device_memory(compiled: Any) -> dict[str, int]:
    """XLA's account of the compiled program's device memory, in bytes (temporaries are the activations)."""
    m = compiled.memory_analysis()
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    return {f.removesuffix("_size_in_bytes"): int(getattr(m, f, 0) or 0) for f in fields} if m is not None else {}


class Layout(NamedTuple):
    """Devices of a (compile-only) topology, the mesh over them and the ZeRO level (benchmarks/gpu_scaling.py)."""

    devices: list
    axes: tuple[tuple[str, int], ...]
    zero: int = 0
    zero_axis: str = "fsdp"


def _train_step(config: Any, device: jax.Device, batch: Callable[[Any, int, Any], dict],
                num_classes: int = 0, gpu_forms: str = "all", layout: Layout | None = None) -> tuple[Any, Any, dict]:
    """The trainer's step of ``config`` on a one-device mesh of ``device`` (or on ``layout``'s devices and
    mesh): (step, state shapes, batch shapes); ``gpu_forms``: ``model.gpu_forms`` (which fused forms:
    "validated", "all" or names)."""
    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec
    from jaxrat.trainer.step import make_train_step

    config.model.kernels, config.model.gpu_forms = "gpu", gpu_forms
    config.train.compute_dtype = "bfloat16"
    layout = layout or Layout([device], (("data", 1), ("fsdp", 1)))
    config.mesh.axes = layout.axes
    config.sharding.zero, config.sharding.axis = layout.zero, layout.zero_axis
    task = load_task(config)
    if num_classes:
        task.num_classes = num_classes  # what prepare_data would read from the annotations
    spec = make_state_spec(config, make_mesh(config.mesh.axes, devices=layout.devices), task)
    shape = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype, sharding=spec.batch_sharding)  # noqa: E731
    return make_train_step(spec), spec.abstract_with_shardings(), batch(config, config.data.batch_size, shape)


def isic_step(device: jax.Device, size: int = 256, batch: int = 16, attention: str = "sparse",
              config: str = "configs/isic.py", gpu_forms: str = "all", layout: Layout | None = None,
              **rat: Any) -> tuple[Any, Any, dict]:
    """The ISIC RAT train step (``config``, ``model.rat.attention``, any other RAT fields) at ``size`` px,
    ``batch`` images in all (over ``layout``'s devices when given)."""
    from jaxrat.config_schema import load_config

    c = load_config(str(REPO / config))
    c.data.image_size, c.data.batch_size = size, batch
    c.model.rat.update(dict(attention=attention, **rat))
    return _train_step(c, device, lambda c, b, shape: {"image": shape(b, size, size, 3),
                                                       "mask": shape(b, size, size, 1)}, gpu_forms=gpu_forms,
                       layout=layout)


def coco_step(device: jax.Device, size: int = 800, batch: int | None = None,
              gpu_forms: str = "all", layout: Layout | None = None) -> tuple[Any, Any, dict]:
    """The COCO RAT-DETR train step (``configs/coco.py``, its full RAT) at ``size`` px, the config's batch
    (over ``layout``'s devices when given)."""
    from jaxrat.config_schema import load_config

    c = load_config(str(REPO / "configs" / "coco.py"))
    c.data.image_size = size
    c.data.batch_size = batch or c.data.batch_size
    c.train.reduction_shards = 0  # one program for the whole step

    def shapes(c: Any, b: int, shape: Callable) -> dict:
        n = c.task.max_boxes
        return {"image": shape(b, size, size, 3), "pad_mask": shape(b, size, size), "boxes": shape(b, n, 4),
                "labels": shape(b, n, dtype=jnp.int32), "box_valid": shape(b, n)}

    return _train_step(c, device, shapes, num_classes=80, gpu_forms=gpu_forms, layout=layout)


def step_cost(name: str, args: argparse.Namespace, gpu: GpuModel, gpu_forms: str = "all") -> dict:
    device = target_device(gpu)
    if name == "quick":
        made = isic_step(device, 32, 2, "sparse", config="configs/isic.py:demo", gpu_forms=gpu_forms, num_blocks=1)
    elif name.startswith("isic_"):
        made = isic_step(device, args.size, args.batch, name.split("_", 1)[1], gpu_forms=gpu_forms)
    else:
        made = coco_step(device, args.coco_size, args.coco_batch, gpu_forms)
    step, state, batch = made
    px, b = batch["image"].shape[1], batch["image"].shape[0]
    t = time.perf_counter()
    row = cost(step, state, batch, gpu=gpu, hlo_path=os.path.join(args.hlo_dir, f"{name}.hlo") if args.hlo_dir else "")
    from jaxrat.ops.forms import select

    row.update(step=name, px=px, batch=b, wall_s=time.perf_counter() - t, gpu_forms=gpu_forms,
               forms_used=sorted(select(gpu_forms).used))
    return row


def _fmt(row: dict) -> str:
    return (f"{row['kernels']:,} | {row['bytes'] / 1e9:.2f} | {row['flops'] / 1e9:.1f} | "
            f"{row['seconds'] * 1e3:.2f} |")


def print_tables(rows: list[dict], kinds: int = 12) -> None:
    print("| step | model.gpu_forms | px | batch | compile s | compile CPU s | kernels | GB | GFLOP | est. ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['gpu_forms']} | {r['px']} | {r['batch']} | {r['compile_s']:.1f} | "
              f"{r['compile_cpu_s']:.1f} | " + _fmt(r["total"]))
    for r in rows:
        print(f"\n{r['step']} ({r['gpu_forms']}: {', '.join(r['forms_used']) or 'portable forms only'})")
    for r in rows:
        print(f"\n{r['step']} ({r['gpu_forms']}), per named scope:\n\n"
              "| scope | kernels | GB | GFLOP | est. ms |\n|---|---|---|---|---|")
        for scope, s in r["by_scope"].items():
            print(f"| {scope} | " + _fmt(s))
        print(f"\n{r['step']} ({r['gpu_forms']}), per kernel kind (the {kinds} costliest):\n\n"
              "| kind | kernels | GB | GFLOP | est. ms |\n|---|---|---|---|---|")
        for kind, s in list(r["by_kind"].items())[:kinds]:
            print(f"| {kind} | " + _fmt(s))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--quick", action="store_true", help="only a tiny RAT step (32 px), for CI")
    parser.add_argument("--size", type=int, default=256, help="ISIC image side in px")
    parser.add_argument("--batch", type=int, default=16, help="ISIC batch")
    parser.add_argument("--coco-size", type=int, default=800, help="COCO canvas side in px")
    parser.add_argument("--coco-batch", type=int, default=0, help="COCO batch (0: the config's)")
    parser.add_argument("--hlo-dir", default="", help="write each step's optimized HLO text here")
    parser.add_argument("--gpu", default="h100_sxm", help="a description in benchmarks/data/")
    parser.add_argument("--gpu-forms", nargs="+", default=None,
                        help="model.gpu_forms sets to price each step with, side by side (default: the validated "
                             "set and the experimental one, 'validated all'; --quick: 'all')")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_cost.json"))
    args = parser.parse_args(argv)
    args.gpu_forms = args.gpu_forms or (["all"] if args.quick else ["validated", "all"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = plugin_missing()
    if why:
        print(f"gpu_cost: error: {why}", file=sys.stderr)
        return 2
    gpu = load_gpu(args.gpu)
    rows = []
    for name, forms in [(n, f) for n in (["quick"] if args.quick else args.steps) for f in args.gpu_forms]:
        rows.append(step_cost(name, args, gpu, forms))
        r = rows[-1]
        print(f"{name} ({forms}): compiled in {r['compile_s']:.1f} s ({r['compile_cpu_s']:.1f} s CPU; lowered in "
              f"{r['lower_s']:.1f} s; load {r['load_avg_1min']:.1f}; {r['memory'].get('temp', 0) / 2**30:.2f} GiB "
              "of temporaries): "
              f"{r['total']['kernels']:,} kernels, {r['total']['bytes'] / 1e9:.2f} GB", flush=True)
    print_tables(rows)
    out = {"gpu": gpu.figures, "rows": rows, "args": vars(args), "jax": jax.__version__,
           "machine": platform.platform(), "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

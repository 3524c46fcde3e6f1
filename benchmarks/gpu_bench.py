"""The RAT on a GPU: attention kernels per form, the ISIC train step and the COCO RAT-DETR step.

    python benchmarks/gpu_bench.py                 # on a GPU node: the whole table, under ten minutes
    python benchmarks/gpu_bench.py --quick         # small sizes; also runs on a CPU (portable forms only)

Needs nothing but the package (``pip install 'jaxrat[cuda12]'`` or ``[cuda13]``) and this checkout.

**Kernels**, at the shapes of the ISIC RAT's first block (``configs/isic.py``: feature dims, heads,
SGA kernel and stride, MR window) for each ``--sizes`` px image, one image: dense SGA (one grouping
iteration), sparse SGA, global and windowed multi-resolution attention over the first SGA grid.
Each form is timed forward + backward (``jit(value_and_grad)``, median of ``--reps`` after a
warm-up); its memory is XLA's accounting of the compiled program (temporaries + arguments), and
on a GPU the device's peak so far (``memory_stats()``). The forms:

* ``fused``: :mod:`jaxrat.ops.gpu` with ``implementation="auto"`` (cuDNN in bfloat16);
* ``fallback``: the same functions with the named fallback they take where cuDNN refuses (the
  Pallas Triton kernel where its block constraints hold, else the materialised XLA form);
* ``portable``: the memory-efficient XLA kernels of jaxrat.ops (chunked attention, the sparse
  SGA kernel), as every machine runs them today.

A form whose compiled program needs more than the device's memory is reported as such, not run;
an XLA form whose attention matrix alone exceeds it is not even compiled (XLA's autotuner would
try to allocate it). Sparse SGA's ``fused`` form is the Pallas kernels of
:mod:`jaxrat.ops.gpu.sparse_sga` through their token-major API.

**Steps**: the trainer's own train step (``make_state_spec`` + ``make_train_step``, as
benchmarks/step_profile.py builds it) of the ISIC RAT at ``--isic-size`` px (the config's global
batch) in images/s and model FLOP utilisation: FLOPs from the compiled step's ``cost_analysis``
plus the fused attention calls counted analytically from their operand shapes (XLA counts custom
calls as zero: 4 B N T S H per forward call, 10 B N T S H per backward), divided by the step time
and the device's bfloat16 peak, measured in this run with a large bfloat16 matmul. The step time
("step s") is ``--reps`` steps dispatched back to back, as the trainer runs them (it waits for a
step's metrics only at log steps, so the host's dispatch overlaps the device's work); "one step s"
is the median of steps each waited for (latency: dispatch + device). The COCO
RAT-DETR step at ``--coco-size`` px likewise. ``model.kernels`` is set to ``--kernels`` where the
config has that key.

Prints markdown tables and writes ``--out`` (JSON) and the same tables next to it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hlo_calls import fused_attention_calls  # noqa: E402

from jaxrat.config_schema import load_config  # noqa: E402
from jaxrat.ops.gpu import dense_sga, multires_attention, why_not  # noqa: E402

FORMS = ("fused", "fallback", "portable")
KERNELS = ("dense_sga", "sparse_sga", "mr_global", "mr_windowed")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# --------------------------------------------------------------------------- shapes of the RAT


def _strided(n: int, k: int, s: int) -> int:
    return (n + 2 * ((k - 1) // 2) - k) // s + 1


def rat_geometry(config: Any, size: int) -> dict[str, Any]:
    """The first block's attention shapes of ``config``'s RAT on a ``size`` px image (2D)."""
    m = config.model.rat
    kernel = int(m.get("sga_kernel_size", 7))
    stride = int(m.get("stride", None) or max(1, kernel // 2))
    heads = int(m.num_heads)
    out = _strided(size, kernel, stride)
    return {"size": size, "heads": heads, "head_dim": int(m.feature_dims) // heads, "pixels": size * size,
            "grid": (out, out), "groups": out * out, "kernel": kernel, "stride": stride,
            "window": int(m.get("mr_window", 16))}


def fallback_implementation(shapes: list[tuple[int, int, int, int]]) -> str:
    """What ``implementation="auto"`` falls back to when cuDNN refuses: "pallas" where every call
    of the kernel, (queries, keys, dqk, dv), meets its constraints, else "xla"."""
    ok = all(why_not("pallas", nq, nk, dqk, dv, jnp.float32) is None for nq, nk, dqk, dv in shapes)
    return "pallas" if ok and on_gpu() else "xla"  # off a GPU the Triton kernel runs only interpreted


def kernel_cases(geom: dict[str, Any], dtype: Any, forms: tuple[str, ...]) -> dict[str, dict[str, tuple]]:
    """kernel -> form -> (function, argument shapes); forms a kernel does not have are left out."""
    from jaxrat.ops import PORTABLE
    from jaxrat.ops.attention import grouping_attention
    from jaxrat.ops.attention import multires_attention as policy_mr
    from jaxrat.ops.gpu.sparse_sga import sparse_update as fused_sparse_update
    from jaxrat.ops.portable.sparse_sga import Geometry, sparse_blocks, sparse_update

    portable_mr = lambda q, k, v, segments, window: policy_mr(q, k, v, segments, window, PORTABLE)

    h, dh, n, g = geom["heads"], geom["head_dim"], geom["pixels"], geom["groups"]
    grid, win = geom["grid"], geom["window"]
    d = dh + 2
    sga_fb = fallback_implementation([(g, n, dh, dh), (n, g, d, d), (n, g, d, dh)])
    cases: dict[str, dict[str, tuple]] = {}
    q, kv = (1, h, g, dh), (1, h, n, dh)
    cases["dense_sga"] = {
        "fused": (lambda q, k, v: dense_sga(q, k, v, implementation="auto"), (q, kv, kv)),
        "fallback": (lambda q, k, v: dense_sga(q, k, v, implementation=sga_fb), (q, kv, kv), sga_fb),
        "portable": (grouping_attention, (q, kv, kv)),
    }
    sparse = Geometry((geom["size"],) * 2, (geom["kernel"],) * 2, (geom["stride"],) * 2)
    cases["sparse_sga"] = {  # the fused kernels' API is token-major: (batch, tokens, heads, head dim)
        "fused": (lambda q, k, v: fused_sparse_update(q, k, v, sparse), ((1, g, h, dh), (1, n, h, dh), (1, n, h, dh)),
                  "pallas"),
        "portable": (lambda q, k, v: sparse_update(q, sparse_blocks(k, sparse), sparse_blocks(v, sparse), sparse),
                     (q, kv, kv)),
    }
    tokens = (1, g, h, dh)
    segments = [(g, grid)]
    for name, window in (("mr_global", None), ("mr_windowed", win)):
        windowed = window is not None and any(side > window for side in grid)
        t = win * win if windowed else g
        padded = windowed and any(side % window for side in grid)  # masked by key lengths: no Pallas
        fb = "xla" if padded else fallback_implementation([(t, t, dh, dh)])
        cases[name] = {
            "fused": (lambda q, k, v, w=window: multires_attention(q, k, v, segments, w, implementation="auto"),
                      (tokens,) * 3),
            "fallback": (lambda q, k, v, w=window, i=fb: multires_attention(q, k, v, segments, w, implementation=i),
                         (tokens,) * 3, fb),
            "portable": (lambda q, k, v, w=window: portable_mr(q, k, v, segments, w), (tokens,) * 3),
        }
    return {k: {f: c for f, c in forms_.items() if f in forms} for k, forms_ in cases.items()}


def materialised_logits(kernel: str, geom: dict[str, Any]) -> int:
    """Elements of the largest attention matrix the ``kernel``'s materialised XLA form (the "xla"
    fallback) holds in float32: more than the device has means XLA's autotuner and allocator fail
    at compile time, so such a form is not compiled at all."""
    h, n, g, win = geom["heads"], geom["pixels"], geom["groups"], geom["window"]
    if kernel == "dense_sga":
        return h * g * n
    if kernel == "mr_windowed" and any(side > win for side in geom["grid"]):
        windows = int(np.prod([-(-side // win) for side in geom["grid"]]))
        return h * windows * (win * win) ** 2
    if kernel in ("mr_global", "mr_windowed"):
        return h * g * g
    return 0


# --------------------------------------------------------------------------- measuring


def _device_limit() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _peak() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(fn: Callable, shapes: tuple, dtype: Any, reps: int) -> dict[str, Any]:
    """Forward + backward of ``fn`` on random inputs: median ms, XLA's memory, the device peak."""
    keys = jax.random.split(jax.random.key(0), len(shapes))
    args = [(jax.random.normal(k, s, jnp.float32) * 0.5).astype(dtype) for k, s in zip(keys, shapes)]
    step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(len(args)))))
    row: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        compiled = step.lower(*args).compile()
        row["compile_s"] = time.perf_counter() - t
        mem = compiled.memory_analysis()
        need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
        row["xla_gib"] = need / 2**30
        limit = _device_limit()
        if limit and need > limit:
            row["status"] = f"needs {need / 2**30:.1f} GiB > {limit / 2**30:.1f}"
            return row
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - t) * 1e3)
        row.update(status="ok", ms=statistics.median(times), all_ms=times)
        peak = _peak()
        if peak is not None:
            row["device_peak_gib"] = peak / 2**30
    except Exception as e:  # an OOM or a refusal is a result of the table, not the end of the run
        row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def kernel_rows(config: Any, sizes: list[int], forms: tuple[str, ...], dtype: Any, reps: int,
                portable_max_px: int, kernels: tuple[str, ...] = KERNELS) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        geom = rat_geometry(config, size)
        for kernel, by_form in kernel_cases(geom, dtype, forms).items():
            if kernel not in kernels:
                continue
            for form, case in by_form.items():
                impl = case[2] if len(case) > 2 else ("auto" if form == "fused" else "jaxrat.ops")
                row = {"kernel": kernel, "px": size, "form": form, "implementation": impl, "groups": geom["groups"],
                       "pixels": geom["pixels"]}
                logits_gib = 4 * materialised_logits(kernel, geom) / 2**30 if impl == "xla" else 0.0
                limit = _device_limit()
                if form == "portable" and size > portable_max_px and kernel != "sparse_sga":
                    row["status"] = f"skipped (> --portable-max-px {portable_max_px})"
                elif limit and logits_gib * 2**30 > limit:
                    row["status"] = f"not compiled: its logits alone take {logits_gib:.0f} GiB > {limit / 2**30:.1f}"
                else:
                    row.update(measure(case[0], case[1], dtype, reps))
                rows.append(row)
                print(f"  {kernel:12s} {size:5d} px {form:9s} {row['status'][:60]:60s} "
                      f"{row.get('ms', float('nan')):10.2f} ms", flush=True)
    return rows


def fused_attention_flops(stablehlo: str) -> float:
    """FLOPs of the cuDNN fused attention calls of a lowered program, from their q and k shapes."""
    return float(sum(call.flops for call in fused_attention_calls(stablehlo)))


def bf16_peak_flops(n: int, reps: int = 5) -> float:
    """FLOP/s of a jitted n x n bfloat16 matmul on the default device (best of ``reps``)."""
    from step_profile import matmul_flops_per_s

    return matmul_flops_per_s(jnp.bfloat16, n, reps)


def _with_kernels(config: Any, kernels: str, gpu_forms: str = "validated") -> Any:
    if kernels and "kernels" in config.model:
        config.model.kernels = kernels
        config.model.gpu_forms = gpu_forms
    return config


def _time_step(spec: Any, state: Any, batch: Any, reps: int) -> dict[str, Any]:
    from jaxrat.trainer.step import make_train_step

    step = make_train_step(spec)
    lowered = step.lower(state, batch)
    t = time.perf_counter()
    compiled = lowered.compile()
    out: dict[str, Any] = {"compile_s": time.perf_counter() - t}
    cost = compiled.cost_analysis()
    cost = cost if isinstance(cost, (list, tuple)) else [cost]
    out["xla_flops"] = float(sum((c or {}).get("flops", 0.0) for c in cost))
    text = lowered.as_text()
    out["fused_attention_flops"] = fused_attention_flops(text)
    out["fused_attention_calls"] = len(fused_attention_calls(text))
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(reps):  # each step waited for: its latency, the host's dispatch included
        t = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    # The trainer dispatches the next step before the last one is done (it fetches metrics only at log
    # steps), so the host's dispatch overlaps the device's work: its throughput is steps back to back.
    t = time.perf_counter()
    for _ in range(reps):
        state, m = compiled(state, batch)
    jax.block_until_ready((state, m))
    out.update(step_s=(time.perf_counter() - t) / reps, latency_s=statistics.median(times), all_latency_s=times)
    return out


def isic_step(config_path: str, size: int, batch: int, kernels: str, reps: int, attention: str = "",
              gpu_forms: str = "validated") -> dict[str, Any]:
    """The trainer's ISIC RAT train step on synthetic lesions (``attention``: the SGA form, "" = the config's;
    ``gpu_forms``: ``model.gpu_forms``)."""
    spec, state, batch_, row = isic_setup(config_path, size, batch, kernels, attention, gpu_forms)
    row.update(_time_step(spec, state, batch_, reps))
    return row


def isic_setup(config_path: str, size: int, batch: int, kernels: str, attention: str = "",
               gpu_forms: str = "validated", policy: Any = None) -> tuple:
    """(state spec, initial state, one global batch, the row's description) of :func:`isic_step`;
    ``policy``: a kernel policy to build with instead of resolving ``kernels`` and ``gpu_forms``."""
    from step_profile import isic_config

    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.loop import _first_batch, to_global
    from jaxrat.trainer.state import make_state_spec

    base = load_config(config_path)
    config = isic_config(config_path, size, batch or base.data.batch_size, attention or base.model.rat.attention)
    _with_kernels(config, kernels, gpu_forms)
    mesh = make_mesh(config.mesh.axes)
    task = load_task(config)
    with tempfile.TemporaryDirectory(prefix="jaxrat-gpu-bench-") as root:
        task.prepare_data(root)
        spec = make_state_spec(config, mesh, task, kernels=policy)
        data = task.train_iterator(0, local_batch=config.data.batch_size // jax.process_count(),
                                   process_index=jax.process_index(), process_count=jax.process_count(),
                                   processes_on_host=1)
        batch_ = to_global(_first_batch(data), spec.batch_sharding)
    state = spec.initialiser()(jax.random.key_data(jax.random.key(0)))
    row = {"step": "isic_rat", "config": config_path, "px": size, "global_batch": config.data.batch_size,
           "devices": mesh.size, "attention": config.model.rat.attention, "dtype": str(jnp.dtype(spec.dtype)),
           "gpu_forms": sorted(spec.kernels.gpu_forms) if spec.kernels.gpu else []}
    return spec, state, batch_, row


def coco_step(config_spec: str, size: int, batch: int, kernels: str, reps: int,
              gpu_forms: str = "validated") -> dict[str, Any]:
    """The trainer's COCO RAT-DETR train step on blank images with random boxes."""
    import coco_step as coco

    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.trainer.loop import to_global
    from jaxrat.trainer.state import make_state_spec

    config = load_config(config_spec)
    config.data.image_size = size or config.data.image_size
    config.data.batch_size = batch or config.data.batch_size
    _with_kernels(config, kernels, gpu_forms)
    mesh = make_mesh(config.mesh.axes)
    spec = make_state_spec(config, mesh, coco._task(config))
    state = spec.initialiser()(jax.random.key_data(jax.random.key(0)))
    batch_ = to_global(coco._batch(config, config.data.batch_size, np.random.default_rng(0)), spec.batch_sharding)
    row = {"step": "coco_rat_detr", "config": config_spec, "px": int(config.data.image_size),
           "global_batch": config.data.batch_size, "devices": mesh.size, "dtype": str(jnp.dtype(spec.dtype))}
    row.update(_time_step(spec, state, batch_, reps))
    return row


def finish_step(row: dict[str, Any], peak: float) -> dict[str, Any]:
    flops = row["xla_flops"] + row["fused_attention_flops"]
    row["images_per_s"] = row["global_batch"] / row["step_s"]
    row["images_per_s_per_device"] = row["images_per_s"] / row["devices"]
    row["tflops_per_s"] = flops / row["step_s"] / 1e12
    row["mfu"] = flops / row["step_s"] / (peak * row["devices"])
    return row


# --------------------------------------------------------------------------- tables


def kernel_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kernel | px | form | implementation | fwd+bwd ms | XLA GiB | device peak GiB | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:.2f}" if "ms" in r else "-"
        xla = f"{r['xla_gib']:.2f}" if "xla_gib" in r else "-"
        peak = f"{r['device_peak_gib']:.2f}" if "device_peak_gib" in r else "-"
        lines.append(f"| {r['kernel']} | {r['px']} | {r['form']} | {r['implementation']} | {ms} | {xla} | {peak} | "
                     f"{r['status']} |")
    return "\n".join(lines)


def step_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| step | px | global batch | devices | dtype | step s | one step s | images/s | TFLOP/s | MFU "
             "| fused calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    name = lambda r: r["step"] + (f" ({r['attention']})" if r.get("attention") else "")  # noqa: E731
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['step']} | {r.get('px', '-')} | | | | | | | | | {r.get('status', '')} |")
            continue
        lines.append(f"| {name(r)} | {r['px']} | {r['global_batch']} | {r['devices']} | {r['dtype']} | "
                     f"{r['step_s']:.4f} | {r['latency_s']:.4f} | "
                     f"{r['images_per_s']:.1f} | {r['tflops_per_s']:.1f} | {r['mfu']:.1%} | "
                     f"{r['fused_attention_calls']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and batches (runs on a CPU too)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="kernel image sizes in px")
    parser.add_argument("--only", nargs="+", choices=("kernels", "isic", "coco"), default=["kernels", "isic", "coco"])
    parser.add_argument("--config", default="configs/isic.py", help="the RAT whose shapes the kernels take")
    parser.add_argument("--isic-size", type=int, default=0)
    parser.add_argument("--isic-batch", type=int, default=0, help="global batch (0: the config's)")
    parser.add_argument("--isic-attention", nargs="+", default=None,
                        help="SGA forms of the ISIC step (default sparse and dense; --quick: the config's)")
    parser.add_argument("--coco-config", default="configs/coco.py")
    parser.add_argument("--coco-size", type=int, default=0)
    parser.add_argument("--coco-batch", type=int, default=0, help="global batch (0: the config's)")
    parser.add_argument("--kernels", default="gpu", help="model.kernels for the steps, where the config has it")
    parser.add_argument("--gpu-forms", default="validated",
                        help="model.gpu_forms for the steps: validated, all, or form names separated by commas")
    parser.add_argument("--portable-max-px", type=int, default=512,
                        help="largest size at which the slow portable attention kernels are timed")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_bench.json"))
    args = parser.parse_args(argv)
    gpu = on_gpu()
    if args.sizes is None:
        args.sizes = [64] if args.quick else [256, 512, 1024]
    if args.quick:
        args.reps = min(args.reps, 2)
        args.isic_size = args.isic_size or (128 if gpu else 48)
        args.isic_batch = args.isic_batch or 2
        args.coco_size = args.coco_size or 128
        args.coco_batch = args.coco_batch or 2
        if args.config == "configs/isic.py" and not gpu:
            args.config = "configs/isic.py:demo"
    args.isic_size = args.isic_size or 256
    args.isic_attention = args.isic_attention or ([""] if args.quick else ["sparse", "dense"])
    args.coco_size = args.coco_size or 800
    if not gpu:
        args.kernels = "portable" if args.kernels == "gpu" else args.kernels
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.chdir(REPO)  # config paths are the repository's
    gpu = on_gpu()
    # Without a GPU only the XLA forms run (cuDNN and Triton calls lower, they do not run on a CPU).
    forms = FORMS if gpu else ("fallback", "portable")
    dtype = jnp.bfloat16 if gpu else jnp.float32
    result: dict[str, Any] = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                              "backend": jax.default_backend(), "jax": jax.__version__,
                              "platform": platform.platform(), "args": vars(args), "dtype": jnp.dtype(dtype).name,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def save(md: list[str]) -> None:  # after every section: a run stopped at a deadline keeps what it measured
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(result, indent=1, default=str))
        out.with_suffix(".md").write_text("\n\n".join(md) + "\n")

    peak = bf16_peak_flops(8192 if gpu else 1024)
    result["bf16_matmul_tflops"] = peak / 1e12
    print(f"device {result['device_kind']}: bfloat16 matmul {peak / 1e12:.1f} TFLOP/s", flush=True)
    md = [f"# gpu_bench {result['date']}: {result['device_kind']} ({result['backend']}), jax {jax.__version__}, "
          f"bf16 matmul {peak / 1e12:.1f} TFLOP/s"]
    if "kernels" in args.only:
        rows = kernel_rows(load_config(args.config), args.sizes, forms, dtype, args.reps, args.portable_max_px)
        result["kernels"] = rows
        md.append(kernel_table(rows))
        save(md)
    steps = []
    runs = [("isic", lambda a=a: isic_step(args.config, args.isic_size, args.isic_batch, args.kernels, args.reps, a,
                                           args.gpu_forms))
            for a in args.isic_attention]
    runs.append(("coco", lambda: coco_step(args.coco_config, args.coco_size, args.coco_batch, args.kernels,
                                           args.reps, args.gpu_forms)))
    for name, run in runs:
        if name not in args.only:
            continue
        try:
            steps.append(finish_step(run(), peak))
        except Exception as e:
            steps.append({"step": name, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(step_table(steps[-1:]).splitlines()[-1], f"({time.perf_counter() - started:.0f} s in)", flush=True)
        result["steps"] = steps
        save(md + [step_table(steps)])
    if steps:
        md.append(step_table(steps))
    save(md)
    print("\n\n".join(md))
    print(f"wrote {out} and {out.with_suffix('.md')} ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()

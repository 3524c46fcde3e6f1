"""Validate the gpu policy's fused forms on a GPU and write the validation record (jaxrat.ops.forms).

    python benchmarks/gpu_validate.py parity --out DIR       # on a GPU: every form, float32 and bfloat16
    python benchmarks/gpu_validate.py finish --out DIR       # the steps' timings and the demo's Dice into it
    python benchmarks/gpu_validate.py status                 # each form: fingerprint now, validated or not
    python benchmarks/gpu_validate.py seed                   # rebuild the record's first runs from git

``parity`` checks each fused form alone (a policy with only that form, and the forms it requires, against
the portable policy): a small ISIC-like RAT's loss and every gradient (forms of the model; RoSE's rotation
and the upsampling, plain XLA, on their own), the fused
AdamW and moving average against optax's (one step, some skipped), the multi-tensor cast against
``astype``, DETR's masked attention against the portable one. Float32 runs against float32; bfloat16
against float32, beside the portable form's own bfloat16 error. A form whose program at a dtype is the
portable program (it takes no float32 call, e.g. cuDNN) has no figure there. It writes DIR/parity.json
and DIR/validated.json: the repository's record plus a run of every form that passed, fingerprinted to
this checkout; a form that failed is refused (listed, not recorded). scripts/gpu_session.sh runs it first.
Whoever ran it commits DIR/validated.json as jaxrat/ops/gpu/validated.json.

``seed`` rebuilds the record's runs measured before this script existed, each fingerprinted to the code
at the commit that ran (``git show``), its figures as the measurement history (docs/history/) gives them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from jaxrat.ops import forms  # noqa: E402  (pure Python: no jax)


class Refused(ValueError):
    """A run the record does not take: its parity failed."""


# ------------------------------------------------------------------------------------------ the record

def git_reader(commit: str, repo: Path = REPO) -> Callable[[str], Optional[str]]:
    """``read(path)``: the file's text at ``commit`` (None where it did not exist)."""
    def read(path: str) -> Optional[str]:
        out = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None
    return read


def make_run(name: str, read: Optional[Callable] = None, **fields: Any) -> dict[str, Any]:
    """One validation of form ``name``: its fingerprint and sources as ``read`` gives them (default this
    checkout), the blocks it ran with, and ``fields`` (gpu, driver, jax, flax, date, commit, parity_f32,
    parity_bf16, reference_bf16, timing, evidence)."""
    form = forms.FORMS[name]
    sources = forms.source_digests(form, read)
    return {"fingerprint": forms.fingerprint_of(sources, form.blocks), "sources": sources,
            "blocks": dict(form.blocks), **fields}


def add_run(record: dict[str, Any], name: str, run: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``run`` added to form ``name``'s runs; a run whose parity fails is refused."""
    why = forms.parity_failure(run)
    if why is not None:
        raise Refused(f"form {name} is not recorded: {why}.")
    runs = [r for r in record.get("forms", {}).get(name, []) if r != run]
    return {**record, "forms": {**record.get("forms", {}), name: runs + [run]}}


def write_record(path: Path, record: dict[str, Any]) -> None:
    from jaxrat.runtime.fileio import write_text

    about = ("Fused GPU forms validated on a GPU (jaxrat.ops.forms; written by benchmarks/gpu_validate.py). "
             "A form is used by default while its code's fingerprint matches a run here.")
    record = {"format": 1, "about": about, "forms": dict(sorted(record.get("forms", {}).items()))}
    write_text(path, json.dumps(record, indent=1, sort_keys=False) + "\n")


H100 = "NVIDIA H100 80GB HBM3"
# Runs measured before this script, as docs/history/gpu_h100.md reports them (each with its section's title).
SEEDS = [
    ("sparse_sga_tap", "fd6ad17", dict(
        gpu=H100, driver=None, jax="0.11.2", flax="0.12.10", date="2026-11-27",
        parity_f32={"forward_and_every_gradient": 1.3e-6},
        parity_bf16={"u": 4.1e-3, "dq": 6.5e-3, "dk": 8.0e-3, "dv": 5.7e-3},
        reference_bf16={"u": 5.0e-3, "dq": 7.2e-3, "dk": 9.5e-3, "dv": 9.5e-3},
        timing={"isic_step_ms": 40.0, "replaces": "portable sparse SGA (main b3f90b6)", "replaced_isic_step_ms": 91.7,
                "first_layer_fwd_bwd_ms": 3.7, "replaced_first_layer_fwd_bwd_ms": "14.7-15.0"},
        evidence="docs/history/gpu_h100.md, 'The ISIC step on an H100 with fused sparse SGA (2026-11-27, issue 37)'; "
                 "docs/history/gpu_h100.md, 'Since then, on the same GPU kind (2026-11-27)': "
                 "head-major kernels (main fd6ad17), 40.0 ms")),
    ("sparse_sga_tap", "fbc9130", dict(
        gpu=H100, driver=None, jax="0.11.2", flax="0.12.10", date="2026-11-27",
        parity_f32={"normalised_max": 8.6e-7, "plain_max": 5.0e-7},
        parity_bf16={"max": 6.5e-3}, reference_bf16={"max": 1.18e-2},
        timing={"first_layer_fwd_bwd_ms": 4.72, "first_layer_three_uses_fwd_bwd_ms": 11.47,
                "replaced_first_layer_fwd_bwd_ms": 14.49, "replaces": "portable sparse SGA"},
        evidence="docs/history/gpu_h100.md, 'The ISIC step on an H100 with the key/value pass and the fused MLPs "
                 "(2026-11-27, 16:15-16:30 UTC, issue 37)' (main fbc9130; 0e2df86 changed only the MLP)")),
    ("mlp", "0e2df86", dict(
        gpu=H100, driver=None, jax="0.11.2", flax="0.12.10", date="2026-11-27",
        parity_f32={"output": 1.05e-6, "dx": 1.03e-6, "dw1": 4.3e-7, "db1": 1.7e-7, "dw2": 3.1e-7},
        parity_bf16={"output": 3.9e-3, "gradients_max": 5.5e-3},
        reference_bf16={"output": 6.7e-3, "gradients_max": 1.24e-2},
        timing={"isic_step_ms": 40.4, "replaces": "XLA's MLP", "replaced_isic_step_ms": 39.5},
        evidence="docs/history/gpu_h100.md, 'The ISIC step on an H100 with the key/value pass and the fused MLPs "
                 "(2026-11-27, 16:15-16:30 UTC, issue 37)' (the weights' pass recut, 0e2df86)")),
    ("dense_sga", "b3f90b6", dict(
        gpu=H100, driver=None, jax="0.11.2", flax="0.12.10", date="2026-11-26",
        parity_f32=None, parity_bf16={"output": 4.6e-3, "gradients_max": 2.1e-2},
        timing={"note": "the dense-SGA step did not finish compiling and running within 80 s"},
        evidence="docs/history/gpu_h100.md, 'Measured on an NVIDIA H100 80GB HBM3 (2026-11-26, main b3f90b6)': "
                 "fused kernels against the float32 formulas, 128 px (cuDNN takes bfloat16 only)")),
    ("attention", "b3f90b6", dict(
        gpu=H100, driver=None, jax="0.11.2", flax="0.12.10", date="2026-11-26",
        parity_f32=None, parity_bf16={"output": 2.1e-3},
        timing={"isic_step_ms": 91.7, "note": "the whole ISIC step with it (portable sparse SGA)"},
        evidence="docs/history/gpu_h100.md, 'Measured on an NVIDIA H100 80GB HBM3 (2026-11-26, main b3f90b6)': "
                 "MR attention within 2.1e-3 (cuDNN takes bfloat16 only)")),
]


def seed(repo: Path = REPO) -> dict[str, Any]:
    """The record of :data:`SEEDS`, each fingerprinted to its commit's code."""
    record: dict[str, Any] = {"forms": {}}
    for name, commit, fields in SEEDS:
        record = add_run(record, name, make_run(name, git_reader(commit, repo), commit=commit, **fields))
    return record


def status(record: Optional[dict] = None) -> list[dict[str, Any]]:
    """Per form: its fingerprint now, whether a run in ``record`` matches it, and its runs' commits."""
    record = forms.load_record() if record is None else record
    valid = forms.validated(record)
    rows = []
    for name in forms.FORMS:
        runs = record.get("forms", {}).get(name, [])
        rows.append({"form": name, "fingerprint": forms.fingerprint(name), "validated": name in valid,
                     "runs": [f"{r.get('commit') or '?'} ({r['fingerprint']})" for r in runs],
                     "experimental": name in forms.candidates()})
    return rows


# -------------------------------------------------------------------------------------------- parity

def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale


def _errors(got, want) -> dict[str, float]:
    """Largest relative error of the output and of the gradients (each leaf against its largest entry)."""
    import jax

    (v, g), (w, h) = got, want
    grads = [_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(h))]
    return {"output": _rel(v, w), "gradients_max": max(grads) if grads else 0.0}


def form_policy(name: str):
    """The gpu policy with form ``name`` alone (and a form of each operation it requires)."""
    from jaxrat import ops

    chosen = {name} | {n for op in forms.FORMS[name].requires for n in forms.candidates()
                       if forms.FORMS[n].operation == op}
    return ops.KernelPolicy("gpu", gpu_forms=frozenset(chosen), sparse_sga=ops.policy.blocks_of(chosen))


SMALL_RAT = dict(feature_dims=32, num_blocks=1, num_heads=2, iters=2, mlp_dropout=0.0, mr_window=4)


def _model_value_and_grads(policy, dtype, attention: str, size: int):
    """A small ISIC RAT's ``mean(out ** 2)`` and gradients, and the program's jaxpr text."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrat.config_schema import load_config
    from jaxrat.models import build_model

    config = load_config(str(REPO / "configs" / "isic.py"))
    config.model.rat.update(dict(SMALL_RAT, attention=attention))
    config.model.decoder_dim = 16
    model = build_model(config.model, dtype=dtype, rngs=nnx.Rngs(0), kernels=policy)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (2, size, size, 3), jnp.float32)

    def loss(params, x):
        out = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    f = jax.value_and_grad(loss, argnums=(0, 1))
    text = str(jax.make_jaxpr(f)(params, x))
    return jax.jit(f)(params, x), text


def model_parity(name: str, size: int = 64) -> dict[str, Any]:
    """Form ``name`` in a small ISIC RAT (dense SGA for the dense form, else sparse) against the portable
    policy: float32 against float32, bfloat16 against float32, and the portable form's own bfloat16 error."""
    import jax.numpy as jnp

    from jaxrat import ops

    attention = "dense" if name == "dense_sga" else "sparse"
    exact, exact_text = _model_value_and_grads(ops.PORTABLE, jnp.float32, attention, size)
    low, low_text = _model_value_and_grads(ops.PORTABLE, jnp.bfloat16, attention, size)
    policy = form_policy(name)
    f32, f32_text = _model_value_and_grads(policy, jnp.float32, attention, size)
    bf16, bf16_text = _model_value_and_grads(policy, jnp.bfloat16, attention, size)
    return {"parity_f32": None if f32_text == exact_text else _errors(f32, exact),
            "parity_bf16": None if bf16_text == low_text else _errors(bf16, exact),
            "reference_bf16": _errors(low, exact)}


def optimizer_parity(name: str) -> dict[str, Any]:
    """The fused AdamW (six steps, one skipped) against optax's chain, or the fused moving average (a step
    taken and one skipped) against the leaf-by-leaf one; float32."""
    import jax
    import jax.numpy as jnp
    import ml_collections as mlc
    import numpy as np

    from jaxrat.trainer import fused_optimizer
    from jaxrat.trainer.optimizer import global_norm, make_optimizer, update_ema

    cfg = mlc.ConfigDict(dict(optimizer=dict(learning_rate=1e-2, warmup_steps=2, end_learning_rate_factor=0.1,
                                             clip_norm=1.0, b1=0.9, b2=0.99, weight_decay=0.05,
                                             weight_decay_exclude="bias", layer_decay=0.0),
                              sharding=dict(zero=0, rules=()), num_train_steps=10))
    rng = np.random.default_rng(0)
    params = {f"p{i}": jnp.asarray(rng.normal(size=s), jnp.float32)
              for i, s in enumerate([(128, 512), (512,), (3, 3, 32, 32), (1,), (1025,), (64, 64)] * 4)}
    tx, schedule = make_optimizer(cfg.optimizer, cfg.num_train_steps, concatenate_norm=True)
    state = tx.init(params)
    fused = fused_optimizer.fused_adamw(cfg, form_policy(name), {"params": params, "opt_state": state}, schedule)
    if name == "adamw":
        def reference(g, s, p, ok):
            u, s2 = tx.update(g, s, p)
            keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, o)  # noqa: E731
            return keep(jax.tree.map(jnp.add, p, u), p), keep(s2, s)

        a = b = (params, state)
        for step in range(6):
            g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * (3.0 if step % 2 else 0.01),
                                                   jnp.float32), params)
            ok = jnp.asarray(step != 3)
            a = jax.jit(reference)(g, a[1], a[0], ok)
            b = jax.jit(fused.update)(g, b[1], b[0], ok, global_norm(g, concatenate=True))
        err = max(_rel(y, x) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        return {"parity_f32": {"params_and_moments_max": err}, "parity_bf16": None}
    avg = jax.tree.map(lambda p: p * 0.5, params)
    err = 0.0
    for ok in (True, False):
        want = jax.jit(lambda a, p, k: jax.tree.map(lambda n, o: jnp.where(k, n, o),
                                                    update_ema(a, p, jnp.float32(0.99)), a))(avg, params,
                                                                                           jnp.asarray(ok))
        got = jax.jit(lambda a, p, k: fused.ema(a, p, jnp.float32(0.99), k))(avg, params, jnp.asarray(ok))
        err = max([err] + [_rel(y, x) for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got))])
    return {"parity_f32": {"averages_max": err}, "parity_bf16": None}


def cast_parity() -> dict[str, Any]:
    """The multi-tensor cast against ``astype`` (it must be exact: relative error 0)."""
    import jax
    import jax.numpy as jnp

    from jaxrat.optim import gpu_cast as cast

    leaves = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(128, 512), (512,), (7, 9), (1,)] * 3)]
    got = jax.jit(lambda *a: cast.multi_tensor_cast(a, jnp.bfloat16))(*leaves)
    err = max(_rel(g.astype(jnp.float32), x.astype(jnp.bfloat16).astype(jnp.float32)) for g, x in zip(got, leaves))
    return {"parity_f32": None, "parity_bf16": {"against_astype": err}}


def masked_parity() -> dict[str, Any]:
    """DETR's masked attention (packed keys, then cuDNN) against the portable form, bfloat16 against
    float32, with the portable form's own bfloat16 error."""
    import jax
    import jax.numpy as jnp

    from jaxrat import ops
    from jaxrat.ops import attention as A

    ks = jax.random.split(jax.random.key(2), 4)
    q, k, v = (jax.random.normal(kk, (2, n, 4, 32)) for kk, n in zip(ks[:3], (100, 300, 300)))
    ok = jax.random.uniform(ks[3], (2, 300)) < 0.8

    def value_and_grads(policy, dtype):
        def loss(q, k, v):
            padding, (kk, vv) = A.pack_keys(ok, (k, v), policy)
            return jnp.mean(jnp.square(A.masked_attention(q, kk, vv, padding, policy).astype(jnp.float32)))
        args = [x.astype(dtype) for x in (q, k, v)]
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)

    exact = value_and_grads(ops.PORTABLE, jnp.float32)
    return {"parity_f32": None, "parity_bf16": _errors(value_and_grads(form_policy("masked_attention"), jnp.bfloat16),
                                                       exact),
            "reference_bf16": _errors(value_and_grads(ops.PORTABLE, jnp.bfloat16), exact)}


def op_parity(name: str) -> dict[str, Any]:
    """An XLA form alone against the portable one: RoSE's rotation of (2, 256, 4, 16) features, or a
    linear upsampling of a (2, 16, 16, 8) map to 64 x 64; the value and every gradient."""
    import jax
    import jax.numpy as jnp

    from jaxrat import ops
    from jaxrat.ops.resize import resize_linear
    from jaxrat.ops.rotate import rotate_heads

    ks = jax.random.split(jax.random.key(3), 2)
    if name == "rotate":
        args = (jax.random.normal(ks[0], (2, 256, 4, 16)), 3.0 * jax.random.normal(ks[1], (256, 2, 8)))
        f = lambda policy: lambda x, phase: rotate_heads(x, phase, 2, policy)  # noqa: E731
    else:
        args = (jax.random.normal(ks[0], (2, 16, 16, 8)),)
        f = lambda policy: lambda x: resize_linear(x, (64, 64), policy)  # noqa: E731

    def value_and_grads(policy, dtype):
        g = lambda *a: jnp.mean(jnp.sin(f(policy)(*a).astype(jnp.float32)))  # noqa: E731
        low = [args[0].astype(dtype), *args[1:]]  # RoSE's angles stay float32, as in the model
        return jax.jit(jax.value_and_grad(g, argnums=tuple(range(len(args)))))(*low)

    exact = value_and_grads(ops.PORTABLE, jnp.float32)
    policy = form_policy(name)
    return {"parity_f32": _errors(value_and_grads(policy, jnp.float32), exact),
            "parity_bf16": _errors(value_and_grads(policy, jnp.bfloat16), exact),
            "reference_bf16": _errors(value_and_grads(ops.PORTABLE, jnp.bfloat16), exact)}


def parity_of(name: str, size: int = 64) -> dict[str, Any]:
    """Form ``name``'s parity figures (``parity_f32``, ``parity_bf16``, ``reference_bf16``)."""
    if name in ("adamw", "ema"):
        return optimizer_parity(name)
    if name == "cast":
        return cast_parity()
    if name == "masked_attention":
        return masked_parity()
    if name in ("rotate", "resize"):
        return op_parity(name)
    return model_parity(name, size)


def device_fields() -> dict[str, Any]:
    """GPU, driver, jax and flax versions, date and commit, for a run measured here."""
    import flax
    import jax

    driver = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"gpu": jax.devices()[0].device_kind, "driver": driver, "jax": jax.__version__, "flax": flax.__version__,
            "date": datetime.date.today().isoformat(), "commit": commit.stdout.strip() or None}


def run_parity(out: Path, names: list[str], size: int = 64, record: Optional[dict] = None) -> dict[str, Any]:
    """Every form of ``names``: its figures, then the record with the ones that pass (DIR/validated.json).
    A form whose check raises or fails is reported and refused; the others go on."""
    record = forms.load_record() if record is None else record
    fields = device_fields()
    report: dict[str, Any] = {"device": fields, "forms": {}, "recorded": [], "refused": {}}
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t = time.perf_counter()
        try:
            figures = parity_of(name, size)
        except Exception as e:  # a form that does not compile or run here is refused, the rest go on
            figures = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        figures["seconds"] = round(time.perf_counter() - t, 1)
        report["forms"][name] = figures
        print(name, json.dumps(figures), flush=True)
        if "error" in figures:
            report["refused"][name] = figures["error"]
            continue
        run = make_run(name, **fields, **{k: figures.get(k) for k in ("parity_f32", "parity_bf16", "reference_bf16")},
                       timing=None, evidence="benchmarks/gpu_validate.py parity")
        try:
            record = add_run(record, name, run)
            report["recorded"].append(name)
        except Refused as e:
            report["refused"][name] = str(e)
        (out / "parity.json").write_text(json.dumps(report, indent=1) + "\n")
        write_record(out / "validated.json", record)
    (out / "parity.json").write_text(json.dumps(report, indent=1) + "\n")
    write_record(out / "validated.json", record)
    return report


def finish(out: Path) -> dict[str, Any]:
    """DIR/validated.json's runs of this session (``timing`` None) given the ISIC steps' times
    (DIR/step_*.json, gpu_bench's) and the demo's eval Dice (DIR/demo_summary.json)."""
    record = forms.load_record(out / "validated.json")
    steps = {}
    for path in sorted(out.glob("step_*.json")):
        rows = [r for r in json.loads(path.read_text()).get("steps", []) if r.get("step") == "isic_rat"]
        if rows and rows[0].get("step_s"):
            steps[path.stem.removeprefix("step_")] = round(1000 * rows[0]["step_s"], 2)
    demo = None
    if (out / "demo_summary.json").exists():
        demo = json.loads((out / "demo_summary.json").read_text()).get("last_eval", {}).get("eval/dice")
    timing = {"isic_step_ms": steps, "demo_eval_dice": demo}
    for runs in record.get("forms", {}).values():
        for run in runs:
            if run.get("evidence") == "benchmarks/gpu_validate.py parity" and run.get("timing") is None:
                run["timing"] = timing
    write_record(out / "validated.json", record)
    return timing


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("parity", "finish", "status", "seed"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_validate"))
    parser.add_argument("--forms", default="", help="forms to check, separated by commas (default: every form)")
    parser.add_argument("--size", type=int, default=64, help="image size of the small RAT")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.command == "seed":
        write_record(forms.RECORD, seed())
        print(f"wrote {forms.RECORD}")
    elif args.command == "status":
        for row in status():
            print(f"{row['form']:24s} {row['fingerprint']}  {'validated' if row['validated'] else 'not validated':14s}"
                  f" runs: {', '.join(row['runs']) or '-'}")
    elif args.command == "parity":
        names = [n for n in args.forms.split(",") if n] or list(forms.FORMS)
        unknown = [n for n in names if n not in forms.FORMS]
        if unknown:
            parser.error(f"unknown forms {unknown}; known: {sorted(forms.FORMS)}")
        report = run_parity(out, names, args.size)
        print(f"recorded {report['recorded']}; refused {sorted(report['refused'])}")
        return 1 if report["refused"] else 0
    else:
        print(json.dumps(finish(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

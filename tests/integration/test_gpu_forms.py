"""The gpu policy's fused forms by validation (jaxrat.ops.forms): the record, the fingerprints, what
``model.kernels=auto`` takes on a GPU, and the record's writer (benchmarks/gpu_validate.py).

No GPU here: the record is given per test, the sources are edited in a temporary copy, and the gpu
program is lowered for CUDA.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from benchmark_scripts import load
from jaxrat import ops
from jaxrat.config_schema import load_config
from jaxrat.ops import forms
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.trainer.run_summary import kernels_summary
from jaxrat.trainer.state import gpu_forms_line, resolve_kernels
from runner import REPO as _REPO

validate = load("gpu_validate")
REPO = pathlib.Path(_REPO)
GOOD = dict(parity_f32={"output": 1e-6, "gradients_max": 2e-6}, parity_bf16={"output": 4e-3},
            reference_bf16={"output": 6e-3})


def _record(*names: str, read=None) -> dict:
    """A record validating ``names`` as their code is now (or as ``read`` gives it)."""
    record = {"forms": {}}
    for name in names:
        record = validate.add_run(record, name, validate.make_run(name, read, gpu="test", **GOOD))
    return record


def test_the_record_s_first_runs_are_fingerprinted_to_the_code_at_their_commits():
    """jaxrat/ops/gpu/validated.json is what `gpu_validate.py seed` makes from git: each run's sources hashed
    as they were at the commit that ran (a file missing then is None), and the forms changed since are
    not validated."""
    commits = {commit for _, commit, _ in validate.SEEDS}
    for commit in commits:
        if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"]).returncode:
            pytest.skip(f"this clone lacks commit {commit} (shallow)")
    assert json.loads(forms.RECORD.read_text())["forms"] == validate.seed()["forms"]
    record = forms.load_record()
    tap = {r["commit"]: r for r in record["forms"]["sparse_sga_tap"]}
    assert set(tap) == {"fd6ad17", "fbc9130"} and tap["fd6ad17"]["parity_f32"] == {"forward_and_every_gradient": 1.3e-6}
    assert tap["fd6ad17"]["sources"]["jaxrat/ops/gpu/sparse_sga/tiles.py"] is None  # no such file then
    assert tap["fd6ad17"]["blocks"] == {"products": False, "sweep_rows": 0}
    # every form's code changed after it ran, so nothing is validated yet
    assert forms.validated(record) == frozenset()
    assert ops.resolve("auto", "gpu").gpu_forms == frozenset()


def test_auto_on_a_gpu_takes_a_validated_form_and_holds_back_the_rest():
    policy = ops.resolve("auto", "gpu", validated=forms.validated(_record("mlp", "attention")))
    assert policy.gpu and policy.gpu_forms == {"mlp", "attention"}
    assert policy.uses("mlp") and not policy.uses("sparse_sga_sweep") and not policy.uses("layer_norm")
    # the same names on a CPU: the cpu form, no GPU form used
    assert not ops.resolve("auto", "cpu", validated=forms.validated(_record("mlp"))).uses("mlp")
    everything = ops.resolve("gpu", gpu_forms="all", validated=frozenset())
    assert everything.gpu_forms == forms.candidates() and "sparse_sga_products" not in everything.gpu_forms
    named = ops.resolve("gpu", gpu_forms="layer_norm, sparse_sga_products", validated=forms.validated(_record("mlp")))
    assert named.gpu_forms == {"mlp", "layer_norm", "sparse_sga_products"}
    assert named.sparse_sga.products and named.sparse_sga.sweep_rows == 8


def test_a_form_whose_source_changed_after_validation_falls_back(tmp_path, monkeypatch):
    """The record validates the fused MLP and the sweeping sparse SGA as their code is; a copy of the
    package with one line of the MLP kernel changed then resolves ``auto`` without it (the portable MLP),
    and without the sweeps once the sweep module's code changes (its comments and docstring do not
    count): the tap form, older, is still validated."""
    record = _record("mlp", "sparse_sga_sweep", "sparse_sga_tap")
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "jaxrat", copy / "jaxrat", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(forms, "ROOT", copy)
    before = ops.resolve("auto", "gpu", validated=forms.validated(record))
    assert before.gpu_forms == {"mlp", "sparse_sga_sweep"} and before.sparse_sga.sweep_rows == 8

    mlp = copy / "jaxrat/ops/gpu/mlp.py"
    mlp.write_text(mlp.read_text().replace("CHUNK = 128", "CHUNK = 64", 1))
    assert "mlp" not in ops.resolve("auto", "gpu", validated=forms.validated(record)).gpu_forms

    sweep = copy / "jaxrat/ops/gpu/sparse_sga/sweep.py"
    sweep.write_text(sweep.read_text().replace('"""', '"""Reworded. ', 1) + "\n# a comment\n")
    assert "sparse_sga_sweep" in ops.resolve("auto", "gpu", validated=forms.validated(record)).gpu_forms
    sweep.write_text(sweep.read_text() + "\nCHANGED = True\n")
    after = ops.resolve("auto", "gpu", validated=forms.validated(record))
    assert after.gpu_forms == {"sparse_sga_tap"} and after.sparse_sga.sweep_rows == 0  # the passes apart
    line = forms.Selection(after.gpu_forms, forms.candidates() - after.gpu_forms, "validated").line()
    assert "using sparse_sga_tap;" in line and "mlp" in line.split("held back")[1]


def test_the_run_logs_and_records_the_forms_it_uses(monkeypatch):
    config = load_config("configs/isic.py:smoke")
    mesh = make_mesh(config.mesh.axes)
    monkeypatch.setattr(ops.policy, "platform_of", lambda devices=None: "gpu")
    monkeypatch.setattr(forms, "validated", lambda record=None, fingerprints=None: frozenset({"layer_norm"}))
    kernels = resolve_kernels(config, mesh)
    assert kernels.gpu_forms == {"layer_norm"}
    line = gpu_forms_line(config, kernels)
    assert line.startswith("GPU forms (validated): using layer_norm; held back") and "sparse_sga_sweep" in line
    summary = json.loads(json.dumps(kernels_summary(config, kernels)))
    assert summary["gpu_forms"] == ["layer_norm"] and "mlp" in summary["gpu_forms_held_back"]
    assert summary["sparse_sga"] == {"products": False, "sweep_rows": 8, "input_grad_features": 256}
    config.model.gpu_forms = "all"
    assert resolve_kernels(config, mesh).gpu_forms == forms.candidates()
    config.model.gpu_forms = "mlp,fast_attention"
    with pytest.raises(ConfigError, match=r"^config.model.gpu_forms names unknown forms \['fast_attention'\]; "
                                          r"use 'validated', 'all' or names"):
        resolve_kernels(config, mesh)


def test_the_record_refuses_a_form_whose_parity_failed(tmp_path):
    run = lambda **figures: validate.make_run("mlp", gpu="test", **figures)  # noqa: E731
    record = validate.add_run({"forms": {}}, "mlp", run(**GOOD))
    for figures, why in [(dict(parity_f32={"dx": 2e-5}), "float32 error 2.00e-05 exceeds 1e-05"),
                         (dict(parity_f32={"dx": float("nan")}), "not finite"),
                         (dict(parity_f32=None, parity_bf16=None), "no parity figure"),
                         (dict(parity_bf16={"u": 9e-3}, reference_bf16={"u": 5e-3}), "1.5 x the portable form's"),
                         (dict(parity_bf16={"u": 0.2}), "bfloat16 error 2.00e-01 exceeds 5e-02")]:
        with pytest.raises(validate.Refused, match=re.escape(why)):
            validate.add_run(record, "mlp", run(**figures))
    validate.write_record(tmp_path / "validated.json", record)
    written = forms.load_record(tmp_path / "validated.json")
    assert written["format"] == 1 and forms.validated(written) == {"mlp"}
    # a record edited by hand to hold a failing run validates nothing
    written["forms"]["mlp"][0]["parity_f32"]["dx"] = 1e-3
    assert forms.validated(written) == frozenset()


def test_the_parity_stage_records_what_passes_and_goes_on_past_a_failure(tmp_path, monkeypatch):
    """run_parity with one form that passes, one whose figures fail and one whose check raises: the first
    is recorded (fingerprinted to this checkout), the others refused, each named, and the stage goes on."""
    def parity_of(name, size):
        if name == "layer_norm":
            raise RuntimeError("Failed to compile Triton kernel\nmore lines")
        return GOOD if name == "mlp" else dict(GOOD, parity_f32={"output": 3e-4})

    monkeypatch.setattr(validate, "parity_of", parity_of)
    monkeypatch.setattr(validate, "device_fields", lambda: {"gpu": "test", "date": "2026-11-29"})
    report = validate.run_parity(tmp_path, ["mlp", "layer_norm", "rotate"], record={"forms": {}})
    assert report["recorded"] == ["mlp"]
    assert report["refused"] == {"layer_norm": "RuntimeError: Failed to compile Triton kernel",
                                 "rotate": "form rotate is not recorded: float32 error 3.00e-04 exceeds 1e-05 "
                                           "against the portable form."}
    written = forms.load_record(tmp_path / "validated.json")
    assert forms.validated(written) == {"mlp"} and written["forms"]["mlp"][0]["fingerprint"] == forms.fingerprint("mlp")
    assert json.loads((tmp_path / "parity.json").read_text())["forms"]["layer_norm"]["error"]


@pytest.mark.parametrize("name", ["rotate", "resize"])
def test_an_xla_form_s_parity_runs_here(name):
    """The parity harness itself on this CPU, for the forms that are plain XLA (RoSE's rotation, the
    upsampling gathers): float32 and bfloat16 figures against the portable form's float32, beside the
    portable form's own bfloat16; both pass."""
    figures = validate.parity_of(name)
    assert set(figures) == {"parity_f32", "parity_bf16", "reference_bf16"}
    assert max(figures["parity_f32"].values()) < 1e-5 and forms.parity_failure(figures) is None, figures


def test_the_session_s_commands_run_here_for_the_xla_forms(tmp_path, monkeypatch, capsys):
    """gpu_session.sh's first and last stages on this CPU, for the two forms that are plain XLA: `parity`
    records both into DIR/validated.json (the repository's record plus them), which, named by
    $JAXRAT_GPU_RECORD, is then what ``auto`` on a GPU reads; `finish` adds the steps' times and the demo's
    Dice to this session's runs only."""
    assert validate.main(["parity", "--forms", "rotate,resize", "--out", str(tmp_path)]) == 0
    assert "recorded ['rotate', 'resize']; refused []" in capsys.readouterr().out
    monkeypatch.setenv("JAXRAT_GPU_RECORD", str(tmp_path / "validated.json"))
    assert ops.resolve("auto", "gpu").gpu_forms == {"rotate", "resize"}
    (tmp_path / "step_all.json").write_text(json.dumps({"steps": [{"step": "isic_rat", "step_s": 0.0212}]}))
    (tmp_path / "demo_summary.json").write_text(json.dumps({"last_eval": {"eval/dice": 0.9895}}))
    assert validate.main(["finish", "--out", str(tmp_path)]) == 0
    record = forms.load_record()
    assert record["forms"]["rotate"][-1]["timing"] == {"isic_step_ms": {"all": 21.2}, "demo_eval_dice": 0.9895}
    assert record["forms"]["mlp"][0]["timing"]["isic_step_ms"] == 40.4  # the earlier runs keep theirs


def test_kernel_switches_are_values_not_module_globals():
    hits = [f"{p}:{i}" for p in (REPO / "jaxrat" / "ops").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"(ENABLED|PRODUCTS|ROWS)\b", line)]
    assert not hits, hits
    with pytest.raises(ValueError, match="sweep_rows and input_grad_features must be >= 0"):
        ops.policy.SparseSGABlocks(sweep_rows=-1)
    with pytest.raises(ValueError, match=r"unknown GPU forms \['fast'\]"):
        ops.KernelPolicy("gpu", gpu_forms={"fast"})


@pytest.mark.slow
def test_the_auto_program_lowered_for_cuda_holds_only_the_record_s_forms(monkeypatch):
    """A small RAT (sparse SGA, windowed MR) in bfloat16, forward and backward, built with ``auto`` on a GPU
    whose record validates the fused MLP only: lowered for CUDA, its only custom calls are the MLP's three
    Triton kernels; sparse SGA, the layer norms and the MR attention take their portable forms."""
    from jax._src.cudnn import fused_attention_stablehlo

    from jaxrat.models import build_model
    from model_configs import rat_model

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    policy = ops.resolve("auto", "gpu", validated=forms.validated(_record("mlp")))
    cfg = rat_model(num_classes=1, feature_dims=32, num_blocks=1, num_heads=2, iters=1, decoder_dim=16,
                    mlp_dropout=0.0, attention="sparse", mr_attention="windowed", mr_window=4)
    graphdef, params, rest = nnx.split(build_model(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=policy),
                                       nnx.Param, ...)
    grads = jax.grad(lambda p, x: jnp.mean(nnx.merge(graphdef, p, rest)(x).astype(jnp.float32) ** 2))
    text = jax.jit(grads).trace(params, jnp.zeros((2, 64, 64, 3))).lower(lowering_platforms=("cuda",)).as_text()
    targets = set(re.findall(r"custom_call @([\w$.]+)\(", text))
    names = set(re.findall(r'name = \\?"([a-z_0-9]+)', text))
    assert targets == {"__gpu$xla.gpu.triton"}, targets
    assert {n for n in names if n.startswith(("fused_", "sparse_", "layer_norm"))} == {
        "fused_mlp_forward", "fused_mlp_inputs", "fused_mlp_weights"}


def test_the_record_ships_with_the_package():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"ops/gpu/validated.json"' in pyproject and pathlib.Path(forms.RECORD).is_file()

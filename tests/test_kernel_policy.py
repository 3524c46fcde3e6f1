"""The kernel policy: the model states the math, the policy picks the kernels, chosen from the target.

A model built with the ``gpu`` policy on this CPU machine traces the GPU program, which lowers for
CUDA here; the CPU kernels (:mod:`jaxrat.ops.cpu`, all under one named scope) appear only in the
``cpu`` policy's program.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.config import check_override_args, load_config
from jaxrat.errors import ConfigError
from jaxrat.models import build_model
from jaxrat.models.rat.config import field_names
from jaxrat.ops.cpu import SCOPE
from jaxrat.parallel.mesh import make_mesh
from jaxrat.tasks.base import load_task
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import make_train_step
from model_configs import rat_model
from runner import REPO

RAT_CONFIGS = ["configs/isic.py", "configs/isic_multiscale.py", "configs/ablations.py", "configs/coco.py",
               "configs/classification.py:rat"]


def test_model_code_never_asks_which_machine_it_runs_on():
    models = pathlib.Path(REPO, "jaxrat", "models")
    hits = [f"{p}:{i}" for p in models.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if "default_backend" in line or re.search(r"^\s*(from|import) jaxrat\.ops\.(cpu|gpu)", line)]
    assert not hits, hits


@pytest.mark.parametrize("spec", RAT_CONFIGS)
def test_every_rat_option_is_settable_and_a_misspelt_one_is_refused(spec):
    config = load_config(spec)
    assert set(config.model.rat) == set(field_names())
    values = {"mr_attention": "windowed", "mr_window": "8", "remat": "blocks", "attention": "mixed",
              "num_heads": "4", "scales": "(64,32)", "stride": "2", "spacing": "(1.0,2.0)", "reference_compat": "true"}
    check_override_args([f"--config={spec}", "--config.model.kernels=portable"] +
                        [f"--config.model.rat.{k}={v}" for k, v in values.items()])
    with pytest.raises(ConfigError, match=r"did you mean --config\.model\.rat\.mr_attention\?"):
        check_override_args([f"--config={spec}", "--config.model.rat.mr_atention=windowed"])
    with pytest.raises(ConfigError, match=r"did you mean --config\.model\.kernels\?"):
        check_override_args([f"--config={spec}", "--config.model.kernel=gpu"])


def test_an_unknown_policy_is_one_sentence():
    with pytest.raises(ConfigError, match="config.model.kernels: model.kernels must be one of"):
        build_model(rat_model(num_classes=1, feature_dims=8, num_blocks=1, num_heads=2, kernels="cuda"),
                    rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fields", [dict(attention="dense"), dict(attention="sparse", mr_attention="windowed",
                                                                  mr_window=4, scales=(24, 12))])
def test_cpu_and_portable_policies_compute_the_same_model(fields):
    cfg = rat_model(num_classes=1, feature_dims=16, num_blocks=2, num_heads=2, iters=1, decoder_dim=8, **fields)
    x = jax.random.normal(jax.random.key(0), (2, 24, 24, 3))

    def loss_and_grads(kernels):
        model = build_model(cfg, rngs=nnx.Rngs(0), kernels=kernels)
        return nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2)))(model)

    (l_cpu, g_cpu), (l_port, g_port) = loss_and_grads("cpu"), loss_and_grads("portable")
    np.testing.assert_allclose(l_cpu, l_port, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(g_cpu)), jax.tree.leaves(nnx.state(g_port))):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def _isic_step(kernels: str, size: int, **rat):
    config = load_config("configs/isic.py")
    config.model.kernels = kernels
    config.model.rat.update(rat)
    config.data.image_size = size
    config.data.batch_size = 2
    config.mesh.axes = (("data", 2), ("fsdp", 1))
    mesh = make_mesh(config.mesh.axes, jax.devices()[:2])
    spec = make_state_spec(config, mesh, load_task(config))
    batch = {"image": jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32, sharding=spec.batch_sharding),
             "mask": jax.ShapeDtypeStruct((2, size, size, 1), jnp.float32, sharding=spec.batch_sharding)}
    return spec, make_train_step(spec), batch


@pytest.mark.slow
def test_the_gpu_program_lowers_for_cuda_here_and_holds_no_cpu_kernel():
    """The ISIC RAT step (sparse SGA, windowed MR, 256 px) built with the gpu policy, lowered for CUDA on
    this CPU machine: no op of the CPU kernels; with the cpu policy, lowered for CPU, they are there."""
    spec, step, batch = _isic_step("gpu", 256)
    assert spec.kernels.form == "gpu"
    gpu_text = step.trace(spec.abstract_with_shardings(), batch).lower(
        lowering_platforms=("cuda",)).as_text(debug_info=True)
    assert SCOPE not in gpu_text and "cuda" in gpu_text.lower()
    spec, step, batch = _isic_step("cpu", 256)
    cpu_text = step.trace(spec.abstract_with_shardings(), batch).lower().as_text(debug_info=True)
    assert SCOPE in cpu_text  # the strided convolutions, the rotation's backward


def test_the_policy_is_resolved_once_from_the_mesh_and_recorded():
    spec, _, _ = _isic_step("auto", 32, feature_dims=8, num_blocks=1, num_heads=2, iters=1)
    assert spec.kernels.form == "cpu" and spec.kernels == ops.resolve("cpu")
    spec, _, _ = _isic_step("portable", 32, feature_dims=8, num_blocks=1, num_heads=2, iters=1)
    assert spec.kernels == ops.PORTABLE

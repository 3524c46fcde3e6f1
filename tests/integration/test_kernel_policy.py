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
from jaxrat.config_schema import check_override_args, load_config
from jaxrat.models import build_model
from jaxrat.models.rat.config import field_names
from jaxrat.ops.cpu import SCOPE
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.trainer.state import check_kernels_run_here, make_state_spec, resolve_kernels
from jaxrat.trainer.step import make_train_step
from model_configs import TINY_IMAGES, TINY_RAT, mean_square_and_grads, rat_model
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
    config = load_config("configs/isic.py:smoke")
    config.model.kernels = "cuda"
    with pytest.raises(ConfigError, match="config.model.kernels: model.kernels must be one of"):
        resolve_kernels(config, make_mesh(config.mesh.axes))


def test_models_take_a_resolved_policy_only():
    """Resolving reads the devices, which model code must not do: a name is refused in one sentence."""
    with pytest.raises(TypeError, match=r"resolve a name once with jaxrat.ops.resolve\('auto'\)"):
        build_model(rat_model(num_classes=1, feature_dims=8, num_blocks=1, num_heads=2), rngs=nnx.Rngs(0),
                    kernels="auto")


# The cpu form of these models is test_window_attention's too: the same programs, compiled once per run.
@pytest.mark.parametrize("fields", [dict(attention="dense"), dict(attention="sparse", mr_attention="windowed",
                                                                  mr_window=3, scales=(24, 12))])
def test_cpu_and_portable_policies_compute_the_same_model(fields):
    cfg = rat_model(num_classes=1, **TINY_RAT, **fields)
    x = jax.random.normal(jax.random.key(0), TINY_IMAGES)

    def loss_and_grads(kernels):
        return mean_square_and_grads(build_model(cfg, rngs=nnx.Rngs(0), kernels=ops.resolve(kernels)), x)

    (l_cpu, g_cpu), (l_port, g_port) = loss_and_grads("cpu"), loss_and_grads("portable")
    np.testing.assert_allclose(l_cpu, l_port, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(g_cpu)), jax.tree.leaves(nnx.state(g_port))):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def _isic_step(kernels: str, size: int, devices: int = 2, dtype: str = "auto", gpu_forms: str = "all", **rat):
    config = load_config("configs/isic.py")
    config.model.kernels, config.model.gpu_forms = kernels, gpu_forms
    config.model.rat.update(rat)
    config.data.image_size = size
    config.data.batch_size = 2
    config.train.compute_dtype = dtype
    config.mesh.axes = (("data", devices), ("fsdp", 1))
    mesh = make_mesh(config.mesh.axes, jax.devices()[:devices])
    spec = make_state_spec(config, mesh, load_task(config))
    batch = {"image": jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32, sharding=spec.batch_sharding),
             "mask": jax.ShapeDtypeStruct((2, size, size, 1), jnp.float32, sharding=spec.batch_sharding)}
    return spec, make_train_step(spec), batch


@pytest.fixture
def cudnn_version(monkeypatch):
    """jax asks the local cuDNN for its version while tracing a fused call; give it one (9.10) so the
    program a GPU would run can be traced and lowered here."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([\dx]+)x(\w+)>, tensor<([\dx]+)x(\w+)>\).*loc\((#loc\d+)\)")
# RoSE's angles (grid positions times frequencies, two spatial coordinates deep) stay float32 by
# design: a bfloat16 angle is off by whole turns at large positions. Forward they are products and
# sums; backward two matrix products over the positions (jaxrat/models/rat/rose.py, _phase).
FLOAT32_BY_DESIGN = ("nhp,hpd->...nd", "nhp,...nd->hpd")  # RoSE angles (jaxrat/ops/rotate.py)


def _big_dots(text: str, elements: int = 1 << 18) -> set[str]:
    """The operand dtypes of the matmuls whose operands both hold at least ``elements`` values
    (``text`` lowered with debug info, so that each matmul names the einsum it comes from)."""
    size = lambda dims: int(np.prod([int(d) for d in dims.split("x")]))
    where = dict(re.findall(r"^(#loc\d+) = (.*)$", text, re.M))
    return {f"{a}/{b}" for da, a, db, b, loc in _DOT.findall(text)
            if size(da) >= elements and size(db) >= elements and not any(e in where.get(loc, "")
                                                                        for e in FLOAT32_BY_DESIGN)}


@pytest.mark.slow
@pytest.mark.parametrize("attention,mr_attention,backward_calls,triton_calls", [
    # a flash-decomposed dense SGA per layer and iteration, one MR call per block
    ("dense", "global", 4 * 3 + 4, 0),
    # sparse SGA: two fused Pallas kernels forward and one backward per layer and iteration (two of the
    # five passes sweep together each way), and one per layer for its keys' and values' gradients, and
    # the first layer's projection (its 65,536 inputs tile by 64; the others' do not); each block's MR:
    # the windows, or the small grid whole
    ("sparse", "windowed", 4, 4 * (3 * 3 + 1) + 1),
])
def test_the_gpu_isic_step_is_fused_attention_in_bfloat16(cudnn_version, attention, mr_attention, backward_calls,
                                                           triton_calls):
    """The ISIC RAT train step at 256 px with the gpu policy, lowered for CUDA on this CPU machine: every
    attention a cuDNN call or a fused Pallas (Triton) kernel (counted against the model's attention
    layers), the MLPs, layer norms and the AdamW update fused Pallas kernels, no while loop from chunking, the large
    matmuls in bfloat16."""
    from benchmark_scripts import load

    fused_attention_calls = load("hlo_calls").fused_attention_calls

    spec, step, batch = _isic_step("gpu", 256, devices=1, dtype="bfloat16", attention=attention,
                                   mr_attention=mr_attention)
    text = step.trace(spec.abstract_with_shardings(), batch).lower(lowering_platforms=("cuda",)).as_text(
        debug_info=True)
    calls = fused_attention_calls(text)
    assert sum(c.backward for c in calls) == backward_calls
    names = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"', text)
    assert sum(n.startswith("sparse_sga_") for n in names) == triton_calls
    # the rest: the MLPs' fused kernels (forward, inputs' and weights' gradients), the layer norms', the
    # AdamW's, the weights' casts', every one of them
    assert {n for n in names if not n.startswith("sparse_sga_")} == {
        "fused_mlp_forward", "fused_mlp_inputs", "fused_mlp_weights", "layer_norm_forward", "layer_norm_backward",
        "multi_tensor_adamw", "multi_tensor_cast"}
    assert "stablehlo.while" not in text
    assert _big_dots(text) == {"bf16/bf16"}, _big_dots(text)


@pytest.mark.slow
def test_the_gpu_coco_rat_detr_step_is_fused_attention(cudnn_version):
    """The COCO RAT-DETR step (800 px, its real config) lowered for CUDA with the gpu policy: the RAT's
    windowed MR blocks and the decoder's self- and cross-attention are cuDNN calls, with no loop."""
    from benchmark_scripts import load

    fused_attention_calls = load("hlo_calls").fused_attention_calls

    config = load_config("configs/coco.py")
    config.model.kernels, config.model.gpu_forms = "gpu", "all"
    config.train.compute_dtype = "bfloat16"
    config.data.batch_size = 1
    config.mesh.axes = (("data", 1), ("fsdp", 1))
    mesh = make_mesh(config.mesh.axes, jax.devices()[:1])
    task = load_task(config)
    task.num_classes = 80  # what prepare_data reads from the annotations
    spec = make_state_spec(config, mesh, task)
    size, boxes = config.data.image_size, config.task.max_boxes
    shape = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype, sharding=spec.batch_sharding)
    batch = {"image": shape(1, size, size, 3), "pad_mask": shape(1, size, size), "boxes": shape(1, boxes, 4),
             "labels": shape(1, boxes, dtype=jnp.int32), "box_valid": shape(1, boxes)}
    text = make_train_step(spec).trace(spec.abstract_with_shardings(), batch).lower(
        lowering_platforms=("cuda",)).as_text(debug_info=True)
    calls = fused_attention_calls(text)
    layers = int(config.model.decoder_layers)
    assert sum(c.backward for c in calls) == 4 + 2 * layers  # 4 MR blocks, self + cross per decoder layer
    assert _big_dots(text) == {"bf16/bf16"}, _big_dots(text)


@pytest.mark.slow
def test_the_gpu_program_lowers_for_cuda_here_and_holds_no_cpu_kernel():
    """The ISIC RAT step (sparse SGA, windowed MR, 256 px) built with the gpu policy, lowered for CUDA on
    this CPU machine: no op of the CPU kernels; with the cpu policy, lowered for CPU, they are there."""
    spec, step, batch = _isic_step("gpu", 256)
    assert spec.kernels.form == "gpu"
    gpu_text = step.trace(spec.abstract_with_shardings(), batch).lower(
        lowering_platforms=("cuda",)).as_text(debug_info=True)
    assert SCOPE not in gpu_text and "cuda" in gpu_text.lower()
    # XLA cannot split a Triton call: on 2 devices the sparse SGA kernels run per device (shard_map),
    # not on a batch gathered onto each
    assert "__gpu$xla.gpu.triton" in gpu_text and re.search(r"sdy\.manual_computation|SPMDFullToShardShape", gpu_text)
    spec, step, batch = _isic_step("cpu", 256)
    cpu_text = step.trace(spec.abstract_with_shardings(), batch).lower().as_text(debug_info=True)
    assert SCOPE in cpu_text  # the strided convolutions, the rotation's backward


def test_the_policy_is_resolved_once_from_the_mesh_and_recorded():
    spec, _, _ = _isic_step("auto", 32, feature_dims=8, num_blocks=1, num_heads=2, iters=1)
    assert spec.kernels.form == "cpu" and spec.kernels == ops.resolve("cpu")
    spec, _, _ = _isic_step("portable", 32, feature_dims=8, num_blocks=1, num_heads=2, iters=1)
    assert spec.kernels == ops.PORTABLE


def test_the_gpu_policy_lowers_here_but_refuses_to_run_on_cpu_devices():
    config = load_config("configs/isic.py:smoke")
    config.model.kernels = "gpu"
    mesh = make_mesh(config.mesh.axes)
    with pytest.raises(ConfigError, match="kernels='gpu' builds the GPU program, which cannot run on cpu devices"):
        check_kernels_run_here(config, mesh)
    config.model.kernels = "portable"
    check_kernels_run_here(config, mesh)

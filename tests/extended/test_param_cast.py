"""The gpu policy's parameter casts in one kernel (jaxrat/optim/gpu_cast.py, jaxrat/trainer/param_cast.py):
the values and gradients are those of the casts the model wrote, and only leaves read solely as one
narrow cast are taken.

The kernel runs in Pallas interpret mode here; that the trainer's step compiles it for an H100 as one
kernel in place of one cast per weight is tests/extended/test_gpu_cost.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrat.optim import gpu_cast as cast
from jaxrat.trainer import param_cast

BF16, F32 = jnp.bfloat16, jnp.float32


def _leaves(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s), F32) for s in shapes]


def test_the_kernel_casts_every_leaf_as_astype_does():
    # sizes below, at and across the block, and more leaves than one call takes
    shapes = [(1,), (3, 5), (cast.BLOCK,), (cast.BLOCK + 1,), (2, 3, 700)] + [(7,)] * cast.LEAVES_PER_CALL
    leaves = _leaves(*shapes)
    got = cast.multi_tensor_cast(leaves, BF16, interpret=True)
    assert len(got) == len(leaves)
    for g, x in zip(got, leaves):
        assert g.dtype == BF16 and g.shape == x.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(x.astype(BF16), np.float32))


def test_its_gradient_is_the_cotangent_in_float32():
    leaves = _leaves((4, 3), (5,))

    def loss(xs, cast_fn):
        a, b = cast_fn(xs)
        return jnp.sum(jnp.sin(a).astype(F32) * 3.0) + jnp.sum(b.astype(F32) ** 2)

    fused = jax.grad(loss)(leaves, lambda xs: cast.multi_tensor_cast(xs, BF16, interpret=True))
    plain = jax.grad(loss)(leaves, lambda xs: [x.astype(BF16) for x in xs])
    for f, p in zip(fused, plain):
        assert f.dtype == F32
        np.testing.assert_array_equal(np.asarray(f), np.asarray(p))


@pytest.mark.parametrize("leaves, why", [
    ([jnp.ones((3,), BF16)], "float32 leaves, not bfloat16"),
    ([jnp.ones((0,), F32)], "non-empty"),
])
def test_what_it_does_not_take_is_refused_in_a_sentence(leaves, why):
    with pytest.raises(ValueError, match=why):
        cast.multi_tensor_cast(leaves, BF16, interpret=True)


def _model(params, x):
    """Reads: "w" once as bfloat16 inside a jit, "b" once as bfloat16 inside a checkpointed function,
    "twice" as bfloat16 twice, "looped" as bfloat16 in a scan's body, "scale" at float32, "mixed" both
    ways, "half" as float16 and bfloat16, "custom" inside a custom derivative, "unused" not at all."""
    y = jax.jit(lambda w, x: x.astype(BF16) @ w.astype(BF16))(params["w"], x)

    def body(c, _):
        return c + (c.astype(BF16) @ params["looped"].astype(BF16)).astype(F32), None

    y2, _ = jax.lax.scan(body, y.astype(F32), None, length=2)
    twice = (params["twice"].astype(BF16) * 2).sum() + jnp.sin(params["twice"].astype(BF16)).sum()
    y3 = jax.checkpoint(lambda b, y: y + b.astype(BF16))(params["b"], (y2 + twice).astype(BF16))
    out = y3.astype(F32) * params["scale"] + params["mixed"].sum() + params["mixed"].astype(BF16).sum()
    out = out + params["half"].astype(jnp.float16).sum() + params["half"].astype(BF16).sum()

    @jax.custom_vjp
    def custom(c):
        return c.astype(BF16).sum()

    custom.defvjp(lambda c: (custom(c), None), lambda _, g: (jnp.full((3,), g, F32),))
    return jnp.sum(out) + custom(params["custom"]).astype(F32)


def _params():
    shapes = dict(w=(3, 3), b=(3,), twice=(3,), looped=(3, 3), scale=(3,), mixed=(2,), half=(2,), custom=(3,),
                  unused=(4,))
    return dict(zip(shapes, _leaves(*shapes.values())))


def test_only_leaves_read_solely_as_one_narrow_cast_are_found():
    params = _params()
    found = param_cast.narrow_reads(_model, params, jnp.ones((2, 3)))
    names = sorted(params)  # jax.tree.leaves orders a dict by key
    assert dict(zip(names, found)) == dict(b=jnp.dtype(BF16), custom=None, half=None, looped=None, mixed=None,
                                           scale=None, twice=None, unused=None, w=jnp.dtype(BF16))


def test_the_wrapped_function_computes_and_differentiates_as_the_plain_one():
    params, x = _params(), jnp.asarray(np.random.default_rng(3).normal(size=(2, 3)), F32)
    fused = param_cast.cast_narrow_reads(_model, interpret=True)
    v1, g1 = jax.jit(jax.value_and_grad(_model))(params, x)
    v2, g2 = jax.jit(jax.value_and_grad(fused))(params, x)
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2))
    for k in params:
        np.testing.assert_array_equal(np.asarray(g1[k]), np.asarray(g2[k]), err_msg=k)
    assert "multi_tensor_cast" in str(jax.make_jaxpr(fused)(params, x))


def test_on_a_mesh_of_eight_devices_each_copy_is_cast_where_it_lives():
    """Replicated parameters under the trainer's mesh: the kernel runs on each device's copy (shard_map),
    and the gradients are those of the model's own casts on that mesh."""
    params, x = _params(), jnp.asarray(np.random.default_rng(4).normal(size=(8, 3)), F32)
    fused = param_cast.cast_narrow_reads(_model, interpret=True)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):
        args = jax.device_put((params, x), rep)
        plain = jax.jit(jax.grad(_model), out_shardings=rep)(*args)
        many = jax.jit(jax.grad(fused), out_shardings=rep)(*args)
        traced = str(jax.make_jaxpr(fused)(params, x))
    for k in params:
        np.testing.assert_array_equal(np.asarray(plain[k]), np.asarray(many[k]), err_msg=k)
    assert "shard_map" in traced and "multi_tensor_cast" in traced


def _tiny_gpu_isic(monkeypatch, dtype: str, accum: int = 1, shards: int = 0, ema_decay: float = 0.0):
    """The ISIC config with a tiny RAT on the gpu policy over 2 devices: its state spec and an abstract
    batch of 4 32-px images (cuDNN's version pretended, so that CUDA lowering works here)."""
    from jax._src.cudnn import fused_attention_stablehlo

    from jaxrat.config_schema import load_config
    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    config = load_config("configs/isic.py")
    config.model.kernels, config.model.gpu_forms = "gpu", "all"
    config.model.rat.update(dict(feature_dims=32, num_blocks=1, num_heads=2, iters=1))
    config.data.image_size, config.data.batch_size = 32, 4
    config.train.compute_dtype = dtype
    config.optimizer.grad_accum_steps = accum
    config.train.reduction_shards = shards
    config.optimizer.ema_decay = ema_decay
    config.mesh.axes = (("data", 2), ("fsdp", 1))
    spec = make_state_spec(config, make_mesh(config.mesh.axes, jax.devices()[:2]), load_task(config))
    batch = {k: jax.ShapeDtypeStruct((4, 32, 32, c), jnp.float32, sharding=spec.batch_sharding)
             for k, c in (("image", 3), ("mask", 1))}
    return spec, batch


@pytest.mark.parametrize("dtype, accum, cast_calls", [("bfloat16", 1, 1), ("bfloat16", 2, 1), ("float32", 1, 0)])
def test_the_trainer_s_gpu_step_casts_in_one_kernel_where_it_computes_in_bfloat16(monkeypatch, dtype, accum,
                                                                                   cast_calls):
    """The ISIC step (tiny RAT) on the gpu policy over 2 devices, lowered for CUDA here: in bfloat16 one
    multi-tensor cast call (inside the micro-batches' scan with accumulation); in float32 none (nothing
    is read narrowed)."""
    from jaxrat.trainer.step import make_train_step

    spec, batch = _tiny_gpu_isic(monkeypatch, dtype, accum)
    text = make_train_step(spec).trace(spec.abstract_with_shardings(), batch).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count('name = "multi_tensor_cast"') == cast_calls


@pytest.mark.parametrize("dtype, cast_calls", [("bfloat16", 1), ("float32", 0)])
def test_the_trainer_s_gpu_eval_step_casts_in_one_kernel_too(monkeypatch, dtype, cast_calls):
    """The ISIC eval step (tiny RAT) on the gpu policy over 2 devices, lowered for CUDA: the weights it
    reads only as bfloat16 cast in one multi-tensor call, as the train step's; none in float32."""
    from jaxrat.trainer.step import make_eval_step

    spec, batch = _tiny_gpu_isic(monkeypatch, dtype)
    batch["valid"] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=spec.batch_sharding)
    params = spec.abstract_with_shardings()["params"]
    text = make_eval_step(spec).trace(params, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('name = "multi_tensor_cast"') == cast_calls



@pytest.mark.parametrize("dtype, cast_calls", [("bfloat16", 1), ("float32", 0)])
def test_the_fixed_shards_gpu_program_casts_in_one_kernel_too(monkeypatch, dtype, cast_calls):
    """Under ``train.reduction_shards`` the step is one single-device program per shard
    (FixedShardStep): on the gpu policy in bfloat16 that program casts the weights it reads narrowed
    in one multi-tensor call, as the plain step does; in float32 none."""
    from jaxrat.trainer.step import make_train_step

    spec, batch = _tiny_gpu_isic(monkeypatch, dtype, shards=2)
    step = make_train_step(spec)
    assert type(step).__name__ == "FixedShardStep"
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), spec.abstract_state["params"])
    one = {k: jax.ShapeDtypeStruct((2, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    text = step._grad.trace(params, one, jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('name = "multi_tensor_cast"') == cast_calls

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrat.parallel import sharding
from jaxrat.parallel.mesh import axis_sizes, make_mesh
from jaxrat.runtime.errors import ConfigError


def test_axis_sizes():
    assert axis_sizes((("data", -1), ("fsdp", 2)), 8) == (("data", "fsdp"), (4, 2))
    assert axis_sizes((("data", 8),), 8) == (("data",), (8,))
    for bad, msg in [((("data", -1), ("fsdp", -1)), "more than one -1"), ((("data", 3),), "needs 3 devices"),
                     ((("data", -1), ("fsdp", 3)), "do not divide"), ((("a", 2), ("a", 4)), "repeats")]:
        with pytest.raises(ConfigError, match=msg):
            axis_sizes(bad, 8)


def test_mesh_orders_devices_process_major():
    mesh = make_mesh((("data", 2), ("fsdp", 4)))
    assert mesh.shape == {"data": 2, "fsdp": 4}
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())


def test_fsdp_spec_picks_largest_divisible_dim_and_skips_small():
    assert sharding.fsdp_spec((3, 3, 16, 64), ("fsdp",), 8, 1) == P(None, None, None, "fsdp")
    assert sharding.fsdp_spec((12, 7), ("fsdp",), 4, 1) == P("fsdp", None)
    assert sharding.fsdp_spec((7, 5), ("fsdp",), 4, 1) == P()
    assert sharding.fsdp_spec((64, 64), ("fsdp",), 8, 2**14) == P()
    assert sharding.fsdp_spec((64, 64), ("data", "fsdp"), 8, 1) == P(("data", "fsdp"), None)


def test_rules_override_the_preset_by_path():
    mesh = make_mesh((("data", 2), ("fsdp", 4)))
    tree = {"enc": {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32),
                    "bias": jax.ShapeDtypeStruct((16,), np.float32)},
            "mu": {"enc": {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32)}}}
    out = sharding.tree_shardings(tree, mesh, shard=True, axis="fsdp", min_size=1,
                                  rules=(("enc/bias", "replicate"), ("mu/.*kernel", "(None, 'data')")))
    assert out["enc"]["kernel"].spec == P(None, "fsdp")
    assert out["enc"]["bias"].spec == P()
    assert out["mu"]["enc"]["kernel"].spec == P(None, "data")
    with pytest.raises(ConfigError, match="not a mesh axis"):
        sharding.tree_shardings(tree, mesh, shard=False, axis="fsdp", min_size=1, rules=((".*", "('model',)"),))
    with pytest.raises(ConfigError, match="does not fit enc/bias"):
        sharding.tree_shardings(tree, mesh, shard=False, axis="fsdp", min_size=1, rules=(("bias", "('data', None)"),))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_presets_shard_what_they_promise(zero):
    from jaxrat.config_schema import load_config
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec

    config = load_config("configs/isic.py:smoke")
    config.mesh.axes = (("data", 1), ("fsdp", -1))
    config.sharding.zero = zero
    config.sharding.min_size = 1
    s = make_state_spec(config, make_mesh(config.mesh.axes), load_task(config))
    params = [sh.spec for sh in jax.tree.leaves(s.state_shardings["params"])]
    opt = [sh.spec for sh in jax.tree.leaves(s.state_shardings["opt_state"])]
    grads = [sh.spec for sh in jax.tree.leaves(s.grad_shardings)]
    assert any(p != P() for p in params) == (zero >= 3)
    assert any(p != P() for p in opt) == (zero >= 1)
    assert any(p != P() for p in grads) == (zero >= 2)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_alone_shards_over_the_data_devices_of_the_default_mesh(zero):
    """The default mesh is {'data': N, 'fsdp': 1}: ZeRO over its 1-device fsdp axis would shard nothing
    (and still turn the replicated-state forms off), so it shards over every mesh axis instead."""
    from jaxrat.config_schema import load_config
    from jaxrat.tasks.base import load_task
    from jaxrat.trainer.state import make_state_spec

    config = load_config("configs/isic.py:smoke")
    assert dict(config.mesh.axes) == {"data": -1, "fsdp": 1} and config.sharding.axis == "fsdp"
    config.sharding.zero = zero
    config.sharding.min_size = 1
    mesh = make_mesh(config.mesh.axes)
    assert mesh.shape["data"] == 8
    s = make_state_spec(config, mesh, load_task(config))
    opt = [sh.spec for sh in jax.tree.leaves(s.state_shardings["opt_state"])]
    params = [sh.spec for sh in jax.tree.leaves(s.state_shardings["params"])]
    assert any(("data", "fsdp") in tuple(p) for p in opt)
    assert any(p != P() for p in params) == (zero >= 3)
    # a named axis that spans devices is kept as it is
    assert sharding.zero_axis(make_mesh((("data", 2), ("fsdp", 4))), "fsdp", zero) == "fsdp"
    assert sharding.zero_axis(make_mesh((("data", 1), ("fsdp", 1)), devices=jax.devices()[:1]), "fsdp", zero) == "fsdp"
    assert sharding.zero_axis(mesh, "fsdp", 0) == "fsdp"

"""Reference weight import: layout conversions, strictness, the CLI round trip."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.rat import ResolutionAwareTransformer
from jaxrat.models.torch_import import convert_state_dict, load_params_npz, main, read_state_dict

CFG = dict(feature_dims=16, num_blocks=1, num_heads=2, iters=1, input_features=2)


def torch_layout(model) -> dict[str, np.ndarray]:
    """The inverse of the importer's mapping, written out independently for the test."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]:
        names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        w = np.asarray(leaf)
        if names[-1] == "kernel":
            names[-1] = "weight"
            w = w.T if w.ndim == 2 else np.transpose(w, (w.ndim - 1, w.ndim - 2) + tuple(range(w.ndim - 2)))
        elif names[-1] == "scale" and names[-2].startswith("norm"):
            names[-1] = "weight"
        out[".".join(names)] = w
    return out


def test_state_dict_keys_follow_the_reference_names():
    keys = set(torch_layout(ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))))
    expected = {"init_proj.weight", "init_proj.bias", "sga_layers.0.strider.weight", "sga_layers.0.kv.weight",
                "sga_layers.0.q.bias", "sga_layers.0.temp", "sga_layers.0.mask_embedding", "sga_layers.0.rose.freqs",
                "sga_layers.0.rose.scale_a", "sga_layers.0.norm3.weight", "sga_layers.0.mlp.fc1.weight",
                "mr_attn_layers.0.qkv.weight", "mr_attn_layers.0.proj.bias", "mr_attn_layers.0.norm1.weight",
                "mr_attn_layers.0.mlp.fc2.bias", "mr_attn_layers.0.rose.scale_d"}
    assert expected <= keys


def test_round_trip_through_torch_layout():
    source = ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(1), kernels=ops.resolve("auto"))
    target = ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(2), kernels=ops.resolve("auto"))
    converted = convert_state_dict(torch_layout(source), target)
    want = nnx.to_pure_dict(nnx.state(source, nnx.Param))
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert torch_layout(source)["init_proj.weight"].shape == (16, 2, 7, 7)


def test_mismatched_state_dicts_are_rejected():
    model = ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    sd = torch_layout(model)
    # both names: the file's key and the model's parameter path
    with pytest.raises(ValueError, match=r"missing \[\"init_proj.bias \(the model's init_proj/bias\)\"\]"):
        convert_state_dict({k: v for k, v in sd.items() if k != "init_proj.bias"}, model)
    with pytest.raises(ValueError, match="unused"):
        convert_state_dict(sd | {"head.weight": np.zeros(3)}, model)
    with pytest.raises(ValueError, match=r"the file's init_proj.bias \(the model's init_proj/bias\): reference "
                                         r"shape \(5,\) does not match"):
        convert_state_dict(sd | {"init_proj.bias": np.zeros(5)}, model)
    convert_state_dict(sd | {"head.weight": np.zeros(3)}, model, strict=False)


def test_the_cli_npz_loads_through_the_one_reader_and_a_mismatch_is_one_sentence(tmp_path):
    from jaxrat.models.torch_import import flatten_params
    from jaxrat.runtime.errors import ConfigError

    source = ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(1), kernels=ops.resolve("auto"))
    flat = flatten_params(nnx.to_pure_dict(nnx.state(source, nnx.Param)))
    np.savez(tmp_path / "rat.npz", **flat)
    target = load_params_npz(ResolutionAwareTransformer(**CFG, rngs=nnx.Rngs(2), kernels=ops.resolve("auto")),
                             tmp_path / "rat.npz")
    for a, b in zip(jax.tree.leaves(nnx.state(target, nnx.Param)), jax.tree.leaves(nnx.state(source, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    np.savez(tmp_path / "short.npz", **{k: v for k, v in flat.items() if k != "init_proj/bias"})
    with pytest.raises(ConfigError, match=r"short.npz has no init_proj/bias, a parameter of this model"):
        load_params_npz(target, tmp_path / "short.npz")
    np.savez(tmp_path / "wide.npz", **(flat | {"init_proj/bias": np.zeros(5, np.float32)}))
    with pytest.raises(ConfigError, match=r"wide.npz: init_proj/bias is \(5,\) in the file but \(16,\)"):
        load_params_npz(target, tmp_path / "wide.npz")
    with pytest.raises(ConfigError, match="gone.npz do not exist"):
        load_params_npz(target, tmp_path / "gone.npz")


def test_read_state_dict_strips_a_prefix(tmp_path):
    sd = {"backbone.a": np.ones(2, np.float32), "head.b": np.zeros(1, np.float32)}
    np.savez(tmp_path / "sd.npz", **sd)
    assert set(read_state_dict(tmp_path / "sd.npz", prefix="backbone.")) == {"a"}


def test_cli_with_reference_checkpoint(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[reference]'")
    from jaxrat.models.torch_import import import_reference_package

    ref = import_reference_package()
    cfg = dict(CFG, spatial_dims=2)
    torch.manual_seed(0)
    model = ref.ResolutionAwareTransformer(**cfg).eval()
    torch.save({"backbone." + k: v for k, v in model.state_dict().items()}, tmp_path / "rat.pt")
    (tmp_path / "rat.json").write_text(json.dumps(cfg))
    assert main(["--state-dict", str(tmp_path / "rat.pt"), "--config", str(tmp_path / "rat.json"),
                 "--out", str(tmp_path / "rat.npz"), "--prefix", "backbone."]) == 0

    flax_model = ResolutionAwareTransformer(**cfg, reference_compat=True, rngs=nnx.Rngs(5), kernels=ops.resolve("auto"))
    ours = load_params_npz(flax_model, tmp_path / "rat.npz")
    x = np.random.default_rng(0).standard_normal((1, 2, 15, 15)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x))[0]["x_out"].numpy()
    got = nnx.jit(lambda m, x: m(x)[0].tokens)(ours, jnp.asarray(np.moveaxis(x, 1, -1)))
    assert np.abs(np.asarray(got) - want).max() <= 1e-4 * np.abs(want).max()

"""Pretrained backbone files refused with one sentence: missing, partial, mis-shaped, or a pickle
holding more than tensors; the timm names and layouts convert without torch."""

import pickle

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxrat import ops
from jaxrat.models.backbones import build_backbone
from jaxrat.models.backbones.weights import expected_shapes, load_backbone_weights
from jaxrat.runtime.errors import ConfigError

FIELDS = dict(img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2)


def _expected():
    model = nnx.eval_shape(lambda: build_backbone("vit_tiny_patch16_224", kernels=ops.PORTABLE, rngs=nnx.Rngs(0),
                                                  **FIELDS))
    return expected_shapes(model)


def _timm_state():
    """A timm-named state dict of the tiny ViT, from the jaxrat shapes turned back into torch layouts."""
    rng = np.random.RandomState(0)
    out = {}
    for name, shape in _expected().items():
        parts = name.split("/")
        last = parts[-1]
        if last == "kernel":
            shape = (shape[3], shape[2], shape[0], shape[1]) if len(shape) == 4 else shape[::-1]
            last = "weight"
        elif last == "scale":
            last = "weight"
        out[".".join([*parts[:-1], last])] = rng.randn(*shape).astype(np.float32)
    return out


def test_timm_names_convert_and_every_parameter_loads(tmp_path):
    state = _timm_state()
    save_file(state, str(tmp_path / "w.safetensors"))
    got = load_backbone_weights(tmp_path / "w.safetensors", _expected())
    assert set(got) == set(_expected())
    np.testing.assert_array_equal(got["blocks/0/attn/qkv/kernel"], state["blocks.0.attn.qkv.weight"].T)
    np.testing.assert_array_equal(got["patch_embed/proj/kernel"],
                                  state["patch_embed.proj.weight"].transpose(2, 3, 1, 0))


def test_missing_file_and_key_and_shape_each_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="do not exist"):
        load_backbone_weights(tmp_path / "nope.safetensors", _expected())
    state = _timm_state()
    del state["blocks.0.mlp.fc1.weight"]
    save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ConfigError, match=r"lack the model's blocks/0/mlp/fc1/kernel \(the file's "
                                          r"'blocks.0.mlp.fc1.weight'\) of \d+ backbone parameters"):
        load_backbone_weights(tmp_path / "partial.safetensors", _expected())
    state = _timm_state()
    state["blocks.0.attn.proj.weight"] = np.zeros((16, 8), np.float32)
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ConfigError, match=r"the file's 'blocks.0.attn.proj.weight' \(the model's "
                                          r"blocks/0/attn/proj/kernel\) has shape \(8, 16\) after conversion but "
                                          r"the model's is \(16, 16\)"):
        load_backbone_weights(tmp_path / "shape.safetensors", _expected())
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors"):
        load_backbone_weights(tmp_path / "broken.safetensors", _expected())
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="complete Hugging Face model folder"):
        load_backbone_weights(tmp_path / "folder", _expected())


class Payload:
    """An object a plain unpickler would construct (and could run code from)."""

    def __reduce__(self):
        return (print, ("code ran",))


def test_pickle_with_more_than_tensors_is_refused_without_running_it(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    state = {k: torch.from_numpy(v) for k, v in _timm_state().items()}
    torch.save(state, tmp_path / "ok.pth")
    assert set(load_backbone_weights(tmp_path / "ok.pth", _expected())) == set(_expected())
    torch.save({"state_dict": state, "extra": Payload()}, tmp_path / "evil.pth")
    # torch's own reason, not its last line (a pointer to its documentation)
    with pytest.raises(ConfigError, match=r"holds more than plain tensors \(Unsupported global: GLOBAL \S*print "
                                          r"was not an allowed global\); .*weights_only=True"):
        load_backbone_weights(tmp_path / "evil.pth", _expected())
    assert "code ran" not in capsys.readouterr().out
    (tmp_path / "raw.bin").write_bytes(pickle.dumps({"a": Payload()}))
    with pytest.raises(ConfigError, match="weights_only=True|not a readable PyTorch file"):
        load_backbone_weights(tmp_path / "raw.bin", _expected())


def test_pretrained_arrays_land_under_backbone_and_honour_include_exclude(tmp_path):
    import jax

    from jaxrat.checkpointing.init_from import place_arrays
    from jaxrat.checkpointing.named_arrays import named_leaves
    from jaxrat.models.backbones.weights import pretrained_arrays

    save_file(_timm_state(), str(tmp_path / "w.safetensors"))
    backbone = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), _expected(),
                            is_leaf=lambda x: isinstance(x, tuple))
    abstract = {"backbone": {}, "heads": {"kernel": jax.ShapeDtypeStruct((16, 3), np.float32)}}
    for name, leaf in backbone.items():  # nest "a/b/c" paths as the model's params are nested
        node = abstract["backbone"]
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    arrays = pretrained_arrays(tmp_path / "w.safetensors", abstract)
    assert set(arrays) == {f"backbone/{k}" for k in _expected()}
    placed = named_leaves(place_arrays(arrays, abstract, exclude="blocks/0/mlp"))
    assert "heads/kernel" not in placed and "backbone/blocks/0/mlp/fc1/kernel" not in placed
    assert "backbone/blocks/0/attn/qkv/kernel" in placed
    with pytest.raises(ConfigError, match="has no backbone"):
        pretrained_arrays(tmp_path / "w.safetensors", {"heads": abstract["heads"]})


def test_the_log_says_whose_architecture_and_resampling_apply(tmp_path, caplog):
    import json
    import logging

    import jax

    from jaxrat.models.backbones.weights import pretrained_arrays

    abstract = {"backbone": {}}
    for name, shape in _expected().items():
        node = abstract["backbone"]
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jax.ShapeDtypeStruct(shape, np.float32)
    for origin, config, says in [
            ("hf", {"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "intermediate_size": 64, "image_size": 32, "patch_size": 8}, "Hugging Face"),
            ("timm", {"architecture": "vit_tiny_patch16_224", "model_args": {"patch_size": 8}}, "timm")]:
        folder = tmp_path / origin
        folder.mkdir()
        save_file(_timm_state(), str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            pretrained_arrays(folder, abstract)
        assert f"pretrained: a {says} vit; architecture from {folder / 'config.json'}" in caplog.text
        assert f"resampled as {says} does it" in caplog.text

"""ViT, BEiT and Swin against timm and transformers: random-weight PyTorch models saved to files
(with the config.json each library writes beside them), loaded by jaxrat with the architecture taken
from that config, the same logits and features (float32, 1e-4 relative) at the saved image size and
a second one, position embeddings and bias tables resampled as the file's library does it."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.backbones import build_backbone
from jaxrat.models.backbones.weights import expected_shapes, load_backbone_weights, set_params
from torch_models import import_references

TINY = {
    "vit": ("vit_tiny_patch16_224", dict(patch_size=8, depth=2, embed_dim=32, num_heads=2), (32, 48)),
    "beit": ("beit_base_patch16_224", dict(patch_size=8, depth=2, embed_dim=32, num_heads=2), (32, 48)),
    "swin": ("swin_tiny_patch4_window7_224", dict(window_size=2, embed_dim=16, depths=(1, 2, 1), num_heads=(1, 2, 2)),
             (32, 48)),
}


def _randomise(model, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _jaxrat(arch, size, path, num_classes=5):
    """The backbone for the file at ``path``: only the image size given, the rest from its config."""
    model = build_backbone(arch, img_size=size, num_classes=num_classes, kernels=ops.PORTABLE, rngs=nnx.Rngs(0),
                           pretrained=str(path))
    arrays = load_backbone_weights(path, expected_shapes(model))
    assert set(arrays) == set(expected_shapes(model))
    set_params(model, arrays)
    return model


def _close(a, b, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)
    assert err <= tol, err


def _images(size, n=2):
    return np.random.RandomState(size).randn(n, size, size, 3).astype(np.float32)


def _torch_features(kind, model, x):
    """Stage or block outputs of a timm model, NHWC, no final norm."""
    import torch

    with torch.no_grad():
        if kind == "swin":
            h = model.patch_embed(x)
            out = []
            for stage in model.layers:
                h = stage(h)
                out.append(h.numpy())
            return out
        feats = model.forward_intermediates(x, indices=[0, 1], norm=False, intermediates_only=True)
        return [f.permute(0, 2, 3, 1).numpy() for f in feats]


@pytest.mark.parametrize("kind", ["vit", "beit", "swin"])
def test_timm_file_same_outputs_and_features_at_two_sizes(kind, tmp_path):
    import torch
    from safetensors.torch import save_file

    timm, _ = import_references()
    arch, fields, (size, other) = TINY[kind]
    ref = _randomise(timm.create_model(arch, pretrained=False, img_size=size, num_classes=5, **fields), 0)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    # what timm's push_to_hub writes beside the weights: the architecture by name and its arguments
    (tmp_path / "config.json").write_text(json.dumps({
        "architecture": arch, "num_classes": 5, "num_features": ref.num_features,
        "pretrained_cfg": {"input_size": [3, size, size], "interpolation": "bicubic", "num_classes": 5},
        "model_args": {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}))
    for s in (size, other):
        # timm's own loader resamples position embeddings and bias tables to the new size
        model_t = ref if s == size else timm.create_model(
            arch, pretrained=True, img_size=s, num_classes=5, pretrained_cfg_overlay={"file": str(path)},
            **fields).eval()
        # timm keeps a head of other classes than its pretrained config's out of the load
        model_t.load_state_dict({k: v for k, v in ref.state_dict().items() if k.startswith("head")}, strict=False)
        x = _images(s)
        with torch.no_grad():
            want = model_t(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
        model = _jaxrat(arch, s, path)
        # one program for both (op-by-op dispatch of the Swin's small ops took most of this test's time)
        logits, feats = nnx.jit(lambda m, im: (m(im), m.features(im) if kind == "swin" else m.features(im, [0, 1])))(
            model, jnp.asarray(x))
        _close(logits, want)
        for got, exp in zip(feats, _torch_features(kind, model_t, torch.from_numpy(x).permute(0, 3, 1, 2)),
                            strict=True):
            _close(got, exp)
    if kind == "vit":  # a ViT built for one size runs another, its embeddings resampled on the fly
        _close(_jaxrat(arch, size, path)(jnp.asarray(_images(other))),
               _jaxrat(arch, other, path)(jnp.asarray(_images(other))), 1e-5)


def _hf_model(transformers, kind, **extra):
    """A tiny HF model at transformers' own defaults (layer_norm_eps 1e-12 for ViT and BEiT) but
    for its sizes and ``extra``."""
    T = transformers
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
                patch_size=8, num_labels=5)
    if kind == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**tiny, **extra))
    if kind == "beit":  # HF's default BEiT has no position information at all: its checkpoints turn this on
        return T.BeitForImageClassification(T.BeitConfig(**tiny, **{"use_relative_position_bias": True, **extra}))
    return T.SwinForImageClassification(T.SwinConfig(embed_dim=16, depths=[1, 2, 1], num_heads=[1, 2, 2],
                                                     window_size=2, image_size=32, patch_size=4, num_labels=5, **extra))


HF_CASES = {
    "vit": ("vit", {}),
    "vit_no_qkv_bias": ("vit", {"qkv_bias": False}),
    "beit": ("beit", {}),
    "beit_token_no_layer_scale": ("beit", {"use_mean_pooling": False, "layer_scale_init_value": 0.0}),
    "swin": ("swin", {}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hugging_face_folder_same_logits_at_two_sizes(case, tmp_path):
    import torch

    _, transformers = import_references()
    kind, extra = HF_CASES[case]
    arch, _, (size, other) = TINY[kind]
    ref = _randomise(_hf_model(transformers, kind, **extra), 1)
    ref.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved.get("layer_norm_eps", ref.config.layer_norm_eps) == (1e-5 if kind == "swin" else 1e-12)
    for s in (size, other):
        x = _images(s)
        with torch.no_grad():  # HF resamples on the fly: bicubic embeddings, bilinear BEiT tables
            want = ref(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2),
                       interpolate_pos_encoding=s != size).logits.numpy()
        model = _jaxrat(arch, s, tmp_path / "hf")
        _close(nnx.jit(lambda m, im: m(im))(model, jnp.asarray(x)), want)
        if kind == "vit" and s == other:  # built for the saved size, run at another: HF's rule on the fly too
            _close(nnx.jit(lambda m, im: m(im))(_jaxrat(arch, size, tmp_path / "hf"), jnp.asarray(x)), want)

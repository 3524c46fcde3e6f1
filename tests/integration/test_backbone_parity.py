"""ViT, BEiT and Swin against timm and transformers: random-weight PyTorch models saved to files,
loaded by jaxrat, the same logits and features (float32, 1e-4 relative) at two image sizes."""

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


def _jaxrat(arch, fields, size, path, num_classes=5):
    model = build_backbone(arch, img_size=size, num_classes=num_classes, kernels=ops.PORTABLE, rngs=nnx.Rngs(0),
                           **fields)
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
        model = _jaxrat(arch, fields, s, path)
        # one program for both (op-by-op dispatch of the Swin's small ops took most of this test's time)
        logits, feats = nnx.jit(lambda m, im: (m(im), m.features(im) if kind == "swin" else m.features(im, [0, 1])))(
            model, jnp.asarray(x))
        _close(logits, want)
        for got, exp in zip(feats, _torch_features(kind, model_t, torch.from_numpy(x).permute(0, 3, 1, 2)),
                            strict=True):
            _close(got, exp)
    if kind == "vit":  # a ViT built for one size runs another, its embeddings resampled on the fly
        _close(_jaxrat(arch, fields, size, path)(jnp.asarray(_images(other))),
               _jaxrat(arch, fields, other, path)(jnp.asarray(_images(other))), 1e-5)


def _hf_model(transformers, kind):
    T = transformers
    if kind == "vit":
        return T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=128, image_size=32, patch_size=8,
                                                       num_labels=5, layer_norm_eps=1e-6))
    if kind == "beit":
        return T.BeitForImageClassification(T.BeitConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=5, layer_norm_eps=1e-6, use_relative_position_bias=True, use_mean_pooling=True,
            use_absolute_position_embeddings=False))
    return T.SwinForImageClassification(T.SwinConfig(embed_dim=16, depths=[1, 2, 1], num_heads=[1, 2, 2],
                                                     window_size=2, image_size=32, patch_size=4, num_labels=5))


@pytest.mark.parametrize("kind", ["vit", "beit", "swin"])
def test_hugging_face_folder_same_logits(kind, tmp_path):
    import torch

    _, transformers = import_references()
    arch, fields, (size, _) = TINY[kind]
    ref = _randomise(_hf_model(transformers, kind), 1)
    ref.save_pretrained(tmp_path / "hf")
    x = _images(size)
    with torch.no_grad():
        want = ref(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2)).logits.numpy()
    _close(_jaxrat(arch, fields, size, tmp_path / "hf")(jnp.asarray(x)), want)

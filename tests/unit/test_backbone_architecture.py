"""A pretrained file's config.json gives the backbone's architecture: Hugging Face's defaults where
it is silent, one sentence for a field that contradicts the user's, for one jaxrat does not build and
for one it does not know; Hugging Face's resampling rule is torch's interpolate to the last digit."""

import json

import numpy as np
import pytest

from jaxrat.models.backbones import backbone_fields
from jaxrat.models.backbones.architecture import file_fields
from jaxrat.models.backbones.vit import resample_grid, torch_resize_matrix
from jaxrat.runtime.errors import ConfigError

# What transformers 5 writes for a default ViTConfig at a tiny size (save_pretrained's config.json)
HF_VIT = {"architectures": ["ViTForImageClassification"], "attention_probs_dropout_prob": 0.0, "dtype": "float32",
          "encoder_stride": 16, "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "hidden_size": 32,
          "id2label": {"0": "a"}, "image_size": 32, "initializer_range": 0.02, "intermediate_size": 128,
          "label2id": {"a": 0}, "layer_norm_eps": 1e-12, "model_type": "vit", "num_attention_heads": 2,
          "num_channels": 3, "num_hidden_layers": 2, "patch_size": 8, "pooler_act": "tanh",
          "pooler_output_size": 32, "qkv_bias": True, "transformers_version": "5.24.0"}


def _folder(tmp_path, config, name="hf"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_hugging_face_config_gives_every_architecture_field(tmp_path):
    origin, kind, fields, _ = file_fields(_folder(tmp_path, HF_VIT))
    assert (origin, kind) == ("hf", "vit")
    assert fields == dict(img_size=32, patch_size=8, in_channels=3, eps=1e-12, embed_dim=32, depth=2, num_heads=2,
                          mlp_ratio=4.0, qkv_bias=True, global_pool="token", pos_resample="hf")
    # keys the file leaves out take transformers' defaults (layer_norm_eps 1e-12, mean pooling, layer scale 0.1)
    beit = {"model_type": "beit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 64, "use_relative_position_bias": True}
    _, kind, fields, _ = file_fields(_folder(tmp_path, beit, "beit"))
    assert kind == "beit" and fields["eps"] == 1e-12 and fields["global_pool"] == "avg"
    assert fields["layer_scale"] == 0.1 and fields["rel_pos_bias"] and fields["mlp_ratio"] == 2.0
    # the backbone name gives only the kind and what the file does not say; the user's img_size is free
    built = backbone_fields("vit_base_patch16_224", {"img_size": 48}, _folder(tmp_path, HF_VIT, "again"))
    assert (built["embed_dim"], built["depth"], built["eps"], built["img_size"]) == (32, 2, 1e-12, 48)


def test_a_field_the_user_set_otherwise_is_one_sentence_with_both_values(tmp_path):
    folder = _folder(tmp_path, HF_VIT)
    with pytest.raises(ConfigError, match=r"backbone_fields\.eps is 1e-06 but .*config\.json says 1e-12"):
        backbone_fields("vit_base_patch16_224", {"eps": 1e-6}, folder)
    with pytest.raises(ConfigError, match=r"backbone_fields\.patch_size is 16 but .* says 8"):
        backbone_fields("vit_base_patch16_224", {"patch_size": 16}, folder)
    assert backbone_fields("vit_base_patch16_224", {"depth": 2}, folder)["depth"] == 2  # agreeing is fine
    with pytest.raises(ConfigError, match=r"pretrained .*gone does not exist, and the backbone's architecture"):
        backbone_fields("vit_base_patch16_224", {}, str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=r"config.model.backbone is 'swin_tiny_patch4_window7_224' \(a swin\) "
                                          r"but .* describes a vit"):
        backbone_fields("swin_tiny_patch4_window7_224", {}, folder)


@pytest.mark.parametrize("change, message", [
    ({"use_flash_rope": True}, r"field 'use_flash_rope' of this vit config is not one jaxrat understands"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not built by jaxrat"),
    ({"model_type": "deit"}, r"model_type 'deit' is not one jaxrat builds"),
])
def test_unknown_or_unbuildable_hugging_face_field_is_refused(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        file_fields(_folder(tmp_path, {**HF_VIT, **change}))


def test_unbuildable_beit_and_swin_fields_are_refused(tmp_path):
    beit = {"model_type": "beit", "use_shared_relative_position_bias": True}
    with pytest.raises(ConfigError, match="use_shared_relative_position_bias=True is not built"):
        file_fields(_folder(tmp_path, beit, "beit"))
    with pytest.raises(ConfigError, match="use_absolute_embeddings=True is not built"):
        file_fields(_folder(tmp_path, {"model_type": "swin", "use_absolute_embeddings": True}, "swin"))


def test_timm_config_names_the_architecture_and_its_arguments(tmp_path):
    timm = {"architecture": "beit_base_patch16_224", "num_classes": 5, "num_features": 32,
            "pretrained_cfg": {"input_size": [3, 32, 32], "interpolation": "bicubic", "mean": [0.5] * 3},
            "model_args": {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "drop_path_rate": 0.1}}
    folder = _folder(tmp_path, timm)
    origin, kind, fields, _ = file_fields(folder)
    assert (origin, kind) == ("timm", "beit") and fields["pos_resample"] == "timm"
    assert (fields["img_size"], fields["patch_size"], fields["depth"], fields["layer_scale"]) == (32, 8, 2, 0.1)
    # a weights file inside the folder finds the config beside it; a jaxrat run's config.json is not one
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert file_fields(tmp_path / "hf" / "model.safetensors")[1] == "beit"
    run = _folder(tmp_path, {"model": {"name": "unet"}}, "run")
    assert file_fields(f"{run}/w.safetensors") == ("", "", {}, "")
    for bad, message in [({"model_args": {"qk_norm": True}}, "model_args qk_norm=True is not built"),
                         ({"model_args": {"mystery": 1}}, "model_args field 'mystery' is not one jaxrat"),
                         ({"architecture": "convnext_tiny"}, "timm architecture 'convnext_tiny' is not one"),
                         ({"pretrained_cfg": {"mystery": 1}}, "pretrained_cfg field 'mystery'")]:
        with pytest.raises(ConfigError, match=message):
            file_fields(_folder(tmp_path, {**timm, **bad}, f"bad{len(list(tmp_path.iterdir()))}"))


@pytest.mark.parametrize("n_in, n_out", [(4, 6), (7, 11), (6, 4), (3, 3)])
def test_hugging_face_resampling_is_torch_interpolate(n_in, n_out):
    torch = pytest.importorskip("torch")
    grid = np.random.RandomState(n_in).randn(n_in, n_in, 3).astype(np.float32)
    for method in ("bicubic", "bilinear"):
        want = torch.nn.functional.interpolate(torch.from_numpy(grid).permute(2, 0, 1)[None], size=(n_out, n_out),
                                               mode=method, align_corners=False)[0].permute(1, 2, 0).numpy()
        np.testing.assert_allclose(resample_grid(grid, (n_out, n_out), method), want, atol=1e-5)
    assert torch_resize_matrix(n_in, n_out, "bicubic").sum(1) == pytest.approx(np.ones(n_out))

"""A pretrained file's own architecture: the backbone fields its ``config.json`` states.

A Hugging Face model folder's ``config.json`` (``model_type`` vit, beit or swin) and a timm hub
folder's (``architecture``, ``model_args``, ``pretrained_cfg``) say how the weights were built:
LayerNorm epsilon (HF's default is 1e-12, timm's 1e-6), pooling, q/k/v biases, layer scale, patch
size, depth, width, heads, window, the kind of position bias. :func:`file_fields` turns such a file
into this package's backbone fields, with the HF defaults for keys the file leaves out (as
transformers does when it reads it). A key that changes the architecture in a way these backbones
do not build (shared relative bias, a non-GELU activation, ...) and a key this module does not know
are refused, never ignored. :func:`resolve` lays the file's fields over the backbone name's and
checks the user's own against them: a contradiction is one sentence naming the field and both values.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from jaxrat.runtime.errors import ConfigError

# Keys every transformers config may hold (v4 and v5) that say nothing about the backbone's math.
_HF_GENERIC = frozenset("""
_name_or_path architectures model_type transformers_version torch_dtype dtype id2label label2id num_labels
problem_type return_dict output_attentions output_hidden_states output_scores chunk_size_feed_forward
is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size tie_encoder_decoder
tie_word_embeddings torchscript use_bfloat16 pruned_heads finetuning_task tokenizer_class prefix
bos_token_id pad_token_id eos_token_id sep_token_id decoder_start_token_id task_specific_params
max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature
top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id
forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens
begin_suppress_tokens tf_legacy_loss use_return_dict _attn_implementation_autoset _commit_hash
initializer_range hidden_dropout_prob attention_probs_dropout_prob drop_path_rate
""".split())
# Per model type: keys read below, and keys of heads or training these backbones leave out.
_HF_IGNORED = {
    "vit": {"encoder_stride", "pooler_output_size", "pooler_act"},  # masked-image decoder, HF's tanh pooler
    "beit": {"use_mask_token", "vocab_size", "use_auxiliary_head", "auxiliary_loss_weight", "auxiliary_channels",
             "auxiliary_num_convs", "auxiliary_concat_input", "semantic_loss_ignore_index", "pool_scales",
             "out_indices", "out_features", "stage_names", "add_fpn", "reshape_hidden_states"},
    "swin": {"encoder_stride", "num_layers", "hidden_size", "out_indices", "out_features", "stage_names"},
}
# HF's defaults (transformers' ViTConfig, BeitConfig, SwinConfig) for the keys read here.
_HF_DEFAULTS = {
    "vit": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                hidden_act="gelu", layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3,
                qkv_bias=True),
    "beit": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 hidden_act="gelu", layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3,
                 use_absolute_position_embeddings=False, use_relative_position_bias=False,
                 use_shared_relative_position_bias=False, layer_scale_init_value=0.1, use_mean_pooling=True),
    "swin": dict(image_size=224, patch_size=4, num_channels=3, embed_dim=96, depths=[2, 2, 6, 2],
                 num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4.0, qkv_bias=True, hidden_act="gelu",
                 use_absolute_embeddings=False, layer_norm_eps=1e-5),
}
# timm's config.json: its top-level keys, and the keys of a PretrainedCfg (data and provenance only).
_TIMM_TOP = {"architecture", "num_classes", "num_features", "global_pool", "pretrained_cfg", "model_args",
             "label_names", "label_descriptions"}
_TIMM_CFG = frozenset("""
url file state_dict hf_hub_id hf_hub_filename source architecture tag custom_load input_size test_input_size
min_input_size fixed_input_size interpolation crop_pct test_crop_pct crop_mode mean std num_classes
label_offset label_names label_descriptions pool_size test_pool_size first_conv classifier license
description origin_url paper_name paper_ids notes
""".split())
# timm constructor arguments: read as this package's field, or left out (training-only, the head).
_TIMM_ARGS = {"img_size": "img_size", "patch_size": "patch_size", "in_chans": "in_channels",
              "embed_dim": "embed_dim", "depth": "depth", "num_heads": "num_heads", "mlp_ratio": "mlp_ratio",
              "qkv_bias": "qkv_bias", "init_values": "layer_scale", "global_pool": "global_pool",
              "window_size": "window_size", "depths": "depths", "use_rel_pos_bias": "rel_pos_bias"}
_TIMM_IGNORED = {"num_classes", "drop_rate", "drop_path_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate",
                 "patch_drop_rate", "weight_init", "dynamic_img_size", "dynamic_img_pad", "pretrained_strict"}
# timm constructor arguments these backbones build only at the value given.
_TIMM_ONLY = {"use_abs_pos_emb": False, "use_shared_rel_pos_bias": False, "class_token": True,
              "no_embed_class": False, "pre_norm": False, "qk_norm": False, "reg_tokens": 0, "ape": False}
# Fields where the user's value may differ from the file's: the image size the run trains at.
FREE = ("img_size",)


def _hf_fields(cfg: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    kind = cfg.get("model_type")
    if kind not in _HF_DEFAULTS:
        raise ConfigError(f"{where}: model_type {kind!r} is not one jaxrat builds; pretrained weights load into "
                          f"a vit, beit or swin.")
    for key in cfg:
        if key not in _HF_DEFAULTS[kind] and key not in _HF_IGNORED[kind] and key not in _HF_GENERIC:
            raise ConfigError(f"{where}: field {key!r} of this {kind} config is not one jaxrat understands; it may "
                              f"change the architecture, so the file is refused rather than built another way.")
    c = {**_HF_DEFAULTS[kind], **cfg}

    def only(key: str, value: Any, why: str) -> None:
        if c[key] != value:
            raise ConfigError(f"{where}: {key}={c[key]!r} is not built by jaxrat ({why}); use weights saved "
                              f"with {key}={value!r}.")

    only("hidden_act", "gelu", "its backbones use the exact GELU")
    common = dict(img_size=int(c["image_size"]), patch_size=int(c["patch_size"]),
                  in_channels=int(c["num_channels"]), eps=float(c["layer_norm_eps"]))
    if kind == "swin":
        only("use_absolute_embeddings", False, "its Swin has relative position biases only")
        return "swin", dict(common, embed_dim=int(c["embed_dim"]), depths=tuple(int(d) for d in c["depths"]),
                            num_heads=tuple(int(h) for h in c["num_heads"]), window_size=int(c["window_size"]),
                            mlp_ratio=float(c["mlp_ratio"]), qkv_bias=bool(c["qkv_bias"]))
    width = int(c["hidden_size"])
    fields = dict(common, embed_dim=width, depth=int(c["num_hidden_layers"]), num_heads=int(c["num_attention_heads"]),
                  mlp_ratio=int(c["intermediate_size"]) / width, pos_resample="hf")
    if kind == "vit":
        return "vit", dict(fields, qkv_bias=bool(c["qkv_bias"]), global_pool="token")
    only("use_absolute_position_embeddings", False, "its BEiT has relative position biases only")
    only("use_shared_relative_position_bias", False, "its BEiT has a bias table per block")
    scale = float(c["layer_scale_init_value"])
    return "beit", dict(fields, rel_pos_bias=bool(c["use_relative_position_bias"]),
                        layer_scale=scale if scale > 0 else None,
                        global_pool="avg" if c["use_mean_pooling"] else "token")


def _timm_fields(cfg: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    from jaxrat.models.backbones import ARCHITECTURES

    for key in cfg:
        if key not in _TIMM_TOP:
            raise ConfigError(f"{where}: field {key!r} of this timm config is not one jaxrat understands; the file "
                              f"is refused rather than built another way.")
    for key in cfg.get("pretrained_cfg") or {}:
        if key not in _TIMM_CFG:
            raise ConfigError(f"{where}: pretrained_cfg field {key!r} is not one jaxrat understands; the file is "
                              f"refused rather than built another way.")
    arch = cfg["architecture"]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: timm architecture {arch!r} is not one jaxrat builds; choose weights of one of "
                          f"{sorted(ARCHITECTURES)}.")
    fields = dict(ARCHITECTURES[arch])
    kind = fields.pop("kind")
    size = (cfg.get("pretrained_cfg") or {}).get("input_size")
    if size:
        fields["img_size"] = int(size[-1])
    if cfg.get("global_pool"):
        fields["global_pool"] = cfg["global_pool"]
    for key, value in (cfg.get("model_args") or {}).items():
        if key in _TIMM_ONLY:
            if value != _TIMM_ONLY[key]:
                raise ConfigError(f"{where}: model_args {key}={value!r} is not built by jaxrat; use weights saved "
                                  f"with {key}={_TIMM_ONLY[key]!r}.")
        elif key in _TIMM_ARGS:
            if key == "init_values" and kind != "beit":
                raise ConfigError(f"{where}: model_args init_values={value!r} (layer scale) is built by jaxrat for "
                                  f"a BEiT only; use a ViT saved without it.")
            fields[_TIMM_ARGS[key]] = tuple(value) if isinstance(value, list) else value
        elif key not in _TIMM_IGNORED:
            raise ConfigError(f"{where}: model_args field {key!r} is not one jaxrat understands; the file is refused "
                              f"rather than built another way.")
    return kind, dict(fields, pos_resample="timm") if kind != "swin" else fields


def config_file(path: str | os.PathLike) -> Optional[Path]:
    """The ``config.json`` that describes the weights at ``path`` (a model folder's, or the one beside
    a weights file when it is a Hugging Face or timm config), or None."""
    path = Path(os.path.expanduser(str(path)))
    found = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not found.is_file():
        return None
    if path.is_dir():
        return found
    try:  # beside a lone file, only a config that says it is one (not, e.g., a run's own config.json)
        cfg = json.loads(found.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(cfg, dict) and ("model_type" in cfg or "architecture" in cfg) else None


@functools.lru_cache(maxsize=16)
def _file_fields(found: str, mtime: float) -> tuple[str, str, tuple[tuple[str, Any], ...]]:
    del mtime  # part of the cache key: a file rewritten in place is read again
    try:
        cfg = json.loads(Path(found).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{found} is not readable JSON ({e}); download the model folder again.") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{found} holds no JSON object; download the model folder again.")
    if "architecture" in cfg:
        kind, fields = _timm_fields(cfg, found)
        origin = "timm"
    else:
        kind, fields = _hf_fields(cfg, found)
        origin = "hf"
    return origin, kind, tuple(sorted(fields.items()))


def file_fields(path: str | os.PathLike) -> tuple[str, str, dict[str, Any], str]:
    """(origin "hf"/"timm"/"", kind, backbone fields, config file) the pretrained weights at ``path``
    state; ("", "", {}, "") when there is no config to read (a lone timm file)."""
    found = config_file(path)
    if found is None:
        return "", "", {}, ""
    origin, kind, fields = _file_fields(str(found), found.stat().st_mtime)
    return origin, kind, dict(fields), str(found)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def resolve(arch: str, defaults: Mapping[str, Any], user: Mapping[str, Any], pretrained: str) -> dict[str, Any]:
    """The fields of backbone ``arch`` (``defaults``, the name's own) with the file's laid over them,
    then the ``user``'s; a user field that contradicts the file is a ConfigError naming both values."""
    fields = {**defaults}
    if pretrained and not pretrained.startswith("hf:") and not os.path.exists(os.path.expanduser(pretrained)):
        # its config.json would give fields: building without it could silently build another model
        raise ConfigError(f"config.model.pretrained {pretrained} does not exist, and the backbone's architecture is "
                          f"read from the file's config.json; point it at the weights (a file or Hugging Face folder).")
    if pretrained:
        origin, kind, from_file, where = file_fields(pretrained)
        if from_file:
            if kind != defaults.get("kind"):
                raise ConfigError(f"config.model.backbone is {arch!r} (a {defaults.get('kind')}) but {where} "
                                  f"describes a {kind}; set config.model.backbone to a {kind} name.")
            for key, value in user.items():
                if key in from_file and key not in FREE and not _same(value, from_file[key]):
                    raise ConfigError(f"config.model.backbone_fields.{key} is {value!r} but {where} says "
                                      f"{from_file[key]!r}; remove the override to take the file's, or point "
                                      f"config.model.pretrained at weights built with {key}={value!r}.")
            fields.update(from_file)
    fields.update(user)
    return fields

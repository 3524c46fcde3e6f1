"""Pretrained backbone weights from the files users have: a timm ``.safetensors``, ``.bin`` or
``.pth``, or a Hugging Face model folder (``config.json`` beside ``model.safetensors`` or
``pytorch_model.bin``, sharded or not), converted on load (:mod:`jaxrat.models.backbones.convert`).

Files are read by jaxrat's one weight reader, :func:`jaxrat.checkpointing.weight_files.read_arrays`
(safetensors first; a ``.bin``/``.pth``/``.pt`` only with ``torch.load(weights_only=True)``, a
pickle holding more than tensors refused in one sentence, its code never run). Every mistake (a missing
file, a key the backbone needs and the file lacks, a shape that differs) is a
:class:`~jaxrat.runtime.errors.ConfigError` naming the key and both shapes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat.checkpointing.hub import resolve_pretrained
from jaxrat.checkpointing.named_arrays import named_leaves
from jaxrat.checkpointing.weight_files import read_arrays, read_model_folder
from jaxrat.models.backbones import convert
from jaxrat.models.backbones.architecture import file_fields
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.tree_paths import path_name


def read_weights(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state dict as numpy arrays, Hugging Face ``config.json`` or {}) of a file or model folder,
    read by :func:`jaxrat.checkpointing.weight_files.read_arrays`."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise ConfigError(f"pretrained weights {path} do not exist; give a .safetensors/.bin/.pth file or a "
                          f"Hugging Face model folder.")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if path.is_dir() and config_file.is_file() else {}
    if path.is_dir():
        return read_model_folder(path), config  # a folder here is a model folder, never a run
    return read_arrays(path), config


def origin_of(path: str | os.PathLike, state: Mapping[str, np.ndarray]) -> str:
    """"hf" or "timm": the library the weights at ``path`` come from (their config, else their names)."""
    return file_fields(path)[0] or ("hf" if convert.is_hf(state) else "timm")


def convert_state(state: Mapping[str, np.ndarray], expected: Mapping[str, tuple], where: str,
                  origin: str = "") -> dict[str, np.ndarray]:
    """A timm or Hugging Face state dict as arrays for a backbone whose parameters are ``expected``
    (path -> shape), through the backbones' filter (:func:`convert.checkpoint_filter`), resampled to
    its image size as ``origin``'s library does it (default: by the names). Entries the backbone does
    not have (a classifier of other classes, a pooler) are left out; a missing or mis-shaped one is an
    error naming the file's key and the model's."""
    named, sources = convert.checkpoint_filter(state, expected, origin)
    missing = [k for k in expected if k not in named and not k.startswith("head/")]
    if missing:
        hint = "" if len(missing) == 1 else f" and {len(missing) - 1} more"
        hf = " (or its Hugging Face name)" if convert.is_hf(state) else ""
        raise ConfigError(f"pretrained weights {where} lack the model's {missing[0]} (the file's "
                          f"{convert.file_name(missing[0])!r}{hf}){hint} of {len(expected)} backbone parameters; the "
                          f"file is partial or of another architecture (set config.model.backbone to the one it was "
                          f"saved from).")
    out = {}
    for name, shape in expected.items():
        if name not in named:
            continue
        if tuple(named[name].shape) != tuple(shape):
            if name.startswith("head/"):
                continue  # a classifier for other classes: the new one starts fresh
            raise ConfigError(f"pretrained weights {where}: the file's {sources.get(name, convert.file_name(name))!r} "
                              f"(the model's {name}) has shape {tuple(named[name].shape)} after conversion but the "
                              f"model's is {tuple(shape)}; set config.model.backbone (and its sizes) to the "
                              f"architecture the file was saved from.")
        out[name] = named[name]
    return out


def load_backbone_weights(path: str | os.PathLike, expected: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """Read, convert and check the weights at ``path`` for a backbone with parameters ``expected``."""
    state, _ = read_weights(path)
    if not state:
        raise ConfigError(f"pretrained weights {path} hold no tensors; download them again.")
    return convert_state(state, expected, str(path), origin_of(path, state))


def expected_shapes(model: Any) -> dict[str, tuple]:
    """Parameter path -> shape of an (abstract) backbone."""
    return {k: tuple(v.shape) for k, v in named_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def set_params(model: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` (path -> array, a subset of the model's parameters) into ``model`` in place."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jnp.asarray(arrays[path_name(p)], leaf.dtype) if path_name(p) in arrays else leaf, params)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)


def pretrained_arrays(source: str | os.PathLike, abstract_params: Any,
                      prefix: str = "backbone/") -> dict[str, np.ndarray]:
    """The weights ``source`` names (a ``config.model.pretrained`` value: a file, a model folder, or
    ``hf:OWNER/NAME[@REV]``, taken from the hub's cache or downloaded) converted for the backbone under
    ``prefix`` of a model whose parameters are ``abstract_params`` (shapes suffice), as
    ``{prefix + name: array}`` (the trainer places them with
    :func:`jaxrat.checkpointing.init_from.place_arrays`)."""
    expected = {k[len(prefix):]: tuple(v.shape) for k, v in named_leaves(abstract_params).items()
                if k.startswith(prefix)}
    if not expected:
        raise ConfigError(f"config.model.pretrained is set but this model has no {prefix.rstrip('/')}; pretrained "
                          f"weights load into a ViT/BEiT/Swin backbone (backbone_classifier, transunet, swin_unet).")
    path = resolve_pretrained(str(source))  # the commit the model's architecture was read from
    _, kind, fields, where = file_fields(path)
    state, _ = read_weights(path)
    if not state:
        raise ConfigError(f"pretrained weights {path} hold no tensors; download them again.")
    origin = origin_of(path, state)
    library = "Hugging Face" if origin == "hf" else "timm"
    if where:
        logging.info("pretrained: a %s %s; architecture from %s: %s", library, kind, where,
                     ", ".join(f"{k}={v}" for k, v in sorted(fields.items())))
    logging.info("pretrained: position embeddings and bias tables of another size resampled as %s does it (%s)",
                 library, "bicubic; BEiT tables bilinear" if origin == "hf" else
                 "antialiased bicubic; relative tables on BEiT's geometric spacing")
    arrays = {prefix + k: v for k, v in convert_state(state, expected, str(path), origin).items()}
    logging.info("pretrained: %d backbone tensors from %s", len(arrays), path)
    return arrays

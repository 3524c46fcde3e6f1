"""Pretrained backbone weights from the files users have: a timm ``.safetensors``, ``.bin`` or
``.pth``, or a Hugging Face model folder (``config.json`` beside ``model.safetensors`` or
``pytorch_model.bin``, sharded or not), converted on load (:mod:`jaxrat.models.backbones.convert`).

Safetensors hold only tensors and are read first. A ``.bin``/``.pth``/``.pt`` is read with
``torch.load(weights_only=True)``, which refuses a pickle holding anything but tensors and plain
containers; such a file ends with one sentence, never by running its code. Every mistake (a missing
file, a key the backbone needs and the file lacks, a shape that differs) is a
:class:`~jaxrat.runtime.errors.ConfigError` naming the key and both shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jaxrat.models.backbones import convert
from jaxrat.runtime.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "open_clip_pytorch_model.bin")
TORCH_SUFFIXES = (".bin", ".pth", ".pt")


def _read_torch(path: Path) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{path} is a PyTorch pickle and reading it needs torch (pip install "
                          f"'jaxrat[reference]'); or convert it to .safetensors.") from None
    import pickle

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path} is a pickle that holds more than plain tensors ({first}); jaxrat reads "
                          f"such files only with torch.load(weights_only=True) and never runs their code: save "
                          f"the state_dict alone, or as .safetensors.") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{path} is not a readable PyTorch file ({e}); download it again.") from None
    return data


def _read_file(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a readable safetensors file ({e}); download it again.") from None
    if path.suffix == ".npz":
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    if path.suffix not in TORCH_SUFFIXES:
        raise ConfigError(f"{path}: pretrained weights must be .safetensors, .bin, .pth, .pt or .npz, or a "
                          f"Hugging Face model folder.")
    data = _read_torch(path)
    for wrapper in ("state_dict", "model", "module"):  # checkpoints saved by training scripts
        if isinstance(data, Mapping) and isinstance(data.get(wrapper), Mapping):
            data = data[wrapper]
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a state dict of tensors; save "
                          f"model.state_dict().")
    out = {}
    for key, value in data.items():
        if not hasattr(value, "detach"):
            raise ConfigError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; save "
                              f"model.state_dict().")
        out[str(key).removeprefix("module.")] = value.detach().cpu().float().numpy()
    return out


def read_weights(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state dict as numpy arrays, Hugging Face ``config.json`` or {}) of a file or model folder."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise ConfigError(f"pretrained weights {path} do not exist; give a .safetensors/.bin/.pth file or a "
                          f"Hugging Face model folder.")
    if not path.is_dir():
        return _read_file(path), {}
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for name in WEIGHT_FILES:
        found = path / name
        if not found.is_file():
            continue
        if name.endswith(".index.json"):  # sharded: the index maps each tensor to its shard
            shards = sorted(set(json.loads(found.read_text()).get("weight_map", {}).values()))
            state: dict[str, np.ndarray] = {}
            for shard in shards:
                if not (path / shard).is_file():
                    raise ConfigError(f"{path} is partial: {shard}, named by {name}, is missing; download the "
                                      f"model folder again.")
                state.update(_read_file(path / shard))
            return state, config
        return _read_file(found), config
    raise ConfigError(f"{path} holds none of {', '.join(WEIGHT_FILES)}; point at the weights file or a complete "
                      f"Hugging Face model folder.")


def convert_state(state: Mapping[str, np.ndarray], expected: Mapping[str, tuple], where: str) -> dict[str, np.ndarray]:
    """A timm or Hugging Face state dict as arrays for a backbone whose parameters are ``expected``
    (path -> shape), resampled to its image size. Entries the backbone does not have (a classifier
    of other classes, a pooler) are left out; a missing or mis-shaped one is an error."""
    named = convert.timm_to_jaxrat(convert.hf_to_timm(state) if convert.is_hf(state) else state)
    named = convert.fit(named, expected)
    missing = [k for k in expected if k not in named and not k.startswith("head/")]
    if missing:
        hint = "" if len(missing) == 1 else f" and {len(missing) - 1} more"
        raise ConfigError(f"pretrained weights {where} lack {missing[0]}{hint} of {len(expected)} backbone "
                          f"parameters; the file is partial or of another architecture (set config.model.backbone "
                          f"to the one it was saved from).")
    out = {}
    for name, shape in expected.items():
        if name not in named:
            continue
        if tuple(named[name].shape) != tuple(shape):
            if name.startswith("head/"):
                continue  # a classifier for other classes: the new one starts fresh
            raise ConfigError(f"pretrained weights {where}: {name} has shape {tuple(named[name].shape)} in the file "
                              f"but {tuple(shape)} in the model; set config.model.backbone (and its sizes) to the "
                              f"architecture the file was saved from.")
        out[name] = named[name]
    return out


def load_backbone_weights(path: str | os.PathLike, expected: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """Read, convert and check the weights at ``path`` for a backbone with parameters ``expected``."""
    state, _ = read_weights(path)
    if not state:
        raise ConfigError(f"pretrained weights {path} hold no tensors; download them again.")
    return convert_state(state, expected, str(path))


def expected_shapes(model: Any) -> dict[str, tuple]:
    """Parameter path -> shape of an (abstract) backbone."""
    from flax import nnx

    from jaxrat.runtime.tree_paths import named_leaves

    return {k: tuple(v.shape) for k, v in named_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def set_params(model: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` (path -> array, a subset of the model's parameters) into ``model`` in place."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrat.runtime.tree_paths import path_name

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jnp.asarray(arrays[path_name(p)], leaf.dtype) if path_name(p) in arrays else leaf, params)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)


def pretrained_arrays(path: str | os.PathLike, abstract_params: Any,
                      prefix: str = "backbone/") -> dict[str, np.ndarray]:
    """The file at ``path`` converted for the backbone under ``prefix`` of a model whose parameters
    are ``abstract_params`` (shapes suffice), as ``{prefix + name: array}`` (the trainer places them
    with :func:`jaxrat.checkpointing.init_from.place_arrays`)."""
    from jaxrat.runtime.tree_paths import named_leaves

    expected = {k[len(prefix):]: tuple(v.shape) for k, v in named_leaves(abstract_params).items()
                if k.startswith(prefix)}
    if not expected:
        raise ConfigError(f"config.model.pretrained is set but this model has no {prefix.rstrip('/')}; pretrained "
                          f"weights load into a ViT/BEiT/Swin backbone (backbone_classifier, transunet, swin_unet).")
    return {prefix + k: v for k, v in load_backbone_weights(path, expected).items()}

"""One reader for every file of weights jaxrat loads: named arrays from what a user points at.

:func:`read_arrays` reads a ``.safetensors`` (tensors only, read first), a PyTorch ``.bin``/
``.pth``/``.pt`` (``torch.load(weights_only=True)`` only: a pickle holding anything but tensors and
plain containers is refused with one sentence quoting torch's reason, never run), a ``.npz``, a
Hugging Face model folder (``model.safetensors`` or ``pytorch_model.bin``, sharded or not) or a
jaxrat run's Orbax checkpoint (``PATH[:STEP|:best|:latest]``), and returns ``{name: array}`` with
the file's own names. What those names mean for a model is the model's business: each keeps its
filter beside it, as timm keeps a ``checkpoint_filter_fn`` beside each model
(:func:`jaxrat.models.backbones.convert.checkpoint_filter` for ViT/BEiT/Swin,
:func:`jaxrat.models.torch_import.convert_state_dict` for the reference RAT).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from jaxrat.runtime.errors import ConfigError

# A Hugging Face model folder's weights, in the order they are preferred.
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "open_clip_pytorch_model.bin")
TORCH_SUFFIXES = (".bin", ".pth", ".pt")
FILE_SUFFIXES = (".safetensors", ".npz", *TORCH_SUFFIXES)


def is_weight_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a weights file by its suffix (not a jaxrat run)."""
    return Path(os.path.expanduser(str(path))).suffix in FILE_SUFFIXES


def _torch_reason(error: Exception) -> str:
    """The line of torch's refusal that says what the pickle held ("GLOBAL builtins.print was not an
    allowed global"), not its generic last line pointing at the documentation."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line:
            reason = line.split("error:", 1)[-1].strip()
            return reason.split(" by default", 1)[0].rstrip(".")
    return lines[-1] if lines else type(error).__name__


def _read_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{path} is a PyTorch pickle and reading it needs torch (pip install "
                          f"'jaxrat[reference]'); or convert it to .safetensors.") from None
    import pickle

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConfigError(f"{path} is a pickle that holds more than plain tensors ({_torch_reason(e)}); jaxrat "
                          f"reads such files only with torch.load(weights_only=True) and never runs their code: "
                          f"save the state_dict alone, or as .safetensors.") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{path} is not a readable PyTorch file ({e}); download it again.") from None
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


def _read_file(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a readable safetensors file ({e}); download it again.") from None
    if path.suffix == ".npz":
        try:
            with np.load(path) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is not a readable .npz file ({e}); write it again.") from None
    if path.suffix in TORCH_SUFFIXES:
        return _read_torch(path)
    raise ConfigError(f"{path}: weights must be .safetensors, .bin, .pth, .pt or .npz, a Hugging Face model folder "
                      f"or a jaxrat run's checkpoint.")


def read_model_folder(path: Path) -> dict[str, np.ndarray]:
    """The weights of a Hugging Face model folder (one file or shards), by the file's names."""
    for name in MODEL_FILES:
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
            return state
        return _read_file(found)
    raise ConfigError(f"{path} holds none of {', '.join(MODEL_FILES)}; point at the weights file or a complete "
                      f"Hugging Face model folder.")


def _read_checkpoint(spec: str, item: str) -> dict[str, np.ndarray]:
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from jaxrat.checkpointing.named_arrays import named_leaves
    from jaxrat.checkpointing.reading import open_checkpoint

    with open_checkpoint(spec, [item]) as opened, ocp.PyTreeCheckpointer() as ckptr:
        where = os.path.join(opened.where, "state")
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(where)).tree
        if item not in tree:
            raise ConfigError(f"the checkpoint {spec} holds no {item}; read its params instead.")
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {item: jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device),
                                     tree[item])}
        restored = ckptr.restore(where, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    return {k: np.asarray(v) for k, v in named_leaves(restored[item]).items()}


def _is_run(path: Path) -> bool:
    """Whether the folder ``path`` is a jaxrat run, its checkpoints/ or one of its steps."""
    from jaxrat.checkpointing import store

    return ((path / "checkpoints").is_dir() or (path / store.COMMIT_FILE).is_file()
            or any(n.isdigit() and (path / n).is_dir() for n in os.listdir(path)))


def read_arrays(source: str | os.PathLike, item: str = "params") -> dict[str, np.ndarray]:
    """Every array of the weights at ``source`` by the file's own names (a jaxrat checkpoint's
    ``item`` by its parameter paths, ``a/b/kernel``); one sentence for a file missing, unreadable or
    unsafe. A folder is a Hugging Face model folder unless it is a jaxrat run (or its checkpoints)."""
    path = Path(os.path.expanduser(str(source)))
    if path.suffix in FILE_SUFFIXES or path.is_file():
        if not path.is_file():
            raise ConfigError(f"weights {path} do not exist; give a .safetensors/.bin/.pth/.npz file, a Hugging "
                              f"Face model folder or a jaxrat run.")
        return _read_file(path)
    if path.is_dir() and (any((path / n).is_file() for n in MODEL_FILES) or not _is_run(path)):
        return read_model_folder(path)
    return _read_checkpoint(str(source), item)

"""Import weights of the PyTorch reference RAT into the Flax backbone.

Usage from Python::

    from jaxrat.models.torch_import import load_reference_backbone
    model = load_reference_backbone("rat.pt", {"feature_dims": 128, "num_heads": 8},
                                    reference_compat=True)

and from the shell (writes a flat ``.npz`` of Flax params that :func:`load_params_npz` reads)::

    python -m jaxrat.models.torch_import --state-dict rat.pt --config rat.json --out rat_flax.npz

``config`` holds the reference constructor's keyword arguments (``ResolutionAwareTransformer``;
the names are the same in :class:`jaxrat.models.rat.ResolutionAwareTransformer`). Layout
conversions: Linear ``(out, in)`` -> kernel ``(in, out)``; Conv ``(out, in, *k)`` ->
``(*k, in, out)`` (both frameworks cross-correlate); LayerNorm ``weight`` -> ``scale``; RoSE
``freqs``/``scale_*``, ``temp``, ``mask_embedding`` and ``leading_tokens`` are copied as they are.

Reading ``.pt`` files and :func:`import_reference_package` need the ``reference`` extra (torch
and the reference packages); converting an in-memory dict of numpy arrays needs nothing extra.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat import ops
from jaxrat.models.rat.backbone import ResolutionAwareTransformer
from jaxrat.runtime.errors import ConfigError

# Reference constructor arguments that have no counterpart here or must keep their default.
_IGNORED_CONFIG = {"mlp_activation"}


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        return value.detach().cpu().float().numpy()
    return np.asarray(value, dtype=np.float32)


def read_state_dict(source: str | os.PathLike | Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """A reference state dict as numpy arrays, from a mapping or a ``.pt``/``.pth``/``.safetensors``/
    ``.npz`` file (:func:`jaxrat.checkpointing.weight_files.read_arrays`). This model's filter, the
    name and layout mapping, is :func:`convert_state_dict`.

    ``prefix`` (e.g. ``"backbone."``) is stripped and entries without it are dropped, for state
    dicts saved from a wrapper model.
    """
    if isinstance(source, (str, os.PathLike)):
        from jaxrat.checkpointing.weight_files import read_arrays

        source = read_arrays(source)  # jaxrat's one weight reader: .pt/.pth (weights_only), .safetensors, .npz
    out = {}
    for key, value in source.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = _to_numpy(value)
    return out


def _backbone_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in dict(config).items() if k not in _IGNORED_CONFIG}
    act = config.get("mlp_activation")
    if act is not None and getattr(act, "__name__", str(act)) not in ("GELU", "gelu"):
        raise ValueError(f"only the reference's default GELU MLP activation is supported, got {act!r}")
    return kwargs


def _torch_key(path: tuple, ndim: int) -> tuple[str, str]:
    """(torch state-dict key, conversion kind) for one Flax param path."""
    names = [str(p) for p in path]
    leaf = names[-1]
    kind = "copy"
    if leaf == "kernel":
        names[-1] = "weight"
        kind = "linear" if ndim == 2 else "conv"
    elif leaf == "scale" and names[-2].startswith("norm"):
        names[-1] = "weight"
    return ".".join(names), kind


def convert_state_dict(
    state_dict: Mapping[str, Any],
    model: nnx.Module,
    *,
    strict: bool = True,
) -> dict:
    """Map a reference state dict onto ``model``'s parameters; returns a pure dict of params.

    Args:
      state_dict: torch-named tensors or arrays (see :func:`read_state_dict`).
      model: a :class:`ResolutionAwareTransformer` (or any module with the same naming) whose
        parameter shapes define the target.
      strict: raise on missing or unused entries (parameters with no reference counterpart, such
        as ``abs_pos``, are always allowed to keep their initial values).

    Returns:
      Nested dict of numpy arrays with the structure of ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.
    """
    sd = {k: _to_numpy(v) for k, v in state_dict.items()}
    target = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    used: set[str] = set()
    missing: list[str] = []

    def convert(path, leaf):
        names = tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
        key, kind = _torch_key(names, np.ndim(leaf))
        if key not in sd:
            if not key.startswith("abs_pos."):
                missing.append(f"{key} (the model's {'/'.join(map(str, names))})")
            return np.asarray(leaf)
        used.add(key)
        w = sd[key]
        if kind == "linear":
            w = w.T
        elif kind == "conv":
            w = np.transpose(w, tuple(range(2, w.ndim)) + (1, 0))
        if w.shape != np.shape(leaf):
            raise ValueError(f"the file's {key} (the model's {'/'.join(map(str, names))}): reference shape {w.shape} "
                             f"does not match Flax shape {np.shape(leaf)}; "
                             f"check the config")
        return w.astype(np.float32)

    converted = jax.tree_util.tree_map_with_path(convert, target)
    unused = sorted(set(sd) - used)
    if strict and (missing or unused):
        raise ValueError(f"state dict does not match the config: missing {missing[:10]}, unused {unused[:10]}")
    return converted


def load_reference_backbone(
    source: str | os.PathLike | Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    prefix: str = "",
    dtype: Any = jnp.float32,
    strict: bool = True,
    kernels: Any = "auto",
    **overrides: Any,
) -> ResolutionAwareTransformer:
    """Build a Flax RAT backbone from ``config`` and load the reference weights into it.

    ``overrides`` are extra fields of the Flax backbone (:class:`jaxrat.models.rat.RATConfig`),
    typically ``reference_compat=True`` to reproduce the reference's outputs exactly. ``kernels``
    is the kernel policy or its name, resolved here (this builds a model for a caller, like a run
    does): "auto" (from this process's devices), "cpu", "gpu" or "portable".
    """
    kwargs = _backbone_kwargs(config) | overrides
    model = ResolutionAwareTransformer(**kwargs, kernels=ops.resolve(kernels), dtype=dtype, rngs=nnx.Rngs(0))
    params = convert_state_dict(read_state_dict(source, prefix), model, strict=strict)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, params))
    nnx.update(model, state)
    return model


def flatten_params(params: Mapping) -> dict[str, np.ndarray]:
    """Nested param dict -> {"a/b/c": array} (the .npz layout the CLI writes)."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        flat["/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)] = np.asarray(leaf)
    return flat


def load_params_npz(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
    """Load a CLI-written ``.npz`` into ``model`` (in place; also returned), read by jaxrat's one
    weight reader (:func:`jaxrat.checkpointing.weight_files.read_arrays`)."""
    from jaxrat.checkpointing.weight_files import read_arrays

    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    flat = read_arrays(path)

    def fill(tree_path, leaf):
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in tree_path)
        if key not in flat:
            raise ConfigError(f"{path} has no {key}, a parameter of this model; write it again from a backbone "
                              f"built with the same config.")
        if tuple(flat[key].shape) != tuple(leaf.shape):
            raise ConfigError(f"{path}: {key} is {tuple(flat[key].shape)} in the file but {tuple(leaf.shape)} in "
                              f"this model; build the model with the config the file was written from.")
        return jnp.asarray(flat[key])

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, pure))
    nnx.update(model, state)
    return model


_REFERENCE_TIMM: Optional[types.ModuleType] = None


def import_reference_package() -> types.ModuleType:
    """Import the PyTorch reference ``resolution_aware_transformer`` without torchvision.

    The reference needs only ``timm.layers.Mlp`` and ``DropPath``, but ``import timm`` imports
    torchvision, whose PyPI (CUDA) build fails to load beside a CPU torch ("operator
    torchvision::nms does not exist"). If timm is not importable as a whole, this registers a
    bare ``timm``/``timm.layers`` package that loads timm's real ``mlp.py`` and ``drop.py`` files
    (unchanged code) and nothing else. Requires the ``reference`` extra.
    """
    global _REFERENCE_TIMM
    if "timm" not in sys.modules:
        spec = importlib.util.find_spec("timm")
        if spec is None or spec.origin is None:
            raise ImportError("timm is not installed; pip install 'jaxrat[reference]'")
        root = os.path.dirname(spec.origin)
        timm = types.ModuleType("timm")
        timm.__path__ = [root]
        layers = types.ModuleType("timm.layers")
        layers.__path__ = [os.path.join(root, "layers")]
        timm.layers = layers
        sys.modules["timm"], sys.modules["timm.layers"] = timm, layers
        layers.Mlp = importlib.import_module("timm.layers.mlp").Mlp
        layers.DropPath = importlib.import_module("timm.layers.drop").DropPath
        _REFERENCE_TIMM = timm
    return importlib.import_module("resolution_aware_transformer")


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: convert a reference state dict to a Flax ``.npz``."""
    parser = argparse.ArgumentParser(prog="python -m jaxrat.models.torch_import", description=__doc__.split("\n")[0])
    parser.add_argument("--state-dict", required=True, help=".pt/.pth (torch.save of a state dict) or .npz")
    parser.add_argument("--config", default=None,
                        help="JSON file of reference constructor kwargs (default: reference defaults)")
    parser.add_argument("--out", required=True, help="output .npz of Flax params")
    parser.add_argument("--prefix", default="", help="strip this key prefix (e.g. 'backbone.')")
    parser.add_argument("--non-strict", action="store_true", help="allow missing/unused entries")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text()) if args.config else {}
    model = load_reference_backbone(args.state_dict, config, prefix=args.prefix, strict=not args.non_strict)
    flat = flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    np.savez(args.out, **flat)
    print(f"wrote {len(flat)} arrays ({sum(v.size for v in flat.values()):,} parameters) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

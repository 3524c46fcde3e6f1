"""Shardings for batches, parameters and optimizer state, decided on abstract shapes.

ZeRO presets: 0 replicates everything; 1 shards optimizer state; 2 also reduce-scatters
gradients into that sharding; 3 also shards parameters (FSDP). An array is sharded over the
ZeRO axis along its largest dimension divisible by the axis size, when it has at least
``min_size`` elements; otherwise it is replicated.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.tree_paths import path_name


def batch_spec(mesh: Mesh) -> P:
    """Batches split their leading dimension over every mesh axis."""
    return P(tuple(mesh.axis_names))


def zero_axes(mesh: Mesh, axis: str) -> tuple[str, ...]:
    """Mesh axes named by ``config.sharding.axis`` ("fsdp" or "data,fsdp")."""
    names = tuple(a.strip() for a in axis.split(",") if a.strip())
    for n in names:
        if n not in mesh.axis_names:
            raise ConfigError(f"config.sharding.axis names {n!r}, not a mesh axis of {mesh.axis_names}.")
    return names


def zero_axis(mesh: Mesh, axis: str, zero: int) -> str:
    """The axes ZeRO shards over: ``axis`` (``config.sharding.axis``), or every mesh axis when ``axis``
    spans one device while the mesh has more. ZeRO's stages shard over the data-parallel devices (as
    DeepSpeed's do); on the default mesh, ``{'data': N, 'fsdp': 1}``, ``sharding.zero`` alone would
    otherwise shard nothing and still switch the replicated-state forms (fused AdamW, one-kernel cast) off."""
    axes = zero_axes(mesh, axis)
    if zero > 0 and mesh.size > 1 and int(np.prod([mesh.shape[a] for a in axes])) == 1:
        wide = ",".join(mesh.axis_names)
        logging.info("ZeRO-%d over the mesh axes %s: config.sharding.axis=%r spans 1 of the %d devices", zero, wide,
                     axis, mesh.size)
        return wide
    return axis


def fsdp_spec(shape: tuple[int, ...], axes: tuple[str, ...], axis_size: int, min_size: int) -> P:
    """Shard the largest dimension divisible by ``axis_size``; replicate small or indivisible arrays."""
    if axis_size <= 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % axis_size == 0:
            spec = [None] * len(shape)
            spec[dim] = axes if len(axes) > 1 else axes[0]
            return P(*spec)
    return P()


def parse_rule_spec(spec: Any, mesh: Mesh) -> str | P:
    """A rule's spec: "replicate", "fsdp", or per-dimension axes such as ``(None, "fsdp")``."""
    if spec in ("replicate", "fsdp"):
        return spec
    if isinstance(spec, str):
        import ast

        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"Sharding rule spec {spec!r} is not 'replicate', 'fsdp' or a tuple like (None, 'fsdp')."
            ) from None
    dims = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    for d in dims:
        for a in (d if isinstance(d, (tuple, list)) else (d,)):
            if a is not None and a not in mesh.axis_names:
                raise ConfigError(f"Sharding rule spec {spec!r} names {a!r}, not a mesh axis of {mesh.axis_names}.")
    return P(*dims)


def tree_shardings(
    abstract: Any, mesh: Mesh, *, shard: bool, axis: str, min_size: int, rules: Any = ()
) -> Any:
    """NamedShardings for every leaf of ``abstract`` (ShapeDtypeStructs or arrays).

    ``rules`` are ``(regex, spec)`` pairs matched (``re.search``) against the leaf's path, e.g.
    ``"conv1/kernel"`` or ``"mu/.*/kernel$"``; the first match wins, and unmatched leaves follow
    the ZeRO preset (``shard``). Optimizer-state paths contain the parameter path, so one rule
    covers a parameter and its moments.
    """
    import re

    axes = zero_axes(mesh, axis)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    compiled = [(re.compile(r), parse_rule_spec(sp, mesh)) for r, sp in rules]

    def one(path: tuple, x: Any) -> NamedSharding:
        name = path_name(path)
        spec: Any = "fsdp" if shard else "replicate"
        for regex, rule in compiled:
            if regex.search(name):
                spec = rule
                break
        if spec == "fsdp":
            spec = fsdp_spec(tuple(x.shape), axes, size, min_size)
        elif spec == "replicate":
            spec = P()
        elif len(spec) > len(x.shape) or any(
            d is not None and x.shape[i] % int(np.prod([mesh.shape[a] for a in (d if isinstance(d, tuple) else (d,))]))
            for i, d in enumerate(spec)
        ):
            raise ConfigError(f"Sharding rule {spec} does not fit {name} of shape {tuple(x.shape)}; "
                              f"fix config.sharding.rules.")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, abstract)


def log_shardings(tree: Any, shardings: Any, name: str) -> None:
    """Sharding of every leaf at debug level; bytes per device at info level."""
    total = 0
    for (path, x), (_, s) in zip(
        jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree_util.tree_flatten_with_path(shardings)[0]
    ):
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        shard_shape = s.shard_shape(tuple(x.shape))
        total += int(np.prod(shard_shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        logging.debug("%s%s %s %s -> %s", name, jax.tree_util.keystr(path), x.shape, s.spec, nbytes)
    logging.info("%s: %.2f MiB per device", name, total / 2**20)

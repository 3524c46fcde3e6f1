"""Start a new run from another run's weights (``config.init_from``), optionally with its optimizer state."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxrat.checkpointing.named_arrays import named_leaves, subtree
from jaxrat.checkpointing.reading import Opened, open_checkpoint
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.tree_paths import path_name


def load_init(spec: str, abstract_state: Any, *, optimizer: bool = False, include: str = "", exclude: str = "",
              strict: bool = True, rename: str = "", params_from: str = "params", together: bool = True,
              opened: Opened | None = None) -> dict[str, Any]:
    """Weights of another run for a new one: ``{"params": ...}`` (and ``"opt_state"`` when asked).
    ``params_from`` names the checkpoint item read as ``"params"``: ``"ema_params"`` reads the
    moving average of a run trained with ``optimizer.ema_decay``.

    ``spec`` is ``PATH[:STEP|:best|:latest]`` (a jaxrat run) or a file of parameters by path (a
    ``.npz`` from ``python -m jaxrat.models.torch_import``, or ``.safetensors``/``.pth``), read by
    :func:`jaxrat.checkpointing.weight_files.read_arrays`; arrays land on the shardings of ``abstract_state``.
    ``include``/``exclude``: regexes searched in parameter paths (``backbone/...``, as
    :func:`jaxrat.checkpointing.named_arrays.named_leaves` spells them): only included, not excluded ones load.
    ``strict``: every parameter must load (a shape difference, or a parameter one side lacks, ends
    with a ConfigError naming it). Otherwise ``params`` holds only the parameters that loaded
    (merge them into a fresh state with :func:`merge_params`) and the log lists the others, which
    keep their fresh initialisation; nothing loading at all is an error. ``rename``:
    ``"OLD=NEW[,OLD2=NEW2]"`` path prefixes of the source replaced before matching (for a source
    whose model names its parts otherwise).
    The optimizer state comes with its schedule step counts set to 0 (see :func:`restart_schedules`).
    A run's checkpoint is read as :func:`jaxrat.checkpointing.reading.open_checkpoint` holds it
    (checked against its digests, ``latest`` falling back past damage, held still against a
    training's rotation); ``opened``: one the caller holds already. ``together``: see there.
    """
    select = _selector(include, exclude)  # the user's patterns are refused before anything is read
    renames = _renames(rename)
    if _is_npz(spec) or renames:
        if optimizer:
            raise ConfigError(f"init_from={spec}: a weights file (.npz, .safetensors, .pth) or init_from_rename "
                              f"loads parameters only; drop "
                              f"--config.checkpoint.init_optimizer.")
        return {"params": _load_arrays(spec, abstract_state["params"], select, strict, renames)}
    keys = [params_from] + (["opt_state"] if optimizer else [])
    if opened is None:
        with open_checkpoint(spec, keys, together=together) as held:
            return _load_opened(held, abstract_state, keys, select, strict, optimizer, bool(include or exclude),
                                params_from)
    return _load_opened(opened, abstract_state, keys, select, strict, optimizer, bool(include or exclude),
                        params_from)


def _load_opened(opened: Opened, abstract_state: Any, keys: list[str], select: Callable[[str], bool], strict: bool,
                 optimizer: bool, patterns: bool, params_from: str) -> dict[str, Any]:
    directory, step, held = opened.directory, opened.step, opened.where
    where = os.path.join(directory, str(step))  # what messages name (``held`` may be a private copy)
    with ocp.PyTreeCheckpointer() as ckptr:
        saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(held) / "state").tree
        if params_from not in saved:
            raise ConfigError(f"init_from: the checkpoint {where} holds no {params_from} (the run kept no moving "
                              f"average); load its params instead.")
        if strict and not patterns:
            target = {k: abstract_state["params" if k == params_from else k] for k in keys}
            _check_compatible(target, {k: saved[k] for k in keys if k in saved}, where, optimizer)
        else:
            target = {params_from: _loadable(abstract_state["params"], saved[params_from], select,
                                             f"{directory} step {step}", strict, every=optimizer),
                      **({"opt_state": abstract_state["opt_state"]} if optimizer else {})}
        restored = dict(ckptr.restore(os.path.join(held, "state"), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
    logging.info("init_from: loaded %s from %s", " and ".join(keys), where)
    restored["params"] = restored.pop(params_from)
    if optimizer:
        restored["opt_state"], reset = restart_schedules(restored["opt_state"])
        if reset:
            logging.info("init_from: optimizer step counts %s set to 0, so the learning rate schedule starts "
                         "again at its warmup; the loaded moments and their bias-correction counts are kept",
                         ", ".join(reset))
    return restored


def merge_params(fresh: Any, loaded: Any) -> Any:
    """``fresh`` params with every leaf that ``loaded`` (a subtree of the same paths) holds replaced."""
    got = named_leaves(loaded)

    def pick(path: tuple, leaf: Any) -> Any:
        return got.get(path_name(path), leaf)

    return jax.tree_util.tree_map_with_path(pick, fresh)


def _selector(include: str, exclude: str) -> Callable[[str], bool]:
    try:
        inc = re.compile(include) if include else None
        exc = re.compile(exclude) if exclude else None
    except re.error as e:
        raise ConfigError(f"init_from_include/init_from_exclude: {e}; fix the regular expression.") from None
    return lambda name: (inc is None or bool(inc.search(name))) and not (exc is not None and exc.search(name))


def _loadable(abstract_params: Any, source: Any, select: Callable[[str], bool], where: str, strict: bool, *,
              every: bool = False) -> Any:
    """The subtree of ``abstract_params`` that ``source`` (a tree, or ``{path: array}``) fills: each
    parameter ``select`` admits that ``source`` holds in the same shape. Logs the others, or raises for
    them when ``strict`` (or, with ``every``, for any: the optimizer state needs every parameter)."""
    want = named_leaves(abstract_params)
    have = {k: tuple(getattr(v, "shape", ())) for k, v in named_leaves(source).items()}
    chosen, excluded, missing, differ = [], [], [], []
    for name, leaf in want.items():
        if not select(name):
            excluded.append(name)
        elif name not in have:
            missing.append(name)
        elif have[name] != tuple(leaf.shape):
            differ.append(f"{name} (checkpoint {have[name]}, model {tuple(leaf.shape)})")
        else:
            chosen.append(name)
    hint = "; train from scratch, pick a checkpoint of the same model, or narrow --config.init_from_include"
    if strict and (missing or differ):
        raise ConfigError(f"init_from: {(missing or differ)[0]} cannot load from {where}{hint}.")
    if not chosen:
        raise ConfigError(f"init_from: no parameter of this model loads from {where} (of {len(want)}: {len(excluded)} "
                          f"excluded by the patterns, {len(missing)} missing there, {len(differ)} of another shape)"
                          f"{hint}.")
    if every and len(chosen) < len(want):
        raise ConfigError("init_from: --config.checkpoint.init_optimizer needs every parameter loaded, but "
                          f"{len(want) - len(chosen)} are not; drop init_optimizer or the patterns.")
    logging.info("init_from: %d of %d parameter tensors load from %s", len(chosen), len(want), where)
    for what, names in (("shape differs", differ), ("not in the checkpoint", missing),
                        ("excluded by init_from_include/exclude", excluded)):
        if names:
            logging.warning("init_from: re-initialised (%s): %s", what, ", ".join(names))
    unused = sorted(set(have) - set(want))
    if unused:
        logging.info("init_from: %d checkpoint tensors not used, e.g. %s", len(unused), ", ".join(unused[:3]))
    return subtree(abstract_params, chosen)


def _is_npz(spec: str) -> bool:
    """Whether ``spec`` is a file of parameters by path (.npz, .safetensors, a torch state dict), not a run."""
    from jaxrat.checkpointing.weight_files import is_weight_file

    return is_weight_file(spec) and os.path.isfile(os.path.expanduser(spec))


# Where a backbone-only .npz (torch_import converts the reference backbone) lives in jaxrat's models.
NPZ_PREFIXES = ("", "backbone/")


def _renames(rename: str) -> list[tuple[str, str]]:
    out = []
    for part in (p.strip() for p in rename.split(",") if p.strip()):
        old, eq, new = part.partition("=")
        if not eq:
            raise ConfigError(f"init_from_rename={rename!r}: write OLD_PREFIX=NEW_PREFIX, comma-separated, e.g. "
                              f"encoder/=backbone/.")
        out.append((old, new))
    return out


def _source_arrays(spec: str) -> dict[str, Any]:
    """Every parameter of a weights file, or of a jaxrat checkpoint read onto the host, by path
    (:func:`jaxrat.checkpointing.weight_files.read_arrays`, jaxrat's one weight reader)."""
    from jaxrat.checkpointing.weight_files import read_arrays

    return read_arrays(spec) if _is_npz(spec) else read_arrays(spec, "params")


def _load_arrays(spec: str, abstract_params: Any, select: Callable[[str], bool], strict: bool,
                 renames: list[tuple[str, str]]) -> Any:
    flat = _source_arrays(spec)
    if renames:
        def renamed(k: str) -> str:
            for old, new in renames:
                if k.startswith(old):
                    return new + k[len(old):]
            return k

        arrays = {renamed(k): v for k, v in flat.items()}
    else:
        # The prefix under which most of the file's names are this model's parameters.
        want = named_leaves(abstract_params)
        prefix = max(NPZ_PREFIXES, key=lambda p: sum(f"{p}{k}" in want for k in flat))
        if prefix:
            logging.info("init_from: the names in %s are placed under %s", spec, prefix)
        arrays = {f"{prefix}{k}": v for k, v in flat.items()}
    logging.info("init_from: loading params from %s", spec)
    return _placed(arrays, abstract_params, select, spec, strict)


def place_arrays(arrays: dict[str, Any], abstract_params: Any, *, include: str = "", exclude: str = "",
                 where: str = "") -> Any:
    """Parameters (by path) from outside a jaxrat run, e.g. converted pretrained weights, as the
    subtree of ``abstract_params`` they fill, on its shardings; ``include``/``exclude`` as in
    :func:`load_init`. Parameters they do not fill keep their fresh values (:func:`merge_params`)."""
    return _placed(arrays, abstract_params, _selector(include, exclude), where, strict=False)


def _placed(arrays: dict[str, Any], abstract_params: Any, select: Callable[[str], bool], where: str,
            strict: bool) -> Any:
    def put(path: tuple, leaf: Any) -> Any:
        value = arrays[path_name(path)].astype(leaf.dtype)
        return jax.device_put(value, leaf.sharding) if getattr(leaf, "sharding", None) is not None else value

    return jax.tree_util.tree_map_with_path(put, _loadable(abstract_params, arrays, select, where, strict))


def restart_schedules(opt_state: Any) -> tuple[Any, list[str]]:
    """Set every schedule step count of an optax state to 0; returns (state, names of the counts reset).

    A new run starts at step 0 and logs its learning rate from the step, but optax computes it from
    the ``count`` leaves of its schedule states: loaded unchanged, they would continue the source
    run's schedule (no warmup, a decayed rate) behind the logs' back. A ``count`` that sits next to
    moments (``mu``/``nu``, as in Adam's state) is their bias correction and stays: the moments are
    warm, and a count of 0 would treat them as one step old and shrink the updates for many steps.
    """
    names = named_leaves(opt_state)

    def beside_moments(parent: str) -> bool:
        return any(n.startswith(f"{parent}/mu") or n.startswith(f"{parent}/nu") for n in names)

    reset: list[str] = []

    def maybe_zero(path: tuple, leaf: Any) -> Any:
        name = path_name(path)
        parent, _, last = name.rpartition("/")
        if last != "count" or beside_moments(parent):
            return leaf
        reset.append(name)
        return leaf * 0  # an elementwise op keeps the leaf's sharding and dtype

    out = jax.tree_util.tree_map_with_path(maybe_zero, opt_state)
    return out, reset


def _check_compatible(target: Any, saved: Any, where: str, optimizer: bool) -> None:
    want, have = named_leaves(target), named_leaves(saved)
    where = f"{os.path.dirname(where)} step {os.path.basename(where)}"
    hint = ("; train from scratch, or pick a checkpoint of the same model"
            + (" (or drop --config.checkpoint.init_optimizer)" if optimizer else ""))
    for path, leaf in want.items():
        if path not in have:
            raise ConfigError(f"init_from: {path} of this model is missing from the checkpoint {where}{hint}.")
        shape = tuple(getattr(have[path], "shape", ()))
        if shape != tuple(leaf.shape):
            raise ConfigError(
                f"init_from: {path} has shape {shape} in the checkpoint {where} but {tuple(leaf.shape)} in "
                f"this model{hint}."
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(f"init_from: the checkpoint {where} has {extra[0]}, which this model lacks{hint}.")

"""Start a new run from another run's weights (``config.init_from``), optionally with its optimizer state."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxrat.checkpointing import store
from jaxrat.errors import ConfigError
from jaxrat.tree_paths import named_leaves, path_name


def load_init(spec: str, abstract_state: Any, *, optimizer: bool = False, params_from: str = "params"
              ) -> dict[str, Any]:
    """Weights of another run for a new one: ``{"params": ...}`` (and ``"opt_state"`` when asked).
    ``params_from`` names the checkpoint item read as ``"params"``: ``"ema_params"`` reads the
    moving average of a run trained with ``optimizer.ema_decay``.

    ``spec`` is ``PATH[:STEP|:best|:latest]``; arrays land on the shardings of ``abstract_state``.
    A parameter whose shape differs, or that one side lacks, ends with a ConfigError naming it.
    The optimizer state comes with its schedule step counts set to 0 (see :func:`restart_schedules`).
    """
    directory, step = store.resolve(spec)
    keys = [params_from] + (["opt_state"] if optimizer else [])
    target = {k: abstract_state["params" if k == params_from else k] for k in keys}
    where = os.path.join(directory, str(step))
    # The "state" item alone, read with the plain PyTree handler: no manager, nothing to clean up.
    with ocp.PyTreeCheckpointer() as ckptr:
        saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(where) / "state").tree
        _check_compatible(target, {k: saved[k] for k in keys if k in saved}, where, optimizer)
        restored = dict(ckptr.restore(os.path.join(where, "state"), args=ocp.args.PyTreeRestore(
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

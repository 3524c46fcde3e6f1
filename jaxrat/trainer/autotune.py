"""Automatic batch sizing: the largest per-device micro-batch whose compiled step fits the devices'
memory, and the accumulation that reaches the target global batch.

Fitting is read from XLA's own accounting of the compiled step (``memory_analysis()``: arguments,
outputs and temporaries), so nothing is run and nothing runs out of memory to find out. On a GPU
the budget is the device's memory limit; on CPU (no limit to read) ``train.memory_budget_gb`` says
it, which is also how tests simulate a device.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np
from jax.experimental import multihost_utils

from jaxrat.config_schema import field
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.fileio import read_json, write_json
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import make_train_step

LR_RULES = ("none", "linear", "sqrt")
RECORD_NAME = "autotune.json"


@dataclasses.dataclass
class Choice:
    """What automatic sizing decided, and why."""

    per_device: int
    devices: int
    accum: int
    global_batch: int
    target: int
    budget_bytes: int
    tried: list[tuple[int, int]]  # (per-device micro-batch, compiled bytes), in the order tried
    learning_rate: float

    def table(self) -> str:
        rows = [f"| {b} | {m / 2**20:.1f} | {'yes' if m <= self.budget_bytes else 'no'} |" for b, m in self.tried]
        return "\n".join([
            f"automatic batch size: budget {self.budget_bytes / 2**20:.0f} MiB per device",
            "| per-device micro-batch | compiled step MiB | fits |", "|---|---|---|", *rows,
            f"chosen: {self.per_device} per device x {self.devices} devices x {self.accum} accumulation steps = "
            f"global batch {self.global_batch} (target {self.target}); learning rate {self.learning_rate:g}",
        ])


def wanted(config: mlc.ConfigDict) -> bool:
    """Whether the config asks for automatic sizing (``data.per_device_batch_size = "auto"``)."""
    return str(field(config.data, "data.per_device_batch_size")).strip().lower() == "auto"


def budget_bytes(config: mlc.ConfigDict) -> int:
    """Bytes one device may use for the step: the config's budget, else the device's limit, with
    ``train.memory_margin`` kept free (fragmentation, the allocator, the input prefetch)."""
    configured = float(field(config.train, "train.memory_budget_gb"))
    if configured > 0:
        total = configured * 2**30
    else:
        stats = jax.local_devices()[0].memory_stats() or {}
        if not stats.get("bytes_limit"):
            raise ConfigError("data.per_device_batch_size='auto' needs the devices' memory, which this platform does "
                              "not report; set --config.train.memory_budget_gb.")
        total = float(stats["bytes_limit"])
    return int(total * (1.0 - float(field(config.train, "train.memory_margin"))))


def compiled_bytes(compile_step: Callable[[int], Any], per_device: int) -> int:
    """Peak bytes per device of the step compiled for ``per_device`` examples per device."""
    mem = compile_step(per_device).memory_analysis()
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - getattr(mem, "alias_size_in_bytes", 0))


def choose(config: mlc.ConfigDict, devices: int, compile_step: Callable[[int], Any], *,
           max_per_device: int = 4096) -> Choice:
    """Double the per-device micro-batch while the compiled step fits, then bisect between the last
    fit and the first miss; derive accumulation and the learning rate from the target batch."""
    budget = budget_bytes(config)
    tried: list[tuple[int, int]] = []

    def fits(b: int) -> bool:
        tried.append((b, compiled_bytes(compile_step, b)))
        return tried[-1][1] <= budget

    if not fits(1):
        raise ConfigError(f"One example per device needs {tried[0][1] / 2**20:.0f} MiB, more than the budget of "
                          f"{budget / 2**20:.0f} MiB; use a smaller model or image size, shard parameters "
                          f"(--config.sharding.zero=3) or more memory.")
    good, bad = 1, None
    while bad is None and good * 2 <= max_per_device:
        if fits(good * 2):
            good *= 2
        else:
            bad = good * 2
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    target = int(field(config.data, "data.target_batch_size") or config.data.batch_size)
    micro = good * devices
    accum = max(1, math.ceil(target / micro))
    per_device = math.ceil(target / (devices * accum))  # the smallest micro-batch that reaches the target
    global_batch = per_device * devices * accum
    return Choice(per_device, devices, accum, global_batch, target, budget, tried,
                  scaled_learning_rate(config, global_batch))


def scaled_learning_rate(config: mlc.ConfigDict, global_batch: int) -> float:
    """``optimizer.learning_rate`` scaled from ``optimizer.reference_batch_size`` to ``global_batch``."""
    rule = str(field(config.optimizer, "optimizer.lr_scaling"))
    if rule not in LR_RULES:
        raise ConfigError(f"config.optimizer.lr_scaling={rule!r}; use one of {list(LR_RULES)}.")
    ref = int(field(config.optimizer, "optimizer.reference_batch_size") or 0)
    lr = float(config.optimizer.learning_rate)
    if rule == "none" or ref <= 0:
        return lr
    ratio = global_batch / ref
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def apply(config: mlc.ConfigDict, choice: Choice) -> mlc.ConfigDict:
    """A copy of ``config`` with the choice in it (batch, accumulation, learning rate); ``config``
    itself stays what was asked for, which is what ``config.json`` records."""
    sized = copy.deepcopy(config)
    sized.data.batch_size = choice.global_batch
    sized.optimizer.grad_accum_steps = choice.accum
    sized.optimizer.learning_rate = choice.learning_rate
    return sized


def record(choice: Choice, workdir: str) -> None:
    """Log the choice's table and write it to ``WORKDIR/autotune.json`` (process 0)."""
    logging.info("%s", choice.table())
    if jax.process_index() == 0:
        write_json(os.path.join(workdir, RECORD_NAME), dataclasses.asdict(choice), indent=2)


def recorded(workdir: str) -> Choice | None:
    """The choice recorded in ``WORKDIR/autotune.json``; None when there is none (or it is unreadable)."""
    saved = read_json(os.path.join(workdir, RECORD_NAME))
    try:
        return Choice(**{**saved, "tried": [tuple(t) for t in saved["tried"]]})
    except (TypeError, KeyError):  # none, or not a record of a choice
        return None


def kept(config: mlc.ConfigDict, devices: int, compile_step: Callable[[int], Any], workdir: str) -> Choice | None:
    """The choice an earlier start of this run recorded, when it was made for these devices and this
    target and its micro-batch still fits (one compile): a resume then trains with the batch,
    accumulation and learning rate it started with, without searching again (a search is a dozen
    compiles, and another device's memory could choose another batch). None: search. Process 0's
    record decides for every process (a workdir need not look the same from every host)."""
    before = recorded(workdir) if jax.process_index() == 0 else None
    fields = ([before.per_device, before.devices, before.accum, before.global_batch, before.target] if before
              else [0] * 5)
    per_device, was_devices, accum, global_batch, target = (
        int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(fields, np.int64)))
    now_target = int(field(config.data, "data.target_batch_size") or config.data.batch_size)
    if not per_device or was_devices != devices or target != now_target:
        return None
    budget = budget_bytes(config)
    need = compiled_bytes(compile_step, per_device)
    if need > budget:
        logging.warning("automatic batch size: the recorded micro-batch of %d per device needs %.0f MiB, more than "
                        "these devices' budget of %.0f MiB; searching again (the global batch and learning rate "
                        "may change from the ones the run trained with)", per_device, need / 2**20, budget / 2**20)
        return None
    return Choice(per_device, devices, accum, global_batch, target, budget, [(per_device, need)],
                  scaled_learning_rate(config, global_batch))  # the config's rule, as a fresh choice applies it


def abstract_batch(example: dict[str, np.ndarray], global_batch: int, sharding: Any) -> dict[str, Any]:
    """Shapes of a global batch of ``global_batch`` examples like the rows of ``example``."""
    return {k: jax.ShapeDtypeStruct((global_batch, *np.shape(v)[1:]), np.asarray(v).dtype, sharding=sharding)
            for k, v in example.items()}


def train_step_lowering(config: mlc.ConfigDict, mesh: jax.sharding.Mesh,
                        task: Any) -> Callable[[dict[str, np.ndarray], int], Any]:
    """``lower(example, global_batch)``: the train step of ``config`` on ``mesh`` lowered (``jax.stages.Lowered``)
    for ``global_batch`` examples shaped like the rows of ``example``, from shapes alone: no data, no
    parameters, nothing allocated. ``.compile()`` it for XLA's memory accounting."""
    spec = make_state_spec(config, mesh, task)
    step = make_train_step(spec)

    def lower(example: dict[str, np.ndarray], global_batch: int) -> Any:
        return step.lower(spec.abstract_with_shardings(), abstract_batch(example, global_batch, spec.batch_sharding))

    return lower


def size_batch(config: mlc.ConfigDict, mesh: jax.sharding.Mesh, task: Any, example: dict[str, np.ndarray],
               workdir: str) -> Choice:
    """Choose the batch for ``config`` on ``mesh`` and record it in ``workdir`` (:func:`apply` makes the
    config that trains with it), or keep the one recorded there (:func:`kept`); ``example`` is a host
    batch of the task (any size) that gives the fields' shapes and types."""
    if config.train.reduction_shards:
        # The probe sizes would not divide into the shards, and what must fit is one shard's program.
        raise ConfigError(
            f"data.per_device_batch_size='auto' cannot size a run with train.reduction_shards="
            f"{config.train.reduction_shards}; set data.batch_size to a multiple of the shards instead.")
    probe_config = copy.deepcopy(config)
    probe_config.optimizer.grad_accum_steps = 1  # one micro-batch is what must fit
    lower = train_step_lowering(probe_config, mesh, task)

    def compile_step(per_device: int) -> Any:
        return lower(example, per_device * mesh.size).compile()

    again = kept(config, mesh.size, compile_step, workdir)
    if again is not None:
        logging.info("automatic batch size: kept from %s: %d per device x %d devices x %d accumulation steps = global "
                     "batch %d", os.path.join(workdir, RECORD_NAME), again.per_device, again.devices, again.accum,
                     again.global_batch)
        return again
    choice = choose(config, mesh.size, compile_step)
    record(choice, workdir)
    return choice

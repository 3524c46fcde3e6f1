"""The train state: its shapes and shardings, creation born sharded, and restore-or-init.

The state is a plain dict of arrays, ``{"step", "params", "opt_state", "rng"}`` (plus
``"ema_params"``, the parameters' moving average, when ``optimizer.ema_decay`` is on), so a checkpoint
holds nothing but arrays. The model's non-parameter state (dropout RNG streams) is rebuilt every
step from the step's key instead of being carried, so dropout noise depends only on (seed, step).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat import ops
from jaxrat.checkpointing import Checkpointer, load_init
from jaxrat.checkpointing.init_from import merge_params, place_arrays
from jaxrat.config_schema import field
from jaxrat.models.backbones.weights import pretrained_arrays
from jaxrat.parallel import sharding
from jaxrat.runtime.compile_options import init_compiler_options
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import Task
from jaxrat.trainer.input_feed import Restorable
from jaxrat.trainer.optimizer import ema_enabled, ema_schedule, make_optimizer
from jaxrat.trainer.optimizer_step import Optimizer, optimizer_for

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_compute_dtype(name: str, mesh: jax.sharding.Mesh) -> str:
    """``train.compute_dtype`` as the step runs it: "auto" is bfloat16 on GPUs (their matmul units run
    it at full rate; float32 would be TF32 at best) and float32 elsewhere (a CPU gains nothing from
    bfloat16 matmuls); "float32" and "bfloat16" are taken as given. Parameters and optimizer state
    stay float32 either way."""
    if name == "auto":
        return "bfloat16" if mesh.devices.flat[0].platform == "gpu" else "float32"
    if name not in DTYPES:
        raise ConfigError(f"config.train.compute_dtype={name!r}; use 'auto', 'float32' or 'bfloat16'.")
    return name


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def resolve_kernels(config: mlc.ConfigDict, mesh: jax.sharding.Mesh) -> ops.KernelPolicy:
    """``config.model.kernels`` resolved once for the run, from the platform of the mesh's devices (and,
    on the gpu form, ``config.model.gpu_forms``: which fused forms)."""
    from jaxrat.ops.forms import parse_request

    gpu_forms = field(config.model, "model.gpu_forms")
    try:
        parse_request(gpu_forms)
    except ValueError as e:
        raise ConfigError(f"config.{e}.") from None
    try:
        return ops.resolve(field(config.model, "model.kernels"), ops.policy.platform_of(mesh.devices.flat),
                           process_count=jax.process_count(), gpu_forms=gpu_forms)
    except ValueError as e:
        raise ConfigError(f"config.model.kernels: {e}.") from None


def gpu_forms_line(config: mlc.ConfigDict, kernels: ops.KernelPolicy) -> str:
    """The one line a gpu run logs: the fused forms it uses and those it holds back."""
    from jaxrat.ops.forms import Selection, candidates

    used = kernels.gpu_forms
    return Selection(used, candidates() - used, str(field(config.model, "model.gpu_forms"))).line()


def check_kernels_run_here(config: mlc.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """A run (not a lowering) needs kernels its devices can execute: the gpu form's fused attention is
    a set of CUDA custom calls."""
    platform = ops.policy.platform_of(mesh.devices.flat)
    if field(config.model, "model.kernels") == "gpu" and ops.policy.form_for_platform(platform) != "gpu":
        raise ConfigError(f"config.model.kernels='gpu' builds the GPU program, which cannot run on {platform} "
                          f"devices; use 'auto' here (the GPU program can still be lowered and inspected on this "
                          f"machine: docs/rat.md, 'On GPUs').")


def check_state_settings(config: mlc.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """The settings :func:`make_state_spec` resolves (compute dtype, kernels, ZeRO level), checked
    before the data is prepared: each mistake in one sentence, seconds after the start."""
    check_kernels_run_here(config, mesh)
    resolve_compute_dtype(config.train.compute_dtype, mesh)
    resolve_kernels(config, mesh)
    zero_level(config)


def zero_level(config: mlc.ConfigDict) -> int:
    """``sharding.zero``: 0 (replicated), 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters)."""
    zero = config.sharding.zero
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"config.sharding.zero={zero}; use 0, 1, 2 or 3.")
    return zero


def fresh_rest(abstract_rest: Any, rng: jax.Array) -> Any:
    """Concrete non-parameter model state (dropout RNG streams) derived from ``rng``."""
    leaves, treedef = jax.tree.flatten(abstract_rest)
    # fold_in(rng, i) for every leaf at once: one kernel on a GPU, not one per stream (the same keys)
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(len(leaves), dtype=jnp.uint32))
    out = [jnp.broadcast_to(keys[i], x.shape) if _is_key(x) else jnp.zeros(x.shape, x.dtype)
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def init_state(task: Task, dtype: Any, kernels: ops.KernelPolicy, tx: Any, ema: bool,
               rng_data: jax.Array) -> dict[str, Any]:
    """A fresh train state (jit it with ``out_shardings=state_shardings`` to create it sharded)."""
    key = jax.random.wrap_key_data(rng_data)
    rngs = nnx.Rngs(params=jax.random.fold_in(key, 0), default=jax.random.fold_in(key, 1))
    params = nnx.to_pure_dict(nnx.state(task.build_model(dtype=dtype, rngs=rngs, kernels=kernels), nnx.Param))
    return state_from_params(params, tx, ema, key)


def state_from_params(params: Any, tx: Any, ema: bool, key: jax.Array) -> dict[str, Any]:
    """The train state around the model's fresh ``params``: what :func:`init_state` returns once it has
    built the model. Run under ``jax.eval_shape`` on an abstract model's parameters, it gives the state's
    shapes without building the model a second time."""
    # A parameter made from a Python float is weakly typed; the step's outputs are not, so the
    # step would be traced and compiled a second time at step 2 (seen: DETR's anchor_size).
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), params)
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.key_data(jax.random.fold_in(key, 2)),
    }
    if ema:  # the average starts at the initial weights (timm, Ultralytics)
        state["ema_params"] = jax.tree.map(jnp.copy, params)
    return state


@dataclasses.dataclass
class StateSpec:
    """Everything derived from the config and the mesh that the step functions need: the model's
    graph (train and eval mode), the optimizer, the state's abstract shapes and its shardings."""

    mesh: jax.sharding.Mesh
    task: Task
    dtype: Any
    tx: Optimizer  # init builds the optimizer state; the train step applies it (optimizer_step)
    schedule: Callable[[Any], Any]
    train_graphdef: Any
    eval_graphdef: Any
    abstract_rest: Any
    abstract_state: Any
    state_shardings: dict[str, Any]
    grad_shardings: Any
    batch_sharding: NamedSharding
    kernels: ops.KernelPolicy
    ema: bool  # the state carries "ema_params"
    # The config's settings the steps read, resolved here once: the step builders take no config.
    accum: int  # optimizer.grad_accum_steps: the micro-batches a step's gradient averages
    reduction_shards: int  # train.reduction_shards (0: off)
    concatenate_norm: bool  # the gradients' norm over one vector (:func:`concatenates_norm`)
    state_sharded: bool  # ZeRO or sharding rules lay some of the state out over the devices
    ema_schedule: Callable[[Any], Any] | None  # the moving average's decay at a step, when ``ema``
    init_options: dict[str, Any]  # XLA's options for compiling the initialisation on these devices

    def eval_params(self, state: dict[str, Any]) -> Any:
        """The parameters evaluation, best checkpoints and predictions use: the average when on."""
        return state["ema_params"] if self.ema else state["params"]

    def model(self, params: Any, rng: jax.Array, *, train: bool) -> nnx.Module:
        """The model in train or eval mode with ``params`` (inside jit)."""
        graphdef = self.train_graphdef if train else self.eval_graphdef
        return nnx.merge(graphdef, params, fresh_rest(self.abstract_rest, rng))

    def init_state(self, rng_data: jax.Array) -> dict[str, Any]:
        """A fresh train state (jit it with ``out_shardings=state_shardings`` to create it sharded)."""
        return init_state(self.task, self.dtype, self.kernels, self.tx, self.ema, rng_data)

    def initialiser(self) -> Any:
        """``init(rng_data) -> state``: :meth:`init_state` jitted to create the state sharded, compiled
        as the platform compiles it fastest (:mod:`jaxrat.runtime.compile_options`)."""
        return jax.jit(self.init_state, out_shardings=self.state_shardings, compiler_options=self.init_options)

    def abstract_with_shardings(self) -> Any:
        """The state's shapes carrying the current mesh's shardings (restore target)."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self.abstract_state, self.state_shardings)


def concatenates_norm(config: mlc.ConfigDict) -> bool:
    """Whether the step takes the gradients' global norm over one concatenated vector: below ZeRO-2 and
    with no sharding rules, where gradients are replicated (:func:`jaxrat.trainer.optimizer.global_norm`)."""
    return config.sharding.zero < 2 and not config.sharding.get("rules")


def make_state_spec(config: mlc.ConfigDict, mesh: jax.sharding.Mesh, task: Task,
                    kernels: ops.KernelPolicy | None = None) -> StateSpec:
    """Split the task's model abstractly and decide every sharding; nothing is allocated. ``kernels``: a
    policy to build with instead of resolving ``config.model.kernels`` (benchmarks that vary its switches)."""
    compute_dtype = resolve_compute_dtype(config.train.compute_dtype, mesh)
    logging.info("compute dtype %s (train.compute_dtype=%s)", compute_dtype, config.train.compute_dtype)
    dtype = DTYPES[compute_dtype]
    kernels = resolve_kernels(config, mesh) if kernels is None else kernels
    logging.info("kernels: %s form (model.kernels=%s), attention block %d", kernels.form,
                 field(config.model, "model.kernels"), kernels.block_elements)
    if kernels.gpu:
        logging.info("%s", gpu_forms_line(config, kernels))
    zero = zero_level(config)
    # Decided by the config, not the mesh, so that a run's numbers do not depend on its device count.
    concatenate_norm = concatenates_norm(config)
    tx, schedule = make_optimizer(config.optimizer, config.num_train_steps, concatenate_norm=concatenate_norm)
    model = nnx.eval_shape(lambda: task.build_model(dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels))
    model.train()
    train_graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    model.eval()
    eval_graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    abstract_rest = nnx.to_pure_dict(rest)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_rest)[0]:
        if not _is_key(leaf) and "count" not in jax.tree_util.keystr(path):
            raise ConfigError(
                f"Model state {jax.tree_util.keystr(path)} is neither a parameter nor an RNG stream; "
                f"jaxrat models must not keep mutable statistics (use GroupNorm/LayerNorm)."
            )
    ema = ema_enabled(config.optimizer)
    ema_decay = ema_schedule(config.optimizer) if ema else None
    # The parameters' shapes do not depend on the key they are drawn with: the abstract model's serve.
    abstract_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    abstract_state = jax.eval_shape(lambda p, key: state_from_params(p, tx, ema, key), abstract_params,
                                    jax.random.key(0))
    # chosen once, here: its state is the chain's whichever form applies it, so the shapes above hold
    tx = optimizer_for(config, kernels, tx, schedule, abstract_state)

    sc = config.sharding
    axis = sharding.zero_axis(mesh, sc.axis, zero)

    def shard(tree: Any, on: bool) -> Any:
        return sharding.tree_shardings(tree, mesh, shard=on, axis=axis, min_size=sc.min_size, rules=sc.rules)

    rep = NamedSharding(mesh, P())
    params, opt_state = abstract_state["params"], abstract_state["opt_state"]
    state_shardings = {"step": rep, "rng": rep, "params": shard(params, zero >= 3),
                       "opt_state": shard(opt_state, zero >= 1)}
    if ema:  # read by evaluation as the parameters are, so laid out as they are
        state_shardings["ema_params"] = state_shardings["params"]
    spec = StateSpec(mesh=mesh, task=task, dtype=dtype, tx=tx, schedule=schedule,
                     train_graphdef=train_graphdef, eval_graphdef=eval_graphdef, abstract_rest=abstract_rest,
                     abstract_state=abstract_state, state_shardings=state_shardings,
                     grad_shardings=shard(params, zero >= 2),
                     batch_sharding=NamedSharding(mesh, sharding.batch_spec(mesh)), kernels=kernels, ema=ema,
                     accum=int(config.optimizer.grad_accum_steps), reduction_shards=int(config.train.reduction_shards),
                     concatenate_norm=concatenate_norm, state_sharded=bool(zero != 0 or sc.get("rules")),
                     ema_schedule=ema_decay,
                     init_options=init_compiler_options(mesh.devices.flat[0].platform))
    sharding.log_shardings(params, spec.state_shardings["params"], "params")
    sharding.log_shardings(opt_state, spec.state_shardings["opt_state"], "opt_state")
    return spec


@dataclasses.dataclass
class Restored:
    """Where a run starts: its state, its data iterator, and whether the checkpointed step's
    evaluation still has to run (the run was preempted inside it)."""

    state: dict[str, Any]
    data: Iterator
    eval_pending: bool
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # what was saved with the checkpoint

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state["step"]))


def initial_weights(config: mlc.ConfigDict, spec: StateSpec) -> dict[str, Any]:
    """What a new run's state starts from besides its fresh initialisation: a timm / Hugging Face
    file's weights for the backbone with ``model.pretrained``, another run's or a weights file's
    parameters (and optimizer state) for ``init_from`` (which wins: it holds a backbone too), else
    nothing. Read before anything compiles, so a mismatch fails first; the parameters it holds land on
    ``spec``'s shardings."""
    abstract = spec.abstract_with_shardings()
    include, exclude = field(config, "init_from_include"), field(config, "init_from_exclude")
    pretrained = "" if config.init_from else str(config.model.get("pretrained") or "")
    if pretrained:
        arrays = pretrained_arrays(pretrained, abstract["params"])
        return {"params": place_arrays(arrays, abstract["params"], include=include, exclude=exclude, where=pretrained)}
    if not config.init_from:
        return {}
    return load_init(config.init_from, abstract, optimizer=config.checkpoint.init_optimizer, include=include,
                     exclude=exclude, strict=field(config, "init_from_strict"),
                     rename=field(config, "init_from_rename"))


def restore_or_init(config: mlc.ConfigDict, spec: StateSpec, ckpt: Checkpointer,
                    train_iter: Callable[[int], Iterator]) -> Restored:
    """Resume from the newest readable checkpoint in ``ckpt``, or start fresh (from ``init_from``
    weights when ``config`` names some). ``train_iter(start_example)`` makes the data iterator."""
    data = train_iter(0)
    restored = ckpt.restore_latest(spec.abstract_with_shardings(), Restorable(data))
    if restored is not None:
        step, state, data_ok = restored
        if not data_ok:  # saved by another process count: the position follows from the step
            if hasattr(data, "close"):
                data.close()
            data = train_iter(step * config.data.batch_size)
        logging.info("resumed from step %d (%s)", step, "iterator state" if data_ok else "position from step")
        if config.init_from:
            logging.info("init_from=%s ignored: this workdir already has checkpoints", config.init_from)
        meta = ckpt.step_metadata(step)
        return Restored(state, data, bool(meta.get("eval_pending")), meta)
    init = spec.initialiser()  # traced and compiled at its call below, after the weights have been read
    loaded = initial_weights(config, spec)
    state = init(jax.random.key_data(jax.random.key(config.seed)))
    if "params" in loaded:  # the parameters that did not load keep their fresh values
        loaded["params"] = merge_params(state["params"], loaded["params"])
    state = {**state, **loaded}
    if spec.ema and "params" in loaded:  # average the loaded weights, not the discarded random ones
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=spec.state_shardings["params"])
        state["ema_params"] = copy(loaded["params"])
    return Restored(state, data, False)

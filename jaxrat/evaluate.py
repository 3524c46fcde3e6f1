"""Evaluate a trained run: ``python -m jaxrat.evaluate --workdir DIR [--step N|best|latest] [--name NAME]``.

The run's own config (``DIR/config.json``) is loaded and may be overridden like training's
(``--config.data.image_size=384``: evaluate at another resolution). The same command runs under
``srun``/``mpirun``/``torchrun`` on many hosts. Metrics go to ``DIR/eval/NAME/metrics.json`` (and
``metrics.jsonl`` + TensorBoard there); checkpoints are only read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import ml_collections as mlc
from absl import app, flags

from jaxrat.cli import fail, quiet_libraries
from jaxrat.config import flatten
from jaxrat.errors import ConfigError, UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (holds config.json and checkpoints/).")
_STEP = flags.DEFINE_string("step", "latest", "Checkpoint to evaluate: a step number, 'best' or 'latest'.")
_NAME = flags.DEFINE_string("name", "", "Subfolder of WORKDIR/eval for the results (default: step and overrides).")
flags.mark_flags_as_required(["workdir"])


def load_run_config(workdir: str, overrides: list[str]) -> mlc.ConfigDict:
    """The run's resolved config with ``--config.a.b=value`` overrides applied (types kept)."""
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} not found; pass the --workdir of a training run.") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}); it was not written by jaxrat, or was damaged.") from None
    config = mlc.ConfigDict(_tuples(raw))
    flat = flatten(config)
    for item in overrides:
        key, eq, value = item.removeprefix("--config.").partition("=")
        if not eq:
            raise ConfigError(f"{item}: write overrides as --config.KEY=VALUE.")
        if key not in flat:
            raise ConfigError(f"Unknown config key --config.{key} for this run; see {path} for its keys.")
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = _parse(value, flat[key], key)
    return config


def _tuples(x: Any) -> Any:
    """JSON lists back to the tuples the config files use (mesh axes, heads, scales)."""
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def _parse(value: str, current: Any, key: str) -> Any:
    import ast

    if isinstance(current, str):
        return value
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--config.{key}={value} is not a Python literal like {current!r}; fix the value.") from None
    if isinstance(current, bool) or isinstance(parsed, bool):
        return bool(parsed)
    if isinstance(current, float) and isinstance(parsed, int):
        return float(parsed)
    return parsed


def evaluate(config: mlc.ConfigDict, workdir: str, step_spec: str = "latest", name: str = "") -> dict[str, float]:
    """Evaluate checkpoint ``step_spec`` of ``workdir`` under ``config``; returns ``{"eval/...": value}``."""
    import jax

    from jaxrat.checkpointing import load_init
    from jaxrat.checkpointing.store import resolve
    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.tasks.base import load_task
    from jaxrat.tracking.writers import MetricWriter
    from jaxrat.trainer.hooks import Evaluation
    from jaxrat.trainer.loop import check_batch_sizes, to_global
    from jaxrat.trainer.state import make_state_spec
    from jaxrat.trainer.step import make_eval_step

    directory, step = resolve(f"{workdir}:{step_spec}")
    mesh = make_mesh(config.mesh.axes)
    check_batch_sizes(config, mesh.size, jax.process_count())
    task = load_task(config)
    out_dir = os.path.join(workdir, "eval", name or f"step_{step}")
    os.makedirs(out_dir, exist_ok=True)
    logging.info("data: %s", task.prepare_data(out_dir))
    spec = make_state_spec(config, mesh, task)
    params = load_init(f"{directory}:{step}", spec.abstract_with_shardings())["params"]
    writer = MetricWriter(out_dir, is_main=jax.process_index() == 0)
    try:
        evaluation = Evaluation(config, task, make_eval_step(spec), lambda b: to_global(b, spec.batch_sharding),
                                writer)
        metrics = evaluation.run(step, params, interrupt=lambda: False)
    finally:
        writer.close()
    if jax.process_index() == 0:
        result = {"workdir": workdir, "step": step, "metrics": metrics,
                  "config": json.loads(config.to_json_best_effort())}
        with open(os.path.join(out_dir, "metrics.json.tmp"), "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
        os.replace(os.path.join(out_dir, "metrics.json.tmp"), os.path.join(out_dir, "metrics.json"))
        logging.info("wrote %s", os.path.join(out_dir, "metrics.json"))
    return metrics


def main(argv: list[str], overrides: list[str]) -> None:
    """Initialise the runtime from the run's config, then evaluate."""
    from jaxrat import cluster, compile_cache

    quiet_libraries()
    try:
        if argv[1:]:
            raise UserError(f"Unexpected arguments {argv[1:]}; pass --workdir, --step, --name and --config.KEY=VALUE.")
        workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
        config = load_run_config(workdir, overrides)
        cluster.initialize(config.distributed)
        compile_cache.enable(config.train.get("compilation_cache_dir", ""))
        evaluate(config, workdir, _STEP.value, _NAME.value)
    except UserError as e:
        fail(str(e))


def run() -> None:
    """Console entry point (also ``python -m jaxrat.evaluate``)."""
    # --config.* overrides are not absl flags: they go to main() beside absl's parse of the rest.
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    app.run(lambda argv: main(argv, overrides), argv=[a for a in sys.argv if not a.startswith("--config.")])


if __name__ == "__main__":
    run()

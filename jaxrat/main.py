"""Entry point: ``python -m jaxrat.main --config configs/isic.py[:variant] --workdir DIR``.

The same command runs on a laptop and under ``srun``/``mpirun``/``torchrun`` on many nodes.
Config fields can be overridden with ``--config.a.b=value``.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrat.cluster import preemption
from jaxrat.config import check_override_args
from jaxrat.runtime import hugepages, platform_hint
from jaxrat.runtime.console import fail, quiet_libraries
from jaxrat.runtime.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, optionally with :variant.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and the resolved config go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    """Initialise the distributed runtime, then train and evaluate."""
    preemption.install_handlers()  # a SIGTERM during start-up asks for a stop, it does not kill the run
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxrat import cluster
    from jaxrat.parallel.cpu_client import pin_cpu_parallelism
    from jaxrat.runtime import compile_cache  # before anything that touches JAX devices

    quiet_libraries()
    config = _CONFIG.value
    if platform_hint.expects_cpu():  # before JAX's CPU client exists; a GPU run leaves it alone
        pin_cpu_parallelism(int(config.train.get("reduction_shards", 0) or 0))
    try:
        preemption.note_process_count(cluster.initialize(config.distributed).process_count)
        compile_cache.enable(config.train.compilation_cache_dir)
        from jaxrat.trainer.loop import train_and_evaluate

        try:
            train_and_evaluate(config, _WORKDIR.value)
        except cluster.Preempted as e:
            logging.warning("%s", e)
            sys.exit(cluster.PREEMPTED_EXIT_CODE)
        except UserError:
            raise
        except Exception:
            cluster.stop_if_peer_lost()  # a collective that failed because a peer died says so, in one sentence
            raise
    except UserError as e:
        fail(str(e))


def run() -> None:
    """Console entry point (also ``python -m jaxrat.main``)."""
    hugepages.reexec_if_wanted()  # first: glibc reads it only at process start (jaxrat/runtime/hugepages.py)
    preemption.install_handlers()
    try:
        check_override_args(sys.argv[1:])
    except UserError as e:
        fail(str(e))
    app.run(main)


if __name__ == "__main__":
    run()

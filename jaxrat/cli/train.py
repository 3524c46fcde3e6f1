"""Train: ``python -m jaxrat.main --config CONFIG[:variant] --workdir DIR`` (also ``jaxrat train``).

CONFIG is a config file, a packaged config's name (``isic:demo``; ``--list-configs`` lists them) or
a run's ``config.json``. The same command runs on a laptop and under ``srun``/``mpirun``/``torchrun``
on many nodes. Config fields can be overridden with ``--config.a.b=value``.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrat.cli import command_line
from jaxrat.cli.entry import no_positional, user_errors
from jaxrat.cluster import preemption
from jaxrat.config_schema import check_override_args, field, load_config
from jaxrat.config_schema.loader import ALLOW_IMPORT_HELP
from jaxrat.config_schema.packaged import describe_packaged
from jaxrat.runtime import device_errors, hugepages, platform_hint
from jaxrat.runtime.console import quiet_libraries
from jaxrat.runtime.errors import ConfigError, UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and the resolved config go (required).")
_ALLOW_IMPORT = flags.DEFINE_multi_string("allow_import", [], ALLOW_IMPORT_HELP)
_CONFIG_HELP = (("--config CONFIG[:VARIANT]", "a config file, a packaged config's name (e.g. isic:demo) or a run's "
                 "config.json (required)"),
                ("--list-configs", "list the packaged configs and their variants, then exit"))


def main(argv: list[str]) -> None:
    """Initialise the distributed runtime, then train and evaluate."""
    preemption.install_handlers()  # a SIGTERM during start-up asks for a stop, it does not kill the run
    from jaxrat import cluster
    from jaxrat.parallel.cpu_client import pin_cpu_parallelism
    from jaxrat.runtime import compile_cache  # before anything that touches JAX devices

    quiet_libraries()
    with user_errors():
        no_positional(argv, "--config, --workdir and --config.KEY=VALUE (--help lists them)")
        if not _WORKDIR.value:
            raise UserError("Pass --workdir DIR: the folder for the run's checkpoints, logs and config.")
        config = flags.FLAGS["config"].value
        if platform_hint.expects_cpu():  # before JAX's CPU client exists; a GPU run leaves it alone
            pin_cpu_parallelism(int(field(config.train, "train.reduction_shards") or 0))
        preemption.note_process_count(cluster.initialize(config.distributed).process_count)
        compile_cache.enable(config.train.compilation_cache_dir)
        from jaxrat.trainer.loop import train_and_evaluate

        try:
            train_and_evaluate(config, _WORKDIR.value)
        except cluster.Interrupted as e:  # Ctrl-C: one line, the shell's status for an interrupted command
            sys.stderr.write(f"jaxrat: {e}\n")
            sys.exit(cluster.INTERRUPTED_EXIT_CODE)
        except cluster.Preempted as e:
            logging.warning("%s", e)
            sys.exit(cluster.PREEMPTED_EXIT_CODE)
        except UserError:
            raise
        except Exception as e:
            cluster.stop_if_peer_lost()  # a collective that failed because a peer died says so, in one sentence
            why = device_errors.explain(e, device_errors.training_batch_advice(config))
            if why is not None:
                raise why from None
            raise


def _take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` spec, ``argv`` without it): ml_collections' flag reads only files, so jaxrat
    loads the config itself (names, paths, config.json) and hands absl the loaded dict."""
    rest, spec, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg == "--config":
            spec = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        else:
            rest.append(arg)
        i += 1
    return spec, rest


def _allowed_imports(argv: list[str]) -> list[str]:
    """The ``--allow_import`` values in ``argv``: a config.json --config is loaded before absl parses flags."""
    found = []
    for i, arg in enumerate(argv):
        if arg.startswith("--allow_import="):
            found.append(arg.split("=", 1)[1])
        elif arg == "--allow_import" and i + 1 < len(argv):
            found.append(argv[i + 1])
    return found


def run() -> None:
    """Console entry point (also ``python -m jaxrat.main`` and ``jaxrat train``)."""
    hugepages.reexec_if_wanted()  # first: glibc reads it only at process start (jaxrat/runtime/hugepages.py)
    preemption.install_handlers(start_up_exit=True)  # and a second Ctrl-C before the first step ends it cleanly
    argv = [sys.argv[0], *command_line.absl_style(sys.argv[1:])]
    if command_line.wants_help(argv[1:]):
        command_line.print_help_and_exit(command_line.absl_help(
            __doc__, __name__, "python -m jaxrat.main", extra=_CONFIG_HELP))
    if "--list_configs" in argv[1:]:  # respelled from --list-configs
        sys.stdout.write(describe_packaged())
        sys.exit(0)
    spec, argv = _take_config(argv)
    with user_errors():
        mistake = command_line.flag_mistake(argv[1:], __name__)
        if mistake:
            raise UserError(mistake)
        if not spec:
            raise ConfigError("Pass --config with a config file or a packaged config's name, e.g. --config isic:demo "
                              "(--list-configs lists them).")
        config = load_config(spec, _allowed_imports(argv))
        check_override_args(argv[1:], config=config, spec=spec)
    config_flags.DEFINE_config_dict("config", config, lock_config=True, sys_argv=argv)
    app.run(main, argv=argv)


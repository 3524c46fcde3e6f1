"""What the commands share between reading their command line and doing their work: the flags of a
command that opens a trained run, the ``--config.KEY=VALUE`` split of the absl commands, the argparse
commands' parser, and the one-sentence exit for a user's mistake."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from absl import app, flags

from jaxrat.cli import command_line
from jaxrat.config_schema.loader import ALLOW_IMPORT_HELP
from jaxrat.runtime.console import fail
from jaxrat.runtime.errors import UserError


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A :class:`UserError` raised inside ends the command with its sentence and status 2."""
    try:
        yield
    except UserError as e:
        fail(str(e))


def no_positional(argv: list[str], options: str) -> None:
    """Refuse words absl left over (``argv[0]`` is the program), naming the options to pass instead."""
    if argv[1:]:
        raise UserError(f"Unexpected arguments {argv[1:]}; pass {options}.")


class TrainedRunFlags:
    """``--workdir`` (required) and ``--allow_import`` of a command that reads a trained run, filed
    under the command's module so its ``--help`` lists them with its own flags."""

    def __init__(self, module: str) -> None:
        self._workdir = flags.DEFINE_string("workdir", None, "A training workdir (holds config.json and checkpoints/).",
                                            module_name=module)
        self._allow_import = flags.DEFINE_multi_string("allow_import", [], ALLOW_IMPORT_HELP, module_name=module)
        flags.mark_flag_as_required("workdir")

    def open(self, overrides: list[str]) -> tuple[str, Any]:
        """(the workdir, its config with ``overrides`` applied), or a :class:`UserError` saying why not."""
        from jaxrat.trainer.evaluation import open_trained_run

        return open_trained_run(self._workdir.value, overrides, self._allow_import.value)


def help_or_respell(module: str, default_prog: str, config_overrides: bool = True) -> list[str]:
    """``sys.argv`` in absl's flag style; with ``--help``, print the command's help as text and exit 0.

    ``module`` is the ``__name__`` of the module that defines the command's flags."""
    defining = sys.argv[0] if module == "__main__" else module  # where absl filed the flags
    if command_line.wants_help(sys.argv[1:]):
        text = command_line.absl_help(sys.modules[module].__doc__ or "", defining, default_prog, config_overrides)
        command_line.print_help_and_exit(text)
    argv = [sys.argv[0], *command_line.absl_style(sys.argv[1:])]
    mistake = command_line.flag_mistake(argv[1:], defining)
    if mistake:
        fail(mistake)
    return argv


def run_with_config_overrides(main: Callable[[list[str], list[str]], None], default_prog: str) -> None:
    """``absl.app.run(main)`` for a command that also takes ``--config.KEY=VALUE`` overrides: they are
    not absl flags, so they are set apart and handed to ``main(argv, overrides)``."""
    argv = help_or_respell(main.__module__, default_prog)
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    app.run(lambda argv: main(argv, overrides), argv=[a for a in argv if not a.startswith("--config.")])


def parser(doc: str, default_prog: str, **kwargs: Any) -> argparse.ArgumentParser:
    """An argparse command's parser: named as the command was started, described by the first
    paragraph of its module's docstring."""
    return argparse.ArgumentParser(prog=command_line.prog(default_prog), description=command_line.plain(
        doc.split("\n\n")[0]), **kwargs)


def arguments(argv: list[str] | None) -> list[str]:
    """An argparse command's arguments (``sys.argv`` when None) in argparse's flag style."""
    return command_line.argparse_style(sys.argv[1:] if argv is None else argv)


def print_or_submit(spec: Any, scheduler: str, dry_run: bool, root: str, stem: str) -> int:
    """The job script of ``spec``: printed with ``--dry-run``, else written beside the runs in ``root``
    (``stem``.sbatch or .bsub) and submitted without waiting; the exit status."""
    from jaxrat.cluster.jobscript import render, submit

    script = render(spec, scheduler)
    if dry_run:
        sys.stdout.write(script)
        return 0
    path = Path(root) / f"{stem}.{'sbatch' if scheduler == 'slurm' else 'bsub'}"
    return submit(script, spec, scheduler, wait=False, timeout=60, path=path)

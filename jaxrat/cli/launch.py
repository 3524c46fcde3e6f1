"""Render (and optionally submit) a SLURM sbatch or LSF bsub script for a jaxrat run.

    python -m jaxrat.launch --config configs/isic.py --nodes 2 --gpus-per-node 8 \\
        --partition gpu --time 24:00:00 [--submit [--wait]] [-- --config.data.batch_size=64]

Without ``--submit`` the script is printed (a dry run). Every job runs the same
``python -m jaxrat.main`` under ``srun``/``blaunch``; :mod:`jaxrat.cluster` reads the
scheduler's environment in each process, so the script exports nothing about ranks or ports.
One process per GPU is the default (``--tasks-per-node`` or ``--one-process-per-node`` change
it). Scripts request a warning signal before the time limit, checkpoint, and requeue themselves.

Exit statuses the scripts act on: 0 done; 2 an error of the run itself (no requeue: a rerun would
fail alike); 42 preempted or a process lost (requeue); anything else, e.g. a task killed by a
signal (requeue at most ``--max-restarts`` times per job). The rendering itself lives in
:mod:`jaxrat.cluster.jobscript`, which ``python -m jaxrat.sweep`` also uses for job arrays.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys

from jaxrat.cli.entry import arguments, parser
from jaxrat.cluster.jobscript import (  # noqa: F401  (re-exported: the renderer's public names)
    SCHEDULERS,
    JobSpec,
    add_job_arguments,
    detect_scheduler,
    job_fields,
    render,
    submit,
    validate,
)
from jaxrat.config_schema.loader import portable_spec
from jaxrat.runtime.errors import UserError


def parse_args(argv: list[str]) -> tuple[JobSpec, argparse.Namespace]:
    """Build a :class:`JobSpec` from command-line arguments (everything after ``--`` goes to main)."""
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = parser(
        __doc__, "python -m jaxrat.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config overrides for the run go after --, e.g.\n"
               "  jaxrat launch --config isic --nodes 2 --gpus-per-node 8 --time 24:00:00 -- "
               "--config.data.batch_size=64\n"
               "Without --submit the script is printed; sbatch it from a folder that exists (its log goes there).")
    p.add_argument("--config", required=True, help="config file[:variant], as for jaxrat.main")
    p.add_argument("--workdir", help="run directory on shared storage (default runs/<config>[-variant])")
    add_job_arguments(p)
    p.add_argument("--scheduler", default="auto", help="slurm, lsf or auto (the one whose submit command exists)")
    p.add_argument("--submit", action="store_true", help="submit instead of printing")
    p.add_argument("--wait", action="store_true", help="with --submit: block until the job ends")
    p.add_argument("--wait-timeout", type=float, default=24 * 3600, help="seconds --wait may block")
    a = p.parse_args(argv)
    command = " ".join(shlex.quote(x) for x in ["python", "-m", "jaxrat.launch", *argv]
                       + (["--", *extra] if extra else []))
    command = re.sub(r" --(submit|wait)\b", "", command)
    try:
        config = portable_spec(a.config)
    except UserError:
        config = a.config  # main says why, with the other mistakes
    spec = JobSpec(config=config, workdir=a.workdir, extra_args=tuple(extra), command=command, **job_fields(p, a))
    return spec, a


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    spec, a = parse_args(arguments(argv))
    try:
        spec = dataclasses.replace(spec, config=portable_spec(spec.config))
        scheduler = a.scheduler
        if scheduler == "auto":
            scheduler = detect_scheduler() or ("slurm" if not a.submit else "")
            if not scheduler:
                raise UserError("neither sbatch nor bsub is on PATH; submit from a login node, or drop --submit "
                                "and pass --scheduler slurm|lsf to print the script.")
        script = render(spec, scheduler)
        if not a.submit:
            if a.wait:
                raise UserError("--wait needs --submit; add --submit to submit and wait for the job.")
            sys.stdout.write(script)
            return 0
        return submit(script, spec, scheduler, wait=a.wait, timeout=a.wait_timeout)
    except UserError as err:
        print(f"jaxrat.launch: error: {err}", file=sys.stderr)
        return 2


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(main())

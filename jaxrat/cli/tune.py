"""Entry point: a hyperparameter search with Optuna, here or as a job array of workers.

    python -m jaxrat.tune --config FILE[:arg] --root DIR --trials N [--metric eval/x --mode max|min]
        [--slurm | --lsf [--workers K] [job options of jaxrat.launch]] [--dry-run] [--config.x=y ...]
    python -m jaxrat.tune --summarize --root DIR

The search space is the config file's ``get_search_space()``; every trial trains
``python -m jaxrat.main`` in DIR/trials/trial_<n> with the trial's overrides, then the
``--config.x=y`` given here. The study is DIR/optuna_journal.log; rerunning the command (after a
kill, a cancelled job) continues it up to N trials. ``--slurm``/``--lsf`` submit a job array of
K workers sharing the study. At the end DIR/tune_summary.md, .json and DIR/best_sweep.py are
written. See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from jaxrat.cli.entry import arguments, parser, print_or_submit, user_errors
from jaxrat.cluster.jobscript import JobSpec, add_job_arguments, job_fields
from jaxrat.config_schema.loader import portable_spec
from jaxrat.runtime.errors import UserError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], argparse.ArgumentParser]:
    p = parser(__doc__, "python -m jaxrat.tune", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file[:arg] that defines get_search_space()")
    p.add_argument("--root", help="folder of the search: the study journal, one workdir per trial, the summary")
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # a job-array element: DIR/worker-<i> (the template's flag)
    p.add_argument("--trials", type=int, default=0, help="trials in the study in all (replaced ones aside)")
    p.add_argument("--metric", default="", help="objective (default: config.checkpoint.best_metric)")
    p.add_argument("--mode", default="", help="max or min (default: config.checkpoint.best_mode)")
    p.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--slurm", action="store_true", help="submit a SLURM job array of workers")
    where.add_argument("--lsf", action="store_true", help="submit an LSF job array of workers")
    where.add_argument("--summarize", action="store_true", help="only write DIR/tune_summary.{md,json}")
    p.add_argument("--workers", type=int, default=2, help="job-array elements (workers running trials at once)")
    p.add_argument("--dry-run", action="store_true", help="print the job script and stop")
    add_job_arguments(p)
    a, rest = p.parse_known_args(argv)
    bad = [x for x in rest if not x.startswith("--config.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides for every trial are --config.key=value)")
    if a.workdir and not a.root:
        a.root = str(Path(a.workdir).parent)
    if not a.root:
        p.error("--root is required")
    if not a.summarize and (not a.config or a.trials < 1):
        p.error("--config and --trials N (N >= 1) are required, unless --summarize")
    return a, rest, p


def require_optuna() -> None:
    """Stop in one sentence, before anything is written, where Optuna (the ``tune`` extra) is missing."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UserError("jaxrat tune needs Optuna, which is not installed here; install the tune extra: "
                        "pip install 'jaxrat[tune]' (in a clone: pip install -e '.[tune]').") from None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = arguments(argv)
    a, common, p = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors():
        require_optuna()
        from jaxrat.experiments import tune, tune_summary

        if a.summarize:
            s = tune_summary.write(a.root)
            sys.stdout.write(tune_summary.markdown(s))
            return 0
        config = portable_spec(a.config)
        tune.load_search_space(config, common)  # mistakes end here, before anything is submitted
        metric, direction = tune.objective(config, common, a.metric, a.mode)
        if not a.workdir:
            os.makedirs(a.root, exist_ok=True)
            with open(os.path.join(a.root, tune_summary.SETTINGS), "w") as f:
                json.dump({"config": config, "metric": metric, "common": common}, f, indent=2)
        if a.slurm or a.lsf:
            return _submit(a, p, argv, common)
        status = tune.run_worker(config, a.root, a.trials, common, metric=a.metric, mode=a.mode, seed=a.seed,
                                 python=a.python or sys.executable, worker_index=_worker_index(a.workdir))
        s = tune_summary.write(a.root)
        sys.stdout.write(tune_summary.markdown(s))
        return status
    return 2  # not reached: a user's mistake exits in user_errors


def _worker_index(workdir: str | None) -> int:
    """A job-array element's index, from the ``--workdir DIR/worker-<i>`` the template passes; 0 here."""
    name = os.path.basename(os.path.normpath(workdir or ""))
    return int(name[len("worker-"):]) if name.startswith("worker-") and name[len("worker-"):].isdigit() else 0


def _submit(a: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str], common: list[str]) -> int:
    """A job array of ``--workers`` elements, each ``python -m jaxrat.tune`` on the shared study."""
    if a.workers < 1:
        raise UserError(f"--workers {a.workers}: submit at least one worker.")
    scheduler = "slurm" if a.slurm else "lsf"
    worker_args = (f"--trials={a.trials}", f"--seed={a.seed}", *((f"--metric={a.metric}",) if a.metric else ()),
                   *((f"--mode={a.mode}",) if a.mode else ()))
    command = " ".join(shlex.quote(x) for x in ["python", "-m", "jaxrat.tune", *(x for x in argv if x != "--dry-run")])
    fields = job_fields(p, a)
    fields["module"] = "jaxrat.tune"
    spec = JobSpec(config=portable_spec(a.config), workdir=os.path.abspath(a.root), extra_args=tuple(common),
                   command=command, array=tuple((f"worker-{i}", worker_args) for i in range(a.workers)), **fields)
    return print_or_submit(spec, scheduler, a.dry_run, a.root, "tune")


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(main())

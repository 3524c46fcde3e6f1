"""Entry point: run an ablation sweep, one variant after another or as one job array.

    python -m jaxrat.sweep --config configs/ablations.py[:arg] --root DIR [--only a,b] [--folds K] [--seeds S]
        [--local | --slurm | --lsf] [--dry-run] [job options of jaxrat.launch] [--config.x=y ...]
    python -m jaxrat.sweep --summarize --root DIR          (= python -m jaxrat.summarize DIR)

Variants come from the config file's ``get_sweep()``; variant NAME trains in DIR/NAME with its
overrides, then any ``--config.x=y`` given here (those apply to every variant and win). Finished
variants (final checkpoint written) are skipped, unfinished ones resume from their checkpoints.
``--folds K --seeds S`` repeat every variant K x S times (run NAME-f<fold>-s<seed>), each fold of the
training split held out once as validation (assignment files in DIR/folds).
``--local`` (the default) trains them here one after another and writes the summary at the end;
``--slurm``/``--lsf`` write DIR/sweep.sbatch (.bsub) for a job array of the unfinished variants and
submit it (``--dry-run`` prints it instead). See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from jaxrat.cli.entry import arguments, parser, print_or_submit, user_errors
from jaxrat.cluster.jobscript import JobSpec, add_job_arguments, job_fields
from jaxrat.config_schema.loader import portable_spec
from jaxrat.experiments import sweep
from jaxrat.experiments.summary import report
from jaxrat.runtime.errors import UserError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], argparse.ArgumentParser]:
    """(options, the --config.x=y overrides for every variant, the parser)."""
    if "--" in argv:  # as in jaxrat.launch: what follows -- goes to every run
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1:]
    else:
        tail = []
    p = parser(__doc__, "python -m jaxrat.sweep", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file[:arg] that defines get_sweep()")
    p.add_argument("--root", required=True, help="folder of the sweep: one workdir per variant, the summary")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="train here, one variant after another (default)")
    where.add_argument("--slurm", action="store_true", help="submit a SLURM job array")
    where.add_argument("--lsf", action="store_true", help="submit an LSF job array")
    where.add_argument("--summarize", action="store_true", help="only write DIR/summary.{md,csv,png}")
    p.add_argument("--dry-run", action="store_true", help="print what would run (the job script) and stop")
    p.add_argument("--folds", type=int, default=0,
                   help="K: repeat each variant over K cross-validation folds of the training split")
    p.add_argument("--seeds", type=int, default=1, help="repeat each variant (and fold) over this many seeds")
    p.add_argument("--max-parallel", type=int, default=0, help="array elements running at once (0: no limit)")
    add_job_arguments(p)
    a, rest = p.parse_known_args(argv)
    bad = [x for x in rest if not x.startswith("--config.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides for every variant are --config.key=value)")
    if not a.summarize and not a.config:
        p.error("--config is required (a config file with get_sweep()), unless --summarize")
    return a, [*rest, *tail], p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = arguments(argv)
    a, common, p = parse_args(argv)
    with user_errors():
        if a.summarize:
            sys.stdout.write(report(a.root))
            return 0
        variants = sweep.load_sweep(a.config, common)
        chosen = sweep.select(variants, [n for n in a.only.split(",") if n])
        if a.folds or a.seeds != 1:
            first = sweep.base_seed(a.config, common)
            variants, chosen = (sweep.replicate(v, a.root, folds=a.folds, seeds=a.seeds, first_seed=first)
                                for v in (variants, chosen))
        if a.max_parallel < 0:
            raise UserError(f"--max-parallel {a.max_parallel} must be 0 (no limit) or more.")
        if not a.dry_run:
            sweep.write_manifest(a.root, a.config, variants, common)
        if not (a.slurm or a.lsf):
            status = sweep.run_local(a.config, a.root, chosen, common, dry_run=a.dry_run,
                                     python=a.python or sys.executable)
            if not a.dry_run and any(Path(a.root, v.name, "metrics.jsonl").is_file() for v in variants):
                sys.stdout.write(report(a.root))
            return status
        return _submit(a, p, argv, variants, chosen, common)
    return 2  # not reached: a user's mistake exits in user_errors


def _portable(overrides: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A variant's overrides with its own ``--config=FILE[:ARG]`` as any folder loads it (a packaged
    config by name, another file by absolute path), as the sweep's own config is in the job script."""
    return tuple(f"--config={portable_spec(o.partition('=')[2])}" if o.startswith("--config=") else o
                 for o in overrides)


def _submit(a: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str], variants: list[sweep.Variant],
            chosen: list[sweep.Variant], common: list[str]) -> int:
    """Render the job array of the unfinished chosen variants; print it (--dry-run) or submit it."""
    scheduler = "slurm" if a.slurm else "lsf"
    todo = []
    for v in chosen:
        state = sweep.run_state(str(Path(a.root) / v.name), sweep.target_steps(a.config, [*v.overrides, *common]))
        print(f"sweep: {v.name}: {state.describe()}" + ("" if state.finished else ", submitting"), file=sys.stderr)
        if not state.finished:
            todo.append(variants.index(v))
    if not todo:
        print(f"sweep: all {len(chosen)} variants are finished; summary: python -m jaxrat.summarize {a.root}",
              file=sys.stderr)
        return 0
    command = " ".join(shlex.quote(x) for x in ["python", "-m", "jaxrat.sweep", *(x for x in argv if x != "--dry-run")])
    spec = JobSpec(config=portable_spec(a.config), workdir=a.root, extra_args=tuple(common), command=command,
                   array=tuple((v.name, _portable(v.overrides)) for v in variants), array_indices=tuple(todo),
                   array_parallel=a.max_parallel, **job_fields(p, a))
    return print_or_submit(spec, scheduler, a.dry_run, a.root, "sweep")


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(main())

"""The ``jaxrat`` command: ``jaxrat SUBCOMMAND [options]`` runs ``python -m jaxrat.MODULE [options]``.

Each subcommand is exactly its entry module run as a program (``jaxrat/NAME.py``, which calls
``jaxrat.cli.NAME.run``), so ``jaxrat train ...`` and ``python -m jaxrat.main ...`` are the same
command; cluster scripts keep calling the modules.
"""

from __future__ import annotations

import runpy
import sys

# subcommand -> (module, one line of what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("jaxrat.main", "train and evaluate a config in a workdir (resumes from its checkpoints)"),
    "evaluate": ("jaxrat.evaluate", "score a trained run's checkpoint again (other splits, sizes, TTA, tiles)"),
    "predict": ("jaxrat.predict", "run a trained model on new images: masks, overlays, labels or boxes"),
    "export": ("jaxrat.export", "write a trained model as a jax.export program or ONNX, with a loader that needs no "
               "jaxrat"),
    "robustness": ("jaxrat.robustness", "evaluate one checkpoint at several input sizes and spacings"),
    "sweep": ("jaxrat.sweep", "train every variant of a config's get_sweep(), here or as a job array"),
    "summarize": ("jaxrat.summarize", "one comparison table (md, csv, png) of the runs under a folder"),
    "tune": ("jaxrat.tune", "a hyperparameter search with Optuna, here or as a job array"),
    "report": ("jaxrat.report", "one study page from the sweeps, searches and tables under a folder"),
    "launch": ("jaxrat.launch", "render (and submit) a SLURM or LSF job script for a training run"),
    "checkpoints": ("jaxrat.checkpoints", "list a run's checkpoints: size, eval metrics, best, latest"),
    "download": ("jaxrat.download", "download and verify ISIC 2018, COCO 2017 or a hub model (hf:OWNER/NAME)"),
}


def usage() -> str:
    """The top-level help: every subcommand with one line."""
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxrat SUBCOMMAND [options]     (also: python -m jaxrat SUBCOMMAND ...)", "",
             "Train the Resolution Aware Transformer and its baselines with JAX; every subcommand",
             "takes --help. Flags may be written with hyphens or underscores.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "e.g.  jaxrat train --config isic:demo --workdir runs/demo",
              "      jaxrat train --list-configs"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run ``jaxrat SUBCOMMAND ...``; exits with the subcommand's status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        sys.exit(0)
    if argv[0] in ("--version", "-V"):
        from jaxrat import __version__

        print(f"jaxrat {__version__}")
        sys.exit(0)
    name = argv[0]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean jaxrat {close[0]}?" if close else "jaxrat --help lists them."
        print(f"jaxrat: error: unknown subcommand {name!r}; {hint}", file=sys.stderr)
        sys.exit(2)
    from jaxrat.cli import command_line

    module = COMMANDS[name][0]
    command_line.PROG[:] = [f"jaxrat {name}"]
    sys.argv = [f"jaxrat {name}", *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)

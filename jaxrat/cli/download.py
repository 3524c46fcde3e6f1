"""``jaxrat download DATASET --dest DIR`` (also ``python -m jaxrat.download``): official dataset archives
(:mod:`jaxrat.data.download`); ``jaxrat download hf:OWNER/NAME[@REV]``: a pretrained model from the
Hugging Face hub into its cache (:mod:`jaxrat.checkpointing.hub`)."""

import sys

from jaxrat.cli.command_line import run_argparse


def main(argv: list[str]) -> int:
    """Dispatch on the first argument: ``hf:...`` is a model, anything else a dataset."""
    if argv and argv[0].startswith("hf:"):
        from jaxrat.checkpointing import hub

        return hub.main(argv)
    from jaxrat.data import download

    return download.main(argv)


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(run_argparse(main, sys.argv[1:]))

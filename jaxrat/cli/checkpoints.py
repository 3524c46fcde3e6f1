"""``python -m jaxrat.checkpoints WORKDIR [--json]``: list a run's checkpoints (see jaxrat.checkpointing.inspect)."""

import sys

from jaxrat.checkpointing.inspect import main
from jaxrat.cli.command_line import run_argparse


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(run_argparse(main, sys.argv[1:]))

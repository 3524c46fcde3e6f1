"""``python -m jaxrat.checkpoints WORKDIR [--json]``: list a run's checkpoints (see jaxrat.checkpointing.inspect)."""

import sys

from jaxrat.checkpointing.inspect import main
from jaxrat.runtime.command_line import run_argparse

if __name__ == "__main__":
    sys.exit(run_argparse(main, sys.argv[1:]))

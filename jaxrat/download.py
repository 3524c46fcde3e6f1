"""``python -m jaxrat.download DATASET --dest DIR``: download official dataset archives
(:mod:`jaxrat.data.download`; also ``python -m jaxrat.data.download``)."""

import sys

from jaxrat.data.download import main
from jaxrat.runtime.command_line import run_argparse

if __name__ == "__main__":
    sys.exit(run_argparse(main, sys.argv[1:]))

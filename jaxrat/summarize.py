"""Entry point: ``python -m jaxrat.summarize ROOT`` -- one comparison table of the runs under ROOT.

Writes ``ROOT/summary.md``, ``ROOT/summary.csv`` and ``ROOT/summary.png`` (the plot only with
matplotlib installed) and prints the markdown table. See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import sys

from jaxrat.experiments.summary import report
from jaxrat.runtime.command_line import argparse_style, plain, prog
from jaxrat.runtime.console import fail
from jaxrat.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog=prog("python -m jaxrat.summarize"), description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("root", help="the sweep's root folder (one workdir per variant)")
    try:
        sys.stdout.write(report(p.parse_args(argparse_style(sys.argv[1:] if argv is None else argv)).root))
    except UserError as e:
        fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())

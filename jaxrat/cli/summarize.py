"""Entry point: ``python -m jaxrat.summarize ROOT`` -- one comparison table of the runs under ROOT.

Writes ``ROOT/summary.md``, ``ROOT/summary.csv`` and ``ROOT/summary.png`` (the plot only with
matplotlib installed) and prints the markdown table. See docs/experiments.md.
"""

from __future__ import annotations

import sys

from jaxrat.cli.entry import arguments, parser, user_errors
from jaxrat.experiments.summary import report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = parser(__doc__, "python -m jaxrat.summarize")
    p.add_argument("root", help="the sweep's root folder (one workdir per variant)")
    a = p.parse_args(arguments(argv))
    with user_errors():
        sys.stdout.write(report(a.root))
    return 0


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(main())

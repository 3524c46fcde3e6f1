"""Entry point: ``python -m jaxrat.report ROOT`` -- one study page from the files under ROOT.

Writes ``ROOT/report.md`` and ``ROOT/report.html`` (images in ``ROOT/report_files/``): every sweep's
tables (mean ± sd over folds and seeds, paired differences), every search's trials and importances,
every robustness table, the metric curves, each run's config differences, machine and commit.
It reads only what runs wrote, so it works while jobs run. See docs/experiments.md.
"""

from __future__ import annotations

import os
import sys

from jaxrat.cli.entry import arguments, parser, user_errors
from jaxrat.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = parser(__doc__, "python -m jaxrat.report")
    p.add_argument("root", help="a folder holding sweeps, searches, robustness tables or runs (at any depth)")
    a = p.parse_args(arguments(argv))
    with user_errors():
        if not os.path.isdir(a.root):
            raise UserError(f"{a.root} is not a folder; pass the folder that holds your sweeps and searches.")
        from jaxrat.experiments.report import write

        paths = write(a.root)
        print("written: " + ", ".join(paths))
    return 0


def run() -> None:
    """Run the command with ``sys.argv``; exits with its status."""
    sys.exit(main())

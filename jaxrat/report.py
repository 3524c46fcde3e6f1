"""Entry point: ``python -m jaxrat.report ROOT`` -- one study page from the files under ROOT.

Writes ``ROOT/report.md`` and ``ROOT/report.html`` (images in ``ROOT/report_files/``): every sweep's
tables (mean ± sd over folds and seeds, paired differences), every search's trials and importances,
every robustness table, the metric curves, each run's config differences, machine and commit.
It reads only what runs wrote, so it works while jobs run. See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxrat.runtime.command_line import argparse_style, plain, prog
from jaxrat.runtime.console import fail
from jaxrat.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog=prog("python -m jaxrat.report"), description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("root", help="a folder holding sweeps, searches, robustness tables or runs (at any depth)")
    a = p.parse_args(argparse_style(sys.argv[1:] if argv is None else argv))
    try:
        if not os.path.isdir(a.root):
            raise UserError(f"{a.root} is not a folder; pass the folder that holds your sweeps and searches.")
        from jaxrat.experiments.report import write

        paths = write(a.root)
        print("written: " + ", ".join(paths))
    except UserError as e:
        fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())

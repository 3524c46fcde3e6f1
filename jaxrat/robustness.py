"""``python -m jaxrat.robustness``: the ``jaxrat robustness`` command, whose code is :mod:`jaxrat.cli.robustness`."""

from jaxrat.cli.robustness import run

if __name__ == "__main__":
    run()

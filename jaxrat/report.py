"""``python -m jaxrat.report``: the ``jaxrat report`` command, whose code is :mod:`jaxrat.cli.report`."""

from jaxrat.cli.report import run

if __name__ == "__main__":
    run()

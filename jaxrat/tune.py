"""``python -m jaxrat.tune``: the ``jaxrat tune`` command, whose code is :mod:`jaxrat.cli.tune`."""

from jaxrat.cli.tune import run

if __name__ == "__main__":
    run()

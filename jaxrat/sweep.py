"""``python -m jaxrat.sweep``: the ``jaxrat sweep`` command, whose code is :mod:`jaxrat.cli.sweep`."""

from jaxrat.cli.sweep import run

if __name__ == "__main__":
    run()

"""``python -m jaxrat.export``: the ``jaxrat export`` command, whose code is :mod:`jaxrat.cli.export`."""

from jaxrat.cli.export import run

if __name__ == "__main__":
    run()

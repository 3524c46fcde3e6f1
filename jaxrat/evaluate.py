"""``python -m jaxrat.evaluate``: the ``jaxrat evaluate`` command, whose code is :mod:`jaxrat.cli.evaluate`."""

from jaxrat.cli.evaluate import run

if __name__ == "__main__":
    run()

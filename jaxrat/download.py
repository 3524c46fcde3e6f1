"""``python -m jaxrat.download``: the ``jaxrat download`` command, whose code is :mod:`jaxrat.cli.download`."""

from jaxrat.cli.download import run

if __name__ == "__main__":
    run()

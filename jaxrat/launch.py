"""``python -m jaxrat.launch``: the ``jaxrat launch`` command, whose code is :mod:`jaxrat.cli.launch`."""

from jaxrat.cli.launch import run

if __name__ == "__main__":
    run()

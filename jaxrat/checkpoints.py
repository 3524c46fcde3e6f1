"""``python -m jaxrat.checkpoints``: the ``jaxrat checkpoints`` command, whose code is :mod:`jaxrat.cli.checkpoints`."""

from jaxrat.cli.checkpoints import run

if __name__ == "__main__":
    run()

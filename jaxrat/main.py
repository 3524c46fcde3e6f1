"""``python -m jaxrat.main``: the ``jaxrat train`` command, whose code is :mod:`jaxrat.cli.train`."""

from jaxrat.cli.train import run

if __name__ == "__main__":
    run()

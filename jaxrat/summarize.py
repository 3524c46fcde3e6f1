"""``python -m jaxrat.summarize``: the ``jaxrat summarize`` command, whose code is :mod:`jaxrat.cli.summarize`."""

from jaxrat.cli.summarize import run

if __name__ == "__main__":
    run()

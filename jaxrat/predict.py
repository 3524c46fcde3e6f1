"""``python -m jaxrat.predict``: the ``jaxrat predict`` command, whose code is :mod:`jaxrat.cli.predict`."""

from jaxrat.cli.predict import run

if __name__ == "__main__":
    run()

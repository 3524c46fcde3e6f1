"""``python -m jaxrat SUBCOMMAND ...``: the ``jaxrat`` command (:mod:`jaxrat.cli.commands`)."""

from jaxrat.cli.commands import main

if __name__ == "__main__":
    main()

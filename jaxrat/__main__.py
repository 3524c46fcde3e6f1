"""``python -m jaxrat SUBCOMMAND ...``: the ``jaxrat`` command (:mod:`jaxrat.commands`)."""

from jaxrat.commands import main

if __name__ == "__main__":
    main()

"""The commands: one module per ``jaxrat SUBCOMMAND``, and what they share (:mod:`jaxrat.cli.entry`,
:mod:`jaxrat.cli.command_line`).

Each command also starts as ``python -m jaxrat.NAME`` (``jaxrat.main`` for ``train``): those modules
at the package top only call this package's ``run``, so cluster scripts and the docs keep one name.
"""

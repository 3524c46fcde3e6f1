"""Errors a user can cause and fix.

Anything raised as :class:`UserError` is printed by ``jaxrat.main`` as one sentence (no
traceback) and the process exits with status 2. Messages name the problem and the fix.
"""


class UserError(Exception):
    """A mistake in the config, the data or the environment that the user can fix."""


class ConfigError(UserError):
    """An invalid configuration value or combination."""


class DataError(UserError):
    """Missing, corrupt or inconsistent input data."""


class CheckpointError(UserError):
    """A checkpoint could not be written (e.g. the disk is full); the previous ones are intact."""

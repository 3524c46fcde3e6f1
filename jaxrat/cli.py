"""What every command-line entry point shares: quiet library logs and the one-sentence exit."""

from __future__ import annotations

import logging
import sys

from absl import flags

USER_ERROR_EXIT_CODE = 2


class _QuietLibraries(logging.Filter):
    """Keep INFO lines from jaxrat only; libraries (Orbax logs a dozen lines per save) from WARNING up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "/jaxrat/" in record.pathname.replace("\\", "/")


def quiet_libraries() -> None:
    """Filter library INFO lines out of the log, unless the user asked for a verbosity."""
    if not flags.FLAGS["verbosity"].present:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_QuietLibraries())


def fail(message: str) -> None:
    """Print ``jaxrat: error: message`` and exit with the user-error status (never requeued)."""
    print(f"jaxrat: error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.exit(USER_ERROR_EXIT_CODE)

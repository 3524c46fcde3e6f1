"""What every command-line entry point shares: quiet library logs and the one-sentence exit."""

from __future__ import annotations

import logging
import sys

from absl import flags

USER_ERROR_EXIT_CODE = 2


class _QuietLibraries(logging.Filter):
    """Keep INFO lines from jaxrat only; libraries (Orbax logs a dozen lines per save) from WARNING
    up, and without their tracebacks: a failure jaxrat handles (a full disk during an async save)
    is explained by jaxrat's own sentence, not by three stack traces from library threads."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "/jaxrat/" in record.pathname.replace("\\", "/"):
            return True
        if record.levelno < logging.WARNING:
            return False
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def quiet_libraries() -> None:
    """Filter library INFO lines out of the log, unless the user asked for a verbosity."""
    if not flags.FLAGS["verbosity"].present:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_QuietLibraries())


def fail(message: str) -> None:
    """Print ``jaxrat: error: message`` and exit with the user-error status (never requeued)."""
    print(f"jaxrat: error: {message}", file=sys.stderr, flush=True)
    # Library tasks abandoned by the error (Orbax's async writes after a full disk) are reported by
    # asyncio when they are collected at exit; the sentence above already said what happened.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    logging.shutdown()
    sys.exit(USER_ERROR_EXIT_CODE)

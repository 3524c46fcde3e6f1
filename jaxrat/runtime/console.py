"""What every command-line entry point shares: quiet library logs and the one-sentence exit."""

from __future__ import annotations

import logging
import os
import sys
import threading

from absl import flags

USER_ERROR_EXIT_CODE = 2
# Set once jaxrat has said why it stops: library threads still failing (Orbax's background writes
# after a full disk) must not print after the sentence, which is the last line a user reads.
_SAID_WHY = threading.Event()


_OWN_FILES: dict[str, bool] = {}


def is_jaxrat_record(record: logging.LogRecord) -> bool:
    """Whether jaxrat logged ``record``: its logger is named ``jaxrat...`` or the file that logged it
    is a module of the jaxrat package. The module decides, not the path: a venv inside a folder
    named jaxrat (``git clone ... jaxrat``) puts ``/jaxrat/`` in every library's path."""
    if record.name == "jaxrat" or record.name.startswith("jaxrat."):
        return True
    path = record.pathname
    own = _OWN_FILES.get(path)
    if own is None:
        own = False
        real = os.path.realpath(path)
        for name, module in list(sys.modules.items()):
            spec = getattr(module, "__spec__", None)
            dotted = spec.name if spec is not None and spec.name else name  # __main__ of python -m jaxrat.X
            if dotted != "jaxrat" and not dotted.startswith("jaxrat."):
                continue
            file = getattr(module, "__file__", None)
            if file and (file == path or os.path.realpath(file) == real):
                own = True
                break
        _OWN_FILES[path] = own
    return own


class _QuietLibraries(logging.Filter):
    """Keep INFO lines from jaxrat only; libraries (Orbax logs a dozen lines per save) from WARNING
    up, and without their tracebacks: a failure jaxrat handles (a full disk during an async save)
    is explained by jaxrat's own sentence, not by three stack traces from library threads."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_jaxrat_record(record):
            return True
        if record.levelno < logging.WARNING or _SAID_WHY.is_set():
            return False
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class _DropClosedLoopTracebacks:
    """A stand-in for sys.stderr that drops one kind of library noise: when an Orbax save fails
    (a full disk), its event loop closes while TensorStore writes are still in flight, and each of
    them prints "RuntimeError: Event loop is closed" with a stack trace straight to sys.stderr, not
    through logging. jaxrat explains the failure in one sentence; every other line, and every
    other traceback, passes through unchanged."""

    _NOISE = "RuntimeError: Event loop is closed"

    def __init__(self, stream) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        # Per writing thread: a traceback printed by a library thread may be interleaved with the
        # main thread's lines (jaxrat's own error sentence), and must still be read as one.
        self._partial: dict[int, str] = {}
        self._held: dict[int, list[str]] = {}  # the lines of a traceback not yet finished

    def write(self, text: str) -> int:
        me = threading.get_ident()
        with self._lock:
            *lines, self._partial[me] = (self._partial.get(me, "") + text).split("\n")
            for line in lines:
                self._line(me, line + "\n")
        return len(text)

    def _line(self, me: int, line: str) -> None:
        held = self._held.get(me)
        if held:
            held.append(line)
            if not line[:1].isspace() and not line.startswith("Traceback"):  # the exception's own line
                if line.strip() != self._NOISE:
                    self._stream.write("".join(held))
                del self._held[me]
        elif line.startswith("Traceback (most recent call last):"):
            self._held[me] = [line]
        else:
            self._stream.write(line)

    def flush(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._partial.get(me) and not self._held.get(me):
                self._stream.write(self._partial.pop(me))
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet_libraries() -> None:
    """Filter library INFO lines and known library noise out of the log, unless the user asked
    for a verbosity."""
    if not flags.FLAGS["verbosity"].present:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_QuietLibraries())
        if not isinstance(sys.stderr, _DropClosedLoopTracebacks):
            sys.stderr = _DropClosedLoopTracebacks(sys.stderr)


_LIVE = threading.Event()  # a progress line is on the terminal, not yet ended by a newline


class _EndLiveLine(logging.Filter):
    """Ends the progress line before any other log line is printed below it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _LIVE.is_set():
            _LIVE.clear()
            sys.stderr.write("\n")
        return True


def on_terminal() -> bool:
    """Whether stderr is a terminal (a person watching) rather than a file (a job log)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress(line: str) -> None:
    """A progress line: on a terminal rewritten in place (tqdm-style, the next log line starts
    below it); in a job log an ordinary INFO line, one per log period."""
    if not on_terminal():
        logging.info("%s", line, stacklevel=2)  # the caller's file and line, as for any log line
        return
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _EndLiveLine) for f in handler.filters):
            handler.filters.insert(0, _EndLiveLine())
    sys.stderr.write("\r" + line + "\x1b[K")
    sys.stderr.flush()
    _LIVE.set()


def fail(message: str) -> None:
    """Print ``jaxrat: error: message`` and exit with the user-error status (never requeued)."""
    _SAID_WHY.set()
    if _LIVE.is_set():
        _LIVE.clear()
        sys.stderr.write("\n")
    print(f"jaxrat: error: {message}", file=sys.stderr, flush=True)
    # Library tasks abandoned by the error (Orbax's async writes after a full disk) are reported by
    # asyncio when they are collected at exit; the sentence above already said what happened.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    logging.shutdown()
    sys.exit(USER_ERROR_EXIT_CODE)

"""The stderr filter that drops TensorStore's "Event loop is closed" stack traces (printed when an
Orbax save fails mid-write) and lets everything else through."""

import io
import pathlib
import subprocess
import sys
import textwrap

from jaxrat.runtime.console import _DropClosedLoopTracebacks

NOISE = ('Traceback (most recent call last):\n'
         '  File "/usr/lib/python3.11/asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
         '    self._check_closed()\n'
         "RuntimeError: Event loop is closed\n")
REAL = ('Traceback (most recent call last):\n'
        '  File "x.py", line 1, in <module>\n'
        "ValueError: a real error\n")


def test_drops_the_closed_loop_traceback_and_keeps_everything_else():
    out = io.StringIO()
    err = _DropClosedLoopTracebacks(out)
    text = "before\n" + NOISE + REAL + NOISE + "after, no newline"
    for i in range(0, len(text), 7):  # written in pieces, as threads and print() do
        err.write(text[i:i + 7])
    err.flush()
    assert out.getvalue() == "before\n" + REAL + "after, no newline"


def test_a_line_from_another_thread_inside_the_noise_passes_and_the_noise_is_still_dropped():
    # Seen in CI: a TensorStore thread's traceback, printed line by line, had the main thread's
    # "jaxrat: error: ..." sentence land between its first and second line.
    import threading

    out = io.StringIO()
    err = _DropClosedLoopTracebacks(out)
    lines = NOISE.splitlines(keepends=True)
    go_main, go_lib = threading.Event(), threading.Event()

    def library() -> None:
        err.write(lines[0])
        err.write(lines[1])
        go_main.set()
        go_lib.wait(10)
        for line in lines[2:]:
            err.write(line)

    t = threading.Thread(target=library)
    t.start()
    go_main.wait(10)
    err.write("jaxrat: error: the disk is full\n")
    go_lib.set()
    t.join(10)
    err.flush()
    assert out.getvalue() == "jaxrat: error: the disk is full\n"


def test_a_chained_traceback_is_kept_whole():
    out = io.StringIO()
    err = _DropClosedLoopTracebacks(out)
    chained = REAL + "\nDuring handling of the above exception, another exception occurred:\n\n" + REAL
    err.write(chained)
    assert out.getvalue() == chained


def test_tensorstore_callbacks_on_a_closed_loop_print_nothing():
    # The real thing: TensorStore futures finishing after their asyncio loop closed.
    script = textwrap.dedent("""
        import asyncio, sys, time
        import tensorstore as ts
        from jaxrat.runtime.console import _DropClosedLoopTracebacks
        sys.stderr = _DropClosedLoopTracebacks(sys.stderr)
        for _ in range(3):
            promise, future = ts.Promise.new()
            async def waiter():
                await future
            loop = asyncio.new_event_loop()
            loop.create_task(waiter())
            loop.run_until_complete(asyncio.sleep(0.01))
            loop.close()
            promise.set_result(1)
        time.sleep(0.2)
        print("the end", file=sys.stderr, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Event loop is closed" not in proc.stderr and "the end" in proc.stderr, proc.stderr
    unfiltered = subprocess.run([sys.executable, "-c", script.replace("sys.stderr = _Drop", "_ = _Drop")],
                                capture_output=True, text=True, timeout=120)
    assert "Event loop is closed" in unfiltered.stderr  # the check above can fail


def test_a_library_error_logged_after_the_sentence_is_dropped_so_the_sentence_stays_last():
    """Seen in CI: an Orbax writer thread logged its full-disk error after jaxrat's sentence."""
    script = textwrap.dedent("""
        import logging, threading
        from absl import app
        from jaxrat.runtime import console as cli

        def main(argv):
            cli.quiet_libraries()
            lib = logging.LogRecord("orbax", logging.ERROR, "/site-packages/orbax/future.py", 1, "raised", None, None)
            def late():
                cli._SAID_WHY.wait()
                logging.getLogger().handle(lib)
            t = threading.Thread(target=late)
            t.start()
            logging.getLogger().handle(lib)  # before the sentence: kept
            try:
                cli.fail("no space left on the device; free some.")
            finally:
                t.join()

        app.run(main)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "jaxrat: error: no space left on the device; free some.", out.stderr
    assert sum("raised" in line for line in lines) == 1, out.stderr


def _record(pathname: str, name: str = "absl", level: int = 20):
    import logging

    return logging.LogRecord(name, level, pathname, 1, "a line", None, None)


def test_library_info_is_dropped_from_a_venv_inside_a_folder_named_jaxrat():
    import logging

    import jaxrat.trainer.hooks as hooks
    from jaxrat.runtime.console import _QuietLibraries

    quiet = _QuietLibraries()
    orbax = "/home/me/jaxrat/.venv/lib/python3.11/site-packages/orbax/checkpoint/manager.py"
    assert not quiet.filter(_record(orbax))
    assert quiet.filter(_record(orbax, level=logging.WARNING))
    assert quiet.filter(_record(hooks.__file__, name="root"))
    assert quiet.filter(_record("/elsewhere/x.py", name="jaxrat.custom"))


def test_a_smoke_run_from_a_venv_under_a_jaxrat_folder_logs_no_library_info(tmp_path):
    # The README's own setup: git clone ... jaxrat && bash scripts/demo.sh puts the venv at jaxrat/.venv.
    import os

    from runner import REPO, env_with_devices

    clone = tmp_path / "jaxrat"
    clone.mkdir()
    venv = os.path.dirname(os.path.dirname(sys.executable))
    os.symlink(venv, clone / ".venv")
    python = str(clone / ".venv" / "bin" / os.path.basename(sys.executable))
    env = env_with_devices(1)
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([python, "-m", "jaxrat.main", "--config", "isic:smoke", f"--workdir={tmp_path / 'w'}",
                           "--config.num_train_steps=2"], cwd=str(clone), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "/jaxrat/.venv/" in subprocess.run([python, "-c", "import orbax.checkpoint as o; print(o.__file__)"],
                                              env=env, capture_output=True, text=True).stdout
    own = {p.name for p in pathlib.Path(REPO, "jaxrat").rglob("*.py")}
    # Python's log lines (absl format); C++ lines (I0000, e.g. a CUDA plugin's probe) bypass Python logging.
    info = [line for line in proc.stderr.splitlines() if line[:1] == "I" and "] " in line and line[:5] != "I0000"]
    foreign = [line for line in info if line.split("] ")[0].split()[-1].split(":")[0] not in own]
    assert info and not foreign, foreign[:5]

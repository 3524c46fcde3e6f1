"""A second Ctrl-C during start-up (jaxrat/cluster/startup_exit.py): the run ends at once, after the
write under way (jaxrat/runtime/exit_guard.py), with its line and what it holds released.

The exits run in a short helper process (importing jaxrat.cluster, not JAX): it ends with os._exit.
Its main thread sits in a blocking call, as a run's sits in XLA's compile; the signal handler that
Python runs there does not end it, the window's thread does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxrat.cluster import startup_exit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HELPER = textwrap.dedent('''
    import os, signal, sys, threading, time
    from jaxrat.cluster import preemption, startup_exit
    from jaxrat.runtime import exit_guard

    mode, out = sys.argv[1], sys.argv[2]
    preemption.install_handlers(start_up_exit=True)
    startup_exit.note_step(3)
    startup_exit.on_exit(lambda: open(os.path.join(out, "released"), "w").close())
    if mode == "wakeup_taken":  # something else took the interpreter's wakeup pipe after the window opened
        other = os.pipe()[1]
        os.set_blocking(other, False)
        signal.set_wakeup_fd(other)
    if mode == "done":
        startup_exit.done()
    inside = threading.Event()

    def write():
        with exit_guard.whole():
            inside.set()
            time.sleep(60 if mode == "stuck" else 1.0)  # stuck: a write on a dead filesystem
            open(os.path.join(out, "written"), "w").close()

    threading.Thread(target=write, daemon=True).start()
    inside.wait()
    print("ready", flush=True)
    time.sleep(60)  # a blocking call: the handler runs inside it and returns, the sleep goes on
    print("slept", flush=True)
''')


def _start(mode: str, out: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", _HELPER, mode, out], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=30)
    return proc


def _two_ctrl_cs(proc: subprocess.Popen) -> tuple[int, str, float]:
    """(exit status, stderr, seconds from the second Ctrl-C to the exit)."""
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["window", "wakeup_taken"])
def test_a_second_ctrl_c_during_start_up_ends_after_the_guarded_write_with_the_line_and_the_release(tmp_path, mode):
    proc = _start(mode, str(tmp_path))
    status, err, seconds = _two_ctrl_cs(proc)
    assert status == 130, err
    assert err.count("Ctrl-C: stopping at the next step") == 1, err
    assert err.endswith("\njaxrat: interrupted before step 4 (during start-up, the checkpoint of step 3 is kept); "
                        "run the same command to resume\n"), err
    assert "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["released", "written"]  # the write ran to its end first
    assert seconds < 10  # not the helper's 60 s sleep


def test_a_third_ctrl_c_ends_the_run_while_the_exit_waits_for_a_write_that_never_ends(tmp_path):
    proc = _start("stuck", str(tmp_path))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the second waits for the write
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.endswith("\njaxrat: interrupted before step 4 (during start-up, the checkpoint of step 3 is kept); "
                        "run the same command to resume\n"), err
    assert os.listdir(tmp_path) == []  # cut: neither the write nor the release ran


def test_after_start_up_a_second_ctrl_c_is_the_default_action(tmp_path):
    proc = _start("done", str(tmp_path))
    status, err, _ = _two_ctrl_cs(proc)
    assert status == -signal.SIGINT, err
    assert "Ctrl-C again exits now" in err and "interrupted" not in err and "released" not in os.listdir(tmp_path)


def test_the_closing_line_names_the_step_it_goes_on_from():
    assert startup_exit.closing_line(None) == "interrupted during start-up; run the same command to resume"
    assert startup_exit.closing_line(0) == ("interrupted before step 1 (during start-up, no checkpoint yet); run the "
                                            "same command to resume")

"""Input worker processes end cleanly on every exit path: a finished run, a preemption (SIGTERM to
every process of the job, as SLURM sends it), Ctrl-C (SIGINT to the terminal's process group), and
none leaves shared memory behind (no "resource_tracker: ... leaked shared_memory objects" warning).

Before the fix, a job-wide SIGTERM killed the workers with batches in shared memory that nobody
unlinked, and the preempted run's exit warned of 4-7 leaked objects.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from jaxrat.cluster import PREEMPTED_EXIT_CODE
from runner import REPO, main_cmd
from test_preempt import TIMEOUT, cached_env, compile_cache, train_steps_logged  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ARGS = ["--config.train.eval_every=100000", "--config.train.eval_at_end=false", "--config.data.num_workers=2",
        "--config.checkpoint.every_steps=1000", "--config.train.log_every=1"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(workdir: str, log: str, cache: str, steps: int, signal_after: int | None, sig: int = signal.SIGTERM):
    with open(log, "w") as out:
        # SIGINT at its default, as in a terminal: a suite started in the background (`cmd &` in a
        # script, nohup) ignores it, every child inherits that, and Python then keeps ignoring Ctrl-C.
        proc = subprocess.Popen(main_cmd(workdir, *ARGS, f"--config.num_train_steps={steps}"),
                                env=cached_env(1, cache), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_default_sigint)
        try:
            if signal_after is not None:
                deadline = time.time() + TIMEOUT
                while len(train_steps_logged(workdir)) < signal_after and proc.poll() is None:
                    assert time.time() < deadline, "no train steps in time"
                    time.sleep(0.01)
                os.killpg(proc.pid, sig)  # the whole job: the workers get it too
            code = proc.wait(TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    with open(log) as f:
        return code, f.read(), proc.pid


def _no_leak(output: str) -> None:
    assert "resource_tracker" not in output and "leaked" not in output, output[-3000:]


@pytest.mark.parametrize("how", ["finish", "preemption", "ctrl-c"])
def test_workers_leave_no_shared_memory_behind(tmp_path, compile_cache, how):
    wd, log = str(tmp_path / "wd"), str(tmp_path / "run.log")
    if how == "finish":
        code, out, session = _run(wd, log, compile_cache, steps=6, signal_after=None)
        assert code == 0, out[-3000:]
    elif how == "preemption":
        code, out, session = _run(wd, log, compile_cache, steps=300, signal_after=4)
        assert code == PREEMPTED_EXIT_CODE, out[-3000:]
        assert "preempted at step" in out
    else:
        code, out, session = _run(wd, log, compile_cache, steps=300, signal_after=4, sig=signal.SIGINT)
        assert code != 0, out[-3000:]
    _no_leak(out)
    # No worker outlives the run (the run was started in a session of its own).
    deadline = time.time() + 15
    while (left := subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True).stdout.split()):
        assert time.time() < deadline, f"processes of the run still alive: {left}"
        time.sleep(0.2)


def _session_ends(session: int, timeout: float = 15) -> None:
    deadline = time.time() + timeout
    while (left := subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True).stdout.split()):
        assert time.time() < deadline, f"processes of the run still alive: {left}"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_during_start_up_exits_for_requeue_with_nothing_to_save(tmp_path, compile_cache, sig):
    """The handlers were installed at the first step's check: a SIGTERM during data preparation or
    the first compile ended the run with -15 (not requeued), SIGUSR1 killed it outright, and the
    run's lock and input workers were left behind."""
    wd, log = str(tmp_path / "wd"), str(tmp_path / "run.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(main_cmd(wd, *ARGS, "--config.num_train_steps=300"), env=cached_env(1, compile_cache),
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + TIMEOUT
            while " mesh " not in open(log).read() and proc.poll() is None:  # main is running, no step yet
                assert time.time() < deadline, "the run did not start in time"
                time.sleep(0.01)
            os.kill(proc.pid, sig)
            code = proc.wait(TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    text = open(log).read()
    if sig == signal.SIGINT:  # Ctrl-C: the same stop, said for a person, with the shell's status
        assert code == 130 and "Traceback" not in text, text[-3000:]
        last = text.rstrip().splitlines()[-1]
        assert last == ("jaxrat: interrupted before step 1 (during start-up, no checkpoint yet); run the same "
                        "command to resume"), text[-3000:]
    else:
        assert code == PREEMPTED_EXIT_CODE, text[-3000:]
        assert "nothing to save" in text and "preempted before step 1" in text, text[-3000:]
    assert not os.path.exists(os.path.join(wd, "run.lock"))
    _session_ends(proc.pid)


def test_input_workers_end_when_the_run_is_killed(tmp_path, compile_cache):
    """Workers ignore SIGTERM by design; with their parent killed they kept running and held the
    job's output pipe open."""
    wd, log = str(tmp_path / "wd"), str(tmp_path / "run.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(main_cmd(wd, *ARGS, "--config.num_train_steps=300"), env=cached_env(1, compile_cache),
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + TIMEOUT
            while len(train_steps_logged(wd)) < 2 and proc.poll() is None:
                assert time.time() < deadline, "no train steps in time"
                time.sleep(0.01)
            proc.kill()
            assert proc.wait(30) == -signal.SIGKILL
            _session_ends(proc.pid)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

"""One run per workdir and config checks on resume, in-process (docs/workdir.md).

The end-to-end runs (a second ``jaxrat.main`` on a live workdir, kill -9 and takeover, a changed
config on resume) are in tests/integration/test_workdir_runs.py.
"""

import dataclasses
import json
import logging
import os
import subprocess
import threading
import time

import pytest

from jaxrat.config_schema import load_config
from jaxrat.trainer import workdir as wdm
from jaxrat.trainer.workdir_lock import LOCK_NAME, Holder, WorkdirInUse, WorkdirLock, dead_reason
from runner import SMOKE


def _plant(workdir, age_s: float = 0.0, **fields) -> Holder:
    """A lock file as another run would have left it, last refreshed ``age_s`` ago."""
    holder = dataclasses.replace(Holder.this_process(), **fields)
    path = os.path.join(workdir, LOCK_NAME)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(holder), f)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return holder


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    held = json.load(open(tmp_path / LOCK_NAME))
    assert held["pid"] == os.getpid() and held["token"] == lock.me.token
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # no temporary files left
    lock.release()
    assert not os.listdir(tmp_path)


def test_a_live_holder_is_named_and_keeps_the_lock(tmp_path):
    first = WorkdirLock(str(tmp_path))
    first.acquire()
    try:
        with pytest.raises(WorkdirInUse) as e:
            WorkdirLock(str(tmp_path)).acquire()
        msg = str(e.value)
        assert f"is in use by another run (process {os.getpid()} on host {first.me.host}" in msg, msg
        assert "since " in msg and "UTC" in msg and "another --workdir" in msg and msg.count(". ") == 0, msg
    finally:
        first.release()


def test_slurm_holder_is_named_with_its_job(tmp_path):
    _plant(tmp_path, slurm_job_id="4242", slurm_restart_count=1)
    with pytest.raises(WorkdirInUse, match=r"SLURM job 4242 restart 1.*scancel 4242"):
        WorkdirLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("fields, why", [
    (lambda: {"pid": _dead_pid()}, "its process is gone"),
    (lambda: {"start_ticks": 1}, "belongs to another process"),  # our pid, reused: another start time
    (lambda: {"boot_id": "an-earlier-boot"}, "rebooted"),
    (lambda: {"host": "node-elsewhere"}, "lease expired"),
    (lambda: {"pid": _dead_pid(), "pid_namespace": "pid:[1]"}, "lease expired"),  # another container
])
def test_a_dead_holder_is_taken_over_with_a_warning(tmp_path, caplog, fields, why):
    _plant(tmp_path, age_s=1000, **fields())
    lock = WorkdirLock(str(tmp_path), lease_s=60)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    try:
        assert json.load(open(tmp_path / LOCK_NAME))["token"] == lock.me.token
        assert "took over the workdir lock" in caplog.text and why in caplog.text, caplog.text
    finally:
        lock.release()
    assert not os.listdir(tmp_path)


def test_another_host_with_a_fresh_lease_keeps_the_lock(tmp_path):
    _plant(tmp_path, age_s=5, host="node-elsewhere", pid=1)
    with pytest.raises(WorkdirInUse, match="process 1 on host node-elsewhere.*last heartbeat 5 s ago"):
        WorkdirLock(str(tmp_path), lease_s=60).acquire()
    # Another container on this host: its process ids mean nothing here, only its lease counts.
    _plant(tmp_path, age_s=5, pid=_dead_pid(), pid_namespace="pid:[1]")
    with pytest.raises(WorkdirInUse):
        WorkdirLock(str(tmp_path), lease_s=60).acquire()


def test_dead_reason_is_pure_of_the_lock_file():
    me = Holder.this_process()
    assert dead_reason(me, 10**6, 1.0, me) is None  # a live process on this host: the lease does not matter
    other = dataclasses.replace(me, host="elsewhere")
    assert dead_reason(other, 5, 10, me) is None
    assert "lease expired" in dead_reason(other, 11, 10, me)


@pytest.mark.parametrize("stale", [False, True], ids=["no-lock", "stale-lock"])
def test_runs_starting_together_get_exactly_one_holder(tmp_path, stale):
    if stale:
        _plant(tmp_path, age_s=1000, host="node-elsewhere")
    locks = [WorkdirLock(str(tmp_path), lease_s=60) for _ in range(8)]
    start, won, lost = threading.Barrier(len(locks)), [], []

    def contend(lock):
        start.wait()
        try:
            lock.acquire()
            won.append(lock)
        except WorkdirInUse as e:
            lost.append(str(e))

    threads = [threading.Thread(target=contend, args=(lk,)) for lk in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    assert all("is in use by another run" in m for m in lost), lost
    assert json.load(open(tmp_path / LOCK_NAME))["token"] == won[0].me.token
    won[0].release()
    assert not os.listdir(tmp_path)  # no takeover markers or temporary files left


def test_a_takeover_cut_short_by_kill9_does_not_block_later_starts(tmp_path):
    stale = _plant(tmp_path, age_s=1000, host="node-elsewhere")
    marker = tmp_path / f"{LOCK_NAME}.takeover-{stale.token}"
    taker = dataclasses.replace(Holder.this_process(), pid=_dead_pid())  # died between marker and replace
    marker.write_text(json.dumps(dataclasses.asdict(taker)))
    lock = WorkdirLock(str(tmp_path), lease_s=60)
    lock.acquire()
    lock.release()
    assert not os.listdir(tmp_path)
    # A live taker's marker is respected: this start waits its turn and then stops.
    stale = _plant(tmp_path, age_s=1000, host="node-elsewhere")
    marker = tmp_path / f"{LOCK_NAME}.takeover-{stale.token}"
    marker.write_text(json.dumps(dataclasses.asdict(Holder.this_process())))
    with pytest.raises(WorkdirInUse, match="keeps changing hands"):
        WorkdirLock(str(tmp_path), lease_s=60).acquire()
    assert marker.exists()


def test_heartbeat_refreshes_the_lease_and_release_spares_a_new_holder(tmp_path):
    lock = WorkdirLock(str(tmp_path), lease_s=0.4)
    lock.acquire()
    path = tmp_path / LOCK_NAME
    os.utime(path, (0, 0))
    time.sleep(0.5)
    assert time.time() - os.stat(path).st_mtime < 0.4
    _plant(tmp_path)  # someone took it over after our lease expired: release must not remove theirs
    lock.release()
    assert path.exists()


def test_a_requeued_job_waits_for_its_previous_allocation(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    # The previous start keeps its heartbeat: it still runs, so the requeued start stops.
    _plant(tmp_path, host="node-elsewhere", pid=4321, slurm_job_id="77", slurm_restart_count=0)
    stop = threading.Event()
    beat = threading.Thread(target=lambda: [os.utime(tmp_path / LOCK_NAME) for _ in iter(lambda: stop.wait(0.3), True)])
    beat.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkdirInUse, match="SLURM job 77 restart 0.*kill 4321 on node-elsewhere: an earlier start"):
            WorkdirLock(str(tmp_path), lease_s=3).acquire()
    finally:
        stop.set()
        beat.join()
    assert time.monotonic() - t0 < 3
    # Its heartbeat has stopped: the requeued start takes over once the lease runs out.
    lock = WorkdirLock(str(tmp_path), lease_s=3)
    t0 = time.monotonic()
    lock.acquire()
    lock.release()
    assert 1 < time.monotonic() - t0 < 8


# ------------------------------------------------------------------------------------ config

def _smoke(*overrides: str):
    """The smoke config with ``"a.b=value"`` overrides, as on the command line."""
    config = load_config(SMOKE)
    for o in overrides:
        key, value = o.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        old = node[leaf]
        node[leaf] = eval(value) if isinstance(old, tuple) else type(old)(value)
    return config


def test_config_fields_are_split_into_what_is_trained_and_how(tmp_path):
    changed = _smoke("data.image_size=48", "num_train_steps=9", "seed=1", "mesh.axes=(('data', 2),)",
                     "optimizer.grad_accum_steps=2")
    old, new = wdm.config_as_json(_smoke()), wdm.config_as_json(changed)
    fixed, free = wdm.config_changes(old, new)
    assert fixed == ["data.image_size: 32 -> 48", "seed: 0 -> 1"]
    assert free == ['mesh.axes: [["data", -1], ["fsdp", 1]] -> [["data", 2]]', "num_train_steps: 6 -> 9",
                    "optimizer.grad_accum_steps: 1 -> 2"]
    for key in ("model.features", "task.name", "data.name", "data.batch_size", "optimizer.learning_rate",
                "data.synthetic", "data.synthetic_image_size", "train.compute_dtype"):
        assert not wdm.resumable(key), key
    for key in ("distributed.coordinator_address", "checkpoint.keep", "data.data_dir", "workdir.lease_seconds",
                "data.eval_spacing"):
        assert wdm.resumable(key), key


def test_a_changed_config_stops_a_resume_and_an_allowed_change_is_kept_aside(tmp_path, caplog):
    wd = str(tmp_path)
    wdm.check_and_save_config(_smoke(), wd, allow_change=False)
    # No checkpoint yet: a fresh start, whatever the old config.json says.
    wdm.check_and_save_config(_smoke("data.image_size=48"), wd, allow_change=False)
    os.makedirs(os.path.join(wd, "checkpoints", "3"))
    with pytest.raises(wdm.ConfigChanged) as e:
        wdm.check_and_save_config(_smoke("num_train_steps=9"), wd, allow_change=False)
    msg = str(e.value)
    assert "data.image_size: 48 -> 32" in msg and "num_train_steps" not in msg, msg
    assert "--config.workdir.allow_config_change=true" in msg and f"--config.init_from={wd}" in msg

    with caplog.at_level(logging.INFO):
        wdm.check_and_save_config(_smoke("data.image_size=48", "num_train_steps=9"), wd, allow_change=False)
    assert "num_train_steps: 6 -> 9" in caplog.text
    assert json.load(open(os.path.join(wd, "config.json")))["num_train_steps"] == 9
    kept = sorted(n for n in os.listdir(wd) if n.startswith("config.") and n != "config.json")
    assert len(kept) == 2, kept  # the smoke config, then the 48-pixel one with 6 steps
    assert json.load(open(os.path.join(wd, kept[-1])))["num_train_steps"] == 6

    wdm.check_and_save_config(_smoke("data.image_size=64", "num_train_steps=9"), wd, allow_change=True)
    assert json.load(open(os.path.join(wd, "config.json")))["data"]["image_size"] == 64
    wdm.check_and_save_config(_smoke("data.image_size=64", "num_train_steps=9"), wd, allow_change=False)
    assert len([n for n in os.listdir(wd) if n.startswith("config.")]) == 4  # an unchanged config is not kept twice


def test_a_resume_with_another_length_warns_that_the_schedule_moves(tmp_path, caplog):
    """More steps on resume stretch the cosine under the resumed step: the rate jumps. It may change
    (extending a run is routine), but as a warning that says so, not an INFO line among the ports."""
    wd = str(tmp_path)
    wdm.check_and_save_config(_smoke(), wd, allow_change=False)
    os.makedirs(os.path.join(wd, "checkpoints", "3"))
    with caplog.at_level(logging.INFO):
        wdm.check_and_save_config(_smoke("train.log_every=2"), wd, allow_change=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        wdm.check_and_save_config(_smoke("num_train_steps=9"), wd, allow_change=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "num_train_steps 6 -> 9" in warned[0] and "keep num_train_steps" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):  # a constant rate (no decay) has no schedule to move
        flat = _smoke("num_train_steps=12", "optimizer.end_learning_rate_factor=1.0")
        wdm.check_and_save_config(flat, wd, allow_change=True)
    assert not [r for r in caplog.records if "keep num_train_steps" in r.getMessage()]


def test_hold_releases_the_lock_when_the_run_fails(tmp_path):
    wd = str(tmp_path / "wd")
    with pytest.raises(RuntimeError, match="boom"):
        with wdm.hold(_smoke(), wd):
            assert os.path.exists(os.path.join(wd, LOCK_NAME))
            with pytest.raises(WorkdirInUse):
                with wdm.hold(_smoke(), wd):
                    pass
            raise RuntimeError("boom")
    assert not os.path.exists(os.path.join(wd, LOCK_NAME))
    assert os.path.exists(os.path.join(wd, "config.json"))
    os.makedirs(os.path.join(wd, "checkpoints", "6"))
    with pytest.raises(wdm.ConfigChanged):
        with wdm.hold(_smoke("model.num_classes=2"), wd):
            pass
    assert not os.path.exists(os.path.join(wd, LOCK_NAME))


def test_a_new_run_keeps_aside_only_the_files_it_writes_and_a_resume_touches_none(tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    for name in ("summary.json", "confusion_label.png", "label_stats.json", "notes.txt"):
        (wd / name).write_text(name)
    with wdm.hold(_smoke(), str(wd)):
        pass
    names = sorted(p.name for p in wd.iterdir())
    assert "notes.txt" in names and "summary.json" not in names and "label_stats.json" not in names
    for stem, ext in (("summary", ".json"), ("confusion_label", ".png"), ("label_stats", ".json")):
        [aside] = [n for n in names if n.startswith(stem + ".20") and n.endswith(ext)]
        assert (wd / aside).read_text() == stem + ext
    os.makedirs(wd / "checkpoints" / "6")  # now a run's workdir: a resume leaves its files as they are
    (wd / "summary.md").write_text("the run's")
    before = sorted(p.name for p in wd.iterdir())
    with wdm.hold(_smoke(), str(wd)):
        pass
    assert sorted(p.name for p in wd.iterdir()) == before and (wd / "summary.md").read_text() == "the run's"


def test_a_forced_resume_the_restore_refuses_leaves_the_workdir_byte_equal(tmp_path):
    """EMA turned off with allow_config_change on an EMA run: the restore refuses, and config.json
    must still be the run's (it said ema_decay 0 and evaluate then scored the raw weights)."""
    wd = str(tmp_path / "wd")
    with wdm.hold(_smoke("optimizer.ema_decay=0.9"), wd) as save_config:
        save_config()
    os.makedirs(os.path.join(wd, "checkpoints", "3"))
    before = sorted(os.listdir(wd)), open(os.path.join(wd, "config.json"), "rb").read()
    forced = _smoke("optimizer.ema_decay=0.0", "workdir.allow_config_change=true")
    with pytest.raises(RuntimeError, match="refused"):
        with wdm.hold(forced, wd):
            raise RuntimeError("the checkpoint refused the restore")
    after = sorted(os.listdir(wd)), open(os.path.join(wd, "config.json"), "rb").read()
    assert after == before
    with wdm.hold(forced, wd) as save_config:  # once the restore has succeeded the new config is the run's
        save_config()
    assert json.load(open(os.path.join(wd, "config.json")))["optimizer"]["ema_decay"] == 0.0


def test_a_workdir_that_cannot_be_written_is_one_sentence(tmp_path):
    """A read-only workdir ended in a PermissionError traceback from the lock file."""
    from jaxrat.runtime.errors import UserError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for wd in ("/sys/jaxrat_workdir", str(blocker / "wd")):  # a read-only filesystem; a path through a file
        with pytest.raises(UserError, match=r"^Cannot write to the workdir .* train in a folder you can write to"):
            with wdm.hold(_smoke(), wd):
                pass


def test_a_workdir_that_is_a_file_says_it_is_not_a_folder(tmp_path):
    from jaxrat.runtime.errors import UserError
    from jaxrat.trainer.loop import train_and_evaluate

    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    with pytest.raises(UserError, match=rf"^--workdir {blocker} is a file, not a folder; pass a folder for the run"):
        train_and_evaluate(_smoke(), str(blocker))
    with pytest.raises(UserError, match=rf"^--workdir {blocker}/run is not a folder: {blocker} is a file; pass"):
        train_and_evaluate(_smoke(), str(blocker / "run"))
    assert blocker.read_text() == "mine"


def test_a_rerun_of_the_same_config_without_checkpoints_keeps_its_files_in_place(tmp_path):
    config = _smoke()
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    wdm.check_config(config, workdir, allow_change=False)()
    for name in ("label_stats.json", "metrics.jsonl"):  # what an attempt killed before its first checkpoint left
        (tmp_path / "run" / name).write_text("{}")
    wdm.check_config(config, workdir, allow_change=False)()  # the same config again: its caches are its own
    assert sorted(os.listdir(workdir)) == ["config.json", "label_stats.json", "metrics.jsonl"]
    wdm.check_config(_smoke("seed=7"), workdir, allow_change=False)()  # another config: kept aside
    assert sorted(n.split(".")[0] for n in os.listdir(workdir)) == ["config", "config", "label_stats", "metrics"]
    assert not os.path.exists(os.path.join(workdir, "label_stats.json"))


def _documented_resumable_fields() -> list[str]:
    """The fields docs/workdir.md's "May change on resume" table names (``section.*`` as ``section.``)."""
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "workdir.md")) as f:
        text = f.read()
    table = text.split("**May change on resume**", 1)[1].split("**Must match**", 1)[0]
    fields = []
    for line in table.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            fields += [name.removesuffix("*") for name in re.findall(r"`([a-z_.*]+)`", cell)]
    return fields


def test_every_field_the_docs_let_change_on_resume_may_change():
    """docs/workdir.md lets train.plots change on resume, but a resume with it changed was refused
    (it was missing from RESUMABLE); where compiled programs are cached changes nothing trained either."""
    fields = _documented_resumable_fields()
    assert "train.plots" in fields and "checkpoint." in fields, fields
    for key in fields:
        probe = key + "keep" if key.endswith(".") else key
        assert wdm.resumable(probe), key
    assert wdm.resumable("train.compilation_cache_dir")


def test_a_folder_of_yours_with_another_tools_numbered_checkpoints_is_refused(tmp_path):
    """A --workdir holding checkpoints/5/ of another tool counted as a run to resume: nothing was kept
    aside (the user's summary.md was overwritten by the run's) and the restore moved their folder into
    checkpoints/damaged. It is refused in one sentence, with nothing written or moved."""
    wd = tmp_path / "home"
    (wd / "checkpoints" / "5").mkdir(parents=True)
    (wd / "checkpoints" / "5" / "model.pt").write_text("another tool's weights")
    (wd / "summary.md").write_text("my notes")
    from jaxrat.runtime.errors import UserError

    before = sorted(str(p.relative_to(wd)) for p in wd.rglob("*"))
    assert not wdm.has_checkpoint(str(wd))
    with pytest.raises(UserError, match=r"checkpoints/5 holds another tool's files \(model.pt\), not a jaxrat "
                                        r"checkpoint.*pass another --workdir"):
        with wdm.hold(_smoke(), str(wd)):
            pass
    assert sorted(str(p.relative_to(wd)) for p in wd.rglob("*")) == before
    (wd / "checkpoints" / "5" / "_CHECKPOINT_METADATA").write_text("{}")  # a save of jaxrat's, even unfinished
    assert wdm.has_checkpoint(str(wd)) and not wdm.foreign_steps(str(wd))


def test_init_from_naming_the_new_runs_own_workdir_is_one_sentence(tmp_path):
    """It said the folder "holds no complete checkpoint; train that run first", which is this run."""
    from jaxrat.runtime.errors import UserError

    wd = tmp_path / "run"
    for spec in (str(wd), f"{wd}/checkpoints:best", f"{wd}:latest"):
        with pytest.raises(UserError, match=r"names this run's own workdir, which has no checkpoint to start from"):
            with wdm.hold(_smoke(f"init_from={spec}"), str(wd)):
                pass
    with wdm.hold(_smoke(f"init_from={tmp_path / 'other'}"), str(wd)):
        pass  # another run's workdir: the weights are read later, as before

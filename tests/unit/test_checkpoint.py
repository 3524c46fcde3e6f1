"""Checkpointer in-process: keep policy, best pointer, killed saves, init_from, CLI, no pickle."""

import json
import logging
import os
import pickle
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.checkpointing import Checkpointer, Policy, SaveSchedule, inspect, load_init, store
from jaxrat.cluster import PreemptionWatch, preemption
from jaxrat.runtime.errors import ConfigError, UserError


def _mesh(n=8):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _state(step, mesh, kernel_shape=(8, 4)):
    sh = NamedSharding(mesh, P("data"))
    params = {"conv": {"kernel": jnp.arange(np.prod(kernel_shape), dtype=jnp.float32).reshape(kernel_shape) + step},
              "head": {"bias": jnp.full((4,), float(step))}}
    params = jax.device_put(params, {"conv": {"kernel": sh}, "head": {"bias": NamedSharding(mesh, P())}})
    return {"step": jnp.int32(step), "params": params, "opt_state": optax.adam(1e-3).init(params)}


def _abstract(state, mesh):
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)


def test_keep_latest_every_pth_and_best_with_a_pointer(tmp_path):
    mesh = _mesh()
    policy = Policy(keep=2, keep_every=5, best_metric="eval/dice", keep_best=2)
    ck = Checkpointer(str(tmp_path / "checkpoints"), policy)
    dice = {2: 0.30, 4: 0.70, 6: 0.50, 8: 0.60, 10: 0.10}
    for step in range(1, 13):
        metrics = {"eval/dice": dice[step], "eval/loss": 1 - dice[step]} if step in dice else None
        ck.save(step, _state(step, mesh), reason="steps", metrics=metrics)
    ck.close()
    # latest 2 (11, 12), every 5th (5, 10), best 2 by dice (4: 0.70, 8: 0.60)
    assert store.committed_steps(ck.directory) == [4, 5, 8, 10, 11, 12]
    assert json.load(open(tmp_path / "checkpoints" / "best.json")) == {
        "step": 4, "metric": "eval/dice", "mode": "max", "value": 0.7}
    info = inspect.describe(str(tmp_path))
    assert info["latest"] == 12 and info["best"]["step"] == 4 and not info["incomplete"]
    assert {r["step"]: r["reason"] for r in info["steps"]}[4] == "steps"
    assert all(r["bytes"] > 0 for r in info["steps"])
    # The pointer is only a shortcut: without it the metrics stored per step give the same answer.
    os.remove(tmp_path / "checkpoints" / "best.json")
    assert store.best_step(ck.directory)[0] == 4
    assert store.resolve(f"{tmp_path}:best") == (ck.directory, 4)


def test_min_mode_and_checkpoints_without_metrics_never_best(tmp_path):
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), Policy(keep=1, best_metric="eval/loss", best_mode="min", keep_best=1))
    ck.save(1, _state(1, mesh), reason="steps", metrics={"eval/loss": 0.4})
    ck.save(2, _state(2, mesh), reason="time")  # no eval at this step
    ck.save(3, _state(3, mesh), reason="steps", metrics={"eval/loss": 0.2})
    ck.save(4, _state(4, mesh), reason="preemption")
    ck.close()
    assert store.committed_steps(ck.directory) == [3, 4]
    assert store.best_step(ck.directory)[0] == 3


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["atomic_rename", "commit_file"])
def test_half_written_checkpoint_is_never_restored_and_is_cleaned_up(tmp_path, atomic_rename):
    mesh = _mesh()
    directory = str(tmp_path / "checkpoints")
    policy = Policy(atomic_rename=atomic_rename)
    ck = Checkpointer(directory, policy)
    ck.save(1, _state(1, mesh), reason="steps")
    ck.close()
    # What a save killed before its commit leaves behind, in each mode.
    partial = os.path.join(directory, "2.orbax-checkpoint-tmp-1700000000" if atomic_rename else "2")
    shutil.copytree(os.path.join(directory, "1"), partial)
    for root, _, files in os.walk(partial):
        for name in files:
            if name == "commit_success.txt":
                os.remove(os.path.join(root, name))
    assert store.committed_steps(directory) == [1]
    assert store.incomplete_entries(directory) == [os.path.basename(partial)]

    ck = Checkpointer(directory, policy)
    assert ck.latest_step() == 1
    state, _ = ck.restore(1, _abstract(_state(0, mesh), mesh))
    np.testing.assert_array_equal(state["params"]["head"]["bias"], np.full(4, 1.0))
    ck.save(3, _state(3, mesh), reason="steps")  # the manager finishes its start-up cleanup first
    ck.close()
    assert not os.path.exists(partial)
    assert store.committed_steps(directory) == [1, 3]


def test_init_from_loads_params_or_also_optimizer_onto_new_shardings(tmp_path):
    ck = Checkpointer(str(tmp_path / "src" / "checkpoints"), Policy())
    ck.save(7, _state(7, _mesh(8)), reason="final")
    ck.close()
    mesh4 = _mesh(4)
    fresh = _state(0, mesh4)
    loaded = load_init(str(tmp_path / "src"), _abstract(fresh, mesh4))
    assert set(loaded) == {"params"}
    np.testing.assert_array_equal(loaded["params"]["head"]["bias"], np.full(4, 7.0))
    assert loaded["params"]["conv"]["kernel"].sharding.mesh.devices.size == 4
    both = load_init(f"{tmp_path}/src/checkpoints/7", _abstract(fresh, mesh4), optimizer=True)
    assert set(both) == {"params", "opt_state"}
    assert jax.tree.structure(both["opt_state"]) == jax.tree.structure(fresh["opt_state"])


def test_init_from_with_optimizer_restarts_the_schedule_and_keeps_the_moments(tmp_path):
    import ml_collections as mlc

    from jaxrat.checkpointing.named_arrays import named_leaves
    from jaxrat.trainer.optimizer import make_optimizer

    cfg = mlc.ConfigDict(dict(learning_rate=1e-2, warmup_steps=10, end_learning_rate_factor=0.01, clip_norm=1.0,
                              b1=0.9, b2=0.999, weight_decay=0.05))
    tx, schedule = make_optimizer(cfg, 100)
    mesh = _mesh()
    src = _state(0, mesh)
    params, opt_state = src["params"], tx.init(src["params"])
    update = jax.jit(tx.update)
    for i in range(30):  # past the warmup: the source's rate is the cosine's, not the warmup's
        grads = jax.tree.map(lambda p: jnp.sin(p + i), params)
        _, opt_state = update(grads, opt_state, params)
    ck = Checkpointer(str(tmp_path / "src" / "checkpoints"), Policy())
    ck.save(30, dict(src, step=jnp.int32(30), opt_state=opt_state), reason="final")
    ck.close()

    fresh = dict(src, opt_state=tx.init(params))
    loaded = load_init(str(tmp_path / "src"), _abstract(fresh, mesh), optimizer=True)["opt_state"]
    got, saved = named_leaves(loaded), named_leaves(opt_state)
    counts = {n: int(v) for n, v in got.items() if n.endswith("count")}
    moments = [n for n in got if "/mu/" in n or "/nu/" in n]
    assert moments and all(np.array_equal(got[n], saved[n]) for n in moments)
    # Adam's bias-correction count stays with its warm moments; the schedule's counts start again.
    assert {n: c for n, c in counts.items() if n.rpartition("/")[0] + "/mu/conv/kernel" in got} == {
        n: 30 for n in counts if n.rpartition("/")[0] + "/mu/conv/kernel" in got}
    schedule_counts = [n for n in counts if n.rpartition("/")[0] + "/mu/conv/kernel" not in got]
    assert schedule_counts and all(counts[n] == 0 for n in schedule_counts)

    grads = jax.tree.map(jnp.ones_like, params)
    step0, after0 = update(grads, loaded, params)
    assert schedule(0) == 0.0 and all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(step0))
    unreset, _ = update(grads, opt_state, params)  # what loading the counts unchanged did: a full rate
    assert float(jnp.abs(unreset["conv"]["kernel"]).max()) > 0
    after = named_leaves(after0)
    assert all(int(after[n]) == 1 for n in schedule_counts)  # step 1 uses schedule(1), the warmup's
    assert float(schedule(1)) == pytest.approx(cfg.learning_rate / cfg.warmup_steps)


def test_init_from_shape_mismatch_names_the_parameter(tmp_path):
    ck = Checkpointer(str(tmp_path / "checkpoints"), Policy())
    ck.save(1, _state(1, _mesh()), reason="final")
    ck.close()
    other = _state(0, _mesh(), kernel_shape=(8, 6))
    message = r"params/conv/kernel has shape \(8, 4\) in the checkpoint .* step 1 but \(8, 6\) in this model"
    with pytest.raises(ConfigError, match=message):
        load_init(str(tmp_path), _abstract(other, _mesh()))
    same = _state(0, _mesh())
    renamed = dict(same, params={"conv": same["params"]["conv"], "neck": same["params"]["head"]})
    with pytest.raises(ConfigError, match="params/neck/bias of this model is missing"):
        load_init(str(tmp_path), _abstract(renamed, _mesh()))


def test_resolve_names_what_is_missing(tmp_path):
    with pytest.raises(UserError, match="No checkpoints at"):
        store.resolve(str(tmp_path / "nope"))
    ck = Checkpointer(str(tmp_path / "checkpoints"), Policy())
    ck.save(2, _state(2, _mesh()), reason="final")
    ck.close()
    assert store.resolve(str(tmp_path)) == (ck.directory, 2)
    assert store.resolve(f"{tmp_path}:latest") == (ck.directory, 2)
    with pytest.raises(UserError, match="no complete checkpoint at step 5; available: 2"):
        store.resolve(f"{tmp_path}:5")
    with pytest.raises(UserError, match="no ranked checkpoint"):
        store.resolve(f"{tmp_path}:best")


def test_restore_unpickles_nothing(tmp_path, monkeypatch):
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), Policy(best_metric="eval/dice"))
    ck.save(1, _state(1, mesh), reason="final", metrics={"eval/dice": 0.5})
    ck.close()

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint tried to unpickle something")

    import _pickle

    for mod in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(mod, name, refuse)
    ck = Checkpointer(str(tmp_path), Policy(best_metric="eval/dice"))
    state, _ = ck.restore(1, _abstract(_state(0, mesh), mesh))
    ck.close()
    assert int(state["step"]) == 1
    assert load_init(f"{tmp_path}:best", _abstract(_state(0, mesh), mesh))["params"]["head"]["bias"][0] == 1.0


def test_cli_lists_steps_sizes_metrics_latest_best_and_incomplete(tmp_path, capsys):
    ck = Checkpointer(str(tmp_path / "checkpoints"), Policy(best_metric="eval/dice"))
    ck.save(3, _state(3, _mesh()), reason="steps", metrics={"eval/dice": 0.25})
    ck.save(6, _state(6, _mesh()), reason="preemption", eval_pending=True)
    ck.close()
    os.makedirs(tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1")
    assert inspect.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "latest: 6" in out and "best: 3 (eval/dice 0.2500, max)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert "0.2500" in rows["3"] and "best" in rows["3"] and "KiB" in rows["3"]
    assert "preemption" in rows["6"] and "latest,eval pending" in rows["6"]
    assert "incomplete (never committed, deleted at the next start): 9.orbax-checkpoint-tmp-1" in out
    assert inspect.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["step"] == 3
    assert inspect.main([str(tmp_path / "missing")]) == 2


def test_cli_columns_are_task_agnostic_ranked_metric_first():
    metrics = {"eval/zeta": 1.0, "eval/top5": 0.9, "eval/loss": 0.3, "eval/f1": 0.5, "eval/accuracy": 0.7}
    info = {"directory": "/x", "latest": 2, "incomplete": [],
            "best": {"step": 2, "metric": "eval/loss", "mode": "min", "value": 0.3},
            "steps": [{"step": 2, "bytes": 10, "reason": "steps", "metrics": metrics, "eval_pending": False}]}
    header = inspect.format_table(info).splitlines()[1].split()
    assert header[header.index("for") + 1:-1] == ["eval/loss", "eval/accuracy", "eval/f1", "eval/top5"]


def test_restore_latest_gives_the_newest_step_or_none(tmp_path):
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), Policy())
    assert ck.restore_latest(_abstract(_state(0, mesh), mesh)) is None
    ck.save(1, _state(1, mesh), reason="steps")
    ck.save(2, _state(2, mesh), reason="steps")
    ck.wait()
    step, state, data_restored = ck.restore_latest(_abstract(_state(0, mesh), mesh))
    ck.close()
    assert step == 2 and not data_restored
    np.testing.assert_array_equal(state["params"]["head"]["bias"], np.full(4, 2.0))


@pytest.mark.parametrize("field,value,words", [
    ("keep", 0, "keep at least 1"), ("best_mode", "highest", "use 'max'"), ("every_steps", -1, "negative"),
    ("best_metric", "dice", "not an eval metric"),
])
def test_policy_errors_name_the_field(field, value, words):
    from jaxrat.config_schema import base_config

    c = base_config().checkpoint
    c[field] = value
    with pytest.raises(ConfigError, match=f"config.checkpoint.{field}.*{words}"):
        Policy.from_config(c)


def test_save_schedule_steps_final_and_minutes():
    now = [0.0]
    sched = SaveSchedule(Policy(every_steps=4, every_minutes=1.0), total_steps=10, clock=lambda: now[0])
    assert [s for s in range(1, 11) if sched.reason(s, log_step=False)] == [4, 8, 10]
    now[0] = 59.0
    assert sched.reason(5, log_step=True) is None
    now[0] = 61.0
    assert sched.reason(5, log_step=False) is None  # time is checked at log steps only
    assert sched.reason(5, log_step=True) == "time"
    sched.saved()
    assert sched.reason(6, log_step=True) is None


@pytest.fixture
def fresh_signal_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    flags = [getattr(preemption, name) for name in ("_sigterm", "_sigint") if hasattr(preemption, name)]
    for flag in flags:
        flag.clear()
    preemption._handler_installed = False
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    for flag in flags:
        flag.clear()
    preemption._handler_installed = False


def test_a_ctrl_c_during_a_save_is_honoured_after_it_not_lost_in_a_gc_callback(fresh_signal_handlers, monkeypatch):
    # A save runs finalisers and garbage-collector callbacks; Python's own SIGINT handler raises
    # KeyboardInterrupt in whichever of them runs, where it is printed as "Exception ignored" and
    # lost. The run's handler only sets a flag, so the loop's next check stops it.
    import gc

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    getattr(preemption, "install_handlers", lambda: None)()
    watch = PreemptionWatch()
    assert not watch.requested()  # the loop's check before the save (installs the handlers on old code)
    sent = []

    def mid_save(phase, info):
        if phase == "start" and not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the callback

    gc.callbacks.append(mid_save)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(mid_save)
    assert sent and lost == []
    assert watch.requested() and preemption.interrupted()  # the next check: stop, as Ctrl-C
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a second Ctrl-C ends the process at once


def test_sigusr1_requests_preemption_and_later_signals_are_ignored(fresh_signal_handlers):
    watch = PreemptionWatch()
    assert not watch.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.requested()
    watch.hold_signals()
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal: would end the process without the hold
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.requested()


def test_a_checkpoint_folder_renamed_by_hand_is_refused_naming_its_real_step(tmp_path):
    """checkpoints/12 renamed to 20 was resumed as step 20 ("resumed from step 20") while its state
    trained on from 12; it stayed the newest folder, so every later resume went back to step 12 and
    the steps trained after it were lost."""
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), Policy())
    ck.save(1, _state(1, mesh), reason="steps")
    ck.save(2, _state(2, mesh), reason="steps")
    ck.wait()
    ck.close()
    os.rename(tmp_path / "2", tmp_path / "20")
    ck = Checkpointer(str(tmp_path), Policy())
    with pytest.raises(ConfigError, match=r"checkpoints?.*20 holds the state of step 2.*rename it back") as e:
        ck.restore_latest(_abstract(_state(0, mesh), mesh))
    ck.close()
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["1", "20"]  # nothing moved aside as damaged, nothing deleted


def test_a_checkpoint_whose_metadata_was_removed_restores_with_a_warning(tmp_path, caplog):
    """Without its _CHECKPOINT_METADATA a step has no digests to check its arrays against: it was
    restored without a word (Orbax's own "Metadata file does not exist" aside)."""
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), Policy())
    ck.save(3, _state(3, mesh), reason="steps")
    ck.wait()
    ck.close()
    os.remove(tmp_path / "3" / "_CHECKPOINT_METADATA")
    ck = Checkpointer(str(tmp_path), Policy())
    with caplog.at_level(logging.WARNING):
        restored = ck.restore_latest(_abstract(_state(0, mesh), mesh))
    ck.close()
    assert restored is not None and restored[0] == 3
    assert "step 3 has no digests of its arrays" in caplog.text and "restored unchecked" in caplog.text

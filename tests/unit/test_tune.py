"""jaxrat.tune without training: the search space, the study journal, stale trials, the job array."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from jaxrat.experiments import tune, tune_summary
from jaxrat.experiments.sweep import load_sweep
from jaxrat.runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TOY = "tests/toy/sweep_config.py"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_search_space_is_checked_and_becomes_overrides():
    space = tune.load_search_space(TOY)
    assert space["model.features"]["choices"] == ["(4,8)", "(8,16)"]  # tuples travel as override text
    params = tune.suggest(optuna.trial.FixedTrial({"optimizer.learning_rate": 1e-3, "model.features": "(8,16)"}),
                          space)
    assert tune.to_overrides(params) == ["--config.optimizer.learning_rate=0.001", "--config.model.features=(8,16)"]
    assert set(tune.load_search_space("configs/ablations.py:smoke")) == {
        "optimizer.learning_rate", "optimizer.weight_decay", "model.rat.mlp_dropout"}
    assert tune.objective(TOY, []) == ("eval/dice", "maximize")
    assert tune.objective(TOY, ["--config.checkpoint.best_metric=eval/loss", "--config.checkpoint.best_mode=min"]) \
        == ("eval/loss", "minimize")
    with pytest.raises(ConfigError, match="defines no get_search_space"):
        tune.load_search_space("configs/isic.py:smoke")


def test_bad_ranges_and_keys_name_the_fix(tmp_path):
    def space(text):
        path = tmp_path / "c.py"
        isic = str(REPO / "configs/isic.py")
        path.write_text(f"from jaxrat.config_schema import load_config\n"
                        f"def get_config(arg=None):\n    return load_config({isic!r} + ':smoke')\n"
                        f"def get_search_space(arg=None):\n    return {text}\n")
        return tune.load_search_space(str(path))

    with pytest.raises(ConfigError, match="did you mean --config.optimizer.learning_rate"):
        space("{'optimizer.learningrate': {'type': 'float', 'low': 0.1, 'high': 1.0}}")
    with pytest.raises(ConfigError, match="'low' <= 'high'"):
        space("{'optimizer.learning_rate': {'type': 'float', 'low': 1.0, 'high': 0.1}}")
    with pytest.raises(ConfigError, match="'type' one of"):
        space("{'optimizer.learning_rate': [0.1, 1.0]}")


def test_a_trial_left_running_by_a_dead_worker_is_queued_again_with_its_workdir(tmp_path):
    root = str(tmp_path)
    study = tune.open_study(root, "maximize")
    done = study.ask()
    study.tell(done, 0.5)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = study.ask()
    orphan.suggest_float("optimizer.learning_rate", 1e-4, 1e-2, log=True)
    orphan.set_user_attr("worker", f"{socket.gethostname()}-{dead.pid}")
    orphan.set_user_attr("workdir", "/runs/trial_1")
    mine = study.ask()  # running in this (live) process: left alone
    mine.set_user_attr("worker", f"{socket.gethostname()}-{os.getpid()}")
    assert tune.recover_stale(study, root) == [orphan.number]
    assert tune.recover_stale(study, root) == []
    trials = {t.number: t for t in study.get_trials()}
    assert trials[orphan.number].state == optuna.trial.TrialState.FAIL and trials[orphan.number].user_attrs["replaced"]
    assert trials[mine.number].state == optuna.trial.TrialState.RUNNING
    again = study.ask()
    assert again.user_attrs["workdir"] == "/runs/trial_1" and again.user_attrs["retry_of"] == orphan.number
    assert again.suggest_float("optimizer.learning_rate", 1e-4, 1e-2, log=True) == \
        trials[orphan.number].params["optimizer.learning_rate"]
    assert [t.number for t in tune.counted(tune.open_study(root, "maximize"))] == [0, 2, 3]


def test_the_summary_and_the_best_variant_file(tmp_path, monkeypatch):
    root = str(tmp_path)
    (tmp_path / tune_summary.SETTINGS).write_text(
        '{"config": "%s", "metric": "eval/dice", "common": ["--config.num_train_steps=4"]}' % (REPO / TOY))
    study = tune.open_study(root, "maximize")
    for lr, value in ((1e-3, 0.5), (3e-3, 0.7), (1e-2, 0.6)):
        t = study.ask()
        t.suggest_float("optimizer.learning_rate", 1e-4, 1e-1, log=True)
        t.set_user_attr("overrides", [f"--config.optimizer.learning_rate={lr}"])
        t.report(value - 0.1, 2)
        study.tell(t, value)
    t = study.ask()
    t.report(0.1, 2)
    study.tell(t, state=optuna.trial.TrialState.PRUNED)
    s = tune_summary.write(root)
    assert s["counts"] == {"complete": 3, "pruned": 1} and s["pruned"] == [3]
    assert s["best"]["number"] == 1 and set(s["importances"]) == {"optimizer.learning_rate"}
    md = (tmp_path / "tune_summary.md").read_text()
    assert "pruned: 3" in md and "| 1 | complete | 0.7 | 2 | 0.6 | not started | optimizer.learning_rate=0.003 |" in md
    variants = load_sweep(str(tmp_path / tune_summary.BEST_SWEEP))
    assert [(v.name, v.overrides) for v in variants] == [
        ("best", ("--config.optimizer.learning_rate=0.003", "--config.num_train_steps=4"))]


def test_the_best_variant_file_embeds_a_hostile_root_as_text_not_code(tmp_path):
    # A root (and metric) holding a docstring's closing quotes and a newline, then code: the
    # generated file must carry them as text and run nothing.
    evil = '"""\nimport os; os.mkdir("INJECTED")\n"""'
    root = tmp_path / f"study{evil}"
    root.mkdir()
    (root / tune_summary.SETTINGS).write_text(json.dumps({"config": str(REPO / TOY), "metric": f"eval/dice{evil}"}))
    study = tune.open_study(str(root), "maximize")
    t = study.ask()
    t.set_user_attr("overrides", ["--config.optimizer.learning_rate=0.01"])
    study.tell(t, 0.5)
    tune_summary.write(str(root))
    text = (root / tune_summary.BEST_SWEEP).read_text()
    module = __import__("ast").parse(text)
    assert [type(n).__name__ for n in module.body] == ["Expr", "ImportFrom", "Assign", "Assign", "FunctionDef",
                                                       "FunctionDef"]
    doc = __import__("ast").get_docstring(module)
    assert str(root) in doc and f"eval/dice{evil}" in doc
    variants = load_sweep(str(root / tune_summary.BEST_SWEEP))
    assert [v.overrides for v in variants] == [("--config.optimizer.learning_rate=0.01",)]
    assert not (tmp_path / "INJECTED").exists() and not (REPO / "INJECTED").exists()


def test_slurm_dry_run_is_an_array_of_workers_on_one_study(tmp_path, capsys):
    from jaxrat.cli import tune as cli

    assert cli.main(["--config", TOY, "--root", str(tmp_path), "--trials", "6", "--slurm", "--workers", "2",
                     "--dry-run", "--config.train.eval_every=1"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1\n" in out and "-m jaxrat.tune" in out
    assert "VARIANT=worker-1; VARIANT_ARGS=(--trials=6 --seed=0)" in out
    assert "--config.train.eval_every=1" in out


def test_workers_started_together_draw_different_parameters_and_a_rerun_the_same():
    """Two array elements with one --seed drew identical overrides before the worker's index went
    into the sampler's seed (seen on the local SLURM cluster: trials 0/1 and 2/3 were twins)."""
    import optuna

    from jaxrat.experiments.tune import sampler_for

    def first(worker_index, trials_before=0):
        study = optuna.create_study(sampler=sampler_for(0, worker_index, trials_before))
        return study.ask().suggest_float("lr", 1e-5, 1e-1, log=True)

    assert first(0) == first(0)
    assert len({first(0), first(1), first(2), first(0, trials_before=4)}) == 4


@pytest.mark.parametrize("end, interrupted", [("os.kill(os.getpid(), signal.SIGTERM)", True), ("sys.exit(42)", True),
                                              ("sys.exit(130)", True), ("sys.exit(1)", False)])
def test_a_trial_stopped_from_outside_is_interrupted_and_one_that_fails_is_failed(tmp_path, end, interrupted):
    """scancel sends SIGTERM to the worker and its trial alike; the trial may die (or save and exit
    42) before the worker's handler runs. That is a preemption to resume, not a failed trial."""
    import optuna

    from jaxrat.experiments.tune import Interrupted, run_trial

    trial = optuna.create_study().ask()
    cmd = [sys.executable, "-c", f"import os, signal, sys\n{end}"]
    if interrupted:
        with pytest.raises(Interrupted):
            run_trial(trial, cmd, str(tmp_path / "t"), "eval/dice")
    else:
        assert run_trial(trial, cmd, str(tmp_path / "t"), "eval/dice") == ("failed", None)


def _fake_trials(monkeypatch, calls):
    """``run_trial`` replaced by one that scores a trial by its learning rate (no training)."""
    def fake(trial, cmd, workdir, metric, env=None, stop=None):
        calls.append((trial.number, workdir))
        return "complete", trial.params["optimizer.learning_rate"]
    monkeypatch.setattr(tune, "run_trial", fake)


def test_a_tuner_killed_in_its_last_trial_runs_the_retry_and_names_the_true_best(tmp_path, monkeypatch):
    """Kill -9 in the last of 4 trials: the retry queued for it counted towards --trials, so every
    rerun stopped at once ("2 complete, 1 pruned, 1 waiting") and named a worse trial the best."""
    root = str(tmp_path)
    study = tune.open_study(root, "maximize")
    space = tune.load_search_space(TOY)
    for lr, state in ((1e-3, "complete"), (1e-5, "pruned"), (2e-3, "complete")):
        study.enqueue_trial({"optimizer.learning_rate": lr, "model.features": "(4,8)"})
        t = study.ask()
        tune.suggest(t, space)
        if state == "complete":
            study.tell(t, lr)
        else:
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study.enqueue_trial({"optimizer.learning_rate": 2e-2, "model.features": "(8,16)"})
    last = study.ask()
    tune.suggest(last, space)
    last.set_user_attr("worker", f"{socket.gethostname()}-{dead.pid}")
    last.set_user_attr("workdir", str(tmp_path / "trials" / "trial_3"))
    calls = []
    _fake_trials(monkeypatch, calls)
    for _ in range(2):  # the first rerun runs the retry; a second one has nothing left to do
        assert tune.run_worker(TOY, root, 4) == 0
    assert calls == [(4, str(tmp_path / "trials" / "trial_3"))]
    s = tune_summary.write(root)
    assert s["counts"] == {"complete": 3, "pruned": 1}
    assert s["best"]["number"] == 4 and s["best"]["value"] == 2e-2


@pytest.mark.parametrize("crowded", [False, True])
def test_several_workers_run_exactly_the_trials_asked_for_and_no_retry_is_left(tmp_path, monkeypatch, crowded):
    """``crowded``: the moment that made the plain case fail about once in 70 runs, held open: trial 2's
    retry is queued a second after trial 2 is marked replaced, and the first worker to see a queued
    retry waits while another takes it, then asks for a fresh trial in that moment."""
    import threading
    import time

    root = str(tmp_path)
    study = tune.open_study(root, "maximize")
    study.tell(study.ask(), 0.1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for n in range(2):  # two trials left running by a dead worker: both are retried
        study.enqueue_trial({"optimizer.learning_rate": 1e-3 * (n + 1), "model.features": "(4,8)"})
        t = study.ask()
        tune.suggest(t, tune.load_search_space(TOY))
        t.set_user_attr("worker", f"{socket.gethostname()}-{dead.pid}")
    calls = []
    _fake_trials(monkeypatch, calls)
    if crowded:
        enqueue, queued, first = optuna.study.Study.enqueue_trial, tune.queued, threading.Lock()

        def late_enqueue(self, params, user_attrs=None, **kw):
            if (user_attrs or {}).get("retry_of") == 2:
                time.sleep(1.0)
            return enqueue(self, params, user_attrs=user_attrs, **kw)

        def slow_queued(study):
            out = queued(study)
            if out and first.acquire(blocking=False):
                time.sleep(0.4)
            return out

        monkeypatch.setattr(optuna.study.Study, "enqueue_trial", late_enqueue)
        monkeypatch.setattr(tune, "queued", slow_queued)
    statuses = []
    workers = [threading.Thread(target=lambda i=i: statuses.append(tune.run_worker(TOY, root, 3, worker_index=i)))
               for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert statuses == [0, 0, 0]
    trials = tune_summary.load_study(root).get_trials(deepcopy=False)
    assert all(t.state.is_finished() for t in trials)
    assert len(tune.counted(tune_summary.load_study(root))) == 3
    retried = {t.number: t.user_attrs["retry_of"] for t in trials if t.user_attrs.get("retry_of") is not None}
    dump = [(t.number, str(t.state), {k: v for k, v in t.user_attrs.items() if k != "overrides"}) for t in trials]
    assert sorted(retried.values()) == [1, 2], dump
    # both retries ran, each once, and nothing else did. Their numbers vary: a worker that asks for a fresh
    # trial between the marking of trial 2 as replaced and the queueing of its retry (trial 2 still counts
    # then) finds no place left and yields it (replaced, failed, no parameters), so the retry is trial 5.
    assert sorted(n for n, _ in calls) == sorted(retried), (calls, dump)
    yielded = [t for t in trials if t.number > 2 and t.number not in retried]
    assert all(t.user_attrs.get(tune.REPLACED) and not t.params and t.state == optuna.trial.TrialState.FAIL
               for t in yielded), dump


def test_a_trial_whose_worker_died_before_naming_itself_is_retried_once_old(tmp_path, monkeypatch):
    root = str(tmp_path)
    study = tune.open_study(root, "maximize")
    nameless = study.ask()  # the worker was killed between ask() and set_user_attr("worker")
    (tmp_path / tune.WORKERS_DIR).mkdir()
    (tmp_path / tune.WORKERS_DIR / f"{socket.gethostname()}-{os.getpid()}").touch()  # another live worker
    assert tune.recover_stale(study, root) == []  # young: that worker may be naming itself right now
    monkeypatch.setattr(tune, "STALE_S", 0.0)
    assert tune.recover_stale(study, root) == [nameless.number]


def test_a_nameless_trial_no_live_worker_can_claim_is_retried_at_once(tmp_path):
    """Waiting two minutes for it, the rerun of a tuner killed between ask() and naming itself
    counted the orphan, ran one trial too few and ended with it RUNNING."""
    root = str(tmp_path)
    study = tune.open_study(root, "maximize")
    nameless = study.ask()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / tune.WORKERS_DIR).mkdir()
    (tmp_path / tune.WORKERS_DIR / f"{socket.gethostname()}-{dead.pid}").touch()  # the killed tuner's
    me = f"{socket.gethostname()}-{os.getpid()}"
    (tmp_path / tune.WORKERS_DIR / me).touch()
    assert tune.recover_stale(study, root, me) == [nameless.number]
    retry = study.ask()
    assert retry.user_attrs["retry_of"] == nameless.number


def test_summarize_on_a_root_that_is_not_a_search_is_one_sentence_and_writes_nothing(tmp_path):
    for root in (tmp_path, tmp_path / "missing"):
        proc = subprocess.run([sys.executable, "-m", "jaxrat.tune", "--summarize", "--root", str(root)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "pass the --root of a python -m jaxrat.tune search" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []  # no empty journal left behind


def test_a_tuner_stopped_and_rerun_draws_the_parameters_of_the_undisturbed_search(tmp_path, monkeypatch):
    """The sampler was seeded once per worker start, from the trials the study held: after a kill,
    the trials after the retry drew other parameters than an undisturbed search, and the rerun
    named another best trial."""
    def params(root):
        trials = tune_summary.load_study(root).get_trials(deepcopy=False)
        return [t.params for t in trials if not t.user_attrs.get(tune.REPLACED)]

    _fake_trials(monkeypatch, [])
    assert tune.run_worker(TOY, str(tmp_path / "a"), 5) == 0
    real = tune.run_trial
    stopped = []

    def stop_once(trial, cmd, workdir, metric, env=None, stop=None):
        if trial.number == 2 and not stopped:  # as if the tuner died in the third trial
            stopped.append(trial.number)
            raise tune.Interrupted()
        return real(trial, cmd, workdir, metric, env, stop)

    monkeypatch.setattr(tune, "run_trial", stop_once)
    assert tune.run_worker(TOY, str(tmp_path / "b"), 5) == 0  # Interrupted: the worker stops there
    assert tune.run_worker(TOY, str(tmp_path / "b"), 5) == 0
    assert stopped == [2] and params(str(tmp_path / "b")) == params(str(tmp_path / "a"))
    assert tune_summary.write(str(tmp_path / "b"))["best"]["params"] == \
        tune_summary.write(str(tmp_path / "a"))["best"]["params"]


def test_a_trial_is_pruned_at_its_first_bad_evaluation_however_fast_it_ran(tmp_path):
    """A run that had ended before the tuner read its metrics was never pruned, and a pruned
    trial's value was whichever row was read last: the table depended on the tuner's timing."""
    import optuna

    from jaxrat.experiments.tune import run_trial

    study = optuna.create_study(direction="minimize",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    good = study.ask()
    for step in (1, 2, 3):
        good.report(0.1, step)
    study.tell(good, 0.1)
    trial = study.ask()
    workdir = tmp_path / "t"
    rows = "".join(json.dumps({"step": s, "eval/loss": v}) + "\n" for s, v in ((1, 0.9), (2, 0.8), (3, 0.05)))
    cmd = [sys.executable, "-c", f"open({str(workdir / 'metrics.jsonl')!r}, 'w').write({rows!r})"]
    assert run_trial(trial, cmd, str(workdir), "eval/loss") == ("pruned", 0.9)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    assert study.trials[1].intermediate_values == {1: 0.9} and study.trials[1].value == 0.9


def test_a_replaced_trial_counts_until_its_retry_is_queued(tmp_path):
    """Between marking a trial replaced and queueing its retry (two journal writes), another worker
    counted one trial too few and started a fresh one: three workers ended with four trials of three."""
    study = tune.open_study(str(tmp_path), "maximize")
    study.tell(study.ask(), 0.1)
    lost = study.ask()
    tune.suggest(lost, tune.load_search_space(TOY))
    study._storage.set_trial_user_attr(lost._trial_id, tune.REPLACED, True)
    study.tell(lost, state=optuna.trial.TrialState.FAIL)
    assert [t.number for t in tune.counted(study)] == [0, 1]  # its retry is not queued yet
    study.enqueue_trial(lost.params, user_attrs={"workdir": "", "retry_of": lost.number})
    assert [t.number for t in tune.counted(study)] == [0, 2]
    late = study.ask()  # the retry
    yielded = study.ask()  # asked for a place the others had filled: it yields, with no parameters
    study._storage.set_trial_user_attr(yielded._trial_id, tune.REPLACED, True)
    study.tell(yielded, state=optuna.trial.TrialState.FAIL)
    assert [t.number for t in tune.counted(study)] == [0, late.number]


def test_config_names_are_taken_from_any_folder(tmp_path, monkeypatch, capsys):
    """``--config ablations:smoke`` is a packaged config's name, not a file in the current folder:
    the search space loads and the job array's CONFIG stays the name."""
    from jaxrat.cli import tune as cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", "ablations:smoke", "--root", str(tmp_path / "search"), "--trials", "2", "--slurm",
                     "--dry-run"]) == 0
    assert "\nCONFIG=ablations:smoke\n" in capsys.readouterr().out
    assert json.loads((tmp_path / "search" / tune_summary.SETTINGS).read_text())["config"] == "ablations:smoke"


def test_without_optuna_one_sentence_names_the_extra_and_nothing_is_written(tmp_path, monkeypatch):
    code = ("import sys; sys.modules['optuna'] = None; from jaxrat.cli import tune; "
            f"sys.exit(tune.main(['--config', {TOY!r}, '--root', {str(tmp_path / 'search')!r}, '--trials', '2']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "needs Optuna" in said[0] and "pip install -e '.[tune]'" in said[0], proc.stderr
    assert os.listdir(tmp_path) == []

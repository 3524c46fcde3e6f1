"""Sweeps without training: get_sweep() parsing and checks, finished/unfinished workdirs, job-array
scripts (SLURM and LSF, run with fake srun/blaunch), the CLI's dry runs, and the summary table."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrat.cluster.jobscript import JobSpec, index_ranges, render
from jaxrat.config_schema import flatten, load_config
from jaxrat.experiments import summary, sweep
from jaxrat.runtime.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]
TOY = "tests/toy/sweep_config.py"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # config paths are relative to the repository root


# ------------------------------------------------------------------------------------ get_sweep

def test_both_forms_and_override_spellings_parse_alike():
    as_dict = sweep.parse_sweep({"a": [], "b": ["--config.x.y=1", "z=true"], "c": {"m.s": (8, 16), "m.t": True}})
    as_list = sweep.parse_sweep([("a", []), ("b", ("--config.x.y=1", "--config.z=true")),
                                 ("c", ["--config.m.s=(8,16)", "--config.m.t=true"])])
    assert as_dict == as_list
    assert as_dict[2] == sweep.Variant("c", ("--config.m.s=(8,16)", "--config.m.t=true"))
    assert sweep.parse_sweep({"one": {"m.s": (4,)}})[0].overrides == ("--config.m.s=(4,)",)


@pytest.mark.parametrize("raw, needle", [
    ("abc", "returned str; return"),
    ([("a", [], "extra")], "returned list; return"),
    ({}, "no variants"),
    ({"my run": []}, "cannot name a workdir"),
    ({"../up": []}, "cannot name a workdir"),
    ([("a", []), ("a", [])], "twice"),
    ({"a": ["--config.lr"]}, "is not an override"),
    ({"a": ["--lr=1"]}, "is not an override"),
    ({"a": [3]}, "is not an override"),
    ({"a": "--config.x=1"}, "must be a list"),
])
def test_malformed_sweeps_fail_with_a_sentence(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        sweep.parse_sweep(raw)


@pytest.mark.parametrize("arg", ["", ":demo", ":smoke"])
def test_the_ablation_study_covers_five_axes_with_real_keys(arg):
    variants = sweep.load_sweep(f"configs/ablations.py{arg}")  # checks every key and value type
    keys = {o.partition("=")[0].removeprefix("--config.") for v in variants for o in v.overrides}
    baselines = {"": ["unet", "transunet", "swin_unet"], ":demo": ["transunet", "swin_unet"], ":smoke": []}[arg]
    rat_keys = {"model.rat.positional_encoding", "model.rat.attention", "model.rat.mr_attention",
                "model.rat.scales", "model.rat.num_blocks", "model.rat.feature_dims"}
    assert keys == rat_keys | ({"--config"} if baselines else set())
    assert variants[0] == sweep.Variant("baseline", ())
    assert len({v.name for v in variants}) == len(variants) == 12 + len(baselines)
    # the study's other models train their own configs/isic.py variant, with the same data and schedule
    suffix = "_demo" if arg == ":demo" else ""
    for v in variants[12:]:
        config, rest = sweep.own_config(f"configs/ablations.py{arg}", v.overrides)
        assert config.endswith(f"configs/isic.py:{v.name}{suffix}") and rest == []
        assert load_config(config).model.name == v.name


@pytest.mark.parametrize("arg", ["", ":demo"])
def test_every_ablation_variant_changes_its_base(arg):
    # A variant equal to the base (e.g. attn_sparse once isic.py itself trains sparse SGA) would
    # silently train the baseline twice under another name.
    base = flatten(load_config(f"configs/ablations.py{arg}"))
    assert base["model.rat.attention"] == "dense"  # the study's base is the reference's SGA
    for v in sweep.load_sweep(f"configs/ablations.py{arg}")[1:12]:  # the RAT's variants, not the baselines
        pairs = [o.removeprefix("--config.").split("=", 1) for o in v.overrides]
        assert any(str(base[k]).replace(" ", "") != val.replace(" ", "") for k, val in pairs), v


def test_unknown_keys_missing_get_sweep_and_unknown_names_are_refused(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(Path(TOY).read_text().replace('"--config.optimizer.learning_rate=0.01"', '"--config.optimizer.lr=1"')
                   .replace('ISIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",',
                            f'ISIC = os.path.join("{REPO}",'))
    with pytest.raises(ConfigError, match="Unknown config key --config.optimizer.lr; did you mean"):
        sweep.load_sweep(str(bad))
    with pytest.raises(ConfigError, match="is not an integer"):
        sweep.load_sweep(TOY, ["--config.num_train_steps=many"])
    with pytest.raises(ConfigError, match="defines no get_sweep"):
        sweep.load_sweep("configs/isic.py:smoke")
    with pytest.raises(ConfigError, match="--only nope: no such variant; this sweep has base, lr_high, wide"):
        sweep.select(sweep.load_sweep(TOY), ["nope"])
    assert [v.name for v in sweep.select(sweep.load_sweep(TOY), ["wide", "base"])] == ["base", "wide"]


# ---------------------------------------------------------------------------------- run states

def fake_checkpoint(workdir: Path, step: int, eval_pending: bool = False, committed: bool = True) -> None:
    d = workdir / "checkpoints" / str(step)
    d.mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"custom_metadata": {"eval_pending": eval_pending}}))
    if committed:
        (d / "commit_success.txt").write_text("")


def test_finished_means_the_final_step_committed_and_evaluated(tmp_path):
    assert sweep.run_state(str(tmp_path / "new"), 6).describe() == "not started"
    fake_checkpoint(tmp_path / "half", 3)
    fake_checkpoint(tmp_path / "half", 6, committed=False)  # a save cut short counts for nothing
    assert sweep.run_state(str(tmp_path / "half"), 6).describe() == "at step 3 of 6"
    fake_checkpoint(tmp_path / "pending", 6, eval_pending=True)  # preempted during the final eval
    assert not sweep.run_state(str(tmp_path / "pending"), 6).finished
    fake_checkpoint(tmp_path / "done", 6)
    assert sweep.run_state(str(tmp_path / "done"), 6).finished
    assert not sweep.run_state(str(tmp_path / "done"), 10).finished  # asked for more steps: resume
    assert sweep.target_steps(TOY, ["--config.num_train_steps=9", "--config.num_train_steps=10"]) == 10
    assert sweep.target_steps(TOY, []) == 4


def test_local_dry_run_skips_finished_and_says_what_resumes(tmp_path, capsys):
    fake_checkpoint(tmp_path / "base", 4)
    fake_checkpoint(tmp_path / "lr_high", 2)
    assert sweep.run_local(TOY, str(tmp_path), sweep.load_sweep(TOY), ["--config.seed=1"], dry_run=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sweep [1/3] base: finished (step 4), skipped"
    assert out[1].startswith("sweep [2/3] lr_high: would resume at step 2 of 4: ")
    assert out[1].endswith(f"--workdir={tmp_path}/lr_high --config.optimizer.learning_rate=0.01 --config.seed=1")
    assert out[2].startswith("sweep [3/3] wide: would train: ") and "'--config.model.features=(8,16)'" in out[2]
    assert not (tmp_path / "wide").exists()


# ------------------------------------------------------------------------------- job-array scripts

VARIANTS = (("base", ()), ("lr_high", ("--config.optimizer.learning_rate=0.01",)),
            ("wide", ("--config.model.features=(8,16)",)))


def array_script(tmp_path: Path, scheduler: str, **kw) -> str:
    spec = JobSpec(config=TOY, workdir=str(tmp_path / "root"), job_name="abl", cache_dir=str(tmp_path / "cache"),
                   extra_args=("--config.seed=3",), array=VARIANTS, **kw)
    return render(spec, scheduler)


def fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text("#!/bin/sh\n" + body)
    (bindir / name).chmod(0o755)
    return bindir


def run_element(tmp_path: Path, script: str, env: dict[str, str], status: int = 0) -> subprocess.CompletedProcess:
    """Run the job script with fake launchers that record their arguments, one per line."""
    (tmp_path / "job.sh").write_text(script)
    record = 'for a in "$@"; do echo "$a"; done > ' + str(tmp_path / "args") + '\nexit "$FAKE_STATUS"\n'
    bindir = fake_bin(tmp_path, "srun", record)
    fake_bin(tmp_path, "blaunch", record)
    fake_bin(tmp_path, "scontrol", f'echo "$@" >> {tmp_path / "requeues"}\n')
    fake_bin(tmp_path, "brequeue", f'echo "$@" >> {tmp_path / "requeues"}\n')
    return subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "FAKE_STATUS": str(status), **env})


def test_index_ranges():
    assert index_ranges((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert index_ranges((2, 0), offset=1) == "1,3"


def test_slurm_array_element_runs_its_variant_in_its_workdir(tmp_path):
    text = array_script(tmp_path, "slurm", array_indices=(0, 2), array_parallel=2)
    root = tmp_path / "root"
    assert "#SBATCH --array=0,2%2\n" in text and "#SBATCH --output=abl-%A_%a.out\n" in text
    assert "#SBATCH --requeue\n" in text and "#SBATCH --job-name=abl\n" in text
    proc = run_element(tmp_path, text, {"SLURM_JOB_ID": "91", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_NODELIST": "vm"},
                       status=42)
    assert proc.returncode == 42, proc.stdout + proc.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[-4:] == ["--config=" + TOY, f"--workdir={root}/wide", "--config.model.features=(8,16)",
                         "--config.seed=3"]
    assert "jaxrat: variant wide (array element 2)" in proc.stdout
    assert (tmp_path / "requeues").read_text() == "requeue 91\n"  # this element's own job id
    assert (root / "wide").is_dir() and (tmp_path / "cache").is_dir()
    run_element(tmp_path, text, {"SLURM_JOB_ID": "92", "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_NODELIST": "vm"})
    assert (tmp_path / "args").read_text().splitlines()[-3:] == ["--config=" + TOY, f"--workdir={root}/base",
                                                                 "--config.seed=3"]
    bad = run_element(tmp_path, text, {"SLURM_JOB_ID": "93", "SLURM_ARRAY_TASK_ID": "7", "SLURM_JOB_NODELIST": "vm"})
    assert bad.returncode == 2 and "SLURM_ARRAY_TASK_ID=7 names no variant of this sweep" in bad.stdout


def test_lsf_array_is_one_based_and_requeues_one_element(tmp_path):
    text = array_script(tmp_path, "lsf", array_indices=(1, 2))
    root = tmp_path / "root"
    assert '#BSUB -J "abl[2-3]"\n' in text and f"#BSUB -o {root}/lsf-%J_%I.out\n" in text
    env = {"LSB_JOBID": "55", "LSB_JOBINDEX": "2", "LSB_MCPU_HOSTS": "vm 1", "LSB_DJOB_HOSTFILE": "/dev/null"}
    proc = run_element(tmp_path, text, env, status=42)
    assert proc.returncode == 42, proc.stdout + proc.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[-4:] == ["--config=" + TOY, f"--workdir={root}/lr_high", "--config.optimizer.learning_rate=0.01",
                         "--config.seed=3"]
    assert (tmp_path / "requeues").read_text() == "55[2]\n"  # not the whole array


def test_single_job_scripts_have_no_array_lines():
    text = render(JobSpec(config=TOY, workdir="/w"), "slurm")
    assert "--array" not in text and "VARIANT" not in text and "--output=jaxrat-sweep_config-%j.out" in text


def test_cli_dry_run_submits_only_unfinished_variants(tmp_path, capsys):
    from jaxrat.cli import sweep as cli

    root = tmp_path / "root"
    fake_checkpoint(root / "lr_high", 4)
    argv = ["--config", TOY, "--root", str(root), "--slurm", "--dry-run", "--job-name", "abl", "--time", "00:20:00",
            "--config.data.num_threads=1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --array=0,2\n" in out and "#SBATCH --time=00:20:00\n" in out
    generated = out.splitlines()[1]
    assert generated.startswith("# Generated by: python -m jaxrat.sweep --config tests/toy/sweep_config.py --root ")
    assert "--dry-run" not in generated
    assert " --config.data.num_threads=1 &" in out
    assert "lr_high: finished" in err and "wide: not started, submitting" in err
    assert not (root / "sweep.sbatch").exists()
    fake_checkpoint(root / "base", 4)
    fake_checkpoint(root / "wide", 4)
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "" and "all 3 variants are finished" in err


def test_cli_mistakes_end_in_one_sentence(tmp_path):
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "jaxrat.sweep", *argv], capture_output=True, text=True,
                              timeout=60, cwd=REPO)

    proc = run("--config", TOY, "--root", str(tmp_path), "--only", "base,nope", "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "jaxrat: error: --only nope: no such variant; this sweep has base, lr_high, wide."]
    proc = run("--config", TOY, "--root", str(tmp_path), "--dry-run", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    proc = run("--summarize", "--root", str(tmp_path / "none"))
    assert proc.returncode == 2 and "is not a folder" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ summary

def fake_run(root: Path, name: str, rows: list[dict], total: int = 4, best: str = "eval/dice", mode: str = "max",
             done: bool = True) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_train_steps": total,
                                               "checkpoint": {"best_metric": best, "best_mode": mode}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"time": 0.0, **r}) + "\n" for r in rows))
    fake_checkpoint(d, total if done else 2)


def test_summary_table_of_fake_runs(tmp_path):
    root = tmp_path / "sweep"
    fake_run(root, "b_run", [{"step": 1, "train/loss": 0.9}, {"step": 2, "eval/dice": 0.5, "eval/iou": 0.3},
                             {"step": 4, "train/loss": 0.7}, {"step": 4, "eval/dice": 0.4, "eval/iou": 0.35}])
    # Resumed after step 2: steps 3-4 are logged twice; the newest line counts. The last line was cut short.
    fake_run(root, "a_run", [{"step": 2, "eval/dice": 0.6, "eval/iou": 0.4}, {"step": 3, "eval/dice": 0.1},
                             {"step": 3, "eval/dice": 0.7, "eval/iou": 0.5}, {"step": 4, "train/loss": 0.5}])
    with open(root / "a_run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "eval/di')
    fake_run(root, "c_partial", [{"step": 2, "eval/dice": 0.2, "eval/iou": 0.1}], done=False)
    (root / "not_a_run").mkdir()
    sweep.write_manifest(str(root), TOY, [sweep.Variant("b_run", ("--config.seed=2",)), sweep.Variant("a_run", ())],
                         [])
    text = summary.report(str(root))
    header, rows = summary.table(summary.collect(str(root)))
    assert header == ["run", "state", "step", "eval step", "eval/dice", "eval/iou", "best eval/dice (max)",
                      "best eval/dice step", "train/loss", "overrides"]
    assert rows == [["b_run", "finished", 4, 4, 0.4, 0.35, 0.5, 2, 0.7, "seed=2"],  # sweep order first
                    ["a_run", "finished", 4, 3, 0.7, 0.5, 0.7, 3, 0.5, ""],
                    ["c_partial", "stopped at step 2 of 4", 2, 2, 0.2, 0.1, 0.2, 2, None, ""]]
    md = (root / "summary.md").read_text()
    assert md in text and "| b_run | finished | 4 | 4 | 0.4000 | 0.3500 | 0.5000 | 2 | 0.7000 | seed=2 |" in md
    table = list(csv.reader(io.StringIO((root / "summary.csv").read_text())))
    assert table[0] == header and table[3] == ["c_partial", "stopped at step 2 of 4", "2", "2", "0.2", "0.1", "0.2",
                                               "2", "", ""]
    assert (root / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wide_table_shows_the_chosen_columns_and_keeps_the_rest_in_the_csv(tmp_path):
    names = ("background", "disc", "square")
    row = {"step": 4, "eval/dice": 0.8, "eval/iou": 0.7, "eval/dice_all": 0.85, "eval/iou_all": 0.75,
           "eval/pixel_accuracy": 0.9, "eval/loss": 0.3, "eval/num_images": 8.0,
           **{f"eval/{m}/{c}": 0.5 for c in names for m in ("dice", "iou")}}
    fake_run(tmp_path, "a", [{"step": 4, "train/loss": 0.4}, row])
    fake_run(tmp_path, "b", [{"step": 4, "train/loss": 0.5}, row])
    text = summary.report(str(tmp_path))
    full = next(csv.reader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert len(full) == 21
    shown = (tmp_path / "summary.md").read_text().splitlines()[0].strip("| ").split(" | ")
    assert len(shown) == summary.MAX_COLUMNS and shown[:5] == ["run", "state", "step", "eval step", "eval/dice"]
    assert "best eval/dice (max)" in shown and "overrides" in shown and "eval/dice/background" not in shown
    assert "11 more columns in summary.csv: eval/dice_all," in text


def test_min_mode_best_and_plot_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    losses = [{"step": 1, "eval/loss": 0.5}, {"step": 2, "eval/loss": 0.3}, {"step": 3, "eval/loss": 0.4}]
    fake_run(tmp_path, "r", losses, total=3, best="eval/loss", mode="min")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    runs = summary.write_summary(str(tmp_path))
    assert runs[0].best == (2, 0.3) and "best eval/loss (min)" in summary.table(runs)[0]
    assert not (tmp_path / "summary.png").exists() and "matplotlib is not installed" in caplog.text


def test_summary_of_an_empty_folder_says_so(tmp_path):
    with pytest.raises(UserError, match="holds no runs"):
        summary.report(str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_summary_of_a_run_workdir_refuses_without_touching_its_summary(tmp_path):
    fake_run(tmp_path, "run", [{"step": 4, "train/loss": 0.4}])
    workdir = tmp_path / "run"
    (workdir / "summary.md").write_text("the run's own results\n")
    before = sorted(p.name for p in workdir.iterdir())
    with pytest.raises(UserError, match=r"is one run's workdir, not a sweep's root .* \(the --root given to jaxrat "
                                        r"sweep\)\.$"):
        summary.report(str(workdir))
    assert (workdir / "summary.md").read_text() == "the run's own results\n"
    assert sorted(p.name for p in workdir.iterdir()) == before  # no summary.csv/png written


FAKE_TRAINER = """#!/bin/bash
# Stands in for `python -m jaxrat.main`: fails for variant base, waits for SIGTERM (exit 42) for lr_high.
workdir=$(printf '%s\\n' "$@" | sed -n 's/^--workdir=//p')
mkdir -p "$workdir"
case "$workdir" in
  */base) exit 1 ;;
  */lr_high) trap 'echo term > "$workdir/got"; exit 42' TERM; touch "$workdir/started"
             for i in $(seq 600); do sleep 0.1; done; exit 0 ;;
esac
"""


def test_local_sweep_goes_on_after_a_failure_and_stops_when_terminated(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAINER)
    fake.chmod(0o755)
    root = tmp_path / "root"
    code = ("import sys; from jaxrat.experiments import sweep as s; "
            f"sys.exit(s.run_local({TOY!r}, {str(root)!r}, s.load_sweep({TOY!r}), python={str(fake)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (root / "lr_high" / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # as a scheduler preempting the sweep would
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 42, out
    assert "sweep [1/3] base: ended with status 1" in out  # the failure did not stop the sweep
    assert (root / "lr_high" / "got").read_text() == "term\n"  # passed on to the run
    assert "sweep [2/3] lr_high: ended with status 42" in out and "sweep: stopped" in out
    assert not (root / "wide").exists()


def test_a_killed_sweep_stops_its_training(tmp_path):
    """kill -9 of the sweep left its training running (no parent-death signal): the rerun found the
    workdir locked and counted the variant as failed."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAINER)
    fake.chmod(0o755)
    root = tmp_path / "root"
    code = ("import sys; from jaxrat.experiments import sweep as s; "
            f"sys.exit(s.run_local({TOY!r}, {str(root)!r}, s.load_sweep({TOY!r}), python={str(fake)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (root / "lr_high" / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 30
        while not (root / "lr_high" / "got").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
    assert (root / "lr_high" / "got").read_text() == "term\n"  # told to checkpoint and stop


def test_a_rerun_waits_for_the_run_still_stopping_in_its_workdir(tmp_path, capsys):
    import json
    import socket

    from jaxrat.experiments.sweep import wait_for_stopping_run

    stopping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": stopping.pid, "token": "t"}))
    (tmp_path / "run.lock.stopping").write_text(json.dumps({"token": "t"}))  # it was told to stop
    t0 = time.monotonic()
    wait_for_stopping_run(str(tmp_path), "sweep [1/1] base", wait_s=60)
    assert stopping.poll() is not None or stopping.wait(5) == 0
    assert time.monotonic() - t0 < 30
    assert f"held by process {stopping.pid}, a run still stopping" in capsys.readouterr().out
    t0 = time.monotonic()
    wait_for_stopping_run(str(tmp_path), "sweep [1/1] base", wait_s=60)  # its holder is gone: the run takes over
    assert time.monotonic() - t0 < 1


def _held_by(workdir, proc, stopping):
    import json
    import socket

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": proc.pid, "token": "t"}))
    if stopping:
        (workdir / "run.lock.stopping").write_text(json.dumps({"token": "t"}))


def test_a_rerun_tells_a_training_run_from_a_stopping_one_by_its_heartbeat(tmp_path, capsys):
    from jaxrat.experiments.sweep import MARK_GRACE_S, wait_for_stopping_run

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _held_by(tmp_path, live, stopping=False)  # training: reported at once, never waited for
        t0 = time.monotonic()
        assert wait_for_stopping_run(str(tmp_path), "sweep [1/1] base", wait_s=30) == live.pid
        assert time.monotonic() - t0 < MARK_GRACE_S + 5 and "still stopping" not in capsys.readouterr().out
        _held_by(tmp_path, live, stopping=True)  # stopping, but its heartbeat stopped long ago: not waited for
        old = time.time() - 3600
        os.utime(tmp_path / "run.lock", (old, old))
        t0 = time.monotonic()
        assert wait_for_stopping_run(str(tmp_path), "sweep [1/1] base", wait_s=30) is None
        assert time.monotonic() - t0 < 5
    finally:
        live.kill()
        live.wait()


def test_a_run_told_to_stop_says_so_beside_its_lock_until_it_releases_it(tmp_path):
    import threading

    from jaxrat.experiments.status import holder_stopping
    from jaxrat.trainer.workdir_lock import WorkdirLock

    told = threading.Event()
    lock = WorkdirLock(str(tmp_path), lease_s=60, stopping=told.is_set)
    lock.acquire()
    try:
        time.sleep(1.0)
        assert not holder_stopping(str(tmp_path))
        told.set()
        deadline = time.monotonic() + 5
        while not holder_stopping(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holder_stopping(str(tmp_path))
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_a_sweep_skips_a_variant_another_process_trains_without_calling_it_failed(tmp_path, capsys):
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    root = tmp_path / "root"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _held_by(root / "base", live, stopping=False)
        status = sweep.run_local(TOY, str(root), sweep.load_sweep(TOY), python=str(fake))
    finally:
        live.kill()
        live.wait()
    out = capsys.readouterr().out
    assert status == 1
    assert f"is being trained by process {live.pid} on this host; skipped (not counted as failed)" in out
    assert "variants failed" not in out and "1 of 3 variants are being trained by another process (base)" in out


def test_a_variant_may_train_another_config_file_locally_and_in_a_job_array(tmp_path, capsys):
    """The study's baselines (configs/ablations.py's transunet, swin_unet) train their own configs/isic.py
    variant: the command names that file once, the target step count is its own, and a job array's
    element runs it."""
    from jaxrat.cli import sweep as cli

    cmd = sweep.train_command("configs/ablations.py:demo", "/w",
                              ["--config=configs/isic.py:transunet_demo", "--config.seed=1"], python="py")
    assert cmd == ["py", "-m", "jaxrat.main", "--config=configs/isic.py:transunet_demo", "--workdir=/w",
                   "--config.seed=1"]
    assert sweep.target_steps("configs/ablations.py:smoke", ["--config=configs/isic.py:transunet_demo"]) == 400
    assert sweep.target_steps("configs/ablations.py:smoke", []) == 6
    root = tmp_path / "root"
    argv = ["--config", "configs/ablations.py:demo", "--root", str(root), "--slurm", "--dry-run", "--only",
            "baseline,swin_unet", "--time", "00:20:00"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "  0) VARIANT=baseline; VARIANT_CONFIG=ablations:demo; VARIANT_ARGS=() ;;" in out
    # the variant's own packaged config by name, as the sweep's is: the script runs from any folder
    assert "VARIANT=swin_unet; VARIANT_CONFIG=isic:swin_unet_demo; VARIANT_ARGS=() ;;" in out
    assert 'CONFIG="$VARIANT_CONFIG"' in out and '--config="$CONFIG"' in out
    # a variant's own file given relative to this folder: its absolute path in the script
    (tmp_path / "own_sweep.py").write_text(
        "from jaxrat.config_schema import load_config\n"
        "def get_config(arg=None):\n    return load_config('isic:smoke')\n"
        "def get_sweep(arg=None):\n    return {'base': [], 'toy': ['--config=tests/toy/sweep_config.py']}\n")
    assert cli.main(["--config", str(tmp_path / "own_sweep.py"), "--root", str(tmp_path / "own"), "--slurm",
                     "--dry-run"]) == 0
    toy = REPO / "tests" / "toy" / "sweep_config.py"
    assert f"VARIANT=toy; VARIANT_CONFIG={toy}; VARIANT_ARGS=() ;;" in capsys.readouterr().out

"""The job-script renderer: content, shell syntax, user errors, submission through a fake sbatch,
and that the example scripts in launch/ are exactly what the renderer produces."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from jaxrat.cli import launch as L

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # --config paths are relative to the repository root


def render(*argv: str, scheduler: str = "slurm") -> str:
    spec, _ = L.parse_args(["--config", "configs/isic.py", *argv])
    return L.render(spec, scheduler)


def bash_syntax_ok(text: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(text)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def directives(text: str, prefix: str = "#SBATCH") -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(prefix + " ")]


def test_templates_are_package_data():
    for name in ("slurm.sbatch", "lsf.bsub"):
        assert resources.files("jaxrat").joinpath("launch_templates", name).is_file()


def test_one_process_per_gpu_by_default(tmp_path):
    text = render("--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--account", "proj",
                  "--time", "12:00:00")
    d = directives(text)
    for expected in ["--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu",
                     "--account=proj", "--time=12:00:00", "--requeue", "--signal=B:USR1@300",
                     "--open-mode=append", "--job-name=jaxrat-isic", "--output=jaxrat-isic-%j.out"]:
        assert expected in d, (expected, d)
    assert ('srun --kill-on-bad-exit=0 --wait=120 \\\n'
            '  "$PYTHON" -m jaxrat.main --config="$CONFIG" --workdir="$WORKDIR" &') in text
    assert 'export JAX_COMPILATION_CACHE_DIR="$(dirname "$WORKDIR")/jax_cache"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "if [[ $preempted == 1 || $status == 42 ]]; then" in text
    bash_syntax_ok(text, tmp_path)


def test_one_process_per_node_and_cpu_only():
    assert "--ntasks-per-node=1" in directives(render("--gpus-per-node", "8", "--one-process-per-node"))
    cpu = directives(render("--tasks-per-node", "2"))
    assert "--ntasks-per-node=2" in cpu and not any(x.startswith("--gpus") for x in cpu)


def test_staging_setup_cache_and_passthrough(tmp_path):
    text = render("--stage-data", "/shared/ISIC 2018", "--setup", "module load cuda/12", "--cache-dir",
                  "/shared/cache", "--signal-lead", "600", "--directive=--constraint=a100",
                  "--", "--config.data.batch_size=64", "--config.model.name=rat small")
    assert "module load cuda/12\n" in text
    assert 'LOCAL_DATA="${TMPDIR:-/tmp}/jaxrat-data-$SLURM_JOB_ID"' in text
    assert "'/shared/ISIC 2018' \"$LOCAL_DATA\"" in text
    assert "export JAX_COMPILATION_CACHE_DIR=/shared/cache" in text
    assert '--config.data.data_dir="$LOCAL_DATA" --config.data.batch_size=64 \'--config.model.name=rat small\' &' \
        in text
    assert "--signal=B:USR1@600" in directives(text) and "--constraint=a100" in directives(text)
    bash_syntax_ok(text, tmp_path)


def test_values_kept_for_the_job_to_expand_cannot_end_their_quotes_and_run_code(tmp_path):
    # A value with $ goes in double quotes so the job expands it; a quote, backslash or backtick of
    # its own must stay text, while a $(...) the user wrote stays shell code.
    hostile = f'$HOME/c"; touch {tmp_path}/INJECTED; echo "`touch {tmp_path}/INJECTED2`\\'
    for value, expected in ((hostile, hostile.replace("$HOME", "/h")),
                            ('$(dirname "$HOME/x y")/cache', "/h/cache")):
        text = render("--cache-dir", value, "--", f"--config.tracking.name={value}")
        bash_syntax_ok(text, tmp_path)
        cache = next(ln for ln in text.splitlines() if ln.startswith("export JAX_COMPILATION_CACHE_DIR="))
        run = next(ln for ln in text.splitlines() if "-m jaxrat.main" in ln)
        extra = run.split('--workdir="$WORKDIR"', 1)[1].removesuffix(" &")
        script = f'{cache}; printf "%s\\n" "$JAX_COMPILATION_CACHE_DIR"{extra}'
        got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                             env={"HOME": "/h", "PATH": os.environ["PATH"]})
        assert got.stdout.splitlines() == [expected, f"--config.tracking.name={expected}"], (got.stdout, got.stderr)
    assert not (tmp_path / "INJECTED").exists() and not (tmp_path / "INJECTED2").exists()


def test_lsf_script(tmp_path):
    text = render("--nodes", "2", "--gpus-per-node", "4", "--time", "1-02:30:00", "--partition", "gpuq",
                  "--stage-data", "/data", scheduler="lsf")
    d = directives(text, "#BSUB")
    for expected in ["-n 8", '-R "span[ptile=4]"', '-gpu "num=4:mode=exclusive_process"', "-W 26:30",
                     "-q gpuq", "-r", "-wa USR1", "-wt 5"]:
        assert expected in d, (expected, d)
    assert 'blaunch -u "$LSB_DJOB_HOSTFILE" "$PYTHON" -m jaxrat.main' in text
    bash_syntax_ok(text, tmp_path)


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0"], "--nodes 0"),
    (["--gpus-per-node", "8", "--tasks-per-node", "3"], "split evenly"),
    (["--time", "tomorrow"], "--time 'tomorrow'"),
    (["--signal-lead", "10"], "too short"),
    (["--time", "00:05:00"], "--time 00:05:00 is not longer than --signal-lead 300 s"),
    (["--time", "0:01:30", "--signal-lead", "120"], "not longer than --signal-lead 120 s"),
    (["--local-data", "/tmp/x"], "--stage-data"),
    (["--workdir", "$SCRATCH/run"], "cannot expand"),
    (["--workdir", "my run"], "contains spaces"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
])
def test_impossible_requests_fail_with_a_sentence(argv, needle):
    spec, _ = L.parse_args(["--config", "configs/isic.py", *argv])
    with pytest.raises(L.UserError, match=needle):
        L.render(spec, "slurm")


def test_missing_config_file_and_unknown_scheduler():
    spec, _ = L.parse_args(["--config", "configs/nope.py:smoke"])
    with pytest.raises(L.UserError, match="does not exist"):
        L.render(spec)
    spec, _ = L.parse_args(["--config", "configs/isic.py"])
    with pytest.raises(L.UserError, match="pbs"):
        L.render(spec, "pbs")


def fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bindir


def run_cli(args: list[str], path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, "-m", "jaxrat.launch", *args], capture_output=True, text=True,
                          env=env, timeout=60, cwd=REPO)


def test_scheduler_detection_from_path(tmp_path):
    base = str(tmp_path / "empty")  # a PATH without sbatch or bsub (this machine may have Slurm)
    none = run_cli(["--config", "configs/isic.py"], base)  # no scheduler: a dry run still prints SLURM
    assert none.returncode == 0 and "#SBATCH --nodes=1" in none.stdout
    lsf = run_cli(["--config", "configs/isic.py"], f"{fake_bin(tmp_path, 'bsub', 'exit 0')}:{base}")
    assert lsf.returncode == 0 and "#BSUB -n 1" in lsf.stdout, lsf.stderr
    nowhere = run_cli(["--config", "configs/isic.py", "--submit"], base)
    assert nowhere.returncode == 2 and "neither sbatch nor bsub" in nowhere.stderr


def test_submit_through_a_fake_sbatch(tmp_path):
    log = tmp_path / "sbatch_args"
    bindir = fake_bin(tmp_path, "sbatch", f'echo "$@" > {log}\necho "4242;cluster"\n')
    workdir = tmp_path / "run"
    proc = run_cli(["--config", "configs/isic.py:smoke", "--workdir", str(workdir), "--submit"],
                   f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    assert proc.returncode == 0, proc.stderr
    assert "submitted job 4242" in proc.stdout
    script = workdir / "jaxrat-isic-smoke.sbatch"
    # SLURM opens the log before the job starts: --submit made the workdir and sends the log there.
    assert script.is_file() and log.read_text().split() == ["--parsable", f"--output={workdir}/slurm-%j.out",
                                                            str(script)]
    assert f"WORKDIR={workdir}" in script.read_text()


def test_refused_submission_is_reported(tmp_path):
    bindir = fake_bin(tmp_path, "sbatch", 'echo "sbatch: error: invalid partition specified: gpux" >&2\nexit 1\n')
    proc = run_cli(["--config", "configs/isic.py", "--workdir", str(tmp_path / "r"), "--submit"],
                   f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    assert proc.returncode == 2
    assert "sbatch refused the job: sbatch: error: invalid partition specified: gpux" in proc.stderr


def test_wait_needs_submit():
    proc = run_cli(["--config", "configs/isic.py", "--wait"], os.environ["PATH"])
    assert proc.returncode == 2 and "--wait needs --submit" in proc.stderr


EXAMPLES = sorted((REPO / "launch").glob("*.sbatch")) + sorted((REPO / "launch").glob("*.bsub"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_in_launch_dir_match_the_renderer(example, tmp_path, monkeypatch):
    from jaxrat.cluster import node_size

    monkeypatch.setattr(node_size, "node_shape", lambda partition: None)  # rendered away from a cluster
    text = example.read_text()
    command = text.splitlines()[1].removeprefix("# Generated by: ")
    argv = shlex.split(command)[3:]  # drop "python -m jaxrat.launch"
    spec, args = L.parse_args(argv)
    assert L.render(spec, args.scheduler) == text, f"regenerate {example.name} with: {command} > launch/{example.name}"
    bash_syntax_ok(text, tmp_path)


@pytest.mark.parametrize("scheduler", ["slurm", "lsf"])
def test_job_script_requeues_by_exit_status(scheduler, tmp_path):
    """The script's decision after training ends, with fake srun/blaunch and requeue commands: 0 and 2
    (an error of the run itself) never requeue, 42 (preempted, process lost) always does, anything
    else (srun's 128+9 when a task was killed) at most --max-restarts times per job."""
    workdir = tmp_path / "run"
    text = render("--tasks-per-node", "2", "--workdir", str(workdir), "--max-restarts", "2", "--cache-dir",
                  str(tmp_path / "cache"), scheduler=scheduler)
    script = tmp_path / "job.sh"
    script.write_text(text)
    requeues = tmp_path / "requeues"
    requeue = 'echo "$@" >> ' + str(requeues) + "\n"
    bindir = fake_bin(tmp_path, "srun", 'exit "$FAKE_STATUS"\n')
    fake_bin(tmp_path, "blaunch", 'exit "$FAKE_STATUS"\n')
    fake_bin(tmp_path, "scontrol", requeue)
    fake_bin(tmp_path, "brequeue", requeue)
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "vm",
           "LSB_JOBID": "77", "LSB_MCPU_HOSTS": "vm 2", "LSB_DJOB_HOSTFILE": "/dev/null"}
    expected = "requeue 77" if scheduler == "slurm" else "77"
    for status, requeued, says in [(0, False, ""), (2, False, ""), (42, True, ""),
                                   (137, True, "requeue 1 of at most 2 after a failure"),
                                   (1, True, "requeue 2 of at most 2 after a failure"),
                                   (137, False, "not requeueing: job 77 failed 3 times, more than --max-restarts 2"),
                                   (42, True, "")]:
        requeues.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**env, "FAKE_STATUS": str(status)})
        assert proc.returncode == status, (status, proc.stdout, proc.stderr)
        assert f"ended with status {status}," in proc.stdout
        assert says in proc.stdout, (status, proc.stdout)
        assert (requeues.read_text().strip() if requeues.exists() else None) == (expected if requeued else None), \
            (status, proc.stdout)


def test_rendering_a_script_does_not_load_jax():
    code = ("import sys; from jaxrat.cli import launch as L; spec, _ = L.parse_args(['--config', 'configs/isic.py']); "
            "L.render(spec); print('jax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_cpus_and_memory_default_to_the_nodes_share(tmp_path, monkeypatch):
    from jaxrat.cluster import node_size

    bindir = fake_bin(tmp_path, "sinfo", 'echo "64 256000 gpu:a100:8(S:0-1)"\necho "96 512000 gpu:8"\n')
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    assert node_size.node_shape("gpu") == (64, 256000, 8)
    d = directives(render("--gpus-per-node", "2"))  # a quarter of the node's GPUs, one task per GPU
    assert "--cpus-per-task=8" in d and f"--mem={int(256000 * 0.25 * 0.95)}M" in d
    d = directives(render("--gpus-per-node", "8", "--cpus-per-task", "4"))  # given values win
    assert "--cpus-per-task=4" in d and "--mem=0" in d
    d = directives(render("--one-process-per-node"))  # a CPU-only job keeps SLURM's defaults
    assert not [x for x in d if x.startswith(("--cpus-per-task", "--mem"))]


def test_help_says_how_to_pass_config_overrides():
    proc = run_cli(["--help"], os.environ["PATH"])
    assert proc.returncode == 0 and "-- --config.data.batch_size=64" in proc.stdout


def test_a_hand_submitted_script_logs_where_sbatch_runs(tmp_path):
    # SLURM opens --output before the script runs: a folder only the job would create cannot hold it.
    text = render("--workdir", str(tmp_path / "not" / "yet"))
    assert "#SBATCH --output=jaxrat-isic-%j.out\n" in text


def test_config_names_files_and_config_json_render_a_config_that_loads_from_any_folder(tmp_path, capsys):
    """Packaged names stay names (jaxrat resolves them wherever the job runs; a clone's configs/NAME.py
    is one), any other file becomes its absolute path, so sbatch may run in any folder."""
    run_json = tmp_path / "run" / "config.json"
    run_json.parent.mkdir()
    run_json.write_text('{"seed": 0}')
    for given, expected in [("segmentation", "segmentation"), ("isic:demo", "isic:demo"),
                            ("configs/isic.py:smoke", "isic:smoke"),
                            ("tests/toy/sweep_config.py", str(REPO / "tests/toy/sweep_config.py")),
                            (os.path.relpath(run_json, REPO), str(run_json))]:
        assert L.main(["--config", given, "--scheduler", "slurm"]) == 0, given
        text = capsys.readouterr().out
        assert f"\nCONFIG={expected}\n" in text, (given, text[:900])
    assert L.main(["--config", "nope:demo", "--scheduler", "slurm"]) == 2
    assert "packaged config's name" in capsys.readouterr().err


def test_the_python_is_the_one_the_setup_lines_activate(tmp_path):
    """Without --python, a job with --setup runs the interpreter its setup puts on PATH (the
    environment it activates), not the rendering machine's; --python still wins."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").write_text("#!/bin/sh\n")
    (venv / "python3").chmod(0o755)
    ran = tmp_path / "ran"
    bindir = fake_bin(tmp_path, "srun", f'echo "$@" > {ran}\n')
    for extra, expected in [([], str(venv / "python3")), (["--python", "/opt/py/bin/python"], "/opt/py/bin/python")]:
        text = render("--setup", f"export PATH={venv}:$PATH", "--workdir", str(tmp_path / "run"), "--cache-dir",
                      str(tmp_path / "cache"), *extra)
        assert sys.executable not in text
        script = tmp_path / "job.sh"
        script.write_text(text)
        env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm"}
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert ran.read_text().split()[2] == expected  # srun --kill-on-bad-exit=0 --wait=120 PYTHON -m ...
    assert f"PYTHON={sys.executable}\n" in render()  # no setup: this environment's interpreter


def test_without_sinfo_one_line_says_so_and_the_flags_set_cpus_and_memory(tmp_path, capsys):
    bindir = fake_bin(tmp_path, "sbatch", "exit 0\n")  # a login node whose sinfo is missing
    proc = run_cli(["--config", "isic", "--gpus-per-node", "4"], f"{bindir}:/usr/bin:/bin")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "could not size --cpus-per-task and --mem" in said[0], proc.stderr
    assert not [x for x in directives(proc.stdout) if x.startswith(("--cpus-per-task", "--mem"))]
    proc = run_cli(["--config", "isic", "--gpus-per-node", "4", "--cpus-per-task", "6", "--mem", "100G"],
                   f"{bindir}:/usr/bin:/bin")
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    assert {"--cpus-per-task=6", "--mem=100G"} <= set(directives(proc.stdout))

"""SLURM sbatch and LSF bsub job scripts: render them from a :class:`JobSpec`, and submit them.

The command lines are ``python -m jaxrat.launch`` (one run) and ``python -m jaxrat.sweep --slurm``
(a job array, one element per variant: :attr:`JobSpec.array`). Both scripts come from the same
templates (``jaxrat/launch_templates``), so a sweep's elements checkpoint, requeue and resume
exactly like a single run. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from jaxrat.cluster.node_size import node_resources
from jaxrat.cluster.preemption import PREEMPTED_EXIT_CODE
from jaxrat.runtime.errors import UserError

SCHEDULERS = ("slurm", "lsf")
_TEMPLATES = {"slurm": "slurm.sbatch", "lsf": "lsf.bsub"}
_TIME = re.compile(r"^(?:(\d+)-)?(\d{1,3}):(\d{2})(?::(\d{2}))?$")
# What a job-array element may be called: it names the element's workdir under the sweep's root.
ELEMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything a job script needs; built from the command line by :func:`spec_from_args`."""

    config: str
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None  # None: one per GPU (or 1 without GPUs)
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    job_name: str | None = None
    workdir: str | None = None
    python: str | None = None  # None: this interpreter, or with setup lines the one they put on PATH
    module: str = "jaxrat.main"
    setup: tuple[str, ...] = ()
    stage_data: str | None = None
    local_data: str | None = None
    data_key: str = "data.data_dir"
    cache_dir: str | None = None
    signal_lead: int = 300
    max_restarts: int = 3
    extra_directives: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    command: str = ""
    # A job array: (name, overrides) per element; element i runs in WORKDIR/<name i> with its
    # overrides before extra_args. Empty: one job.
    array: tuple[tuple[str, tuple[str, ...]], ...] = ()
    array_indices: tuple[int, ...] = ()  # the elements to submit (0-based); empty: all
    array_parallel: int = 0  # at most this many elements at once; 0: no limit

    @property
    def ntasks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1

    @property
    def name(self) -> str:
        if self.job_name:
            return self.job_name
        stem, _, variant = self.config.partition(":")
        return "jaxrat-" + Path(stem).stem + (f"-{variant}" if variant else "")

    @property
    def run_dir(self) -> str:
        return self.workdir or f"runs/{self.name.removeprefix('jaxrat-')}"

    @property
    def elements(self) -> tuple[int, ...]:
        """The array elements to submit, 0-based."""
        return self.array_indices or tuple(range(len(self.array)))


def validate(spec: JobSpec, scheduler: str) -> None:
    """Raise :class:`UserError` with one sentence for a request no scheduler could run."""
    if scheduler not in SCHEDULERS:
        raise UserError(f"--scheduler {scheduler!r} is unknown; use one of {', '.join(SCHEDULERS)} (or auto).")
    # A packaged config's name (isic:demo) is resolved by jaxrat on the nodes; a file must exist
    # (the commands hand it over as an absolute path, so the job runs from any folder).
    stem = spec.config.partition(":")[0]
    if ("/" in stem or stem.endswith((".py", ".json"))) and not Path(stem).is_file():
        raise UserError(f"--config file {stem!r} does not exist; give its path, or a packaged config's name "
                        f"(e.g. --config isic:demo).")
    if spec.nodes < 1:
        raise UserError(f"--nodes {spec.nodes} must be at least 1.")
    if spec.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node {spec.gpus_per_node} must be 0 (CPU) or more.")
    t = spec.ntasks_per_node
    if t < 1:
        raise UserError(f"--tasks-per-node {t} must be at least 1.")
    g = spec.gpus_per_node
    if g and t > 1 and g % t:
        raise UserError(
            f"{g} GPUs per node cannot be split evenly over {t} processes per node; use a divisor of {g} "
            "(one process per GPU is the default, --one-process-per-node drives all GPUs from one)."
        )
    if not _TIME.match(spec.time):
        raise UserError(f"--time {spec.time!r} is not a duration; write HH:MM:SS or D-HH:MM:SS, e.g. 24:00:00.")
    if spec.signal_lead < 60:
        raise UserError(f"--signal-lead {spec.signal_lead} s is too short to save a checkpoint; use 60 or more.")
    if _seconds(spec.time) <= spec.signal_lead:
        # The scheduler would signal "time limit near" as soon as the job starts: checkpoint, stop and
        # requeue, again and again (seen: a 5-minute test job told to stop one second after it started).
        raise UserError(f"--time {spec.time} is not longer than --signal-lead {spec.signal_lead} s, the warning "
                        f"before the limit that makes training checkpoint and stop; give a longer --time or a "
                        f"shorter --signal-lead (60 s or more).")
    if re.search(r"[\s$'\"]", spec.run_dir):
        raise UserError(
            f"--workdir {spec.run_dir!r} contains spaces, quotes or '$', which #SBATCH/#BSUB lines cannot "
            "expand or quote; pass the plain expanded path (e.g. --workdir \"$SCRATCH/runs/isic\" in your shell)."
        )
    if spec.max_restarts < 0:
        raise UserError(f"--max-restarts {spec.max_restarts} must be 0 (never requeue after a failure) or more.")
    if spec.local_data and not spec.stage_data:
        raise UserError("--local-data only makes sense with --stage-data SRC; add the dataset source to copy.")
    bad = [name for name, _ in spec.array if not ELEMENT_NAME.match(name)]
    if bad:
        raise UserError(f"variant name {bad[0]!r} cannot name a workdir; use letters, digits, '.', '_' and '-'.")
    if spec.array and not all(0 <= i < len(spec.array) for i in spec.elements):
        raise UserError(f"array elements {list(spec.elements)} are not all among the {len(spec.array)} variants.")


def _seconds(duration: str) -> int:
    days, h, m, s = _TIME.match(duration).groups()  # type: ignore[union-attr]
    return int(days or 0) * 86400 + int(h) * 3600 + int(m) * 60 + int(s or 0)


def _minutes(duration: str) -> int:
    return -(-_seconds(duration) // 60)  # started minutes count whole


def _q(value: str) -> str:
    """Shell-quote, but keep $VAR, ${VAR...} and $(...) references working (they are meant for the
    job): such a value goes in double quotes, where a ``"``, ``\\`` or backtick of its own is escaped
    (a quote would otherwise end the string and run the rest of the value as commands of the job);
    what lies inside a ``$(...)`` or ``${...}`` is the user's shell code and is kept as written."""
    if "$" not in value:
        return shlex.quote(value)
    out, closers, i = [], [], 0
    while i < len(value):
        pair = value[i:i + 2]
        if pair in ("$(", "${"):
            closers.append(")" if pair == "$(" else "}")
            out.append(pair)
            i += 2
            continue
        c = value[i]
        if closers and c == closers[-1]:
            closers.pop()
        elif not closers and c in '"\\`':
            c = "\\" + c
        out.append(c)
        i += 1
    return '"' + "".join(out) + '"'


def index_ranges(indices: tuple[int, ...], offset: int = 0) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``: the index list of a job array (``offset`` 1 for LSF)."""
    out: list[str] = []
    for i in sorted(set(indices)):
        i += offset
        if out and int(out[-1].rpartition("-")[2]) == i - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _own_configs(spec: JobSpec) -> bool:
    """Whether an array element trains its own config file (an override ``--config=FILE``)."""
    return any(a.startswith("--config=") for _, args in spec.array for a in args)


def _array_block(spec: JobSpec, scheduler: str) -> str:
    """Shell lines that pick this element's variant name and overrides by the array index."""
    index, offset = ("SLURM_ARRAY_TASK_ID", 0) if scheduler == "slurm" else ("LSB_JOBINDEX", 1)
    def case(i: int, name: str, args: tuple[str, ...]) -> str:
        # A variant may train its own config file (an item --config=FILE[:ARG]; the last one counts).
        files = [a.partition("=")[2] for a in args if a.startswith("--config=")]
        rest = [a for a in args if not a.startswith("--config=")]
        config = f"VARIANT_CONFIG={_q(files[-1] if files else spec.config)}; " if _own_configs(spec) else ""
        return f"  {i + offset}) VARIANT={name}; {config}VARIANT_ARGS=({' '.join(shlex.quote(a) for a in rest)}) ;;\n"

    cases = "".join(case(i, name, args) for i, (name, args) in enumerate(spec.array))
    return (
        f"# A job array: element ${index} runs one variant, in its own workdir under the sweep's root.\n"
        f'case "${{{index}:-}}" in\n{cases}'
        f'  *) echo "jaxrat: {index}=${{{index}:-}} names no variant of this sweep"; exit 2 ;;\n'
        "esac\n"
        f'echo "jaxrat: variant $VARIANT (array element ${index})"\n\n'
    )


def _python_after_setup(spec: JobSpec) -> str:
    """The job's interpreter when ``--python`` is not given: with ``--setup`` lines (``module load``,
    ``source .venv/bin/activate``, ``conda activate``) the ``python`` they put on PATH, found when the
    job runs; without, this one (a shared file system's environment)."""
    if spec.setup:
        return '"$(command -v python3 || command -v python)"'
    return _q(sys.executable)


def _scheduler_header(spec: JobSpec, scheduler: str) -> tuple[str, str, str, str]:
    """What differs between the schedulers' headers: (resource directive lines, time limit in the
    scheduler's format, log file name, job name)."""
    g = spec.gpus_per_node
    limit = f"%{spec.array_parallel}" if spec.array_parallel else ""
    if scheduler == "slurm":
        pairs = [("gpus-per-node", g or None), ("cpus-per-task", spec.cpus_per_task), ("mem", spec.mem),
                 ("partition", spec.partition), ("account", spec.account), ("qos", spec.qos),
                 ("array", index_ranges(spec.elements) + limit if spec.array else None)]
        lines = [f"#SBATCH --{k}={v}\n" for k, v in pairs if v is not None]
        lines += [f"#SBATCH {d}\n" for d in spec.extra_directives]
        return "".join(lines), spec.time, slurm_log(spec), spec.name
    pairs = [("-gpu", f'"num={g}:mode=exclusive_process"' if g else None), ("-q", spec.partition),
             ("-P", spec.account), ("-M", spec.mem)]
    lines = [f"#BSUB {k} {v}\n" for k, v in pairs if v is not None]
    lines += [f"#BSUB {d}\n" for d in spec.extra_directives]
    time = f"{_minutes(spec.time) // 60}:{_minutes(spec.time) % 60:02d}"
    log = "lsf-%J_%I.out" if spec.array else "lsf-%J.out"
    # LSF has no array directive: the index list and its limit are part of the job name.
    job_name = f'"{spec.name}[{index_ranges(spec.elements, offset=1)}]{limit}"' if spec.array else spec.name
    return "".join(lines), time, log, job_name


def render(spec: JobSpec, scheduler: str = "slurm") -> str:
    """The job script text for ``scheduler`` ("slurm" or "lsf")."""
    validate(spec, scheduler)
    template = resources.files("jaxrat").joinpath("launch_templates", _TEMPLATES[scheduler]).read_text()
    t = spec.ntasks_per_node
    resource_lines, time, log, job_name = _scheduler_header(spec, scheduler)
    stage, data_flag = "", ""
    if spec.stage_data:
        stage = _stage_block(spec, scheduler)
        data_flag = f' --config.{spec.data_key}="$LOCAL_DATA"'
    workdir = _q(spec.run_dir)
    values = {
        "command": spec.command or "python -m jaxrat.launch ...",
        "how_to_submit": ("The same command without --dry-run submits the variants not finished yet." if spec.array
                          else "Regenerate with that command (add --submit to submit)."),
        "job_name": job_name,
        "nodes": str(spec.nodes),
        "tasks_per_node": str(t),
        "total_tasks": str(spec.nodes * t),
        "resource_lines": resource_lines,
        "time": time,
        # SLURM opens the log before the script runs, so it must go to a folder that exists: the
        # one sbatch runs in (a hand-submitted script); --submit creates the workdir and logs there.
        "log": log if scheduler == "slurm" else f"{workdir}/{log}",
        "array_select": _array_block(spec, scheduler) if spec.array else "",
        "workdir": f'{workdir}/"$VARIANT"' if spec.array else workdir,
        "signal_lead": str(spec.signal_lead),
        "signal_lead_min": str(max(1, spec.signal_lead // 60)),
        "config": '"$VARIANT_CONFIG"' if spec.array and _own_configs(spec) else _q(spec.config),
        "python": _q(spec.python) if spec.python else _python_after_setup(spec),
        "cache_dir": _q(spec.cache_dir) if spec.cache_dir else '"$(dirname "$WORKDIR")/jax_cache"',
        "setup": "".join(f"{line}\n" for line in spec.setup),
        "stage": stage,
        "module": spec.module,
        "data_flag": data_flag,
        # Safe under `set -u` with an empty array on bash < 4.4 too.
        "variant_args": ' ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"}' if spec.array else "",
        "lsf_job": '"$LSB_JOBID[$LSB_JOBINDEX]"' if spec.array else '"$LSB_JOBID"',  # brequeue one element only
        "preempted_exit_code": str(PREEMPTED_EXIT_CODE),
        "max_restarts": str(spec.max_restarts),
        "extra": "".join(" " + _q(a) for a in spec.extra_args),
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)
def _stage_block(spec: JobSpec, scheduler: str) -> str:
    job = "$SLURM_JOB_ID" if scheduler == "slurm" else "$LSB_JOBID"
    local = _q(spec.local_data or f"${{TMPDIR:-/tmp}}/jaxrat-data-{job}")
    copy = ("mkdir -p \"$1\" && if command -v rsync >/dev/null; then rsync -a \"$0\"/ \"$1\"/; "
            "else cp -a \"$0\"/. \"$1\"/; fi")
    if scheduler == "slurm":
        per_node = 'srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" --kill-on-bad-exit=1'
    else:
        per_node = "blaunch -z \"$(echo $LSB_MCPU_HOSTS | awk '{for (i = 1; i <= NF; i += 2) print $i}')\""
    return (
        "# Copy the dataset once to each node's local disk; training reads it from there.\n"
        f"LOCAL_DATA={local}\n"
        f"{per_node} bash -c {shlex.quote(copy)} {_q(spec.stage_data)} \"$LOCAL_DATA\"\n"  # type: ignore[arg-type]
    )


def detect_scheduler() -> str | None:
    """The scheduler whose submit command is on PATH ("slurm", "lsf"), or None."""
    if shutil.which("sbatch"):
        return "slurm"
    if shutil.which("bsub"):
        return "lsf"
    return None


def submit(script: str, spec: JobSpec, scheduler: str, *, wait: bool, timeout: float,
           path: Path | None = None) -> int:
    """Write the script (to ``path``, default the workdir), submit it, and return the exit status.

    With ``wait`` the call blocks until the job ends (bounded by ``timeout`` seconds) and
    returns the job's exit status; otherwise 0 once the scheduler accepted the job.
    """
    workdir = Path(spec.run_dir)
    workdir.mkdir(parents=True, exist_ok=True)  # the scheduler writes the job log there
    path = path or workdir / f"{spec.name}.{'sbatch' if scheduler == 'slurm' else 'bsub'}"
    path.write_text(script)
    if scheduler == "slurm":
        log = "slurm-%A_%a.out" if spec.array else "slurm-%j.out"  # the command line wins over #SBATCH
        cmd = ["sbatch", "--parsable", f"--output={workdir}/{log}"] + (["--wait"] if wait else []) + [str(path)]
        stdin = None
    else:
        cmd = ["bsub"] + (["-K"] if wait else [])
        stdin = script
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout if wait else 60)
    except subprocess.TimeoutExpired:
        raise UserError(f"`{' '.join(cmd)}` did not return within {timeout:.0f} s; check the queue "
                        "(squeue/bjobs) and raise --wait-timeout if the job is just slow.") from None
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} is not on PATH; submit from a {scheduler} login node.") from None
    out = (proc.stdout + proc.stderr).strip()
    if scheduler == "slurm" and proc.stdout.strip():
        job = proc.stdout.strip().splitlines()[0].split(";")[0]
        logs = f"logs {workdir}/slurm-{job}_<element>.out" if spec.array else f"log {workdir}/slurm-{job}.out"
        print(f"submitted job {job}: script {path}, {logs}", flush=True)
    elif out:
        print(out, flush=True)
    if proc.returncode and not (wait and scheduler == "slurm" and proc.stdout.strip()):
        raise UserError(f"{cmd[0]} refused the job: {out or 'exit status ' + str(proc.returncode)}")
    return proc.returncode




def slurm_log(spec: JobSpec) -> str:
    """The ``#SBATCH --output`` of a script: in the folder sbatch runs in, named for the job."""
    return f"{spec.name}-%A_%a.out" if spec.array else f"{spec.name}-%j.out"


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The allocation and job-script options shared by ``jaxrat.launch`` and ``jaxrat.sweep``."""
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="0 for CPU-only nodes")
    p.add_argument("--tasks-per-node", type=int, help="processes per node (default: one per GPU)")
    p.add_argument("--one-process-per-node", action="store_true", help="one process drives all GPUs of its node")
    p.add_argument("--time", default="04:00:00", help="wall-clock limit, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", help="SLURM partition / LSF queue")
    p.add_argument("--account", help="SLURM account / LSF project")
    p.add_argument("--qos")
    p.add_argument("--cpus-per-task", type=int,
                   help="CPUs per process (default: the node's, by sinfo, shared by the GPUs and tasks requested)")
    p.add_argument("--mem", help="memory per node, e.g. 200G (default: the node's share, by sinfo; 0: all)")
    p.add_argument("--job-name")
    p.add_argument("--python", help="python on the compute nodes (default: the one --setup activates, else this one)")
    p.add_argument("--module", default="jaxrat.main", help="entry module, e.g. jaxrat.evaluate")
    p.add_argument("--setup", action="append", default=[], help="shell line run before training (repeatable)")
    p.add_argument("--stage-data", metavar="SRC", help="copy this dataset directory to node-local disk first")
    p.add_argument("--local-data", metavar="DIR", help="node-local target for --stage-data")
    p.add_argument("--data-key", default="data.data_dir", help="config field that receives the local copy")
    p.add_argument("--cache-dir", help="persistent JAX compilation cache (default: <workdir>/../jax_cache)")
    p.add_argument("--signal-lead", type=int, default=300, help="seconds before the limit to checkpoint")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="requeues after a failure (a process killed, status other than 0, 2, 42) per job")
    p.add_argument("--directive", action="append", default=[],
                   help="extra raw '#SBATCH'/'#BSUB' option, e.g. --directive=--constraint=a100")


def job_fields(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """The :class:`JobSpec` fields given by :func:`add_job_arguments`' options."""
    if a.one_process_per_node and a.tasks_per_node not in (None, 1):
        p.error("--one-process-per-node contradicts --tasks-per-node; give only one of them")
    tasks = 1 if a.one_process_per_node else (a.tasks_per_node or a.gpus_per_node or 1)
    if getattr(a, "scheduler", "slurm") != "lsf" and not getattr(a, "lsf", False):
        a.cpus_per_task, a.mem = node_resources(a.cpus_per_task, a.mem, a.gpus_per_node, tasks, a.partition)
    return dict(
        nodes=a.nodes, gpus_per_node=a.gpus_per_node, tasks_per_node=1 if a.one_process_per_node else a.tasks_per_node,
        time=a.time, partition=a.partition, account=a.account, qos=a.qos, cpus_per_task=a.cpus_per_task, mem=a.mem,
        job_name=a.job_name, python=a.python, module=a.module, setup=tuple(a.setup), stage_data=a.stage_data,
        local_data=a.local_data, data_key=a.data_key, cache_dir=a.cache_dir, signal_lead=a.signal_lead,
        max_restarts=a.max_restarts, extra_directives=tuple(a.directive),
    )

"""The read side's restore (evaluate, predict, export, init_from, robustness): the same trust as a resume.

A training resumes from its newest checkpoint that reads back as it was saved (the arrays' digests
saved with it), falling back to the previous complete one. The commands that only read a run do
the same here, without moving anything aside (the folder is the training's): :func:`open_checkpoint`
picks the step, checks it, and holds it still while it is read. A training beside the reader
keeps rotating its checkpoints (``checkpoint.keep``); the chosen step is hard-linked into a
private folder next to the checkpoints, so deleting the original does not pull the files from
under the reader. Where links cannot be made (a read-only workdir, a filesystem without them),
it is read in place, and a step that disappears meanwhile is said so in one sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence

from jaxrat.checkpointing import store
from jaxrat.runtime.errors import UserError

PIN_PREFIX = ".reading-"  # WORKDIR/.reading-<host>-<pid>-*: a reader's hard links of one step


@dataclasses.dataclass(frozen=True)
class Opened:
    """A checkpoint step held for reading: ``where`` is its ``<step>/`` folder (pinned or in place)."""

    directory: str  # the run's checkpoints/ folder
    step: int
    where: str

    @property
    def spec(self) -> str:
        """``PATH:STEP`` of the held copy, for readers that take one."""
        return f"{os.path.dirname(self.where)}:{self.step}"


def _asks_latest(spec: str) -> bool:
    path, step = store.split_spec(spec)
    if step:
        return step == "latest"
    return not store._STEP_RE.match(os.path.basename(path.rstrip("/")))


def _clean_stale_pins(base: str) -> None:
    """Remove the pins of readers on this host that are gone (a kill -9 skips the cleanup)."""
    host = socket.gethostname()
    try:
        names = [n for n in os.listdir(base) if n.startswith(f"{PIN_PREFIX}{host}-")]
    except OSError:
        return
    for name in names:
        pid = name[len(f"{PIN_PREFIX}{host}-"):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except PermissionError:
            continue


@contextlib.contextmanager
def _pinned(directory: str, step: int) -> Iterator[str | None]:
    """``step``'s folder held still (hard links), or in place where links cannot be made; None
    when the step is gone (rotated away by the training) before it could be held."""
    source = os.path.join(directory, str(step))
    base = os.path.dirname(directory)
    _clean_stale_pins(base)
    try:
        root = tempfile.mkdtemp(prefix=f"{PIN_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=base)
    except OSError:  # a read-only workdir: nothing can be held, read in place
        yield source if os.path.isfile(os.path.join(source, store.COMMIT_FILE)) else None
        return
    try:
        target = os.path.join(root, str(step))
        try:
            for dirpath, _, files in os.walk(source):
                into = os.path.join(target, os.path.relpath(dirpath, source))
                os.makedirs(into, exist_ok=True)
                for f in files:
                    os.link(os.path.join(dirpath, f), os.path.join(into, f))
        except FileNotFoundError:
            yield None
            return
        except OSError:  # no hard links here (another filesystem, a policy): read in place
            yield source if os.path.isfile(os.path.join(source, store.COMMIT_FILE)) else None
            return
        complete = os.path.isfile(os.path.join(target, store.COMMIT_FILE)) and os.path.isdir(source)
        yield target if complete else None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _problem(where: str, items: Sequence[str]) -> str | None:
    """Why ``where`` cannot be trusted: a file that does not read, or an array of ``items`` whose
    digest differs from the one saved with the step; None when it reads back as saved."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    from jaxrat.checkpointing import digest, recovery
    from jaxrat.checkpointing.named_arrays import named_leaves

    expected = store.step_metadata(os.path.dirname(where), os.path.basename(where)).get("digest") or {}
    try:
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(where) / "state").tree
        present = [k for k in items if k in meta]
        if not present:
            return None  # the caller says what it misses, in its own words
        target = {k: meta[k] for k in present}
        args = {k: jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta[k]) for k in present}
        with ocp.PyTreeCheckpointer() as ckptr:
            arrays = ckptr.restore(os.path.join(where, "state"), args=ocp.args.PyTreeRestore(
                item=target, restore_args=args, partial_restore=True))
    except Exception as e:
        if recovery.is_out_of_memory(e):
            raise
        logging.debug("checkpoint: reading %s failed", where, exc_info=True)
        return recovery.short_reason(e)
    bad = sorted(n for n, a in named_leaves(arrays).items()
                 if n in expected and digest.host_digest(a) != int(expected[n]))
    return f"{bad[0]} reads back different from what was saved ({len(bad)} arrays differ)" if bad else None


def _damaged(real: str, pinned: str | None, problem: str, elsewhere: Sequence[int], others: str) -> UserError:
    """The sentence for a checkpoint that cannot be read; the folder named is ``real``, never the temporary
    ``pinned`` copy the reader held (gone once the sentence is read), and another step is suggested only
    where the run holds one."""
    if pinned:  # the reason may be cut short inside the copy's path: its folder then reads as the real one's
        problem = problem.replace(pinned, real).replace(os.path.dirname(pinned), os.path.dirname(real))
    if not elsewhere:
        return UserError(f"The checkpoint {real} cannot be read ({problem}) and it is the run's only complete "
                         f"checkpoint; restore that folder from a copy, or train the run again.")
    return UserError(f"The checkpoint {real} cannot be read ({problem}); ask for another step (complete: {others}) "
                     f"or --step latest, which skips damaged ones.")


@contextlib.contextmanager
def open_checkpoint(spec: str, items: Sequence[str] = ("params",), *, together: bool = True) -> Iterator[Opened]:
    """The checkpoint ``PATH[:STEP|:best|:latest]`` held still and checked, for reading ``items``.

    For ``latest`` a damaged step (a file that does not read, an array whose digest differs) is
    skipped with a line saying so, for the previous complete one, as a resume does; a step asked
    for by number or as ``best`` is not replaced by another, and its damage ends in a sentence.
    ``together``: every process of a multi-process run calls this and they agree on the step
    (a collective); False for per-process readers (prediction).
    """
    from jaxrat.checkpointing import recovery

    agree = recovery.all_agree if together else (lambda ok: ok)
    directory, step = store.resolve(spec)
    latest = _asks_latest(spec)
    while True:
        with _pinned(directory, step) as where:
            problem = "it was removed while being opened" if where is None else _problem(where, items)
            if agree(problem is None):
                yield Opened(directory, step, where)
                return
        gone = not os.path.isfile(os.path.join(directory, str(step), store.COMMIT_FILE))
        steps = store.committed_steps(directory)
        if latest and gone and steps:
            logging.warning("checkpoint step %d of %s was removed while it was read (the training there rotates "
                            "its checkpoints); reading the newest, step %d", step, directory, steps[-1])
            step = steps[-1]
            continue
        older = [s for s in steps if s < step]
        if latest and older:
            logging.warning("checkpoint %s cannot be read (%s); reading the previous complete step %d instead",
                            os.path.join(directory, str(step)), problem, older[-1])
            step = older[-1]
            continue
        others = ", ".join(map(str, steps)) or "none"
        if gone:
            raise UserError(f"Checkpoint step {step} of {directory} was removed while it was read (the training "
                            f"there keeps only its newest checkpoints); ask for --step latest or a step it still "
                            f"holds ({others}).")
        raise _damaged(os.path.join(directory, str(step)), where, problem, [s for s in steps if s != step], others)

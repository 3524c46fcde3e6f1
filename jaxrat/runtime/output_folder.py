"""The folder a command writes its results into (``predict --out``, ``evaluate --out``, ``export --out``).

One helper for every command, run before any work:

- :func:`check` refuses an output that is, contains or lies inside what the command reads: its
  inputs, a training run's own files (``config.json``, ``checkpoints/``, ``metrics.jsonl``: every
  entry of a workdir but ``eval/`` and the folders commands wrote there) or a dataset folder; and
  one that cannot be written or is full (a probe of :data:`PROBE_BYTES` is written and removed).
- :func:`claim` takes an existing folder only when it is empty, or with ``overwrite`` when the same
  command wrote it: ``OUT/.jaxrat-outputs.json`` (:data:`MANIFEST`) names the command and lists what
  it writes there, and ``--overwrite`` removes exactly those files, never one jaxrat did not write
  nor another command's results (an export's model is not replaced by a prediction).

Each refusal is one sentence naming the folder and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import unwritable, write_json

MANIFEST = ".jaxrat-outputs.json"
PROBE_BYTES = 1 << 20  # a folder that cannot take 1 MiB cannot take a command's results either
# Entries a command keeps beside its results while it runs (its lock and the lock's temporaries).
_OWN_PREFIXES = (MANIFEST, ".jaxrat-output.lock")
# A workdir's entries that are not the run's own files: evaluations' folders.
_NOT_RUN_FILES = ("eval",)


@dataclasses.dataclass(frozen=True)
class Guarded:
    """A path a command only reads: its output may not be it, contain it or (unless ``inside_ok``) lie in it."""

    path: str
    what: str  # as the refusal names it: "the input folder", "the run's own files"
    inside_ok: bool = False


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _within(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip(os.sep) + os.sep)


def overlap(path: str, other: str) -> str:
    """How ``path`` stands to ``other``, symlinks resolved: "is", "contains", "lies inside", or "" (apart)."""
    a, b = _real(path), _real(other)
    if a == b:
        return "is"
    if _within(b, a):
        return "contains"
    return "lies inside" if _within(a, b) else ""


def _is_workdir(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) and os.path.isdir(os.path.join(folder, "checkpoints"))


def run_files(workdir: str) -> list[Guarded]:
    """A training workdir and its own entries: everything in it but ``eval/`` and folders a command
    wrote there (they hold a :data:`MANIFEST`). An output may be a new folder inside the workdir."""
    out = [Guarded(workdir, "a training run's workdir", inside_ok=True)]
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(workdir)):
            p = os.path.join(workdir, name)
            if name in _NOT_RUN_FILES or os.path.isfile(os.path.join(p, MANIFEST)):
                continue
            out.append(Guarded(p, f"the run's own {'folder' if os.path.isdir(p) else 'file'} {name}"))
    return out


def _workdirs_around(out: str) -> list[Guarded]:
    """The run files of any training workdir that ``out`` is or lies in (another run's too)."""
    found, here = [], _real(out)
    while True:
        if _is_workdir(here):
            found += run_files(here)
        parent = os.path.dirname(here)
        if parent == here:
            return found
        here = parent


def check(out: str, guarded: Iterable[Guarded], *, command: str, flag: str = "--out",
          input_files: Sequence[str] = (), what: str = "") -> None:
    """Refuse (one sentence) an ``out`` that overlaps a ``guarded`` path, an input file or a training
    workdir, that is a file, or that cannot be written (read-only, no permission, full disk); the
    folder exists afterwards. ``what``: the results as the refusal names them (default: "the
    evaluation" for evaluate, else "COMMAND's results")."""
    o = _real(out)
    for g in [*guarded, *_workdirs_around(out)]:
        if not g.path:
            continue
        how = overlap(out, g.path)
        if not how or (how == "lies inside" and g.inside_ok):
            continue
        raise UserError(f"{flag} {out} {how} {g.what} ({g.path}), which {command} only reads; choose an output "
                        f"folder outside it.")
    inside = next((f for f in input_files if _real(f) == o or _within(_real(f), o)), None)
    if inside is not None:
        how = "is" if _real(inside) == o else "contains"
        raise UserError(f"{flag} {out} {how} the input {inside}, which {command} only reads; choose an output folder "
                        f"outside the inputs.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{flag} {out} is a file; choose a folder.")
    why = unwritable(out, PROBE_BYTES)
    if why:
        what = what or ("evaluation" if command == "evaluate" else f"{command}'s results")
        raise UserError(f"Cannot write the {what} to {out} ({why}); pass {flag} a folder you can write to, on a disk "
                        f"with free space.")


def run_inputs(workdir: str, config: Any) -> list[Guarded]:
    """What a command on a trained run reads besides its own inputs: the run's own files and its
    dataset folders (``config.data.data_dir``, ``config.data.stage_to_local_dir``), which jaxrat never writes."""
    data = config.get("data") or {}
    folders = [Guarded(str(data.get(k)), "the run's dataset folder") for k in ("data_dir", "stage_to_local_dir")
               if data.get(k)]
    return [*run_files(workdir), *folders]


def read_manifest(out: str) -> dict | None:
    """``OUT/.jaxrat-outputs.json``, or None when there is none (or it is not one jaxrat wrote)."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None


def listed_files(manifest: dict) -> list[str]:
    """The relative paths a manifest names: its ``files``, and each of its ``each`` templates for
    every one of its ``stems`` (``"masks/{stem}.png"``; a per-image list stays short)."""
    files = [str(f) for f in manifest.get("files", [])]
    stems = [str(s) for s in manifest.get("stems", [])]
    for template in manifest.get("each", []):
        files += [str(template).replace("{stem}", s) for s in stems]
    return files


def _remove_listed(out: str, manifest: dict) -> None:
    """Delete the files the manifest lists, then the folders that left empty; nothing outside ``out``
    (a listed path through ``..`` or a link leading out is left alone)."""
    root = _real(out)
    folders = set()
    for rel in listed_files(manifest):
        p = os.path.join(out, rel)
        if os.path.isabs(rel) or not _within(_real(p), root) or not os.path.lexists(p) or os.path.isdir(p):
            continue
        os.remove(p)
        folders.add(os.path.dirname(p))
    for folder in sorted(folders, key=len, reverse=True):
        while _within(_real(folder), root):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty: a file the user put there keeps its folder
            if os.path.exists(folder):
                break
            folder = os.path.dirname(folder)


def refuse_taken(out: str, *, command: str, overwrite: bool, flag: str = "--out") -> None:
    """:func:`claim`'s refusals, writing nothing: a folder holding another command's outputs (its
    :data:`MANIFEST` names that command), a non-empty ``out`` without ``overwrite``, or one jaxrat did
    not write (no :data:`MANIFEST`). For a command that says so before minutes of work."""
    if not _present(out):
        return
    refuse_other(out, command=command, fix="choose a new folder", where=f"{flag} {out}", even=", even with --overwrite")
    if read_manifest(out) is None and command != "evaluate" and _is_run_evaluation(out):
        raise UserError(f"{flag} {out} holds an evaluation of the run (jaxrat evaluate writes WORKDIR/eval/NAME), "
                        f"which {command} never replaces, even with --overwrite; choose a new folder.")
    if not overwrite:
        raise UserError(f"{flag} {out} exists and is not empty; choose a new folder or pass --overwrite.")
    if read_manifest(out) is None:
        raise UserError(f"{flag} {out} holds files jaxrat did not write (it has no {MANIFEST}), which --overwrite "
                        f"never deletes; choose a new folder, or empty this one yourself.")


def refuse_other(out: str, *, command: str, fix: str, where: str = "", even: str = "") -> None:
    """Refuse (one sentence ending in ``fix``) an ``out`` whose :data:`MANIFEST` names another command
    than ``command``: --overwrite there would delete that command's results (an export's model, a
    prediction's masks) and leave a folder of one command's files listed as another's. ``where``:
    how the sentence names ``out`` (default: the path); ``even``: said after "never replaces"."""
    # A manifest naming no command (one written by hand) stays what it was before commands were told
    # apart: a list of files any command's --overwrite may remove.
    other = str((read_manifest(out) or {}).get("command") or command)
    if other != command:
        raise UserError(f"{where or out} holds the outputs of jaxrat {other}, which {command} never replaces{even}; "
                        f"{fix}.")


def _is_run_evaluation(out: str) -> bool:
    """Whether ``out`` is an evaluation's folder in a run's workdir (``WORKDIR/eval/NAME``, its scores in
    it): evaluate writes there without a manifest, as the run's own folder."""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(out)))
    return (os.path.basename(parent) == _NOT_RUN_FILES[0] and os.path.isfile(os.path.join(out, "metrics.json"))
            and os.path.isfile(os.path.join(os.path.dirname(parent), "config.json")))


def _present(out: str) -> list[str]:
    return [n for n in os.listdir(out) if not n.startswith(_OWN_PREFIXES)] if os.path.isdir(out) else []


def files_in(out: str) -> set[str]:
    """Every file under ``out`` (relative paths) but the command's own :data:`MANIFEST` and lock."""
    found = set()
    for folder, _, names in os.walk(out):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), out)
            if not rel.startswith(_OWN_PREFIXES):
                found.add(rel)
    return found


def record(out: str, *, command: str, files: Sequence[str] = (), each: Sequence[str] = (),
           stems: Sequence[str] = ()) -> None:
    """Write ``out``'s :data:`MANIFEST`: what ``command`` writes there, which a later ``--overwrite`` removes."""
    write_json(os.path.join(out, MANIFEST), {"command": command, "files": list(files), "each": list(each),
                                             "stems": list(stems)}, indent=1)


def claim(out: str, *, command: str, overwrite: bool, files: Sequence[str] = (), each: Sequence[str] = (),
          stems: Sequence[str] = (), flag: str = "--out") -> None:
    """Take ``out`` (checked by :func:`check`) for ``command``: an empty folder as it is; a non-empty
    one only with ``overwrite`` and only when ``command`` wrote it (:func:`refuse_taken`), removing
    exactly the files its manifest lists. Then record what this command will write (``files``, and
    ``each`` template for every one of ``stems``) as the new manifest, before writing any of it."""
    refuse_taken(out, command=command, overwrite=overwrite, flag=flag)
    manifest = read_manifest(out) if _present(out) else None
    if manifest is not None:
        _remove_listed(out, manifest)
    record(out, command=command, files=files, each=each, stems=stems)

"""Grain pipelines: per-host, deterministic, resumable from the step.

The training stream is one global sequence: shuffle (reshuffled each epoch) -> repeat -> decode
-> random augmentation seeded by the element's *global* index. The global batch of step ``s`` is
global elements ``[s*B, (s+1)*B)`` and host ``p`` of ``P`` reads its ``p``-th run of ``B/P``
consecutive ones, so the batch the trainer assembles (host 0's rows first) is the same rows in the
same order whatever the number of hosts: a run resumed on another process count sees exactly the
examples an uninterrupted run would have seen, and fixed reduction shards hold the same rows.

Worker processes (``num_workers``) take elements round-robin *before* batching, so batches are
the same for any worker count. The iterator's checkpoint state is just the next global element,
so a run may also resume with another worker count. Bad files: see :mod:`jaxrat.data.badfiles`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np

from jaxrat.data import transforms as T
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError
from jaxrat.data.process_rows import ProcessRows
from jaxrat.data.sources.isic import DecodePair
from jaxrat.data.workers import finish_shared_memory_unlinks, worker_ignores_job_signals
from jaxrat.runtime.errors import ConfigError, DataError

IMAGENET_MEAN = np.array(T.IMAGENET_MEAN, np.float32)
IMAGENET_STD = np.array(T.IMAGENET_STD, np.float32)
# Consecutive bad elements tolerated under "skip" before giving up: a dataset that is mostly
# broken should stop the run, not spin.
MAX_CONSECUTIVE_BAD = 64


# -------------------------------------------------------------------------------- sources

@dataclasses.dataclass(frozen=True)
class ExampleSource:
    """One split of a dataset as the pipeline reads it: random-access ``records``, a ``loader``
    turning one record into an example dict (raising BadFileError for a broken file), the bad-file
    ``policy`` and a ``name`` for messages. Segmentation pairs, COCO images and TFDS records alike."""

    records: Sequence[Any]
    loader: Any = dataclasses.field(default_factory=DecodePair)
    policy: BadFilePolicy = dataclasses.field(default_factory=BadFilePolicy)
    name: str = ""

    def __len__(self) -> int:
        return len(self.records)


def as_source(data: ExampleSource | Sequence[tuple[str, str]]) -> ExampleSource:
    """Accept a plain list of (image, mask) paths as well."""
    return data if isinstance(data, ExampleSource) else ExampleSource(list(data))


class _LoadWithFallback(grain.MapDataset):
    """Element ``i`` = loader(parent[i]); under "skip" a bad record is replaced by parent[i+1],
    parent[i+2], ... (deterministic: depends on the index and the files only)."""

    def __init__(self, parent: grain.MapDataset, loader: Any, policy: BadFilePolicy):
        super().__init__(parent)
        self._loader, self._policy = loader, policy

    def __len__(self) -> int:
        return len(self._parent)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        for k in range(MAX_CONSECUTIVE_BAD):
            try:
                return self._loader.map(self._parent[(index + k) % len(self._parent)])
            except BadFileError as e:
                self._policy.handle(e)  # raises under "fail"
        raise DataError(
            f"{MAX_CONSECUTIVE_BAD} bad files in a row in the training stream (see skipped_files.txt); "
            f"the dataset looks broken: fix or re-download it."
        )


# ------------------------------------------------------------------------------- options

def augment_ops(
    image_size: int,
    *,
    random_flip: bool = True,
    keep_aspect_ratio: bool = False,
    random_crop_scale: Sequence[float] = (1.0, 1.0),
    scale_jitter: Sequence[float] = (1.0, 1.0),
    rotation_degrees: float = 0.0,
    color_jitter: float = 0.0,
    elastic_prob: float = 0.0,
    elastic_alpha: float = 34.0,
    elastic_sigma: float = 4.0,
    train: bool = True,
) -> list:
    """The op list (after decoding) for segmentation; each switch adds exactly its op."""
    crop_lo, crop_hi = (float(x) for x in random_crop_scale)
    if not 0 < crop_lo <= crop_hi <= 1:
        raise ConfigError(f"config.data.random_crop_scale={tuple(random_crop_scale)}; "
                          "use (min, max) with 0 < min <= max <= 1.")
    if train and crop_lo < 1:
        # Letterbox first when asked: the crop alone would train on stretched images while
        # evaluation (Resize below) sees padded ones. Larger by the crop's zoom, to keep detail.
        canvas = int(math.ceil(image_size / math.sqrt(crop_lo)))
        ops: list = [T.Resize(canvas, keep_aspect=True)] if keep_aspect_ratio else []
        ops.append(T.RandomResizedCrop(image_size, scale=(crop_lo, crop_hi)))
    else:
        ops = [T.Resize(image_size, keep_aspect=keep_aspect_ratio)]
    if train:
        jit_lo, jit_hi = (float(x) for x in scale_jitter)
        if not 0 < jit_lo <= jit_hi:
            raise ConfigError(f"config.data.scale_jitter={tuple(scale_jitter)}; use (min, max) with 0 < min <= max.")
        if (jit_lo, jit_hi) != (1.0, 1.0):
            ops.append(T.ScaleJitter(image_size, scale=(jit_lo, jit_hi)))
        if random_flip:
            ops.append(T.RandomFlip())
        if rotation_degrees:
            ops.append(T.RandomRotation(float(rotation_degrees)))
        if elastic_prob:
            ops.append(T.ElasticDeform(alpha=float(elastic_alpha), sigma=float(elastic_sigma),
                                       prob=float(elastic_prob)))
        if color_jitter:
            x = float(color_jitter)
            ops.append(T.ColorJitter(brightness=x, contrast=x, saturation=x, hue=x / 2))
    ops.append(T.Normalize())
    return ops


def _cfg(data_cfg: Any, name: str, default: Any) -> Any:
    return data_cfg.get(name, default) if hasattr(data_cfg, "get") else getattr(data_cfg, name, default)


def train_options(data_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`train_iterator` from a ``config.data`` section."""
    keys = ("random_flip", "keep_aspect_ratio", "random_crop_scale", "scale_jitter", "rotation_degrees",
            "color_jitter", "elastic_prob", "elastic_alpha", "elastic_sigma")
    kw = {k: _cfg(data_cfg, k, None) for k in keys}
    ops = augment_ops(data_cfg.image_size, **{k: v for k, v in kw.items() if v is not None}, train=True)
    return {
        "ops": ops,
        "num_workers": _cfg(data_cfg, "num_workers", -1),
        "worker_ram_budget_gb": _cfg(data_cfg, "worker_ram_budget_gb", 0.0),
        "num_threads": _cfg(data_cfg, "num_threads", 2),
        "prefetch": _cfg(data_cfg, "prefetch_buffer", 4),
    }


def eval_options(data_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`eval_batches` from a ``config.data`` section."""
    ops = augment_ops(data_cfg.image_size, keep_aspect_ratio=_cfg(data_cfg, "keep_aspect_ratio", False), train=False)
    coarsen = eval_coarsen(data_cfg)
    if coarsen:
        ops.insert(-1, coarsen)  # after the resize, before Normalize
    return {"ops": ops, "num_threads": _cfg(data_cfg, "num_threads", 2)}


def eval_coarsen(data_cfg: Any) -> T.Coarsen | None:
    """The :class:`~jaxrat.data.transforms.Coarsen` op for ``data.eval_spacing`` (None at 1)."""
    spacing = float(_cfg(data_cfg, "eval_spacing", 1.0))
    if spacing < 1:
        raise ConfigError(f"config.data.eval_spacing={spacing}; use 1 (the input as it is) or more (coarser detail).")
    return T.Coarsen(spacing) if spacing != 1 else None


def _decode_target(image_size: int, ops: Sequence[Any]) -> tuple[int, int]:
    """Smallest decode size that loses nothing for ``ops`` (JPEG draft decoding)."""
    factor = 1.0
    for op in ops:
        if isinstance(op, T.RandomResizedCrop):
            factor *= 1 / math.sqrt(op.scale[0])
        elif isinstance(op, T.ScaleJitter):
            factor *= max(1.0, op.scale[1])
    side = int(math.ceil(image_size * factor))
    return side, side


def _with_decode_target(loader: Any, image_size: int, ops: Sequence[Any]) -> Any:
    """A loader with an unset ``at_least`` field (DecodePair and the like) set for ``ops``."""
    if dataclasses.is_dataclass(loader) and getattr(loader, "at_least", ()) is None:
        return dataclasses.replace(loader, at_least=_decode_target(image_size, ops))
    return loader


def _available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


# A worker is a spawned Python process with numpy, PIL and grain imported (about 0.2 GiB resident
# seen in a demo run; 0.3 GiB leaves headroom) plus its output buffer.
WORKER_BASE_BYTES = 300 << 20


def resolve_num_workers(num_workers: int, ram_budget_gb: float, example_bytes: int, buffer_elements: int,
                        processes_on_host: int = 1) -> int:
    """``num_workers >= 0`` is used as given; ``-1`` picks as many as this process's share of the
    CPU cores (one left for the train step) and the RAM budget (``ram_budget_gb``, or a quarter of
    the available RAM shared by the ``processes_on_host`` training processes of this machine) allow.

    A process pinned to some cores (SLURM ``--cpus-per-task`` with task affinity) already sees
    only its share; an unpinned one divides the machine by ``processes_on_host``.
    """
    if num_workers >= 0:
        return int(num_workers)
    if num_workers != -1:
        raise ConfigError(f"config.data.num_workers={num_workers}; use 0 (in-process), N, or -1 (auto).")
    machine = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    share = max(1, processes_on_host)
    if cores >= machine:
        cores = max(1, cores // share)
    budget = ram_budget_gb * (1 << 30) if ram_budget_gb > 0 else _available_ram_bytes() / 4 / share
    per_worker = WORKER_BASE_BYTES + buffer_elements * example_bytes
    n = max(0, min(cores - 1, int(budget // per_worker)))
    logging.info("data: %d worker processes (%d cores for this process, RAM budget %.1f GiB, ~%.0f MiB each)",
                 n, cores, budget / (1 << 30), per_worker / (1 << 20))
    return n


def _read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=max(num_threads, 0), prefetch_buffer_size=max(prefetch, 0))


# ---------------------------------------------------------------------------- training stream

class StreamIterator:
    """This host's batches; its checkpoint state is the next *global* element (JSON bytes), so it
    restores under any worker count. The underlying Grain iterator is built lazily."""

    def __init__(self, build: Callable[[int], Iterator], start_example: int, global_batch: int, process_count: int):
        self._build, self._next, self._gb, self._pc = build, start_example, global_batch, process_count
        self._it: Iterator | None = None

    def __iter__(self) -> StreamIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            self._it = self._build(self._next)
        try:
            batch = next(self._it)
        except DataError as e:
            # The message names the file, so the traceback adds nothing, and it (with Grain's unfiltered
            # copy in __cause__) reaches the frames of Grain's reader threads, whose elements hold worker
            # shared memory: kept alive, they make the exit warn of "leaked shared_memory" (see close).
            e.__cause__ = e.__context__ = None
            raise e.with_traceback(None) from None
        self._next += self._gb
        return batch

    @property
    def next_example(self) -> int:
        """Global index of the first element of the next batch."""
        return self._next

    def get_state(self) -> bytes:
        return json.dumps({"next_example": self._next}).encode()

    def set_state(self, state: bytes | str | dict) -> None:
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        self._next = int(state["next_example"])
        self._it = None

    def start_prefetch(self) -> None:
        """Called by Grain's checkpoint handler after a restore; prefetch starts on first next()."""

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close:
            close()
        self._it = None
        # A reader thread that stopped on an error keeps its last element in a reference cycle with
        # that error; collect it now, while its worker shared memory can still be unlinked.
        gc.collect()
        finish_shared_memory_unlinks()




def train_iterator(
    data: ExampleSource | Sequence[tuple[str, str]],
    *,
    image_size: int,
    local_batch: int,
    seed: int,
    process_index: int,
    process_count: int,
    start_example: int = 0,
    random_flip: bool = True,
    ops: Sequence[Any] | None = None,
    num_workers: int = 0,
    worker_ram_budget_gb: float = 0.0,
    num_threads: int = 2,
    prefetch: int = 4,
    processes_on_host: int = 1,
) -> StreamIterator:
    """Infinite iterator of this host's training batches, starting at global element ``start_example``.

    ``start_example`` must be a multiple of the global batch (``local_batch * process_count``).
    ``prefetch`` is in batches; ``processes_on_host`` (training processes on this machine) shares
    the cores and RAM among them when ``num_workers=-1``. ``ops`` (default: resize +
    ``random_flip``) run after decoding; see :func:`augment_ops`.
    """
    data = as_source(data)
    if not len(data):
        raise DataError("The training set is empty; check --config.data.data_dir.")
    ops = list(ops) if ops is not None else augment_ops(image_size, random_flip=random_flip)
    loader = _with_decode_target(data.loader, image_size, ops)
    gb = local_batch * process_count
    example_bytes = image_size * image_size * 4 * 4 * (2 if any(isinstance(o, T.Pyramid) for o in ops) else 1)
    workers = resolve_num_workers(num_workers, worker_ram_budget_gb, example_bytes, prefetch * local_batch,
                                  processes_on_host)

    def build(start: int) -> Iterator:
        ds = grain.MapDataset.source(data.records).seed(seed).shuffle().repeat(None)
        ds = _LoadWithFallback(ds, loader, data.policy)
        for op in ops:
            ds = ds.random_map(op) if isinstance(op, grain.transforms.RandomMap) else ds.map(op)
        ds = ProcessRows(ds, start, local_batch, process_index, process_count)
        # ``prefetch`` counts batches; Grain's buffer counts elements. A buffer smaller than a
        # batch lets the readers idle while the step runs, and the loop then waits for data.
        it = ds.to_iter_dataset(_read_options(num_threads, prefetch * local_batch))
        if workers > 0:
            _allow_grain_flags()
            per_worker = max(2, -(-prefetch * local_batch // workers))
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=per_worker),
                                worker_init_fn=worker_ignores_job_signals)
        return iter(it.batch(local_batch, drop_remainder=True))

    return StreamIterator(build, start_example, gb, process_count)


def _allow_grain_flags() -> None:
    # Grain workers read absl flags; outside absl.app.run (tests, notebooks) they are unparsed.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# ------------------------------------------------------------------------------------- eval

@dataclasses.dataclass(frozen=True)
class _EvalFetch(grain.transforms.Map):
    data: ExampleSource
    ops: tuple
    with_index: bool = False

    def map(self, i: int) -> T.Example:
        n = len(self.data)
        valid = i < n
        try:
            ex = self.data.loader.map(self.data.records[min(i, n - 1)])
        except BadFileError as e:
            self.data.policy.handle(e)  # raises under "fail"
            ex, valid = self._stand_in(i), False
        for op in self.ops:
            ex = op.map(ex)
        ex["valid"] = np.float32(valid)
        if self.with_index:
            ex["index"] = np.int32(min(i, n - 1))
        return ex

    def _stand_in(self, i: int) -> T.Example:
        """Padding for a skipped file: the next example that decodes, whatever fields the task's
        examples have (it is marked invalid, so its content never counts)."""
        n = len(self.data)
        for k in range(1, min(n, MAX_CONSECUTIVE_BAD) + 1):
            try:
                return self.data.loader.map(self.data.records[(i + k) % n])
            except BadFileError as e:
                self.data.policy.handle(e)
        raise DataError(f"{MAX_CONSECUTIVE_BAD} bad files in a row in {self.data.name or 'the evaluation set'} "
                        f"(see skipped_files.txt); the dataset looks broken: fix or re-download it.")


def eval_batches(
    data: ExampleSource | Sequence[tuple[str, str]],
    *,
    image_size: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    num_threads: int = 2,
    ops: Sequence[Any] | None = None,
    with_index: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """This host's eval batches; the set is padded to whole global batches and ``valid`` marks real
    examples, so every host runs the same number of eval steps and padding never counts. Under
    ``skip`` an undecodable file also counts as padding. ``with_index`` adds ``index`` (int32), the
    example's position in ``data`` (e.g. to read its mask again at the original resolution)."""
    data = as_source(data)
    if not len(data):
        raise DataError("The evaluation set is empty; check --config.data.data_dir.")
    ops = tuple(ops) if ops is not None else tuple(augment_ops(image_size, train=False))
    if any(isinstance(o, grain.transforms.RandomMap) for o in ops):
        raise ConfigError("Evaluation ops must be deterministic; remove random augmentations from them.")
    data = dataclasses.replace(data, loader=_with_decode_target(data.loader, image_size, ops))
    n = len(data)
    padded = -(-n // global_batch) * global_batch
    ds = grain.MapDataset.range(padded)[process_index::process_count].map(_EvalFetch(data, ops, with_index))
    local_batch = global_batch // process_count
    it = ds.to_iter_dataset(_read_options(num_threads, 2)).batch(local_batch, drop_remainder=True)
    return iter(it)


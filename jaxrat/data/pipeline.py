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

This module holds the iterators; what they are built from lives by concern: the sources
(:mod:`~jaxrat.data.example_source`), the augmentations (:mod:`~jaxrat.data.augmentation`), the
config's options (:mod:`~jaxrat.data.options`) and the worker count (:mod:`~jaxrat.data.workers`).
Their public names are importable from here as well, the pipeline's one front door.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np

from jaxrat.data import transforms as T
from jaxrat.data import workers
from jaxrat.data.augmentation import augment_ops
from jaxrat.data.example_source import MAX_CONSECUTIVE_BAD, ExampleSource, LoadWithFallback, as_source
from jaxrat.data.imageio import BadFileError
from jaxrat.data.options import eval_coarsen, eval_options, loader_options, train_options
from jaxrat.data.process_rows import ProcessRows
from jaxrat.data.workers import (
    finish_shared_memory_unlinks,
    resolve_num_workers,
    worker_ignores_job_signals,
    worker_shared_memory_used,
)
from jaxrat.runtime.errors import ConfigError, DataError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ExampleSource", "StreamIterator", "as_source", "augment_ops",
           "eval_batches", "eval_coarsen", "eval_options", "loader_options", "resolve_num_workers", "train_iterator",
           "train_options", "workers"]

IMAGENET_MEAN = np.array(T.IMAGENET_MEAN, np.float32)
IMAGENET_STD = np.array(T.IMAGENET_STD, np.float32)


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
        # that error; collect it now, while its worker shared memory can still be unlinked. Without
        # workers there is no shared memory to unlink, and a full collection is a tenth of a second.
        if worker_shared_memory_used():
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
        ds = LoadWithFallback(ds, loader, data.policy)
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


"""One split of a dataset as the pipeline reads it (:class:`ExampleSource`), and the read of its
records that steps over bad files under the "skip" policy (:mod:`jaxrat.data.badfiles`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain

from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError
from jaxrat.data.sources.isic import DecodePair
from jaxrat.runtime.errors import DataError

# Consecutive bad elements tolerated under "skip" before giving up: a dataset that is mostly
# broken should stop the run, not spin.
MAX_CONSECUTIVE_BAD = 64


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


class LoadWithFallback(grain.MapDataset):
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

"""Which elements of the global training stream each host reads."""

from __future__ import annotations

import grain


class ProcessRows(grain.MapDataset):
    """This process's rows of each global batch: batch ``b`` is elements ``start + b*G ... + G - 1``
    of ``parent`` (``G = local_batch * process_count``) and process ``p`` takes its ``p``-th run of
    ``local_batch`` consecutive ones. The global batch the trainer assembles (process 0's rows first)
    is then in the same row order on any process count, which fixed reduction shards rely on."""

    def __init__(self, parent: grain.MapDataset, start: int, local_batch: int, process_index: int,
                 process_count: int):
        super().__init__(parent)
        self._start, self._local, self._index, self._count = start, local_batch, process_index, process_count

    def __len__(self) -> int:
        return max(0, len(self._parent) - self._start) // self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        batch, row = divmod(index, self._local)
        return self._parent[self._start + (batch * self._count + self._index) * self._local + row]

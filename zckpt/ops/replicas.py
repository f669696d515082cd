"""Copies of one tensor that a checkpoint keeps in several places and that must hold the same
bits: a tied param that several pipeline stages each keep, a param every tensor rank holds whole
(``CheckpointIndex.replicas``).
Outputs write each name once; this is the check that the copy left out was the same.
"""

from __future__ import annotations

import numpy as np

from ..core.index import CheckpointIndex, Entry
from ..io.reading import FileReader, read_range

_CHUNK = 1 << 22  # elements compared at a time: memory stays bounded whatever the tensor's size


def replica_problems(index: CheckpointIndex, reader: FileReader | None = None) -> list[str]:
    """One line per replica that differs from the entry of its name (shape, dtype or bits)."""
    kept = {e.name: e for e in index.entries}
    problems = []
    own = reader is None
    reader = reader or FileReader()
    try:
        for replica in index.replicas:
            entry = kept.get(replica.name)
            if entry is None:
                continue
            differs = _difference(reader, entry, replica)
            if differs:
                problems.append(
                    f"{_where(replica)}: its copy of {replica.name} {differs} the copy in {_where(entry)}: "
                    "the copies of a param that several ranks keep must be equal (a file is from another save, or damaged)"
                )
    finally:
        if own:
            reader.close()
    return problems


def _where(entry: Entry) -> str:
    return entry.source.segments[0].path if entry.source.segments else entry.name


def _difference(reader: FileReader, a: Entry, b: Entry) -> str | None:
    """How `b`'s tensor differs from `a`'s, or None when the bits are equal."""
    if (a.source.shape, a.source.dtype) != (b.source.shape, b.source.dtype):
        return f"is {b.source.dtype.name} {list(b.source.shape)}, not {a.source.dtype.name} {list(a.source.shape)} as"
    numel, unequal = a.source.numel, 0
    for start in range(0, numel, _CHUNK):
        count = min(_CHUNK, numel - start)
        left = np.empty(count, dtype=a.source.dtype.numpy_raw)
        right = np.empty(count, dtype=b.source.dtype.numpy_raw)
        read_range(reader, a.source, start, left)
        read_range(reader, b.source, start, right)
        # compared as bytes, element by element: NaN payloads and -0.0 count as they are stored
        itemsize = a.source.dtype.itemsize
        unequal += int(np.count_nonzero((left.view(np.uint8) != right.view(np.uint8)).reshape(count, itemsize).any(1)))
    return f"differs in {unequal} of {numel} elements from" if unequal else None

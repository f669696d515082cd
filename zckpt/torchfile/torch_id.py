"""torch.save's own ``.data/serialization_id``, so that a streamed archive is byte-identical to
what ``torch.save`` writes (the archive writer's default id is a hash of its own; see :mod:`.save`).

Why it can be reproduced: torch 2.x (``PyTorchStreamWriter::writeSerializationId``) writes 40
digits, nothing random: 20 of ``c10::hash_combine`` over the hashes of the record names written
(in the iteration order of a C++ ``unordered_set``), then 20 of ``hash_combine`` over the CRC-32
of every record, taken in writing order from the zip data descriptors as they pass through its
write callback. The name half depends only on the set of names, that is on the number of
storages, so torch itself is asked for it once per count (a few empty-sized tensors saved to
memory); the CRC half is computed here from the CRCs the writer already has. One quirk is kept:
a record of 8 bytes or more whose data begins like a data descriptor (``PK\\x07\\x08``) is taken
by torch's callback as one too, its bytes 4-8 mixed in as a CRC.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import zipfile
from typing import Callable

import numpy as np

from ..io.materialize import convert
from ..io.reading import FileReader
from .pickler import Copy, Inline, OutStorage
from .save import Record

_MASK = (1 << 64) - 1
_DESCRIPTOR = b"PK\x07\x08"


def hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


@functools.lru_cache(maxsize=64)
def names_hash(storages: int) -> bytes:
    """The 20 name-hash digits of an archive with `storages` storages, as torch computes them."""
    import torch

    buffer = io.BytesIO()
    torch.save([torch.zeros(1) for _ in range(storages)], buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        last = archive.infolist()[-1]
        if not last.filename.endswith("/.data/serialization_id"):
            raise RuntimeError(f"torch {torch.__version__} wrote no serialization id last")
        return archive.read(last)[:20]


def torch_serialization_id(
    storages: dict[str, OutStorage], reader: FileReader
) -> Callable[[tuple[Record, ...], list[int]], bytes]:
    """The id function for :attr:`.save.ArchivePlan.serialization_id`: `storages` are the plan's."""

    def serialization_id(records: tuple[Record, ...], crcs: list[int]) -> bytes:
        combined = 0
        for record, crc in zip(records, crcs):
            if record.size >= 8:
                head = (
                    record.content[:8]
                    if record.content is not None
                    else _head(storages[record.storage_key or ""], reader)
                )
                if head[:4] == _DESCRIPTOR:
                    combined = hash_combine(combined, struct.unpack("<I", head[4:8])[0])
            combined = hash_combine(combined, crc)
        return names_hash(len(storages)) + f"{combined:020d}".encode()

    return serialization_id


def _head(storage: OutStorage, reader: FileReader, count: int = 8) -> bytes:
    """The first `count` bytes of a storage as written (re-read raw: not fed to the record checks,
    which saw these bytes when the storage was written)."""
    out = bytearray()
    for part in storage.parts:
        if len(out) >= count:
            break
        if isinstance(part, Inline):
            out += part.data[:count]
        elif isinstance(part, Copy):
            source = part.source_dtype
            numel = min(part.numel, -(-count // storage.dtype.itemsize))
            raw = np.empty(numel * source.itemsize, dtype=np.uint8)
            fd, done = reader.descriptor(part.segment.path), 0
            while done < raw.nbytes:
                got = os.preadv(fd, [memoryview(raw)[done:]], part.segment.offset + done)
                if got == 0:
                    break
                done += got
            out += np.ascontiguousarray(convert(raw.view(np.dtype(source.numpy_raw)), source, storage.dtype)).tobytes()
        else:  # Zeros
            out += bytes(min(part.numel * storage.dtype.itemsize, count))
    return bytes(out[:count])

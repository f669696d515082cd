"""Streaming, deterministic writer of ``torch.save`` archives, without torch tensors in memory.

Why not ``torch.save``: it needs every tensor in memory and pickles real objects, so writing a
DeepSpeed ``optim_states`` file would mean holding a rank's whole optimizer state and having
DeepSpeed's classes importable. Here the pickle is produced from plain descriptions
(``zckpt.torchfile.pickler``: classes named by :class:`GlobalName`, tensors as :class:`OutTensor`
lists of file segments, zeros and inline bytes), the archive is planned with every offset known
(``zckpt.torchfile.ziparchive``; so free space can be checked first), and tensor bytes are then streamed
through one reused buffer, read from their source exactly once, CRC-32 computed on the way.

The output is byte-identical to what ``torch.save`` (2.x) writes for the same objects, except
the content of ``.data/serialization_id``, which torch fills with a random number and this
writer derives from a hash of the pickle and the record sizes, so the same input always gives
the same file.
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..core.dtypes import DType
from ..core.errors import CorruptFileError
from ..core.index import Segment
from ..io.checksums import crc32_combine
from ..io.direct_write import DirectFile, open_output
from ..io.materialize import CHUNK_BYTES, convert, write_all
from ..io.reading import FileReader
from ..io.workers import WorkerPool
from . import ziparchive
from .pickler import (
    Copy,
    GlobalName,
    Inline,
    OutStorage,
    OutTensor,
    Part,
    PickledEnum,
    PickledInstance,
    PickledReduce,
    Zeros,
    pickle_tree,
    torch_size,
)

__all__ = [
    "ArchivePlan",
    "Copy",
    "GlobalName",
    "Inline",
    "OutStorage",
    "OutTensor",
    "Part",
    "PickledEnum",
    "PickledInstance",
    "PickledReduce",
    "RawPlan",
    "Record",
    "Zeros",
    "archive_name_for",
    "plan_archive",
    "plan_raw",
    "save",
    "torch_size",
    "write_archive",
    "write_archives",
    "write_raw",
]

_PARALLEL_CRC_BYTES = 1 << 20  # chunks from this size on are checksummed while being written
_DIRECT_READ_BYTES = 4 << 20  # one read (and one checksum task) into a direct file's buffer


@dataclass(frozen=True)
class Record:
    """One zip record of the planned archive."""

    name: str  # full name in the zip, e.g. "model/data/0"
    size: int
    header_offset: int
    data_offset: int  # where its first byte lands (64-byte aligned)
    content: bytes | None  # small records' bytes; None for a tensor storage
    storage_key: str | None = None  # "0", "1", ... for tensor storages


@dataclass(frozen=True)
class ArchivePlan:
    """Everything about an archive but the tensor bytes: pickle, records, offsets, file size."""

    archive_name: str
    pickle: bytes
    records: tuple[Record, ...]
    total_size: int  # bytes of the finished file
    storages: Mapping[str, OutStorage] = field(repr=False)  # storage key -> storage, in pickling order
    # torch's own serialization id (:mod:`.torch_id`): the last record's 40 bytes computed while
    # writing, from the records before it and their CRC-32s; None keeps the planned content
    serialization_id: Callable[[tuple[Record, ...], list[int]], bytes] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (what `progress` counts up to)."""
        return sum(s.nbytes for s in self.storages.values())


FORMAT_VERSION = b"1"
VERSION = b"3\n"
BYTEORDER = b"little"


def archive_name_for(path: str | os.PathLike[str]) -> str:
    """The archive name torch.save gives a file at `path`: its base name up to the last dot.

    A non-ASCII path makes torch write through a Python stream, and then the name is "archive".
    Pass the final name when writing to a temporary path that is renamed afterwards.
    """
    text = os.fspath(path)
    if not text.isascii():
        return "archive"
    base = text.replace("\\", "/").rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0] if "." in base else base
    if not stem:
        raise ValueError(f"torch cannot name an archive after {text!r}")
    return stem


def plan_archive(obj: Any, archive_name: str) -> ArchivePlan:
    """Pickle `obj` as torch.save would and lay out every record. Pure: reads no tensor bytes.

    Raises ValueError for a tensor whose parts do not add up to its shape, TypeError for an
    object the writer cannot pickle.
    """
    if not archive_name or not archive_name.isascii() or "/" in archive_name or "\\" in archive_name:
        raise ValueError(f"bad archive name {archive_name!r}")
    data, storages = pickle_tree(obj)
    prefix = archive_name + "/"
    small = [
        ("data.pkl", data),
        (".format_version", FORMAT_VERSION),
        (".storage_alignment", str(ziparchive.ALIGNMENT).encode()),
        ("byteorder", BYTEORDER),
    ]
    entries: list[tuple[str, int, bytes | None, str | None]] = [(prefix + n, len(c), c, None) for n, c in small]
    entries += [(f"{prefix}data/{key}", storage.nbytes, None, key) for key, storage in storages.items()]
    entries.append((prefix + "version", len(VERSION), VERSION, None))
    digest = hashlib.sha256(data)
    for name, size, _, _ in entries:
        digest.update(f"{name}\0{size}\n".encode())
    h = digest.digest()
    serialization_id = f"{int.from_bytes(h[:8], 'little'):020d}{int.from_bytes(h[8:16], 'little'):020d}".encode()
    entries.append((prefix + ".data/serialization_id", len(serialization_id), serialization_id, None))

    layouts = ziparchive.layout([(name, size) for name, size, _, _ in entries])
    records = tuple(
        Record(lay.name, lay.size, lay.header_offset, lay.data_offset, content, key)
        for lay, (_, _, content, key) in zip(layouts, entries)
    )
    total = layouts[-1].end_offset + ziparchive.directory_size(layouts)
    return ArchivePlan(archive_name, data, records, total, storages)


def write_archive(
    path: str | os.PathLike[str], plan: ArchivePlan, reader: FileReader, progress: Callable[[int], None] | None = None
) -> None:
    """Write the planned archive at `path` (created or truncated), streaming tensor bytes.

    `progress` is called with the number of tensor bytes written since its last call. Memory
    stays one reused buffer (materialize.CHUNK_BYTES) whatever the tensor sizes; two helper
    threads read ahead and checksum while this one writes. Every source byte is read once.
    OSErrors propagate; the caller owns temporary names, fsync and renaming.
    """
    write_archives(path, [plan], reader, progress)


def write_archives(
    path: str | os.PathLike[str],
    plans: Sequence[ArchivePlan],
    reader: FileReader,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write planned archives one after another at `path` (created or truncated), as
    :func:`write_archive` writes one: a file of several archives is what torch.save writes into
    one stream, torch.distributed.checkpoint's ``.distcp`` files (each archive's offsets count
    from its own first byte, as torch's do). One stream for all: the same buffers, direct I/O
    for the whole file where the filesystem takes it."""
    total = sum(plan.total_size for plan in plans)
    fd, direct = open_output(path, total)
    try:
        with WorkerPool(3 if direct else 2, "zckpt-torchsave") as helpers:
            stream = _TensorStream(fd, reader, progress or (lambda _n: None), helpers, direct=direct)
            for plan in plans:
                _write_records(plan, stream)
            stream.finish(total)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RawPlan:
    """A file of a tensor's raw little-endian bytes, no pickle, no zip (DeepSpeed's NVMe swap
    files), streamed like an archive's storages."""

    storage: OutStorage

    @property
    def total_size(self) -> int:
        return self.storage.nbytes

    @property
    def tensor_bytes(self) -> int:
        return self.storage.nbytes


def plan_raw(tensor: OutTensor) -> RawPlan:
    """The raw file of `tensor`'s elements. Pure; ValueError when its parts do not fill it."""
    storage = OutStorage(tensor.dtype, tuple(tensor.parts))
    if tensor.storage is not None or storage.numel != math.prod(tensor.shape):
        raise ValueError(f"a raw file needs a tensor's own parts: {storage.numel} elements for shape {tensor.shape}")
    return RawPlan(storage)


def write_raw(
    path: str | os.PathLike[str], plan: RawPlan, reader: FileReader, progress: Callable[[int], None] | None = None
) -> None:
    """Write the planned raw file at `path` (created or truncated), through the same stream as
    archive storages: one reused buffer, every source byte read once (and CRC-checked by the
    reader's checker)."""
    fd, direct = open_output(path, plan.total_size)
    try:
        with WorkerPool(3 if direct else 2, "zckpt-torchsave") as helpers:
            stream = _TensorStream(fd, reader, progress or (lambda _n: None), helpers, direct=direct)
            stream.write(plan.storage)
            stream.finish(plan.total_size)
    finally:
        os.close(fd)


def _write_records(plan: ArchivePlan, stream: _TensorStream) -> None:
    layouts = ziparchive.layout([(r.name, r.size) for r in plan.records])
    crcs = []
    pending = bytearray()  # small writes are gathered into one system call
    for record, lay in zip(plan.records, layouts):
        if (lay.header_offset, lay.data_offset) != (record.header_offset, record.data_offset):
            raise ValueError(f"plan record {record.name} does not match the zip layout")
        pending += ziparchive.local_header(lay)
        if record.content is not None:
            content = record.content
            if plan.serialization_id is not None and record is plan.records[-1]:
                content = plan.serialization_id(plan.records[:-1], crcs)
                if len(content) != record.size:
                    raise ValueError(f"serialization id of {len(content)} bytes, planned {record.size}")
            crc = zlib.crc32(content)
            pending += content
        else:
            stream.put(pending)
            pending.clear()
            crc = stream.write(plan.storages[record.storage_key or ""])
        pending += ziparchive.data_descriptor(lay, crc)
        crcs.append(crc)
    pending += ziparchive.directory(layouts, crcs)
    stream.put(pending)


def save(obj: Any, path: str | os.PathLike[str], reader: FileReader | None = None) -> None:
    """Plan and write `obj` at `path`, named as torch.save would name it."""
    plan = plan_archive(obj, archive_name_for(path))
    if reader is not None:
        write_archive(path, plan, reader)
        return
    with FileReader() as own:
        write_archive(path, plan, own)


class _TensorStream:
    """Writes storages' parts through one reused buffer, returning each storage's CRC-32.

    Three things happen at once, on halves of the buffer: the next chunk is read (a helper
    thread), the current one is checksummed (another) and written (this thread). pread, write
    and zlib.crc32 all release the GIL, so this runs at the speed of the slowest of the three
    rather than of their sum.

    No kernel-side copies (copy_file_range): every byte's CRC-32 is needed for its output record
    (and for its input record's check), so a kernel copy costs a second read of each byte; read
    into the buffer they are written from, bytes are read once per job (issue 36: a torchrun
    process's reads no more than its share).

    With `direct` (an O_DIRECT descriptor, :mod:`zckpt.io.direct_write`), bytes are read straight
    into the aligned buffers that are written to the disk, checksummed there on a helper thread:
    one copy per byte, none through the page cache.
    """

    def __init__(
        self, fd: int, reader: FileReader, progress: Callable[[int], None], helpers: WorkerPool, *, direct: bool = False
    ) -> None:
        self.fd, self.reader, self.progress, self.helpers = fd, reader, progress, helpers
        self._buffer: np.ndarray | None = None
        self.direct = DirectFile(fd, helpers) if direct else None

    def put(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes outside tensor storages (zip headers, small records)."""
        if self.direct is not None:
            self.direct.write(data)
        else:
            write_all(self.fd, data)

    def finish(self, planned_size: int) -> None:
        """Every byte on its way to the file; the file exactly `planned_size` long."""
        if self.direct is not None:
            self.direct.finish()
        written = os.lseek(self.fd, 0, os.SEEK_END)
        if written != planned_size:
            raise AssertionError(f"wrote {written} bytes, planned {planned_size}")

    def _scratch(self) -> memoryview:
        if self._buffer is None:
            self._buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
        return memoryview(self._buffer)

    def _emit(self, data: memoryview | bytes, crc: int) -> int:
        pending = self.helpers.submit(zlib.crc32, data, crc) if len(data) >= _PARALLEL_CRC_BYTES else None
        self.put(data)
        self.progress(len(data))
        return pending.result() if pending is not None else zlib.crc32(data, crc)

    def write(self, storage: OutStorage) -> int:
        crc = 0
        for part in storage.parts:
            if isinstance(part, Inline):
                if part.data:
                    crc = self._emit(part.data, crc)
            elif isinstance(part, Zeros):
                left = part.numel * storage.dtype.itemsize
                while left:
                    view = self._scratch()[: min(left, CHUNK_BYTES)]
                    np.frombuffer(view, dtype=np.uint8).fill(0)
                    crc = self._emit(view, crc)
                    left -= len(view)
            else:
                crc = self._copy(part, storage.dtype, crc)
        return crc

    def _copy(self, part: Copy, dtype: DType, crc: int) -> int:
        source = part.source_dtype
        if source == dtype:
            nbytes = part.segment.numel * source.itemsize
            if self.direct is not None:
                return self._direct_copy(part.segment.path, part.segment.offset, nbytes, crc)
            for view in self._read_ahead(part.segment, source.itemsize, CHUNK_BYTES // 2):
                crc = self._emit(view, crc)
            return crc
        # A conversion allocates its output and numpy temporaries: smaller chunks bound them.
        chunk = CHUNK_BYTES // 8 * source.itemsize // max(source.itemsize, dtype.itemsize)
        for view in self._read_ahead(part.segment, source.itemsize, chunk):
            out = convert(np.frombuffer(view, dtype=np.dtype(source.numpy_raw)), source, dtype)
            crc = self._emit(memoryview(np.ascontiguousarray(out)).cast("B"), crc)
        return crc

    def _direct_copy(self, path: str, offset: int, nbytes: int, crc: int) -> int:
        """Read the bytes into the direct file's buffer; checksum each read on a helper thread
        (the output record's CRC and the input record's check come from the same pass)."""
        src = self.reader.descriptor(path)
        checker = self.reader.checker
        windows: list[tuple[Future[int], int, int]] = []

        def settle(keep: int) -> None:
            nonlocal crc
            while len(windows) > keep:
                future, position, count = windows.pop(0)
                window = future.result()
                crc = crc32_combine(crc, window, count)
                if checker is not None:
                    checker.feed_crc(path, position, count, window)

        done = 0
        while done < nbytes:
            view = self.direct.space()[: min(_DIRECT_READ_BYTES, nbytes - done)]
            position = offset + done
            got = 0
            while got < len(view):
                count = os.preadv(src, [view[got:]], position + got)
                if count == 0:
                    raise CorruptFileError(
                        path, f"truncated: {nbytes} bytes expected at offset {offset}, file ends sooner"
                    )
                got += count
            future = self.helpers.submit(zlib.crc32, view)
            self.direct.advance(len(view), future)
            windows.append((future, position, len(view)))
            self.progress(len(view))
            done += len(view)
            settle(4)
        settle(0)
        return crc

    def _read_ahead(self, segment: Segment, itemsize: int, chunk_bytes: int) -> Iterator[memoryview]:
        """The segment's bytes in chunks of whole elements, alternating between the buffer's two
        halves; the next chunk is read while the caller uses the current one."""
        step = max(1, min(chunk_bytes, CHUNK_BYTES // 2) // itemsize) * itemsize
        buffer = self._scratch()
        halves = (buffer[:step], buffer[step : 2 * step])
        total = segment.numel * itemsize
        starts = range(0, total, step)
        if len(starts) == 1:  # one chunk (a rank's slice of a param: thousands of them in a ZeRO-3
            # reshard): read here, where a helper thread's round trip would cost more than the read
            view = halves[0][:total]
            self.reader.read_into(segment.path, segment.offset, view)
            yield view
            return

        def read(index: int) -> Future[memoryview]:
            view = halves[index % 2][: min(step, total - starts[index])]
            return self.helpers.submit(self.reader.read_into, segment.path, segment.offset + starts[index], view)

        pending = read(0) if starts else None
        for index in range(len(starts)):
            assert pending is not None
            pending.result()
            view = halves[index % 2][: min(step, total - starts[index])]
            pending = read(index + 1) if index + 1 < len(starts) else None
            yield view

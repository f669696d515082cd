"""Moving bytes from files into buffers: positional reads into caller-owned memory.

Why pread and not mmap: mapped pages count towards a process's resident memory until they are
unmapped, so touching a 100 GB optimizer file through mmap inflates RSS by what was read; a
pread into a reused buffer keeps memory bounded by the buffer and still reads only the bytes
that are needed.
"""

from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any

import numpy as np

from ..core.dtypes import DType
from ..core.errors import CorruptFileError, UsageError
from ..core.index import Segment, TensorRef, TensorSource
from .checksums import RecordChecker


class FileReader:
    """Keeps read-only descriptors open while a job runs, at most `max_open` at once (a
    checkpoint of a thousand ranks must not exhaust the process's descriptor limit).

    With `verify` (the default), every byte read is checksummed against the CRC-32 of the zip
    record it lies in (:mod:`zckpt.io.checksums`); the records touched are checked whole when the
    reader is closed without an error, or earlier by :meth:`verify_now`. A `checker` shared by
    several readers (the threads of one job) is checked by its owner instead.
    """

    def __init__(self, max_open: int = 128, *, verify: bool = True, checker: RecordChecker | None = None) -> None:
        self._fds: dict[str, int] = {}  # in order of last use
        self._max_open = max_open
        self.checker = checker if checker is not None else (RecordChecker() if verify else None)
        self._owns_checker = checker is None

    def descriptor(self, path: str) -> int:
        """An open read-only descriptor of `path` (valid until max_open others are opened)."""
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= self._max_open:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CorruptFileError(path, f"cannot open: {exc.strerror}") from None
        self._fds[path] = fd
        return fd

    def read_into(self, path: str, offset: int, dest: memoryview) -> None:
        """Fill `dest` with the bytes of `path` at `offset`; a short file is an error."""
        fd = self.descriptor(path)
        done, total = 0, len(dest)
        while done < total:
            count = os.preadv(fd, [dest[done:]], offset + done)
            if count == 0:
                raise CorruptFileError(path, f"truncated: {total} bytes expected at offset {offset}, file ends sooner")
            done += count
        if self.checker is not None:
            self.checker.feed(path, offset, dest)

    def touch(self, path: str, offset: int, nbytes: int) -> None:
        """Bytes of `path` used without passing through this process (a kernel-side copy):
        their records are read and checked by :meth:`verify_now` or on close."""
        if self.checker is not None:
            self.checker.touch(path, offset, nbytes)

    def verify_now(self) -> None:
        """Check the records read so far (CorruptFileError naming the first damaged one)."""
        if self.checker is not None:
            self.checker.finish()

    def read_segments(self, dtype: DType, segments: tuple[Segment, ...] | list[Segment], dest: np.ndarray) -> None:
        """Read the concatenation of `segments` into the raw array `dest` (exactly as long)."""
        raw = memoryview(dest.view(np.uint8).reshape(-1))
        position = 0
        for segment in segments:
            nbytes = segment.numel * dtype.itemsize
            self.read_into(segment.path, segment.offset, raw[position : position + nbytes])
            position += nbytes
        if position != raw.nbytes:
            raise ValueError(f"segments hold {position} bytes, buffer has {raw.nbytes}")

    def read_source(self, source: TensorSource) -> np.ndarray:
        """A fresh raw numpy array (bf16 as uint16) holding the whole tensor, flat."""
        out = np.empty(source.numel, dtype=np.dtype(source.dtype.numpy_raw))
        self.read_segments(source.dtype, source.segments, out)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None and self._owns_checker:
                self.verify_now()
        finally:
            self.close()


def source_of(ref: TensorRef) -> TensorSource:
    """The TensorSource of a tensor stored whole in one file (it must be contiguous)."""
    if not ref.is_contiguous:
        raise CorruptFileError(ref.path, f"non-contiguous tensor of shape {list(ref.shape)} is not supported")
    return TensorSource(ref.dtype, ref.shape, (Segment(ref.path, ref.offset, ref.numel),) if ref.numel else ())


def read_ref(reader: FileReader, ref: TensorRef) -> np.ndarray:
    """Read a small whole tensor (a buffer, a step counter) as a raw numpy array of its shape."""
    return reader.read_source(source_of(ref)).reshape(ref.shape)


def read_range(reader: FileReader, source: TensorSource, start: int, dest: np.ndarray) -> None:
    """Fill the raw array `dest` with elements ``start .. start + len(dest)`` of `source`
    (elements in file order, across its segments)."""
    raw = memoryview(dest.view(np.uint8).reshape(-1))
    itemsize = source.dtype.itemsize
    wanted_end = start + dest.size
    position = 0  # element index where the current segment begins
    filled = 0
    for segment in source.segments:
        end = position + segment.numel
        if end > start and position < wanted_end:
            first = max(start, position)
            count = min(end, wanted_end) - first
            reader.read_into(
                segment.path,
                segment.offset + (first - position) * itemsize,
                raw[filled * itemsize : (filled + count) * itemsize],
            )
            filled += count
        position = end
        if position >= wanted_end:
            break
    if filled != dest.size:
        raise CorruptFileError(
            source.segments[0].path if source.segments else None, f"holds {position} elements, {wanted_end} expected"
        )


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in the file at `path` (`what` names it in errors: "DeepSpeed config").
    A missing file is a usage error; unreadable or non-object JSON is a corrupt file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise UsageError(path, f"{what} not found") from None
    except (OSError, ValueError) as exc:
        raise CorruptFileError(path, f"not a JSON {what} ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptFileError(path, "not a JSON object")
    return data

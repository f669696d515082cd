"""Turn a TensorSource into bytes in a file, or into a torch tensor, in a chosen dtype.

Streaming keeps memory bounded: same-dtype copies move file to file in the kernel
(``copy_file_range``); dtype conversions (and copies where the kernel cannot) stream in small
chunks through a few reused buffers, which gives the same bits as converting the whole tensor
(conversion is elementwise).
"""

from __future__ import annotations

import errno
import os
from collections import deque
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ..core.dtypes import BF16, FP16, FP32, DType
from ..core.errors import CorruptFileError
from ..core.index import Segment, TensorSource
from .checksums import checksum_range
from .reading import FileReader, read_range
from .workers import WorkerPool

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 * 1024 * 1024
# Chunks of a streamed conversion, each read, checksummed and written whole, and converted in
# blocks of _BLOCK elements whose passes stay in the CPU's cache (1 MiB of L2 per core here):
# 64 MiB chunks went through DRAM at every pass and took 3x longer (BENCHMARKS.md, 16-bit
# output); chunks of 2 MiB rather than 1 halve the per-chunk overhead for 10 MiB more memory.
STREAM_CHUNK_BYTES = 2 << 20
_IN_FLIGHT = 4  # chunks being read and converted by the helper threads, or waiting to be written
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


def numpy_to_torch(raw: np.ndarray, dtype: DType) -> "torch.Tensor":
    """A torch tensor sharing `raw`'s memory (bf16 arrives as raw uint16)."""
    import torch

    if dtype == BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)


def convert(
    raw: np.ndarray, source: DType, target: DType, out: np.ndarray | None = None, scratch: np.ndarray | None = None
) -> np.ndarray:
    """Cast raw elements from `source` to `target` with torch's rounding (round to nearest even).

    Widening 16-bit floats to fp32 is exact and done in numpy (bf16 is the top half of an fp32),
    so fp32 output never needs torch; fp32 -> bf16/fp16 is numpy arithmetic that gives torch's
    bits (:func:`fp32_to_bf16`, :func:`fp32_to_fp16`); the rest, and chunks holding a NaN, go
    through torch. `out` (room for `raw`'s elements in `target`) and `scratch` (uint32; the
    narrowing goes through it in blocks of half its length) are optional reused buffers for the
    numpy narrowings; the result may be a view of `out` or a new array.
    """
    if source == target:
        return raw
    if target == FP32 and source == BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if target == FP32 and source == FP16:
        widened = raw.astype(np.float32)
        nan = np.isnan(widened)
        if nan.any():  # the CPU's conversion (torch's) quiets signalling NaNs; numpy keeps them
            widened.view(np.uint32)[nan] |= 0x00400000
        return widened
    if source == FP32 and target == BF16 and (rounded := fp32_to_bf16(raw, out, scratch)) is not None:
        return rounded
    if source == FP32 and target == FP16 and (rounded := fp32_to_fp16(raw, out, scratch)) is not None:
        return rounded
    import torch

    converted = numpy_to_torch(raw, source).to(target.torch())
    if target == BF16:
        return converted.view(torch.int16).numpy().view(np.uint16)
    return converted.numpy()


def unequal_elements(reader: FileReader, reference: TensorSource, other: TensorSource, chunk: int) -> int:
    """How many elements of `other` differ in their stored bits from `reference`'s converted to
    `other`'s dtype (unchanged where the dtypes agree: NaN payloads and -0.0 count as stored),
    read `chunk` elements at a time so that memory stays bounded whatever the tensor's size.
    The two hold `other.numel` elements each."""
    return sum(_unequal(converted, kept) for _, converted, kept in _compared_chunks(reader, reference, other, chunk))


def _compared_chunks(
    reader: FileReader, reference: TensorSource, other: TensorSource, chunk: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(start, reference's elements converted to other's dtype, other's elements)``, `chunk`
    elements at a time (raw arrays of other's element size)."""
    for start in range(0, other.numel, chunk):
        count = min(chunk, other.numel - start)
        wide = np.empty(count, dtype=reference.dtype.numpy_raw)
        kept = np.empty(count, dtype=other.dtype.numpy_raw)
        read_range(reader, reference, start, wide)
        read_range(reader, other, start, kept)
        yield start, convert(wide, reference.dtype, other.dtype), kept


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def unequal_columns(
    reader: FileReader, reference: TensorSource, other: TensorSource, columns: int, chunk: int
) -> tuple[int, np.ndarray]:
    """:func:`unequal_elements` of a row-major 2-D `other` with `columns` columns, and which of
    its columns hold an unequal element (a bool per column), read `chunk` elements at a time."""
    unequal = 0
    changed = np.zeros(columns, dtype=bool)
    for start, converted, kept in _compared_chunks(reader, reference, other, chunk):
        bits = _BITS[kept.dtype.itemsize]  # the 16-bit copies' (complex ones are never rounded copies)
        where = np.flatnonzero(converted.view(bits) != kept.view(bits))
        unequal += where.size
        changed[(where + start) % columns] = True
    return unequal, changed


def all_zero(reader: FileReader, source: TensorSource, chunk: int) -> bool:
    """Whether every element of `source` is zero as a value (-0.0 too), read `chunk` elements at a
    time: memory stays bounded, and the first nonzero chunk ends the read."""
    dtype = source.dtype
    bits = _BITS.get(dtype.itemsize) if not dtype.name.startswith("complex") else None
    # a float's bits less its sign bit (-0.0 is zero); any other dtype's bits whole
    mask = ((1 << (8 * dtype.itemsize - 1)) - 1) if bits is not None and dtype.is_floating else None
    for start in range(0, source.numel, chunk):
        raw = np.empty(min(chunk, source.numel - start), dtype=dtype.numpy_raw)
        read_range(reader, source, start, raw)
        if bits is None:
            nonzero = bool(raw.view(np.uint8).any())
        else:
            view = raw.view(bits)
            nonzero = bool((view & bits(mask)).any() if mask is not None else view.any())
        if nonzero:
            return False
    return True


def _unequal(left: np.ndarray, right: np.ndarray) -> int:
    """How many elements of two raw arrays of one element size differ in their stored bits (as
    unsigned integers of that size: 40x faster than comparing bytes and grouping them)."""
    bits = _BITS.get(left.dtype.itemsize)
    if bits is None:  # complex128: 16 bytes an element
        width = left.dtype.itemsize
        return int(np.count_nonzero((left.view(np.uint8) != right.view(np.uint8)).reshape(-1, width).any(1)))
    return int(np.count_nonzero(left.view(bits) != right.view(bits)))


# Why numpy and not torch for fp32 -> 16 bits: torch's threaded .to() spent more time waking its
# threads than converting (BENCHMARKS.md), and importing torch alone costs ~200 MB of RSS. The
# arithmetic runs in place, block by block, in a uint32 scratch of cache size: the passes then
# stay in the CPU cache, and a whole tensor needs no more memory than its output. NaN is the
# exception: torch's NaN bits depend on its build and CPU (bf16: 0xFFFF from its AVX kernels,
# 0x7FC0 from its scalar code; fp16: the CPU's payload truncation), so an array holding one
# goes through torch. The NaN test is a max(): a NaN propagates through it, in one pass that
# writes nothing.

_BLOCK = 1 << 18  # elements per block: 1 MiB of fp32


def fp32_to_bf16(
    raw: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None
) -> np.ndarray | None:
    """fp32 -> bf16 bits (as uint16) exactly as torch rounds finite and infinite values (round
    to nearest even: add 0x7FFF plus the lowest kept bit, keep the top half; checked on all 2^32
    patterns). None when `raw` holds a NaN (see above)."""
    return _narrow(raw, np.uint16, out, scratch, 1, _bf16_block)


def fp32_to_fp16(
    raw: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None
) -> np.ndarray | None:
    """fp32 -> fp16 bits exactly as torch rounds finite and infinite values (checked on all 2^32
    patterns). Results in fp16's normal range are integer arithmetic as for bf16: rebias the
    exponent (127 -> 15) and round to nearest even at bit 13; the few others (fp16 subnormals,
    zeros, overflow to Inf: a few per thousand weights) take numpy's cast, exact but per element
    (numpy has no vectorised fp16 cast here): 1.6x faster than casting everything.
    None when `raw` holds a NaN (see above)."""
    return _narrow(raw, np.float16, out, scratch, 2, _fp16_block)


def _narrow(
    raw: np.ndarray,
    dtype: type,
    out: np.ndarray | None,
    scratch: np.ndarray | None,
    words: int,
    block: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None],
) -> np.ndarray | None:
    """Run `block` over `raw` in pieces of at most _BLOCK elements that fit `scratch` (`words`
    uint32 per element)."""
    if _has_nan(raw):
        return None
    result = np.empty(raw.size, dtype) if out is None else out.view(dtype)[: raw.size]
    if scratch is None or scratch.size < words:
        scratch = np.empty(words * max(1, min(raw.size, _BLOCK)), np.uint32)
    step = min(scratch.size // words, _BLOCK)
    for start in range(0, raw.size, step):
        piece = raw[start : start + step]
        block(piece, piece.view(np.uint32), result.view(np.uint16)[start : start + step], scratch)
    return result


def _has_nan(raw: np.ndarray) -> bool:
    return raw.size > 0 and bool(np.isnan(raw.max()))


def _bf16_block(raw: np.ndarray, bits: np.ndarray, result: np.ndarray, scratch: np.ndarray) -> None:
    t = scratch[: bits.size]
    np.right_shift(bits, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, bits, out=t)  # no overflow: only NaNs are above 0xFFFF8000
    np.right_shift(t, 16, out=t)
    np.copyto(result, t, casting="unsafe")


def _fp16_block(raw: np.ndarray, bits: np.ndarray, result: np.ndarray, scratch: np.ndarray) -> None:
    n = bits.size
    t, magnitude = scratch[:n], scratch[n : 2 * n]
    np.bitwise_and(bits, 0x7FFFFFFF, out=magnitude)
    np.subtract(magnitude, 0x38800000, out=t)  # |x| - 2^-14, wrapping below 0: so |x| outside
    outside = np.greater_equal(t, 0x477FF000 - 0x38800000, out=result.view(np.bool_)[:n])  # [2^-14, 65520)
    others = np.flatnonzero(outside)
    np.right_shift(magnitude, 13, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, magnitude, out=t)
    np.add(t, 0xC8000FFF, out=t)  # 0xFFF - ((127 - 15) << 23), modulo 2^32
    np.right_shift(t, 13, out=t)
    np.bitwise_xor(bits, magnitude, out=magnitude)  # the sign bit alone
    np.right_shift(magnitude, 16, out=magnitude)
    np.bitwise_or(t, magnitude, out=t)
    np.copyto(result, t, casting="unsafe")
    if others.size:
        with np.errstate(over="ignore"):  # beyond fp16's range: Inf, as in torch
            result[others] = raw[others].astype(np.float16).view(np.uint16)


def read_scalar(reader: FileReader, source: TensorSource) -> int | float | bool:
    """The value of a one-element tensor (a step counter), without torch: 16-bit floats are
    widened exactly in numpy, other dtypes read as numpy already holds them."""
    raw = reader.read_source(source)
    value = convert(raw, source.dtype, FP32) if source.dtype in (BF16, FP16) else raw
    return value.reshape(-1)[0].item()


def read_tensor(reader: FileReader, source: TensorSource, dtype: DType | None = None) -> "torch.Tensor":
    """The whole tensor in memory, shaped, in `dtype` (default: as stored)."""
    raw = reader.read_source(source)
    target = dtype or source.dtype
    return numpy_to_torch(convert(raw, source.dtype, target), target).reshape(source.shape)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (it may write less)."""
    data = memoryview(data)
    while data:
        written = os.write(fd, data)
        data = data[written:]


class _Slot:
    """The buffers of one chunk in flight: its input bytes, a uint32 scratch for the rounding
    passes, and the converted output."""

    def __init__(self) -> None:
        self.raw = memoryview(np.empty(STREAM_CHUNK_BYTES, dtype=np.uint8))
        self.scratch = np.empty(2 * _BLOCK, dtype=np.uint32)
        self.out = np.empty(STREAM_CHUNK_BYTES // 2, dtype=np.uint8)  # 16-bit out of fp32 in


class StreamWriter:
    """Writes TensorSources into an open file descriptor at its current position.

    Bytes that need no conversion and no checksum move file to file in the kernel. The others stream in small
    chunks (STREAM_CHUNK_BYTES) through a few reused buffers: the helper threads read, checksum
    and convert up to _IN_FLIGHT chunks at once while this thread writes the finished ones in
    order. pread, zlib.crc32, numpy's ufuncs and write all release the GIL, so on 2 cores a
    16-bit output takes less time than the kernel copy of the fp32 bytes (BENCHMARKS.md), and
    memory stays a few MiB whatever the tensor sizes.
    """

    def __init__(self, reader: FileReader, progress: Callable[[int], None] | None = None) -> None:
        self.reader = reader
        self.progress = progress or (lambda _n: None)
        self._slots: list[_Slot] = []
        self._kernel_copy = hasattr(os, "copy_file_range")

    def write(self, fd: int, source: TensorSource, dtype: DType) -> None:
        """Append `source`'s elements to `fd`, converted to `dtype`."""
        segments = source.segments
        # Checked bytes are read once, here: checksummed in the buffer they are written from. A
        # kernel copy would need a second read of each byte to checksum it (twice the reads of
        # the input, and under torchrun more than each process's share: issue 36).
        if dtype == source.dtype and self._kernel_copy and self.reader.checker is None:
            for index, segment in enumerate(segments):
                if not self._copy(fd, segment.path, segment.offset, segment.numel * dtype.itemsize):
                    segments = segments[index:]  # nothing of it written: stream it and the rest
                    break
            else:
                return
        self._stream(fd, segments, source.dtype, dtype)

    def _stream(self, fd: int, segments: tuple[Segment, ...], source: DType, target: DType) -> None:
        if not self._slots:
            self._slots = [_Slot() for _ in range(_IN_FLIGHT)]
        step = STREAM_CHUNK_BYTES // source.itemsize * source.itemsize
        pending: deque[Future[np.ndarray]] = deque()
        index = 0
        try:
            for segment in segments:
                nbytes = segment.numel * source.itemsize
                for start in range(0, nbytes, step):
                    if len(pending) == _IN_FLIGHT:  # the slot to reuse is written first
                        self._emit(fd, pending.popleft().result())
                    slot = self._slots[index % _IN_FLIGHT]
                    index += 1
                    # The descriptor is taken here: FileReader's table is not for several threads.
                    src = self.reader.descriptor(segment.path)
                    count = min(step, nbytes - start)
                    pending.append(
                        _helpers().submit(
                            self._convert, slot, src, segment.path, segment.offset + start, count, source, target
                        )
                    )
            while pending:
                self._emit(fd, pending.popleft().result())
        finally:  # after an error, no helper may still be filling a slot
            for future in pending:
                future.cancel()
            wait(pending)

    def _convert(
        self, slot: _Slot, src: int, path: str, offset: int, nbytes: int, source: DType, target: DType
    ) -> np.ndarray:
        """Read `nbytes` at `offset` into the slot and checksum them (what FileReader.read_into
        does, on a descriptor the writing thread took), then return them converted."""
        view = slot.raw[:nbytes]
        done = 0
        while done < nbytes:
            count = os.preadv(src, [view[done:]], offset + done)
            if count == 0:
                raise CorruptFileError(path, f"truncated: {nbytes} bytes expected at offset {offset}, file ends sooner")
            done += count
        if self.reader.checker is not None:
            self.reader.checker.feed(path, offset, view)
        return convert(np.frombuffer(view, dtype=np.dtype(source.numpy_raw)), source, target, slot.out, slot.scratch)

    def _emit(self, fd: int, out: np.ndarray) -> None:
        data = memoryview(out).cast("B")
        write_all(fd, data)
        self.progress(len(data))

    def _copy(self, fd: int, path: str, offset: int, nbytes: int) -> bool:
        """Kernel-side copy; False (nothing written) when the filesystem cannot do it. With a
        checking reader, each window is checksummed on a helper thread while it is copied."""
        src = self.reader.descriptor(path)
        checker = self.reader.checker
        done = 0
        try:
            while done < nbytes:
                window = min(nbytes - done, CHUNK_BYTES // 2)
                pending = _helpers().submit(checksum_range, src, path, offset + done, window) if checker else None
                copied = 0
                try:
                    while copied < window:
                        count = os.copy_file_range(src, fd, window - copied, offset + done + copied)
                        if count == 0:
                            raise CorruptFileError(
                                path, f"truncated: {nbytes} bytes expected at offset {offset}, file ends sooner"
                            )
                        copied += count
                        self.progress(count)
                finally:
                    crc = pending.result() if pending is not None else None
                if checker is not None and crc is not None:
                    checker.feed_crc(path, offset + done, window, crc)
                done += window
        except OSError as exc:
            if done == 0 and exc.errno in _NO_COPY_FILE_RANGE:
                self._kernel_copy = False
                return False
            raise
        return True


_POOL: WorkerPool | None = None


def _helpers() -> WorkerPool:
    """Threads that checksum bytes being copied by the kernel, and read, checksum and convert
    the chunks of a streamed conversion (zlib.crc32, pread and numpy release the GIL)."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool(2, "zckpt-stream")
    return _POOL

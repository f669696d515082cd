"""Turn a TensorSource into bytes in a file, or into a torch tensor, in a chosen dtype.

Streaming keeps memory bounded: same-dtype copies move file to file in the kernel
(``copy_file_range``) or through one reused buffer; dtype conversions work chunk by chunk,
which gives the same bits as converting the whole tensor (conversion is elementwise).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Callable

import numpy as np

from .dtypes import BF16, FP16, FP32, DType
from .errors import CorruptFileError
from .index import TensorSource
from .reading import FileReader

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 * 1024 * 1024
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


def numpy_to_torch(raw: np.ndarray, dtype: DType) -> "torch.Tensor":
    """A torch tensor sharing `raw`'s memory (bf16 arrives as raw uint16)."""
    import torch

    if dtype == BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)


def convert(raw: np.ndarray, source: DType, target: DType) -> np.ndarray:
    """Cast raw elements from `source` to `target` with torch's rounding (round to nearest even).

    Widening 16-bit floats to fp32 is exact and done in numpy (bf16 is the top half of an fp32),
    so fp32 output never needs torch; narrowing goes through torch so the rounding is torch's.
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
    if source == FP32 and target == BF16 and (rounded := fp32_to_bf16(raw)) is not None:
        return rounded
    import torch

    converted = numpy_to_torch(raw, source).to(target.torch())
    if target == BF16:
        return converted.view(torch.int16).numpy().view(np.uint16)
    return converted.numpy()


def fp32_to_bf16(raw: np.ndarray) -> np.ndarray | None:
    """fp32 -> bf16 bits exactly as torch rounds finite and infinite values (round to nearest
    even: add 0x7FFF plus the lowest kept bit, keep the top half), in single-threaded numpy:
    torch's threaded .to() spent more time waking its threads than converting (BENCHMARKS.md).
    None when `raw` holds a NaN: torch's NaN bits depend on its code path, so it converts those."""
    if np.isnan(raw).any():
        return None
    bits = raw.view(np.uint32)
    return ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


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


class StreamWriter:
    """Writes TensorSources into an open file descriptor at its current position."""

    def __init__(self, reader: FileReader, progress: Callable[[int], None] | None = None) -> None:
        self.reader = reader
        self.progress = progress or (lambda _n: None)
        self._buffer: np.ndarray | None = None
        self._kernel_copy = hasattr(os, "copy_file_range")

    def _scratch(self, nbytes: int) -> memoryview:
        if self._buffer is None or self._buffer.nbytes < nbytes:
            self._buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        return memoryview(self._buffer)[:nbytes]

    def write(self, fd: int, source: TensorSource, dtype: DType) -> None:
        """Append `source`'s elements to `fd`, converted to `dtype`."""
        same = dtype == source.dtype
        in_size = source.dtype.itemsize
        chunk = CHUNK_BYTES // max(in_size, dtype.itemsize)
        for segment in source.segments:
            if same and self._kernel_copy and self._copy(fd, segment.path, segment.offset, segment.numel * in_size):
                continue
            done = 0
            while done < segment.numel:
                count = min(chunk, segment.numel - done)
                view = self._scratch(count * in_size)
                self.reader.read_into(segment.path, segment.offset + done * in_size, view)
                raw = np.frombuffer(view, dtype=np.dtype(source.dtype.numpy_raw))
                out = convert(raw, source.dtype, dtype)
                write_all(fd, memoryview(out).cast("B"))
                self.progress(count * dtype.itemsize)
                done += count

    def _copy(self, fd: int, path: str, offset: int, nbytes: int) -> bool:
        """Kernel-side copy; False (nothing written) when the filesystem cannot do it."""
        src = self.reader.descriptor(path)
        done = 0
        try:
            while done < nbytes:
                count = os.copy_file_range(src, fd, min(nbytes - done, 1 << 30), offset + done)
                if count == 0:
                    raise CorruptFileError(path, f"truncated: {nbytes} bytes expected at offset {offset}, file ends sooner")
                done += count
                self.progress(count)
        except OSError as exc:
            if done == 0 and exc.errno in _NO_COPY_FILE_RANGE:
                self._kernel_copy = False
                return False
            raise
        return True

"""Safetensors files written by several processes at once, each a share of every file's bytes.

Why: a torchrun job that splits whole files between its processes leaves most of them idle when
the output has few files (a model consolidated into 5 GB shards on 16 nodes), and a process
holding the biggest file reads more than its share. A safetensors file has no checksum of its
own and every offset is known from its header, so its tensors can be cut into pieces of a few
MiB, shared out by the bytes each reads, and written where they belong (``pwrite``-style) into
files process 0 created at their final size. The bytes are those one process writes.

Plan first (:func:`plan_pieces`, pure), then :func:`create_files` (process 0) and
:func:`write_pieces` (every process, its share).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.dtypes import DType
from ..core.errors import ZckptError
from ..core.index import TensorSource, slice_segments
from ..io.materialize import StreamWriter, write_all
from ..io.reading import FileReader
from .formats import ShardTensor, safetensors_header

PIECE_BYTES = 16 << 20  # output bytes per piece at most: big enough to stream
MIN_PIECE_BYTES = 256 << 10  # and at least: a small output is cut finer, not into crumbs


def piece_bytes_for(total: int, parts: int) -> int:
    """Pieces small enough that each of `parts` processes gets about 16 of them (a balance within
    a few percent), within [MIN_PIECE_BYTES, PIECE_BYTES].

    >>> piece_bytes_for(140 << 30, 128) // (1 << 20), piece_bytes_for(30 << 20, 4) // 1024
    (16, 480)
    """
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, total // (16 * max(parts, 1))))


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + count) of one tensor, written at byte `offset` of file `name`."""

    name: str
    offset: int
    source: TensorSource  # the piece's elements only
    dtype: DType  # written as

    @property
    def read_bytes(self) -> int:
        return self.source.nbytes


@dataclass(frozen=True)
class PiecePlan:
    headers: dict[str, bytes]  # file name -> its header (the bytes before the data)
    sizes: dict[str, int]  # file name -> its final size
    pieces: tuple[Piece, ...]


def plan_pieces(
    files: Sequence[tuple[str, Sequence[ShardTensor]]], tied: dict[str, str], piece_bytes: int = PIECE_BYTES
) -> PiecePlan:
    """Every file's header and size, and its tensors cut into pieces, as the one-process writer
    lays them out (:func:`~zckpt.ops.formats.write_safetensors`: header, then each tensor in
    order)."""
    headers, sizes, pieces = {}, {}, []
    for name, tensors in files:
        header = safetensors_header(tensors, tied)
        headers[name] = header
        offset = len(header)
        for tensor in tensors:
            numel = tensor.source.numel
            step = max(1, piece_bytes // tensor.dtype.itemsize)
            for start in range(0, numel, step):
                count = min(step, numel - start)
                source = TensorSource(tensor.source.dtype, (count,), tuple(slice_segments(tensor.source, start, count)))
                pieces.append(Piece(name, offset + start * tensor.dtype.itemsize, source, tensor.dtype))
            offset += numel * tensor.dtype.itemsize
        sizes[name] = offset
    return PiecePlan(headers, sizes, tuple(pieces))


def create_files(plan: PiecePlan, paths: dict[str, str], on_error: Callable[[str, OSError], Exception]) -> None:
    """Process 0, before the others write: each file at `paths[name]` created at its final size
    (a sparse file), its header written. `on_error` as for :func:`write_pieces`."""
    for name, header in plan.headers.items():
        try:
            fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, header)
                os.ftruncate(fd, plan.sizes[name])
            finally:
                os.close(fd)
        except OSError as exc:
            raise on_error(name, exc) from None


def write_pieces(
    pieces: Sequence[Piece],
    paths: dict[str, str],
    reader: FileReader,
    advance: Callable[[int], None],
    on_error: Callable[[str, OSError], Exception],
) -> list[str]:
    """Write `pieces` into the files process 0 created; the paths written to (to be synced).
    `on_error(name, exc)`: the error to raise for an OS error while writing file `name`."""
    writer = StreamWriter(reader, advance)
    descriptors: dict[str, int] = {}
    try:
        for piece in pieces:
            try:
                fd = descriptors.get(piece.name)
                if fd is None:
                    fd = descriptors[piece.name] = os.open(paths[piece.name], os.O_WRONLY)
                os.lseek(fd, piece.offset, os.SEEK_SET)
                writer.write(fd, piece.source, piece.dtype)
            except ZckptError:
                raise
            except OSError as exc:
                raise on_error(piece.name, exc) from None
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return [paths[name] for name in descriptors]

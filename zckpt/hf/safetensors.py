"""The safetensors container: build a header up front, read and validate one.

Writing streams: the header (names, dtypes, shapes, offsets) is fixed before any tensor byte
is produced, so tensors can be assembled and written one at a time. The format: an 8-byte
little-endian header length, a JSON header padded with spaces, then the tensor bytes in the
order of their offsets, with no gaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Sequence

from ..core.dtypes import BY_SAFETENSORS, DType
from ..core.errors import CheckpointNotFoundError, CorruptFileError

METADATA_KEY = "__metadata__"
# Metadata key recording tied weights ({alias: source}, as JSON): safetensors cannot alias, so
# each name gets its own copy and this says which copies are one tensor in the model.
TIED_METADATA_KEY = "zckpt_tied_weights"
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # byte offsets within the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    tensors: tuple[HeaderTensor, ...]  # in order of data offsets
    metadata: dict[str, str]
    data_start: int  # file offset of the data section

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def build_header(
    tensors: Sequence[tuple[str, DType, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, Header]:
    """Header bytes for tensors written in the given order, and the parsed Header they encode."""
    body: dict[str, object] = {}
    if metadata:
        body[METADATA_KEY] = dict(metadata)
    laid_out = []
    position = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        body[name] = {"dtype": dtype.safetensors, "shape": list(shape), "data_offsets": [position, position + size]}
        laid_out.append(HeaderTensor(name, dtype, tuple(shape), position, position + size))
        position += size
    text = json.dumps(body, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # align the data section to 8 bytes
    return struct.pack("<Q", len(text)) + text, Header(tuple(laid_out), dict(metadata or {}), 8 + len(text))


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate a safetensors header: dtypes, shapes, and offsets that tile the data
    section exactly up to the end of the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(path, "file not found")
    file_size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CorruptFileError(path, "truncated: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER or 8 + length > file_size:
            raise CorruptFileError(
                path, f"header length {length} does not fit the {file_size}-byte file: truncated or not safetensors"
            )
        raw = handle.read(length)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFileError(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise CorruptFileError(path, "header is not a JSON object")
    metadata = body.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(path, "__metadata__ must map strings to strings")
    tensors = []
    for name, info in body.items():
        try:
            dtype = BY_SAFETENSORS[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(path, f"tensor {name}: bad or unsupported header entry {info!r:.100}") from None
        if any(d < 0 for d in shape) or end - begin != math.prod(shape) * dtype.itemsize:
            raise CorruptFileError(
                path, f"tensor {name}: offsets [{begin}, {end}) do not match shape {list(shape)} of {dtype}"
            )
        tensors.append(HeaderTensor(name, dtype, shape, begin, end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            raise CorruptFileError(
                path, f"tensor {tensor.name}: data offsets overlap or leave a gap at byte {position}"
            )
        position = tensor.end
    if 8 + length + position != file_size:
        raise CorruptFileError(
            path, f"data section should be {position} bytes, file holds {file_size - 8 - length}: truncated or garbled"
        )
    return Header(tuple(tensors), metadata, 8 + length)

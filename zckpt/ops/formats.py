"""The weights output formats (``--format``): one writer object each, found by name in :data:`FORMATS`.

Why one registry: a format is more than a name to branch on. Each knows its Hugging Face file
names (single file, shard pattern, shard index, PEFT adapter file), the order it writes a file's
tensors in, whether tied names are copies or one shared storage, and how to stream one file from
tensor sources with bounded memory (one tensor, or one buffer, at a time). The weights folder
(:mod:`.weights_folder`), the PEFT outputs (:mod:`.peft`), ``consolidate`` and the CLI ask it
instead of testing the string.

* safetensors: the header first (every offset known from shapes), then each tensor's bytes;
* torch: the ``torch.save`` archive of ``{name: tensor}``, streamed by :mod:`zckpt.torchfile.save`
  with torch's own serialization id (:mod:`zckpt.torchfile.torch_id`), so the bytes equal what
  ``torch.save`` writes for the same tensors at the same path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Callable, Literal, Protocol, Sequence

from ..core.dtypes import DType
from ..core.errors import UsageError
from ..core.index import TensorSource
from ..hf import names as hf
from ..hf.safetensors import TIED_METADATA_KEY, build_header
from ..io.materialize import StreamWriter, write_all
from ..io.reading import FileReader
from ..torchfile.pickler import Copy, OutTensor
from ..torchfile.save import archive_name_for, plan_archive, write_archive
from ..torchfile.torch_id import torch_serialization_id

OutputFormat = Literal["safetensors", "torch"]
Advance = Callable[[int], None]  # count more bytes written


class ShardTensor(Protocol):
    """One tensor of an output file: its name, output dtype and shape, and where its elements are."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    source: TensorSource
    alias_of: str | None

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class WeightsFormat:
    """A weights file format: its file names and its streamed writer of one file."""

    name: str  # the --format value
    pattern: str  # shard file names, with {suffix}: "" alone, "-00001-of-00002" sharded
    index_file: str  # the shard index, written when sharded
    adapter_file: str  # PEFT's adapter file in this format
    tied_copies: bool  # tied names written as copies of their source (else one shared storage)

    @property
    def single_file(self) -> str:
        """The one file of an unsharded folder (model.safetensors, pytorch_model.bin)."""
        return self.pattern.format(suffix="")

    def order(self, tensors: Sequence[ShardTensor]) -> list[ShardTensor]:
        """A file's tensors in writing order."""
        return list(tensors)

    def tensor_bytes(self, tensors: Sequence[ShardTensor], distinct_bytes: int) -> int:
        """Tensor bytes written for all files: `distinct_bytes` counts tied tensors once."""
        return sum(t.nbytes for t in tensors) if self.tied_copies else distinct_bytes

    def file_overhead(self, tensors: Sequence[ShardTensor], tied: dict[str, str]) -> int:
        """Bytes of one file besides its tensors, as far as known before writing."""
        return 0

    def write(
        self,
        path: str,
        tensors: Sequence[ShardTensor],
        tied: dict[str, str],
        reader: FileReader,
        advance: Advance,
        name: str | None = None,
    ) -> None:
        """Stream one file at `path` (created or truncated), one tensor at a time; `name`: the
        file's final name, when `path` is a temporary one renamed afterwards."""
        raise NotImplementedError


@dataclass(frozen=True)
class SafetensorsFormat(WeightsFormat):
    def order(self, tensors: Sequence[ShardTensor]) -> list[ShardTensor]:
        # widest first keeps every tensor aligned, as safetensors does
        return sorted(tensors, key=lambda t: -t.dtype.itemsize)

    def file_overhead(self, tensors: Sequence[ShardTensor], tied: dict[str, str]) -> int:
        return len(safetensors_header(tensors, tied))

    def write(
        self,
        path: str,
        tensors: Sequence[ShardTensor],
        tied: dict[str, str],
        reader: FileReader,
        advance: Advance,
        name: str | None = None,
    ) -> None:
        writer = StreamWriter(reader, advance)
        write_safetensors(
            path, safetensors_header(tensors, tied), tensors, lambda fd, t: writer.write(fd, t.source, t.dtype)
        )


@dataclass(frozen=True)
class TorchFormat(WeightsFormat):
    def write(
        self,
        path: str,
        tensors: Sequence[ShardTensor],
        tied: dict[str, str],
        reader: FileReader,
        advance: Advance,
        name: str | None = None,
    ) -> None:
        shard: dict[str, OutTensor] = {}
        for tensor in tensors:
            if tensor.alias_of is not None and tensor.alias_of in shard:
                shard[tensor.name] = shard[tensor.alias_of]  # one storage, as in the model
                continue
            parts = tuple(Copy(s, tensor.source.dtype) for s in tensor.source.segments)
            shard[tensor.name] = OutTensor(tensor.dtype, tuple(tensor.source.shape), parts)
        # named as torch.save names a file at its final path, not after the temporary one
        plan = plan_archive(shard, archive_name_for(os.path.join(os.path.dirname(path), name) if name else path))
        plan = replace(plan, serialization_id=torch_serialization_id(dict(plan.storages), reader))
        write_archive(path, plan, reader, advance)


SAFETENSORS = SafetensorsFormat(
    "safetensors", hf.SAFETENSORS_PATTERN, hf.SAFETENSORS_INDEX, hf.ADAPTER_SAFETENSORS, tied_copies=True
)
TORCH = TorchFormat("torch", hf.TORCH_PATTERN, hf.TORCH_INDEX, hf.ADAPTER_TORCH, tied_copies=False)
FORMATS: dict[str, WeightsFormat] = {f.name: f for f in (SAFETENSORS, TORCH)}


def find_format(name: str | WeightsFormat) -> WeightsFormat | None:
    """The format called `name` (or `name` itself, a format); None for any other name."""
    if isinstance(name, WeightsFormat):
        return name
    return FORMATS.get(name) if isinstance(name, str) else None


def weights_format(name: str | WeightsFormat) -> WeightsFormat:
    """The format called `name`; a UsageError for any other name."""
    found = find_format(name)
    if found is None:
        raise UsageError(None, f"unknown format {name!r}: choose {' or '.join(FORMATS)}")
    return found


def safetensors_header(tensors: Sequence[ShardTensor], tied: dict[str, str]) -> bytes:
    """The header of a weights file: transformers' {"format": "pt"}, and which names are tied."""
    metadata = {"format": "pt"}
    if tied:
        metadata[TIED_METADATA_KEY] = json.dumps(tied, sort_keys=True)
    header, _ = build_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)
    return header


def write_safetensors(
    path: str, header: bytes, tensors: Sequence[ShardTensor], write_tensor: Callable[[int, ShardTensor], object]
) -> None:
    """A safetensors file, header first: `write_tensor(fd, tensor)` appends each tensor's bytes
    in order (streamed from its source, or computed, as the PEFT merge does)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, header)
        for tensor in tensors:
            write_tensor(fd, tensor)
    finally:
        os.close(fd)

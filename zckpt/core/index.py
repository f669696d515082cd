"""zckpt's own description of a checkpoint: what tensors it holds and where their bytes are.

The format layer (``zckpt.deepspeed``) builds these from DeepSpeed's files; everything else
(consolidation, inspection, the Python API) works on them and knows no DeepSpeed key names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .dtypes import DType

EntryKind = Literal["param", "frozen", "buffer", "tied"]


@dataclass(frozen=True)
class Segment:
    """`numel` contiguous elements at byte `offset` of the file at `path`."""

    path: str
    offset: int
    numel: int


@dataclass(frozen=True)
class TensorSource:
    """One full tensor as the concatenation of `segments`, viewed as `shape`."""

    dtype: DType  # dtype of the stored elements
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Entry:
    """One named tensor of the consolidated state dict.

    A ``tied`` entry is an alias: it has the source of `alias_of`, the name it shares memory
    with in the model.
    """

    name: str
    kind: EntryKind
    source: TensorSource
    alias_of: str | None = None


# A checkpoint folder `zckpt train` wrote holds this file, whose "model_type" is this (the trainer
# writes it; inspect tells zckpt's checkpoints from DeepSpeed's by it, torch-free)
TRAINER_MODEL_CONFIG = "model_config.json"
TRAINER_MODEL_TYPE = "zckpt-gpt"


@dataclass(frozen=True)
class CheckpointIndex:
    """A checkpoint's consolidated state dict, as a plan, plus what inspection reports."""

    checkpoint_dir: str
    tag: str
    tag_dir: str
    tags: tuple[str, ...]
    zero_stage: int
    world_size: int
    dtype: DType  # the training (16-bit or fp32) dtype
    ds_version: str | None
    offload: Literal["none", "cpu", "nvme"]
    entries: tuple[Entry, ...]  # in the order DeepSpeed's zero_to_fp32.py emits them
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # facts worth telling a user, not problems
    universal: bool = False  # a universal folder (one file per param and state), not rank partitions

    @property
    def source_tag(self) -> str:
        """The tag of the training save: a universal folder's name less its ``_universal``."""
        suffix = "_universal"
        return self.tag[: -len(suffix)] if self.universal and self.tag.endswith(suffix) and self.tag != suffix else self.tag

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> Entry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(name)

"""zckpt's own description of a checkpoint: what tensors it holds and where their bytes are.

The format layer (``zckpt.deepspeed``) builds these from DeepSpeed's files; everything else
(consolidation, inspection, the Python API) works on them and knows no DeepSpeed key names.
"""

from __future__ import annotations

import array
import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Literal, Sequence, overload

from .dtypes import DType
from .errors import CorruptFileError
from .topology import Topology

EntryKind = Literal["param", "frozen", "buffer", "tied"]


@dataclass(frozen=True, slots=True)
class Segment:
    """`numel` contiguous elements at byte `offset` of the file at `path`. Slotted: a param cut
    across thousands of ranks has a segment per rank and state, kept for the whole run."""

    path: str
    offset: int
    numel: int


class PackedSegments(Sequence[Segment]):
    """Segments kept as columns (each one's path, byte offset and element count), not as an
    object each: a ZeRO-3 param cut across thousands of ranks has a segment per rank and state,
    about 24 bytes each here against some 130 as Segment objects with their ints. Reads as the
    tuple of its Segments (made when read), equal to it and hashed as it is."""

    __slots__ = ("_paths", "_offsets", "_numels")

    def __init__(self, segments: Iterable[Segment]) -> None:
        paths: list[str] = []
        offsets, numels = array.array("q"), array.array("q")
        for segment in segments:
            paths.append(segment.path)
            offsets.append(segment.offset)
            numels.append(segment.numel)
        self._paths, self._offsets, self._numels = tuple(paths), offsets, numels

    def __len__(self) -> int:
        return len(self._paths)

    @overload
    def __getitem__(self, index: int) -> Segment: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Segment, ...]: ...
    def __getitem__(self, index: int | slice) -> Segment | tuple[Segment, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        return Segment(self._paths[index], self._offsets[index], self._numels[index])

    def __iter__(self) -> Iterator[Segment]:
        return map(Segment, self._paths, self._offsets, self._numels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PackedSegments, tuple)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PackedSegments({tuple(self)!r})"

    def __reduce__(self) -> tuple:  # stdlib pickling (processes): as its segments
        return (PackedSegments, (tuple(self),))


@dataclass(frozen=True)
class TensorSource:
    """One full tensor as the concatenation of `segments`, viewed as `shape`."""

    dtype: DType  # dtype of the stored elements
    shape: tuple[int, ...]
    segments: tuple[Segment, ...] | PackedSegments

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def segment_starts(self) -> array.array:
        """The first element of each segment, and the total: computed once per source, as a
        writer cuts one source into a slice per output rank (8 bytes a segment, no int objects)."""
        return array.array("q", itertools.accumulate((s.numel for s in self.segments), initial=0))


class SegmentSlicer:
    """:func:`slice_segments` for many slices of one source: each found by bisection over the
    segments' first elements, so cutting a tensor of many segments into many runs (a row-parallel
    weight's rows) costs a search per run, not a walk from the start."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.starts = source.segment_starts

    def slice(self, start: int, length: int) -> list[Segment]:
        segments, itemsize = self.source.segments, self.source.dtype.itemsize
        out, end = [], start + length
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(segments) and self.starts[i] < end:
            base, segment = self.starts[i], segments[i]
            lo, hi = max(start, base), min(end, base + segment.numel)
            if lo < hi:
                out.append(Segment(segment.path, segment.offset + (lo - base) * itemsize, hi - lo))
            i += 1
        return out


def slice_segments(source: TensorSource, start: int, length: int) -> list[Segment]:
    """The segments of elements [start, start + length) of a source (fewer when it is shorter).
    The source's segment starts are summed once (:attr:`TensorSource.segment_starts`): a writer
    slices each source once per output rank, which would otherwise cost ranks x segments."""
    return SegmentSlicer(source).slice(start, length)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's elements lie in a file; holds no data. What the torch file reader makes of
    every tensor in a pickle (and the DeepSpeed reader of a raw swap file's run), read by the I/O
    layer (:func:`zckpt.io.reading.source_of`) without knowing either format."""

    path: str
    offset: int  # byte offset in `path` of element 0
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # Python attributes pickled with the tensor (DeepSpeed's ZeRO-3 flat groups carry `ds_id`).
    attributes: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    @classmethod
    def flat(cls, path: str, offset: int, dtype: DType, numel: int) -> "TensorRef":
        """A 1-D contiguous run of `numel` elements at byte `offset` (e.g. in a raw swap file)."""
        return cls(path, offset, dtype, (numel,), (1,))

    def __reduce__(self) -> tuple:  # stdlib pickling (processes) by constructor, not by state
        return (TensorRef, (self.path, self.offset, self.dtype, self.shape, self.stride, self.attributes))

    def __setstate__(self, state: object) -> None:  # a pickle must not repoint it at another file
        raise CorruptFileError(None, "corrupted pickle: BUILD applied to a tensor")


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
    # how the saving run's ranks were arranged; None given: data-parallel over world_size ranks
    topology: Topology | None = field(default=None, compare=False)
    # other copies of entries' tensors that must hold the same bits (a tied param that several
    # pipeline stages keep): verify compares them, the outputs write each name once
    replicas: tuple[Entry, ...] = field(default=(), compare=False)
    # where the saving run kept each tensor beyond data parallelism, in words, by name (the stage
    # of a pipeline, the split over tensor ranks, an expert's rank): what inspect shows
    placements: dict[str, str] = field(default_factory=dict, compare=False)
    # the 16-bit copies a run keeps of its trainable params (the module's weights in a ZeRO-1/2
    # model-states file or a pipeline layer file, an expert file's weights), each beside the entry
    # of the master it was rounded from: verify checks that rounding the master gives the copy
    rounded_copies: tuple[tuple[Entry, Entry], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.topology is None:
            object.__setattr__(self, "topology", Topology.data_parallel(self.world_size))

    @property
    def source_tag(self) -> str:
        """The tag of the training save: a universal folder's name less its ``_universal``."""
        suffix = "_universal"
        return (
            self.tag[: -len(suffix)]
            if self.universal and self.tag.endswith(suffix) and self.tag != suffix
            else self.tag
        )

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> Entry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(name)


def merged_index(
    part: CheckpointIndex,
    topology: Topology,
    entries: list[Entry] | tuple[Entry, ...],
    files: tuple[str, ...],
    notes: tuple[str, ...],
    replicas: list[Entry] | tuple[Entry, ...] = (),
    placements: dict[str, str] | None = None,
    rounded_copies: list[tuple[Entry, Entry]] | tuple[tuple[Entry, Entry], ...] = (),
) -> CheckpointIndex:
    """The index of a checkpoint read part by part (pipeline stages, tensor ranks, expert ranks):
    one part's description (tag, stage, dtype, version), the whole run's topology and tensors."""
    return replace(
        part,
        world_size=topology.world_size,
        topology=topology,
        entries=tuple(entries),
        files=files,
        notes=notes,
        replicas=tuple(replicas),
        placements=dict(placements or {}),
        rounded_copies=tuple(rounded_copies),
    )

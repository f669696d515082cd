"""Where every param's elements lie in DeepSpeed's flat optimizer partitions, as plain integers.

One pure description, :class:`ZeroLayout`, serves the reader (param -> pieces of rank files), the
writer (rank file -> the params that fill it) and the trainer. It is built from param numels,
their param groups, the world size and the few settings that change DeepSpeed's layout; nothing
here opens a file or touches a tensor.

ZeRO-1/2 (``stage_1_and_2.py``): per param group, the params are flattened in *flat order*
(the group's order, or its round-robin reorder with ``round_robin_gradients``), each followed by
an alignment padding (``parameter_alignment``, DeepSpeed >= 0.18), the group padded to a
multiple of ``2 * world_size`` and cut into equal partitions. Worked example, world size 3, one
group of params with 5 and 4 elements::

    flat group    = p0[0:5] p1[0:4] pad pad pad      (9 -> 12)
    partition     = 4 elements per rank
    pieces        = p0 -> (rank 0, 0:4 at 0), (rank 1, 4:5 at 0)
                    p1 -> (rank 1, 0:3 at 1), (rank 2, 3:4 at 0)
    saved fp32    = 4, 4, 1     (the tail padding is dropped when saving)
    saved states  = 4, 4, 4     (exp_avg & co keep it)

ZeRO-3 (``stage3.py``): each param is partitioned on its own, ``ceil(numel / world_size)``
elements per rank (the last ranks padded), and a rank's flat group of each optimizer sub-group
concatenates its shares of the sub-group's params. Same params, world size 3::

    shares        = 2, 2
    pieces        = p0 -> (rank 0, 0:2 at 0), (rank 1, 2:4 at 0), (rank 2, 4:5 at 0)
                    p1 -> (rank 0, 0:2 at 2), (rank 1, 2:4 at 2)       (rank 2 holds padding)
    saved         = 4, 4, 4     (padding included)
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from .partition import zero2_align, zero3_partition, zero3_sub_groups

MAX_RANKS = 2**31 - 1
"""The most ranks (processes) any target run may have: torch.distributed keeps a job's rank and
world size as C ``int`` (c10d's ``ProcessGroup``, NCCL's ``nranks``), so no job is larger. A run of
a model with fewer elements than this is held to fewer ranks (:func:`rank_limit`)."""


def rank_limit(elements: int) -> int:
    """The most ranks a target run of a model with `elements` elements may have: that many, and
    never more than :data:`MAX_RANKS`.

    Why the elements (of the params, trainable and frozen): every element of the model lives (as a
    ZeRO-3 param partition, a master and its optimizer states) in exactly one data-parallel rank's
    partition of its model-parallel group, so a run of more ranks than the model has elements has
    at least one rank whose every file holds padding only, and its checkpoint more rank files than
    the model has numbers. DeepSpeed would start such a run (ranks
    of padding are a legal ZeRO layout), but it gives those GPUs nothing to do and no one trains so:
    such a request is a typo (``-w 1000000000``), refused before any planning rather than planned
    for hours. Up to the limit every layout is planned: a run with more ranks than a large param
    has elements (ranks holding padding of it) is an ordinary ZeRO-3 layout.

    >>> rank_limit(2610), rank_limit(7 * 10**9) == MAX_RANKS
    (2610, True)
    """
    return max(1, min(elements, MAX_RANKS))


def rank_limit_reason(elements: int) -> str:
    """:func:`rank_limit` in words, for a refusal: the limit, and which of the two it is."""
    limit = rank_limit(elements)
    if limit == MAX_RANKS:
        return f"at most {limit:,} ranks (torch.distributed keeps ranks as C ints)"
    return f"at most {limit:,} ranks, the elements the model has (beyond that some rank would hold padding only)"


@dataclass(frozen=True)
class LayoutParam:
    """A trainable param as the layout sees it: a name, a size, its (user) param group."""

    name: str
    numel: int
    group: int


@dataclass(frozen=True, slots=True)
class Piece:
    """`length` elements of param `param` (from element `param_offset` of the flattened param)
    stored at element `flat_offset` of rank `rank`'s flat tensor of flat group `flat`. Slotted:
    ZeRO-3 cuts every param across every rank, a piece each."""

    param: int
    rank: int
    flat: int
    flat_offset: int
    param_offset: int
    length: int


@dataclass(frozen=True)
class FlatGroup:
    """One flat optimizer group: a ZeRO-1/2 param group or a ZeRO-3 sub-group.

    `params` are indices into the layout's params, in flat order. `partition` is the elements
    each rank owns (padding included); `saved` the fp32 elements each rank's file holds (ZeRO-1/2
    drop the tail padding); `alignment_paddings` the padding after each param (ZeRO-1/2).
    `partition_count` is the ranks the group is partitioned over (DeepSpeed saves it per group)
    and `ranks` the data-parallel ranks they are; today every group spans all of them.
    """

    param_group: int
    params: tuple[int, ...]
    partition: int
    saved: tuple[int, ...]
    alignment_paddings: tuple[int, ...] = ()
    partition_count: int = 0  # 0: one partition per saved size
    ranks: tuple[int, ...] = ()  # (): ranks 0 .. partition_count - 1

    def __post_init__(self) -> None:
        if not self.partition_count:
            object.__setattr__(self, "partition_count", len(self.saved))
        if not self.ranks:
            object.__setattr__(self, "ranks", tuple(range(self.partition_count)))


@dataclass(frozen=True, eq=True)
class Zero3Pieces(Sequence[Piece]):
    """ZeRO-3's pieces as columns, each :class:`Piece` made when asked for.

    Why: ZeRO-3 cuts every param across every rank, so a checkpoint of 4,096 ranks and 723 params
    has 3 million pieces; as objects they were most of a reader's memory there. Each is a function
    of four numbers per param: param `i` holds ``shares[i]`` elements per rank (``ceil(numel /
    world_size)``, :func:`~.partition.zero3_partition`) at element ``offsets[i]`` of every rank's
    flat group ``flats[i]``, on ranks ``0 .. ceil(numel / share) - 1`` (the others hold padding).
    `members[f]` lists flat group f's params in flat order. Ordered by param, then rank, as a
    tuple of pieces would be."""

    world_size: int
    numels: tuple[int, ...]
    flats: tuple[int, ...]
    offsets: tuple[int, ...]
    shares: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    def holders(self, param: int) -> int:
        """The ranks holding any of `param` (the lowest ones)."""
        share = self.shares[param]
        return -(-self.numels[param] // share) if share else 0

    def _piece(self, param: int, rank: int) -> Piece:
        share = self.shares[param]
        start = rank * share
        return Piece(param, rank, self.flats[param], self.offsets[param], start, min(share, self.numels[param] - start))

    def of_param(self, param: int) -> list[Piece]:
        return [self._piece(param, rank) for rank in range(self.holders(param))]

    def in_rank(self, rank: int, flat: int) -> list[Piece]:
        """Rank `rank`'s pieces of flat group `flat`, by flat offset (the members' order)."""
        return [self._piece(param, rank) for param in self.members[flat] if rank < self.holders(param)]

    @cached_property
    def _starts(self) -> list[int]:
        """The position of each param's first piece in the sequence (an int per param)."""
        return list(itertools.accumulate((self.holders(i) for i in range(len(self.numels))), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, position):  # type: ignore[override]
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        position = _checked_index(position, len(self))
        param = bisect.bisect_right(self._starts, position) - 1
        return self._piece(param, position - self._starts[param])

    def __iter__(self) -> Iterator[Piece]:
        for param in range(len(self.numels)):
            yield from self.of_param(param)


class _RankPieces(Mapping[tuple[int, int], list[Piece]]):
    """``ZeroLayout.by_rank()`` of a ZeRO-3 layout: each (rank, flat group)'s pieces computed
    when looked up, not held for every rank at once (a writer asks for one rank at a time)."""

    def __init__(self, pieces: Zero3Pieces) -> None:
        self._pieces = pieces

    def __getitem__(self, key: tuple[int, int]) -> list[Piece]:
        rank, flat = key
        if not (0 <= rank < self._pieces.world_size and 0 <= flat < len(self._pieces.members)):
            raise KeyError(key)
        found = self._pieces.in_rank(rank, flat)
        if not found:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for rank in range(self._pieces.world_size):
            for flat, members in enumerate(self._pieces.members):
                if any(rank < self._pieces.holders(param) for param in members):
                    yield (rank, flat)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class ZeroLayout:
    stage: int
    world_size: int
    params: tuple[LayoutParam, ...]
    flat_groups: tuple[FlatGroup, ...]
    pieces: Sequence[Piece]  # ordered by param, then rank; ZeRO-3's as columns (Zero3Pieces)

    def pieces_of(self, param: int) -> list[Piece]:
        """The pieces of one param, in element order (they concatenate to the whole param)."""
        if isinstance(self.pieces, Zero3Pieces):
            return self.pieces.of_param(param)
        return [p for p in self.pieces if p.param == param]

    def pieces_in(self, rank: int, flat: int) -> list[Piece]:
        """The pieces stored in one rank's flat tensor of one flat group, by flat offset."""
        if isinstance(self.pieces, Zero3Pieces):
            return self.pieces.in_rank(rank, flat)
        return sorted((p for p in self.pieces if p.rank == rank and p.flat == flat), key=lambda p: p.flat_offset)

    def by_param(self) -> Sequence[list[Piece]]:
        """pieces_of for every param at once (one pass, for large layouts; ZeRO-3's made one
        param at a time as they are iterated)."""
        if isinstance(self.pieces, Zero3Pieces):
            return _ByParam(self.pieces)
        grouped: list[list[Piece]] = [[] for _ in self.params]
        for piece in self.pieces:
            grouped[piece.param].append(piece)
        return grouped

    def by_rank(self) -> Mapping[tuple[int, int], list[Piece]]:
        """pieces_in for every (rank, flat group) holding any (ZeRO-3's made per lookup)."""
        if isinstance(self.pieces, Zero3Pieces):
            return _RankPieces(self.pieces)
        grouped: dict[tuple[int, int], list[Piece]] = {}
        for piece in self.pieces:
            grouped.setdefault((piece.rank, piece.flat), []).append(piece)
        for pieces in grouped.values():
            pieces.sort(key=lambda p: p.flat_offset)
        return grouped


class _ByParam(Sequence[list[Piece]]):
    """``ZeroLayout.by_param()`` of a ZeRO-3 layout: each param's pieces made when asked for."""

    def __init__(self, pieces: Zero3Pieces) -> None:
        self._pieces = pieces

    def __len__(self) -> int:
        return len(self._pieces.numels)

    def __getitem__(self, param):  # type: ignore[override]
        if isinstance(param, slice):
            return [self[i] for i in range(*param.indices(len(self)))]
        return self._pieces.of_param(_checked_index(param, len(self)))


def _checked_index(index: int, size: int) -> int:
    """A sequence index as a list takes it (negative from the end), or IndexError."""
    position = index + size if index < 0 else index
    if not 0 <= position < size:
        raise IndexError(index)
    return position


def round_robin_order(count: int, world_size: int) -> list[int]:
    """DeepSpeed's ``_round_robin_reorder``: position k of the flat group holds param order[k].

    >>> round_robin_order(5, 2)
    [0, 2, 4, 1, 3]
    """
    return [i for j in range(min(world_size, count)) for i in range(j, count, world_size)]


def parameter_alignment_paddings(numels: Sequence[int], element_size: int) -> list[int]:
    """Padding after each param (none after the last) so that every param starts on a 16-byte
    boundary of the 16-bit flat buffer, as ``parameter_alignment: true`` does.

    >>> parameter_alignment_paddings([5, 3, 4], 2)
    [3, 5, 0]
    """
    align = 16 // math.gcd(16, element_size)
    paddings, offset = [], 0
    for i, numel in enumerate(numels):
        offset += numel
        padding = 0 if i == len(numels) - 1 else (-offset) % align
        paddings.append(padding)
        offset += padding
    return paddings


def zero12_layout(
    groups: Sequence[Sequence[LayoutParam]],
    world_size: int,
    *,
    alignment_paddings: Sequence[Sequence[int]] | None = None,
    keep_group_padding: bool = False,
    stage: int = 2,
    partition_counts: Sequence[int] | None = None,
) -> ZeroLayout:
    """The ZeRO-1/2 layout of param groups given in flat order.

    `alignment_paddings[g][i]` follows the i-th param of group g. `keep_group_padding`: the
    saved fp32 partitions keep the tail padding (DeepSpeed's BF16_Optimizer files do).
    `partition_counts[g]`: the ranks group g is partitioned over, as saved (each the world
    size: a group over a subset of the ranks is not a layout zckpt reads).

    >>> a, b = LayoutParam("a", 5, 0), LayoutParam("b", 4, 0)
    >>> layout = zero12_layout([[a, b]], 3)
    >>> [(p.param, p.rank, p.flat_offset, p.param_offset, p.length) for p in layout.pieces]
    [(0, 0, 0, 0, 4), (0, 1, 0, 4, 1), (1, 1, 1, 0, 3), (1, 2, 0, 3, 1)]
    >>> layout.flat_groups[0].saved
    (4, 4, 1)
    """
    _check_world(world_size)
    counts = list(partition_counts) if partition_counts is not None else [world_size] * len(groups)
    if len(counts) != len(groups) or any(c != world_size for c in counts):
        raise ValueError(
            f"partition counts {counts} for {len(groups)} param groups over {world_size} ranks: each group must span every rank"
        )
    params: list[LayoutParam] = [p for group in groups for p in group]
    flat_groups: list[FlatGroup] = []
    pieces: list[Piece] = []
    base = 0
    for g, group in enumerate(groups):
        paddings = list(alignment_paddings[g]) if alignment_paddings is not None else [0] * len(group)
        if len(paddings) != len(group):
            raise ValueError(f"param group {g}: {len(paddings)} alignment paddings for {len(group)} params")
        group_numel = sum(p.numel for p in group) + sum(paddings)
        partition = zero2_align(group_numel, world_size) // world_size
        if keep_group_padding:
            saved = tuple(partition for _ in range(world_size))
        else:
            saved = tuple(max(0, min(partition, group_numel - rank * partition)) for rank in range(world_size))
        indices = tuple(range(base, base + len(group)))
        flat_groups.append(FlatGroup(g, indices, partition, saved, tuple(paddings), counts[g], tuple(range(counts[g]))))
        offset = 0
        for index, param, padding in zip(indices, group, paddings):
            pieces.extend(_cut(index, g, offset, param.numel, partition))
            offset += param.numel + padding
        base += len(group)
    pieces.sort(key=lambda p: (p.param, p.rank))
    return ZeroLayout(stage, world_size, tuple(params), tuple(flat_groups), tuple(pieces))


def _cut(param: int, flat: int, offset: int, numel: int, partition: int) -> list[Piece]:
    """Cut the flat-group range [offset, offset + numel) at partition boundaries."""
    pieces = []
    done = 0
    while done < numel:
        position = offset + done
        rank, start = divmod(position, partition)
        length = min(numel - done, partition - start)
        pieces.append(Piece(param, rank, flat, start, done, length))
        done += length
    return pieces


def zero3_layout(groups: Sequence[Sequence[LayoutParam]], world_size: int, sub_group_size: int) -> ZeroLayout:
    """The ZeRO-3 layout of param groups (in the optimizer's order), cut into sub-groups as
    DeepSpeed cuts them for `sub_group_size`.

    >>> a, b = LayoutParam("a", 5, 0), LayoutParam("b", 4, 0)
    >>> layout = zero3_layout([[a, b]], 3, 10**9)
    >>> [(p.param, p.rank, p.flat_offset, p.param_offset, p.length) for p in layout.pieces]
    [(0, 0, 0, 0, 2), (0, 1, 0, 2, 2), (0, 2, 0, 4, 1), (1, 0, 2, 0, 2), (1, 1, 2, 2, 2)]
    """
    params = [p for group in groups for p in group]
    members = zero3_sub_groups([[p.numel for p in group] for group in groups], world_size, sub_group_size)
    sub_groups = [[params[i] for i in indices] for indices in members]
    return zero3_layout_of_sub_groups(
        sub_groups, world_size, [params[indices[0]].group if indices else 0 for indices in members]
    )


def zero3_layout_of_sub_groups(
    sub_groups: Sequence[Sequence[LayoutParam]], world_size: int, param_groups: Sequence[int] | None = None
) -> ZeroLayout:
    """The ZeRO-3 layout of sub-groups given explicitly (as a checkpoint lists them);
    `param_groups[i]` is the param group of sub-group i (it overrides the params' own)."""
    _check_world(world_size)
    params: list[LayoutParam] = []
    flat_groups: list[FlatGroup] = []
    flats: list[int] = []
    offsets: list[int] = []
    shares: list[int] = []
    members_of: list[tuple[int, ...]] = []
    for flat, members in enumerate(sub_groups):
        group = param_groups[flat] if param_groups is not None else (members[0].group if members else 0)
        indices = []
        offset = 0
        for member in members:
            index = len(params)
            params.append(LayoutParam(member.name, member.numel, group))
            indices.append(index)
            share = zero3_partition(member.numel, world_size)[0]
            flats.append(flat)
            offsets.append(offset)
            shares.append(share)
            offset += share
        members_of.append(tuple(indices))
        flat_groups.append(
            FlatGroup(
                group,
                tuple(indices),
                offset,
                tuple(offset for _ in range(world_size)),
                (),
                world_size,
                tuple(range(world_size)),
            )
        )
    pieces = Zero3Pieces(
        world_size, tuple(p.numel for p in params), tuple(flats), tuple(offsets), tuple(shares), tuple(members_of)
    )
    return ZeroLayout(3, world_size, tuple(params), tuple(flat_groups), pieces)


def _check_world(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")

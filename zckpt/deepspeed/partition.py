"""DeepSpeed's partition and padding math, on plain integers.

Pure functions: no files, no tensors. The reader uses them to find where each parameter's
elements lie across rank files; a writer uses the same functions to lay them out.

ZeRO-1/2 (``stage_1_and_2.py``): the params of one param group are flattened in order, each
followed by an alignment padding (``param_alignment_paddings``, DeepSpeed >= 0.18; zero
before), the whole group padded to a multiple of ``2 * world_size`` and cut into ``world_size``
equal partitions. The saved partitions drop the group's tail padding (``group_paddings``), so
the last rank's partition is shorter. Worked example, world size 3, one group of params with
5 and 4 elements and no per-param padding::

    flat group  = p0[0:5] p1[0:4] pad pad pad     (9 -> 12 = multiple of 2*3)
    partitions  = [p0 0:4] [p0 4:5, p1 0:3] [p1 3:4, pad, pad, pad]
    saved sizes = 4, 4, 1                         (tail padding of 3 dropped)

ZeRO-3 (``stage3.py``): every param is partitioned on its own: each rank owns
``ceil(numel / world_size)`` elements of it (the last ranks padded), and a rank's flat fp32
group is the concatenation of its partitions of the params in that group. Worked example,
world size 3, params of 5 and 4 elements::

    per-rank share = ceil(5/3)=2, ceil(4/3)=2
    rank 0 flat    = p0[0:2] p1[0:2]
    rank 1 flat    = p0[2:4] p1[2:4]
    rank 2 flat    = p0[4:5] pad p1[4:4] pad pad  -> p0[4], pad, pad, pad
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Piece:
    """`length` elements starting at element `start` of piece number `index` of a sequence."""

    index: int
    start: int
    length: int


def zero3_partition(numel: int, world_size: int) -> tuple[int, int]:
    """Elements each rank owns of a ZeRO-3 param, and the padding on the full param.

    >>> zero3_partition(5, 3)
    (2, 1)
    >>> zero3_partition(6, 3)
    (2, 0)
    """
    share = math.ceil(numel / world_size)
    return share, share * world_size - numel


def zero2_align(numel: int, world_size: int) -> int:
    """Round up to the ZeRO-1/2 group alignment: a multiple of 2 * world_size (4-byte NCCL starts).

    >>> zero2_align(9, 3)
    12
    """
    align_to = 2 * world_size
    return align_to * math.ceil(numel / align_to)


def zero12_param_offsets(numels: Sequence[int], paddings: Sequence[int] | None = None) -> list[int]:
    """Offset of each param in a ZeRO-1/2 flat group; `paddings[i]` follows param i.

    >>> zero12_param_offsets([5, 3, 4], [1, 0, 0])
    [0, 6, 9]
    """
    offsets, position = [], 0
    for i, numel in enumerate(numels):
        offsets.append(position)
        position += numel + (paddings[i] if paddings else 0)
    return offsets


def zero12_group_numel(numels: Sequence[int], paddings: Sequence[int] | None = None) -> int:
    """Elements a ZeRO-1/2 group's params and their paddings take, before group alignment."""
    return sum(numels) + (sum(paddings) if paddings else 0)


def zero12_partition_sizes(group_numel: int, world_size: int) -> list[int]:
    """Saved partition size of each rank for a group (tail padding dropped).

    >>> zero12_partition_sizes(9, 3)
    [4, 4, 1]
    """
    share = zero2_align(group_numel, world_size) // world_size
    return [max(0, min(share, group_numel - rank * share)) for rank in range(world_size)]


def zero3_param_offsets(numels: Sequence[int], world_size: int) -> list[int]:
    """Offset of each param's partition within every rank's (concatenated) flat fp32 group.

    >>> zero3_param_offsets([5, 4], 3)
    [0, 2]
    """
    offsets, position = [], 0
    for numel in numels:
        offsets.append(position)
        position += zero3_partition(numel, world_size)[0]
    return offsets


def split_range(piece_sizes: Sequence[int], start: int, length: int) -> list[Piece]:
    """Cut the range [start, start + length) of a concatenation of pieces into per-piece parts.

    >>> split_range([4, 4, 1], 3, 5)
    [Piece(index=0, start=3, length=1), Piece(index=1, start=0, length=4)]

    Raises ValueError when the range reaches past the end of the concatenation.
    """
    if start < 0 or length < 0:
        raise ValueError(f"bad range start={start} length={length}")
    parts: list[Piece] = []
    base = 0
    end = start + length
    for index, size in enumerate(piece_sizes):
        if base >= end:
            break
        lo, hi = max(start, base), min(end, base + size)
        if lo < hi:
            parts.append(Piece(index, lo - base, hi - lo))
        base += size
    if sum(p.length for p in parts) != length:
        raise ValueError(f"range [{start}, {end}) reaches past the {sum(piece_sizes)} elements available")
    return parts



def zero3_sub_groups(group_numels: Sequence[Sequence[int]], world_size: int, sub_group_size: int) -> list[list[int]]:
    """The params (indices counted across all param groups) of each ZeRO-3 optimizer sub-group.

    Mirrors ``stage3._create_fp16_sub_groups``: within each param group, params are taken in
    order and a sub-group is closed once its per-rank partition reaches `sub_group_size`
    elements (or at the group's last param); a group smaller than that is one sub-group.

    >>> zero3_sub_groups([[10, 10, 10], [4]], 2, 9)
    [[0, 1], [2], [3]]
    >>> zero3_sub_groups([[10, 10, 10]], 2, 100)
    [[0, 1, 2]]
    """
    sub_groups: list[list[int]] = []
    base = 0
    for numels in group_numels:
        indices = list(range(base, base + len(numels)))
        base += len(numels)
        shares = [zero3_partition(n, world_size)[0] for n in numels]
        if sub_group_size >= sum(shares):
            sub_groups.append(indices)
            continue
        current: list[int] = []
        filled = 0
        for position, (index, share) in enumerate(zip(indices, shares)):
            current.append(index)
            filled += share
            if filled >= sub_group_size or position == len(indices) - 1:
                sub_groups.append(current)
                current, filled = [], 0
    return sub_groups

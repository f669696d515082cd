"""DeepSpeed's partition and padding arithmetic, on plain integers.

Pure functions: no files, no tensors. :mod:`zckpt.deepspeed.layout` builds every param's pieces
from them; the reader, the writer and the trainer use that layout, never these directly.

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
from typing import Sequence


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

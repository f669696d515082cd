"""DeepSpeed partition math on plain integers: simulate DeepSpeed's partitioning with numbered
elements, then check that the reader's arithmetic finds every element again."""

from __future__ import annotations

import random

import pytest

from zckpt.deepspeed.partition import (
    split_range,
    zero2_align,
    zero3_param_offsets,
    zero3_partition,
    zero12_group_numel,
    zero12_param_offsets,
    zero12_partition_sizes,
)


def zero3_rank_flats(numels: list[int], world: int) -> list[list[int]]:
    """What each rank's flat fp32 group holds in ZeRO-3: element ids, -1 for padding."""
    flats: list[list[int]] = [[] for _ in range(world)]
    base = 0
    for numel in numels:
        share, _ = zero3_partition(numel, world)
        padded = list(range(base, base + numel)) + [-1] * (share * world - numel)
        for rank in range(world):
            flats[rank] += padded[rank * share : (rank + 1) * share]
        base += numel
    return flats


def zero12_rank_partitions(numels: list[int], paddings: list[int], world: int) -> list[list[int]]:
    """Saved ZeRO-1/2 partitions: params with per-param padding, group tail padding dropped."""
    flat, base = [], 0
    for numel, pad in zip(numels, paddings):
        flat += list(range(base, base + numel)) + [-1] * pad
        base += numel
    sizes = zero12_partition_sizes(len(flat), world)
    share = zero2_align(len(flat), world) // world
    return [flat[r * share : r * share + sizes[r]] for r in range(world)]


def pieces_to_ids(pieces: list[list[int]], parts) -> list[int]:
    return [x for p in parts for x in pieces[p.index][p.start : p.start + p.length]]


@pytest.mark.parametrize("seed", range(200))
def test_zero3_reconstruction(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    numels = [rng.choice([0, 1, 2, 3, rng.randint(1, 60)]) for _ in range(rng.randint(1, 8))]
    flats = zero3_rank_flats(numels, world)
    # Cut each rank's flat into arbitrary sub-groups, as sub_group_size does.
    cuts = [sorted(rng.sample(range(len(f) + 1), k=min(2, len(f) + 1))) for f in flats]
    subgroups = [[f[: c[0]], f[c[0] : c[-1]], f[c[-1] :]] for f, c in zip(flats, cuts)]
    base = 0
    for numel, offset in zip(numels, zero3_param_offsets(numels, world)):
        share, padding = zero3_partition(numel, world)
        assert share * world - padding == numel
        gathered = []
        for rank in range(world):
            gathered += pieces_to_ids(subgroups[rank], split_range([len(s) for s in subgroups[rank]], offset, share))
        assert gathered[:numel] == list(range(base, base + numel))
        assert all(x == -1 for x in gathered[numel:])
        base += numel


@pytest.mark.parametrize("seed", range(200))
def test_zero12_reconstruction(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    numels = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
    paddings = [rng.choice([0, 0, (-n) % 8]) for n in numels[:-1]] + [0]
    parts = zero12_rank_partitions(numels, paddings, world)
    sizes = [len(p) for p in parts]
    assert zero2_align(zero12_group_numel(numels, paddings), world) == zero2_align(sum(sizes), world)
    base = 0
    for numel, offset in zip(numels, zero12_param_offsets(numels, paddings)):
        assert pieces_to_ids(parts, split_range(sizes, offset, numel)) == list(range(base, base + numel))
        base += numel


def test_split_range_rejects_ranges_past_the_end() -> None:
    with pytest.raises(ValueError):
        split_range([4, 4, 1], 8, 2)
    assert split_range([4, 0, 4], 2, 4)[1].index == 2  # empty pieces are skipped

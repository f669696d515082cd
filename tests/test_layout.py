"""The layout (zckpt/deepspeed/layout.py) against what DeepSpeed wrote, and against a direct
simulation of DeepSpeed's partitioning (written from its source, not from layout.py).

The DeepSpeed facts: for every sample, the layout a writer plans for the sample's own world
size, stage and config (from the optimizer's param order, not from the files' layout) must give
the files' param_shapes order, fp32 partition sizes, group paddings, alignment paddings, ZeRO-3
sub-groups and ds_ids, and every (numel, start) of DeepSpeed's param_slice_mappings.
"""

from __future__ import annotations

import math
import random

import pytest

from conftest import SAMPLE_LIST, Sample
from zckpt import torchfile
from zckpt.deepspeed.layout import LayoutParam, round_robin_order, zero3_layout, zero12_layout
from zckpt.deepspeed.reader import open_training_state
from zckpt.deepspeed.writer import Target, _ds_ids, plan_target, target_layout

RANK_FILES = [s for s in SAMPLE_LIST if s.meta["ds_config"]["zero_optimization"].get("offload_optimizer", {}).get("device") != "nvme"]


def _optim_files(case: Sample) -> list[dict]:
    tag = case.checkpoint / case.meta["tag"]
    prefix = "bf16_" if case.meta["dtype"] == "bf16" else ""
    return [torchfile.load(tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(case.meta["world_size"])]


def _planned(case: Sample):
    """The layout a writer plans for the sample's own world size, stage and config."""
    state = open_training_state(case.checkpoint)
    if state.index.offload == "nvme":  # reshard refuses these for now; the layout is the same
        zero = case.meta["ds_config"]["zero_optimization"]
        target = Target(3, case.meta["world_size"], case.meta["ds_config"], state.index.dtype, False, False, zero["sub_group_size"], False, "0.19.8")
        return state, target_layout(state, target)
    return state, target_layout(state, plan_target(state, case.meta["world_size"], case.meta["zero_stage"]))


@pytest.mark.parametrize("case", [s for s in RANK_FILES if s.meta["zero_stage"] < 3], ids=lambda s: s.name)
def test_zero12_layout_is_what_deepspeed_wrote(case: Sample) -> None:
    state, layout = _planned(case)
    model = torchfile.load(case.checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt")
    assert [[layout.params[i].name for i in g.params] for g in layout.flat_groups] == [list(g) for g in model["param_shapes"]]
    by_rank = layout.by_rank()
    for rank, inner in enumerate(_optim_files(case)):
        for g, group in enumerate(layout.flat_groups):
            assert inner["single_partition_of_fp32_groups"][g].numel == group.saved[rank]
            assert inner["base_optimizer_state"]["state"][g]["exp_avg"].numel == group.partition
            if "param_alignment_paddings" in inner:
                assert list(group.alignment_paddings) == list(inner["param_alignment_paddings"][g])
            if "roundrobin" in case.name:
                continue  # DeepSpeed 0.19.8 saves wrong param_slice_mappings with round_robin_gradients
            ours = {layout.params[p.param].name: (p.length, p.flat_offset) for p in by_rank.get((rank, g), [])}
            theirs = {n: (a.numel, a.start) for n, a in inner["param_slice_mappings"][g].items()}
            assert ours == theirs, (rank, g)
        padding = inner["group_paddings"]
        for g, group in enumerate(layout.flat_groups):
            used = sum(layout.params[i].numel for i in group.params) + sum(group.alignment_paddings)
            expected = max(0, min(group.partition, (rank + 1) * group.partition - max(used, rank * group.partition)))
            assert padding[g] == expected


@pytest.mark.parametrize("case", [s for s in SAMPLE_LIST if s.meta["zero_stage"] == 3], ids=lambda s: s.name)
def test_zero3_layout_is_what_deepspeed_wrote(case: Sample) -> None:
    state, layout = _planned(case)
    model = torchfile.load(case.checkpoint / case.meta["tag"] / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert [[layout.params[i].name for i in g.params] for g in layout.flat_groups] == [list(g) for g in model["param_shapes"]]
    ds_ids = _ds_ids(state)
    for inner in _optim_files(case):
        flats = inner["fp32_flat_groups"]
        for ref, group in zip(flats, layout.flat_groups):
            assert ref.numel in (group.partition, 0)  # 0: swapped to NVMe
            first, last = layout.params[group.params[0]].name, layout.params[group.params[-1]].name
            assert ref.attributes["ds_id"] == f"{ds_ids[first]}_{ds_ids[last]}"
    if case.meta.get("ds_ids"):
        assert {n: i for n, i in ds_ids.items()} == {n: i for n, i in case.meta["ds_ids"].items() if n in ds_ids}


# --- a direct simulation of DeepSpeed's partitioning, on numbered elements ------------------------
def simulate_zero12(numels: list[int], world: int, paddings: list[int]) -> list[list[int]]:
    """stage_1_and_2: flatten (with per-param padding), pad to 2*world, equal partitions."""
    flat, base = [], 0
    for numel, pad in zip(numels, paddings):
        flat += list(range(base, base + numel)) + [-1] * pad
        base += numel
    flat += [-1] * ((-len(flat)) % (2 * world))
    size = len(flat) // world
    return [flat[r * size : (r + 1) * size] for r in range(world)]


def simulate_zero3(numels: list[int], world: int) -> list[list[int]]:
    """stage3: each param padded to world * ceil(numel/world), rank r owns slice r of each."""
    flats: list[list[int]] = [[] for _ in range(world)]
    base = 0
    for numel in numels:
        share = math.ceil(numel / world)
        padded = list(range(base, base + numel)) + [-1] * (share * world - numel)
        for rank in range(world):
            flats[rank] += padded[rank * share : (rank + 1) * share]
        base += numel
    return flats


def _gather(layout, flats_of_group) -> list[int]:
    ids = []
    for pieces in layout.by_param():
        for p in pieces:
            ids += flats_of_group[p.flat][p.rank][p.flat_offset : p.flat_offset + p.length]
    return ids


@pytest.mark.parametrize("seed", range(200))
def test_layout_finds_every_element_of_a_simulated_deepspeed_partition(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    numels = [rng.choice([1, 2, 3, 7, 16, 33, rng.randint(1, 300)]) for _ in range(rng.randint(1, 12))]
    params = [LayoutParam(f"p{i}", n, 0) for i, n in enumerate(numels)]
    paddings = [rng.choice([0, 0, 1, 3]) for _ in numels] if rng.random() < 0.5 else [0] * len(numels)
    layout = zero12_layout([params], world, alignment_paddings=[paddings])
    assert _gather(layout, [simulate_zero12(numels, world, paddings)]) == list(range(sum(numels)))
    assert [len(f) for f in simulate_zero12(numels, world, paddings)] == [layout.flat_groups[0].partition] * world
    layout3 = zero3_layout([params], world, 10**9)
    assert _gather(layout3, [simulate_zero3(numels, world)]) == list(range(sum(numels)))
    assert layout3.flat_groups[0].partition == len(simulate_zero3(numels, world)[0])


def test_round_robin_matches_deepspeeds_reorder() -> None:
    """stage_1_and_2._round_robin_reorder, transcribed: bucket i % world, buckets in order."""
    for count in range(0, 12):
        for world in range(1, 6):
            buckets: dict[int, list[int]] = {}
            for i in range(count):
                buckets.setdefault(i % world, []).append(i)
            assert round_robin_order(count, world) == [i for b in buckets.values() for i in b]

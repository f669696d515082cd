"""zckpt's partition layout (zckpt/deepspeed/layout.py) against facts DeepSpeed wrote, never
against zckpt itself.

The facts are read with torch's own loader, ``torch.load(weights_only=True)`` (DeepSpeed's few
pickled classes registered as inert stand-ins), not with zckpt's reader:
- the size of every rank's flat tensors: ZeRO-1/2 ``single_partition_of_fp32_groups`` and the
  optimizer states, ZeRO-3 ``fp32_flat_groups`` per sub-group (empty where swapped to NVMe);
- ``group_paddings`` and (DeepSpeed >= 0.18) ``param_alignment_paddings``;
- ZeRO-1/2 ``param_slice_mappings`` (numel, start). Under ``round_robin_gradients`` DeepSpeed
  0.19.8 writes them in the param group's order, not where the bytes are (see
  sample_ckpts/FORMAT_OBSERVED.md): there they are checked against that order, and where the
  bytes are is checked by the live values;
- ZeRO-3 sub-groups (``param_shapes`` lists one per sub-group; ``param_groups`` say whose) and
  the ``ds_id`` attribute of each flat group;
- the live values (``reference/live.safetensors``, ``live_optimizer.safetensors``): every
  param's fp32 master and Adam moments, gathered from the torch-loaded partitions at the places
  the layout names, must equal what the engine held before saving; a misplaced piece shows.
The layout's inputs are DeepSpeed's facts too: param names and shapes in flattening order
(``param_shapes``), param groups, world size (``partition_count``) and config.

Below them, DeepSpeed's partition rules transcribed from its source (stage_1_and_2.py,
stage3.py; line numbers of 0.19.8) as independent reference functions, against which the layout
is compared on random shapes, and worked examples whose numbers are written by hand.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import SAMPLE_LIST, Sample, deepspeed_base_state, same_bits
from zckpt.deepspeed.layout import (
    LayoutParam,
    ZeroLayout,
    parameter_alignment_paddings,
    round_robin_order,
    zero3_layout,
    zero12_layout,
)
from zckpt.deepspeed.optim_state import slice_mapping_layout

# --- DeepSpeed's files, read by torch ----------------------------------------------------------


def _stand_in(module: str, name: str, base: type = object) -> type:
    cls = type(name, (base,), {})
    cls.__module__, cls.__qualname__ = module, name
    return cls


# The classes DeepSpeed pickles into its files (sample_ckpts/FORMAT_OBSERVED.md: GLOBALs), as
# plain holders of their state, so that torch's weights_only unpickler reads the files unaided.
torch.serialization.add_safe_globals(
    [
        _stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum", int),
        _stand_in("deepspeed.utils.tensor_fragment", "fragment_address"),
    ]
)


@lru_cache(maxsize=None)
def _torch_load(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def _tag(case: Sample) -> Path:
    return case.checkpoint / case.meta["tag"]


def _optim(case: Sample, rank: int) -> dict:
    prefix = "bf16_" if case.meta["dtype"] == "bf16" else ""
    return _torch_load(_tag(case) / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]


def _live_optimizer(case: Sample) -> dict[str, torch.Tensor] | None:
    path = case.folder / "reference" / "live_optimizer.safetensors"
    return load_file(path) if path.exists() else None


def _gather(layout: ZeroLayout, flats: dict[tuple[int, int], torch.Tensor], param: int) -> torch.Tensor:
    """A param's elements, from the ranks' flat tensors at the pieces the layout names."""
    pieces = layout.pieces_of(param)
    assert [p.param_offset for p in pieces] == [sum(q.length for q in pieces[:i]) for i in range(len(pieces))]
    return torch.cat([flats[p.rank, p.flat].reshape(-1)[p.flat_offset : p.flat_offset + p.length] for p in pieces])


# --- ZeRO-1/2 ----------------------------------------------------------------------------------

ZERO12 = [s for s in SAMPLE_LIST if s.meta["zero_stage"] in (1, 2)]


def _zero12_layout(case: Sample, bf16_optimizer: bool = False) -> tuple[ZeroLayout, dict, list[list[int]]]:
    """The layout of the sample's run, from DeepSpeed's facts: param_shapes (flat order), the
    world size, the 16-bit element size and parameter_alignment; zckpt computes the rest.
    `bf16_optimizer`: DeepSpeed's BF16_Optimizer saves its partitions with their padding."""
    model = _torch_load(_tag(case) / "mp_rank_00_model_states.pt")
    zero = model["ds_config"]["zero_optimization"]
    world = _optim(case, 0)["partition_count"][0]
    first = next(iter(model["param_shapes"][0]))
    element_size = model["module"][first].element_size()  # the 16-bit (or fp32) flat buffer's, not a buffer's
    groups = [
        [LayoutParam(name, math.prod(shape), g) for name, shape in shapes.items()]
        for g, shapes in enumerate(model["param_shapes"])
    ]
    paddings = [
        parameter_alignment_paddings([p.numel for p in group], element_size)
        if zero.get("parameter_alignment")
        else [0] * len(group)
        for group in groups
    ]
    return zero12_layout(groups, world, alignment_paddings=paddings, keep_group_padding=bf16_optimizer), zero, paddings


@pytest.mark.parametrize("case", ZERO12, ids=lambda s: s.name)
def test_zero12_partitions_are_where_deepspeed_put_them(case: Sample) -> None:
    bf16_optimizer = "zero_stage" not in _optim(case, 0)  # BF16_Optimizer's files have no stage key
    layout, zero, paddings = _zero12_layout(case, bf16_optimizer)
    padded = _zero12_layout(case)[0] if bf16_optimizer else layout  # the saved sizes of ZeRO's own optimizer
    round_robin = bool(zero.get("round_robin_gradients"))
    described = slice_mapping_layout(layout, round_robin)  # what the mappings say
    described_pieces = described.by_rank()
    masters: dict[tuple[int, int], torch.Tensor] = {}
    states: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # Adam's moments (Muon's momentum under BF16_Optimizer)
    live_optim = _live_optimizer(case)
    for rank in range(layout.world_size):
        inner = _optim(case, rank)
        for g, group in enumerate(layout.flat_groups):
            saved = inner["single_partition_of_fp32_groups"][g]
            assert saved.numel() == group.saved[rank], (rank, g)
            saved_state = deepspeed_base_state(inner)["state"][g]
            # Muon's momentum per whole param, except under BF16_Optimizer and an offloaded optimizer
            offload = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
            muon_whole = deepspeed_base_state(inner)["param_groups"][g].get("use_muon") and not (
                bf16_optimizer or offload
            )
            if muon_whole:
                # DeepSpeed's Muon: the full momentum of each param the partition touches, end to
                # end in flat order (stage_1_and_2.py _muon_momentum_buffer / get_flat_partition)
                touched = [p.param for p in layout.by_rank().get((rank, g), []) if p.length]
                expected = [live_optim[f"{layout.params[i].name}.momentum_buffer"].reshape(-1) for i in touched]
                assert same_bits(saved_state["momentum_buffer"], torch.cat(expected)), (rank, g)
            per_element = [k for k, v in saved_state.items() if torch.is_tensor(v) and v.dim() == 1 and k != "step"]
            for key in per_element if not muon_whole else ():
                states.setdefault(key, {})[rank, g] = saved_state[key]
                # elastic_checkpoint: the group's states less its padding (stage_1_and_2.py _get_base_optimizer_state)
                numel = group.saved[rank] if isinstance(inner["base_optimizer_state"], list) else group.partition
                assert states[key][rank, g].numel() == numel, (rank, g, key)
            # stage_1_and_2.py 541-550: the rank's padding, which ZeRO's saved fp32 partition lacks
            assert inner["group_paddings"][g] == group.partition - padded.flat_groups[g].saved[rank], (rank, g)
            if "param_alignment_paddings" in inner:
                assert list(inner["param_alignment_paddings"][g]) == paddings[g]
            mapping = {
                described.params[p.param].name: (p.length, p.flat_offset) for p in described_pieces.get((rank, g), [])
            }
            assert {n: (a.numel, a.start) for n, a in inner["param_slice_mappings"][g].items()} == mapping, (rank, g)
            masters[rank, g] = saved
    live, live_optim = case.live(), _live_optimizer(case)
    for index, param in enumerate(layout.params):
        assert same_bits(_gather(layout, masters, index).reshape(live[param.name].shape), live[param.name].float()), (
            param.name
        )
        for key, flats in states.items():
            # every flat group holding the param keeps this state (a Muon group keeps momentum_buffer only)
            if live_optim is not None and all((p.rank, p.flat) in flats for p in layout.pieces_of(index)):
                assert same_bits(_gather(layout, flats, index), live_optim[f"{param.name}.{key}"].reshape(-1)), (
                    param.name,
                    key,
                )


# --- ZeRO-3 ------------------------------------------------------------------------------------

ZERO3 = [s for s in SAMPLE_LIST if s.meta["zero_stage"] == 3]


@pytest.mark.parametrize("case", ZERO3, ids=lambda s: s.name)
def test_zero3_partitions_are_where_deepspeed_put_them(case: Sample) -> None:
    model = _torch_load(_tag(case) / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    zero = model["ds_config"]["zero_optimization"]
    world = _optim(case, 0)["partition_count"]
    sub_groups = model["param_shapes"]  # one per optimizer sub-group, in order
    owner = {
        i: g for g, group in enumerate(_optim(case, 0)["optimizer_state_dict"]["param_groups"]) for i in group["params"]
    }
    groups: list[list[LayoutParam]] = [[] for _ in range(max(owner.values()) + 1)]
    for i, shapes in enumerate(sub_groups):
        groups[owner[i]] += [LayoutParam(name, math.prod(shape), owner[i]) for name, shape in shapes.items()]
    layout = zero3_layout(groups, world, int(zero.get("sub_group_size", 1_000_000_000)))
    # zckpt cuts the param groups into DeepSpeed's sub-groups (stage3.py _create_fp16_sub_groups)
    assert [[layout.params[i].name for i in g.params] for g in layout.flat_groups] == [list(s) for s in sub_groups]
    assert [g.param_group for g in layout.flat_groups] == [owner[i] for i in range(len(sub_groups))]
    swapped = {i for i, g in enumerate(case.meta.get("fp32_sub_groups") or []) if g.get("swapped_to_nvme")}
    ids = case.meta.get("ds_ids")  # the ids DeepSpeed gave the live params
    masters: dict[tuple[int, int], torch.Tensor] = {}
    # the optimizer's own per-element states: Adam's moments, SGD's momentum (Muon's sub-groups
    # momentum_buffer, its Adam sub-groups exp_avg and exp_avg_sq)
    states: dict[str, dict[tuple[int, int], torch.Tensor]] = {
        key: {}
        for sub_group in _optim(case, 0)["optimizer_state_dict"]["state"].values()
        for key, value in sub_group.items()
        if key != "step" and torch.is_tensor(value) and value.ndim == 1
    }
    assert states
    for rank in range(world):
        inner = _optim(case, rank)
        for i, (flat, group) in enumerate(zip(inner["fp32_flat_groups"], layout.flat_groups)):
            assert flat.numel() == (0 if i in swapped else group.partition), (rank, i)
            if ids:
                first, last = (layout.params[group.params[k]].name for k in (0, -1))
                assert flat.ds_id == f"{ids[first]}_{ids[last]}", (rank, i)
            masters[rank, i] = flat
            for key in states:
                if key in inner["optimizer_state_dict"]["state"][i]:
                    states[key][rank, i] = inner["optimizer_state_dict"]["state"][i][key]
    live, live_optim = case.live(), _live_optimizer(case)
    for index, param in enumerate(layout.params):
        if any(p.flat in swapped for p in layout.pieces_of(index)):
            continue  # in offloaded_tensors/ (raw swap files), read by test_reader and the consolidation tests
        assert same_bits(_gather(layout, masters, index).reshape(live[param.name].shape), live[param.name].float()), (
            param.name
        )
        for key, flats in states.items():
            # every flat group holding the param keeps this state (a Muon group keeps momentum_buffer only)
            if live_optim is not None and all((p.rank, p.flat) in flats for p in layout.pieces_of(index)):
                assert same_bits(_gather(layout, flats, index), live_optim[f"{param.name}.{key}"].reshape(-1)), (
                    param.name,
                    key,
                )


def test_every_layout_feature_is_in_the_samples() -> None:
    """The checks above cover what changes the layout: round robin, parameter alignment, several
    param groups, ZeRO-3 sub-groups, NVMe-swapped sub-groups, world sizes 1 to 4."""
    zero = [s.meta["ds_config"]["zero_optimization"] for s in ZERO12]
    assert any(z.get("round_robin_gradients") for z in zero) and any(z.get("parameter_alignment") for z in zero)
    assert any(s.meta["param_groups"] > 1 for s in ZERO12) and any(s.meta["param_groups"] > 1 for s in ZERO3)
    assert any((s.meta.get("n_fp32_sub_groups") or 1) > 1 for s in ZERO3)
    assert any(g.get("swapped_to_nvme") for s in ZERO3 for g in s.meta.get("fp32_sub_groups") or [])
    assert {s.meta["world_size"] for s in SAMPLE_LIST} >= {1, 2, 3, 4}


# --- DeepSpeed's rules, transcribed from its source, against the layout on random shapes -------


def deepspeed_zero12(
    numels: list[int], world: int, element_size: int, parameter_alignment: bool
) -> tuple[list[int], list[list[int]], list[int]]:
    """stage_1_and_2.py (0.19.8): per-param paddings (lines 444, 490-500: 16-byte starts, none
    after the last param), the flat buffer aligned to 2 * world (lines 387, 441,
    flatten_dense_tensors_aligned), equal partitions (get_data_parallel_partitions), and each
    rank's padding (lines 541-550). Returns the paddings, each rank's elements (param index per
    element, -1 for padding) and each rank's padding."""
    param_alignment = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    flat: list[int] = []
    paddings = []
    for index, numel in enumerate(numels):
        flat += [index] * numel
        padding = 0 if index == len(numels) - 1 else (-len(flat)) % param_alignment
        paddings.append(padding)
        flat += [-1] * padding
    padded_group_numel = len(flat)
    alignment = 2 * world
    flat += [-1] * ((alignment - len(flat) % alignment) % alignment)
    size = len(flat) // world
    partitions = [flat[r * size : (r + 1) * size] for r in range(world)]
    rank_paddings = []
    for rank in range(world):
        left_boundary = rank * size
        if padded_group_numel <= left_boundary:
            rank_paddings.append(size)
        elif padded_group_numel < left_boundary + size:
            rank_paddings.append(left_boundary + size - padded_group_numel)
        else:
            rank_paddings.append(0)
    return paddings, partitions, rank_paddings


def deepspeed_sub_groups(group_numels: list[list[int]], world: int, sub_group_size: int) -> list[list[int]]:
    """stage3.py _create_fp16_sub_groups (lines 1210-1232), param.partition_numel() being
    ceil(numel / world) (partition_parameters.py): param indices counted across the groups."""
    result, base = [], 0
    for numels in group_numels:
        indices = list(range(base, base + len(numels)))
        base += len(numels)
        shares = [-(-n // world) for n in numels]
        if sub_group_size >= sum(shares):
            result.append(indices)
            continue
        sub, size = [], 0
        for position, (index, share) in enumerate(zip(indices, shares)):
            sub.append(index)
            size += share
            if size >= sub_group_size or position == len(indices) - 1:
                result.append(sub)
                sub, size = [], 0
    return result


@pytest.mark.parametrize("seed", range(200))
def test_layout_follows_deepspeeds_rules_on_random_shapes(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    numels = [
        rng.choice([1, 2, 3, 7, 16, 33, rng.randint(1, 300), rng.randint(1, 5000)]) for _ in range(rng.randint(1, 12))
    ]
    element_size = rng.choice([2, 4])
    aligned = rng.random() < 0.5
    paddings, partitions, rank_paddings = deepspeed_zero12(numels, world, element_size, aligned)
    ours = parameter_alignment_paddings(numels, element_size) if aligned else [0] * len(numels)
    assert ours == paddings
    layout = zero12_layout(
        [[LayoutParam(f"p{i}", n, 0) for i, n in enumerate(numels)]], world, alignment_paddings=[ours]
    )
    group = layout.flat_groups[0]
    assert group.partition == len(partitions[0])
    assert [group.partition - s for s in group.saved] == rank_paddings
    for rank in range(world):
        placed = [-1] * group.partition
        for piece in layout.pieces_in(rank, 0):
            placed[piece.flat_offset : piece.flat_offset + piece.length] = [piece.param] * piece.length
        assert placed == partitions[rank], rank
    for index, pieces in enumerate(layout.by_param()):
        assert sum(p.length for p in pieces) == numels[index]

    # ZeRO-3: each param cut on its own, ceil(numel / world) per rank (the last ranks padded)
    groups = [numels[: len(numels) // 2], numels[len(numels) // 2 :]]
    sub_group_size = rng.choice([1, 10, 50, 10**9])
    layout3 = zero3_layout(
        [[LayoutParam(f"p{i}", n, g) for i, n in enumerate(group)] for g, group in enumerate(groups)],
        world,
        sub_group_size,
    )
    expected = deepspeed_sub_groups(groups, world, sub_group_size)
    assert [list(g.params) for g in layout3.flat_groups] == expected
    for flat, members in enumerate(expected):
        shares = [-(-numels[i] // world) for i in members]
        assert layout3.flat_groups[flat].partition == sum(shares)
        for k, index in enumerate(members):
            for piece in layout3.pieces_of(index):
                assert (piece.flat, piece.flat_offset, piece.param_offset) == (
                    flat,
                    sum(shares[:k]),
                    piece.rank * shares[k],
                )


def test_round_robin_matches_deepspeeds_reorder() -> None:
    """stage_1_and_2._round_robin_reorder (lines 901-922), transcribed: bucket i % world, buckets
    in order of first appearance."""
    for count in range(0, 12):
        for world in range(1, 6):
            buckets: dict[int, list[int]] = {}
            for i in range(count):
                buckets.setdefault(i % world, []).append(i)
            assert round_robin_order(count, world) == [i for b in buckets.values() for i in b]


def test_worked_examples() -> None:
    """Numbers written by hand from DeepSpeed's rules (FORMAT_OBSERVED.md's example included)."""
    # z1_bf16_ws3_groups, group 0: 4107 elements -> 4110 (a multiple of 2 * 3), 1370 per rank,
    # the last rank saves 1367 (group_paddings [3, 0] on rank 2)
    layout = zero12_layout([[LayoutParam("w", 4107, 0)]], 3)
    assert (layout.flat_groups[0].partition, layout.flat_groups[0].saved) == (1370, (1370, 1370, 1367))
    # world 4, 10 elements: aligned to 16, 4 per rank; rank 2 holds 2 and 2 of padding, rank 3
    # only padding (stage_1_and_2.py 541-550 give paddings 0, 0, 2, 4)
    layout = zero12_layout([[LayoutParam("a", 6, 0), LayoutParam("b", 4, 0)]], 4)
    assert layout.flat_groups[0].saved == (4, 4, 2, 0)
    assert [(p.param, p.rank, p.flat_offset, p.param_offset, p.length) for p in layout.pieces] == [
        (0, 0, 0, 0, 4),
        (0, 1, 0, 4, 2),
        (1, 1, 2, 0, 2),
        (1, 2, 0, 2, 2),
    ]
    # bf16 parameter_alignment: 16-byte (8-element) starts, nothing after the last param
    assert parameter_alignment_paddings([5, 8, 1, 3], 2) == [3, 0, 7, 0]
    assert parameter_alignment_paddings([5, 8, 1, 3], 4) == [3, 0, 3, 0]
    # ZeRO-3, world 3: a 5-element param is 2, 2, 1 (+1 padding); a 4-element one 2, 2, 0 (+2)
    layout3 = zero3_layout([[LayoutParam("a", 5, 0), LayoutParam("b", 4, 0)]], 3, 10**9)
    assert layout3.flat_groups[0].partition == 4
    assert [(p.param, p.rank, p.flat_offset, p.param_offset, p.length) for p in layout3.pieces] == [
        (0, 0, 0, 0, 2),
        (0, 1, 0, 2, 2),
        (0, 2, 0, 4, 1),
        (1, 0, 2, 0, 2),
        (1, 1, 2, 2, 2),
    ]

"""DeepSpeed's Muon optimizer (``MuonWithAuxAdam``) in ZeRO-1/2 files: its momentum is kept per
whole param, not per element of the flat partition.

DeepSpeed 0.19.8 splits every param group in two (``engine._muon_param_groups``,
runtime/engine.py:2425-2474): a Muon half (``use_muon: True``; the params ``set_optimizer_flags``
tags, deepspeed/__init__.py:368-372: two or more dimensions and no "embed" / "lm_head" in the
name) and an Adam half (``use_muon: False``: exp_avg, exp_avg_sq, step). ZeRO-1/2 give the torch
optimizer one flat partition per group, but a Muon group's only state, ``momentum_buffer``, is
created in ``_muon_momentum_buffer`` (runtime/zero/stage_1_and_2.py:2812-2836) as
``sum(t.numel() for t in tensor_list)`` elements, ``tensor_list`` being ``params_in_partition``:
the *full* momentum of every param the rank's partition touches, back to back in flat order
(``get_flat_partition`` narrows it at a running ``buffer_idx``, :2749-2760 and :2857-2871), in the
gradient's dtype (bf16 in a bf16 run). A param cut between ranks has its whole momentum on each
of them: its gradient is all-reduced among exactly those ranks (``muon_copy_ranks``,
:1647-1694), so each computes the same momentum from the same inputs.

ZeRO-3 keeps Muon's momentum per element of the sub-group partition (``_create_momentum_buffer``
and ``_muon_update_sub_group``, runtime/zero/stage3.py:1066-1079, :1786-1816), like any other
per-element state; nothing here applies to it.

Loading: the default (rigid) ZeRO-1/2 resume hands each rank's saved state to the torch
optimizer as it is (``_load_legacy_checkpoint``, :3745-3748), so a file must hold its own rank's
layout; the elastic path would give every rank rank 0's buffer (``_partition_base_optimizer_state``
returns ``all_partition_states[0]`` for a state that is not the partition's size, :3566-3568).
"""

from __future__ import annotations

from typing import Any

from .layout import Piece, ZeroLayout

MUON_FLAG = "use_muon"  # the param group key engine._muon_param_groups sets
MOMENTUM = "momentum_buffer"


def is_muon_group(hyperparams: Any) -> bool:
    """Whether a saved param group is the Muon half of DeepSpeed's MuonWithAuxAdam."""
    return isinstance(hyperparams, dict) and hyperparams.get(MUON_FLAG) is True


def whole_param_state(hyperparams: Any, key: str, stage: int, per_element: bool = False) -> bool:
    """Whether `key` of a flat group with these hyperparameters is kept per whole param (a Muon
    group's momentum_buffer at ZeRO-1/2) rather than per element of the partition.

    `per_element`: the run keeps Muon's momentum per element of the partition even at ZeRO-1/2
    (:func:`momentum_per_element`)."""
    return stage in (1, 2) and not per_element and key == MOMENTUM and is_muon_group(hyperparams)


def momentum_per_element(bf16_optimizer: bool, optimizer_offload: bool) -> bool:
    """Whether a ZeRO-1/2 run keeps Muon's momentum per element of the flat partition, as its
    masters: DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation), whose Muon
    momentum "has the same partition layout as the master weights" (``_prepare_muon_updates``,
    runtime/bf16_optimizer.py:436-452: ``zeros_like(partition)``); and a ZeRO-1/2 run offloading
    its optimizer (``cpu_offload``), whose ``_apply_muon_updates_cpu_offload`` makes it
    ``zeros_like(flat_param)`` and writes each param's share at its partition offset
    (runtime/zero/stage_1_and_2.py:2059-2120; a buffer of another size is replaced by zeros,
    :2079-2083, so a whole-param buffer loaded there would be lost)."""
    return bf16_optimizer or optimizer_offload


def touched(layout: ZeroLayout, pieces: list[Piece]) -> list[tuple[int, int]]:
    """The params a rank's partition of a flat group touches (`pieces`: ``layout.by_rank()`` of
    it), as DeepSpeed's ``get_partition_info`` lists them (stage_1_and_2.py:2579-2611: in flat
    order), each with its element offset in the rank's Muon momentum_buffer (the numels before it)."""
    pieces = sorted((p for p in pieces if p.length), key=lambda p: p.flat_offset)
    out, offset = [], 0
    for piece in pieces:
        out.append((piece.param, offset))
        offset += layout.params[piece.param].numel
    return out


def buffer_numel(layout: ZeroLayout, pieces: list[Piece]) -> int:
    """Elements of a rank's Muon momentum_buffer of a flat group (`pieces`: its pieces)."""
    return sum(layout.params[p].numel for p, _ in touched(layout, pieces))


def holders(layout: ZeroLayout) -> list[list[tuple[int, int]]]:
    """For each param of the layout, every (rank, element offset) whose Muon momentum_buffer
    holds its full momentum, lowest rank first."""
    out: list[list[tuple[int, int]]] = [[] for _ in layout.params]
    by_rank = layout.by_rank()
    for flat, group in enumerate(layout.flat_groups):
        for rank in group.ranks:
            for param, offset in touched(layout, by_rank.get((rank, flat), [])):
                out[param].append((rank, offset))
    return out

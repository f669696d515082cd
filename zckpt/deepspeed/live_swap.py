"""A ZeRO-3 checkpoint read with a live swap folder (``--swap-folder``): whether the folder can
belong to the checkpoint's run, and once read, the sub-group files its layout does not claim,
the 16-bit param swaps compared with the masters, and what was read from where (index notes).
"""

from __future__ import annotations

import dataclasses

from ..core.errors import LayoutError
from . import swap_folder as swap
from .partitions import Partitions
from .survey import Survey


def check_swap_folder(result: Survey, folder: swap.SwapFolder, zero3: bool) -> bool:
    """A swap folder belongs to a ZeRO-3 NVMe-offloaded run of the checkpoint's world size.
    Guarantee: DeepSpeed keeps swap files only for ``offload_optimizer.device: nvme``, one
    ``rank<R>`` folder per data-parallel rank (deepspeed/runtime/engine.py:4937-4946)."""
    assert result.location is not None
    if not zero3 or result.offload != "nvme":
        result.add(
            LayoutError,
            result.location.tag_dir,
            f"saved by a {'ZeRO-3' if zero3 else f'ZeRO-{result.zero_stage}'} run without offload_optimizer on NVMe: the swap folder {folder.root} cannot belong to its run",
        )
        return False
    problem = swap.check_world(folder, result.world_size or 0)
    if problem is not None:
        result.problems.append(problem)
        return False
    return True


def report_swap_folder(result: Survey, folder: swap.SwapFolder, partitions: Partitions) -> None:
    """Refuse sub-group files the layout does not claim, compare the 16-bit param swaps with
    the masters, and put what was read from where into the index notes."""
    state = result.state
    layout = partitions.layout
    assert state is not None and result.index is not None and layout is not None
    for orphan in swap.sub_group_orphans(folder, partitions.swap_claimed):
        result.add(
            LayoutError,
            orphan.path,
            f"not in the checkpoint's layout (it swaps no sub-group {orphan.swap_id} with this state): a swap folder of another run or layout",
        )
    if result.problems:
        result.index = result.state = None
        return
    ds_ids, swap_ids = partitions.ds_ids, partitions.swap_ids
    sub_groups = tuple(
        swap.SwappedSubGroup(
            i, swap_ids.get(i), tuple(layout.params[p].name for p in group.params), group.partition, i in swap_ids
        )
        for i, group in enumerate(layout.flat_groups)
    )
    agreement = None
    dtype = swap.PARAM_DTYPES.get(folder.param_dtypes[0]) if folder.param_dtypes else None
    if dtype is not None:
        masters = {e.name: e.source for e in result.index.entries if e.kind == "param"}
        world = layout.world_size
        pieces = [
            (param.name, ds_ids[param.name], masters[param.name], [p.rank for p in parts], -(-param.numel // world))
            for param, parts in zip(layout.params, layout.by_param())
            if param.name in ds_ids and param.name in masters
        ]
        agreement = swap.compare_16bit(folder, pieces, dtype)
    report = swap.SwapReport(
        root=folder.root,
        world_size=layout.world_size,
        sub_groups=sub_groups,
        gradient_files=len(folder.of_kind("gradient")),
        orphans=tuple(f.path for f in folder.of_kind("orphan")),
        total_bytes=folder.total_bytes,
        checkpoint_tag=result.index.tag,
        checkpoint_step=state.global_steps,
        agreement=agreement,
        param_names={i: name for name, i in ds_ids.items()},
    )
    result.swap = report
    result.notes.extend(report.notes())
    index = dataclasses.replace(result.index, notes=tuple(result.notes))
    result.index = index
    result.state = dataclasses.replace(state, index=index)

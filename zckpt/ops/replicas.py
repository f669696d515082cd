"""Copies of one tensor that a checkpoint keeps in several places and that must hold the same
bits: a tied param that several pipeline stages each keep, a param every tensor rank holds whole
(``CheckpointIndex.replicas``); and the 16-bit weights a ZeRO-1/2 run keeps beside each fp32
master, which must be the master rounded (``CheckpointIndex.rounded_copies``).
Outputs write each name once; this is the check that the copy left out was the same.
"""

from __future__ import annotations

from typing import Sequence

from ..core.index import CheckpointIndex, Entry
from ..core.state import TrainingState
from ..io.materialize import unequal_columns, unequal_elements
from ..io.reading import FileReader

_CHUNK = 1 << 22  # elements compared at a time: memory stays bounded whatever the tensor's size
_ROUNDING_CHUNK = 1 << 20  # the same for masters rounded (the rounding's temporaries are a few times a chunk)


def replica_problems(index: CheckpointIndex, reader: FileReader | None = None) -> list[str]:
    """One line per replica that differs from the entry of its name (shape, dtype or bits).

    Guarantee: a pipeline stage's copy of a tied module's ``tied_weight_attr`` param is
    broadcast from the first stage and given one all-reduced gradient
    (deepspeed/runtime/pipe/module.py:457-479), so equal where its moments are (the reader
    leaves out the copies DeepSpeed does not keep in step: ``pipeline._copies_out_of_step``); a
    param every tensor rank holds whole gets the same gradient on each from the same inputs
    (the model's, Megatron's or AutoTP's, not a DeepSpeed check)."""
    kept = {e.name: e for e in index.entries}
    problems = []
    own = reader is None
    reader = reader or FileReader()
    try:
        for replica in index.replicas:
            entry = kept.get(replica.name)
            if entry is None:
                continue
            differs = _difference(reader, entry, replica)
            if differs:
                problems.append(
                    f"{_where(replica)}: its copy of {replica.name} {differs} the copy in {_where(entry)}: "
                    "the copies of a param that several ranks keep must be equal (a file is from another save, or damaged)"
                )
    finally:
        if own:
            reader.close()
    return problems


def rounded_copy_problems(
    index: CheckpointIndex,
    reader: FileReader | None = None,
    differences: Sequence[str | None] | None = None,
    zenflow: bool = False,
) -> list[str]:
    """One line per file whose 16-bit copies are not all their masters rounded to the copy's
    dtype (round to nearest even, as the optimizer's copy back does after each step). A
    model-states, layer or expert file of another step than the optimizer files (or a damaged
    one) shows here.

    Guarantee: the 16-bit weights start as the masters' source (the fp32 partition is the
    16-bit one widened, zero/stage_1_and_2.py:560-561) and after every step that is not
    skipped the fp32 partition is copied back into them (``step``, zero/stage_1_and_2.py:3145,
    :3095-3096 with CPU offload; an overflow skips both, :3049-3060); ZeRO-0's BF16_Optimizer
    (bf16_optimizer.py:431, 593-597), FP16_Optimizer (fp16/fused_optimizer.py:364) and
    FP16_UnfusedOptimizer (fp16/unfused_optimizer.py:239) do the same. Not under ZenFlow, whose
    selective optimizer updates some columns of the 16-bit weights after that copy: there
    `differences` are :func:`zenflow_difference`'s (`zenflow` true words the line so).

    `differences`: each of ``index.rounded_copies``' :func:`rounding_difference`, worked out
    elsewhere (verify shares them between the processes of a torchrun job); nothing is read then."""
    if differences is None:
        own = reader is None
        reader = reader or FileReader()
        try:
            differences = [rounding_difference(reader, master, copy) for copy, master in index.rounded_copies]
        finally:
            if own:
                reader.close()
    by_file: dict[str, list[tuple[Entry, Entry, str]]] = {}
    counted: dict[str, int] = {}
    for (copy, master), differs in zip(index.rounded_copies, differences):
        counted[_where(copy)] = counted.get(_where(copy), 0) + 1
        if differs:
            by_file.setdefault(_where(copy), []).append((copy, master, differs))
    problems = []
    for path, wrong in by_file.items():
        copy, master, differs = wrong[0]
        problems.append(
            f"{path}: {len(wrong)} of its {counted[path]} module weights are not their masters rounded "
            + ("outside the columns ZenFlow's selective optimizer updates " if zenflow else "")
            + f"({copy.name}, {copy.source.dtype.name}, {differs} the {master.source.dtype.name} master in "
            f"{_where(master)}): the module's weights and the optimizer's masters are not of the same step "
            "(a file is from another save, or damaged)"
        )
    return problems


def rounding_difference(reader: FileReader, master: Entry, copy: Entry) -> str | None:
    """How `copy` differs from `master` rounded to its dtype, or None when every bit agrees."""
    numel = copy.source.numel
    if master.source.numel != numel:
        return f"has {numel} elements, not {master.source.numel} as"
    unequal = unequal_elements(reader, master.source, copy.source, _ROUNDING_CHUNK)
    return f"differs in {unequal} of {numel} elements from" if unequal else None


def zenflow_difference(
    reader: FileReader, master: Entry, copy: Entry, topk_ratio: float, partitions: int
) -> str | None:
    """How a ZenFlow run's 16-bit `copy` differs from `master` rounded beyond the columns its
    selective optimizer updates, or None when it does not.

    Guarantee (DeepSpeed 0.19.8, ZenFlowZeroOptimizerSequential): at each accumulation boundary
    the masters are copied into the 16-bit weights whole, as without ZenFlow; then, and at the
    micro-steps between, ZenFlowSelectiveAdamW steps the selected columns of each 2-D weight
    (``param.data[:, param.selected_indices] = ...``, ops/adam/zenflow_torch_adam.py:158) and
    1-D weights whole (the copy back of ``temp_selected_param``, :122-124, runs on the param's
    own data). At a selection boundary the masters are reset to the 16-bit weights widened
    (``sync_fp32_param_from_gpu``, runtime/zenflow/zenflow_stage_1_and_2.py:174-186), so older
    selections leave no difference behind. Each rank whose partition holds part of a weight
    selects ``max(1, int(n * topk_ratio))`` of that part's n columns (:_num_selected_columns,
    :223-225): a 2-D weight differs in at most ``int(columns * topk_ratio) + partitions`` of its
    columns. Weights of other dimensions are not judged."""
    numel = copy.source.numel
    if master.source.numel != numel:
        return f"has {numel} elements, not {master.source.numel} as"
    if len(copy.source.shape) != 2 or numel == 0:
        return None
    columns = copy.source.shape[1]
    most = int(columns * topk_ratio) + partitions
    unequal, changed = unequal_columns(reader, master.source, copy.source, columns, _ROUNDING_CHUNK)
    count = int(changed.sum())
    if count <= most:
        return None
    return (
        f"differs in {unequal} of {numel} elements, in {count} of its {columns} columns (ZenFlow's selective "
        f"optimizer updates at most {most}), from"
    )


def _where(entry: Entry) -> str:
    return entry.source.segments[0].path if entry.source.segments else entry.name


def _difference(reader: FileReader, a: Entry, b: Entry) -> str | None:
    """How `b`'s tensor differs from `a`'s, or None when the bits are equal."""
    if (a.source.shape, a.source.dtype) != (b.source.shape, b.source.dtype):
        return f"is {b.source.dtype.name} {list(b.source.shape)}, not {a.source.dtype.name} {list(a.source.shape)} as"
    unequal = unequal_elements(reader, a.source, b.source, _CHUNK)
    return f"differs in {unequal} of {a.source.numel} elements from" if unequal else None


def state_copy_problems(state: TrainingState, reader: FileReader | None = None) -> list[str]:
    """One line per further copy of a param's optimizer state (``TrainingState.state_copies``)
    that differs from the one read.

    Guarantee: DeepSpeed's Muon at ZeRO-1/2 gives every rank whose partition touches a param the
    same all-reduced gradient of the whole param (``muon_copy_ranks``,
    runtime/zero/stage_1_and_2.py:1647-1694) and each updates its full momentum from it with the
    same ``muon_update`` (:2749-2760), so the copies are equal (zckpt/deepspeed/muon.py)."""
    problems = []
    own = reader is None
    reader = reader or FileReader()
    try:
        for name, key, source in state.state_copies:
            kept = state.param(name).states.get(key)
            if kept is None:
                continue
            differs = _difference(reader, Entry(name, "param", kept), Entry(name, "param", source))
            if differs:
                where = source.segments[0].path if source.segments else name
                kept_where = kept.segments[0].path if kept.segments else name
                problems.append(
                    f"{where}: its copy of {name}'s {key} {differs} the copy in {kept_where}: every rank whose "
                    "partition touches a param keeps the same full momentum (a file is from another save, or damaged)"
                )
    finally:
        if own:
            reader.close()
    return problems

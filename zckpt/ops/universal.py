"""``zckpt to-universal``: write DeepSpeed's universal checkpoint of any ZeRO checkpoint.

Read the whole training state (a ZeRO checkpoint of any stage, or a universal folder), plan one
file per param and state plus the files the loader needs (pure), then stream the bytes with the
writer that ``reshard`` uses. The output, ``OUTPUT_DIR/<tag>_universal`` and
``OUTPUT_DIR/latest_universal``, resumes under ``"checkpoint": {"load_universal": true}`` at any
world size, in a run of the target ZeRO stage. Under torchrun the job's processes split the
files between them; the output is byte-identical to a single process's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ..core.errors import UsageError
from ..core.state import TrainingState
from ..deepspeed.elastic import reshard_refused
from ..deepspeed.muon import momentum_per_element
from ..deepspeed.reader import open_training_state
from ..deepspeed.save import write_checkpoint
from ..deepspeed.universal import UniversalLoss, plan_universal, universal_loss
from ..deepspeed.writer import CheckpointPlan
from ..deepspeed.zenflow import module_weights_note, unsaved_moments_note
from ..io.jobs import job_share
from ..io.output import is_inside, refuse_output_inside_input


@dataclass(frozen=True)
class UniversalResult:
    output_dir: str
    tag: str  # the universal folder's name, e.g. global_step100_universal
    source: TrainingState
    target_stage: int
    files: tuple[str, ...]
    bytes_written: int
    # what DeepSpeed's universal loader of that stage will not restore (written with allow_state_loss)
    loss: UniversalLoss | None = None
    # what the folder does not keep beyond optimizer state (a ZenFlow run's 16-bit weights), and what
    # the input itself lacks (a ZenFlow overlap_step run's moments, which no file holds)
    notes: tuple[str, ...] = ()


def plan_to_universal(
    checkpoint: str | os.PathLike[str],
    *,
    tag: str | None = None,
    target_stage: int | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    tp_rules: str | os.PathLike[str] | None = None,
    expert_parallel: int | None = None,
    tensor_parallel: int | None = None,
) -> CheckpointPlan:
    """Read the checkpoint's training state and plan every file of its universal folder."""
    state = open_training_state(checkpoint, tag, swap_folder, tp_rules)
    return plan_universal(
        state, target_stage=_stage(target_stage), expert_parallel=expert_parallel, tensor_parallel=tensor_parallel
    )


def _stage(stage: int | None) -> int | None:
    if stage is not None and stage not in (1, 2, 3):
        raise UsageError(None, f"--target-stage must be 1, 2 or 3, got {stage}")
    return stage


def to_universal(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    target_stage: int | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
    swap_folder: str | os.PathLike[str] | None = None,
    wait: bool = False,
    tp_rules: str | os.PathLike[str] | None = None,
    allow_state_loss: bool = False,
    expert_parallel: int | None = None,
    tensor_parallel: int | None = None,
) -> UniversalResult:
    """Write the universal checkpoint of `checkpoint` (tag `tag`, default: the latest) into
    `output_dir`, in the flavour a ZeRO-`target_stage` run loads (default: the input's stage).
    With `swap_folder`, the masters and optimizer states of swapped sub-groups come from that
    live ZeRO-Infinity folder (`checkpoint` gives the layout). `wait`: another zckpt run writing
    `output_dir` is waited for instead of refused. `tp_rules`: a ``--tp-rules`` file, for a
    tensor-parallel run that records no merge rules (each param's files then carry its rule).

    DeepSpeed's universal loaders read some layouts in one form only, so the folder is written for
    the loading run's: `expert_parallel`, a mixture-of-experts run's expert-parallel degree
    (default: the checkpoint's; its loader finds experts by their local ids at that degree);
    `tensor_parallel` 1, a tensor-parallel run as the unsharded model's (the only form a ZeRO-3
    run loads: its loader cuts no tensor rank's piece).

    Where DeepSpeed's universal loader of the target stage would not restore part of the
    optimizer's state (:func:`~zckpt.deepspeed.universal.universal_loss`: AMSGrad's
    max_exp_avg_sq at ZeRO-3, NAdam's mu_product, an SGD run's momentum at ZeRO-3), nothing is
    written and a UsageError says what and why, unless `allow_state_loss` (the result's `loss`
    then says it): ``reshard`` writes a checkpoint of the new layout that keeps every state."""
    output_dir = os.fspath(output_dir)
    source = open_training_state(checkpoint, tag, swap_folder, tp_rules)
    plan = plan_universal(
        source, target_stage=_stage(target_stage), expert_parallel=expert_parallel, tensor_parallel=tensor_parallel
    )
    loss = universal_loss(
        source, plan.target.stage, momentum_per_element(plan.target.bf16_optimizer, plan.target.optimizer_offload)
    )
    if loss and not allow_state_loss:
        raise UsageError(
            os.fspath(checkpoint),
            f"{loss.describe()}; "
            + (
                "no reshard of this elastic_checkpoint Muon run is written either (see `zckpt reshard`)"
                if reshard_refused(source)
                else "`zckpt reshard` to the new world size keeps every state"
            )
            + ("" if loss.missing else ", or pass --allow-state-loss to write the universal folder anyway"),
        )
    index = source.index
    # beside the tag folders, as DeepSpeed's ds_to_universal is used, but nowhere else inside the input
    refuse_output_inside_input(
        os.fspath(output_dir), (index.checkpoint_dir, index.tag_dir), may_be=index.checkpoint_dir
    )
    if is_inside(index.tag_dir, os.path.join(output_dir, plan.tag)):
        raise UsageError(output_dir, f"would replace the input {index.tag_dir}; choose another folder")
    part, parts, barrier = job_share(output_dir)
    result = write_checkpoint(
        plan,
        output_dir,
        overwrite=overwrite,
        workers=workers,
        part=part,
        parts=parts,
        barrier=barrier,
        progress=progress,
        verify=verify,
        wait=wait,
    )
    weights = module_weights_note(source.ds_config, "a universal folder")
    notes = tuple(n for n in (weights, unsaved_moments_note(source.ds_config, source.state_names)) if n)
    return UniversalResult(
        output_dir,
        plan.tag,
        source,
        plan.target.stage,
        result.files,
        result.bytes_written,
        loss or None,
        notes,
    )

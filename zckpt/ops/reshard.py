"""``zckpt reshard``: rewrite a ZeRO checkpoint for another world size and/or ZeRO stage.

Read the whole training state, plan the target layout and every file (pure), then stream the
bytes. The output is a normal checkpoint folder that stock DeepSpeed loads with a plain
``engine.load_checkpoint(output_dir)`` at the new world size. Under torchrun (``WORLD_SIZE`` > 1)
the job's processes split the files between them on a shared filesystem.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable

from ..core.errors import OutputError, UsageError
from ..core.state import TrainingState
from ..core.untrusted import path_component, regular_file_inside
from ..deepspeed import names as N
from ..deepspeed.layout import rank_limit, rank_limit_reason
from ..deepspeed.megatron_rules import load_rules
from ..deepspeed.moe_writer import expert_group_indices, plan_moe_checkpoint
from ..deepspeed.pipeline_writer import plan_pipeline_checkpoint
from ..deepspeed.reader import open_training_state
from ..deepspeed.run_config import load_config
from ..deepspeed.save import SaveResult, write_checkpoint
from ..deepspeed.tensor_parallel_writer import (
    one_tensor_rank_state,
    plan_tensor_parallel_checkpoint,
    saved_vocabulary_rows,
    tensor_ranks_state,
    vocabulary_rules,
)
from ..deepspeed.writer import CheckpointPlan, Target, plan_checkpoint, plan_target
from ..deepspeed.zenflow import module_weights_note, unsaved_moments_note
from ..io.jobs import job_share
from ..io.output import is_inside, path_inside, refuse_output_inside_input, replace_atomically

# Hugging Face Trainer's per-process RNG files: rng_state.pth (one process) or rng_state_<i>.pth
_RNG_FILE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


@dataclass(frozen=True)
class ReshardResult:
    output_dir: str
    tag: str
    source: TrainingState
    target: Target
    files: tuple[str, ...]
    bytes_written: int
    carried: tuple[str, ...]  # files copied from beside the input's tag folders (HF Trainer's, ...)
    dropped: tuple[str, ...]  # carried files left out (RNG states of processes the target lacks)
    # what the new layout does not keep of the input (a ZenFlow run's 16-bit weights at ZeRO-3), and
    # what the input itself lacks (a ZenFlow overlap_step run's moments, which no file holds)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Layout:
    """The model-parallel layout asked of the output; None: the input's."""

    pipeline_stages: int | None = None
    expert_parallel: int | None = None
    layer_partition: tuple[int, ...] | None = None
    tensor_parallel: int | None = None
    padded_vocab_size: int | None = None  # at another tensor-parallel degree: a Megatron vocabulary's rows


def plan_reshard(
    checkpoint: str | os.PathLike[str],
    *,
    world_size: int,
    stage: int | None = None,
    tag: str | None = None,
    config: dict | str | os.PathLike[str] | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    pipeline_stages: int | None = None,
    tp_rules: str | os.PathLike[str] | None = None,
    expert_parallel: int | None = None,
    layer_partition: tuple[int, ...] | None = None,
    tensor_parallel: int | None = None,
    padded_vocab_size: int | None = None,
) -> CheckpointPlan:
    """Read the checkpoint's training state and plan every output file; writes nothing."""
    layout = Layout(pipeline_stages, expert_parallel, layer_partition, tensor_parallel, padded_vocab_size)
    state = _open_source(checkpoint, tag, swap_folder, tp_rules, layout, world_size)
    return _plan(state, _target(state, world_size, stage, config), layout)


def _open_source(
    checkpoint: str | os.PathLike[str],
    tag: str | None,
    swap_folder: str | os.PathLike[str] | None,
    tp_rules: str | os.PathLike[str] | None,
    layout: Layout,
    world_size: int,
) -> TrainingState:
    """The input's training state; where a Megatron vocabulary keeps its padding rows (asked, or
    at another tensor-parallel degree: the saved rows, or those asked), read again by rules that
    keep that many rows. A target of more ranks than the model allows is refused once the index
    is read, before anything is planned (:func:`refuse_too_many_ranks`)."""
    rows, tp = layout.padded_vocab_size, layout.tensor_parallel
    if tp is not None and tp < 1:
        raise UsageError(None, f"--tensor-parallel {tp}: at least 1")
    state = open_training_state(checkpoint, tag, swap_folder, tp_rules)
    refuse_too_many_ranks(state, world_size, layout)
    sharded = state.index.topology.tp > 1
    other_degree = sharded and tp not in (None, 1, state.index.topology.tp)
    if rows is None and not other_degree:
        return state
    if rows is not None and (tp is None or tp == state.index.topology.tp or not sharded):
        raise UsageError(
            None,
            f"--padded-vocab-size {rows}: for a tensor-parallel run written at another tensor-parallel degree "
            "(--tensor-parallel N)",
        )
    info = load_rules(tp_rules) if tp_rules is not None else state.engine_extras.get(N.UNIVERSAL_CHECKPOINT_INFO)
    if rows is None:
        saved = saved_vocabulary_rows(state, info)
        if saved is None:
            return state  # no vocabulary (or an AutoTP run, refused at another degree by the plan)
        name, rows = saved
        if rows % tp:
            raise UsageError(
                None,
                f"--tensor-parallel {tp}: {name} holds {rows} rows (its padded vocabulary), which do not split "
                f"evenly over {tp} tensor ranks; pass --padded-vocab-size V, the rows the new run pads it to",
            )
    elif tp > 1 and rows % tp:
        raise UsageError(None, f"--padded-vocab-size {rows}: does not split evenly over {tp} tensor ranks")
    return open_training_state(checkpoint, tag, swap_folder, vocabulary_rules(state, info, rows))


def refuse_too_many_ranks(state: TrainingState, world_size: int, layout: Layout) -> None:
    """Refuse (UsageError, one line naming the limit and the value) a target run of more ranks
    (data-parallel world size x pipeline stages x tensor ranks) than :func:`~zckpt.deepspeed.layout.rank_limit`
    allows the model; costs nothing per rank. Values below 1 or not integers are left to the checks
    that name them."""
    topology = state.index.topology
    stages = 1
    if state.stages:
        stages = (
            layout.pipeline_stages
            if layout.pipeline_stages is not None
            else len(layout.layer_partition) - 1
            if layout.layer_partition is not None
            else topology.pp
        )
    tensor = layout.tensor_parallel if layout.tensor_parallel is not None else topology.tp
    factors = {"--world-size": world_size, "pipeline stages": stages, "tensor ranks": tensor}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in factors.values()):
        return
    ranks = math.prod(factors.values())
    elements = sum(math.prod(p.shape) for p in state.params) + sum(
        e.source.numel for e in state.index.entries if e.kind == "frozen"
    )  # the params a run partitions (a ZeRO-3 run its frozen ones too)
    if ranks <= rank_limit(elements):
        return
    asked = f"--world-size {world_size}" + "".join(
        f" x {v} {k}" for k, v in factors.items() if k != "--world-size" and v > 1
    )
    raise UsageError(None, f"{asked}: a target run of {ranks:,} ranks; zckpt plans {rank_limit_reason(elements)}")


def _plan(state: TrainingState, target: Target, layout: Layout) -> CheckpointPlan:
    """A pipeline run's checkpoint stays one (at its stages, one, or the stages of a layer
    partition); a mixture-of-experts run's one (at its expert-parallel degree or another); a
    tensor-parallel run's one (at its tensor ranks; at one, the unsharded model; at another
    degree, a Megatron-style run's params cut again); any other is data-parallel."""
    experts = bool(expert_group_indices(state))
    expert_parallel, tensor_parallel = layout.expert_parallel, layout.tensor_parallel
    if expert_parallel is not None and (expert_parallel < 1 or not experts):
        raise UsageError(
            None,
            f"--expert-parallel {expert_parallel}: "
            + ("at least 1" if expert_parallel < 1 else "for mixture-of-experts checkpoints; this one has no experts"),
        )
    tp = state.index.topology.tp
    if tensor_parallel not in (None, 1, tp) and tp == 1:
        raise UsageError(
            None,
            f"--tensor-parallel {tensor_parallel}: zckpt writes tensor ranks of a tensor-parallel run only (this "
            "checkpoint has none: how each param would be cut is recorded by no rule)",
        )
    if state.stages:
        return plan_pipeline_checkpoint(
            state, target, layout.pipeline_stages, layout.layer_partition, tensor_parallel if tp > 1 else None
        )
    if layout.pipeline_stages is not None or layout.layer_partition is not None:
        option = "--pipeline-stages" if layout.pipeline_stages is not None else "--layer-partition"
        raise UsageError(None, f"{option} is for pipeline-parallel checkpoints; this one has no pipeline stages")
    if experts:
        return plan_moe_checkpoint(state, target, expert_parallel)
    if state.tensor_shards:
        if tensor_parallel == 1:
            return plan_checkpoint(one_tensor_rank_state(state, layout.padded_vocab_size), target)
        if tensor_parallel not in (None, tp):
            return plan_tensor_parallel_checkpoint(tensor_ranks_state(state, tensor_parallel), target)
        return plan_tensor_parallel_checkpoint(state, target)
    return plan_checkpoint(state, target)


def _target(
    state: TrainingState, world_size: int, stage: int | None, config: dict | str | os.PathLike[str] | None
) -> Target:
    """The target run: the input's config, `config` over it. A ZeRO-3 target that offloads its
    optimizer to NVMe gets its swapped sub-groups written to ``offloaded_tensors/rankRR/``."""
    if isinstance(config, dict) or config is None:
        return plan_target(state, world_size, stage, config)
    return plan_target(state, world_size, stage, load_config(config), os.fspath(config))


def carried_files(checkpoint_dir: str, world_size: int) -> tuple[dict[str, str], list[str]]:
    """Files beside the tag folders to copy along ({name: source}) and those left out.

    Every regular file at the top of the checkpoint folder except ``latest`` (rewritten),
    ``latest_universal`` and hidden files is carried:
    a Trainer's config, tokenizer, trainer_state.json, scheduler.pt, training_args.bin. RNG
    states are per process: those of processes the target run has are kept, the rest dropped,
    under the name the Trainer reads at that process count (``rng_state.pth`` for one process,
    ``rng_state_<i>.pth`` for several). A link leading out of the folder is refused (it is never
    followed into the output), as is a name that is not a plain file name.
    """
    carried, dropped = {}, []
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        skipped = (
            name in (N.LATEST_FILE, N.LATEST_UNIVERSAL_FILE) or name.startswith(".") or os.path.isdir(path)
        )  # tag folders, linked or not
        if skipped or not regular_file_inside(path, checkpoint_dir):
            continue
        path_component(name, checkpoint_dir, "file name")  # it names the copy in the output
        match = _RNG_FILE.match(name)
        if match:
            process = int(match[1] or 0)
            if process >= world_size:
                dropped.append(name)
            else:
                carried["rng_state.pth" if world_size == 1 else f"rng_state_{process}.pth"] = path
            continue
        carried[name] = path
    return carried, dropped


def reshard(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    world_size: int,
    stage: int | None = None,
    tag: str | None = None,
    config: dict | str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
    swap_folder: str | os.PathLike[str] | None = None,
    wait: bool = False,
    pipeline_stages: int | None = None,
    tp_rules: str | os.PathLike[str] | None = None,
    expert_parallel: int | None = None,
    layer_partition: tuple[int, ...] | None = None,
    tensor_parallel: int | None = None,
    padded_vocab_size: int | None = None,
) -> ReshardResult:
    """Rewrite `checkpoint` for `world_size` ranks (and ZeRO `stage`) into `output_dir`.

    `config`: the target run's DeepSpeed config (a dict or a JSON file) where its layout
    settings (``round_robin_gradients``, ``sub_group_size``, ...) differ from the checkpoint's.
    `swap_folder`: a live ZeRO-Infinity ``<nvme_path>`` of the same run; the masters and
    optimizer states of its swapped sub-groups replace the checkpoint's (see consolidate).
    `wait`: another zckpt run writing `output_dir` is waited for instead of refused.
    A pipeline-parallel checkpoint stays one: `world_size` data-parallel ranks per stage, at its
    own number of stages, at `pipeline_stages` = 1 (the layers all in one stage), or as the
    new run's PipelineModule cuts its layers into stages: `layer_partition`, its ``parts`` (each
    stage's first layer, then the layer count).
    `tp_rules`: a ``--tp-rules`` file, for a tensor-parallel run that records no merge rules.
    `expert_parallel`: a mixture-of-experts run's new expert-parallel degree (experts move between
    expert ranks; `world_size` a multiple of it).
    `tensor_parallel`: 1 writes a tensor-parallel run (AutoTP or Megatron-style) as the unsharded
    model's checkpoint over `world_size` data ranks; another degree cuts a Megatron-style run's
    params for that many tensor ranks by its merge rules (each over `world_size` data ranks; a
    pipeline x tensor run's at any degree, 1 included, its layer files too);
    `padded_vocab_size`: a Megatron vocabulary's rows there (default at one rank
    ``original_vocab_size``, at others the rows saved), for a run that pads it (no more than were saved).
    """
    output_dir = os.fspath(output_dir)
    layout = Layout(pipeline_stages, expert_parallel, layer_partition, tensor_parallel, padded_vocab_size)
    source = _open_source(checkpoint, tag, swap_folder, tp_rules, layout, world_size)
    plan = _plan(source, _target(source, world_size, stage, config), layout)
    index = source.index
    refuse_output_inside_input(output_dir, (index.checkpoint_dir, index.tag_dir))
    if is_inside(index.tag_dir, os.path.join(output_dir, plan.tag)):
        raise UsageError(output_dir, f"would replace the input {index.tag_dir}; choose another folder")
    carried, dropped = carried_files(index.checkpoint_dir, world_size)
    existing = [n for n in carried if os.path.exists(os.path.join(output_dir, n))]
    if existing and not overwrite:
        raise OutputError(os.path.join(output_dir, existing[0]), "already exists; pass --overwrite to replace it")
    part, parts, barrier = job_share(output_dir)

    def copy_carried() -> None:
        for name, path in carried.items():
            replace_atomically(path_inside(output_dir, name), lambda temp, source=path: shutil.copyfile(source, temp))

    result: SaveResult = write_checkpoint(
        plan,
        output_dir,
        overwrite=overwrite,
        workers=workers,
        part=part,
        parts=parts,
        barrier=barrier,
        progress=progress,
        verify=verify,
        before_latest=copy_carried,
        wait=wait,
    )
    # what the output cannot hold of a ZenFlow run: 16-bit weights at ZeRO-3; overlap_step's unsaved moments
    weights = module_weights_note(source.ds_config, "a ZeRO-3 checkpoint") if plan.target.stage == 3 else None
    notes = tuple(n for n in (weights, unsaved_moments_note(source.ds_config, source.state_names)) if n)
    return ReshardResult(
        output_dir,
        plan.tag,
        source,
        plan.target,
        result.files,
        result.bytes_written,
        tuple(carried),
        tuple(dropped),
        notes,
    )

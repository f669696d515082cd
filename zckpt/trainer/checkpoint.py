"""Save and resume the trainer's state as DeepSpeed ZeRO-3 checkpoints, through the shared writer.

Saving describes the live state as a :class:`~zckpt.core.state.TrainingState` whose tensors are byte
ranges of the trainer's memory files (:mod:`.arena`): the writer that reshards checkpoints then
plans and streams the files, each rank writing its own rank's files, and rank 0 moves ``latest``
only after every rank has written and synced (``write_checkpoint``'s barrier). A rank's sources
name the other ranks' pieces too (the planner needs whole params) but never reads them.

Resuming reads any checkpoint zckpt reads (its own, DeepSpeed's, a universal or a resharded one)
as whole params and takes this rank's share of each, so the world size may change.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..core.dtypes import FP32, from_torch
from ..core.errors import LayoutError
from ..core.index import CheckpointIndex, Entry, Segment, TensorSource
from ..core.state import ParamGroupState, ParamState, ScalarState, TrainingState
from ..deepspeed import engine_config as E
from ..deepspeed.reader import open_training_state
from ..deepspeed.save import write_checkpoint
from ..deepspeed.writer import plan_checkpoint, plan_target
from ..io.jobs import JobSync
from ..io.materialize import read_tensor
from ..io.output import write_text_atomic
from ..io.reading import FileReader, read_range
from ..torchfile.pickler import Inline, OutTensor
from .model import MODEL_CONFIG_FILE, GPTConfig
from .optim import ADAM_STATES, ShardedAdamW
from .zero3 import Comm, ShardedModel, Zero3Plan

STEP = "step"


class CheckpointedTrainer(Protocol):
    """What saving reads from the trainer and resuming sets on it (:class:`~.loop.Trainer` is
    one): this module gets the trainer's parts handed in and never imports the loop that calls it."""

    plan: Zero3Plan
    optimizer: ShardedAdamW
    comm: Comm
    dtype: torch.dtype
    model: ShardedModel
    model_config: GPTConfig
    global_steps: int
    global_samples: int
    skipped_steps: int
    last_batch_iteration: int

    @property
    def global_batch(self) -> int: ...

    def ds_config(self) -> dict: ...

    def lr(self) -> float: ...


def tag_for(global_steps: int) -> str:
    return f"global_step{global_steps}"


def _whole_param(path: str, byte_offset: int, numel: int, share: int, rank: int, world: int) -> tuple[Segment, ...]:
    """Segments of a whole param whose rank-`rank` share lies at `byte_offset` of `path`; the
    other ranks' shares are named after their owner and never read on this rank."""
    segments = []
    for owner in range(world):
        length = max(0, min(share, numel - owner * share))
        if length:
            segments.append(
                Segment(path, byte_offset, length) if owner == rank else Segment(f"<rank {owner}'s memory>", 0, length)
            )
    return tuple(segments)


def training_state(trainer: CheckpointedTrainer, checkpoint_dir: str, tag: str) -> TrainingState:
    """The trainer's live state in zckpt's own types (no byte copied)."""
    plan, optimizer, rank, world = trainer.plan, trainer.optimizer, trainer.comm.rank, trainer.comm.world
    dtype = from_torch(trainer.dtype)
    arena = optimizer.arena
    entries: list[Entry] = []
    params: dict[str, ParamState] = {}
    for index, spec in enumerate(plan.params):
        if spec.trainable:
            slot = optimizer.slots[index]

            def source(kind: int) -> TensorSource:
                if optimizer.swapper is not None and slot.flat in optimizer.swapped:  # in the live swap file
                    path, offset = optimizer.swapper.paths[slot.flat][kind], slot.offset * 4
                else:
                    path, offset = arena.path, arena.byte_offset(3 * slot.flat + kind) + slot.offset * 4
                return TensorSource(FP32, spec.shape, _whole_param(path, offset, spec.numel, spec.share, rank, world))

            master = source(0)
            params[spec.name] = ParamState(
                spec.name,
                spec.shape,
                plan.group_names.index(spec.group),
                master,
                {k: source(1 + i) for i, k in enumerate(ADAM_STATES)},
            )
            entries.append(Entry(spec.name, "param", master))
        else:
            path, offset = trainer.model.store.location(index)
            segments = _whole_param(path, offset, spec.numel, spec.share, rank, world)
            entries.append(Entry(spec.name, "frozen", TensorSource(dtype, spec.shape, segments)))
    sources = {e.name: e.source for e in entries}
    entries += [Entry(alias, "tied", sources[origin], alias_of=origin) for alias, origin in plan.tied.items()]
    index = CheckpointIndex(
        checkpoint_dir=checkpoint_dir,
        tag=tag,
        tag_dir=os.path.join(checkpoint_dir, tag),
        tags=(tag,),
        zero_stage=3,
        world_size=world,
        dtype=dtype,
        ds_version=E.FORMAT_VERSION,
        offload="nvme" if optimizer.swapper is not None else "none",
        entries=tuple(entries),
    )
    groups = []
    for g, _ in enumerate(plan.group_names):
        flats = [f for f, group in enumerate(plan.layout.flat_groups) if group.param_group == g]
        step = OutTensor(FP32, (), (Inline(np.float32(float(optimizer.steps[flats[0]])).tobytes()),))
        names = tuple(plan.layout.params[i].name for f in flats for i in plan.layout.flat_groups[f].params)
        groups.append(
            ParamGroupState(
                dict(optimizer.hyperparams[g]), {STEP: ScalarState(value=step)}, names, (STEP, *ADAM_STATES)
            )
        )
    scaler = optimizer.loss_scale
    return TrainingState(
        index=index,
        params=tuple(params[p.name] for p in plan.layout.params),
        groups=tuple(groups),
        module_names=plan.module_names,
        module_dtype_names={name: dtype.short for name in plan.module_names},
        loss_scaler=E.dynamic_loss_scaler(vars(scaler)) if scaler is not None else None,
        lr_scheduler=E.scheduler_state(trainer.last_batch_iteration),
        global_steps=trainer.global_steps,
        global_samples=trainer.global_samples,
        skipped_steps=trainer.skipped_steps,
        ds_config=trainer.ds_config(),
        optimizer_extras=E.optimizer_extras(scaler is not None),
    )


def save_checkpoint(trainer: CheckpointedTrainer, checkpoint_dir: str) -> str:
    """Write ``checkpoint_dir/global_stepN/`` (every rank its own files), then ``latest`` and
    ``model_config.json``; returns the tag. Collective: every rank calls it."""
    tag = tag_for(trainer.global_steps)
    state = training_state(trainer, checkpoint_dir, tag)
    plan = plan_checkpoint(state, plan_target(state, trainer.comm.world, stage=3), tag)
    config_text = trainer.model_config.to_json()
    comm = trainer.comm

    def max_of(value: int) -> int:
        return int(comm.all_reduce(torch.tensor([float(value)]), dist.ReduceOp.MAX).item())

    # a rank that cannot write its files (disk full) makes the others stop too, instead of leaving
    # them waiting or committing a checkpoint without its files; every rank returns once `latest`
    # names the new checkpoint (or knows that it could not)
    write_checkpoint(
        plan,
        checkpoint_dir,
        overwrite=True,
        part=comm.rank,
        parts=comm.world,
        barrier=JobSync(max_of if comm.world > 1 else None, checkpoint_dir),
        before_latest=lambda: write_text_atomic(os.path.join(checkpoint_dir, MODEL_CONFIG_FILE), config_text),
        verify=False,  # the sources are memory, not archives with checksums
        by_rank=True,
    )
    return tag


def load_checkpoint(trainer: CheckpointedTrainer, path: str) -> None:
    """Take this rank's share of every param's master and Adam moments, the step counters, the
    lr scheduler and the loss scaler from any checkpoint zckpt reads."""
    state = open_training_state(path)
    plan, optimizer, rank = trainer.plan, trainer.optimizer, trainer.comm.rank
    saved = {p.name: p for p in state.params}
    entries = {e.name: e for e in state.index.entries}
    with FileReader() as reader:
        for index, spec in enumerate(plan.params):
            start = min(spec.numel, rank * spec.share)
            length = max(0, min(spec.share, spec.numel - start))
            if spec.trainable:
                param = saved.get(spec.name)
                if param is None or tuple(param.shape) != spec.shape:
                    found = "absent" if param is None else f"of shape {list(param.shape)}"
                    raise LayoutError(
                        path,
                        f"trainable param {spec.name} of shape {list(spec.shape)} is {found} in the checkpoint (another model?)",
                    )
                targets = [(param.master, "master")] + [(param.states.get(k), k) for k in ADAM_STATES]
                for source, key in targets:
                    if source is None:
                        raise LayoutError(
                            path, f"param {spec.name} has no Adam moments (exp_avg, exp_avg_sq) in the checkpoint"
                        )
                    if source.dtype != FP32:
                        raise LayoutError(
                            path, f"param {spec.name}: optimizer state stored as {source.dtype}, fp32 expected"
                        )
                    share = torch.zeros(spec.share)
                    read_range(reader, source, start, share[:length].numpy())
                    optimizer.write_share(index, key, share)  # into memory, or the live swap file
            else:
                entry = entries.get(spec.name)
                if entry is None or tuple(entry.source.shape) != spec.shape:
                    raise LayoutError(
                        path,
                        f"frozen param {spec.name} of shape {list(spec.shape)} is absent or mis-shaped in the checkpoint",
                    )
                whole = read_tensor(reader, entry.source, from_torch(trainer.dtype)).reshape(-1)
                shard = torch.zeros(spec.share, dtype=trainer.dtype)
                shard[:length] = whole[start : start + length]
                trainer.model.store.write(index, shard)
        for g, group in enumerate(state.groups[: len(plan.group_names)]):
            step = group.scalars.get(STEP)
            value = (
                float(read_tensor(reader, step.tensor))
                if step is not None and step.tensor is not None
                else float(step.value if step else 0)
            )
            for f, flat in enumerate(plan.layout.flat_groups):
                if flat.param_group == g:
                    optimizer.steps[f].fill_(value)
    optimizer.copy_to_shards(trainer.model.store)
    trainer.global_steps = int(state.global_steps or 0)
    # the samples seen so far, so the data continues where it stopped even when the global batch changed
    trainer.global_samples = (
        int(state.global_samples) if state.global_samples is not None else trainer.global_steps * trainer.global_batch
    )
    trainer.skipped_steps = int(state.skipped_steps or 0)
    iteration = E.scheduler_iteration(state.lr_scheduler)
    trainer.last_batch_iteration = (
        iteration if iteration is not None else trainer.global_steps - trainer.skipped_steps - 1
    )
    for group in optimizer.hyperparams:
        group["lr"] = trainer.lr()
    scaler = optimizer.loss_scale
    if scaler is not None and state.loss_scaler is not None:
        values = vars(state.loss_scaler)  # DeepSpeed's DynamicLossScaler, read as plain data
        for key in vars(scaler):
            if key in values and key != "dtype":
                setattr(scaler, key, values[key])

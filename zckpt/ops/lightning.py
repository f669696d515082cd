"""Lightning out: the single checkpoint file PyTorch Lightning's converter writes, streamed.

``pytorch_lightning.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` turns the
folder ``DeepSpeedStrategy`` saved into one ``torch.save`` file: rank 0's model-states dict less
DeepSpeed's own keys (:data:`DEEPSPEED_KEYS`, its list), which leaves Lightning's state (epoch,
global_step, loops, callbacks, lr_schedulers, hyper_parameters, version) and DeepSpeed's shape
records, plus ``state_dict``: zero_to_fp32's state dict (fp32 masters, frozen params and buffers
in their saved dtype, the tied alias one storage with its source), names less the
``_forward_module.`` that Lightning < 2.1 put before them (:func:`without_legacy_prefix`, which
``consolidate`` applies to every format). ``LightningModule.load_from_checkpoint``
reads it without DeepSpeed.

zckpt writes the same object without DeepSpeed, without loading the model and without running
code from the input's pickle: the client state is carried as read (:func:`~zckpt.deepspeed.writer.carry`),
each tensor streamed from its source, the archive laid out as ``torch.save`` lays it out.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ..core.dtypes import FP32, DType
from ..core.index import CheckpointIndex
from ..core.state import TrainingState
from ..deepspeed import names as N
from ..deepspeed.writer import carry
from ..io.output import StagedOutput
from ..io.reading import FileReader
from ..torchfile.pickler import Copy, OutTensor
from ..torchfile.reader import load
from ..torchfile.save import archive_name_for, plan_archive, write_archive
from ..torchfile.torch_id import torch_serialization_id
from .dcp import out_tensor, plan_dcp
from .weights_folder import ConsolidationResult, Progress, byte_counter, write_staged

LIGHTNING = "lightning"  # the --format value
LIGHTNING_FILE = "lightning_model.pt"  # the name Lightning's converter docs use
# the keys Lightning's converter drops from the model states (its own list, verbatim)
DEEPSPEED_KEYS = (
    "module",
    "optimizer",
    "lr_scheduler",
    "csr_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
)
STATE_DICT_KEY = "state_dict"
OPTIMIZER_STATES_KEY = "optimizer_states"  # Lightning's key; its DeepSpeedStrategy saves none
LEGACY_PREFIX = "_forward_module."  # Lightning < 2.1's _LightningModuleWrapperBase attribute


LEGACY_NOTE = (
    f"names less the '{LEGACY_PREFIX}' that Lightning < 2.1 saved before them, as the LightningModule has them"
)


def without_legacy_prefix(index: CheckpointIndex) -> CheckpointIndex | None:
    """The index under the LightningModule's own names, where every name starts with Lightning
    < 2.1's ``_forward_module.`` (its ``_LightningModuleWrapperBase`` was the module DeepSpeed
    saved; Lightning's converter strips the prefix the same way); None for any other checkpoint."""
    if not index.entries or not all(e.name.startswith(LEGACY_PREFIX) for e in index.entries):
        return None

    def strip(name: str | None) -> str | None:
        return name[len(LEGACY_PREFIX) :] if name is not None and name.startswith(LEGACY_PREFIX) else name

    entries = tuple(replace(e, name=strip(e.name), alias_of=strip(e.alias_of)) for e in index.entries)
    replicas = tuple(replace(e, name=strip(e.name), alias_of=strip(e.alias_of)) for e in index.replicas)
    return replace(index, entries=entries, replicas=replicas, notes=(*index.notes, LEGACY_NOTE))


def lightning_state_dict(
    index: CheckpointIndex, dtype: DType | None = None, exclude_frozen: bool = False
) -> dict[str, OutTensor]:
    """zero_to_fp32's state dict, planned: its order, trainable params as fp32 masters (or
    `dtype`), frozen params and buffers as saved (or `dtype`, if floating), an alias the same
    object as its source (torch.save then writes one storage). Pure: reads no bytes."""
    out: dict[str, OutTensor] = {}
    for entry in index.entries:
        if exclude_frozen and entry.kind == "frozen":
            continue
        name = entry.name
        if entry.alias_of is not None:
            if entry.alias_of in out:
                out[name] = out[entry.alias_of]
            continue
        target = entry.source.dtype
        if entry.source.dtype.is_floating and dtype is not None:
            target = dtype
        parts = tuple(Copy(s, entry.source.dtype) for s in entry.source.segments)
        # zero_to_fp32 cuts the masters out of the optimizer's fp32 groups, which require grad
        out[name] = OutTensor(target, tuple(entry.source.shape), parts, requires_grad=entry.kind == "param")
    return out


def optimizer_states(state: TrainingState) -> list[dict[str, Any]]:
    """Lightning's ``optimizer_states``: the one optimizer's ``torch.optim`` state dict, params
    numbered across the groups in order, each with its group's ``step`` (a float32 0-d tensor,
    as torch's AdamW keeps it) and every per-element state (fp32 ``exp_avg``, ``exp_avg_sq``);
    the groups' hyperparameters as saved. The DCP export's plan, numbered instead of named."""
    plan = plan_dcp(state)
    number = {name: i for i, name in enumerate(n for group in plan.param_groups for n in group["params"])}
    per_param: dict[int, dict[str, OutTensor]] = {}
    for item in plan.tensors:
        if item.path[0] == "optim":
            per_param.setdefault(number[item.path[2]], {})[item.path[3]] = out_tensor(item)
    groups = [{**group, "params": [number[n] for n in group["params"]]} for group in plan.param_groups]
    return [{"state": per_param, "param_groups": groups}]


def lightning_checkpoint(
    index: CheckpointIndex,
    dtype: DType | None = None,
    exclude_frozen: bool = False,
    state: TrainingState | None = None,
) -> dict:
    """The object Lightning's converter saves: rank 0's model states less DeepSpeed's keys, then
    ``state_dict``; with the training `state`, then ``optimizer_states`` too (what a Lightning
    Trainer without DeepSpeed restores the optimizer from)."""
    model_file = os.path.join(index.tag_dir, N.model_states_name(index.zero_stage))
    saved = load(model_file)
    out = {key: carry(value) for key, value in saved.items() if key not in DEEPSPEED_KEYS}
    out[STATE_DICT_KEY] = lightning_state_dict(index, dtype, exclude_frozen)
    if state is not None:
        out[OPTIMIZER_STATES_KEY] = optimizer_states(state)
    return out


def consolidate_lightning(
    index: CheckpointIndex,
    output_dir: str,
    *,
    dtype: DType | None = None,
    exclude_frozen: bool = False,
    state: TrainingState | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    verify: bool = True,
    wait: bool = False,
) -> ConsolidationResult:
    """Write ``output_dir/lightning_model.pt``, the file Lightning's converter writes for this
    checkpoint (same keys, dtypes, tied alias and values), staged and moved into place whole.
    With the training `state`, ``optimizer_states`` is added (see :func:`optimizer_states`)."""
    checkpoint = lightning_checkpoint(index, dtype, exclude_frozen, state)
    plan = plan_archive(checkpoint, archive_name_for(LIGHTNING_FILE))
    total = plan.tensor_bytes
    advance = byte_counter(progress, total)
    with (
        StagedOutput(
            output_dir,
            [LIGHTNING_FILE],
            overwrite=overwrite,
            needed_bytes=plan.total_size,
            wait=wait,
            weights_folder=False,
        ) as staged,
        FileReader(verify=verify) as reader,
    ):
        plan = replace(plan, serialization_id=torch_serialization_id(dict(plan.storages), reader))
        write_staged(staged, output_dir, LIGHTNING_FILE, lambda path: write_archive(path, plan, reader, advance))
        reader.verify_now()
        staged.commit()
    tensors = len(checkpoint[STATE_DICT_KEY])
    return ConsolidationResult(output_dir, (LIGHTNING_FILE,), tensors, total, index, dtype or FP32)

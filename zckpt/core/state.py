"""The whole training state of a checkpoint in zckpt's own types: what a resume needs.

Built by the format layer beside the :class:`~zckpt.core.index.CheckpointIndex` (the weights): every
trainable param's fp32 master and optimizer state tensors as lazy file segments, the param
groups with their hyperparameters and per-group scalars (``step``), and the engine's counters,
loss scaler, lr scheduler, config and client state as plain objects. Writers lay these out again
for any world size or ZeRO stage; nothing here knows DeepSpeed's key names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .index import CheckpointIndex, Entry, TensorSource


@dataclass(frozen=True)
class ParamState:
    """One trainable param: its fp32 master and every per-element optimizer state, full shape."""

    name: str
    shape: tuple[int, ...]
    group: int  # index of its param group
    master: TensorSource
    states: dict[str, TensorSource]  # e.g. exp_avg, exp_avg_sq (Adam), momentum_buffer (SGD)


@dataclass(frozen=True)
class ScalarState:
    """A per-group optimizer value that is not per element (``step``): a small tensor in a file,
    or a plain Python value."""

    tensor: TensorSource | None = None
    value: Any = None


@dataclass(frozen=True)
class ParamGroupState:
    """One optimizer param group: its hyperparameters (lr, betas, ...; as saved, so after the lr
    scheduler), its scalar states, and the names of its params in optimizer order."""

    hyperparams: dict[str, Any]
    scalars: dict[str, ScalarState]
    params: tuple[str, ...]
    state_keys: tuple[str, ...]  # the keys of each flat group's optimizer state, in saved order


@dataclass(frozen=True)
class PipelineStage:
    """What one pipeline stage of the run held: its trainable params in its optimizer's order,
    its buffers, and the layer files it saved (carried to a pipeline output as they are); with
    tensor ranks, each tensor rank's own state of the stage's shards (which a writer lays out again)."""

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    layer_files: tuple[str, ...]
    tensor_shards: tuple["TrainingState", ...] = field(default=(), compare=False)
    # each layer file's (global layer number, its (own name, the model's name) pairs in the file's order)
    layer_names: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()
    # the stage's own copies of params it keeps out of step with the model's (a tied module's param
    # the stage never trains): a writer at the same stages writes them back as they were
    own_params: tuple[ParamState, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TrainingState:
    """Everything a checkpoint holds for resuming training, laid out by param, not by rank."""

    index: CheckpointIndex  # weights: buffers, frozen params, fp32 masters, tied aliases
    params: tuple[ParamState, ...]  # trainable params, by group, in optimizer order
    groups: tuple[ParamGroupState, ...]
    module_names: tuple[str, ...]  # the model's state_dict keys, in order (params, buffers, aliases)
    module_dtype_names: dict[str, str]  # dtype (short name) of each module tensor as saved
    loss_scaler: Any = None  # DeepSpeed's loss scaler object (read as plain data), or None
    lr_scheduler: Any = None
    global_steps: int | None = None
    global_samples: int | None = None
    skipped_steps: int | None = None
    ds_config: dict[str, Any] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)  # what the script passed to save_checkpoint
    engine_extras: dict[str, Any] = field(default_factory=dict)  # other engine keys, carried as saved
    optimizer_extras: dict[str, Any] = field(default_factory=dict)  # other optimizer keys (overflow, clip_grad)
    # ZeRO-3 saves every rank's own module buffers (BatchNorm statistics differ per rank): rank r's
    rank_buffers: tuple[dict[str, TensorSource], ...] = ()
    optimizer_kind: str = "zero"  # "zero" or "bf16_optimizer" (DeepSpeed's BF16_Optimizer file layout)
    # whether the model states record the frozen params (a frozen_param_shapes dict): not in ZeRO-0/1
    # runs, nor in runs saved with exclude_frozen_parameters, whose loads keep the model's own
    frozen_recorded: bool = True
    round_robin: bool = False  # the input's flat groups were in round-robin order
    # further copies of a param's state that other ranks keep whole (DeepSpeed's Muon keeps the full
    # momentum of a param on every ZeRO-1/2 rank its partition touches): (param, state, source),
    # each of which must equal ``param(name).states[state]``; outputs write it once
    state_copies: tuple[tuple[str, str, TensorSource], ...] = field(default=(), compare=False)
    stages: tuple[PipelineStage, ...] = ()  # a pipeline-parallel run's stages (empty: data-parallel)
    # a tensor-parallel run: each tensor rank's own state (its shards), which a writer lays out again
    tensor_shards: tuple["TrainingState", ...] = field(default=(), compare=False)
    # the Megatron-style merge rules its tensor ranks were merged by (the checkpoint's or --tp-rules)
    tensor_merge_rules: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def state_names(self) -> list[str]:
        """Names of the per-element optimizer states, in first-seen order."""
        seen: dict[str, None] = {}
        for param in self.params:
            seen.update(dict.fromkeys(param.states))
        return list(seen)

    def param(self, name: str) -> ParamState:
        for param in self.params:
            if param.name == name:
                return param
        raise KeyError(name)

    def entries(self, kind: str) -> list[Entry]:
        return [e for e in self.index.entries if e.kind == kind]

"""The DeepSpeed config and engine objects a run trained by ``zckpt train`` records, so that
DeepSpeed sees a checkpoint of a run it could have made itself (and an engine built from the
same config loads it). Only names and values: no file is written here.
"""

from __future__ import annotations

from typing import Any

from ..dtypes import FP16
from ..torchpickle import GlobalName, PickledInstance
from . import names as N
from .swap_rules import MAX_IN_CPU_DEFAULT, OPTIMIZER_BUFFER_COUNT_DEFAULT, offload_optimizer_section, offload_param_section

FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose checkpoint format the trainer writes
DYNAMIC_LOSS_SCALER = GlobalName("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
# DynamicLossScaler's attributes in the order its __init__ sets them (FORMAT_OBSERVED.md)
_SCALER_FIELDS = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                  "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale")


def engine_config(
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    dtype: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    clip: float,
    sub_group_size: int,
    scheduler: dict[str, Any],
    nvme_path: str | None = None,
    param_buffers: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A ZeRO-3 ds_config describing the run (torch's AdamW, DeepSpeed's lr scheduler); with
    `nvme_path`, the optimizer state offloaded there (DeepSpeed's aio defaults: what decides
    which sub-groups are swapped and how their files are padded); with `param_buffers` (buffer
    size and count) the params too (``offload_param``)."""
    zero: dict[str, Any] = {N.CONFIG_STAGE: 3, N.CONFIG_SUB_GROUP_SIZE: sub_group_size}
    offload: dict[str, Any] = {}
    if nvme_path is not None:
        zero[N.CONFIG_OFFLOAD_OPTIMIZER] = offload_optimizer_section(OPTIMIZER_BUFFER_COUNT_DEFAULT, nvme_path)
        offload[FORCE_DS_CPU_OPTIMIZER] = False  # DeepSpeed refuses torch's AdamW with an offloaded optimizer otherwise
        if param_buffers is not None:
            zero[N.CONFIG_OFFLOAD_PARAM] = offload_param_section(*param_buffers, MAX_IN_CPU_DEFAULT, nvme_path)
    return {
        **offload,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        N.CONFIG_GRADIENT_CLIPPING: clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay, "torch_adam": True}},
        "scheduler": scheduler,
        N.CONFIG_ZERO: zero,
        N.CONFIG_BF16[0]: {"enabled": dtype == "bf16"},
        N.CONFIG_FP16: {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    }


def dynamic_loss_scaler(values: dict[str, Any]) -> PickledInstance:
    """DeepSpeed's DynamicLossScaler object (fp16) holding `values` (its attribute names)."""
    return PickledInstance(DYNAMIC_LOSS_SCALER, {**{k: values[k] for k in _SCALER_FIELDS}, "dtype": FP16})


def optimizer_extras(fp16: bool) -> dict[str, Any]:
    """The ZeRO-3 optimizer's scalar keys besides the loss scaler."""
    return {N.DYNAMIC_LOSS_SCALE: fp16, N.OVERFLOW: False}


def scheduler_state(last_batch_iteration: int) -> dict[str, Any]:
    """WarmupLR/WarmupDecayLR.state_dict()."""
    return {"last_batch_iteration": last_batch_iteration}


def scheduler_iteration(saved: Any) -> int | None:
    """The iteration a saved DeepSpeed lr scheduler state holds (None if it holds none)."""
    value = saved.get("last_batch_iteration") if isinstance(saved, dict) else None
    return int(value) if isinstance(value, (int, float)) else None

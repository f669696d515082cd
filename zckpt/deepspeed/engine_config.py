"""The DeepSpeed config and engine objects a run trained by ``zckpt train`` records, so that
DeepSpeed sees a checkpoint of a run it could have made itself (and an engine built from the
same config loads it). Only names and values: no file is written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.dtypes import FP16
from ..torchfile.pickler import GlobalName, PickledInstance
from . import names as N
from .run_config import read_run_config
from .swap_rules import (
    MAX_IN_CPU_DEFAULT,
    OPTIMIZER_BUFFER_COUNT_DEFAULT,
    offload_optimizer_section,
    offload_param_section,
)

FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose checkpoint format the trainer writes
DYNAMIC_LOSS_SCALER = GlobalName("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
LOSS_SCALER = GlobalName("deepspeed.runtime.fp16.loss_scaler", "LossScaler")  # a static scale
# DynamicLossScaler's attributes in the order its __init__ sets them (FORMAT_OBSERVED.md)
_SCALER_FIELDS = (
    "cur_scale",
    "dynamic",
    "cur_iter",
    "last_overflow_iter",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "cur_hysteresis",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
)


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
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay, "torch_adam": True},
        },
        "scheduler": scheduler,
        N.CONFIG_ZERO: zero,
        N.CONFIG_BF16[0]: {"enabled": dtype == "bf16"},
        N.CONFIG_FP16: {
            "enabled": dtype == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
    }


@dataclass(frozen=True)
class RecordedRun:
    """What a saved ds_config says about the run, in :func:`engine_config`'s terms (None: the
    config does not say, or says it in a form the trainer does not run)."""

    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    lr: float | None = None
    warmup: int | None = None  # 0: a constant lr (WarmupDecayLR with min lr = max lr, or no scheduler)
    total_steps: int | None = None  # where WarmupDecayLR's decay ends
    clip: float | None = None
    sub_group_size: int | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    other_scheduler: str | None = None  # a schedule the trainer does not run, described


def recorded_run(config: Any, world_size: int, ds_version: str | None, where: str | None = None) -> RecordedRun:
    """The inverse of :func:`engine_config`, for any run's ds_config (DeepSpeed's own too): its
    batch (DeepSpeed's rule: two of micro batch, accumulation and global batch give the third),
    AdamW's settings, clipping (DeepSpeed's default where unset), the sub-group size and the lr
    schedule when it is one the trainer runs (WarmupDecayLR warming up linearly from 0, or a
    constant lr). Clipping and the sub-group size are read by :func:`read_run_config` (a value
    DeepSpeed refuses: CorruptFileError naming `where`)."""
    config = config if isinstance(config, dict) else {}
    run = read_run_config(config, where, saved=True)
    micro, accum, batch = (
        _count(config.get(k))
        for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    if batch is None and micro is not None:
        batch = micro * (accum or 1) * world_size
    elif batch is not None and micro is None:
        micro = batch // ((accum or 1) * world_size) if batch % ((accum or 1) * world_size) == 0 else None
    elif batch is not None and accum is None:
        accum = batch // (micro * world_size) if batch % (micro * world_size) == 0 else None
    if micro is None or batch is None:
        micro = accum = batch = None
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    betas = params.get("betas")
    betas = (
        (float(betas[0]), float(betas[1]))
        if isinstance(betas, (list, tuple)) and len(betas) == 2 and all(map(_is_number, betas))
        else None
    )
    clip = (
        run.gradient_clipping
        if run.gradient_clipping is not None
        else N.default_gradient_clipping(N.version_tuple(ds_version or "0.0"))
    )
    lr, warmup, total, other = _schedule(config.get("scheduler"), _number(params.get("lr")))
    return RecordedRun(
        micro_batch=micro,
        grad_accum=accum or (1 if micro else None),
        global_batch=batch,
        lr=lr,
        warmup=warmup,
        total_steps=total,
        clip=clip,
        sub_group_size=run.sub_group_size,
        betas=betas,
        eps=_number(params.get("eps")),
        weight_decay=_number(params.get("weight_decay")),
        other_scheduler=other,
    )


def _schedule(scheduler: Any, optimizer_lr: float | None) -> tuple[float | None, int | None, int | None, str | None]:
    """(lr, warmup, total steps, what else it is) of a ds_config's scheduler section."""
    if scheduler is None:  # DeepSpeed keeps the optimizer's lr
        return optimizer_lr, 0, None, None
    kind = scheduler.get("type") if isinstance(scheduler, dict) else None
    params = (
        scheduler.get("params") if isinstance(scheduler, dict) and isinstance(scheduler.get("params"), dict) else {}
    )
    if kind != "WarmupDecayLR":
        return None, None, None, f"{kind or 'an unnamed'} scheduler"
    # WarmupDecayLR's defaults where the config leaves a value out
    low, high = _number(params.get("warmup_min_lr", 0.0)), _number(params.get("warmup_max_lr", 0.001))
    steps, total, shape = (
        _count(params.get("warmup_num_steps", 1000)),
        _count(params.get("total_num_steps")),
        params.get("warmup_type", "log"),
    )
    if high is None or high <= 0 or steps is None or total is None or shape != "linear" or low not in (0.0, high):
        return None, None, None, f"WarmupDecayLR with {shape} warmup from {low} to {high} over {steps} of {total} steps"
    return high, (0 if low == high else steps), total, None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    return float(value) if _is_number(value) else None


def _count(value: Any) -> int | None:
    """A positive whole number as the config holds it (``"auto"`` and the like: None)."""
    return int(value) if _is_number(value) and value == int(value) and value >= 1 else None


def dynamic_loss_scaler(values: dict[str, Any]) -> PickledInstance:
    """DeepSpeed's DynamicLossScaler object (fp16) holding `values` (its attribute names)."""
    return PickledInstance(DYNAMIC_LOSS_SCALER, {**{k: values[k] for k in _SCALER_FIELDS}, "dtype": FP16})


def static_loss_scaler(scale: Any = 1.0) -> PickledInstance:
    """DeepSpeed's LossScaler object: a static scale (1 for bf16 and fp32 runs)."""
    return PickledInstance(LOSS_SCALER, {"cur_scale": scale, "dynamic": False})


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

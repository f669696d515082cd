"""DeepSpeed 0.19.8 features that change what a run saves and that zckpt does not read, or reads
with a caveat, told from what the files hold (the saved ds_config, the pickles' layout, the file
names): each refused in one line naming the feature, or noted. Paths below are under
``deepspeed/``; the table is in sample_ckpts/FORMAT_OBSERVED.md, "Features DeepSpeed runs only
on GPU, from its source".
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..core.errors import LayoutError
from ..core.index import TensorRef
from . import names as N

# FastPersist's writer at ZeRO-0/1/2 saves every rank file as "<name>-<writer rank>.<writers>"
# (runtime/model_checkpointing/writer_factory.py:130-133; optimize_dp_state, engine.py:1901)
FAST_WRITER_NAME = re.compile(r"^(?P<name>.+_states\.pt)-(?P<rank>\d+)\.(?P<writers>\d+)$")


def fast_writer_refusal(tag_dir: str) -> LayoutError | None:
    """A tag folder whose rank files carry FastPersist's writer suffix: refused, naming the
    feature, instead of "no model states file"."""
    try:
        names = sorted(os.listdir(tag_dir))
    except OSError:
        return None
    suffixed = [n for n in names if FAST_WRITER_NAME.match(n)]
    if not suffixed:
        return None
    return LayoutError(
        tag_dir,
        f"rank files named as DeepSpeed's FastPersist writer names them at ZeRO-0/1/2 ({suffixed[0]}"
        f"{' ...' if len(suffixed) > 1 else ''}: checkpoint.writer, '<file>-<writer rank>.<writers>'), which zckpt "
        "does not read (DeepSpeed's own load looks for the plain names; a single writer's file renamed to "
        f"{FAST_WRITER_NAME.match(suffixed[0])['name']} is an ordinary rank file)",  # type: ignore[index]
    )


def _section(config: Any, *keys: str) -> Any:
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _on(value: Any) -> bool:
    return value is True or value in (1, "true", "True")


def feature_refusal(
    model0: dict, inner: dict[int, dict], zero3: bool, model_path: str, optim_path: str
) -> LayoutError | None:
    """The one refusal of a data-parallel set of rank files saved by a feature zckpt does not read;
    None when there is none. `model0`: rank 0's model states; `inner`: each rank's ZeRO optimizer
    state dict; `zero3`: a ZeRO-3 run (the only stage that quantizes frozen params); the paths name
    rank 0's files."""
    config = model0.get(N.DS_CONFIG)
    zero = _section(config, N.CONFIG_ZERO)
    fragments = model0.get(N.FROZEN_PARAM_FRAGMENTS)
    quantized = [k for k, v in (fragments or {}).items() if isinstance(v, TensorRef) and v.dtype.short == "int8"]
    if quantized or (zero3 and _on(_section(zero, "zero_quantized_nontrainable_weights")) and fragments):
        # partition_parameters.py:1838-1840: a frozen param's ds_tensor is CUDAQuantizer.quantize's int8
        # output, its scale a Python attribute; engine.py:5431 saves ds_tensor.detach().cpu() (no scale)
        return LayoutError(
            model_path,
            "a ZeRO++ run with zero_quantized_nontrainable_weights: its frozen params are saved quantized "
            "(frozen_param_fragments int8, without their scales), which zckpt does not read",
        )
    inner0 = inner.get(0) or {}
    ratio = _section(zero, N.CONFIG_OFFLOAD_OPTIMIZER, "ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1:
        missing = _sub_groups_without_state(inner0)
        if missing:
            # stage3.py:313-326 (a torch AdamW for the sub-groups kept on the GPU, :1100-1108), :1254-1258
            # (it steps them), :3442-3443 (only the CPU optimizer's state is saved)
            return LayoutError(
                optim_path,
                f"a ZeRO-Offload++ run (zero_optimization.offload_optimizer.ratio {ratio}): the optimizer state of "
                f"sub-group(s) {', '.join(map(str, missing))}, stepped on the GPU by a second optimizer, is not "
                "saved (DeepSpeed saves its CPU optimizer's only), which zckpt does not read",
            )
    return None


def _sub_groups_without_state(inner0: dict) -> list[int]:
    """ZeRO-3: the sub-groups the saved torch optimizer holds no state for, while others have some."""
    torch_state = inner0.get(N.OPTIMIZER_STATE_DICT)
    flats = inner0.get(N.FP32_FLAT_GROUPS)
    state = torch_state.get("state") if isinstance(torch_state, dict) else None
    if not isinstance(state, dict) or not state or not isinstance(flats, (list, tuple)):
        return []
    return [i for i in range(len(flats)) if not state.get(i)]


def feature_notes(model0: dict) -> list[str]:
    """What a user must hear about a run whose files zckpt reads as saved."""
    zero = _section(model0.get(N.DS_CONFIG), N.CONFIG_ZERO)
    notes = []
    if _on(_section(zero, N.CONFIG_OFFLOAD_OPTIMIZER, "super_offload")):
        # superoffload/superoffload_stage3.py:93-108 (its CPU sub-groups are not stepped by the saved
        # optimizer), superoffload_utils.py (a worker process's DeepSpeedCPUAdam holds their moments)
        notes.append(
            "a SuperOffload run (offload_optimizer.super_offload): DeepSpeed saves the fp32 masters but not the "
            "Adam moments, which its worker process holds; these files (and zckpt's outputs) restart Adam"
        )
    if _autocast_gradscaler_unsaved(model0.get(N.DS_CONFIG), zero):
        notes.append(
            "a torch_autocast float16 run without ZeRO: DeepSpeed does not save its torch GradScaler, so a resume "
            "from these files (or zckpt's outputs) restarts the loss scale at torch's default"
        )
    return notes


# DeepSpeed's DtypeEnum.fp16 spellings (runtime/config.py:146), read by get_torch_autocast_dtype (:186-195)
_FP16_NAMES = ("torch.float16", "fp16", "float16", "half")


def _autocast_gradscaler_unsaved(config: Any, zero: Any) -> bool:
    """torch_autocast with float16 and ZeRO off: the engine scales the loss with its own
    ``torch.amp.GradScaler`` (runtime/engine.py:666-672, stepped at :3507-3514), which neither the
    model states (``_common_checkpoint_state``, :5017-5038) nor the torch optimizer's state dict
    hold: its scale and growth tracker are lost at every save (measured: a 2-rank run's files hold
    no scaler at all)."""
    autocast = _section(config, "torch_autocast")
    stage = _section(zero, "stage") or 0
    return _on(_section(autocast, "enabled")) and _section(autocast, "dtype") in _FP16_NAMES and stage == 0

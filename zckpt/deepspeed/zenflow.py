"""ZenFlow (``zero_optimization.zenflow``, DeepSpeed 0.19): what its saved config says and what
its 16-bit module weights are.

ZenFlow's selective optimizer steps the selected columns of each 2-D weight (and 1-D weights
whole) in the 16-bit params after the masters were copied back
(``zenflow/zenflow_torch_adam.py:119-121``, ``:158``), so a ZeRO-1/2 ZenFlow checkpoint's module
weights are the live engine's, not the masters rounded. A layout that holds no 16-bit weights
(ZeRO-3, whose module states are placeholders; a universal folder, fp32 only) cannot keep them:
a run loading it starts from the masters rounded.
"""

from __future__ import annotations

DEFAULT_TOPK_RATIO = 0.1  # deepspeed/runtime/zenflow/zenflow_config.py


def zenflow_settings(ds_config: object) -> dict | None:
    """The saved ds_config's ``zero_optimization.zenflow`` (None: ZenFlow off; an empty dict
    where it is on with DeepSpeed's defaults)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    zenflow = zero.get("zenflow") if isinstance(zero, dict) else None
    return None if zenflow is None else zenflow if isinstance(zenflow, dict) else {}


def topk_ratio(zenflow: dict) -> float:
    """ZenFlow's share of selected columns (DeepSpeed's default 0.1, zenflow_config.py)."""
    ratio = zenflow.get("topk_ratio", DEFAULT_TOPK_RATIO)
    return float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else DEFAULT_TOPK_RATIO


def module_weights_note(ds_config: object, where: str) -> str | None:
    """The note for writing a ZenFlow run into `where` (a layout without 16-bit weights), or None
    when the run did not use ZenFlow."""
    if zenflow_settings(ds_config) is None:
        return None
    return (
        f"a ZenFlow run: its saved 16-bit module weights (the selected columns ZenFlow stepped after "
        f"the masters) are not kept in {where}, which holds no 16-bit weights; a run loading it starts "
        f"from the masters rounded (`zckpt reshard` to ZeRO-1 or 2 keeps them)"
    )

"""Which optimizer a DeepSpeed run built from its config's ``optimizer`` section (0.19.8,
``engine._configure_basic_optimizer`` / ``get_optimizer_configuration``): what a writer of another
framework's optimizer state needs to know that the saved param groups do not say."""

from __future__ import annotations

from typing import Any

ADAM_TYPES = ("adam", "adamw")  # runtime/config.py ADAM_OPTIMIZER, ADAMW_OPTIMIZER (names lower-cased)


def deepspeed_adam_w_mode(ds_config: dict[str, Any]) -> bool | None:
    """For a run whose config made DeepSpeed build its own Adam (FusedAdam; DeepSpeedCPUAdam with
    the optimizer offloaded), whether weight decay was decoupled (AdamW): always for type AdamW,
    for type Adam unless ``adam_w_mode`` is false. None for any other optimizer, for torch's own
    (``torch_adam``), and for a client's optimizer (no ``optimizer`` section): their groups say
    what they are. Those two Adams save only lr, betas, eps, weight_decay, bias_correction (and
    amsgrad) per group."""
    section = ds_config.get("optimizer")
    if not isinstance(section, dict):
        return None
    params = section.get("params") or {}
    kind = str(section.get("type", "")).lower()
    if kind not in ADAM_TYPES or not isinstance(params, dict) or params.get("torch_adam"):
        return None
    return kind == "adamw" or bool(params.get("adam_w_mode", True))

"""zckpt: read, consolidate, reshard and inspect DeepSpeed ZeRO checkpoints without DeepSpeed.

Python API::

    import zckpt
    state = zckpt.load_state_dict("runs/ckpt")                  # dict of fp32 tensors
    for name, tensor in zckpt.iter_tensors("runs/ckpt", dtype="bf16"):
        ...                                                      # one tensor in memory at a time
    zckpt.load_into_module(model, "runs/ckpt")                   # strict key check
    zckpt.consolidate("runs/ckpt", "out/")                       # model.safetensors
    zckpt.inspect_path("runs/ckpt")                              # the `zckpt inspect --json` report
    zckpt.reshard("runs/ckpt", "runs/ckpt-8", world_size=8)      # DeepSpeed checkpoint for 8 ranks
    zckpt.open_training_state("runs/ckpt")                       # masters, optimizer states, steps, ...
    zckpt.to_universal("runs/ckpt", "runs/ckpt")                 # DeepSpeed universal checkpoint
"""

from .api import iter_tensors, load_into_module, load_state_dict
from .consolidate import consolidate, plan_consolidation
from .diff import DiffReport, diff
from .deepspeed.reader import open_checkpoint, open_training_state, survey
from .errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    LayoutError,
    OutputError,
    UnsafePathError,
    UnsafePickleError,
    UsageError,
    ZckptError,
)
from .inspect import inspect_path
from .reshard import plan_reshard, reshard
from .universal import plan_to_universal, to_universal

__version__ = "0.1.0"

__all__ = [
    "CheckpointNotFoundError",
    "CorruptFileError",
    "DiffReport",
    "LayoutError",
    "OutputError",
    "UnsafePathError",
    "UnsafePickleError",
    "UsageError",
    "ZckptError",
    "consolidate",
    "diff",
    "inspect_path",
    "iter_tensors",
    "load_into_module",
    "load_state_dict",
    "open_checkpoint",
    "open_training_state",
    "plan_reshard",
    "reshard",
    "plan_consolidation",
    "plan_to_universal",
    "survey",
    "to_universal",
]

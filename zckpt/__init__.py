"""zckpt: read, consolidate, reshard and inspect DeepSpeed ZeRO checkpoints without DeepSpeed.

Python API::

    import zckpt
    state = zckpt.load_state_dict("runs/ckpt")                  # dict of fp32 tensors
    for name, tensor in zckpt.iter_tensors("runs/ckpt", dtype="bf16"):
        ...                                                      # one tensor in memory at a time
    zckpt.load_into_module(model, "runs/ckpt")                   # strict key check
    with zckpt.open("runs/ckpt") as ckpt:                        # keyed, like safetensors' safe_open
        ckpt.get_tensor("lm_head.weight")                        # one tensor read at a time
    zckpt.consolidate("runs/ckpt", "out/")                       # model.safetensors
    zckpt.inspect_path("runs/ckpt")                              # the `zckpt inspect --json` report
    zckpt.reshard("runs/ckpt", "runs/ckpt-8", world_size=8)      # DeepSpeed checkpoint for 8 ranks
    zckpt.open_training_state("runs/ckpt")                       # masters, optimizer states, steps, ...
    zckpt.to_universal("runs/ckpt", "runs/ckpt")                 # DeepSpeed universal checkpoint
    zckpt.to_dcp("runs/ckpt", "dcp/step-500")                    # torch DCP for FSDP2 / torchtitan
"""

from __future__ import annotations

import sys

_module = (
    sys.orig_argv[sys.orig_argv.index("-m") + 1 :][:1] if "-m" in sys.orig_argv else []
)  # `python [options] -m MODULE`
if _module == ["zckpt"] or sys.argv[0].endswith(("/zckpt", "\\zckpt", "zckpt.exe")):
    # the `zckpt` command (or `python -m zckpt`) is starting: from this first line of zckpt on,
    # SIGINT, SIGTERM and SIGHUP end it with the CLI's one line (not a KeyboardInterrupt
    # traceback from an import); the CLI installs its own handlers once it runs
    from .io.interrupts import exit_on_signal

    exit_on_signal()
del _module

import importlib
import types

from .core.errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    LayoutError,
    OutputError,
    UnsafePathError,
    UnsafePickleError,
    UsageError,
    ZckptError,
)

TYPE_CHECKING = False  # not typing's: importing typing costs the command's start-up ~10 ms
if TYPE_CHECKING:
    from typing import Any

    from .deepspeed.reader import open_checkpoint, open_training_state, survey
    from .ops.api import iter_tensors, load_into_module, load_state_dict
    from .ops.consolidate import consolidate
    from .ops.dcp import to_dcp
    from .ops.diff import DiffReport, diff
    from .ops.inspect import inspect_path
    from .ops.lazy import LazyCheckpoint, open  # noqa: F401 (not in __all__: see there)
    from .ops.reshard import plan_reshard, reshard
    from .ops.universal import plan_to_universal, to_universal
    from .ops.weights_folder import plan_consolidation

# The API is imported when first used, not with the package: `zckpt` (the command) starts with
# only its own imports, and so can answer Ctrl-C at start-up with its one line at once.
_API = {
    "iter_tensors": ".ops.api",
    "load_into_module": ".ops.api",
    "load_state_dict": ".ops.api",
    "consolidate": ".ops.consolidate",
    "plan_consolidation": ".ops.weights_folder",
    "open_checkpoint": ".deepspeed.reader",
    "open_training_state": ".deepspeed.reader",
    "survey": ".deepspeed.reader",
    "DiffReport": ".ops.diff",
    "diff": ".ops.diff",
    "inspect_path": ".ops.inspect",
    "open": ".ops.lazy",
    "LazyCheckpoint": ".ops.lazy",
    "plan_reshard": ".ops.reshard",
    "reshard": ".ops.reshard",
    "plan_to_universal": ".ops.universal",
    "to_universal": ".ops.universal",
    "to_dcp": ".ops.dcp",
}


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name not in _API:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_API[name], __name__), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        # the lazy API too, not yet imported: dir(zckpt) and a notebook's tab completion list it
        return sorted(set(self.__dict__) | set(_API))

    def __setattr__(self, name: str, value: Any) -> None:
        # importing a submodule binds it as an attribute of the package: one named like an API
        # function (`zckpt.consolidate` was, before the layers) must not replace the function
        if name in _API and isinstance(value, types.ModuleType):
            return
        types.ModuleType.__setattr__(self, name, value)


sys.modules[__name__].__class__ = _Package

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)

# `open` (zckpt.open) is left out: `from zckpt import *` must not replace the builtin open
__all__ = [
    "CheckpointNotFoundError",
    "CorruptFileError",
    "DiffReport",
    "LayoutError",
    "LazyCheckpoint",
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
    "to_dcp",
    "to_universal",
]

"""The Python API: consolidated state dicts in memory, lazily, or straight into a module."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterator

from ..core.dtypes import DTypeLike, output_dtype
from ..core.errors import LayoutError
from ..core.index import CheckpointIndex, Entry
from ..deepspeed.reader import open_checkpoint, open_training_state
from ..io.materialize import read_tensor
from ..io.reading import FileReader

if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]


def _selected(index: CheckpointIndex, exclude_frozen: bool) -> list[Entry]:
    kept = [e for e in index.entries if not (exclude_frozen and e.kind == "frozen")]
    names = {e.name for e in kept}
    return [e for e in kept if e.alias_of is None or e.alias_of in names]


def iter_tensors(
    checkpoint: PathLike,
    *,
    tag: str | None = None,
    dtype: DTypeLike = "fp32",
    exclude_frozen: bool = False,
    states: bool = False,
    swap_folder: PathLike | None = None,
) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(name, tensor)`` one at a time; only one tensor is in memory at once.

    Floating tensors come in `dtype` (``fp32``, ``bf16`` or ``fp16``, torch's names such as
    ``bfloat16``, or a torch dtype such as ``torch.bfloat16``); integer buffers keep
    their own. A tied alias is yielded as a fresh copy of its source. With `states`, each
    trainable param is followed by its optimizer states as ``<name>.<state>`` (``exp_avg``,
    ``exp_avg_sq`` for Adam; whatever the optimizer keeps), full shape, in their stored dtype.
    With `swap_folder` (a live ZeRO-Infinity ``<nvme_path>`` of the same run), swapped
    sub-groups are read from there: the run's newest state.
    """
    target = output_dtype(dtype)
    state = open_training_state(checkpoint, tag, swap_folder) if states else None
    index = state.index if state else open_checkpoint(checkpoint, tag, swap_folder)
    optimizer = {p.name: p.states for p in state.params} if state else {}
    with FileReader() as reader:
        for entry in _selected(index, exclude_frozen):
            out = target if entry.source.dtype.is_floating else entry.source.dtype
            tensor = read_tensor(reader, entry.source, out)
            reader.verify_now()  # checked before the caller sees it (a whole record at first use)
            yield entry.name, tensor
            for key, source in optimizer.get(entry.name, {}).items() if entry.kind == "param" else ():
                tensor = read_tensor(reader, source)
                reader.verify_now()
                yield f"{entry.name}.{key}", tensor


def load_state_dict(
    checkpoint: PathLike,
    *,
    tag: str | None = None,
    dtype: DTypeLike = "fp32",
    exclude_frozen: bool = False,
    swap_folder: PathLike | None = None,
) -> dict[str, "torch.Tensor"]:
    """The whole consolidated state dict, as zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint
    returns it, plus frozen params; tied aliases share their source's tensor. With `swap_folder`,
    swapped sub-groups come from that live ZeRO-Infinity folder."""
    target = output_dtype(dtype)
    index = open_checkpoint(checkpoint, tag, swap_folder)
    state: dict[str, torch.Tensor] = {}
    with FileReader() as reader:
        for entry in _selected(index, exclude_frozen):
            if entry.alias_of is not None:
                state[entry.name] = state[entry.alias_of]
                continue
            out = target if entry.source.dtype.is_floating else entry.source.dtype
            state[entry.name] = read_tensor(reader, entry.source, out)
    return state


def load_into_module(
    module: "torch.nn.Module", checkpoint: PathLike, *, tag: str | None = None, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Copy a checkpoint's weights into `module` in place, one tensor at a time.

    Each tensor is cast to the dtype of the module's own tensor. With `strict`, keys the
    module has and the checkpoint lacks (missing) or the reverse (unexpected) are an error;
    without it they are returned as ``(missing, unexpected)``.

    A module built on the meta device (``with torch.device("meta"): model = Model()``, the way
    to build a big model without allocating it twice) is materialized: each meta param or
    buffer is replaced by the loaded CPU tensor (``load_state_dict(assign=True)`` semantics),
    keeping its dtype, ``requires_grad`` and ties (a tied param stays one Parameter). Tensors
    the checkpoint does not hold (missing keys with ``strict=False``, non-persistent buffers)
    stay on meta.
    """
    import torch

    index = open_checkpoint(checkpoint, tag)
    targets = module.state_dict(keep_vars=True)
    names = set(index.names())
    missing = sorted(set(targets) - names)
    unexpected = sorted(names - set(targets))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(
                f"missing from the checkpoint: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
            )
        if unexpected:
            parts.append(f"not in the module: {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
        raise LayoutError(index.tag_dir, "; ".join(parts) + " (pass strict=False to load the rest)")
    materialized: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its replacement, so ties stay ties
    with FileReader() as reader, torch.no_grad():
        for entry in index.entries:
            target = targets.get(entry.name)
            if target is None:
                continue
            if tuple(target.shape) != entry.source.shape:
                raise LayoutError(
                    index.tag_dir,
                    f"{entry.name}: checkpoint shape {list(entry.source.shape)} != module shape {list(target.shape)}",
                )
            if not target.is_meta:
                target.copy_(read_tensor(reader, entry.source))
            elif id(target) in materialized:
                _assign(module, entry.name, materialized[id(target)])
            else:  # copy_ into a meta tensor does nothing, silently: replace it instead
                materialized[id(target)] = _materialize(target, read_tensor(reader, entry.source))
                _assign(module, entry.name, materialized[id(target)])
    return missing, unexpected


def _materialize(meta: "torch.Tensor", loaded: "torch.Tensor") -> "torch.Tensor":
    """The loaded tensor in the meta tensor's dtype, a Parameter again if it was one."""
    import torch

    value = loaded.to(meta.dtype)
    if isinstance(meta, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def _assign(module: "torch.nn.Module", name: str, value: "torch.Tensor") -> None:
    """Put `value` in place of the param or buffer at dotted state-dict `name`."""
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attribute in owner._parameters:
        owner._parameters[attribute] = value
    else:
        owner._buffers[attribute] = value

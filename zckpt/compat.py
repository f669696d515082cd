"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, by name, signature and defaults (as of
DeepSpeed 0.19.8), done by zckpt: no DeepSpeed needed, no pickled code run. Change one line::

    # from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from zckpt.compat import get_fp32_state_dict_from_zero_checkpoint

    state_dict = get_fp32_state_dict_from_zero_checkpoint("runs/ckpt")

Every key DeepSpeed's function returns is here, with the same bits, dtype and shape (tested
against DeepSpeed's own functions on the bundled samples). Where zckpt differs:

- ZeRO-1 (and ZeRO-0) frozen params, which DeepSpeed's functions drop (that stage records them
  only in the module's state dict), are included, after DeepSpeed's keys, in their saved dtype,
  as ``zckpt consolidate`` does. ``exclude_frozen_parameters=True`` leaves them out.
- Tied params saved as safetensors (``safe_serialization=True``): DeepSpeed's convert fails
  ("Some tensors share memory"); zckpt writes each name, a copy, as ``zckpt consolidate`` does
  (the file's metadata names the ties).
- Checkpoints DeepSpeed's functions fail on are read: a ZeRO-Infinity run's NVMe-offloaded
  optimizer, bf16 ZeRO-1 with DeepSpeed's BF16_Optimizer, ZeRO-0, universal folders, pipeline
  and tensor-parallel runs (what :func:`zckpt.open_checkpoint` reads).
- `checkpoint_dir` may also be a tag folder, or a folder with one tag folder and no ``latest``
  file (DeepSpeed requires ``latest`` when `tag` is None). Errors are zckpt's, each naming the
  file at fault: a FileNotFoundError where no checkpoint is found (DeepSpeed raises ValueError
  for a missing ``latest``), a ValueError for a damaged one or a bad argument.
- The torch files hold one storage per tensor (a tied alias shares its source's); DeepSpeed's
  ZeRO-2 files hold each param as a view of its group's flat fp32 storage. ``torch.load`` gives
  the same keys and values from both.
- ``lazy_mode=True`` gives :class:`~zckpt.ops.lazy.LazyTensor` objects for every key (DeepSpeed
  gives its pseudo tensors for ZeRO-3 trainable params and plain tensors for the rest): each has
  ``shape``, ``dtype`` and ``contiguous()``, which reads that one tensor then.
- The convert functions write into `output_dir` atomically (all files or none), replace older
  weights files there (stale shards of a larger output included), checksum every record read,
  and refuse an `output_dir` inside the tag folder they read.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .core.dtypes import FP32, DTypeLike, output_dtype
from .core.errors import LayoutError
from .core.index import CheckpointIndex, Entry
from .deepspeed.reader import open_checkpoint
from .io.output import refuse_output_inside_input
from .ops.lazy import LazyCheckpoint, LazyTensor
from .ops.replicas import replica_problems
from .ops.weights_folder import plan_consolidation, write_consolidated

if TYPE_CHECKING:
    import torch

__all__ = [
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

PathLike = str | os.PathLike[str]
_UNSHARDED = 1 << 62  # max_shard_size=None: one file whatever its size, as DeepSpeed writes it


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> "OrderedDict[str, torch.Tensor] | OrderedDict[str, LazyTensor]":
    """The consolidated state dict of a ZeRO checkpoint, as DeepSpeed's function of this name gives it.

    Trainable params are the fp32 masters; buffers come as fp32 (integer ones as saved); frozen
    params in the dtype they were saved in (bf16/fp16 in a 16-bit run: DeepSpeed's behaviour,
    kept; :func:`zckpt.load_state_dict` widens them to fp32). A tied alias is the same tensor
    object as its source. Keys come in DeepSpeed's order (buffers, frozen, trainable, aliases),
    then the ZeRO-1 frozen params DeepSpeed drops (see the module's notes).

    `tag`: the tag folder to read (default: the one ``latest`` names). `exclude_frozen_parameters`:
    leave the frozen params out (and aliases of them). `lazy_mode`: values are
    :class:`~zckpt.ops.lazy.LazyTensor` objects, whose ``.contiguous()`` reads that one tensor
    (a new tensor each call), so memory holds one tensor at a time::

        state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, lazy_mode=True)
        for name, lazy_tensor in state_dict.items():
            tensor = lazy_tensor.contiguous()

    No pickled code runs: the layout is read by zckpt's restricted unpickler, the tensors'
    bytes straight from the files (each zip record checked against its CRC-32 when first used).
    """
    ckpt = LazyCheckpoint(checkpoint_dir, tag, dtype=None, exclude_frozen=exclude_frozen_parameters)
    try:
        values: dict[str, Any] = {}
        entries = _in_deepspeed_order(ckpt.index, [ckpt.entry(name) for name in ckpt.keys()])
        for entry in entries:
            if entry.alias_of is None:
                dtype = None if entry.kind == "frozen" else FP32  # as DeepSpeed: frozen as saved
                read = ckpt.get_lazy if lazy_mode else ckpt.get_tensor
                values[entry.name] = read(entry.name, dtype=dtype)
        state: OrderedDict[str, Any] = OrderedDict()
        for entry in entries:
            state[entry.name] = values[entry.alias_of if entry.alias_of is not None else entry.name]
    finally:
        if not lazy_mode:
            ckpt.close()  # lazy: the files stay open (closed when the last LazyTensor goes)
    return state


def load_state_dict_from_zero_checkpoint(
    model: "torch.nn.Module", checkpoint_dir: PathLike, tag: str | None = None
) -> "torch.nn.Module":
    """Move `model` to the CPU and load the checkpoint's consolidated weights into it, as
    DeepSpeed's function of this name does: :func:`get_fp32_state_dict_from_zero_checkpoint`, then
    ``model.cpu().load_state_dict(state_dict, strict=False)`` (so the module's own load hooks
    run and each tensor is cast to its param's dtype); returns the model.

    As there, the whole state dict is in memory at once; :func:`zckpt.load_into_module` loads one
    tensor at a time (and onto a model built on the meta device). A ZeRO-1 checkpoint's frozen
    params are loaded too, where DeepSpeed leaves the model's own values.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: PathLike,
    output_dir: PathLike,
    dtype: DTypeLike = "float32",
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the consolidated state dict into `output_dir` as DeepSpeed's function of this name
    (DeepSpeed >= 0.18's; its `dtype` default is ``torch.float32``) does: the same files,
    ``pytorch_model.bin`` (``torch.save`` of a dict of plain tensors, loadable with
    ``weights_only=True``) or with `safe_serialization` ``model.safetensors``; above
    `max_shard_size` (Hugging Face's sizes: ``"5GB"`` is 5 * 10**9 bytes; None: never sharded)
    ``pytorch_model-00001-of-0000N.bin`` ... or ``model-00001-of-0000N.safetensors`` ... and
    their ``*.index.json``, the same tensors in the same files.

    Floating tensors are written in `dtype` (``float32``, ``bfloat16``, ``float16``, short names
    or torch dtypes), integer buffers as saved. Tied params: one storage under both names in
    ``pytorch_model.bin``; in safetensors, where DeepSpeed fails, a copy under each name. The
    ZeRO-1 frozen params DeepSpeed drops are written too (after DeepSpeed's tensors, so a sharded
    output only changes if they need a shard of their own). Returns None, as DeepSpeed's does.
    """
    target = output_dtype(dtype)
    index = open_checkpoint(checkpoint_dir, tag)
    output = os.fspath(output_dir)
    # DeepSpeed's habit, `zero_to_fp32.py . out/` inside the checkpoint folder, stays allowed;
    # an output inside the tag folder it reads is refused
    refuse_output_inside_input(output, (index.tag_dir,))
    differing = replica_problems(index)  # a tied param is written once: its other copies must agree
    if differing:
        raise LayoutError(index.tag_dir, differing[0])
    index = replace(index, entries=tuple(_in_deepspeed_order(index, list(index.entries))))
    plan = plan_consolidation(
        index,
        dtype=target,
        format="safetensors" if safe_serialization else "torch",
        max_shard_size=_UNSHARDED if max_shard_size is None else max_shard_size,
        exclude_frozen=exclude_frozen_parameters,
    )
    # DeepSpeed writes the weights alone (consolidate copies a Hugging Face config along)
    write_consolidated(index, replace(plan, extra_files=()), output, overwrite=True)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: PathLike,
    output_dir: PathLike,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32: what ``zero_to_fp32.py CHECKPOINT_DIR
    OUTPUT_DIR`` runs, and the files it writes (``pytorch_model.bin``, or ``model.safetensors``
    with `safe_serialization`; sharded above `max_shard_size`, with the index json)."""
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=FP32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def _in_deepspeed_order(index: CheckpointIndex, entries: list[Entry]) -> list[Entry]:
    """`entries` in zero_to_fp32's order (the index's), the frozen params its functions drop
    (a ZeRO-0/1 run records them only in the module) and their aliases moved last: DeepSpeed's
    keys come first, and shard the same."""
    dropped = {e.name for e in entries if not index.universal and index.zero_stage <= 1 and e.kind == "frozen"}
    dropped |= {e.name for e in entries if e.alias_of in dropped}
    return [e for e in entries if e.name not in dropped] + [e for e in entries if e.name in dropped]

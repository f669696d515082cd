"""Keyed lazy access to a checkpoint, one tensor read at a time: safetensors' ``safe_open`` for
DeepSpeed checkpoints.

::

    import zckpt

    with zckpt.open("runs/ckpt") as ckpt:          # a checkpoint folder, a tag folder, a universal folder
        print(len(ckpt), ckpt.metadata()["zero_stage"])
        for name in ckpt.keys():
            tensor = ckpt.get_tensor(name)         # read now, alone; fp32 masters by default

Opening reads only the small pickles that describe the layout (no tensor data, no pickled code
run); each :meth:`LazyCheckpoint.get_tensor` reads that one tensor's bytes, gathered from every
rank's partition. Consolidated weights (``model.safetensors``, ``pytorch_model.bin``) are not a
checkpoint here: ``safetensors.safe_open`` or ``torch.load(weights_only=True)`` read those.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator

from ..core.dtypes import DType, DTypeLike, output_dtype
from ..core.errors import UsageError
from ..core.index import CheckpointIndex, Entry
from ..deepspeed.reader import open_checkpoint
from ..io.materialize import read_tensor
from ..io.reading import FileReader
from .api import _selected

if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]
_OPEN_DTYPE = object()  # get_tensor's dtype when not given: the one open() was given


class LazyCheckpoint:
    """A checkpoint's consolidated state dict, keyed, read one tensor at a time.

    Made by :func:`open`. Keys are in the order DeepSpeed's zero_to_fp32 emits them (buffers,
    frozen params, trainable params, tied aliases; a ZeRO-1 run's frozen params, which it drops,
    after the buffers). :attr:`index` is the whole description zckpt read. A mapping in all but name: ``name in ckpt``,
    ``len(ckpt)``, ``for name in ckpt``, ``ckpt[name]`` (:meth:`get_tensor`). Safe to share
    between threads (reads take turns). :meth:`close` (or leaving the ``with`` block) closes the
    files; a closed checkpoint reads nothing more.
    """

    def __init__(
        self,
        checkpoint: PathLike,
        tag: str | None = None,
        *,
        dtype: DTypeLike | None = "fp32",
        device: "str | torch.device" = "cpu",
        exclude_frozen: bool = False,
        swap_folder: PathLike | None = None,
        verify: bool = True,
    ) -> None:
        self._dtype = _target(dtype)
        self._device = device
        self.index: CheckpointIndex = open_checkpoint(checkpoint, tag, swap_folder)
        self._entries: dict[str, Entry] = {e.name: e for e in _selected(self.index, exclude_frozen)}
        self._reader = FileReader(verify=verify)
        self._lock = threading.Lock()
        self._closed = False
        # descriptors are closed when the object goes, with or without close()
        self._finalizer = weakref.finalize(self, self._reader.close)

    # --- what is there (no tensor data read) ------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor's name (tied aliases included), in zero_to_fp32's order."""
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        """The index entry of `name`: its kind (``param``, ``frozen``, ``buffer``, ``tied``),
        stored dtype and shape (``entry.source``), and for a tied alias the name it aliases."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of {self.index.tag_dir}") from None

    def kind(self, name: str) -> str:
        return self.entry(name).kind

    @property
    def tied(self) -> dict[str, str]:
        """Tied aliases: alias name -> the name of the tensor it shares memory with in the model."""
        return {e.name: e.alias_of for e in self._entries.values() if e.alias_of is not None}

    def metadata(self) -> dict[str, str]:
        """Facts about the checkpoint, as strings (safetensors' ``metadata()`` is str -> str):
        ``format`` (``deepspeed-zero`` or ``deepspeed-universal``), ``tag``, ``zero_stage``,
        ``world_size``, ``dtype`` (the run's training dtype), ``ds_version``, ``offload``,
        ``checkpoint_dir``, ``tag_dir``. The whole description is :attr:`index`."""
        index = self.index
        return {
            "format": "deepspeed-universal" if index.universal else "deepspeed-zero",
            "tag": index.tag,
            "zero_stage": str(index.zero_stage),
            "world_size": str(index.world_size),
            "dtype": index.dtype.short,
            "ds_version": index.ds_version or "",
            "offload": index.offload,
            "checkpoint_dir": index.checkpoint_dir,
            "tag_dir": index.tag_dir,
        }

    # --- reading ------------------------------------------------------------------------------
    def get_tensor(self, name: str, *, dtype: Any = _OPEN_DTYPE) -> "torch.Tensor":
        """The tensor `name`, read now: a new tensor each call (a tied alias too: a copy of its
        source's values). Floating tensors come in the dtype given to :func:`open` (or here:
        ``fp32``, ``bf16``, ``fp16``, a torch dtype, or None for the dtype it is stored in);
        integer buffers keep theirs. Every record its bytes come from passes its CRC-32 check
        before it is returned (once per record), unless opened with ``verify=False``."""
        return self._read(name, self._output_dtype(name, dtype))

    def _output_dtype(self, name: str, dtype: Any) -> DType:
        """The dtype `name` comes out in, `dtype` asked for (or the one open() was given)."""
        stored = self.entry(name).source.dtype
        target = self._dtype if dtype is _OPEN_DTYPE else _target(dtype)
        return target if target is not None and stored.is_floating else stored

    def _read(self, name: str, out: DType) -> "torch.Tensor":
        entry = self.entry(name)
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.index.tag_dir} is closed: open it again to read {name}")
            tensor = read_tensor(self._reader, entry.source, out)
            self._reader.verify_now()  # checked before the caller sees it
        return tensor if str(self._device) == "cpu" else tensor.to(self._device)

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self.get_tensor(name)

    def get_lazy(self, name: str, *, dtype: Any = _OPEN_DTYPE) -> "LazyTensor":
        """A :class:`LazyTensor` for `name`: its shape and dtype now, its values on ``.contiguous()``."""
        return LazyTensor(self, name, self._output_dtype(name, dtype))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "LazyCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return f"<zckpt.LazyCheckpoint {self.index.tag_dir!r}: {state}>"


class LazyTensor:
    """One tensor of a :class:`LazyCheckpoint`, not read yet: ``shape`` (a ``torch.Size``) and
    ``dtype`` (a torch dtype) now, the values on ``.contiguous()`` (read then, a new tensor each
    call), as DeepSpeed's ``lazy_mode=True`` pseudo tensors give them. Only those three are a
    tensor's: anything else is done on what ``.contiguous()`` returns."""

    __slots__ = ("_checkpoint", "name", "_dtype")

    def __init__(self, checkpoint: LazyCheckpoint, name: str, dtype: DType) -> None:
        self._checkpoint = checkpoint
        self.name = name
        self._dtype = dtype

    @property
    def shape(self) -> "torch.Size":
        import torch

        return torch.Size(self._checkpoint.entry(self.name).source.shape)

    @property
    def dtype(self) -> "torch.dtype":
        return self._dtype.torch()

    def contiguous(self) -> "torch.Tensor":
        return self._checkpoint._read(self.name, self._dtype)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self._dtype.name})"


def _target(dtype: DTypeLike | None) -> DType | None:
    if dtype is None:
        return None
    if isinstance(dtype, DType):
        return dtype if dtype.is_floating else _refused(dtype)
    return output_dtype(dtype)


def _refused(dtype: DType) -> DType:
    raise UsageError(None, f"dtype {dtype.name}: choose fp32, bf16 or fp16 (or None: as stored)")


def open(  # zckpt.open, named as safetensors' safe_open; the builtin is untouched outside this module
    checkpoint: PathLike,
    tag: str | None = None,
    *,
    dtype: DTypeLike | None = "fp32",
    device: "str | torch.device" = "cpu",
    exclude_frozen: bool = False,
    swap_folder: PathLike | None = None,
    verify: bool = True,
) -> LazyCheckpoint:
    """Open a checkpoint for keyed reading, one tensor at a time (safetensors' ``safe_open``)::

        with zckpt.open("runs/ckpt") as ckpt:
            ckpt.keys()                    # names, no data read
            ckpt.get_tensor("lm_head.weight")

    `checkpoint`: a DeepSpeed checkpoint folder (the tag its ``latest`` names, or `tag`), a tag
    folder, a universal checkpoint folder, a Trainer output folder (its newest ``checkpoint-N``)
    or a Lightning checkpoint folder: what :func:`zckpt.open_checkpoint` reads. Floating tensors
    come in `dtype` (default ``fp32``: trainable params are the fp32 masters, frozen params and
    buffers widened exactly; ``bf16``/``fp16`` round to nearest; None keeps each tensor's stored
    dtype), on `device`. `exclude_frozen` leaves out the frozen params; `swap_folder` reads a
    live ZeRO-Infinity run's swapped sub-groups from there. With `verify` (the default), each
    zip record a tensor's bytes come from is checked whole (CRC-32) the first time it is used.
    Nothing pickled is ever run: the layout is read by zckpt's restricted unpickler.
    """
    return LazyCheckpoint(
        checkpoint,
        tag,
        dtype=dtype,
        device=device,
        exclude_frozen=exclude_frozen,
        swap_folder=swap_folder,
        verify=verify,
    )

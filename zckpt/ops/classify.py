"""What is this path? One answer for every command (inspect, verify, diff, nvme-plan, the tensor
sources), so that the same folder is the same kind everywhere.

The checks, in the order that decides an ambiguous path (the order the commands have always
used): a missing path; a folder that is no checkpoint but a live ZeRO-Infinity swap folder; a
DeepSpeed folder (a tag folder first, as :func:`~zckpt.deepspeed.locate.locate` takes it, then a
folder with ``latest`` or tag folders); a folder holding weights (the first of the index, then
single-file names, safetensors before torch), or a PEFT adapter file; a Trainer output folder
(``checkpoint-N`` folders); any other folder. For a file: a shard index (``.index.json``), a
``latest`` file of a checkpoint folder, else one weights file. Pure apart from looking at names
(no file is opened): errors stay the commands' own.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from ..core.run_folders import TRAINER_CHECKPOINT_RE, newest_lightning_checkpoint, newest_trainer_checkpoint
from ..deepspeed import names as N
from ..deepspeed import swap_folder as swap
from ..deepspeed.locate import is_tag_dir, is_universal_dir, looks_like_checkpoint
from .formats import FORMATS

# Weights files looked for in a folder that holds no checkpoint, in the order they win.
WEIGHTS_IN_FOLDER = tuple(f.index_file for f in FORMATS.values()) + tuple(f.single_file for f in FORMATS.values())
ADAPTER_IN_FOLDER = tuple(f.adapter_file for f in FORMATS.values())


class Kind(enum.Enum):
    MISSING = "missing"  # nothing at the path
    SWAP_FOLDER = "swap_folder"  # a live ZeRO-Infinity <nvme_path>, or its zero_stage_3/
    TAG_FOLDER = "tag_folder"  # one tag of a DeepSpeed checkpoint (holds *_model_states.pt)
    UNIVERSAL_FOLDER = "universal_folder"  # the tag folder of a universal checkpoint (zero/ inside)
    CHECKPOINT_FOLDER = "checkpoint_folder"  # a DeepSpeed checkpoint folder: 'latest' or tag folders
    TRAINER_CHECKPOINT = "trainer_checkpoint"  # the same, named checkpoint-N (a Hugging Face Trainer's)
    WEIGHTS_FOLDER = "weights_folder"  # a Hugging Face weights folder (safetensors or torch)
    ADAPTER_FOLDER = "adapter_folder"  # a PEFT adapter folder (adapter_model.*)
    TRAINER_OUTPUT = "trainer_output"  # a Trainer's output folder of checkpoint-N folders
    LIGHTNING_FOLDER = "lightning_folder"  # a Lightning ModelCheckpoint dirpath of *.ckpt folders
    FOLDER = "folder"  # any other folder
    LATEST_FILE = "latest_file"  # the 'latest' (or 'latest_universal') file of a checkpoint folder
    WEIGHTS_INDEX = "weights_index"  # a shard index (*.index.json)
    WEIGHTS_FILE = "weights_file"  # one file: a safetensors or a torch.save file


CHECKPOINT_KINDS = frozenset({Kind.TAG_FOLDER, Kind.UNIVERSAL_FOLDER, Kind.CHECKPOINT_FOLDER, Kind.TRAINER_CHECKPOINT})


@dataclass(frozen=True)
class InputKind:
    """What `path` is, and the file that answers for it where there is one."""

    path: str
    kind: Kind
    weights_file: str | None = None  # a non-checkpoint folder's first weights file (index first)
    adapter_file: str | None = None  # a non-checkpoint folder's PEFT adapter file

    @property
    def is_checkpoint(self) -> bool:
        """A DeepSpeed checkpoint folder or tag folder (what locate() reads as given)."""
        return self.kind in CHECKPOINT_KINDS

    @property
    def checkpoint_dir(self) -> str:
        """The folder a `latest` file belongs to (the path itself for folders)."""
        return (os.path.dirname(self.path) or ".") if self.kind is Kind.LATEST_FILE else self.path


def classify(path: str | os.PathLike[str]) -> InputKind:
    """The kind of `path` (see the module docstring for the order of the checks)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return InputKind(path, Kind.MISSING)
    if not os.path.isdir(path):
        if path.endswith(".index.json"):
            return InputKind(path, Kind.WEIGHTS_INDEX)
        if os.path.basename(path) in (N.LATEST_FILE, N.LATEST_UNIVERSAL_FILE) and looks_like_checkpoint(
            os.path.dirname(path) or "."
        ):
            return InputKind(path, Kind.LATEST_FILE)
        return InputKind(path, Kind.WEIGHTS_FILE)
    if looks_like_checkpoint(path):
        return InputKind(path, _checkpoint_kind(path))
    weights = next((os.path.join(path, n) for n in WEIGHTS_IN_FOLDER if os.path.isfile(os.path.join(path, n))), None)
    adapter = next((os.path.join(path, n) for n in ADAPTER_IN_FOLDER if os.path.isfile(os.path.join(path, n))), None)
    if swap.is_swap_folder(path):
        kind = Kind.SWAP_FOLDER
    elif weights is not None:
        kind = Kind.WEIGHTS_FOLDER
    elif adapter is not None:
        kind = Kind.ADAPTER_FOLDER
    elif newest_trainer_checkpoint(path, looks_like_checkpoint) is not None:
        kind = Kind.TRAINER_OUTPUT
    elif newest_lightning_checkpoint(path, looks_like_checkpoint) is not None:
        kind = Kind.LIGHTNING_FOLDER
    else:
        kind = Kind.FOLDER
    return InputKind(path, kind, weights, adapter)


def _checkpoint_kind(path: str) -> Kind:
    """Which DeepSpeed folder: a tag folder first (as locate() takes it), then a checkpoint folder."""
    if is_tag_dir(path):
        return Kind.UNIVERSAL_FOLDER if is_universal_dir(path) else Kind.TAG_FOLDER
    if TRAINER_CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path))):
        return Kind.TRAINER_CHECKPOINT
    return Kind.CHECKPOINT_FOLDER

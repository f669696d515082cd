"""The folders training frameworks keep their checkpoints in: transformers Trainer's
``output_dir/checkpoint-N``, Accelerate's ``checkpoints/checkpoint_N`` and PyTorch Lightning's
``ModelCheckpoint`` dirpath of ``epoch=E-step=S.ckpt/`` folders (``last.ckpt/`` with ``save_last``).

One rule read on both sides of the format line: the DeepSpeed locator looks one level down into
a Trainer's output folder for the newest tag folders, and consolidation writes beside the config
and tokenizer of a ``checkpoint-N`` folder. Neither format package may import the other, so the
rule lives here, below both.
"""

from __future__ import annotations

import os
import re
from typing import Callable

# transformers' PREFIX_CHECKPOINT_DIR folders (checkpoint-N), and Accelerate's save_state folders
# under ProjectConfiguration(automatic_checkpoint_naming=True) (project_dir/checkpoints/checkpoint_N)
TRAINER_CHECKPOINT_RE = re.compile(r"^checkpoint[-_](\d+)$")

TRAINER_FOLDER_NOTE = "Trainer output folder"  # starts the note saying which checkpoint-N was read
LIGHTNING_FOLDER_NOTE = "Lightning checkpoint folder"  # ... which epoch=E-step=S.ckpt was read
RUN_FOLDER_NOTES = (TRAINER_FOLDER_NOTE, LIGHTNING_FOLDER_NOTE)

# Lightning's DeepSpeedStrategy saves each checkpoint as a folder named like a file (the default
# ModelCheckpoint filename is "{epoch}-{step}", so "epoch=0-step=4.ckpt"); `last.ckpt` with save_last
LIGHTNING_SUFFIX = ".ckpt"
LIGHTNING_STEP_RE = re.compile(r"(?:^|[-_])step=(\d+)")
LIGHTNING_EPOCH_RE = re.compile(r"(?:^|[-_])epoch=(\d+)")
LIGHTNING_LAST_RE = re.compile(r"^last(?:-v\d+)?\.ckpt$")


def newest_trainer_checkpoint(folder: str, is_checkpoint: Callable[[str], bool]) -> tuple[str, int] | None:
    """The newest ``checkpoint-N`` folder in a Trainer's output folder (largest N, as
    transformers' ``get_last_checkpoint`` picks) that `is_checkpoint`, and how many there are."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = [
        (int(m[1]), n)
        for n in names
        if (m := TRAINER_CHECKPOINT_RE.match(n)) and os.path.isdir(os.path.join(folder, n))
    ]
    usable = [(step, n) for step, n in found if is_checkpoint(os.path.join(folder, n))]
    return (max(usable)[1], len(found)) if usable else None


def newest_lightning_checkpoint(folder: str, is_checkpoint: Callable[[str], bool]) -> tuple[str, int, str] | None:
    """The newest ``*.ckpt`` checkpoint folder in a Lightning ``ModelCheckpoint`` dirpath, how many
    there are, and why it was picked. Lightning's own rule first: ``ckpt_path="last"`` takes the
    most recently written ``last*.ckpt``; without one, the largest ``step=`` (then ``epoch=``) in
    the name. Links are not followed (a checkpoint's own folders are read, never a link's target).
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = [
        n
        for n in names
        if n.endswith(LIGHTNING_SUFFIX)
        and not os.path.islink(os.path.join(folder, n))
        and os.path.isdir(os.path.join(folder, n))
    ]
    usable = [n for n in found if is_checkpoint(os.path.join(folder, n))]
    last = [n for n in usable if LIGHTNING_LAST_RE.match(n)]
    if last:
        return max(last, key=lambda n: (_mtime(os.path.join(folder, n)), n)), len(found), "the newest last*.ckpt"
    stepped = [(int(m[1]), _epoch(n), n) for n in usable if (m := LIGHTNING_STEP_RE.search(n))]
    if stepped:
        return max(stepped)[2], len(found), "the largest step="
    if len(usable) == 1:
        return usable[0], len(found), "the only one"
    return None


def _epoch(name: str) -> int:
    found = LIGHTNING_EPOCH_RE.search(name)
    return int(found[1]) if found else -1


def _mtime(folder: str) -> float:
    """When a checkpoint folder was last written: DeepSpeed writes `latest` last."""
    try:
        return os.stat(os.path.join(folder, "latest")).st_mtime
    except OSError:
        return os.stat(folder).st_mtime

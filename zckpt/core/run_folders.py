"""The folders training frameworks keep their checkpoints in: transformers Trainer's
``output_dir/checkpoint-N`` and Accelerate's ``checkpoints/checkpoint_N``.

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

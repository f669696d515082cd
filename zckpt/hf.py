"""Hugging Face layout names: weights files, their index, and the files `from_pretrained` reads."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from .errors import CorruptFileError

SAFETENSORS_PATTERN = "model{suffix}.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_PATTERN = "pytorch_model{suffix}.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
CONFIG_FILE = "config.json"
# the keys a config names its weights' dtype by: transformers 5 writes "dtype", 4.x "torch_dtype"
# (5 still reads it); loading with dtype="auto" (5's default) takes the weights in that dtype
DTYPE_KEYS = ("dtype", "torch_dtype")
TRAINER_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR folders


TRAINER_FOLDER_NOTE = "Trainer output folder"  # starts the note saying which checkpoint-N was read


def newest_trainer_checkpoint(folder: str, is_checkpoint: Callable[[str], bool]) -> tuple[str, int] | None:
    """The newest ``checkpoint-N`` folder in a Trainer's output folder (largest N, as
    transformers' ``get_last_checkpoint`` picks) that `is_checkpoint`, and how many there are."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = [(int(m[1]), n) for n in names if (m := TRAINER_CHECKPOINT_RE.match(n)) and os.path.isdir(os.path.join(folder, n))]
    usable = [(step, n) for step, n in found if is_checkpoint(os.path.join(folder, n))]
    return (max(usable)[1], len(found)) if usable else None

# Files a Hugging Face Trainer `checkpoint-N` folder holds beside the DeepSpeed tag folders that
# make the consolidated output loadable with `from_pretrained`.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def config_with_dtype(path: str, dtype_name: str) -> str:
    """The text of the config.json at `path`, stating `dtype_name` (``float32``, ``bfloat16``,
    ...) wherever it states a dtype (sub-configs of composite models too), or adding ``dtype``:
    a bf16 run's config says bfloat16, and an fp32 consolidation loaded by it would silently
    come back in bf16."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise CorruptFileError(path, f"not a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise CorruptFileError(path, "not a JSON object")
    if not _set_dtype(config, dtype_name):
        config["dtype"] = dtype_name
    return json.dumps(config, indent=2) + "\n"


def _set_dtype(node: Any, dtype_name: str) -> bool:
    found = False
    if isinstance(node, dict):
        for key, value in node.items():
            if key in DTYPE_KEYS and (value is None or isinstance(value, str)):
                node[key] = dtype_name
                found = True
            elif isinstance(value, dict):
                found = _set_dtype(value, dtype_name) or found
    return found

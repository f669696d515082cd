"""Hugging Face layout names: weights files, their index, and the files `from_pretrained` reads."""

from __future__ import annotations

import json
import os
from typing import Any

from ..core.errors import CheckpointNotFoundError, CorruptFileError
from ..core.index import Segment, TensorSource
from ..core.untrusted import path_component, regular_file_inside
from ..io.reading import read_json_object
from .safetensors import read_header

SAFETENSORS_PATTERN = "model{suffix}.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_PATTERN = "pytorch_model{suffix}.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
CONFIG_FILE = "config.json"
# the keys a config names its weights' dtype by: transformers 5 writes "dtype", 4.x "torch_dtype"
# (5 still reads it); loading with dtype="auto" (5's default) takes the weights in that dtype
DTYPE_KEYS = ("dtype", "torch_dtype")
# What PEFT's save_pretrained writes (peft.utils.constants): the adapter's config and weights
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_TORCH = "adapter_model.bin"
ADAPTER_README = "README.md"  # PEFT's model card, written beside the adapter

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


def files_to_copy(folder: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The files among `names` that input folder `folder` holds, to copy along byte for byte:
    regular files inside it (links that stay inside, or into the hub cache's blobs/, included).
    A link leading out of it is refused (UnsafePathError), never copied: a checkpoint's
    ``tokenizer.json -> ~/.ssh/id_rsa`` would otherwise put the key into the output."""
    return tuple(p for n in names if regular_file_inside(p := os.path.join(folder, n), folder))


def config_with_dtype(path: str, dtype_name: str) -> str:
    """The text of the config.json at `path`, stating `dtype_name` (``float32``, ``bfloat16``,
    ...) wherever it states a dtype (sub-configs of composite models too), or adding ``dtype``:
    a bf16 run's config says bfloat16, and an fp32 consolidation loaded by it would silently
    come back in bf16."""
    config = read_json_object(path, "config")
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


# The files of a PEFT adapter folder besides its weights: the config and model card PEFT writes,
# and the tokenizer/processor files the Trainer saves beside them. Not the base model's
# config.json or generation_config.json: they describe the base, not the adapter.
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_README) + tuple(
    n for n in MODEL_FILES if n not in (CONFIG_FILE, "generation_config.json")
)


def model_weights(folder: str) -> list[tuple[str, TensorSource]]:
    """Every tensor of a Hugging Face model folder's safetensors weights (``model.safetensors``,
    or the shards its ``model.safetensors.index.json`` names), in file and offset order, as
    sources in those files: nothing is read but the headers."""
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    single = os.path.join(folder, SAFETENSORS_PATTERN.format(suffix=""))
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(index_path, f"not a weights index ({exc})") from None
        for name in files:  # shards are read beside the index, never elsewhere
            path_component(name, index_path, "shard name")
    elif os.path.isfile(single):
        weight_map, files = None, [os.path.basename(single)]
    else:
        held = (
            sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".safetensors")))
            if os.path.isdir(folder)
            else []
        )
        problem = (
            f"holds {', '.join(held)}; only safetensors weights are read"
            if held
            else f"no {os.path.basename(single)} or {SAFETENSORS_INDEX}"
        )
        raise CheckpointNotFoundError(folder, f"not a Hugging Face model folder: {problem}")
    tensors: list[tuple[str, TensorSource]] = []
    for name in files:
        path = os.path.join(folder, name)
        header = read_header(path)
        for t in header.tensors:
            if weight_map is not None and weight_map.get(t.name) != name:
                raise CorruptFileError(path, f"holds {t.name}, which {SAFETENSORS_INDEX} does not map to it")
            segments = (Segment(path, header.data_start + t.begin, t.numel),) if t.numel else ()
            tensors.append((t.name, TensorSource(t.dtype, t.shape, segments)))
    if weight_map is not None and (missing := sorted(set(weight_map) - {n for n, _ in tensors})):
        raise CorruptFileError(index_path, f"maps {missing[0]} to {weight_map[missing[0]]}, which does not hold it")
    return tensors

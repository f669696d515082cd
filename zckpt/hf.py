"""Hugging Face layout names: weights files, their index, and the files `from_pretrained` reads."""

from __future__ import annotations

SAFETENSORS_PATTERN = "model{suffix}.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_PATTERN = "pytorch_model{suffix}.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

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

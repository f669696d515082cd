"""The params a ZeRO-3 NVMe plan is given (:mod:`zckpt.ops.nvme_plan`), read from MODEL: a
Hugging Face ``config.json`` (shapes computed as transformers builds them, no transformers
needed), a zckpt-readable checkpoint, or weights. Reading only: the planner works on the
:class:`ParamShape` list this returns.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import CorruptFileError, UsageError
from ..deepspeed import names as N
from ..io.reading import read_json_object


@dataclass(frozen=True)
class ParamShape:
    """One parameter as ZeRO-3 sees it: trainable ones get an optimizer partition, frozen ones do not."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_DECODERS = ("llama", "mistral", "qwen2", "qwen3")


def shapes_from_hf_config(config: dict[str, Any], path: str = "config.json") -> list[ParamShape]:
    """The params a Hugging Face model of this config creates, in creation order, without
    transformers: the Llama/Mistral/Qwen2/Qwen3 decoder family and GPT-2. Tied embeddings are one param."""
    model_type = config.get("model_type")
    try:
        if model_type in _DECODERS:
            return _decoder_shapes(config, model_type)
        if model_type == "gpt2":
            return _gpt2_shapes(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFileError(path, f"model_type {model_type!r} config lacks a usable {exc}") from None
    raise UsageError(
        path,
        f"model_type {model_type!r} is not supported; supported: {', '.join(_DECODERS)}, gpt2 "
        "(pass a checkpoint or a weights folder of the model instead)",
    )


def _decoder_shapes(c: dict[str, Any], model_type: str) -> list[ParamShape]:
    hidden, vocab, inter = int(c["hidden_size"]), int(c["vocab_size"]), int(c["intermediate_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    attn_bias = bool(c.get("attention_bias", model_type == "qwen2"))  # Qwen2: q/k/v biases, no o_proj bias
    mlp_bias = bool(c.get("mlp_bias", False))
    out: list[ParamShape] = [ParamShape("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(int(c["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for proj, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            out.append(ParamShape(f"{p}self_attn.{proj}.weight", (rows, hidden)))
            if attn_bias:
                out.append(ParamShape(f"{p}self_attn.{proj}.bias", (rows,)))
        out.append(ParamShape(f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim)))
        if attn_bias and model_type != "qwen2":
            out.append(ParamShape(f"{p}self_attn.o_proj.bias", (hidden,)))
        if model_type == "qwen3":
            out += [
                ParamShape(f"{p}self_attn.q_norm.weight", (head_dim,)),
                ParamShape(f"{p}self_attn.k_norm.weight", (head_dim,)),
            ]
        for proj, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            out.append(ParamShape(f"{p}mlp.{proj}.weight", shape))
            if mlp_bias:
                out.append(ParamShape(f"{p}mlp.{proj}.bias", (shape[0],)))
        out += [
            ParamShape(f"{p}input_layernorm.weight", (hidden,)),
            ParamShape(f"{p}post_attention_layernorm.weight", (hidden,)),
        ]
    out.append(ParamShape("model.norm.weight", (hidden,)))
    if not c.get("tie_word_embeddings", False):  # False is these configs' default
        out.append(ParamShape("lm_head.weight", (vocab, hidden)))
    return out


def _gpt2_shapes(c: dict[str, Any]) -> list[ParamShape]:
    d, vocab, positions = int(c["n_embd"]), int(c["vocab_size"]), int(c.get("n_positions", 1024))
    inner = int(c.get("n_inner") or 4 * d)
    out = [ParamShape("transformer.wte.weight", (vocab, d)), ParamShape("transformer.wpe.weight", (positions, d))]
    for i in range(int(c["n_layer"])):
        p = f"transformer.h.{i}."
        out += [
            ParamShape(f"{p}ln_1.weight", (d,)),
            ParamShape(f"{p}ln_1.bias", (d,)),
            ParamShape(f"{p}attn.c_attn.weight", (d, 3 * d)),
            ParamShape(f"{p}attn.c_attn.bias", (3 * d,)),
            ParamShape(f"{p}attn.c_proj.weight", (d, d)),
            ParamShape(f"{p}attn.c_proj.bias", (d,)),
            ParamShape(f"{p}ln_2.weight", (d,)),
            ParamShape(f"{p}ln_2.bias", (d,)),
            ParamShape(f"{p}mlp.c_fc.weight", (d, inner)),
            ParamShape(f"{p}mlp.c_fc.bias", (inner,)),
            ParamShape(f"{p}mlp.c_proj.weight", (inner, d)),
            ParamShape(f"{p}mlp.c_proj.bias", (d,)),
        ]
    out += [ParamShape("transformer.ln_f.weight", (d,)), ParamShape("transformer.ln_f.bias", (d,))]
    if not c.get("tie_word_embeddings", True):
        out.append(ParamShape("lm_head.weight", (vocab, d)))
    return out


# GPT-2 checkpoints written by old transformers hold these causal-mask buffers beside the weights
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class LoadedModel:
    params: tuple[ParamShape, ...]
    kind: str  # "checkpoint" | "weights" | "hf_config"
    world_size: int | None = None  # a checkpoint's
    dtype: str | None = None  # a checkpoint's training dtype
    notes: tuple[str, ...] = field(default=())


def load_params(path: str | os.PathLike[str]) -> LoadedModel:
    """The params of MODEL: a Hugging Face ``config.json`` (or a folder holding only that), a
    zckpt-readable checkpoint, or weights (safetensors/torch file, ``.index.json`` or their folder)."""
    from ..deepspeed.reader import open_checkpoint
    from .classify import classify
    from .tensor_sources import open_tensors

    path = os.fspath(path)
    found = classify(path)
    config_json = path if path.endswith(".json") and not path.endswith(".index.json") else None
    if (
        config_json is None
        and os.path.isdir(path)
        and not found.is_checkpoint
        and _holds_no_weights(path)
        and os.path.isfile(os.path.join(path, "config.json"))
    ):
        config_json = os.path.join(path, "config.json")
    if config_json is not None:
        config = read_json_object(config_json, "model config")
        note = (
            "shapes computed from config.json: every param counted as trainable (a PEFT run trains far fewer; "
            "pass its checkpoint for exact optimizer sizes)"
        )
        return LoadedModel(tuple(shapes_from_hf_config(config, config_json)), "hf_config", notes=(note,))
    if (
        found.is_checkpoint or os.path.basename(path) == N.LATEST_FILE
    ):  # any file named latest, as nvme-plan always took it
        index = open_checkpoint(os.path.dirname(path) if os.path.basename(path) == N.LATEST_FILE else path)
        params = tuple(
            ParamShape(e.name, e.source.shape, e.kind == "param")
            for e in index.entries
            if e.kind in ("param", "frozen")
        )
        return LoadedModel(params, "checkpoint", index.world_size, index.dtype.short, index.notes)
    found = open_tensors(path)
    if found.is_checkpoint:
        index = open_checkpoint(path)
        params = tuple(
            ParamShape(e.name, e.source.shape, e.kind == "param")
            for e in index.entries
            if e.kind in ("param", "frozen")
        )
        return LoadedModel(params, "checkpoint", index.world_size, index.dtype.short, index.notes)
    seen: set = set()
    params_list, skipped = [], []
    for name, source in found.tensors.items():
        if name.endswith(_BUFFER_SUFFIXES):
            skipped.append(name)
            continue
        if source.segments and source.segments in seen:  # a tied alias saved twice (torch files)
            continue
        seen.add(source.segments)
        params_list.append(ParamShape(name, source.shape))
    notes = ["weights: every tensor counted as a trainable param"]
    if skipped:
        notes.append(f"{len(skipped)} causal-mask buffers ({skipped[0]}, ...) left out")
    return LoadedModel(tuple(params_list), "weights", notes=tuple(notes))


def _holds_no_weights(folder: str) -> bool:
    return not any(n.endswith((".safetensors", ".bin", ".pt", ".index.json")) for n in os.listdir(folder))

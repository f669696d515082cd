"""A small GPT language model (nanoGPT's shape) and the JSON config that rebuilds it.

The trainer saves ``model_config.json`` beside every checkpoint, so anyone (DeepSpeed, a plain
torch script) gets the very same ``nn.Module`` with :func:`build_model` and can load the weights
by name. Parameters are created in state-dict order, which is also the order DeepSpeed's
``zero.Init`` numbers them in (``ds_id``): the trainer's sub-group file names then agree with it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CorruptFileError, UsageError
from ..core.index import TRAINER_MODEL_CONFIG as MODEL_CONFIG_FILE
from ..core.index import TRAINER_MODEL_TYPE


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 2
    dim: int = 64
    heads: int = 4
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "layers", "dim", "heads"):
            if getattr(self, name) < 1:
                raise UsageError(None, f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise UsageError(None, f"--dim {self.dim} is not a multiple of --heads {self.heads}")

    def to_json(self) -> str:
        return json.dumps({"model_type": TRAINER_MODEL_TYPE, **asdict(self)}, indent=2) + "\n"


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.proj = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks, a final norm and an lm head
    (tied to the token embedding with ``tie_embeddings``: one param, two state-dict names)."""

    def __init__(self, config: GPTConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.dim)
        self.wpe = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's init (normal 0.02, residual projections scaled by depth): with `seed`, each
        param from its own generator (:func:`initial_value` gives the same values one param at
        a time); without, from torch's global RNG."""
        for index, (name, param) in enumerate(self.named_parameters()):
            _init(param, name, self.config.layers, _generator(seed, index))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when `targets` are given."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def load_model_config(source: GPTConfig | dict[str, Any] | str | os.PathLike[str]) -> GPTConfig:
    """A GPTConfig from itself, a dict, a ``model_config.json`` or a checkpoint folder holding one."""
    if isinstance(source, GPTConfig):
        return source
    if isinstance(source, dict):
        known = {f.name for f in fields(GPTConfig)}
        return GPTConfig(**{k: v for k, v in source.items() if k in known})
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, MODEL_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise CorruptFileError(
            path, "no such model config (the trainer writes model_config.json beside its checkpoints)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CorruptFileError(path, f"not a readable JSON model config: {exc}") from None
    if not isinstance(data, dict) or data.get("model_type") != TRAINER_MODEL_TYPE:
        raise CorruptFileError(path, f"not a zckpt model config (model_type is not {TRAINER_MODEL_TYPE})")
    return load_model_config(data)


def build_model(source: GPTConfig | dict[str, Any] | str | os.PathLike[str], seed: int | None = None) -> GPT:
    """The GPT a config describes; with `seed`, its init is a function of the seed alone."""
    config = load_model_config(source)
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(config, seed)


def build_empty_model(source: GPTConfig | dict[str, Any] | str | os.PathLike[str]) -> GPT:
    """The GPT's modules with params on the meta device (shapes, no memory): what the ZeRO-3
    trainer shards, with :func:`initial_value` giving one param's values at a time."""
    with torch.device("meta"):
        return GPT(load_model_config(source))


def initial_value(config: GPTConfig, index: int, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Param `index` (``named_parameters`` order) of ``build_model(config, seed)``, alone."""
    value = torch.empty(shape)
    _init(value, name, config.layers, _generator(seed, index))
    return value


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Param `index`'s own random stream (None: torch's global one)."""
    return None if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + index)


@torch.no_grad()
def _init(param: torch.Tensor, name: str, layers: int, generator: torch.Generator | None) -> None:
    if name.endswith("bias"):
        param.zero_()
    elif param.dim() == 1:  # LayerNorm weights
        param.fill_(1.0)
    else:
        std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
        param.normal_(0.0, std, generator=generator)

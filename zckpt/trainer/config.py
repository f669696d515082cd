"""The trainer's options, checked before anything runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.errors import UsageError
from .devices import check_device_choice
from .model import GPTConfig

DTYPES = ("fp32", "bf16", "fp16")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(None, f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class TrainConfig:
    out: str | None = None  # checkpoint folder (None: no checkpoints)
    steps: int = 20
    save_every: int = 0  # 0: save once, at the end (when `out` is set)
    layers: int = 2
    dim: int = 64
    heads: int = 4
    vocab: int = 256
    seq_len: int = 64
    micro_batch: int = 4  # sequences per rank per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    warmup: int = 0
    clip: float = 1.0  # 0: no clipping
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    dtype: str = "fp32"
    tie_embeddings: bool = False
    freeze: str | None = None  # a regex of param names
    sub_group_size: int = 1_000_000_000  # as DeepSpeed's: 0 makes a sub-group of each param
    nvme_path: str | None = None  # NVMe offload: swap folder root, DeepSpeed's layout
    nvme_params: bool = False  # the param shares too (DeepSpeed's offload_param: nvme), not only the optimizer
    bounded_memory: bool = False  # glibc unmaps freed big blocks: memory bounded, steps slower
    resume: str | None = None
    seed: int = 0
    data: str | None = None
    device: str = "auto"  # auto: the rank's GPU when torch sees CUDA (nccl), else CPU (gloo)

    def __post_init__(self) -> None:
        check_device_choice(self.device)
        check_dtype(self.dtype)
        for name in ("steps", "micro_batch", "grad_accum"):  # sub_group_size: read with the run's ds_config (Trainer)
            if getattr(self, name) < 1:
                raise UsageError(None, f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("save_every", "warmup", "seed"):
            if getattr(self, name) < 0:
                raise UsageError(None, f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if not self.lr > 0 or self.clip < 0 or self.weight_decay < 0:
            raise UsageError(None, "--lr must be positive, --clip and the weight decay not negative")
        if self.save_every and not self.out:
            raise UsageError(None, "--save-every needs --out (where checkpoints go)")
        if self.nvme_path is not None and os.path.exists(self.nvme_path) and not os.path.isdir(self.nvme_path):
            raise UsageError(self.nvme_path, "--nvme-path must be a folder (the swap files go in it)")
        if self.nvme_params and self.nvme_path is None:
            raise UsageError(None, "--nvme-params needs --nvme-path (where the param swap files go)")
        if self.resume is not None and not os.path.exists(self.resume):
            raise UsageError(self.resume, "--resume: no such checkpoint")
        self.model_config()  # shape checks

    def model_config(self) -> GPTConfig:
        return GPTConfig(self.vocab, self.seq_len, self.layers, self.dim, self.heads, self.tie_embeddings)

#!/usr/bin/env python3
"""A DeepSpeed ZeRO checkpoint of any size, written without holding the model: the cost-curve
benchmark's input (issue 21).

The model is ``zckpt train``'s GPT (``zckpt.trainer.model``; the same names, shapes, param groups
and tied head DeepSpeed saves for it, see ``scripts/ds_train_gpt.py``), sized by its width and
depth. Its training state is synthetic: every fp32 master and ``exp_avg`` streams from one 64 MiB
file of normal(0, 0.02) float32 values, every ``exp_avg_sq`` from one of their squares, each tensor
starting at its own offset and wrapping around. zckpt's own writer (``plan_checkpoint`` +
``write_checkpoint``, what ``reshard`` and the trainer write with) lays it out as DeepSpeed 0.19.8
would for the world size and ZeRO stage asked, 16-bit module weights rounded from the masters, in
bounded memory whatever the size.

Usage::

    python scripts/synthetic_ckpt.py OUT --params 0.4e9 --stage 3 --world-size 2   # ~5.6 GB at bf16
    python scripts/synthetic_ckpt.py OUT --layers 2 --dim 64 --vocab 256 --stage 2 --world-size 2
    python scripts/synthetic_ckpt.py OUT --block llama --layers 80 --dim 64 --vocab 256 --world-size 64

``--block llama`` lays out Llama's param list instead (Hugging Face's names, 9 params per layer:
Llama-2-70B's 80 layers make 723), for the rank-axis benchmark. ``--params`` picks GPT-2-like shapes (vocabulary 50304, heads of 64, depth and width from the
table in :data:`SIZES` or the nearest below) and prints them. ``OUT`` gets ``latest``, the tag
folder ``global_step1000``, ``model_config.json`` and ``ds_config.json`` (what ``ds_train_gpt.py``
builds the model and the engine from: DeepSpeed then saves the same files, see
``tests/test_interop/test_interop_synthetic.py``), plus ``synthetic.json`` (shapes, params, bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zckpt.core.dtypes import FP32  # noqa: E402
from zckpt.core.index import CheckpointIndex, Entry, Segment, TensorSource  # noqa: E402
from zckpt.core.state import ParamGroupState, ParamState, ScalarState, TrainingState  # noqa: E402
from zckpt.deepspeed import engine_config as E  # noqa: E402
from zckpt.deepspeed.save import write_checkpoint  # noqa: E402
from zckpt.deepspeed.writer import plan_checkpoint, plan_target  # noqa: E402
from zckpt.torchfile.pickler import Inline, OutTensor  # noqa: E402
from zckpt.trainer.model import GPTConfig, build_empty_model  # noqa: E402
from zckpt.trainer.optim import param_group_defaults  # noqa: E402
from zckpt.trainer.zero3 import DECAY, plan_zero3  # noqa: E402

NOISE_ELEMENTS = 16 * 2**20  # 64 MiB of float32
STEPS = 1000
LR = 3e-4
# (dim, layers) at vocabulary 50304 and sequence 1024: 12 * layers * dim^2 + (50304 + 1024) * dim params
# 0.02e9: a smoke test; 2.4e9: the largest whose reshard output fits beside it on a 76 GB disk
SIZES = {0.02e9: (256, 4), 0.4e9: (1024, 28), 1.2e9: (1536, 40), 2.4e9: (2304, 36), 3e9: (2560, 36)}


def gpt_config(params: float | None, layers: int, dim: int, vocab: int, seq_len: int) -> GPTConfig:
    """GPT-2-like shapes for about `params` params (tied head), or the shapes given."""
    if params is not None:
        size = max((s for s in SIZES if s <= params * 1.05), default=min(SIZES))
        dim, layers = SIZES[size]
        vocab, seq_len = 50304, 1024
    return GPTConfig(vocab=vocab, seq_len=seq_len, layers=layers, dim=dim, heads=max(1, dim // 64), tie_embeddings=True)


class _LlamaLayer(nn.Module):
    """A Llama decoder layer's params (Hugging Face's names; no biases; grouped k/v heads)."""

    def __init__(self, dim: int, kv_dim: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(dim, dim, bias=False),
                "k_proj": nn.Linear(dim, kv_dim, bias=False),
                "v_proj": nn.Linear(dim, kv_dim, bias=False),
                "o_proj": nn.Linear(dim, dim, bias=False),
            }
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(dim, ffn, bias=False),
                "up_proj": nn.Linear(dim, ffn, bias=False),
                "down_proj": nn.Linear(ffn, dim, bias=False),
            }
        )
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.empty(dim))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.empty(dim))


def llama_style_model(layers: int, dim: int, vocab: int) -> nn.Module:
    """Llama's param list at `layers` x `dim` on the meta device: per layer q/k/v/o, gate/up/down
    and two norms (9 params), plus the embedding, the final norm and an untied head; k/v at a
    quarter of the width (grouped heads) and the MLP at 8/3 of it, as Llama-2-70B's 80 layers
    (723 params) are shaped. The rank-axis benchmark's 70B-class param list, at tiny widths."""
    with torch.device("meta"):
        model = nn.Module()
        model.model = nn.Module()
        model.model.embed_tokens = nn.Embedding(vocab, dim)
        model.model.layers = nn.ModuleList(_LlamaLayer(dim, max(1, dim // 4), dim * 8 // 3) for _ in range(layers))
        model.model.norm = nn.Module()
        model.model.norm.weight = nn.Parameter(torch.empty(dim))
        model.lm_head = nn.Linear(dim, vocab, bias=False)
    return model


def noise_files(folder: Path) -> tuple[str, str]:
    """(masters and exp_avg, exp_avg_sq): float32 files the sources wrap around, made once."""
    folder.mkdir(parents=True, exist_ok=True)
    values, squares = folder / "noise_fp32.bin", folder / "noise_sq_fp32.bin"
    if not (values.is_file() and values.stat().st_size == 4 * NOISE_ELEMENTS):
        noise = (np.random.default_rng(1234).standard_normal(NOISE_ELEMENTS) * 0.02).astype(np.float32)
        noise.tofile(values)
        (noise * noise).tofile(squares)
    return str(values), str(squares)


def wrapped(path: str, numel: int, start: int) -> TensorSource:
    """`numel` float32 elements of the noise file at `path` from element `start`, wrapping around."""
    segments = []
    position, left = start % NOISE_ELEMENTS, numel
    while left:
        length = min(left, NOISE_ELEMENTS - position)
        segments.append(Segment(path, position * 4, length))
        left -= length
        position = 0
    return tuple(segments)


def synthetic_state(
    config: GPTConfig, world_size: int, dtype: str, noise: tuple[str, str], tag: str, block: str = "gpt"
) -> TrainingState:
    """The training state of `config`'s GPT (or, `block` "llama", of Llama's param list at its
    depth and width) after STEPS AdamW steps, its values from the noise files; laid out by zckpt's
    ZeRO-3 plan of the model (what the trainer saves)."""
    from zckpt.core.dtypes import BY_SHORT

    model = build_empty_model(config) if block == "gpt" else llama_style_model(config.layers, config.dim, config.vocab)
    plan = plan_zero3(model, world_size, sub_group_size=10**9)
    values, squares = noise
    entries: list[Entry] = []
    params: dict[str, ParamState] = {}
    start = 0
    for spec in plan.params:
        shape = tuple(spec.shape)
        master = TensorSource(FP32, shape, wrapped(values, spec.numel, start))
        exp_avg = TensorSource(FP32, shape, wrapped(values, spec.numel, start + 7919))
        exp_avg_sq = TensorSource(FP32, shape, wrapped(squares, spec.numel, start + 104729))
        start += spec.numel
        params[spec.name] = ParamState(
            spec.name, shape, plan.group_names.index(spec.group), master, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        )
        entries.append(Entry(spec.name, "param", master))
    sources = {e.name: e.source for e in entries}
    entries += [Entry(alias, "tied", sources[origin], alias_of=origin) for alias, origin in plan.tied.items()]
    out_dtype = BY_SHORT[dtype]
    index = CheckpointIndex(
        checkpoint_dir="",
        tag=tag,
        tag_dir=tag,
        tags=(tag,),
        zero_stage=3,
        world_size=world_size,
        dtype=out_dtype,
        ds_version=E.FORMAT_VERSION,
        offload="none",
        entries=tuple(entries),
    )
    groups = []
    for g, name in enumerate(plan.group_names):
        step = OutTensor(FP32, (), (Inline(np.float32(STEPS).tobytes()),))  # one per group, as torch's
        members = tuple(p.name for p in plan.layout.params if p.group == g)
        hyper = param_group_defaults(LR, (0.9, 0.95), 1e-8, 0.1 if name == DECAY else 0.0)
        # the groups ds_train_gpt.py gives torch ({"params", "weight_decay"}; torch adds the rest after)
        hyper = {"weight_decay": hyper["weight_decay"], **{k: v for k, v in hyper.items() if k != "weight_decay"}}
        groups.append(
            ParamGroupState(hyper, {"step": ScalarState(value=step)}, members, ("step", "exp_avg", "exp_avg_sq"))
        )
    ds_config = E.engine_config(
        micro_batch=1,
        grad_accum=1,
        world_size=world_size,
        dtype=dtype,
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        clip=1.0,
        sub_group_size=10**9,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 10}},
    )
    return TrainingState(
        index=index,
        params=tuple(params[p.name] for p in plan.layout.params),
        groups=tuple(groups),
        module_names=plan.module_names,
        module_dtype_names={name: dtype for name in plan.module_names},
        lr_scheduler=E.scheduler_state(STEPS),
        global_steps=STEPS,
        global_samples=STEPS * world_size,
        skipped_steps=0,
        ds_config=ds_config,
        optimizer_extras=E.optimizer_extras(dtype == "fp16"),
    )


def write_synthetic(
    out: Path,
    config: GPTConfig,
    world_size: int,
    stage: int,
    dtype: str,
    noise_dir: Path,
    overwrite: bool = False,
    block: str = "gpt",
) -> dict[str, Any]:
    """Write the checkpoint into `out`; returns what ``synthetic.json`` records."""
    tag = f"global_step{STEPS}"
    state = synthetic_state(config, world_size, dtype, noise_files(noise_dir), tag, block)
    started = time.perf_counter()
    plan = plan_checkpoint(state, plan_target(state, world_size, stage=stage), tag)
    result = write_checkpoint(plan, str(out), overwrite=overwrite)
    seconds = time.perf_counter() - started
    model_config = {"model_type": "zckpt-gpt", **{k: getattr(config, k) for k in config.__dataclass_fields__}}
    if block == "llama":  # not a model ds_train_gpt.py builds: the param list only
        model_config = {"model_type": "llama-style", "layers": config.layers, "dim": config.dim, "vocab": config.vocab}
    (out / "model_config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    # the config the run had: what scripts/ds_train_gpt.py gives DeepSpeed to make the same layout
    (out / "ds_config.json").write_text(json.dumps(plan.target.ds_config, indent=2) + "\n")
    params = sum(math.prod(p.shape) for p in state.params)
    facts = {
        "model": model_config,
        "params": params,
        "world_size": world_size,
        "stage": stage,
        "dtype": dtype,
        "tag": tag,
        "files": len(result.files),
        "bytes": result.bytes_written,
        "write_seconds": round(seconds, 2),
    }
    (out / "synthetic.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--params", type=float, help="about this many params (GPT-2-like shapes)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--noise-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "zckpt_noise")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument(
        "--block",
        choices=("gpt", "llama"),
        default="gpt",
        help="gpt: zckpt train's GPT; llama: Llama's param list (9 per layer, no biases, untied head)",
    )
    args = ap.parse_args(argv)
    config = gpt_config(args.params, args.layers, args.dim, args.vocab, args.seq_len)
    facts = write_synthetic(
        args.out, config, args.world_size, args.stage, args.dtype, args.noise_dir, args.overwrite, args.block
    )
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Regenerate the pipeline-parallel DeepSpeed fixtures under ``sample_ckpts/`` (``pp*`` cases).

Like ``make_sample_ckpts.py``, one file is both the driver (stdlib only: launches
``python -m torch.distributed.run`` with the DeepSpeed venv's python, removes the DeepSpeed code
copied into the checkpoint folder, records what DeepSpeed's own ``zero_to_fp32`` does with the
result, writes ``meta.json``) and the per-rank worker (``--worker``): a seeded ``PipelineModule``
trained a few steps with real DeepSpeed (CPU, gloo), its live values captured, then saved.

The model, in pipeline layers (partitioned uniformly over the stages)::

    0  TiedLayerSpec("embed", Embedding(23, 16))        stage 0
    1  Block: LayerNorm(16), Linear(16, 12), Linear(12, 16), buffer `scale`
    2  Frozen: Linear(16, 16) with requires_grad=False
    3  tanh (a function: no state, no layer file)      stage 1
    4  Block
    5  TiedLayerSpec("embed", forward_fn=head): logits = h @ embed.weight.T

Stage 1 keeps its own copy of the tied embedding (DeepSpeed all-reduces its gradient between the
stages), so both stages' files hold ``tied_modules.embed.weight``.

Live truth per stage (``reference/live_stage{S}.safetensors``, written by the stage's data rank 0):
every param under ``engine.module.named_parameters()`` names, trainable ones as
``safe_get_full_fp32_param`` (the stage's fp32 master, gathered over its data-parallel group),
frozen ones and buffers as held. ``reference/live.safetensors`` is their union (the tied weight
once, after checking the stages hold the same bits): the state dict of the model built as one
stage, which is what ``zckpt consolidate`` must write.

Usage::

    python scripts/make_parallel_ckpts.py                  # every case
    python scripts/make_parallel_ckpts.py --only pp2_z1_fp32_dp1
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_sample_ckpts import cpu_env, run, run_workers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PY = str(REPO / ".venv-interop" / "bin" / "python")
SEED = 4321
MICRO_BATCH = 2
SEQ_LEN = 5
VOCAB = 23
DIM = 16
HIDDEN = 12


@dataclass(frozen=True)
class Case:
    name: str
    stage: int  # ZeRO stage (pipeline runs: 0 or 1)
    dtype: str  # fp32 | bf16
    pp: int
    dp: int
    steps: int = 3
    grad_accum: int = 2  # micro-batches per step (the pipeline's schedule)
    ep: int = 0  # expert-parallel degree of a mixture-of-experts case (0: a pipeline case)
    experts: int = 4
    tp: int = 0  # AutoTP degree of a tensor-parallel case
    mtp: int = 0  # tensor-parallel degree of a Megatron-style case (an mpu, merge patterns)
    plain: bool = False  # a pipeline case without tied or frozen layers (a Block and an untied head instead)
    tied: bool = False  # a pipeline x tensor case whose head is the embedding (TiedLayerSpec across stages)
    coupled_wd: bool = False  # torch Adam with L2 weight decay (added to the gradient) instead of AdamW

    @property
    def kind(self) -> str:
        if self.mtp:
            return "pipeline_megatron" if self.pp > 1 else "megatron"
        return "moe" if self.ep else "autotp" if self.tp else "pipeline"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * max(self.tp, self.mtp, 1)


CASES = [
    Case("pp2_z1_fp32_dp1", 1, "fp32", pp=2, dp=1),
    Case("pp2_z1_bf16_dp2", 1, "bf16", pp=2, dp=2),
    Case("moe_z2_fp32_ep2_dp2", 2, "fp32", pp=1, dp=2, ep=2, grad_accum=1),
    Case("moe_z1_bf16_ep2_dp4", 1, "bf16", pp=1, dp=4, ep=2, grad_accum=1),
    Case("autotp_z1_fp32_tp2", 1, "fp32", pp=1, dp=1, tp=2, grad_accum=1),
    Case("autotp_z2_bf16_tp2_dp2", 2, "bf16", pp=1, dp=2, tp=2, grad_accum=1),
    Case("megatron_z1_fp32_tp2", 1, "fp32", pp=1, dp=1, mtp=2, grad_accum=1),
    Case("megatron_z2_bf16_tp2_dp2", 2, "bf16", pp=1, dp=2, mtp=2, grad_accum=1),
    Case("autotp_z3_bf16_tp2_dp2", 3, "bf16", pp=1, dp=2, tp=2, grad_accum=1),
    Case("megatron_z3_fp32_tp2_dp2", 3, "fp32", pp=1, dp=2, mtp=2, grad_accum=1),
    Case("pp2_megatron_z1_fp32_tp2", 1, "fp32", pp=2, dp=1, mtp=2),
    Case("moe_z0_fp32_ep2_dp2", 0, "fp32", pp=1, dp=2, ep=2, grad_accum=1),
    Case("moe_z0_bf16_ep2_dp2", 0, "bf16", pp=1, dp=2, ep=2, grad_accum=1),
    Case("megatron_z0_fp32_tp2", 0, "fp32", pp=1, dp=1, mtp=2, grad_accum=1),
    Case("pp2_z0_fp32_dp2_untied", 0, "fp32", pp=2, dp=2, plain=True),
    Case("pp2_megatron_z1_bf16_tp2_tied", 1, "bf16", pp=2, dp=1, mtp=2, tied=True),
    # the same run with coupled weight decay: the head's stage's copy of the tied LayerNorm, which no
    # gradient reaches, gets nonzero moments there (the decay is its gradient)
    Case("pp2_megatron_z1_bf16_tp2_tied_adam_coupled_wd", 1, "bf16", pp=2, dp=1, mtp=2, tied=True, coupled_wd=True),
]


def ds_config(case: Case) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": case.grad_accum,
        "train_batch_size": MICRO_BATCH * case.grad_accum * case.dp,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": case.stage},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if case.coupled_wd:  # torch.optim.Adam: the decay added to the gradient (adam_w_mode false)
        config["optimizer"]["type"] = "Adam"
        config["optimizer"]["params"]["adam_w_mode"] = False
    if case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if case.tp:
        config["tensor_parallel"] = {"autotp_size": case.tp}
        del config["train_batch_size"]  # AutoTP checks it against every rank, tensor ones included
    return config


# --------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------
def build_pipeline(case: Case) -> Any:
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.relu(self.up(self.norm(h) * self.scale.to(h.dtype))))

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(DIM, DIM)
            for p in self.parameters():
                p.requires_grad_(False)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.proj(h)

    def head(embed: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ embed.weight.t()

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))

    layers = [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        LayerSpec(Block),
        LayerSpec(Frozen),
        torch.tanh,
        LayerSpec(Block),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head),
    ]
    if case.plain:
        layers = [LayerSpec(nn.Embedding, VOCAB, DIM), LayerSpec(Block), LayerSpec(Block), torch.tanh]
        layers += [LayerSpec(Block), LayerSpec(nn.Linear, DIM, VOCAB)]
    return PipelineModule(
        layers=layers, num_stages=case.pp, loss_fn=loss_fn, partition_method="uniform", base_seed=SEED
    )


def build_moe(case: Case) -> Any:
    """Embedding -> LayerNorm -> MoE (``case.experts`` MLP experts over ``case.ep`` ranks, top-1) ->
    head; a buffer. At ep 1 the experts' names are their global ids: the consolidated names."""
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class MoEModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.norm = nn.LayerNorm(DIM)
            expert = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
            self.moe = MoE(
                hidden_size=DIM, expert=expert, num_experts=case.experts, ep_size=case.ep, k=1, min_capacity=8
            )
            self.head = nn.Linear(DIM, VOCAB)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

        def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.embed(tokens)
            out, aux, _ = self.moe(self.norm(h) * self.scale.to(h.dtype))
            return self.head(h + out), aux

    return MoEModel()


def expert_global_name(name: str, param: Any, experts: int, ep: int) -> str:
    """An expert param's name at ep 1: its local expert id made global (DeepSpeed's rule, engine.py
    _save_moe_checkpoint: ep_rank * num_local_experts + local id)."""
    import re

    from deepspeed.utils import groups

    found = re.search(r"deepspeed_experts\.(\d+)\.", name)
    if found is None or getattr(param, "allreduce", True):
        return name
    local = experts // ep
    global_id = groups._get_expert_parallel_rank(param.group_name) * local + int(found[1])
    return name[: found.start(1)] + str(global_id) + name[found.end(1) :]


def moe_worker(case: Case, casedir: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = build_moe(case)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"}
    )
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(case))
    gen = torch.Generator().manual_seed(SEED + 1000 * rank)
    for _ in range(case.steps):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
        logits, aux = engine(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)) + 0.01 * aux
        engine.backward(loss)
        engine.step()
    live: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    # ZeRO off: an fp32 run's module params are the masters, its torch optimizer's state by param; a
    # 16-bit run's FP16_UnfusedOptimizer pairs each module param with its fp32 master
    zero_off = not case.stage
    masters: dict[int, Any] = {}
    if zero_off and case.dtype != "fp32":
        for group16, group32 in zip(engine.optimizer.fp16_groups, engine.optimizer.fp32_groups):
            masters.update({id(p16): p32 for p16, p32 in zip(group16, group32)})
    state = engine.optimizer.optimizer.state if masters else engine.optimizer.state if zero_off else {}
    for name, p in engine.module.named_parameters():  # every rank, same order: the collectives pair up
        master = masters.get(id(p), p)
        value = master.data if zero_off or not p.requires_grad else safe_get_full_fp32_param(p)
        global_name = expert_global_name(name, p, case.experts, case.ep)
        live[global_name] = value.detach().cpu().float().clone().contiguous()
        if zero_off and p.requires_grad:  # the torch optimizer's own state, by param (its master)
            for key in ("exp_avg", "exp_avg_sq"):
                optim[f"{global_name}.{key}"] = state[master][key].detach().cpu().clone().contiguous()
    for name, b in engine.module.named_buffers():
        live[name] = b.detach().cpu().clone().contiguous()
    ref = casedir / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    save_file(live, str(ref / f"live_rank{rank}.safetensors"), metadata={"format": "pt"})
    if optim:
        save_file(optim, str(ref / f"live_optimizer_rank{rank}.safetensors"), metadata={"format": "pt"})
    note = (
        "the torch optimizer's state of each param"
        if optim
        else "not captured (safe_get_full_optimizer_state needs linked fragments)"
    )
    save_and_describe(engine, casedir, note)


def build_llama(case: Case) -> Any:
    """A tiny seeded Hugging Face Llama (GQA: 4 query heads, 2 key/value heads), which AutoTP
    shards: q/k/v, gate/up by rows, o/down by columns, lm_head by vocabulary; norms and the
    embedding replicated."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def autotp_worker(case: Case, casedir: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_llama(case)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case))
    gen = torch.Generator().manual_seed(SEED + 1000 * (rank // case.tp))  # the tensor ranks of a replica see one batch
    for _ in range(case.steps):
        ids = torch.randint(0, 64, (MICRO_BATCH, 8), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    save_and_describe(engine, casedir, "the reference is ds_to_universal's merge (exact for AutoTP)")


MEGATRON_VOCAB = 23  # Megatron pads the vocabulary to a multiple of the tensor ranks (24 at tp 2)
QKV = (8, 4, 4)  # a fused query/key/value (grouped: fewer key/value rows), split per tensor rank


def padded_vocab(tp: int) -> int:
    return -(-MEGATRON_VOCAB // tp) * tp


def megatron_checkpoint_info(tp: int) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` a Megatron-DeepSpeed model saves as client state (its
    keys and pattern style, ``megatron/model/gpt_model.py``): how each param's slices merge."""
    widths = [[size // tp] * tp for size in QKV]
    return {
        "universal_checkpoint_version": 0.4,
        "vocabulary_parameter_patterns": [r"embed\.word_embeddings\.weight", r"lm_head\.weight"],
        "tp_replicated_parameter_patterns": [
            r"embed\.norm\.(weight|bias)",
            r"layers\.\d+\.input_layernorm\.(weight|bias)",
            r"layers\.\d+\.self_attention\.dense\.bias",
            r"layers\.\d+\.mlp\.dense_4h_to_h\.bias",
        ],
        "parameter_with_row_parallelism_patterns": [
            r"layers\.\d+\.self_attention\.dense\.weight",
            r"layers\.\d+\.mlp\.dense_4h_to_h\.weight",
        ],
        "parameter_with_2_sub_params_cat_dim_0": [r"layers\.0\.mlp\.dense_h_to_4h\.(weight|bias)"],
        "parameter_with_sub_params": [
            {
                "patterns": [r"layers\.\d+\.self_attention\.query_key_value\.weight"],
                "shape": (QKV, DIM),
                "partition_dim": 0,
            }
        ],
        "sub_param_shard_widths": {r"layers\.\d+\.self_attention\.query_key_value\.weight": widths},
        "original_vocab_size": MEGATRON_VOCAB,
        "padded_vocab_size": padded_vocab(tp),
    }


class MegatronMpu:
    """The model-parallel unit DeepSpeed takes from Megatron (``deepspeed.initialize(mpu=...)``):
    ranks [d*tp, d*tp + tp) are one replica's tensor ranks; rank r is data rank r // tp."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.tp_group = self.dp_group = None
        for d in range(self.dp):  # every rank creates every group, in one order
            group = dist.new_group(list(range(d * tp, d * tp + tp)))
            if d == self.dp_rank:
                self.tp_group = group
        for t in range(tp):
            group = dist.new_group(list(range(t, world, tp)))
            if t == self.tp_rank:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.tp_rank, self.tp * self.dp, self.tp))


def megatron_modules(tp: int, t: int, group: Any) -> Any:
    """The modules of a tiny Megatron-style GPT as tensor rank `t` of `tp` holds them (each its
    slices of full tensors drawn from ``draw.gen``, one seeded generator): a vocabulary-parallel
    embedding (``Embed``) and head (``Head``; vocabulary padded 23 -> 24), replicated LayerNorms,
    and ``Layer``s of a column-parallel fused QKV (grouped sub-params), row-parallel output
    projections and a SwiGLU (2 sub-params) or plain column-parallel ``dense_h_to_4h``."""
    import types

    import torch
    import torch.distributed as dist
    from torch import nn

    vocab = padded_vocab(tp)

    class CopyToTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad

    class ReduceFromTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    class GatherFromTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad.chunk(tp, dim=-1)[t].contiguous()

    draw = types.SimpleNamespace(gen=torch.Generator().manual_seed(SEED))

    def full(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=draw.gen) * 0.2

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(tp, dim=0)[t].clone()

    def cols(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(tp, dim=1)[t].clone()

    def sub_rows(tensor: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([rows(part) for part in tensor.split(list(sizes), dim=0)], dim=0)

    class RowParallel(nn.Module):
        """A row-parallel linear (its input dim split): the partial products summed over the
        tensor ranks, then the bias, replicated (a module of its own: ZeRO-3 gathers a module's
        params when its forward runs)."""

        def __init__(self, inputs: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(cols(full(DIM, inputs)))
            self.bias = nn.Parameter(full(DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ReduceFromTp.apply(nn.functional.linear(x, self.weight)) + self.bias

    class Layer(nn.Module):
        def __init__(self, swiglu: bool) -> None:
            super().__init__()
            self.swiglu = swiglu
            self.input_layernorm = nn.LayerNorm(DIM)
            self.self_attention = nn.Module()
            self.self_attention.query_key_value = nn.Linear(DIM, sum(QKV) // tp, bias=False)
            self.self_attention.query_key_value.weight.data = sub_rows(full(sum(QKV), DIM), QKV)
            self.self_attention.dense = RowParallel(QKV[1])
            self.mlp = nn.Module()
            up = 2 * HIDDEN if swiglu else HIDDEN
            self.mlp.dense_h_to_4h = nn.Linear(DIM, up // tp)
            weight, bias = full(up, DIM), full(up)
            self.mlp.dense_h_to_4h.weight.data = sub_rows(weight, (HIDDEN, HIDDEN)) if swiglu else rows(weight)
            self.mlp.dense_h_to_4h.bias.data = sub_rows(bias, (HIDDEN, HIDDEN)) if swiglu else rows(bias)
            self.mlp.dense_4h_to_h = RowParallel(HIDDEN)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            x = CopyToTp.apply(self.input_layernorm(h))
            q, k, v = self.self_attention.query_key_value(x).split([size // tp for size in QKV], dim=-1)
            mixed = q[..., : k.shape[-1]] * torch.sigmoid(k) + v
            h = h + self.self_attention.dense(mixed)
            x = CopyToTp.apply(h)
            up = self.mlp.dense_h_to_4h(x)
            if self.swiglu:
                gate, value = up.chunk(2, dim=-1)
                up = nn.functional.silu(gate) * value
            else:
                up = nn.functional.gelu(up)
            return h + self.mlp.dense_4h_to_h(up)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(vocab // tp, DIM)
            self.word_embeddings.weight.data = rows(full(vocab, DIM))
            self.norm = nn.LayerNorm(DIM)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            per_rank = vocab // tp
            local = tokens - t * per_rank
            outside = (local < 0) | (local >= per_rank)
            h = self.word_embeddings(local.masked_fill(outside, 0)) * (~outside).unsqueeze(-1)
            return self.norm(ReduceFromTp.apply(h))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(DIM, vocab // tp, bias=False)
            self.lm_head.weight.data = rows(full(vocab, DIM))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return logits(self.lm_head, h)

    def logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The vocabulary-parallel head's logits gathered over the tensor ranks, padding cut."""
        return GatherFromTp.apply(lm_head(CopyToTp.apply(h)))[..., :MEGATRON_VOCAB]

    return types.SimpleNamespace(draw=draw, Embed=Embed, Layer=Layer, Head=Head, logits=logits)


def build_megatron(case: Case, mpu: MegatronMpu) -> Any:
    """A tiny Megatron-style GPT (:func:`megatron_modules`) on ``case.mtp`` tensor ranks: the
    embedding, a SwiGLU layer, a plain one, the head."""
    from torch import nn

    parts = megatron_modules(mpu.tp, mpu.tp_rank, mpu.tp_group)

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = parts.Embed()
            self.layers = nn.ModuleList([parts.Layer(swiglu=True), parts.Layer(swiglu=False)])
            self.lm_head = parts.Head().lm_head  # Megatron's name, "lm_head.weight"

        def forward(self, tokens: Any) -> Any:
            h = self.embed(tokens)
            for layer in self.layers:
                h = layer(h)
            return parts.logits(self.lm_head, h)

    return Gpt()


def pipeline_megatron_patterns(tp: int) -> dict[str, Any]:
    """Megatron-DeepSpeed's merge patterns for the pipeline model's names (``<layer>.<name>``)."""
    widths = [[size // tp] * tp for size in QKV]
    qkv = r"\d+\.self_attention\.query_key_value\.weight"
    return {
        "universal_checkpoint_version": 0.4,
        "vocabulary_parameter_patterns": [
            r"0\.word_embeddings\.weight",
            r"\d+\.lm_head\.weight",
            r"tied_modules\.embed\.word_embeddings\.weight",
        ],
        "tp_replicated_parameter_patterns": [
            r"0\.norm\.(weight|bias)",
            r"tied_modules\.embed\.norm\.(weight|bias)",
            r"\d+\.input_layernorm\.(weight|bias)",
            r"\d+\.self_attention\.dense\.bias",
            r"\d+\.mlp\.dense_4h_to_h\.bias",
        ],
        "parameter_with_row_parallelism_patterns": [
            r"\d+\.self_attention\.dense\.weight",
            r"\d+\.mlp\.dense_4h_to_h\.weight",
        ],
        "parameter_with_2_sub_params_cat_dim_0": [r"1\.mlp\.dense_h_to_4h\.(weight|bias)"],
        "parameter_with_sub_params": [{"patterns": [qkv], "shape": (QKV, DIM), "partition_dim": 0}],
        "sub_param_shard_widths": {qkv: widths},
        "original_vocab_size": MEGATRON_VOCAB,
        "padded_vocab_size": padded_vocab(tp),
    }


def build_pipeline_megatron(case: Case) -> Any:
    """The Megatron-style GPT as a PipelineModule over a pipe x data x model topology (as
    Megatron-DeepSpeed builds GPTModelPipe): layer 0 the embedding, 1 a SwiGLU layer, 2 a plain
    one, 3 the head; each layer drawn from its own seed, so the stages agree on nothing but the
    layer index."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=case.pp, num_mp=case.mtp, num_dp=case.dp)
    grid = PipelineParallelGrid(topology=topology)
    parts = megatron_modules(case.mtp, grid.get_slice_parallel_rank(), grid.get_slice_parallel_group())

    def seeded(index: int) -> None:
        parts.draw.gen = torch.Generator().manual_seed(SEED + index)

    class EmbedPipe(parts.Embed):  # type: ignore[name-defined,misc]
        def __init__(self, index: int) -> None:
            seeded(index)
            super().__init__()

    class LayerPipe(parts.Layer):  # type: ignore[name-defined,misc]
        def __init__(self, index: int, swiglu: bool) -> None:
            seeded(index)
            super().__init__(swiglu)

    class HeadPipe(parts.Head):  # type: ignore[name-defined,misc]
        def __init__(self, index: int) -> None:
            seeded(index)
            super().__init__()

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, MEGATRON_VOCAB), labels.reshape(-1))

    def tied_head(embed: Any, h: torch.Tensor) -> torch.Tensor:
        """The last stage's use of the tied embedding: its vocabulary-parallel rows as the head (its
        LayerNorm, in that stage's copy too, takes no part: as Megatron-DeepSpeed's EmbeddingPipe's
        position embeddings in the last stage)."""
        return parts.logits(lambda x: torch.nn.functional.linear(x, embed.word_embeddings.weight), h)

    if case.tied:  # as Megatron-DeepSpeed's GPTModelPipe ties them: the tied weight its word embeddings
        tied = {"tied_weight_attr": "word_embeddings.weight"}
        first, last = (
            TiedLayerSpec("embed", EmbedPipe, 0, **tied),
            TiedLayerSpec("embed", EmbedPipe, 0, forward_fn=tied_head, **tied),
        )
    else:
        first, last = LayerSpec(EmbedPipe, 0), LayerSpec(HeadPipe, 3)
    layers = [first, LayerSpec(LayerPipe, 1, True), LayerSpec(LayerPipe, 2, False), last]
    return PipelineModule(layers=layers, topology=topology, loss_fn=loss_fn, partition_method="uniform")


def pipeline_megatron_worker(case: Case, casedir: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_pipeline_megatron(case)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case))
    stage, dp_rank, tp_rank = engine.stage_id, engine.grid.data_parallel_id, engine.grid.get_slice_parallel_rank()
    gen = torch.Generator().manual_seed(SEED + 1000 * dp_rank)  # a replica's tensor ranks see one batch

    def batches():  # type: ignore[no-untyped-def]
        while True:
            tokens = torch.randint(0, MEGATRON_VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
            yield tokens, torch.randint(0, MEGATRON_VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)

    data = batches()
    for _ in range(case.steps):
        engine.train_batch(data_iter=data)
    live, optim = {}, {}
    for name, p in engine.module.named_parameters():  # collective over the data-parallel group
        live[name] = safe_get_full_fp32_param(p).detach().cpu().float().clone().contiguous()
        for key in ("exp_avg", "exp_avg_sq") if case.tied else ():
            optim[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().float().clone().contiguous()
    if dp_rank == 0:
        ref = casedir / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(live, str(ref / f"live_stage{stage}_tp{tp_rank}.safetensors"), metadata={"format": "pt"})
        if optim:
            path = ref / f"live_optimizer_stage{stage}_tp{tp_rank}.safetensors"
            save_file(optim, str(path), metadata={"format": "pt"})
    dist.barrier()
    rules = {"universal_checkpoint_info": pipeline_megatron_patterns(case.mtp)}
    save_and_describe(engine, casedir, "not captured", rules)


def megatron_worker(case: Case, casedir: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = MegatronMpu(case.mtp)
    model = build_megatron(case, mpu)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(case), mpu=mpu
    )
    gen = torch.Generator().manual_seed(SEED + 1000 * mpu.dp_rank)  # a replica's tensor ranks see one batch
    for _ in range(case.steps):
        tokens = torch.randint(0, MEGATRON_VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
        labels = torch.randint(0, MEGATRON_VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
        logits = engine(tokens)
        engine.backward(
            torch.nn.functional.cross_entropy(logits.float().reshape(-1, MEGATRON_VOCAB), labels.reshape(-1))
        )
        engine.step()
    live, optim = {}, {}
    for name, p in engine.module.named_parameters():  # collective over the data-parallel group
        if not case.stage:  # ZeRO off: p is the master, the torch optimizer's state is by param
            live[name] = p.data.detach().cpu().float().clone().contiguous()
            for key in ("exp_avg", "exp_avg_sq"):
                optim[f"{name}.{key}"] = engine.optimizer.state[p][key].detach().cpu().float().clone().contiguous()
            continue
        live[name] = safe_get_full_fp32_param(p).detach().cpu().float().clone().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            optim[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().float().clone().contiguous()
    if mpu.dp_rank == 0:
        ref = casedir / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(live, str(ref / f"live_tp{mpu.tp_rank}.safetensors"), metadata={"format": "pt"})
        save_file(optim, str(ref / f"live_optimizer_tp{mpu.tp_rank}.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    rules = {"universal_checkpoint_info": megatron_checkpoint_info(case.mtp)}
    how = "the torch optimizer's state[param]" if not case.stage else "safe_get_full_optimizer_state"
    save_and_describe(engine, casedir, f"{how} of each tensor rank's slices (live_optimizer_tp*)", rules)


def universal_reference(casedir: Path, python: str, log: Path, env: dict[str, str]) -> None:
    """reference/universal.safetensors: DeepSpeed's own merge of every param's fp32 master and
    Adam moments (``ds_to_universal``, exact for AutoTP's affine maps), as ``<name>``,
    ``<name>.exp_avg``, ``<name>.exp_avg_sq``."""
    code = r"""
import os, shutil, subprocess, sys, torch
from pathlib import Path
from safetensors.torch import save_file
casedir = Path(sys.argv[1])
tag = (casedir / "checkpoint" / "latest").read_text().strip()
out = casedir / "_universal"
subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                str(casedir / "checkpoint" / tag), "--output_folder", str(out)], check=True)
merged = {}
for name in sorted(os.listdir(out / "zero")):
    if not (out / "zero" / name).is_dir():
        continue
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        value = torch.load(out / "zero" / name / f"{state}.pt", weights_only=False)["param"]
        merged[name if state == "fp32" else f"{name}.{state}"] = value.contiguous()
save_file(merged, str(casedir / "reference" / "universal.safetensors"), metadata={"format": "pt"})
shutil.rmtree(out)
(casedir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's, beside its output folder
"""
    (casedir / "reference").mkdir(exist_ok=True)
    run([python, "-c", code, str(casedir)], cwd=REPO, log=log, env=env)


def universal_failure(casedir: Path, python: str, env: dict[str, str]) -> str | None:
    """The last line ``ds_to_universal`` prints where it fails on the case's checkpoint (None: it
    converts it)."""
    tag = (casedir / "checkpoint" / "latest").read_text().strip()
    out = Path("/tmp") / f"universal_{casedir.name}"
    cmd = [python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(casedir / "checkpoint" / tag)]
    done = subprocess.run([*cmd, "--output_folder", str(out)], env=env, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    (casedir / "checkpoint" / "latest_universal").unlink(missing_ok=True)
    lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
    return None if done.returncode == 0 else (lines or [""])[-1][:300]


def save_and_describe(engine: Any, casedir: Path, live_optimizer: str, client_state: dict | None = None) -> None:
    """Save the checkpoint (every rank), and on rank 0 what the driver writes into meta.json."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    ckpt_dir = casedir / "checkpoint"
    engine.save_checkpoint(str(ckpt_dir), client_state=client_state or {})
    dist.barrier()
    if dist.get_rank() == 0:
        info = {
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "tag": (ckpt_dir / "latest").read_text().strip(),
            "global_steps": engine.global_steps,
            "optimizer": type(engine.optimizer).__name__,
            "live_optimizer": live_optimizer,
        }
        (casedir / "_worker_info.json").write_text(json.dumps(info, indent=2))
    dist.barrier()


def all_ranks_ok(ok: bool) -> bool:
    import deepspeed.comm as dist
    import torch

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def capture_live(engine: Any) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """This stage's params (fp32 masters of the trainable ones), buffers, and Adam moments where
    DeepSpeed's API gives them (collective over the stage's data-parallel group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    module = engine.module
    zero = engine.zero_optimization_stage() > 0
    live: dict[str, Any] = {}
    for name, p in module.named_parameters():
        value = safe_get_full_fp32_param(p) if p.requires_grad and zero else p.data  # ZeRO-0: p is the master
        live[name] = value.detach().cpu().clone().contiguous()
    for name, b in module.named_buffers():
        live[name] = b.detach().cpu().clone().contiguous()
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not zero:  # ZeRO-0: the torch optimizer's own state, by param
        state = engine.optimizer.state
        optim = {
            f"{n}.{k}": state[p][k].detach().cpu().clone().contiguous()
            for n, p in trainable
            for k in ("exp_avg", "exp_avg_sq")
        }
        return live, optim, "the torch optimizer's state of each param"
    readable = all(
        getattr(getattr(p, "_hp_mapping", None), "optim_fragment", None) is not None
        and "exp_avg" in p._hp_mapping.optim_fragment
        for _, p in trainable
    )
    if not all_ranks_ok(readable):
        return live, None, "safe_get_full_optimizer_state: no optimizer fragment linked on some rank"
    optim = {}
    for name, p in trainable:
        for key in ("exp_avg", "exp_avg_sq"):
            optim[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().float().clone().contiguous()
    return live, optim, "safe_get_full_optimizer_state worked"


def worker(case: Case, casedir: Path) -> None:
    import deepspeed
    import torch
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    model = build_pipeline(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config(case))
    stage, dp_rank = engine.stage_id, engine.grid.data_parallel_id
    gen = torch.Generator().manual_seed(SEED + 1000 * dp_rank)

    def batches():
        while True:
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)
            yield tokens, torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=gen)

    data = batches()
    for _ in range(case.steps):
        engine.train_batch(data_iter=data)
    live, optim, optim_note = capture_live(engine)
    ref = casedir / "reference"
    if dp_rank == 0:
        ref.mkdir(parents=True, exist_ok=True)
        save_file(live, str(ref / f"live_stage{stage}.safetensors"), metadata={"format": "pt"})
        if optim is not None:
            save_file(optim, str(ref / f"live_optimizer_stage{stage}.safetensors"), metadata={"format": "pt"})
    save_and_describe(engine, casedir, optim_note)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def merge_live(casedir: Path, case: Case, python: str, log: Path, env: dict[str, str]) -> None:
    """reference/live*.safetensors: the stages' files merged, tied copies checked bit-equal."""
    code = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
ref, count, part = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for kind in ("live", "live_optimizer"):
    parts = [ref / f"{kind}_{part}{s}.safetensors" for s in range(count)]
    if not all(p.exists() for p in parts):
        continue
    merged = {}
    for path in parts:
        for name, value in load_file(str(path)).items():
            if name in merged:
                assert torch.equal(merged[name], value), f"{kind}: {name} differs between {part}s"
            merged[name] = value
    save_file(merged, str(ref / f"{kind}.safetensors"), metadata={"format": "pt"})
"""
    count, part = (case.world_size, "rank") if case.ep else (case.pp, "stage")
    run([python, "-c", code, str(casedir / "reference"), str(count), part], cwd=REPO, log=log, env=env)


def generate(case: Case, out: Path, python: str, logdir: Path) -> float:
    started = time.time()
    casedir = out / case.name
    shutil.rmtree(casedir, ignore_errors=True)
    casedir.mkdir(parents=True)
    log = logdir / f"{case.name}.log"
    log.write_text("")
    env = cpu_env(case.world_size)
    run_workers(python, Path(__file__), case.world_size, json.dumps(asdict(case)), casedir, log, env)
    ckpt = casedir / "checkpoint"
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        (ckpt / name).unlink(missing_ok=True)
    ds_to_universal_error = None
    if case.tied:  # ds_to_universal fails on it: its error is recorded, the live slices are the reference
        ds_to_universal_error = universal_failure(casedir, python, env)
    elif (case.tp or case.mtp) and case.stage:  # ZeRO-0: ds_to_universal finds no optimizer files
        universal_reference(casedir, python, log, env)
    else:
        merge_live(casedir, case, python, log, env)
    for f in (casedir / "reference").glob("*.safetensors"):
        f.chmod(0o644)
    zero_to_fp32 = subprocess.run(
        [python, "-m", "deepspeed.utils.zero_to_fp32", "checkpoint", str(Path("/tmp") / f"ztf_{case.name}")],
        cwd=casedir,
        env=env,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(Path("/tmp") / f"ztf_{case.name}", ignore_errors=True)
    last_line = ([line for line in (zero_to_fp32.stderr or "").splitlines() if line.strip()] or [""])[-1]
    info = json.loads((casedir / "_worker_info.json").read_text())
    (casedir / "_worker_info.json").unlink()
    meta = {
        "case": case.name,
        **{k: info[k] for k in ("deepspeed_version", "torch_version", "tag", "global_steps", "optimizer")},
        "zero_stage": case.stage,
        "dtype": case.dtype,
        "pp": case.pp,
        "dp": case.dp,
        "world_size": case.world_size,
        "checkpoint": "checkpoint",
        "steps": case.steps,
        "gradient_accumulation_steps": case.grad_accum,
        **(
            {"tp": case.tp, "frozen": [], "buffers": []}
            if case.tp
            else {
                "tp": case.mtp,
                "mpu": "Megatron-style" if case.pp == 1 else "pipeline (PipeModelDataParallelTopology)",
                "frozen": [],
                "buffers": [],
                **(
                    {
                        "tied": {
                            "embed": "tied_modules.embed.* (layers 0 and 3: the embedding, and the head by its "
                            "word embeddings; a copy in each stage, only the word embeddings' kept in step)"
                        }
                    }
                    if case.tied
                    else {}
                ),
            }
            if case.mtp
            else {"ep": case.ep, "experts": case.experts, "frozen": [], "buffers": ["scale"]}
            if case.ep
            else {"frozen": [], "tied": {}, "buffers": ["1.scale", "2.scale", "4.scale"]}
            if case.plain
            else {
                "frozen": ["2.proj.weight", "2.proj.bias"],
                "tied": {"embed": "tied_modules.embed.weight (layers 0 and 5; a copy in each stage)"},
                "buffers": ["1.scale", "4.scale"],
            }
        ),
        "live_source": (
            "reference/universal.safetensors: DeepSpeed ds_to_universal's merged fp32 masters and Adam moments"
            if case.tp
            else "reference/live_tp{T}.safetensors: each tensor rank's slices as the live engine held them (ZeRO-0: "
            "its module params, the masters; ds_to_universal finds no optimizer files to merge)"
            if case.mtp and not case.stage
            else "reference/universal.safetensors: DeepSpeed ds_to_universal's merge by the saved merge patterns; "
            "reference/live_tp{T}.safetensors: each tensor rank's slices as the live engine held them"
            if case.mtp
            else "per rank: every param's fp32 master (ZeRO-0: an fp32 run's module params, a 16-bit run's "
            "FP16_UnfusedOptimizer fp32_groups; experts under their global ids), module buffers"
            if case.ep and not case.stage
            else "per rank: safe_get_full_fp32_param of every param (experts under their global ids), module buffers"
            if case.ep
            else "per stage: safe_get_full_fp32_param (trainable), module params (frozen) and buffers"
        ),
        "live_optimizer": info["live_optimizer"],
        "reference_command": "python -m deepspeed.utils.zero_to_fp32 checkpoint OUT",
        # as in make_sample_ckpts.py: where DeepSpeed's own tool fails, the live values are the reference
        "reference_error": None if zero_to_fp32.returncode == 0 else last_line[:300],
        **({"ds_to_universal_error": ds_to_universal_error} if case.tied else {}),
        "model": (
            {"llama": "vocab 64, hidden 32, intermediate 48, 2 layers, 4 heads, 2 kv heads", "micro_batch": MICRO_BATCH}
            if case.tp
            else {
                "megatron_gpt": f"vocab {MEGATRON_VOCAB} padded to {padded_vocab(case.mtp)}, dim {DIM}, hidden {HIDDEN}, "
                f"fused qkv {QKV}, 2 layers (SwiGLU, GeLU)",
                "micro_batch": MICRO_BATCH,
                "universal_checkpoint_info": "client state, see megatron_checkpoint_info",
            }
            if case.mtp
            else {"vocab": VOCAB, "dim": DIM, "hidden": HIDDEN, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH}
        ),
        "ds_config": ds_config(case),
    }
    (casedir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return time.time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="case names")
    parser.add_argument("--out", default=str(REPO / "sample_ckpts"))
    parser.add_argument("--python", default=DEFAULT_PY, help="python of a venv with deepspeed 0.19.8")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    parser.add_argument("--outdir", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)  # the launcher may append --local_rank
    if args.worker:
        case = Case(**json.loads(args.case_json))
        {
            "moe": moe_worker,
            "autotp": autotp_worker,
            "megatron": megatron_worker,
            "pipeline_megatron": pipeline_megatron_worker,
            "pipeline": worker,
        }[case.kind](case, Path(args.outdir))
        return 0
    if args.list:
        for case in CASES:
            print(json.dumps(asdict(case)))
        return 0
    chosen = [c for c in CASES if not args.only or c.name in args.only]
    logdir = Path("/tmp/make_parallel_ckpts_logs")
    logdir.mkdir(exist_ok=True)
    for case in chosen:
        seconds = generate(case, Path(args.out), args.python, logdir)
        print(f"{case.name}: {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

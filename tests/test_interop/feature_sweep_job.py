"""A tiny DeepSpeed 0.19.8 job for tests/test_interop/test_interop_feature_sweep.py (run under
torchrun at 2-4 CPU ranks): ``feature_sweep_job.py OUT CASE`` trains 3 steps and saves OUT/ckpt;
with ``$SWEEP_LOADS`` (``path[,path...]``, ``universal:`` before a path for
``checkpoint.load_universal``) it builds a fresh engine per path and loads it instead. Either way
it writes what the engine then holds (masters, per-element optimizer states, 16-bit module
weights, scaler, scheduler, random-LTD state, client state) to OUT/capture_<i>_stage<s>.pt, read
with scripts/ds_probe.py's ``capture``.

Cases (features that do not interfere share a run):
- ``fp16static``: fp16 with a static ``loss_scale`` 128, ZeRO-2, ``gradient_clipping`` 0.5, a
  WarmupLR scheduler, data_efficiency's random-LTD (layers wrapped after initialize, as
  ``convert_to_random_ltd`` is documented; its schedule keeps every token, so no CUDA op runs),
  client state holding numpy's RNG state (what a curriculum data sampler saves).
- ``muonmoe``: DeepSpeed's Muon over a native MoE layer (ep_size 2), ZeRO-2, torch_autocast bf16.
- ``muonpipe``: Muon in a 2-stage PipelineModule, ZeRO-1.
- ``sparse``: ``nn.Embedding(sparse=True)`` with SGD momentum, ZeRO-0 (ZeRO-1/2 fail on it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

VOCAB, DIM = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor, **_: object) -> torch.Tensor:
        return h + torch.relu(self.lin(self.norm(h)))


class Model(nn.Module):
    def __init__(self, sparse: bool = False, moe: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.moe = None
        if moe:
            from deepspeed.moe.layer import MoE

            expert = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
            self.moe = MoE(hidden_size=DIM, expert=expert, num_experts=2, ep_size=2, k=1, min_capacity=8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 4)
        self.register_buffer("count", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        aux = 0.0
        if self.moe is not None:
            h, aux, _ = self.moe(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h).float().pow(2).mean() + 0.01 * aux


def pipeline() -> nn.Module:
    from deepspeed.pipe import LayerSpec, PipelineModule

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))

    layers = [LayerSpec(nn.Embedding, VOCAB, DIM), LayerSpec(Block), LayerSpec(Block), LayerSpec(nn.Linear, DIM, VOCAB)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform", base_seed=0)


def config(world: int) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }
    muon = {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01}}
    if CASE == "fp16static":
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
        cfg["gradient_clipping"] = 0.5
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
        schedule = {"min_value": 8, "max_value": 8, "schedule_type": "fixed_linear"}
        schedule["schedule_config"] = {"require_steps": 10, "seq_per_step": 2}
        ltd = {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 2, "random_ltd_layer_id": [0, 1]}
        ltd.update(model_mask_name=None, model_type="decoder", hidden_state_order="batch_seq_dim")
        ltd["random_ltd_schedule"] = schedule
        cfg["data_efficiency"] = {"enabled": True, "seed": 1234, "data_routing": {"enabled": True, "random_ltd": ltd}}
    elif CASE == "muonmoe":
        cfg["optimizer"] = muon
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif CASE == "muonpipe":
        cfg["optimizer"] = muon
        cfg["zero_optimization"] = {"stage": 1}
        cfg["gradient_clipping"] = 0.25
        cfg["train_batch_size"] = 2 * 2 * (world // 2)
    elif CASE == "sparse":
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
        cfg["zero_optimization"] = {"stage": 0}
    return cfg


def engine_for(universal: bool) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    cfg = config(world)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if CASE == "muonpipe":
        model = pipeline()
        params: object = [p for p in model.parameters() if p.requires_grad]
    else:
        model = Model(sparse=CASE == "sparse", moe=CASE == "muonmoe")
        params = model.parameters()
        if CASE == "muonmoe":
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            params = split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "dense"})
    if CASE == "fp16static":
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()  # the CPU accelerator refuses fp16; torch computes it on CPU
        acc.is_fp16_supported = lambda: True
        acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def train_and_save(engine: deepspeed.DeepSpeedEngine) -> None:
    rank = engine.global_rank
    if CASE == "muonpipe":
        g = torch.Generator().manual_seed(7)

        def batches():  # noqa: ANN202
            while True:
                x = torch.randint(0, VOCAB, (2, 8), generator=g)
                yield x, x

        it = batches()
        for _ in range(3):
            engine.train_batch(data_iter=it)
    else:
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            loss = engine(torch.randint(0, VOCAB, (2, 8), generator=g))
            engine.backward(loss)
            engine.step()
    np.random.seed(5)
    client = {"my_epoch": 7, "np_rng_state": np.random.get_state()}
    engine.save_checkpoint(str(OUT / "ckpt"), client_state=client)


def capture(engine: deepspeed.DeepSpeedEngine, index: int, client: dict) -> None:
    stage = int(engine.zero_optimization_stage())
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name.replace(".random_ltd_layer", ""))
        params[id(p)] = p
    got = probe.capture(engine, stage, names_of, params)
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    sched = engine.lr_scheduler
    info = {
        "optimizer_class": type(opt).__name__,
        "scaler": {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))} if scaler else None,
        "clip_grad": getattr(opt, "clip_grad", None),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "random_ltd": engine.random_ltd_scheduler.state_dict() if engine.random_ltd_enabled() else None,
        "client": {k: client[k] for k in ("my_epoch", "np_rng_state") if k in client},
        "world_size": engine.world_size,
        "zero_stage": stage,
    }
    pipe_stage = getattr(engine, "stage_id", 0)
    first = engine.grid.get_data_parallel_rank() == 0 if hasattr(engine, "grid") else engine.global_rank == 0
    if CASE == "muonmoe":  # each expert-parallel rank holds its own expert: every rank writes
        first, pipe_stage = True, engine.global_rank
    if first:
        got = {k: got[k] for k in ("live", "optim", "module")}
        torch.save({**got, "info": info}, OUT / f"capture_{index}_stage{pipe_stage}.pt")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    loads = [p for p in os.environ.get("SWEEP_LOADS", "").split(",") if p]
    for index, spec in enumerate(loads or [""]):
        universal = spec.startswith("universal:")
        engine = engine_for(universal)
        client: dict = {}
        if spec:
            _, client = engine.load_checkpoint(spec.removeprefix("universal:"))
        if CASE == "fp16static":
            from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

            convert_to_random_ltd(engine, Block)
        if not spec:
            train_and_save(engine)
        if CASE != "sparse":  # its sparse momentum is not one ds_probe reads: nothing to compare
            capture(engine, index, client)
        deepspeed.comm.barrier()


if __name__ == "__main__":  # run by torchrun; pytest's doctest collection only imports it
    ARGS = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    OUT, CASE = Path(ARGS[0]), ARGS[1]

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    _spec = importlib.util.spec_from_file_location(
        "ds_probe", Path(__file__).resolve().parents[2] / "scripts" / "ds_probe.py"
    )
    probe = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(probe)
    main()

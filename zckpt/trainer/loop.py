"""The training loop: micro-steps, the optimizer step, logging through a callback, saving.

One code path for every world size: with one process the collectives are identities.
The library never prints; :func:`train` reports each step to `on_step` (rank 0 only).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..deepspeed import engine_config as E
from ..deepspeed.run_config import read_run_config
from ..deepspeed.swap_rules import param_buffers
from .arena import return_big_frees_to_the_system
from .config import TrainConfig
from .data import TokenData
from .devices import process_group_backend, rank_device
from .model import build_empty_model, initial_value
from .optim import DynamicLossScale, LRSchedule, ShardedAdamW, param_group_defaults
from .param_store import ParamStore, live_param_folder
from .swap import live_optimizer_folder
from .zero3 import DECAY, Comm, ShardedModel, plan_zero3

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepLog:
    step: int  # optimizer steps done (global_steps)
    loss: float  # mean over micro-steps and ranks
    lr: float  # the lr this step used
    grad_norm: float
    skipped: bool  # fp16 overflow: the step was skipped
    tokens_per_s: float
    saved: str | None = None  # the checkpoint tag folder written after this step


@dataclass(frozen=True)
class TrainResult:
    losses: tuple[float, ...]
    global_steps: int
    skipped_steps: int
    checkpoints: tuple[str, ...]
    swapped_sub_groups: tuple[int, int] | None = None  # NVMe offload: (swapped, all) sub-groups of rank 0
    swapped_params: tuple[int, int, str] | None = (
        None  # NVMe offload of params: (swapped, all) params of rank 0, their folder (less rank<R>)
    )


def init_distributed(device_choice: str = "auto") -> bool:
    """Join the torchrun job if there is one; True if this call created the process group (and
    so must destroy it). gloo on CPU; on CUDA, nccl for device tensors and gloo for host ones."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    dist.init_process_group(process_group_backend(rank_device(device_choice)))
    return True


class Trainer:
    """The model, its ZeRO-3 shards, the sharded optimizer and the counters DeepSpeed keeps."""

    def __init__(self, config: TrainConfig, comm: Comm | None = None) -> None:
        self.config = config
        self.comm = comm or Comm()
        self.dtype = TORCH_DTYPES[config.dtype]
        self.device = rank_device(config.device)  # forward and backward; shares and optimizer stay in host memory
        self.model_config = config.model_config()
        if config.bounded_memory:  # memory bounded by the params in use and the swap buffers, before speed
            return_big_frees_to_the_system()
        # no warmup: DeepSpeed's schedule with min lr = max lr (its warmup is at least 2 steps)
        self.schedule = LRSchedule(config.lr, config.warmup, config.steps, min_lr=0.0 if config.warmup else config.lr)
        # the ds_config this run saves, read as DeepSpeed reads it (a value it refuses is a UsageError):
        # its sub_group_size, and its swap rule (it sets no aio section: DeepSpeed's defaults)
        run = read_run_config(self._engine_config(None))
        # modules on the meta device, each param materialised alone while it is sharded: memory
        # never holds the whole model (the values are build_model(model_config, seed)'s)
        full = build_empty_model(self.model_config)
        self.plan = plan_zero3(full, self.comm.world, run.sub_group_size, config.freeze)
        hyper = [
            param_group_defaults(
                self.schedule.at(-1), config.betas, config.eps, config.weight_decay if g == DECAY else 0.0
            )
            for g in self.plan.group_names
        ]
        scaler = DynamicLossScale() if config.dtype == "fp16" else None
        swap_folder = live_optimizer_folder(config.nvme_path, self.comm.rank) if config.nvme_path else None
        rule = run.swap_rule
        self.optimizer = ShardedAdamW(self.plan, self.comm, hyper, config.clip, scaler, swap_folder, rule)
        param_folder = (
            live_param_folder(config.nvme_path, self.dtype, self.comm.rank)
            if config.nvme_path and config.nvme_params
            else None
        )
        store = ParamStore([s.share for s in self.plan.params], self.dtype, param_folder, rule)
        specs = self.plan.params
        self.model = ShardedModel(
            full,
            self.plan,
            self.comm,
            self.dtype,
            grad_ready=self.optimizer.accumulate,
            store=store,
            values=lambda i: initial_value(self.model_config, i, specs[i].name, specs[i].shape, config.seed),
            device=self.device,
        )
        self.optimizer.load_masters(self.model.store)
        self.data = TokenData(self.model_config.vocab, self.model_config.seq_len, config.seed, config.data)
        self.global_steps = 0
        self.global_samples = 0  # sequences trained on: where the data resumes, whatever the batch was before
        self.skipped_steps = 0
        self.last_batch_iteration = -1  # DeepSpeed's lr scheduler counter
        if config.resume:
            from .checkpoint import load_checkpoint

            load_checkpoint(self, config.resume)

    def ds_config(self) -> dict:
        """The ds_config of the DeepSpeed run this one is (saved in its checkpoints, where the
        writer reads it as DeepSpeed does)."""
        store = self.model.store
        buffers = None
        if store.rule is not None:  # buffers the swapped shares need (DeepSpeed's defaults pin 100M elements x 5)
            buffers = param_buffers([store.shares[i] for i in sorted(store.swapped)], store.rule)
        return self._engine_config(buffers)

    def _engine_config(self, param_buffers: tuple[int, int] | None) -> dict:
        config = self.config
        return E.engine_config(
            micro_batch=config.micro_batch,
            grad_accum=config.grad_accum,
            world_size=self.comm.world,
            dtype=config.dtype,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            clip=config.clip,
            sub_group_size=config.sub_group_size,
            scheduler=self.schedule.ds_scheduler(),
            nvme_path=config.nvme_path,
            param_buffers=param_buffers,
        )

    @property
    def global_batch(self) -> int:
        return self.config.micro_batch * self.config.grad_accum * self.comm.world

    def lr(self) -> float:
        return self.schedule.at(self.last_batch_iteration)

    def train_step(self) -> StepLog:
        """One optimizer step: grad_accum micro-steps, then the sharded AdamW step."""
        started = time.perf_counter()
        config = self.config
        scale = self.optimizer.loss_scale.cur_scale if self.optimizer.loss_scale else 1.0
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(config.grad_accum):
            first = self.global_samples + micro * config.micro_batch * self.comm.world
            inputs, targets = self.data.micro_batch(first, self.comm.rank, config.micro_batch)
            self.optimizer.begin_micro_step(last=micro == config.grad_accum - 1)
            loss = self.model(inputs.to(self.device), targets.to(self.device))
            (loss * (scale / config.grad_accum)).backward()
            total += loss.detach().double().cpu()
        self.comm.all_reduce(total)
        lr = self.lr()
        result = self.optimizer.step([lr] * len(self.plan.group_names), self.model.store)
        if result.skipped:
            self.skipped_steps += 1
        else:
            self.last_batch_iteration += 1
            for group in self.optimizer.hyperparams:  # saved after the scheduler step, as DeepSpeed does
                group["lr"] = self.lr()
        self.global_steps += 1
        self.global_samples += self.global_batch  # skipped steps too, as DeepSpeed counts them
        elapsed = time.perf_counter() - started
        loss_value = float(total) / (config.grad_accum * self.comm.world)
        tokens = self.global_batch * self.model_config.seq_len
        return StepLog(
            self.global_steps,
            loss_value,
            lr,
            result.grad_norm,
            result.skipped,
            tokens / elapsed if elapsed > 0 else 0.0,
        )

    def save(self) -> str:
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, self.config.out or "")

    def close(self) -> None:
        """Close the NVMe swap files (they stay, as DeepSpeed's swap folder does)."""
        self.optimizer.close()
        self.model.store.close()


def train(config: TrainConfig, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Train as `config` says, in this process and (under torchrun) its peers."""
    created = init_distributed(config.device)
    try:
        trainer = Trainer(config)
        losses, saved = [], []
        while trainer.global_steps < config.steps:
            log = trainer.train_step()
            losses.append(log.loss)
            due = config.out and (
                trainer.global_steps == config.steps
                or (config.save_every and trainer.global_steps % config.save_every == 0)
            )
            if due:
                saved.append(trainer.save())
                log = StepLog(**{**log.__dict__, "saved": saved[-1]})
            if on_step is not None and trainer.comm.rank == 0:
                on_step(log)
        trainer.close()
        swapped = (len(trainer.optimizer.swapped), len(trainer.plan.layout.flat_groups)) if config.nvme_path else None
        store = trainer.model.store
        params = (
            (len(store.swapped), len(trainer.plan.params), os.path.dirname(store.folder))
            if store.folder is not None
            else None
        )
        return TrainResult(tuple(losses), trainer.global_steps, trainer.skipped_steps, tuple(saved), swapped, params)
    finally:
        if created:
            dist.barrier()  # no rank tears the group down while another still talks to it (gloo aborts)
            dist.destroy_process_group()

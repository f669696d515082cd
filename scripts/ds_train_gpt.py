#!/usr/bin/env python3
"""The zckpt trainer's model under real DeepSpeed ZeRO-3: load a checkpoint, train, dump the state.

Per-rank worker, started by torchrun with an interpreter that has DeepSpeed::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc-per-node N scripts/ds_train_gpt.py \\
        --model-config CKPT/model_config.json --ds-config CONFIG.json --out OUT \\
        [--load CKPT] [--train-steps K] [--seed S] [--freeze REGEX] [--save DIR] [--no-live]

The model is ``zckpt.trainer.build_model(model_config.json, seed=S)`` (the trainer's own init),
its param groups the trainer's (matrices with the config's weight decay, biases and norms
without), the data the trainer's (``zckpt.trainer.data``: rank r takes rows r*mb.. of each
global micro-batch). ``--load`` runs a plain ``engine.load_checkpoint(CKPT)``. Rank 0 writes
``OUT/live.pt`` (per param: ``<name>.master``, ``.exp_avg``, ``.exp_avg_sq`` from DeepSpeed's
``safe_get_full_*``, fp32, full shape; after the training steps if any) and ``OUT/state.json``
(global_steps, skipped_steps, lr, losses of the trained steps, each step's wall seconds, each
rank's peak RSS in KiB: what scripts/bench_trainer.py compares). ``--no-live`` skips live.pt;
``--masters-only`` leaves the Adam moments out of it (a DeepSpeed run with NVMe optimizer offload
has none after a load until it steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--freeze")
    parser.add_argument("--no-live", action="store_true")
    parser.add_argument("--masters-only", action="store_true")
    args, _ = parser.parse_known_args()

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from zckpt.trainer import build_model
    from zckpt.trainer.data import TokenData

    acc = get_accelerator()  # the CPU accelerator refuses fp16 although torch computes it
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with open(args.ds_config, encoding="utf-8") as handle:
        config = json.load(handle)
    model = build_model(args.model_config, seed=args.seed)
    pattern = re.compile(args.freeze) if args.freeze else None
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if pattern and pattern.search(name):
            param.requires_grad_(False)
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    weight_decay = config["optimizer"]["params"]["weight_decay"]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if args.load:
        engine.load_checkpoint(args.load)
    cfg = model.config
    data = TokenData(cfg.vocab, cfg.seq_len, args.seed)
    micro_batch, grad_accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    losses, lrs, step_times = [], [], []
    for _ in range(args.train_steps):
        started = time.perf_counter()
        step = engine.global_steps
        lrs.append(engine.get_lr()[0])
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(grad_accum):
            inputs, targets = data.micro_batch((step * grad_accum + micro) * micro_batch * world, rank, micro_batch)
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / (grad_accum * world))
        step_times.append(time.perf_counter() - started)
    if args.save:
        engine.save_checkpoint(args.save)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    torch.distributed.all_gather(peaks, peak)
    live = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad or args.no_live:
            continue
        live[f"{name}.master"] = safe_get_full_fp32_param(param).float().clone()
        for key in () if args.masters_only else ("exp_avg", "exp_avg_sq"):
            live[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).float().clone()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not args.no_live:
            torch.save(live, os.path.join(args.out, "live.pt"))
        state = {
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "lr": engine.get_lr()[0],
            "losses": losses,
            "lrs": lrs,
            "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0)),
            "step_times": step_times,
            "peak_rss_kib": [int(p) for p in peaks],
        }
        with open(os.path.join(args.out, "state.json"), "w", encoding="utf-8") as handle:
            json.dump(state, handle)
    torch.distributed.barrier()
    # torch 2.13's gloo threads can abort the interpreter's exit ("terminate called without an
    # active exception"; seen here after live.pt was written): the work is done, leave now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

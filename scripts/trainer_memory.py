#!/usr/bin/env python3
"""Measure: does ``zckpt train``'s memory grow with the model under NVMe offload?

The same GPT at several depths (same width, so the largest param and the swap buffer pool stay
the same while the model grows), 2 ranks on gloo, each run in its own torchrun, three ways:

- ``memory``: everything in memory (shares, fp32 masters, Adam moments, fp32 gradients);
- ``nvme``: ``--nvme-path``, masters, moments and gradients of the big sub-groups on NVMe;
- ``nvme+params``: ``--nvme-path --nvme-params``, the big param shares on NVMe too.

Each rank reports its peak RSS (``ru_maxrss``, initialisation included) and its RSS after the
last step. Prints a Markdown table; ``--json`` keeps the raw figures::

    python scripts/trainer_memory.py --work-dir /tmp/trainer_memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_trainer import end_worker, free_port  # noqa: E402  (the same torchrun plumbing)

MODES = {
    "memory": {},
    "nvme": {"nvme": True},
    "nvme+params": {"nvme": True, "nvme_params": True},
    "nvme+params+bounded": {"nvme": True, "nvme_params": True, "bounded_memory": True},
}


def _options(args: argparse.Namespace, layers: int) -> dict:
    return dict(
        layers=layers,
        dim=args.dim,
        heads=args.heads,
        vocab=args.vocab,
        seq_len=args.seq_len,
        micro_batch=1,
        steps=args.steps,
        sub_group_size=args.sub_group_size,
        dtype=args.dtype,
        lr=1e-4,
        seed=1,
    )


def _resident() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from zckpt.trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode = MODES[args.mode]
    nvme = str(args.work_dir / "nvme") if mode.get("nvme") else None
    before = _resident()
    trainer = Trainer(
        TrainConfig(
            **_options(args, args.layers),
            nvme_path=nvme,
            nvme_params=bool(mode.get("nvme_params")),
            bounded_memory=bool(mode.get("bounded_memory")),
        )
    )
    for _ in range(args.steps):
        trainer.train_step()
    swapper = trainer.optimizer.swapper
    store = trainer.model.store
    plan = trainer.plan
    itemsize = store.itemsize
    mine = {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after": _resident(),
        "rss_before_trainer": before,
        "pool_bytes": swapper.pool_bytes if swapper else 0,
        # what a rank would hold for the model in memory: shares + fp32 master, 2 moments, gradient
        "model_state_bytes": sum(s.share for s in plan.params) * itemsize
        + sum(g.partition for g in plan.layout.flat_groups) * 16,
        "largest_param_bytes": max(s.numel for s in plan.params) * 4,
        "params": sum(s.numel for s in plan.params),
        "swapped_sub_groups": len(trainer.optimizer.swapped),
        "sub_groups": len(plan.layout.flat_groups),
        "swapped_params": len(store.swapped),
        "resident_share_bytes": store.resident_bytes(),
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        (args.work_dir / "result.json").write_text(json.dumps(gathered))
    end_worker(trainer)


def _run(args: argparse.Namespace, layers: int, mode: str) -> list[dict]:
    from shm_leaks import removing_shm_leaks

    work = args.work_dir / f"{mode.replace('+', '_')}_{layers}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        __file__,
        "--worker",
        "--work-dir",
        str(work),
        "--layers",
        str(layers),
        "--mode",
        mode,
        "--dim",
        str(args.dim),
        "--heads",
        str(args.heads),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--sub-group-size",
        str(args.sub_group_size),
        "--dtype",
        args.dtype,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    with removing_shm_leaks(), (work / "log.txt").open("w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"trainer_memory: {mode} at {layers} layers failed ({done.returncode}); see {work / 'log.txt'}")
    result = json.loads((work / "result.json").read_text())
    shutil.rmtree(work / "nvme", ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/zckpt_trainer_memory"))
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=1_000_000)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json", type=Path, help="Also write the raw figures here.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.layers = args.layers[0]
        worker(args)
        return
    results = {mode: {layers: _run(args, layers, mode) for layers in args.layers} for mode in args.modes}
    mib = 1 << 20
    print(
        f"GPT dim {args.dim}, {args.dtype}, 2 ranks, sub_group_size {args.sub_group_size:,}, {args.steps} steps; per rank, MiB (rank 0 / rank 1)"
    )
    print()
    print(
        "| layers | params | model state per rank | mode | peak RSS | RSS after the steps | swap pool | largest param | swapped |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        for mode in args.modes:
            ranks = results[mode][layers]
            first = ranks[0]
            swapped = f"{first['swapped_sub_groups']}/{first['sub_groups']} sub-groups" if mode != "memory" else "-"
            if mode.startswith("nvme+params"):
                swapped += f", {first['swapped_params']} params"
            peak = " / ".join(f"{r['peak_rss'] / mib:.0f}" for r in ranks)
            after = " / ".join(f"{r['rss_after'] / mib:.0f}" for r in ranks)
            print(
                f"| {layers} | {first['params'] / 1e6:.1f}M | {first['model_state_bytes'] / mib:.0f} | {mode} | {peak} | {after} | "
                f"{first['pool_bytes'] / mib:.0f} | {first['largest_param_bytes'] / mib:.0f} | {swapped} |"
            )
    if len(args.layers) > 1:
        low, high = min(args.layers), max(args.layers)
        print()
        for mode in args.modes:
            growth = max(r["peak_rss"] for r in results[mode][high]) - max(r["peak_rss"] for r in results[mode][low])
            state = results[mode][high][0]["model_state_bytes"] - results[mode][low][0]["model_state_bytes"]
            print(
                f"- {mode}: {low} -> {high} layers, model state per rank +{state / mib:.0f} MiB, peak RSS +{growth / mib:.0f} MiB ({growth / state:.2f}x)"
            )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()

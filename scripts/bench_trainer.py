#!/usr/bin/env python3
"""Benchmark: ``zckpt train`` with NVMe offload vs DeepSpeed ZeRO-3 with ``offload_optimizer: nvme``.

Same model (``zckpt.trainer.build_model``, same init), same data, same ds_config (the trainer's
own, which a DeepSpeed run of the same settings would use), CPU, 2 ranks (gloo), one thread
per rank, each run in its own torchrun. Run with an interpreter that has DeepSpeed::

    DS_ACCELERATOR=cpu /work/venv-ds19/bin/python scripts/bench_trainer.py --work-dir /tmp/bench_trainer

Measured: each optimizer step's wall time (median over the steps after the first two), each
rank's peak RSS (``ru_maxrss``), the trainer's swap read/write throughput (bytes over the
seconds its I/O thread spent in preadv/pwritev) and, on the same folder, ``dd`` with
``oflag=direct`` / ``iflag=direct``. Prints a Markdown table; ``--json`` keeps the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def _options(args: argparse.Namespace) -> dict:
    return dict(
        layers=args.layers,
        dim=args.dim,
        heads=args.heads,
        vocab=args.vocab,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        grad_accum=1,
        steps=args.steps,
        sub_group_size=args.sub_group_size,
        dtype=args.dtype,
        lr=1e-4,
        seed=1,
    )


# --- the trainer's ranks (started by torchrun with --worker) -----------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from zckpt.trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(
        TrainConfig(
            **_options(args),
            nvme_path=str(args.work_dir / "zckpt_nvme"),
            nvme_params=args.nvme_params,
            bounded_memory=args.bounded_memory,
        )
    )
    losses, step_times = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        losses.append(trainer.train_step().loss)
        step_times.append(time.perf_counter() - started)
    swapper = trainer.optimizer.swapper
    counters = vars(swapper.counters) if swapper else {}
    mine = {
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "counters": counters,
        "pool_bytes": swapper.pool_bytes if swapper else 0,
        "swapped_groups": len(trainer.optimizer.swapped),
        "swapped_params": len(trainer.model.store.swapped),
        "sub_groups": len(trainer.plan.layout.flat_groups),
        "direct": bool(swapper and swapper.direct),
        "swapped_state_bytes": sum(12 * g.file_numel + 4 * g.numel for g in swapper.groups.values()) if swapper else 0,
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        (args.work_dir / "zckpt_run").mkdir(parents=True, exist_ok=True)
        (args.work_dir / "zckpt_run" / "state.json").write_text(
            json.dumps({"losses": losses, "step_times": step_times, "ranks": gathered})
        )
        (args.work_dir / "ds_config.json").write_text(json.dumps(trainer.ds_config()))
        (args.work_dir / "model_config.json").write_text(trainer.model_config.to_json())
    end_worker(trainer)


def end_worker(trainer) -> None:  # type: ignore[no-untyped-def]
    """Close the trainer, leave the process group together, exit at once (torch 2.13's gloo
    threads can abort the interpreter's normal exit)."""
    import torch.distributed as dist

    trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# --- the driver -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "LOCAL_SIZE": "2"}


def _torchrun(script_args: list[str], log: Path) -> None:
    from shm_leaks import removing_shm_leaks

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        *script_args,
    ]
    with removing_shm_leaks(), log.open("w") as out:
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"bench_trainer: {' '.join(cmd[:6])}... failed ({done.returncode}); see {log}")


def _dd(folder: Path, mib: int) -> dict:
    """dd's write (oflag=direct) and read (iflag=direct) throughput in MB/s on `folder`."""
    path = folder / "dd.bin"
    rates = {}
    for kind, cmd in (
        ("write", ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mib // 4}", "oflag=direct"]),
        ("read", ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"]),
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
        assert match, done.stderr
        rates[kind] = int(match.group(1)) / float(match.group(2)) / 1e6
        rates[f"{kind}_cmd"] = " ".join(cmd)
    path.unlink()
    return rates


def _median(times: list[float], skip: int) -> float:
    return statistics.median(times[skip:] if len(times) > skip else times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        required=True,
        help="swap folders, runs and dd's file go here (the disk that is measured)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=500_000)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--dd-mib", type=int, default=256)
    parser.add_argument("--bounded-memory", action="store_true", help="zckpt train --bounded-memory")
    parser.add_argument(
        "--nvme-params",
        action="store_true",
        help="params on NVMe too: zckpt train --nvme-params, DeepSpeed offload_param nvme",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.resolve()
    if args.worker:
        worker(args)
        return 0
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    if args.json:
        passthrough = [a for a in passthrough if a != str(args.json)]
    _torchrun([str(Path(__file__).resolve()), "--worker", *passthrough], args.work_dir / "zckpt.log")
    ours = json.loads((args.work_dir / "zckpt_run" / "state.json").read_text())
    config = json.loads((args.work_dir / "ds_config.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        if section in config["zero_optimization"]:
            config["zero_optimization"][section]["nvme_path"] = str(args.work_dir / "ds_nvme")
    (args.work_dir / "ds_config.json").write_text(json.dumps(config))
    _torchrun(
        [
            str(ROOT / "scripts" / "ds_train_gpt.py"),
            "--model-config",
            str(args.work_dir / "model_config.json"),
            "--ds-config",
            str(args.work_dir / "ds_config.json"),
            "--out",
            str(args.work_dir / "ds_run"),
            "--train-steps",
            str(args.steps),
            "--seed",
            "1",
            "--no-live",
        ],
        args.work_dir / "ds.log",
    )
    theirs = json.loads((args.work_dir / "ds_run" / "state.json").read_text())
    dd = _dd(args.work_dir, args.dd_mib)

    skip = 2  # the first steps warm up allocators (and DeepSpeed's swap buffers)
    step_ours, step_theirs = _median(ours["step_times"], skip), _median(theirs["step_times"], skip)
    rank0 = ours["ranks"][0]
    read_mbs = [r["counters"]["bytes_read"] / r["counters"]["read_seconds"] / 1e6 for r in ours["ranks"]]
    write_mbs = [r["counters"]["bytes_written"] / r["counters"]["write_seconds"] / 1e6 for r in ours["ranks"]]
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
    result = {
        "options": _options(args),
        "zckpt": ours,
        "deepspeed": theirs,
        "dd": dd,
        "median_step_s": {"zckpt": step_ours, "deepspeed": step_theirs},
        "ratio": step_ours / step_theirs,
        "swap_read_mb_s": read_mbs,
        "swap_write_mb_s": write_mbs,
        "max_relative_loss_gap": loss_gap,
    }
    params = f", {rank0.get('swapped_params', 0)} params swapped (offload_param)" if args.nvme_params else ""
    print(
        f"model: {_options(args)}; {rank0['sub_groups']} sub-groups per rank, {rank0['swapped_groups']} swapped{params} "
        f"({rank0['swapped_state_bytes'] / 2**20:.1f} MiB of optimizer state and gradients per rank on NVMe, buffer pool {rank0['pool_bytes'] / 2**20:.1f} MiB, O_DIRECT {rank0['direct']})"
    )
    print("| | zckpt train | DeepSpeed 0.19.8 |\n|---|---|---|")
    print(f"| median step time (steps {skip + 1}-{args.steps}) | {step_ours:.3f} s | {step_theirs:.3f} s |")
    print(f"| ratio zckpt / DeepSpeed | {step_ours / step_theirs:.2f}x | |")
    rss_ours = ", ".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in ours["ranks"])
    rss_theirs = ", ".join(f"{p / 1024:.0f}" for p in theirs["peak_rss_kib"])
    print(f"| peak RSS per rank | {rss_ours} MiB | {rss_theirs} MiB |")
    print(f"| swap read per rank (I/O thread) | {', '.join(f'{x:.0f}' for x in read_mbs)} MB/s | |")
    print(f"| swap write per rank (I/O thread) | {', '.join(f'{x:.0f}' for x in write_mbs)} MB/s | |")
    print(
        f"| dd, same folder | write {dd['write']:.0f} MB/s (oflag=direct), read {dd['read']:.0f} MB/s (iflag=direct) | |"
    )
    print(f"| losses, max relative difference | {loss_gap:.1e} | |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
    parts = _timed_parts(trainer) if args.breakdown and rank == 0 else None
    losses, step_times, breakdown = [], [], []
    for _ in range(args.steps):
        if parts is not None:
            parts.clear()
        started = time.perf_counter()
        losses.append(trainer.train_step().loss)
        step_times.append(time.perf_counter() - started)
        if parts is not None:
            breakdown.append(dict(parts, total=step_times[-1]))
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
            json.dumps({"losses": losses, "step_times": step_times, "ranks": gathered, "breakdown": breakdown})
        )
        (args.work_dir / "ds_config.json").write_text(json.dumps(trainer.ds_config()))
        (args.work_dir / "model_config.json").write_text(trainer.model_config.to_json())
    end_worker(trainer)


def _timed_parts(trainer) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Wrap the trainer's parts in timers (seconds per part, summed over the step; cleared by
    the caller): forward (its gathers included), the collectives, the optimizer step and, in
    it, AdamW, the wait for the gradients' last writes and the wait for the swap reads/writes."""
    from zckpt.trainer import optim

    parts: dict[str, float] = {}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - started

        return run

    comm, model, optimizer = trainer.comm, trainer.model, trainer.optimizer
    comm.all_gather = timed("all_gather", comm.all_gather)
    comm.reduce_scatter = timed("reduce_scatter", comm.reduce_scatter)
    model.forward = timed("forward", model.forward)
    optimizer.step = timed("optimizer_step", optimizer.step)
    optim.adamw = timed("adamw", optim.adamw)
    swapper = optimizer.swapper
    if swapper is not None:
        swapper.drain_gradients = timed("gradient_write_wait", swapper.drain_gradients)
        stream = swapper.stream

        def waited(flats):  # type: ignore[no-untyped-def]
            items = stream(flats)
            while True:  # the time in next(): waiting for reads (and, at the end, the last writes)
                started = time.perf_counter()
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    parts["swap_wait"] = parts.get("swap_wait", 0.0) + time.perf_counter() - started
                yield item

        swapper.stream = waited
    return parts


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


def _extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its ops (async_io for the NVMe swap) for this interpreter: the
    folder tests/interop_helpers.torch_extensions_dir names (per release and venv), so a bench
    run reuses the build .ci/run made instead of paying a 3-6 minute one."""
    import hashlib
    from importlib.metadata import version

    major, minor = version("deepspeed").split(".")[:2]
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    return str(Path.home() / ".cache" / f"torch_extensions_ds{major if major != '0' else ''}{minor}_{key}")


def _env() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "LOCAL_SIZE": "2"}
    env.setdefault("TORCH_EXTENSIONS_DIR", _extensions_dir())
    return env


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


def _ds_breakdown(log: Path, skip: int) -> dict[str, float]:
    """Median seconds per part over DeepSpeed's steps after `skip`, from rank 0's
    wall_clock_breakdown lines (``[Rank 0] time (ms) | fwd: 1.2 | bwd: ...``) in `log`."""
    steps: list[dict[str, float]] = []
    for line in log.read_text(errors="replace").splitlines():
        if "[Rank 0] time (ms)" not in line:
            continue
        found = {k: float(v) / 1e3 for k, v in re.findall(r"(\w+): ([\d.]+)", line.split("time (ms)", 1)[1])}
        if any(k.endswith("_microstep") for k in found):  # the same figures again, per micro-step
            continue
        if not steps or any(k in steps[-1] for k in found):  # a step's lines (swaps, then fwd/bwd/step) are done
            steps.append({})
        steps[-1].update(found)
    return _part_medians(steps, skip)


def _part_medians(steps: list[dict[str, float]], skip: int) -> dict[str, float]:
    kept = steps[skip:] if len(steps) > skip else steps
    return {k: statistics.median(s.get(k, 0.0) for s in kept) for k in dict.fromkeys(k for s in kept for k in s)}


def _median(times: list[float], skip: int) -> float:
    return statistics.median(times[skip:] if len(times) > skip else times)


def _run_pair(args: argparse.Namespace, passthrough: list[str]) -> tuple[dict, dict]:
    """One trainer run, then one DeepSpeed run of the same settings: their state.json."""
    for name in ("zckpt_nvme", "ds_nvme", "zckpt_run", "ds_run"):
        shutil.rmtree(args.work_dir / name, ignore_errors=True)
    _torchrun([str(Path(__file__).resolve()), "--worker", *passthrough], args.work_dir / "zckpt.log")
    ours = json.loads((args.work_dir / "zckpt_run" / "state.json").read_text())
    config = json.loads((args.work_dir / "ds_config.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        if section in config["zero_optimization"]:
            config["zero_optimization"][section]["nvme_path"] = str(args.work_dir / "ds_nvme")
    if args.breakdown:  # DeepSpeed's own timers (forward, backward, step, swaps) in ds.log
        config["wall_clock_breakdown"] = True
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
    return ours, json.loads((args.work_dir / "ds_run" / "state.json").read_text())


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
    parser.add_argument(
        "--alternate",
        type=int,
        default=1,
        metavar="N",
        help="N rounds of trainer-then-DeepSpeed; each round's median per side, the ratio per round, "
        "and the median of those (the machine's load moves between runs, less within a round)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="where rank 0's step time goes: timers around the trainer's parts, DeepSpeed's wall_clock_breakdown",
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
    skip = 2  # the first steps warm up allocators (and DeepSpeed's swap buffers)
    rounds = []
    for _ in range(max(1, args.alternate)):  # trainer then DeepSpeed, each round on fresh swap folders
        ours, theirs = _run_pair(args, passthrough)
        medians = _median(ours["step_times"], skip), _median(theirs["step_times"], skip)
        rounds.append({"zckpt": medians[0], "deepspeed": medians[1], "ratio": medians[0] / medians[1]})
        if args.breakdown:
            rounds[-1]["zckpt_parts"] = _part_medians(ours["breakdown"], skip)
            rounds[-1]["deepspeed_parts"] = _ds_breakdown(args.work_dir / "ds.log", skip)
    dd = _dd(args.work_dir, args.dd_mib)
    step_ours = statistics.median(r["zckpt"] for r in rounds)
    step_theirs = statistics.median(r["deepspeed"] for r in rounds)
    ratio = statistics.median(r["ratio"] for r in rounds)
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
        "rounds": rounds,
        "ratio": ratio,
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
    median_of = f"median over {len(rounds)} rounds of each round's median" if len(rounds) > 1 else "median"
    print(f"| step time, {median_of} (steps {skip + 1}-{args.steps}) | {step_ours:.3f} s | {step_theirs:.3f} s |")
    per_round = ", ".join(f"{r['ratio']:.2f}x" for r in rounds)
    print(f"| ratio zckpt / DeepSpeed (median of the rounds' ratios) | {ratio:.2f}x | {per_round} |")
    rss_ours = ", ".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in ours["ranks"])
    rss_theirs = ", ".join(f"{p / 1024:.0f}" for p in theirs["peak_rss_kib"])
    print(f"| peak RSS per rank | {rss_ours} MiB | {rss_theirs} MiB |")
    print(f"| swap read per rank (I/O thread) | {', '.join(f'{x:.0f}' for x in read_mbs)} MB/s | |")
    print(f"| swap write per rank (I/O thread) | {', '.join(f'{x:.0f}' for x in write_mbs)} MB/s | |")
    print(
        f"| dd, same folder | write {dd['write']:.0f} MB/s (oflag=direct), read {dd['read']:.0f} MB/s (iflag=direct) | |"
    )
    print(f"| losses, max relative difference | {loss_gap:.1e} | |")
    if args.breakdown:
        print("\nrank 0, median seconds per part (steps after the first two), per round:")
        for r in rounds:
            for side in ("zckpt", "deepspeed"):
                print(f"- {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in r[f"{side}_parts"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

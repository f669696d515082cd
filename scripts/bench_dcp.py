#!/usr/bin/env python3
"""Benchmark ``zckpt to-dcp`` against the I/O floor (``cp -r`` of the input) and torch's in-memory
route (the whole ``{"model", "optim"}`` state dict in memory, then ``dcp.save``).

What it does:

1. **Checkpoint**: ``--ckpt PATH`` (a folder holding ``latest``; never written to), or by default
   one made by ``zckpt train`` under torchrun in ``--workdir`` and reused from there (ZeRO-3,
   bf16, 2 ranks, DeepSpeed's layout; ``--layers``/``--dim``/``--vocab`` size it, ~134M params and
   1.9 GB by default, ~20 s to make on 2 cores).
2. **Verify** (untimed): one run of ``zckpt`` and one of ``torch``, outputs kept and read back with
   torch's ``dcp_to_torch_save``: the same keys, every tensor the same bits, the same param
   groups. Fails the benchmark otherwise.
3. **Measure**: ``--repeats`` rounds of the variants in turn, each run a subprocess writing a
   fresh folder deleted afterwards, measured by ``bench_common.run_measured`` (wall time, CPU,
   peak summed RSS of the process tree, then ``os.sync()`` timed outside the wall time). The
   input is read once before every run (untimed) so each starts with it in the page cache.

Commands measured (CKPT the checkpoint folder, OUT fresh)::

    cp -r CKPT OUT                                          # cp
    PY -m zckpt to-dcp CKPT OUT --quiet                     # zckpt
    PY -c TORCH_ROUTE CKPT OUT                              # torch: every tensor read into one
                                                            # state dict, then dcp.save(sd, OUT)

Usage::

    python scripts/bench_dcp.py --repeats 3 --json results.json
    python scripts/bench_dcp.py --ckpt runs/ckpt --workdir /tmp/dcpbench --repeats 1

Children import a copy of the ``zckpt`` package taken at the start (``bench_common.snapshot_zckpt``).
The driver needs only the standard library. All figures are warm-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# torch's in-memory route: zckpt's reader fills the state dict get_state_dict would return (the
# same plan to-dcp writes), every tensor at once; torch's own FileSystemWriter writes it.
TORCH_ROUTE = r"""
import sys, warnings
import torch.distributed.checkpoint as dcp
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.reading import FileReader
from zckpt.ops.dcp import plan_dcp, torch_state_dict
plan = plan_dcp(open_training_state(sys.argv[1]))
with FileReader() as reader:
    sd = torch_state_dict(plan, reader)
warnings.simplefilter("ignore")
dcp.save(sd, checkpoint_id=sys.argv[2])
"""

# read two DCP folders back with torch's converter and compare them
COMPARE = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
loaded = []
for folder, target in ((sys.argv[1], sys.argv[3]), (sys.argv[2], sys.argv[4])):
    dcp_to_torch_save(folder, target)
    loaded.append(torch.load(target, weights_only=False))
a, b = loaded
def same(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
assert sorted(a["model"]) == sorted(b["model"]), "model keys differ"
bad = [k for k in a["model"] if not same(a["model"][k], b["model"][k])]
assert sorted(a["optim"]["state"]) == sorted(b["optim"]["state"]), "optimizer params differ"
for n, states in a["optim"]["state"].items():
    bad += [f"{n}.{k}" for k, v in states.items() if not same(v, b["optim"]["state"][n][k])]
assert a["optim"]["param_groups"] == b["optim"]["param_groups"], "param groups differ"
assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"
print(len(a["model"]), "model tensors,", sum(len(s) for s in a["optim"]["state"].values()), "optimizer tensors: same bits")
"""


def command(variant: str, python: str, ckpt: Path, out: Path) -> list[str]:
    if variant == "cp":
        return ["cp", "-r", str(ckpt), str(out)]
    if variant == "zckpt":
        return [python, "-m", "zckpt", "to-dcp", str(ckpt), str(out), "--quiet"]
    if variant == "torch":
        return [python, "-c", TORCH_ROUTE, str(ckpt), str(out)]
    raise ValueError(variant)


def make_checkpoint(args: argparse.Namespace, python: str) -> Path:
    """A ZeRO-3 bf16 checkpoint of 2 ranks in DeepSpeed's layout, by `zckpt train` (reused)."""
    ckpt = args.workdir / f"train_l{args.layers}_d{args.dim}_v{args.vocab}" / "ckpt"
    if (ckpt / "latest").is_file():
        return ckpt
    size = ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", "16", "--vocab", str(args.vocab)]
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "zckpt", "train", "--out", str(ckpt)]
    cmd += ["--steps", "1", *size, "--seq-len", "32", "--micro-batch", "1", "--dtype", "bf16", "--quiet"]
    print("making the checkpoint:", " ".join(cmd), flush=True)
    env = {**common.child_env(), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=common.child_cwd())
    return ckpt


def read_input(ckpt: Path) -> float:
    """Read every input file once (page cache warm for the next run); seconds taken."""
    t0 = time.perf_counter()
    for path in sorted(ckpt.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                while handle.read(64 << 20):
                    pass
    return time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, help="an existing checkpoint folder (holding 'latest') to measure")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_dcp"))
    ap.add_argument("--python", default=sys.executable, help="interpreter with torch and zckpt's dependencies")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="cp,zckpt,torch")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", type=Path, help="write the runs and the summary here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = common.snapshot_zckpt(args.python, args.workdir / "zckpt_snapshot", args.workdir)
    print(common.describe_snapshot(source), flush=True)
    ckpt = args.ckpt.resolve() if args.ckpt else make_checkpoint(args, args.python)
    variants = args.variants.split(",")
    runs_dir = args.workdir / "runs"
    runs_dir.mkdir(exist_ok=True)
    input_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    print(f"input: {ckpt} ({input_bytes / 1e9:.2f} GB)", flush=True)

    if "zckpt" in variants and "torch" in variants:
        kept = {}
        for variant in ("zckpt", "torch"):
            read_input(ckpt)
            run = common.run_measured(
                variant,
                command(variant, args.python, ckpt, runs_dir / f"verify_{variant}"),
                runs_dir / f"verify_{variant}",
                runs_dir / f"verify_{variant}.log",
                0,
                0.05,
                keep=True,
            )
            if run.returncode != 0:
                sys.exit(f"{variant} failed:\n{run.log_tail}")
            kept[variant] = runs_dir / f"verify_{variant}"
        check = subprocess.run(
            [args.python, "-c", COMPARE, str(kept["zckpt"]), str(kept["torch"])]
            + [str(runs_dir / "a.pt"), str(runs_dir / "b.pt")],
            env=common.child_env(),
            cwd=common.child_cwd(),
            capture_output=True,
            text=True,
        )
        for path in (*kept.values(), runs_dir / "a.pt", runs_dir / "b.pt"):
            subprocess.run(["rm", "-rf", str(path)], check=True)
        if check.returncode != 0:
            sys.exit(f"the outputs differ:\n{check.stderr[-2000:]}")
        print("verify:", check.stdout.strip(), flush=True)

    runs = []
    for rnd in range(1, args.repeats + 1):
        for variant in variants:
            reread = read_input(ckpt)
            out = runs_dir / f"{variant}_{rnd}"
            run = common.run_measured(
                variant, command(variant, args.python, ckpt, out), out, runs_dir / f"{variant}_{rnd}.log", rnd, 0.05
            )
            runs.append(run)
            status = "ok" if run.returncode == 0 else f"FAILED ({run.returncode})"
            print(
                f"round {rnd} {variant:6s} {status}: wall {run.wall_s:6.2f} s + sync {run.sync_s:5.2f} s, "
                f"cpu {run.cpu_user_s + run.cpu_sys_s:6.2f} s, peak tree RSS {run.tree_rss_mib:7.0f} MiB, "
                f"output {run.output_bytes / 1e9:.2f} GB (input re-read {reread:.1f} s)",
                flush=True,
            )
    summary = {v: common.variant_stats(runs, v) for v in variants}
    ratios = {
        f"{a}/{b}": common.time_ratios(runs, summary, a, b)
        for a, b in (("zckpt", "cp"), ("zckpt", "torch"))
        if a in variants and b in variants
    }
    print()
    for variant, s in summary.items():
        if s:
            print(
                f"{variant:6s} wall median {s['wall_s']['median']:6.2f} s (min {s['wall_s']['min']:.2f}, max "
                f"{s['wall_s']['max']:.2f}), wall+sync {s['wall_plus_sync_s']['median']:6.2f} s, "
                f"peak tree RSS {s['tree_rss_mib']['median']:7.0f} MiB"
            )
    for name, r in ratios.items():
        if r:
            print(f"{name}: wall {r['wall']:.2f}x, wall+sync {r['wall_plus_sync']:.2f}x, cpu {r['cpu']:.2f}x")
    if args.json:
        result = {
            "argv": sys.argv,
            "machine": {"nproc": os.cpu_count(), "platform": platform.platform()},
            "zckpt_source": source,
            "input": str(ckpt),
            "input_bytes": input_bytes,
            "runs": [vars(r) for r in runs],
            "summary": summary,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

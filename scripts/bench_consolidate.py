#!/usr/bin/env python3
"""Benchmark ``zckpt consolidate`` against DeepSpeed's ``zero_to_fp32 --safe_serialization``.

What it does:

1. **Make** (once) a ZeRO-3 bf16 checkpoint of a ``--params``-sized model (default just above
   400M params: an embedding, 40 MLP blocks of width 1024/4096 and an untied LM head) with real
   DeepSpeed, 2 ranks on CPU (gloo, ``DS_ACCELERATOR=cpu``, AdamW with ``torch_adam``), one
   optimizer step, then ``save_checkpoint``. Params are created under ``deepspeed.zero.Init``
   so no rank ever holds the whole fp32 model. A complete checkpoint already in ``--workdir``
   (its ``latest`` file and our ``bench_meta.json`` exist, same ``--params``) is reused.
2. **Warm up + verify** (untimed): run each tool once, check that both outputs hold the same
   tensor names and bit-identical tensors (``safetensors.safe_open``, one tensor at a time),
   then delete them. This run also warms the page cache with the checkpoint files.
3. **Measure**: ``--repeats`` rounds of zckpt, deepspeed, zckpt, deepspeed, ... Each run is a
   subprocess writing into a fresh folder, deleted afterwards. Wall time is
   ``time.perf_counter`` around the child; peak RSS is the child's own ``ru_maxrss`` from
   ``os.wait4``. After each run (outside its wall time) ``os.sync()`` is timed too, since zckpt
   fsyncs its output before renaming it into place and ``zero_to_fp32`` does not: "wall+sync"
   is the time until the output is on disk for both.

Commands measured::

    PY -m zckpt consolidate CKPT OUT --quiet
    PY -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization

With ``--dtypes fp32,bf16,fp16`` it measures zckpt's output dtypes against each other instead
of against DeepSpeed (issue #10: 16-bit output no slower than fp32 output), alternating
``PY -m zckpt consolidate CKPT OUT --quiet --dtype D`` for each D in turn every round; the
warm-up outputs are verified against torch's ``.to()`` of the fp32 output, and the report gives
each dtype's wall time and peak RSS over fp32's (ratio of medians and median per-round ratio).

Usage::

    python scripts/bench_consolidate.py --python /work/venv-ds19/bin/python [--json out.json]
    python scripts/bench_consolidate.py --skip-make --dtypes fp32,bf16,fp16 --repeats 5

The driver itself needs only the standard library (the tools, the checkpoint maker and the
verifier run under ``--python``); it stays small on purpose, because on Linux a child's
``ru_maxrss`` can include the parent's resident size at the time of the fork.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shm_leaks import removing_shm_leaks  # noqa: E402

DEFAULT_WORKDIR = Path("/work/bench_data")
DEFAULT_PARAMS = 400_000_000
DIM = 1024
HIDDEN = 4096
VOCAB = 32000
SEQ_LEN = 8
SEED = 1234
TOOLS = ("zckpt", "deepspeed")


# --------------------------------------------------------------------------------------
# Model (shared by the driver, which only does arithmetic, and the worker)
# --------------------------------------------------------------------------------------
def block_params() -> int:
    """Parameters in one MLP block: LayerNorm + Linear(DIM, HIDDEN) + Linear(HIDDEN, DIM)."""
    return 2 * DIM + (DIM * HIDDEN + HIDDEN) + (HIDDEN * DIM + DIM)


def fixed_params() -> int:
    """Parameters outside the blocks: embedding, final LayerNorm, untied LM head."""
    return VOCAB * DIM + 2 * DIM + VOCAB * DIM


def layers_for(params: int) -> int:
    """Smallest number of blocks so that the model has at least `params` parameters."""
    return max(1, math.ceil((params - fixed_params()) / block_params()))


def total_params(n_layers: int) -> int:
    """Exact parameter count of the benchmark model with `n_layers` blocks."""
    return fixed_params() + n_layers * block_params()


def build_model(n_layers: int) -> Any:
    """The benchmark model (call under ``deepspeed.zero.Init``)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        """Pre-norm residual MLP block."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.relu(self.up(self.norm(h))))

    class BenchLM(nn.Module):
        """Embedding -> blocks -> LayerNorm -> LM head (not tied: safetensors refuses ties)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(n_layers))
            self.final_norm = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.lm_head(self.final_norm(h))

    torch.manual_seed(SEED)
    return BenchLM()


def ds_config() -> dict[str, Any]:
    """DeepSpeed config: ZeRO-3, bf16, AdamW (torch implementation, no op compilation)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "wall_clock_breakdown": False,
    }


def worker(ckpt_dir: Path, n_layers: int) -> None:
    """Per-rank entry point (under torchrun): build, one optimizer step, save_checkpoint."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config()):
        model = build_model(n_layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    t1 = time.perf_counter()
    gen = torch.Generator().manual_seed(SEED + rank)
    tokens = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=gen)
    target = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=gen)
    logits = engine(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))
    engine.backward(loss)
    engine.step()
    t2 = time.perf_counter()
    engine.save_checkpoint(str(ckpt_dir))
    dist.barrier()
    t3 = time.perf_counter()
    if rank == 0:
        print(
            f"[worker] init {t1 - t0:.1f} s, step {t2 - t1:.1f} s, save {t3 - t2:.1f} s, loss {loss.item():.4f}",
            flush=True,
        )


# --------------------------------------------------------------------------------------
# Driver helpers
# --------------------------------------------------------------------------------------
def free_port() -> int:
    """A currently free TCP port for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tool_env(extensions_dir: Path | None = None) -> dict[str, str]:
    """Environment for a child: CPU accelerator for DeepSpeed, optionally a private JIT cache.

    DeepSpeed JIT-builds ``deepspeed_shm_comm`` into torch's extension cache when it starts its
    comm backend; the default cache (``~/.cache/torch_extensions/py311_cpu``) is shared by every
    venv with the same torch, so a build by another DeepSpeed release can be picked up (seen
    here: "module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'").
    """
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    if extensions_dir is not None:
        extensions_dir.mkdir(parents=True, exist_ok=True)
        env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def dir_size(path: Path) -> int:
    """Total size in bytes of the regular files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def checkpoint_complete(ckpt_dir: Path, meta_path: Path, params: int) -> bool:
    """True when a finished checkpoint of the requested size is already there."""
    if not (ckpt_dir / "latest").is_file() or not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("requested_params") == params


def make_checkpoint(python: str, ckpt_dir: Path, meta_path: Path, params: int) -> dict[str, Any]:
    """Run the 2-rank DeepSpeed job that writes the checkpoint; return its metadata."""
    n_layers = layers_for(params)
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    meta_path.unlink(missing_ok=True)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    log = ckpt_dir.parent / "make_checkpoint.log"
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        "--ckpt-dir",
        str(ckpt_dir),
        "--layers",
        str(n_layers),
    ]
    print(f"making checkpoint: {total_params(n_layers):,} params ({n_layers} blocks), log in {log}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh, removing_shm_leaks():
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.run(
            cmd, env=tool_env(ckpt_dir.parent / "torch_extensions"), stdout=fh, stderr=subprocess.STDOUT
        )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not (ckpt_dir / "latest").is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        sys.exit(f"checkpoint job failed (exit {proc.returncode}):\n{tail}")
    meta = {
        "requested_params": params,
        "params": total_params(n_layers),
        "layers": n_layers,
        "dim": DIM,
        "hidden": HIDDEN,
        "vocab": VOCAB,
        "ds_config": ds_config(),
        "world_size": 2,
        "make_seconds": round(seconds, 1),
        "made_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": cmd,
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"checkpoint made in {seconds:.1f} s", flush=True)
    return meta


def checkpoint_facts(ckpt_dir: Path) -> dict[str, Any]:
    """Tag, file sizes and total size of the checkpoint on disk."""
    tag = (ckpt_dir / "latest").read_text().strip()
    files = {str(p.relative_to(ckpt_dir)): p.stat().st_size for p in sorted(ckpt_dir.rglob("*")) if p.is_file()}
    return {
        "path": str(ckpt_dir),
        "tag": tag,
        "total_bytes": sum(files.values()),
        "tag_bytes": dir_size(ckpt_dir / tag),
        "files": files,
    }


def warm_page_cache(ckpt_dir: Path) -> float:
    """Read every checkpoint file once (1 MiB chunks); return seconds taken."""
    t0 = time.perf_counter()
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file():
            with p.open("rb", buffering=0) as fh:
                while fh.read(1 << 20):
                    pass
    return time.perf_counter() - t0


def tool_command(tool: str, python: str, ckpt_dir: Path, out_dir: Path) -> list[str]:
    """The exact command line measured for `tool` ("zckpt", "zckpt:bf16", "deepspeed")."""
    if tool.startswith("zckpt"):
        dtype = tool.partition(":")[2]
        return [
            python,
            "-m",
            "zckpt",
            "consolidate",
            str(ckpt_dir),
            str(out_dir),
            "--quiet",
            *(["--dtype", dtype] if dtype else []),
        ]
    return [python, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt_dir), str(out_dir), "--safe_serialization"]


@dataclass
class Run:
    """One measured run of one tool."""

    tool: str
    round: int
    wall_s: float
    sync_s: float
    peak_rss_mib: float
    returncode: int
    output_bytes: int
    output_files: list[str] = field(default_factory=list)
    log_tail: str = ""
    disturbed: bool = False  # a fixture-generation job was seen just before or after the run


def run_measured(tool: str, cmd: list[str], out_dir: Path, log: Path, rnd: int, keep: bool = False) -> Run:
    """Run `cmd` as a child; wall time around it, peak RSS from os.wait4, then time os.sync()."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    busy = bool(busy_processes())
    with log.open("w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=tool_env(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it has been reaped
    t1 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t1
    files = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()) if out_dir.exists() else []
    out_bytes = dir_size(out_dir) if out_dir.exists() else 0
    tail = ""
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    if not keep and out_dir.exists():
        shutil.rmtree(out_dir)
        os.sync()
    busy = busy or bool(busy_processes())
    return Run(tool, rnd, wall, sync_s, usage.ru_maxrss / 1024.0, proc.returncode, out_bytes, files, tail, busy)


VERIFY_CODE = r"""
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open

def names(d):
    m = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                m[k] = f
    return m

a, b = names(sys.argv[1]), names(sys.argv[2])
only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
diff, nbytes, dtypes = [], 0, {}
for k in sorted(set(a) & set(b)):
    with safe_open(str(a[k]), framework="pt") as ha:
        x = ha.get_tensor(k)
    with safe_open(str(b[k]), framework="pt") as hb:
        y = hb.get_tensor(k)
    same = (x.dtype == y.dtype and x.shape == y.shape
            and torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                            y.contiguous().reshape(-1).view(torch.uint8)))
    if not same:
        diff.append(k)
    nbytes += x.numel() * x.element_size()
    dtypes[str(x.dtype)] = dtypes.get(str(x.dtype), 0) + 1
    del x, y
print(json.dumps({"tensors_a": len(a), "tensors_b": len(b), "only_in_zckpt": only_a[:20],
                  "only_in_deepspeed": only_b[:20], "different": diff[:20],
                  "n_different": len(diff), "bytes_compared": nbytes, "dtypes": dtypes,
                  "identical": not only_a and not only_b and not diff and len(a) > 0}))
"""


VERIFY_DTYPE_CODE = r"""
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open

def names(d):
    m = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                m[k] = f
    return m

# argv: the fp32 output, then the 16-bit outputs (folders named ...zckpt:DTYPE)
ref = names(sys.argv[1])
report = {}
for out in sys.argv[2:]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[out.rsplit(":", 1)[1]]
    got = names(out)
    diff, nbytes = [], 0
    for k in sorted(set(ref) & set(got)):
        with safe_open(str(ref[k]), framework="pt") as h:
            x = h.get_tensor(k)
        with safe_open(str(got[k]), framework="pt") as h:
            y = h.get_tensor(k)
        x = x.to(dtype) if x.is_floating_point() else x
        same = (x.dtype == y.dtype and x.shape == y.shape
                and torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                                y.contiguous().reshape(-1).view(torch.uint8)))
        if not same:
            diff.append(k)
        nbytes += y.numel() * y.element_size()
        del x, y
    report[out] = {"tensors": len(got), "same_names": set(got) == set(ref), "different": diff[:20],
                   "bytes_compared": nbytes}
print(json.dumps({"identical": all(r["same_names"] and not r["different"] and r["tensors"]
                                   for r in report.values()), "outputs": report}))
"""


def verify_dtype_outputs(python: str, fp32_out: Path, others: list[Path]) -> dict[str, Any]:
    """Each 16-bit output must equal torch's ``.to()`` of the fp32 output (in a child)."""
    proc = subprocess.run(
        [python, "-c", VERIFY_DTYPE_CODE, str(fp32_out), *map(str, others)],
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"identical": False, "error": proc.stderr.strip().splitlines()[-5:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verify_outputs(python: str, zckpt_out: Path, ds_out: Path) -> dict[str, Any]:
    """Compare the two outputs tensor by tensor (in a child running `python`)."""
    proc = subprocess.run(
        [python, "-c", VERIFY_CODE, str(zckpt_out), str(ds_out)], env=tool_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"identical": False, "error": proc.stderr.strip().splitlines()[-5:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_facts(python: str) -> dict[str, Any]:
    """CPU count, RAM, CPU model, kernel and package versions (read under `python`)."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    code = (
        "import json, platform, importlib.metadata as m\n"
        "v = {}\n"
        "for p in ('torch', 'deepspeed', 'zckpt', 'safetensors', 'numpy'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except Exception: v[p] = None\n"
        "v['python'] = platform.python_version()\n"
        "print(json.dumps(v))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    versions = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-300:]}
    return {
        "nproc": os.cpu_count(),
        "nproc_affinity": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(mem_kib / 2**20, 1),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "versions": versions,
        "tool_python": python,
    }


def busy_processes() -> list[str]:
    """Other heavy jobs we know of that would disturb the timings (fixture generation)."""
    proc = subprocess.run(["pgrep", "-af", "make_sample_ckpts"], capture_output=True, text=True)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def wait_until_idle(max_wait_s: float, poll_s: float = 5.0) -> float:
    """Wait (at most `max_wait_s`) until no fixture-generation job runs; return seconds waited."""
    t0 = time.perf_counter()
    while busy_processes() and time.perf_counter() - t0 < max_wait_s:
        time.sleep(poll_s)
    return time.perf_counter() - t0


def summarize(runs: list[Run], tools: tuple[str, ...] = TOOLS) -> dict[str, Any]:
    """Median / min / max of wall, wall+sync and peak RSS per tool, plus the ratios."""
    out: dict[str, Any] = {}
    for tool in tools:
        rs = [r for r in runs if r.tool == tool and r.returncode == 0]
        if not rs:
            out[tool] = None
            continue
        walls = [r.wall_s for r in rs]
        durable = [r.wall_s + r.sync_s for r in rs]
        rss = [r.peak_rss_mib for r in rs]
        out[tool] = {
            "ok_runs": len(rs),
            "failed_runs": sum(1 for r in runs if r.tool == tool and r.returncode != 0),
            "wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
            "wall_plus_sync_s": {"median": statistics.median(durable), "min": min(durable), "max": max(durable)},
            "peak_rss_mib": {"median": statistics.median(rss), "min": min(rss), "max": max(rss)},
        }
    if tools != TOOLS:
        out["ratio_over_first"] = dtype_ratios(runs, tools, out)
        return out
    z, d = out.get("zckpt"), out.get("deepspeed")
    if z and d:
        out["ratio_zckpt_over_deepspeed"] = {
            "wall": z["wall_s"]["median"] / d["wall_s"]["median"],
            "wall_plus_sync": z["wall_plus_sync_s"]["median"] / d["wall_plus_sync_s"]["median"],
            "peak_rss": z["peak_rss_mib"]["median"] / d["peak_rss_mib"]["median"],
        }
        out["target_met"] = {
            "time_le_0.5x": out["ratio_zckpt_over_deepspeed"]["wall"] <= 0.5,
            "rss_le_0.5x": out["ratio_zckpt_over_deepspeed"]["peak_rss"] <= 0.5,
        }
    return out


def dtype_ratios(runs: list[Run], tools: tuple[str, ...], stats: dict[str, Any]) -> dict[str, Any]:
    """Each tool's wall, wall+sync and peak RSS over the first tool's (fp32): the ratio of the
    medians, and the median of the per-round ratios (both runs of a round saw the same load)."""
    base = tools[0]
    by_round = {(r.tool, r.round): r for r in runs if r.returncode == 0}
    ratios: dict[str, Any] = {}
    for tool in tools[1:]:
        if not stats.get(tool) or not stats.get(base):
            continue
        rounds = [
            (by_round[(tool, n)], by_round[(base, n)]) for (t, n) in by_round if t == tool and (base, n) in by_round
        ]
        ratios[tool] = {
            "wall": stats[tool]["wall_s"]["median"] / stats[base]["wall_s"]["median"],
            "wall_per_round_median": statistics.median(a.wall_s / b.wall_s for a, b in rounds),
            "wall_plus_sync": stats[tool]["wall_plus_sync_s"]["median"] / stats[base]["wall_plus_sync_s"]["median"],
            "peak_rss": stats[tool]["peak_rss_mib"]["median"] / stats[base]["peak_rss_mib"]["median"],
            "target_met": {  # issue #10: no slower than fp32 output, under 200 MB of peak RSS
                "wall_le_1x": stats[tool]["wall_s"]["median"] <= stats[base]["wall_s"]["median"],
                "rss_lt_200MB": stats[tool]["peak_rss_mib"]["max"] * 2**20 < 200e6,
            },
        }
    return ratios


def print_report(result: dict[str, Any]) -> None:
    """The human-readable table."""
    s, f, c = result["summary"], result["machine"], result["checkpoint"]
    v = f["versions"]
    print()
    print("=" * 78)
    print(f"command: {' '.join(result['argv'])}")
    print(
        f"machine: {f['nproc']} CPUs ({f['nproc_affinity']} usable), {f['mem_total_gib']} GiB RAM, "
        f"{f['cpu_model']}, Linux {f['kernel']}"
    )
    print(
        f"versions: python {v.get('python')}, torch {v.get('torch')}, deepspeed {v.get('deepspeed')}, "
        f"zckpt {v.get('zckpt')}, safetensors {v.get('safetensors')}"
    )
    print(
        f"checkpoint: {c['path']} ({c['tag']}), {result['model']['params']:,} params, ZeRO-3 bf16, "
        f"2 ranks; {c['total_bytes'] / 1e9:.2f} GB on disk ({c['tag_bytes'] / 1e9:.2f} GB in tag)"
    )
    print(f"page cache: warmed by reading all files ({result['warm_read_s']:.1f} s) and one untimed run of each tool")
    tools = tuple(result.get("tools", TOOLS))
    print(
        f"rounds: {result['repeats']} (alternating {' / '.join(tools)}); load average before/after: "
        f"{result['loadavg_before']} / {result['loadavg_after']}"
    )
    if result["busy_during_measurement"]:
        print("WARNING: other heavy jobs ran during the measurement:")
        for line in result["busy_during_measurement"]:
            print(f"  {line}")
    print()
    for tool in tools:
        print(f"  {tool:10s}: {' '.join(tool_command(tool, f['tool_python'], Path('CKPT'), Path('OUT'))[1:])}")
    print()
    hdr = (
        f"{'tool':11s} {'runs':>4s} {'wall med':>9s} {'min':>7s} {'max':>7s} "
        f"{'wall+sync med':>14s} {'peak RSS med':>14s} {'min':>7s} {'max':>7s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for tool in tools:
        t = s.get(tool)
        if not t:
            print(f"{tool:11s} all runs failed")
            continue
        w, ws, r = t["wall_s"], t["wall_plus_sync_s"], t["peak_rss_mib"]
        print(
            f"{tool:11s} {t['ok_runs']:>4d} {w['median']:>8.2f}s {w['min']:>6.2f}s {w['max']:>6.2f}s "
            f"{ws['median']:>13.2f}s {r['median']:>10.0f} MiB {r['min']:>7.0f} {r['max']:>7.0f}"
        )
    for tool, q in s.get("ratio_over_first", {}).items():
        tm = q["target_met"]
        print(
            f"{tool} / {tools[0]}: wall {q['wall']:.2f}x (per-round median {q['wall_per_round_median']:.2f}x; "
            f"{'meets' if tm['wall_le_1x'] else 'MISSES'} <= 1x), wall+sync {q['wall_plus_sync']:.2f}x, "
            f"peak RSS {q['peak_rss']:.2f}x ({'meets' if tm['rss_lt_200MB'] else 'MISSES'} < 200 MB)"
        )
    ratio = s.get("ratio_zckpt_over_deepspeed")
    if ratio:
        tm = s["target_met"]
        print()
        print(
            f"zckpt / deepspeed: wall {ratio['wall']:.2f}x "
            f"({'meets' if tm['time_le_0.5x'] else 'MISSES'} <= 0.5x), "
            f"wall+sync {ratio['wall_plus_sync']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x "
            f"({'meets' if tm['rss_le_0.5x'] else 'MISSES'} <= 0.5x)"
        )
    ver = result["verification"]
    print()
    if ver.get("identical") and "outputs" in ver:
        for out, o in ver["outputs"].items():
            print(
                f"verification: {Path(out).name} equals torch's .to() of the fp32 output - "
                f"{o['tensors']} tensors, same names, {o['bytes_compared'] / 1e9:.2f} GB compared"
            )
    elif ver.get("identical"):
        print(
            f"verification: identical - {ver['tensors_a']} tensors, same names, bit-identical "
            f"({ver['bytes_compared'] / 1e9:.2f} GB compared, dtypes {ver['dtypes']})"
        )
    else:
        print(f"verification: NOT identical - {json.dumps(ver)}")
    for tool, files in result["output_files"].items():
        print(f"  {tool} wrote: {', '.join(files)}")
    for r in result["runs"]:
        if r["returncode"] != 0:
            print(f"\n{r['tool']} round {r['round']} failed (exit {r['returncode']}):\n{r['log_tail']}")
    print(f"(driver's own peak RSS: {result['driver_peak_rss_mib']:.0f} MiB; a child's ru_maxrss can include it)")
    print("=" * 78)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help=f"where the checkpoint and the run outputs live (default {DEFAULT_WORKDIR})",
    )
    p.add_argument(
        "--params",
        type=int,
        default=DEFAULT_PARAMS,
        help="minimum model size in params (default %(default)s; rounded up to whole blocks)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each tool (default 3)")
    p.add_argument(
        "--python", default=sys.executable, help="interpreter with torch, deepspeed and zckpt (default: this one)"
    )
    p.add_argument(
        "--skip-make", action="store_true", help="never make the checkpoint; fail if no complete one is in --workdir"
    )
    p.add_argument("--remake", action="store_true", help="make the checkpoint even if one exists")
    p.add_argument("--make-only", action="store_true", help="make (or reuse) the checkpoint and stop")
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    p.add_argument(
        "--dtypes",
        metavar="LIST",
        help="measure zckpt's output dtypes against each other instead of against DeepSpeed, "
        "e.g. fp32,bf16,fp16 (the first is the baseline of the ratios)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long while a make_sample_ckpts job runs "
        "(default 0: do not wait; runs next to one are flagged either way)",
    )
    # worker mode (started by torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args, _unknown = p.parse_known_args(argv)  # torchrun may append --local-rank
    return args


def main(argv: list[str] | None = None) -> int:
    """Make/reuse the checkpoint, warm up and verify, measure, print (and save) the results."""
    args = parse_args(argv)
    if args.worker:
        worker(args.ckpt_dir, args.layers)
        return 0

    workdir: Path = args.workdir.resolve()
    ckpt_dir = workdir / f"z3_bf16_ws2_{args.params}" / "checkpoint"
    meta_path = ckpt_dir.parent / "bench_meta.json"
    if args.remake or not checkpoint_complete(ckpt_dir, meta_path, args.params):
        if args.skip_make:
            sys.exit(f"--skip-make given but no complete checkpoint at {ckpt_dir}")
        meta = make_checkpoint(args.python, ckpt_dir, meta_path, args.params)
    else:
        meta = json.loads(meta_path.read_text())
        print(f"reusing checkpoint {ckpt_dir} (made in {meta['make_seconds']} s on {meta['made_at']})")
    ckpt = checkpoint_facts(ckpt_dir)
    if args.make_only:
        print(json.dumps({"checkpoint": {k: v for k, v in ckpt.items() if k != "files"}, "model": meta}, indent=2))
        return 0

    facts = machine_facts(args.python)
    runs_dir = workdir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    busy_before = busy_processes()
    if busy_before:
        print(
            "note: fixture generation is running"
            f"{f'; waiting up to {args.wait_idle:.0f} s before each run' if args.wait_idle else '; timings will be disturbed'}:",
            *busy_before,
            sep="\n  ",
        )

    print("warming page cache ...", flush=True)
    wait_until_idle(args.wait_idle)
    warm_s = warm_page_cache(ckpt_dir)
    tools = tuple(f"zckpt:{d}" for d in args.dtypes.split(",")) if args.dtypes else TOOLS
    print("untimed warm-up run of each tool, then verification ...", flush=True)
    warm_runs: dict[str, Run] = {}
    for tool in tools:
        out = runs_dir / f"warm_{tool}"
        wait_until_idle(args.wait_idle)
        warm_runs[tool] = run_measured(
            tool, tool_command(tool, args.python, ckpt_dir, out), out, runs_dir / f"warm_{tool}.log", 0, keep=True
        )
        print(
            f"  warm-up {tool}: {warm_runs[tool].wall_s:.2f} s, {warm_runs[tool].peak_rss_mib:.0f} MiB, "
            f"exit {warm_runs[tool].returncode}",
            flush=True,
        )
    if not all(r.returncode == 0 for r in warm_runs.values()):
        verification = {
            "identical": False,
            "error": "a warm-up run failed",
            "tails": {t: r.log_tail for t, r in warm_runs.items() if r.returncode},
        }
    elif args.dtypes:
        outs = [runs_dir / f"warm_{t}" for t in tools]
        verification = verify_dtype_outputs(args.python, outs[0], outs[1:])
    else:
        verification = verify_outputs(args.python, runs_dir / "warm_zckpt", runs_dir / "warm_deepspeed")
    print(f"  verification: {'identical' if verification.get('identical') else 'NOT identical'}", flush=True)
    for tool in tools:
        shutil.rmtree(runs_dir / f"warm_{tool}", ignore_errors=True)
    os.sync()

    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    runs: list[Run] = []
    for rnd in range(1, args.repeats + 1):
        for tool in tools:
            out = runs_dir / f"{tool}_{rnd}"
            waited = wait_until_idle(args.wait_idle)
            if waited > 1:
                print(f"  (waited {waited:.0f} s for fixture generation to finish)", flush=True)
            r = run_measured(
                tool, tool_command(tool, args.python, ckpt_dir, out), out, runs_dir / f"{tool}_{rnd}.log", rnd
            )
            runs.append(r)
            print(
                f"  round {rnd} {tool:9s}: wall {r.wall_s:6.2f} s (+sync {r.sync_s:5.2f} s), "
                f"peak RSS {r.peak_rss_mib:6.0f} MiB, exit {r.returncode}"
                f"{'  (DISTURBED: fixture generation running)' if r.disturbed else ''}",
                flush=True,
            )
    loadavg_after = [round(x, 2) for x in os.getloadavg()]
    busy = [
        f"round {r.round} {r.tool}: a make_sample_ckpts job was running just before or after it"
        for r in runs
        if r.disturbed
    ]

    result: dict[str, Any] = {
        "argv": [sys.executable, *sys.argv] if argv is None else ["bench_consolidate.py", *argv],
        "machine": facts,
        "model": meta,
        "checkpoint": ckpt,
        "repeats": args.repeats,
        "warm_read_s": warm_s,
        "warmup_runs": [asdict(r) for r in warm_runs.values()],
        "verification": verification,
        "output_files": {t: r.output_files for t, r in warm_runs.items()},
        "runs": [asdict(r) for r in runs],
        "tools": list(tools),
        "summary": summarize(runs, tools),
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg_after,
        "busy_during_measurement": busy,
        "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "commands": {t: tool_command(t, args.python, ckpt_dir, Path("OUT")) for t in tools},
    }
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.json}")
    ok = verification.get("identical") and all(r.returncode == 0 for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

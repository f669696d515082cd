#!/usr/bin/env python3
"""Run a model whose token embedding is much larger than its other layers under ZeRO-3 with
``offload_param`` and ``offload_optimizer`` on NVMe (real DeepSpeed, CPU, gloo): the issue's
Qwen3-0.6B report scaled down, to check ``zckpt nvme-plan``'s settings against DeepSpeed itself.

Three modes:

* ``--write-weights FILE``: save the model's weights as safetensors (torch only, no DeepSpeed), the
  MODEL that ``zckpt nvme-plan`` plans from;
* the **driver** (``--config CFG.json --out DIR [--gather] [--world-size N]``, stdlib only): launches
  ``python -m torch.distributed.run`` with the workers and removes the /dev/shm buffers they leak;
* the **per-rank worker** (``--worker``, started by torchrun): builds the model under
  ``deepspeed.zero.Init`` (params partitioned and swapped out as they are created), optionally
  gathers every param at once as transformers and PEFT do at init under ZeRO-3
  (``GatheredParameters(list(model.parameters()))``), then ``deepspeed.initialize``, trains a few
  steps and saves a checkpoint. Each rank writes ``rank<R>.json``: what DeepSpeed decided for
  every param (partition size, swapped or not), its swap-buffer sizes, the swap folder's files,
  and the losses, or the error it raised.

    python scripts/nvme_plan_run.py --write-weights /tmp/m/model.safetensors
    zckpt nvme-plan /tmp/m --world-size 2 --json > plan.json
    python scripts/nvme_plan_run.py --config cfg.json --out /tmp/run --gather
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shm_leaks import removing_shm_leaks  # noqa: E402

VOCAB = 8192  # the embedding: 8M elements, 8x any other layer
DIM = 1024  # hidden layers of DIM x DIM = 1M elements: at 2 ranks, bf16, exactly DeepSpeed's 1 MiB swap threshold
LAYERS = 6
CLASSES = 64  # a small head, so that the embedding stays the one large tensor
SEQ = 8
MICRO_BATCH = 2
STEPS = 2
SEED = 1234
NVME_PATH = "@NVME_PATH@"  # in a config: replaced by the worker with --nvme


def build_model() -> Any:
    import torch
    from torch import nn

    class BigEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            return self.head(self.norm(h).mean(dim=1))

    torch.manual_seed(SEED)
    return BigEmbedding()


def write_weights(path: Path) -> None:
    """The model's weights (bf16, as the ZeRO-3 run holds them) as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    model = build_model()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}, str(path))


def resolve_config(config: dict, nvme: str) -> dict:
    """The config with the NVMe placeholder replaced by this run's swap folder."""
    return json.loads(json.dumps(config).replace(NVME_PATH, str(nvme)))


def swap_facts(model: Any) -> dict[str, Any]:
    """What DeepSpeed decided at zero.Init: per param its partition and whether it went to NVMe."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    params = {}
    swapper = None
    for name, p in model.named_parameters():
        params[name] = {
            "numel": p.ds_numel,
            "partition_numel": p.ds_tensor.ds_numel,
            "swapped": p.ds_tensor.final_location == OffloadDeviceEnum.nvme,
        }
        swapper = swapper or getattr(p, "nvme_swapper", None)
    facts: dict[str, Any] = {"params": params}
    if swapper is not None:
        facts["param_swapper"] = {
            "elements_per_buffer": swapper.elements_per_buffer,
            "aligned_elements_per_buffer": swapper.aligned_elements_per_buffer,
            "buffer_count": swapper.param_buffer_count,
            "pinned_elements": swapper.buffers.numel(),
            "element_size": swapper.swap_element_size,
            "min_aio_bytes": swapper.min_aio_bytes,
            "numel_alignment": swapper.numel_alignment,
        }
    return facts


def folder_listing(root: Path) -> dict[str, int]:
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


def worker(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    result: dict[str, Any] = {"rank": rank, "stage": "init"}
    try:
        import deepspeed
        import deepspeed.comm as dist
        import torch

        deepspeed.init_distributed(dist_backend="gloo")
        config = resolve_config(json.loads(Path(args.config).read_text()), args.nvme)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model()
        result.update(swap_facts(model))
        if args.gather:
            result["stage"] = "gather"
            # what transformers/PEFT do at init under ZeRO-3: every param gathered at once
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                result["gathered_numel"] = sum(p.numel() for p in model.parameters())
        result["stage"] = "initialize"
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters()], config=config
        )
        opt = engine.optimizer
        result["optimizer_swapper"] = None
        swapper = getattr(opt, "optimizer_swapper", None)
        if swapper is not None:
            manager = swapper.swap_buffer_manager
            result["optimizer_swapper"] = {
                "buffer_count": manager.count,
                "buffer_numel": manager.num_elems,
                "largest_numel": swapper.largest_numel,
                "sub_group_partition_numels": list(opt.fp16_partitioned_groups_flat_numel),
                "sub_groups_swapped": [
                    bool(opt._swappable_optimizer_subgroup(i))
                    for i in range(len(opt.fp16_partitioned_groups_flat_numel))
                ],
            }
        result["stage"] = "train"
        gen = torch.Generator().manual_seed(SEED + rank)
        losses = []
        for _ in range(STEPS):
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
            target = torch.randint(0, CLASSES, (MICRO_BATCH,), generator=gen)
            loss = torch.nn.functional.cross_entropy(engine(tokens).float(), target)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        result["losses"] = losses
        dist.barrier()
        result["swap_folder"] = folder_listing(Path(args.nvme) / "zero_stage_3")
        dist.barrier()
        result["stage"] = "save"
        engine.save_checkpoint(str(out / "checkpoint"))
        result["stage"] = "done"
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded for the test, then re-raised as an exit status
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(python: str, config: Path, out: Path, nvme: Path, world_size: int, gather: bool) -> list[str]:
    """The torchrun command line of a run (the tests launch it with their own log and timeout)."""
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        "--config",
        str(config),
        "--out",
        str(out),
        "--nvme",
        str(nvme),
    ]
    return cmd + (["--gather"] if gather else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-weights", type=Path)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--nvme", type=Path)
    parser.add_argument("--gather", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--python", default=sys.executable)
    args, _ = parser.parse_known_args()  # torchrun may append --local_rank
    if args.write_weights:
        write_weights(args.write_weights)
        return 0
    if args.worker:
        return worker(args)
    if not (args.config and args.out):
        parser.error("give --write-weights FILE, or --config and --out")
    args.out.mkdir(parents=True, exist_ok=True)
    nvme = args.nvme or args.out / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with removing_shm_leaks():
        return subprocess.run(
            launch_command(args.python, args.config, args.out, nvme, args.world_size, args.gather), env=env
        ).returncode


if __name__ == "__main__":
    sys.exit(main())

"""Round-trip verification: train -> save -> consolidate / reshard / universal -> resume at
another world size, each result compared with what it must equal.

1. World size A trains k steps, saves, and (the reference) goes on m more steps uninterrupted.
2. zckpt's consolidation of the checkpoint equals the fp32 masters the ranks held: bit for bit.
3. The checkpoint is resharded to world size B and converted to universal.
4. World size B resumes from each (micro-batch scaled so the global batch is the same): the
   masters and Adam moments it loads equal those saved, bit for bit; the two resumed runs are
   identical to each other; their m losses equal the uninterrupted run's within a relative
   tolerance (the gradient is reduced in another order at another world size: rounding only;
   bf16 compute rounds gradients at other points), their final masters within lr per step.

With NVMe offload (`nvme`), every run keeps the big sub-groups' optimizer state in its own swap
folder, the checkpoint holds them in ``offloaded_tensors/`` (checked: one folder per rank, the
files the live swap folder holds), and the resumes load them into their swap folders.

Each phase runs its ranks as processes on gloo (torch.multiprocessing), so the comparison is of
real distributed runs; the caller gets a :class:`RoundtripReport` and prints it. They compute
on CPU on any machine: the bit-for-bit checks need deterministic kernels, which CUDA's
embedding backward (atomic adds) is not.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ..core.errors import UsageError
from .config import TrainConfig
from .loop import Trainer
from .ranks import run_ranks

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}  # relative, the losses after the resume


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class RoundtripReport:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def on_ranks(world: int, folder: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(rank, world, *args) on `world` gloo ranks, one process each; what rank 0 returned."""
    return run_ranks(world, folder, fn, *args)[0]


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every trainable param's fp32 master and Adam moments, gathered (a collective)."""
    out = {}
    for index, spec in enumerate(trainer.plan.params):
        if spec.trainable:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                out[f"{spec.name}.{key}"] = trainer.optimizer.full_state(index, key).clone()
    return out


def _swap_files(trainer: Trainer) -> list[str]:
    """The files of this rank's live swap folder (none without NVMe offload)."""
    swapper = trainer.optimizer.swapper
    return sorted(os.path.basename(p) for paths in swapper.paths.values() for p in paths) if swapper is not None else []


def _train_save_continue(rank: int, world: int, config: TrainConfig, save_at: int) -> dict:
    trainer = Trainer(config)
    losses, saved = [], {}
    while trainer.global_steps < config.steps:
        losses.append(trainer.train_step().loss)
        if trainer.global_steps == save_at:
            trainer.save()
            saved = _state(trainer)
    swap_files, final = _swap_files(trainer), _state(trainer)
    trainer.close()
    return {"losses": losses, "saved": saved, "final": final, "swap_files": swap_files}


def _resume(rank: int, world: int, config: TrainConfig) -> dict:
    trainer = Trainer(config)
    loaded = _state(trainer)
    start = trainer.global_steps
    losses = [trainer.train_step().loss for _ in range(config.steps - start)]
    swapped, swapped_params = len(trainer.optimizer.swapped), len(trainer.model.store.swapped)
    final = _state(trainer)
    trainer.close()
    return {
        "start": start,
        "loaded": loaded,
        "losses": losses,
        "final": final,
        "swapped": swapped,
        "swapped_params": swapped_params,
    }


def _nvme(config: TrainConfig, work_dir: str, run: str, nvme: bool, nvme_params: bool) -> TrainConfig:
    return replace(
        config, nvme_path=os.path.join(work_dir, f"nvme_{run}") if nvme else None, nvme_params=nvme and nvme_params
    )


def roundtrip(
    config: TrainConfig,
    from_world: int,
    to_world: int,
    save_at: int,
    work_dir: str | None = None,
    nvme: bool = False,
    nvme_params: bool = False,
) -> RoundtripReport:
    """Run the round trip for `config` (its `steps` is the end of the run; the checkpoint is at
    `save_at`); `config.micro_batch` is the micro-batch at `from_world`; with `nvme`, every run
    offloads its optimizer state and gradients (with `nvme_params` its params too) to a swap
    folder of its own under the work folder."""
    from ..ops.api import load_state_dict
    from ..ops.reshard import reshard
    from ..ops.universal import to_universal

    if not 0 < save_at < config.steps:
        raise UsageError(None, f"the save step must lie inside the run: 0 < {save_at} < {config.steps}")
    if (config.micro_batch * from_world) % to_world:
        raise UsageError(
            None, f"a global batch of {config.micro_batch * from_world} sequences cannot be split over {to_world} ranks"
        )
    config = replace(config, device="cpu")
    own_dir = work_dir or tempfile.mkdtemp(prefix="zckpt-roundtrip-")
    ckpt = os.path.join(own_dir, "ckpt")
    first = on_ranks(
        from_world,
        os.path.join(own_dir, "run_a"),
        _train_save_continue,
        _nvme(replace(config, out=ckpt, resume=None, save_every=0), own_dir, "a", nvme, nvme_params),
        save_at,
    )
    checks: list[Check] = []
    if nvme:
        tag_dir = os.path.join(ckpt, f"global_step{save_at}", "offloaded_tensors")
        held = sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []
        saved_files = sorted(os.listdir(os.path.join(tag_dir, "rank00"))) if "rank00" in held else []
        ok = (
            held == [f"rank{r:02d}" for r in range(from_world)]
            and bool(first["swap_files"])
            and saved_files == first["swap_files"]
        )
        checks.append(
            Check(
                f"checkpoint holds offloaded_tensors/ of the {from_world} ranks",
                ok,
                f"{len(saved_files)} swap files per rank, named as the live swap folder's"
                if ok
                else f"found {held}, rank 0: {saved_files} vs live {first['swap_files']}",
            )
        )

    weights = load_state_dict(ckpt)
    masters = {k[: -len(".master")]: v for k, v in first["saved"].items() if k.endswith(".master")}
    differing = [n for n, t in masters.items() if not torch.equal(weights[n], t)]
    checks.append(
        Check(
            f"consolidate == masters held by the {from_world} ranks",
            not differing,
            f"{len(masters)} params equal bit for bit" if not differing else f"differ: {', '.join(differing[:3])}",
        )
    )

    resharded, universal = os.path.join(own_dir, f"ws{to_world}"), os.path.join(own_dir, "universal")
    reshard(ckpt, resharded, world_size=to_world)
    to_universal(ckpt, universal)
    later = replace(config, micro_batch=config.micro_batch * from_world // to_world, save_every=0)
    resumed = {
        kind: on_ranks(
            to_world,
            os.path.join(own_dir, f"run_b_{kind}"),
            _resume,
            _nvme(replace(later, resume=path, out=None), own_dir, f"b_{kind}", nvme, nvme_params),
        )
        for kind, path in (("resharded", resharded), ("universal", universal))
    }
    tolerance = TOLERANCE[config.dtype]
    reference_losses = first["losses"][save_at:]
    for kind, run in resumed.items():
        differing = [n for n, t in first["saved"].items() if not torch.equal(run["loaded"][n], t)]
        params = f" and {run['swapped_params']} param(s)" if nvme_params else ""
        swapped = f", {run['swapped']} sub-group(s){params} per rank on NVMe" if nvme else ""
        on_nvme = (run["swapped"] > 0 and (run["swapped_params"] > 0 or not nvme_params)) or not nvme
        checks.append(
            Check(
                f"{kind} at {to_world} ranks loads the saved state",
                not differing and run["start"] == save_at and on_nvme,
                f"step {run['start']}, {len(first['saved'])} masters/moments equal bit for bit{swapped}"
                if not differing
                else f"differ: {', '.join(differing[:3])}",
            )
        )
        worst = max((abs(a - b) / abs(b) for a, b in zip(run["losses"], reference_losses)), default=0.0)
        checks.append(
            Check(
                f"{kind}: {len(run['losses'])} losses vs uninterrupted {from_world}-rank run",
                worst <= tolerance and len(run["losses"]) == len(reference_losses),
                f"max relative difference {worst:.2e} (tolerance {tolerance:g})",
            )
        )
        # Adam moves every element by about lr per step whatever its gradient's size, so an element
        # whose gradient nearly cancels can move either way after a rounding-level change: the
        # bound on the masters is absolute, lr per step since the resume
        bound = config.lr * len(reference_losses)
        worst = max(
            (run["final"][n] - t).abs().max().item() for n, t in first["final"].items() if n.endswith(".master")
        )
        checks.append(
            Check(
                f"{kind}: final masters vs uninterrupted run",
                worst <= bound,
                f"max difference {worst:.2e} (bound: lr x steps = {bound:.1e})",
            )
        )
    a, b = resumed["resharded"], resumed["universal"]
    same = a["losses"] == b["losses"] and all(torch.equal(a["final"][n], t) for n, t in b["final"].items())
    checks.append(
        Check(
            "resharded and universal resumes identical",
            same,
            "same losses and final state bit for bit" if same else "they differ",
        )
    )
    return RoundtripReport(tuple(checks))


def render(report: RoundtripReport) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = [f"{'ok' if c.ok else 'MISMATCH':8}  {c.name:{width}}  {c.detail}" for c in report.checks]
    lines.append("round trip passed" if report.ok else "round trip FAILED")
    return "\n".join(lines)

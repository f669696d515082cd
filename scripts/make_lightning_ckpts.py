#!/usr/bin/env python3
"""Regenerate the PyTorch Lightning fixtures under ``sample_ckpts/`` (``lightning_*`` cases).

One file is the driver (stdlib only: launches ``python -m torch.distributed.run`` with the
DeepSpeed venv's python, which also has ``pytorch_lightning==2.6.6``), the per-rank worker
(``--worker``: a seeded LightningModule trained by ``Trainer.fit`` under a ``DeepSpeedStrategy``
made to run on CPU), and the module the interop tests resume with (:func:`lightning_classes`).

The model (:class:`TinyLM`): an embedding tied to the output head, a frozen LayerNorm, a small
MLP, a buffer ``scale``; AdamW with two param groups (weights decay, biases not) and a per-step
``StepLR`` that Lightning (not DeepSpeed) drives and saves. ``ModelCheckpoint`` saves every 2
steps with ``save_top_k=-1``, so ``checkpoints/`` holds ``epoch=0-step=2.ckpt/`` and
``epoch=0-step=4.ckpt/``: each a DeepSpeed checkpoint folder with ``latest`` = ``checkpoint``.

Beside each case (``reference/``), written at the end of training, right after the step-4 save:

* ``live.safetensors``: every param as the engine holds it gathered (trainable ones as
  ``safe_get_full_fp32_param``, frozen ones and buffers as held), under the LightningModule's
  ``state_dict()`` names, the tied head under both names;
* ``live_optimizer.safetensors``: ``safe_get_full_optimizer_state`` of ``exp_avg`` and
  ``exp_avg_sq`` per trainable param (``<name>.exp_avg``);
* ``lightning_model.pt``: what Lightning's own
  ``pytorch_lightning.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` writes
  for the step-4 checkpoint (it runs DeepSpeed's zero_to_fp32);
* ``meta.json`` (case folder): the global step, epoch, the scheduler's last lr, and the case.

``legacy_prefix`` cases wrap the LightningModule in a module whose attribute is
``_forward_module`` before DeepSpeed sees it, as Lightning < 2.1 did
(``_LightningModuleWrapperBase``): every saved name starts with ``_forward_module.``.

Usage::

    python scripts/make_lightning_ckpts.py               # every case (~1 min each)
    python scripts/make_lightning_ckpts.py --only lightning_z3_bf16_ws2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_torchrun import launcher  # noqa: E402
from make_sample_ckpts import cpu_env, free_port, run, run_workers  # noqa: E402
from rank_exit import leave  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PY = str(REPO / ".venv-interop" / "bin" / "python")
SEED = 1234
VOCAB = 23
DIM = 16
HIDDEN = 12
SEQ_LEN = 6
MICRO_BATCH = 2
SAVE_EVERY = 2
NEWEST = "epoch=0-step=4.ckpt"


@dataclass(frozen=True)
class Case:
    name: str
    stage: int  # ZeRO stage
    dtype: str  # fp32 | bf16
    world_size: int = 2
    steps: int = 4
    legacy_prefix: bool = False  # names under `_forward_module.`, as Lightning < 2.1 saved them


CASES = [
    Case("lightning_z2_bf16_ws2", 2, "bf16"),
    Case("lightning_z3_bf16_ws2", 3, "bf16"),
    Case("lightning_z3_fp32_ws2", 3, "fp32"),
    Case("lightning_z2_fp32_ws2_legacy_prefix", 2, "fp32", legacy_prefix=True),
]


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def precision(dtype: str) -> str:
    return "bf16-mixed" if dtype == "bf16" else "32-true"


# --------------------------------------------------------------------------------------
# The module, the CPU strategy and the data: shared by the worker and the interop tests
# --------------------------------------------------------------------------------------
def lightning_classes() -> Any:
    """(TinyLM, CPUDeepSpeedStrategy, make_dataloader): imported lazily, so the driver needs
    neither torch nor Lightning."""
    import argparse as _argparse

    import pytorch_lightning as pl
    import torch
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.strategies import DeepSpeedStrategy
    from pytorch_lightning.strategies.ddp import DDPStrategy
    from torch import nn
    from torch.nn import functional as F

    class TinyLM(pl.LightningModule):
        def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.embed = nn.Embedding(vocab, dim)
            self.norm = nn.LayerNorm(dim)
            self.norm.requires_grad_(False)  # frozen, with its pretrained values
            with torch.no_grad():
                self.norm.weight.copy_(torch.linspace(0.8, 1.2, dim))
                self.norm.bias.copy_(torch.linspace(-0.1, 0.1, dim))
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            h = h + self.down(torch.relu(self.up(self.norm(h) * self.scale.to(h.dtype))))
            return self.head(h)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, self.hparams.vocab), tokens[:, 1:].reshape(-1))
            self.losses.append(float(loss))
            return loss

        @property
        def losses(self) -> list[float]:
            if not hasattr(self, "_losses"):
                self._losses: list[float] = []
            return self._losses

        def configure_optimizers(self) -> Any:
            trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.0},
            ]
            optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class LegacyWrapper(nn.Module):
        """Lightning < 2.1's ``_LightningModuleWrapperBase``: the module DeepSpeed saved was this."""

        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self._forward_module = module

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self._forward_module(*args, **kwargs)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy without its CUDA-only checks (FORMAT_NOTES: it trains
        and saves on CPU with gloo once the local rank is the device rank)."""

        legacy_prefix = False

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed

            if self.legacy_prefix:
                model = LegacyWrapper(model)
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=_argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, ds_optimizer

    def make_dataloader(batches: int = 16) -> Any:
        generator = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, VOCAB, (batches * MICRO_BATCH, SEQ_LEN), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=MICRO_BATCH)

    return TinyLM, CPUDeepSpeedStrategy, make_dataloader


def make_strategy(stage: int, legacy_prefix: bool = False) -> Any:
    _, strategy_class, _ = lightning_classes()
    strategy = strategy_class(config=ds_config(stage))
    strategy.legacy_prefix = legacy_prefix
    return strategy


def live_state(trainer: Any, module: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The engine's gathered values (every rank must call: ZeRO-3 gathers are collective)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    live: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    zero_optimizer = trainer.strategy.deepspeed_engine.optimizer
    if hasattr(zero_optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 ZeRO-1/2 links each param to its optimizer states once, after the first
        # group's first step: the later groups' states did not exist yet. Link again, now.
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()
    for name, param in module.named_parameters():
        if param.requires_grad:
            live[name] = safe_get_full_fp32_param(param).detach().clone().contiguous()
            for key in ("exp_avg", "exp_avg_sq"):
                optim[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).detach().float().clone().contiguous()
        else:
            with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                live[name] = param.data.detach().clone().contiguous()
    for name, buffer in module.named_buffers():
        live[name] = buffer.detach().clone().contiguous()
    if "head.weight" not in live:  # the tied head: state_dict() has it, named_parameters() does not
        live["head.weight"] = live["embed.weight"].clone()
    del torch
    return live, optim, trainer_info(trainer, module)


def trainer_info(trainer: Any, module: Any) -> dict[str, Any]:
    """What the Trainer and module say of where the run is: step, epoch, scheduler, names, losses."""
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "scheduler_last_epoch": scheduler.last_epoch,
        "last_lr": [float(x) for x in scheduler.get_last_lr()],
        "state_dict_names": list(module.state_dict()),
        "losses": list(module.losses),
    }


def worker(case: Case, casedir: Path) -> None:
    import pytorch_lightning as pl
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    tiny_lm, _, make_dataloader = lightning_classes()
    module = tiny_lm()

    class CaptureLive(pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            live, optim, info = live_state(trainer, pl_module)
            if trainer.is_global_zero:
                ref = casedir / "reference"
                ref.mkdir(exist_ok=True)
                save_file(live, str(ref / "live.safetensors"), metadata={"format": "pt"})
                save_file(optim, str(ref / "live_optimizer.safetensors"), metadata={"format": "pt"})
                (casedir / "_worker_info.json").write_text(json.dumps(info, indent=2))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=case.world_size,
        strategy=make_strategy(case.stage, case.legacy_prefix),
        precision=precision(case.dtype),
        max_steps=case.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(casedir / "_work"),
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=str(casedir / "checkpoints"), every_n_train_steps=SAVE_EVERY, save_top_k=-1
            ),
            CaptureLive(),
        ],
    )
    trainer.fit(module, make_dataloader())


def plain_state(trainer: Any, module: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What a Trainer without DeepSpeed holds: the module's params and buffers, torch AdamW's
    state per param (and its step), the scheduler."""
    live = {name: value.detach().clone().contiguous() for name, value in module.state_dict().items()}
    optimizer = trainer.optimizers[0]
    optim: dict[str, Any] = {}
    steps = set()
    for name, param in module.named_parameters():
        if param.requires_grad:
            state = optimizer.state[param]
            steps.add(float(state["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                optim[f"{name}.{key}"] = state[key].detach().float().clone().contiguous()
    info = {
        **trainer_info(trainer, module),
        "optimizer_steps": sorted(steps),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }
    return live, optim, info


def resume_worker(case: Case, ckpt_path: Path, outdir: Path, world_size: int, steps: int) -> None:
    """``Trainer.fit(ckpt_path=...)`` at `world_size` devices, as a user resumes: what the engine
    holds once Lightning restored the checkpoint (``on_train_start``: params, moments, global
    step, scheduler) to ``outdir/resumed*.safetensors`` and ``outdir/resumed.json``, then `steps`
    more steps (their losses in ``resumed.json``). `world_size` 0: one process, Lightning's own
    strategy, no DeepSpeed (a ``lightning_model.pt`` file written with its optimizer states)."""
    import pytorch_lightning as pl
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    tiny_lm, _, make_dataloader = lightning_classes()
    module = tiny_lm()

    class CaptureResumed(pl.Callback):
        info: dict[str, Any] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            live, optim, info = (plain_state if plain else live_state)(trainer, pl_module)
            CaptureResumed.info = info
            if trainer.is_global_zero:
                save_file(live, str(outdir / "resumed.safetensors"), metadata={"format": "pt"})
                save_file(optim, str(outdir / "resumed_optimizer.safetensors"), metadata={"format": "pt"})

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.is_global_zero:
                info = {**CaptureResumed.info, "losses_after": list(pl_module.losses), "end_step": trainer.global_step}
                (outdir / "resumed.json").write_text(json.dumps(info, indent=2))

    plain = world_size == 0
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=max(world_size, 1),
        strategy="auto" if plain else make_strategy(case.stage, case.legacy_prefix),
        precision=precision(case.dtype),
        max_steps=case.steps + steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(outdir / "_work"),
        callbacks=[CaptureResumed()],
    )
    trainer.fit(module, make_dataloader(), ckpt_path=str(ckpt_path))


def resume_command(python: str, case: Case, ckpt_path: Path, outdir: Path, world_size: int, steps: int) -> list[str]:
    """The command line of :func:`resume_worker`: under torchrun, or for `world_size` 0 alone."""
    torchrun = [*launcher(python), "--nproc_per_node", str(world_size), "--master_port", str(free_port())]
    return [
        *(torchrun if world_size else [python]),
        str(Path(__file__).resolve()),
        "--worker",
        "--case-json",
        json.dumps(asdict(case)),
        "--outdir",
        str(outdir),
        "--resume",
        str(ckpt_path),
        "--resume-world-size",
        str(world_size),
        "--resume-steps",
        str(steps),
    ]


CONVERTER = r"""
import sys
from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2])
"""


def generate(case: Case, out: Path, python: str, logdir: Path) -> float:
    started = time.time()
    casedir = out / case.name
    shutil.rmtree(casedir, ignore_errors=True)
    casedir.mkdir(parents=True)
    log = logdir / f"{case.name}.log"
    log.write_text("")
    env = cpu_env(case.world_size)
    run_workers(python, Path(__file__), case.world_size, json.dumps(asdict(case)), casedir, log, env)
    shutil.rmtree(casedir / "_work", ignore_errors=True)
    for ckpt in (casedir / "checkpoints").iterdir():
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            (ckpt / name).unlink(missing_ok=True)
    converted = casedir / "reference" / "lightning_model.pt"  # zckpt's name: the same archive name inside
    run([python, "-c", CONVERTER, str(casedir / "checkpoints" / NEWEST), str(converted)], cwd=REPO, log=log, env=env)
    for f in (casedir / "reference").iterdir():
        f.chmod(0o644)
    info = json.loads((casedir / "_worker_info.json").read_text())
    (casedir / "_worker_info.json").unlink()
    meta = {
        "case": case.name,
        "lightning": "pytorch_lightning 2.6.6, DeepSpeedStrategy (CPU subclass), torchrun, gloo",
        "deepspeed_version": "0.19.8",
        "zero_stage": case.stage,
        "dtype": case.dtype,
        "precision": precision(case.dtype),
        "world_size": case.world_size,
        "legacy_prefix": case.legacy_prefix,
        "checkpoint": f"checkpoints/{NEWEST}",  # the one the references are of
        "checkpoints": sorted(p.name for p in (casedir / "checkpoints").iterdir()),
        "newest": NEWEST,
        **info,
        "frozen": ["norm.weight", "norm.bias"],
        "tied": {"head.weight": "embed.weight"},
        "buffers": ["scale"],
        "param_groups": "weights (weight_decay 0.1), biases (0.0); AdamW lr 1e-2; StepLR(step_size=1, gamma=0.9) per step",
        "live_source": "reference/live.safetensors (safe_get_full_fp32_param, frozen and buffers as held), "
        "reference/live_optimizer.safetensors (safe_get_full_optimizer_state)",
        "reference_command": "convert_zero_checkpoint_to_fp32_state_dict(checkpoints/" + NEWEST + ", OUT)",
        "ds_config": ds_config(case.stage),
    }
    (casedir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return time.time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="case names")
    parser.add_argument("--out", default=str(REPO / "sample_ckpts"))
    parser.add_argument("--python", default=DEFAULT_PY, help="python of a venv with deepspeed and pytorch_lightning")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    parser.add_argument("--outdir", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--resume-world-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--resume-steps", type=int, default=2, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        case = Case(**json.loads(args.case_json))
        if args.resume:
            resume_worker(case, Path(args.resume), Path(args.outdir), args.resume_world_size, args.resume_steps)
        else:
            worker(case, Path(args.outdir))
        leave()
    chosen = [c for c in CASES if not args.only or c.name in args.only]
    logdir = Path("/tmp/make_lightning_ckpts_logs")
    logdir.mkdir(exist_ok=True)
    for case in chosen:
        seconds = generate(case, Path(args.out), args.python, logdir)
        print(f"{case.name}: {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer side by side with real DeepSpeed (0.19, CPU): DeepSpeed's zero_to_fp32 and a
DeepSpeed ZeRO-3 engine read the trainer's checkpoint as zckpt does (fp32, bf16, fp16), and the trainer resumes
from what DeepSpeed saved for the same model.

Run: ``PYTHONPATH=tests /work/venv-ds19/bin/python -m pytest -q -m deepspeed -p interop_helpers tests/test_interop/test_interop_trainer.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from interop_helpers import ROOT, ds_env, ds_python, free_port, launcher, run_logged
from zckpt.core.errors import UsageError
from zckpt.ops import api
from zckpt.trainer import TrainConfig, Trainer, plan_training
from zckpt.trainer.ranks import run_ranks

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

OPTIONS = dict(
    layers=1,
    dim=16,
    heads=2,
    vocab=23,
    seq_len=8,
    micro_batch=2,
    grad_accum=2,
    lr=1e-2,
    warmup=3,
    steps=20,
    seed=7,
    tie_embeddings=True,
    sub_group_size=300,
    clip=1.0,
)
WORLD = 2


def _train_and_save(rank: int, world: int, folder: str, options: dict) -> dict:
    trainer = Trainer(TrainConfig(**{**options, "out": folder}))
    losses = [trainer.train_step().loss for _ in range(options["steps"])]
    trainer.save()
    live = {}
    for index, spec in enumerate(trainer.plan.params):
        if spec.trainable:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                live[f"{spec.name}.{key}"] = trainer.optimizer.full_state(index, key).clone()
    scale = trainer.optimizer.loss_scale
    return {
        "live": live,
        "losses": losses,
        "lr": trainer.lr(),
        "loss_scale": scale.cur_scale if scale else 1.0,
        "skipped": trainer.skipped_steps,
    }


def _run_deepspeed(
    checkpoint: Path,
    out: Path,
    *,
    load: bool = True,
    train_steps: int = 0,
    save: Path | None = None,
    seed: int = 0,
    nvme_path: Path | None = None,
    masters_only: bool = False,
) -> tuple[dict, dict]:
    python = ds_python()
    model_states = torch.load(
        checkpoint / (checkpoint / "latest").read_text() / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        weights_only=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    config = model_states["ds_config"]
    if nvme_path is not None:  # DeepSpeed's own swap folder, not the trainer's
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(nvme_path)
    (out / "ds_config.json").write_text(json.dumps(config))
    cmd = [
        *launcher(python),
        "--nproc-per-node",
        str(WORLD),
        "--master-port",
        str(free_port()),
        str(ROOT / "scripts" / "ds_train_gpt.py"),
        "--model-config",
        str(checkpoint / "model_config.json"),
        "--ds-config",
        str(out / "ds_config.json"),
        "--out",
        str(out),
        "--train-steps",
        str(train_steps),
        "--seed",
        str(seed),
    ]
    cmd += ["--load", str(checkpoint)] if load else []
    cmd += ["--save", str(save)] if save else []
    cmd += ["--masters-only"] if masters_only else []
    code = run_logged(cmd, ds_env(WORLD, python), out / "ds.log", timeout=600)
    assert code == 0, (out / "ds.log").read_text()[-4000:]
    return torch.load(out / "live.pt", weights_only=True), json.loads((out / "state.json").read_text())


@pytest.fixture(scope="module", params=["fp32", "bf16", "fp16"])
def trained(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"trainer_{request.param}")
    options = {**OPTIONS, "dtype": request.param}
    results = run_ranks(WORLD, folder / "ranks", _train_and_save, str(folder / "ckpt"), options)
    return folder, folder / "ckpt", results[0], options


def test_zero_to_fp32_equals_zckpt_consolidate(trained):
    folder, checkpoint, _, _ = trained
    out = folder / "zero_to_fp32"
    code = run_logged(
        [ds_python(), "-m", "deepspeed.utils.zero_to_fp32", str(checkpoint), str(out)],
        ds_env(1, ds_python()),
        folder / "z2f.log",
        timeout=300,
    )
    assert code == 0, (folder / "z2f.log").read_text()[-3000:]
    theirs = torch.load(out / "pytorch_model.bin", weights_only=True)
    ours = api.load_state_dict(checkpoint)
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


def test_deepspeed_engine_loads_the_checkpoint(trained):
    """A plain load_checkpoint at the same world size: DeepSpeed's fp32 masters and Adam moments
    are the trainer's, bit for bit, and its counters and lr continue the run."""
    folder, checkpoint, result, options = trained
    live, state = _run_deepspeed(checkpoint, folder / "ds_load")
    assert set(live) == set(result["live"])
    for name, tensor in result["live"].items():
        assert torch.equal(live[name], tensor), name
    assert state["global_steps"] == options["steps"]
    assert state["lr"] == result["lr"]
    assert (state["loss_scale"], state["skipped_steps"]) == (result["loss_scale"], result["skipped"])


@pytest.fixture(scope="module")
def deepspeed_run(trained):
    """DeepSpeed ZeRO-3 training the same model from the same init on the same data with the
    trainer's config, saving at the end."""
    folder, checkpoint, _, options = trained
    live, state = _run_deepspeed(
        checkpoint,
        folder / "ds_train",
        load=False,
        train_steps=options["steps"],
        save=folder / "ds_ckpt",
        seed=options["seed"],
    )
    return live, state


def test_losses_match_deepspeed(trained, deepspeed_run):
    _, _, result, options = trained
    _, state = deepspeed_run
    """20 steps (warmup, clipping, decay, gradient accumulation, tied embeddings, 2 sub-groups).
    fp32: the same operations but DeepSpeed sums gradients in its own order (observed: 2e-8
    relative at most). bf16 and fp16: the ranks' gradients are rounded to 16 bits at other points
    than in DeepSpeed (one ulp is 2**-8 = 3.9e-3 relative in bf16, 2**-10 in fp16); observed: 2e-4
    relative at most in bf16, 1.7e-5 in fp16 (dynamic loss scaling, no overflow in these steps)."""
    assert len(state["losses"]) == len(result["losses"]) == options["steps"]
    tolerance = {"fp32": 1e-6, "bf16": 2e-3, "fp16": 1e-3}[options["dtype"]]
    assert result["losses"] == pytest.approx(state["losses"], rel=tolerance)


def test_trainer_resumes_from_deepspeed(trained, deepspeed_run, tmp_path):
    """The trainer loads what DeepSpeed saved: its masters and moments are DeepSpeed's live ones.
    Planned as `zckpt train --resume` plans it: DeepSpeed writes no model_config.json, so the
    model's shape is given (refused in one line without it); the dtype, tied embeddings, schedule,
    clipping, sub-groups and batch come from DeepSpeed's checkpoint and its ds_config."""
    folder, _, _, options = trained
    live, state = deepspeed_run
    checkpoint = str(folder / "ds_ckpt")
    with pytest.raises(
        UsageError,
        match=r"no model_config.json beside the checkpoint .* \(missing: --layers --dim --heads --vocab --seq-len\)$",
    ):
        plan_training({"resume": checkpoint, "steps": options["steps"] + 2}, world_size=WORLD)
    resumed = run_ranks(WORLD, tmp_path, _resume, checkpoint, options)[0]
    assert {k: getattr(resumed["config"], k) for k in options} == {**options, "steps": options["steps"] + 2}
    assert resumed["notes"] == ()
    assert resumed["global_steps"] == state["global_steps"]
    for name, tensor in live.items():
        assert torch.equal(resumed["live"][name], tensor), name
    assert all(map(lambda x: x == x, resumed["losses"]))


def _resume(rank: int, world: int, checkpoint: str, options: dict) -> dict:
    shape = {k: options[k] for k in ("layers", "dim", "heads", "vocab", "seq_len")}
    plan = plan_training(
        {"resume": checkpoint, "steps": options["steps"] + 2, "seed": options["seed"], **shape}, world_size=world
    )
    trainer = Trainer(plan.config)
    global_steps = trainer.global_steps
    live = {}
    for index, spec in enumerate(trainer.plan.params):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            live[f"{spec.name}.{key}"] = trainer.optimizer.full_state(index, key).clone()
    losses = [trainer.train_step().loss for _ in range(2)]
    return {"live": live, "global_steps": global_steps, "losses": losses, "config": plan.config, "notes": plan.notes}


# NVMe offload: sub-groups of 530000 elements, one of 428032 per rank at 2 ranks (>= 1 MiB of fp32:
# swapped) and a small one in memory
NVME_OPTIONS = dict(
    layers=1,
    dim=256,
    heads=4,
    vocab=64,
    seq_len=8,
    micro_batch=2,
    grad_accum=1,
    lr=1e-3,
    warmup=0,
    steps=3,
    seed=7,
    tie_embeddings=True,
    sub_group_size=530000,
    dtype="bf16",
)


def _train_nvme(rank: int, world: int, folder: str, options: dict) -> dict:
    trainer = Trainer(TrainConfig(**{**options, "out": f"{folder}/ckpt", "nvme_path": f"{folder}/nvme"}))
    for _ in range(options["steps"]):
        trainer.train_step()
    trainer.save()
    layout = trainer.plan.layout
    swapped = [layout.params[i].name for f in sorted(trainer.optimizer.swapped) for i in layout.flat_groups[f].params]
    live = {
        spec.name: trainer.optimizer.full_state(index).clone()
        for index, spec in enumerate(trainer.plan.params)
        if spec.trainable
    }
    trainer.close()
    return {"live": live, "swapped": swapped}


def test_deepspeed_nvme_engine_loads_the_nvme_checkpoint(tmp_path):
    """DeepSpeed ZeRO-3 with offload_optimizer on NVMe (its own swap folder) loads the trainer's NVMe
    checkpoint with a plain load_checkpoint: the fp32 masters of the swapped sub-groups are the
    trainer's, bit for bit. Only those: DeepSpeed 0.19.8 with NVMe optimizer offload restores only
    the swapped sub-groups' masters from any checkpoint, its own included (it skips the optim files;
    README, "NVMe offload" under Resharding), so the in-memory sub-group and the Adam moments are
    not compared."""
    result = run_ranks(WORLD, tmp_path / "ranks", _train_nvme, str(tmp_path), NVME_OPTIONS)[0]
    assert result["swapped"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "global_step3" / "offloaded_tensors").iterdir()) == [
        "rank00",
        "rank01",
    ]
    live, state = _run_deepspeed(
        tmp_path / "ckpt", tmp_path / "ds_load", nvme_path=tmp_path / "ds_nvme", masters_only=True
    )
    for name in result["swapped"]:
        assert torch.equal(live[f"{name}.master"], result["live"][name]), name
    assert state["global_steps"] == NVME_OPTIONS["steps"]

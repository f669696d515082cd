"""The trainer's checkpoints: DeepSpeed's ZeRO-3 layout written by the shared writer, read back
by zckpt's reader equal to the live state, and a resume that continues bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from zckpt.deepspeed.reader import open_training_state
from zckpt.ops import api
from zckpt.trainer import TrainConfig, Trainer, build_model, plan_training
from zckpt.trainer.ranks import run_ranks

# tied embeddings, a frozen param, several sub-groups, bf16 compute
OPTIONS = dict(
    layers=1,
    dim=12,
    heads=2,
    vocab=19,
    seq_len=6,
    micro_batch=2,
    grad_accum=2,
    lr=1e-2,
    warmup=1,
    steps=6,
    seed=5,
    dtype="bf16",
    tie_embeddings=True,
    freeze=r"^wpe\.",
    sub_group_size=200,
)


def _live(trainer: Trainer) -> dict:
    """Masters, moments and frozen values gathered from the ranks (fp32 masters, as trained)."""
    out = {}
    for index, spec in enumerate(trainer.plan.params):
        if spec.trainable:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                out[f"{spec.name}.{key}"] = trainer.optimizer.full_state(index, key).clone()
        else:
            out[f"{spec.name}.frozen"] = trainer.model.gather(index).clone()
    return out


def _save_and_resume(rank: int, world: int, folder: str) -> dict:
    options = {**OPTIONS, "out": folder, "save_every": 3}
    trainer = Trainer(TrainConfig(**options))
    losses = []
    for _ in range(6):
        losses.append(trainer.train_step().loss)
        if trainer.global_steps == 3:
            trainer.save()
            at_save = _live(trainer)
    final = {name: t.clone() for name, t in trainer.model.full_params()}
    resumed = Trainer(TrainConfig(**{**options, "resume": folder}))
    assert resumed.global_steps == 3
    resumed_losses = [resumed.train_step().loss for _ in range(3)]
    return {
        "losses": losses,
        "at_save": at_save,
        "final": final,
        "resumed_losses": resumed_losses,
        "resumed_final": dict(resumed.model.full_params()),
        "resumed_masters": _live(resumed),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(2, folder / "ranks", _save_and_resume, str(folder / "run"))
    return folder / "run", results


@pytest.mark.slow
def test_layout_is_deepspeeds(two_ranks):
    folder, _ = two_ranks
    assert (folder / "latest").read_text() == "global_step3"
    names = sorted(os.listdir(folder / "global_step3"))
    assert names == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    model_states = torch.load(folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt", weights_only=True)
    assert model_states["dp_world_size"] == 2 and model_states["global_steps"] == 3
    assert all(
        t.numel() == 0 and t.dtype == torch.bfloat16 for t in model_states["module"].values()
    )  # ZeRO-3 placeholders
    assert json.loads((folder / "model_config.json").read_text())["tie_embeddings"] is True
    model = build_model(folder / "model_config.json")
    assert set(model.state_dict()) == set(api.load_state_dict(folder))


@pytest.mark.slow
def test_checkpoint_equals_live_state(two_ranks):
    """zckpt's reader gives back, bit for bit, what the ranks held when they saved."""
    folder, results = two_ranks
    live = results[0]["at_save"]
    state = open_training_state(folder)
    assert len(state.groups) == 2 and len({p.group for p in state.params}) == 2
    read = dict(api.iter_tensors(folder, states=True))
    for name, tensor in live.items():
        param, key = name.rsplit(".", 1)
        stored = read[param] if key in ("master", "frozen") else read[name]
        assert torch.equal(stored, tensor.float()), name
    assert torch.equal(read["lm_head.weight"], read["wte.weight"])


def test_resume_is_bit_identical(two_ranks):
    _, results = two_ranks
    for result in results:
        assert result["resumed_losses"] == result["losses"][3:]
        for name, tensor in result["final"].items():
            assert torch.equal(result["resumed_final"][name], tensor), name


def _resume_one_rank(rank: int, world: int, checkpoint: str, folder: str) -> dict:
    # the same global batch: one rank takes both ranks' rows
    trainer = Trainer(
        TrainConfig(**{**OPTIONS, "micro_batch": 2 * OPTIONS["micro_batch"], "out": folder, "resume": checkpoint})
    )
    at_load = _live(trainer)
    losses = [trainer.train_step().loss for _ in range(3)]
    return {"at_load": at_load, "losses": losses, "global_steps": trainer.global_steps}


@pytest.mark.slow
def test_resume_at_another_world_size(two_ranks, tmp_path):
    """The 2-rank checkpoint, as saved, resharded to 1 rank and converted to universal: a 1-rank
    run resumes from each with the saved state bit for bit, and the three continue identically.
    Against the uninterrupted 2-rank run, the gradient is reduced in another order (no
    reduce-scatter at one rank) and rounded to bf16 elsewhere: losses agree to 2e-3 relative."""
    from zckpt.ops.reshard import reshard
    from zckpt.ops.universal import to_universal

    folder, results = two_ranks
    reshard(folder, tmp_path / "ws1", world_size=1)
    to_universal(folder, tmp_path / "universal")
    runs = {
        kind: run_ranks(1, tmp_path / f"run_{kind}", _resume_one_rank, str(path), str(tmp_path / f"out_{kind}"))[0]
        for kind, path in (("plain", folder), ("resharded", tmp_path / "ws1"), ("universal", tmp_path / "universal"))
    }
    saved = results[0]["at_save"]
    for kind, run in runs.items():
        for name, tensor in saved.items():
            assert torch.equal(run["at_load"][name], tensor), (kind, name)
        assert run["losses"] == runs["plain"]["losses"], kind
        assert run["global_steps"] == 6
    assert runs["plain"]["losses"] == pytest.approx(results[0]["losses"][3:], rel=2e-3)


def _resume_planned(rank: int, world: int, checkpoint: str, folder: str) -> dict:
    """`zckpt train --resume CHECKPOINT --out FOLDER --seed 5` at `world` ranks, as the CLI plans it."""
    plan = plan_training({"resume": checkpoint, "out": folder, "seed": OPTIONS["seed"]}, world_size=world)
    trainer = Trainer(plan.config)
    return {
        "config": plan.config,
        "notes": plan.notes,
        "at_load": _live(trainer),
        "global_samples": trainer.global_samples,
    }


@pytest.mark.slow
def test_resume_takes_the_run_from_the_checkpoint(two_ranks, tmp_path):
    """Given only the checkpoint, 3 ranks resume the 2-rank bf16 run with its model (tied), dtype,
    frozen param, schedule and sub-groups, load the saved state bit for bit, and keep as close to
    its global batch as 3 ranks allow (8 = 2 x 2 ranks x 2; 3 ranks: 9 = 1 x 3 x 3), saying so.
    (The README's chain, run by torchrun in test_trainer_cli.py, checks what such a run saves.)"""
    folder, results = two_ranks
    resumed = run_ranks(3, tmp_path / "ranks", _resume_planned, str(folder / "global_step3"), str(tmp_path / "out"))
    config = resumed[0]["config"]
    expected = {k: v for k, v in OPTIONS.items() if k not in ("freeze", "micro_batch", "grad_accum")}
    assert {k: getattr(config, k) for k in expected} == expected
    assert (config.micro_batch, config.grad_accum) == (1, 3)
    assert resumed[0]["notes"] == (
        "the checkpoint's global batch of 8 sequences (2 x 2 ranks x 2) cannot be kept at 3 ranks (8 is not a multiple of 3): "
        "using 9 (--micro-batch 1 x 3 ranks x --grad-accum 3), the closest with at most 2 sequences per rank",
    )
    for rank in resumed:
        for name, tensor in results[0]["at_save"].items():
            assert torch.equal(rank["at_load"][name], tensor), name
        assert rank["global_samples"] == 3 * 8


def _failing_save(rank: int, world: int, folder: str) -> str:
    """Save at step 1, then at step 2 with rank 1 unable to write (disk full)."""
    import errno

    import zckpt.deepspeed.save as save_module
    from zckpt.core.errors import ZckptError

    trainer = Trainer(TrainConfig(**{**OPTIONS, "out": folder}))
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    if rank == 1:

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        save_module._write_one = full_disk
    try:
        trainer.save()
    except ZckptError as exc:
        return str(exc)
    return "saved"


@pytest.mark.slow
def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    messages = run_ranks(2, tmp_path / "ranks", _failing_save, str(tmp_path / "run"))
    # rank 1 says why; rank 0 stops too (told by the agreed barrier, or finding the shared
    # staging folder gone: the failed rank's writer removes it)
    assert "no space left" in messages[1] and messages[0] != "saved"
    assert sorted(os.listdir(tmp_path / "run")) == [
        "global_step1",
        "latest",
        "model_config.json",
    ]  # no staging folder left
    assert (tmp_path / "run" / "latest").read_text() == "global_step1"
    assert open_training_state(tmp_path / "run").global_steps == 1


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_and_resumes(tmp_path):
    """An fp16 overflow skips the step as DeepSpeed's DynamicLossScaler does (hysteresis 2: the
    first overflow only spends it, the second halves the scale), is counted, and the scaler is
    saved as DeepSpeed's object and restored on resume."""
    options = {**OPTIONS, "dtype": "fp16", "freeze": None, "out": str(tmp_path / "run"), "micro_batch": 4}
    trainer = Trainer(TrainConfig(**options))
    trainer.train_step()
    before = trainer.optimizer.full_state(0).clone()
    trainer.optimizer.loss_scale.cur_scale = 2.0**40  # fp16 gradients overflow at this scale
    assert trainer.train_step().skipped and trainer.optimizer.loss_scale.cur_scale == 2.0**40
    assert trainer.train_step().skipped and trainer.optimizer.loss_scale.cur_scale == 2.0**39
    assert torch.equal(trainer.optimizer.full_state(0), before)  # skipped steps change nothing
    assert (trainer.global_steps, trainer.skipped_steps, trainer.last_batch_iteration) == (3, 2, 0)
    trainer.optimizer.loss_scale.cur_scale = 2.0**10
    trainer.save()
    state = open_training_state(tmp_path / "run")
    assert type(state.loss_scaler).__name__ == "DynamicLossScaler" and vars(state.loss_scaler)["cur_scale"] == 2.0**10
    assert (state.skipped_steps, state.global_steps) == (2, 3)
    continued = [trainer.train_step().loss for _ in range(2)]
    resumed = Trainer(TrainConfig(**{**options, "resume": str(tmp_path / "run")}))
    assert vars(resumed.optimizer.loss_scale) == {**vars(trainer.optimizer.loss_scale), "cur_iter": 3}
    assert [resumed.train_step().loss for _ in range(2)] == continued

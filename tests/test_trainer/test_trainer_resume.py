"""What ``--resume`` takes from a checkpoint, allows and refuses: the decision alone, on stated
checkpoint facts (the runs that use it are in test_trainer_cli.py and test_trainer_checkpoint.py)."""

from __future__ import annotations

import re

import pytest

from zckpt.core.errors import UsageError
from zckpt.deepspeed.engine_config import RecordedRun, engine_config, recorded_run
from zckpt.trainer.model import GPTConfig
from zckpt.trainer.optim import LRSchedule
from zckpt.trainer.resume import CheckpointFacts, resolve_resume

MODEL = GPTConfig(vocab=256, seq_len=64, layers=2, dim=64, heads=4, tie_embeddings=True)
PARAMS = ("wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "ln_f.weight")
# the README's first run: 2 ranks, bf16, tied, --steps 200, default batch (4 x 2 ranks x 1)
RUN = RecordedRun(
    micro_batch=4,
    grad_accum=1,
    global_batch=8,
    lr=1e-3,
    warmup=0,
    total_steps=200,
    clip=1.0,
    sub_group_size=1_000_000_000,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
)


@pytest.fixture(autouse=True)
def checkpoint_folder(tmp_path, monkeypatch):
    """TrainConfig checks that --resume exists: the facts' path, relative to the test's folder."""
    (tmp_path / "runs" / "gpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)


def facts(**changes) -> CheckpointFacts:
    base = dict(
        path="runs/gpt",
        model=MODEL,
        tied=True,
        dtype="bf16",
        params=PARAMS,
        frozen=(),
        world_size=2,
        global_steps=200,
        run=RUN,
    )
    return CheckpointFacts(**{**base, **changes})


def refusal(given: dict, world: int = 2, **changes) -> str:
    with pytest.raises(UsageError) as caught:
        resolve_resume({"resume": "runs/gpt", **given}, facts(**changes), world)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_takes_the_model_dtype_and_schedule():
    plan = resolve_resume({"resume": "runs/gpt", "out": "runs/gpt", "steps": 300}, facts(), 2)
    config = plan.config
    assert config.model_config() == MODEL and config.dtype == "bf16"
    assert (config.lr, config.warmup, config.clip, config.micro_batch, config.grad_accum, config.steps) == (
        1e-3,
        0,
        1.0,
        4,
        1,
        300,
    )
    assert plan.notes == ()  # same world size, same batch: nothing to say


def test_readme_chain_at_three_ranks_takes_the_closest_global_batch():
    plan = resolve_resume({"resume": "runs/gpt", "out": "runs/gpt", "steps": 300}, facts(), 3)
    assert (plan.config.micro_batch, plan.config.grad_accum) == (3, 1)
    assert plan.notes == (
        "the checkpoint's global batch of 8 sequences (4 x 2 ranks x 1) cannot be kept at 3 ranks (8 is not a multiple of 3): "
        "using 9 (--micro-batch 3 x 3 ranks x --grad-accum 1), the closest with at most 4 sequences per rank",
    )


@pytest.mark.parametrize("world, split", [(1, (4, 2)), (4, (2, 1)), (8, (1, 1))])
def test_keeps_the_global_batch_where_a_split_gives_it(world, split):
    plan = resolve_resume({"resume": "runs/gpt", "steps": 300}, facts(), world)
    micro, accum = split
    assert (plan.config.micro_batch, plan.config.grad_accum) == split and micro * world * accum == 8
    assert plan.notes[0].endswith(
        f"is kept at {world} rank{'s' * (world > 1)} with --micro-batch {micro} x {world} rank{'s' * (world > 1)} x --grad-accum {accum}"
    )


def test_given_batch_options_are_used_and_the_change_said():
    plan = resolve_resume({"resume": "runs/gpt", "steps": 300, "micro_batch": 2}, facts(), 1)
    assert (plan.config.micro_batch, plan.config.grad_accum) == (2, 4) and "is kept at 1 rank" in plan.notes[0]
    plan = resolve_resume({"resume": "runs/gpt", "steps": 300, "micro_batch": 4, "grad_accum": 1}, facts(), 3)
    assert (plan.config.micro_batch, plan.config.grad_accum) == (4, 1)
    assert plan.notes[0].endswith("becomes 12 at 3 ranks (--micro-batch 4 x 3 ranks x --grad-accum 1, as given)")


def test_schedule_options_may_change():
    plan = resolve_resume(
        {"resume": "runs/gpt", "steps": 400, "lr": 5e-4, "warmup": 10, "clip": 0.5, "sub_group_size": 1000}, facts(), 2
    )
    config = plan.config
    assert (config.lr, config.warmup, config.clip, config.sub_group_size, config.steps) == (5e-4, 10, 0.5, 1000, 400)


@pytest.mark.parametrize(
    "given, message",
    [
        (
            {"steps": 300, "dim": 128},
            "runs/gpt: --dim 128 contradicts the checkpoint, which has --dim 64: a resumed run keeps its model, dtype and frozen params (leave --dim out)",
        ),
        (
            {"steps": 300, "tie_embeddings": False},
            "runs/gpt: --no-tie-embeddings contradicts the checkpoint, which has --tie-embeddings: a resumed run keeps its model, dtype and frozen params (leave --tie-embeddings out)",
        ),
        (
            {"steps": 300, "dtype": "fp32"},
            "runs/gpt: --dtype fp32 contradicts the checkpoint, which has --dtype bf16: a resumed run keeps its model, dtype and frozen params (leave --dtype out)",
        ),
        ({"steps": 300, "dtype": "fp8"}, "--dtype must be one of fp32, bf16, fp16, got 'fp8'"),
        (
            {"steps": 300, "freeze": "^wpe"},
            "runs/gpt: --freeze '^wpe' freezes wpe.weight, the checkpoint froze none: a resumed run keeps its model, dtype and frozen params (leave --freeze out)",
        ),
        (
            {"steps": 300, "freeze": "("},
            "--freeze '(' is not a regular expression: missing ), unterminated subpattern at position 0",
        ),
        (
            {"steps": 150},
            "runs/gpt: --steps 150: the checkpoint is at step 200 already (--steps counts from the start of the run)",
        ),
        (
            {},
            "runs/gpt: the checkpoint is at step 200, the end of its run (--steps 200): give a larger --steps to train on",
        ),
    ],
)
def test_contradictions_are_refused_in_one_line(given, message):
    assert refusal(given) == message


def test_the_same_values_given_are_fine():
    given = {
        "resume": "runs/gpt",
        "steps": 300,
        "layers": 2,
        "dim": 64,
        "heads": 4,
        "vocab": 256,
        "seq_len": 64,
        "tie_embeddings": True,
        "dtype": "bf16",
    }
    assert resolve_resume(given, facts(), 2).config.model_config() == MODEL


def test_frozen_params_are_the_checkpoints():
    frozen = facts(frozen=("wpe.weight", "ln_f.weight"))
    pattern = resolve_resume({"resume": "runs/gpt", "steps": 300}, frozen, 2).config.freeze
    assert [name for name in PARAMS if re.search(pattern, name)] == ["wpe.weight", "ln_f.weight"]
    assert (
        resolve_resume({"resume": "runs/gpt", "steps": 300, "freeze": r"^(wpe|ln_f)\."}, frozen, 2).config.freeze
        == r"^(wpe|ln_f)\."
    )


def test_a_checkpoint_without_model_config_needs_the_shape():
    """DeepSpeed writes no model_config.json: the shape must be given (the params do not tell the
    number of heads); tied embeddings are read from the checkpoint."""
    ds = facts(model=None)
    assert refusal({"steps": 300, "dim": 64}, model=None) == (
        "runs/gpt: no model_config.json beside the checkpoint (zckpt train writes one, DeepSpeed does not): "
        "give the model's --layers --dim --heads --vocab --seq-len (missing: --layers --heads --vocab --seq-len)"
    )
    shape = {"layers": 2, "dim": 64, "heads": 4, "vocab": 256, "seq_len": 64}
    config = resolve_resume({"resume": "runs/gpt", "steps": 300, **shape}, ds, 2).config
    assert config.model_config() == MODEL and config.dtype == "bf16"
    assert "contradicts the checkpoint, which has --tie-embeddings" in refusal(
        {"steps": 300, **shape, "tie_embeddings": False}, model=None
    )


def test_a_schedule_the_trainer_does_not_run_must_be_given():
    other = facts(
        run=RecordedRun(
            **{**vars(RUN), "lr": None, "warmup": None, "total_steps": None, "other_scheduler": "OneCycle scheduler"}
        )
    )
    assert refusal({"steps": 300}, run=other.run) == (
        "runs/gpt: its lr schedule (OneCycle scheduler) is not one zckpt train runs "
        "(WarmupDecayLR warming up linearly from 0, or a constant lr): give --lr, --warmup and --steps"
    )
    config = resolve_resume({"resume": "runs/gpt", "steps": 300, "lr": 1e-4, "warmup": 0}, other, 2).config
    assert (config.lr, config.warmup, config.steps) == (1e-4, 0, 300)


@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_recorded_run_reads_back_what_the_trainer_records(warmup):
    """recorded_run is engine_config's inverse on the trainer's own ds_config."""
    schedule = LRSchedule(3e-4, warmup, 50, min_lr=0.0 if warmup else 3e-4)
    config = engine_config(
        micro_batch=3,
        grad_accum=2,
        world_size=5,
        dtype="bf16",
        lr=3e-4,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.05,
        clip=0.25,
        sub_group_size=4096,
        scheduler=schedule.ds_scheduler(),
    )
    assert recorded_run(config, 5, "0.19.8") == RecordedRun(
        3, 2, 30, 3e-4, warmup, 50, 0.25, 4096, (0.8, 0.9), 1e-6, 0.05
    )


def test_recorded_run_of_a_deepspeed_config():
    """DeepSpeed's rules: two of micro batch, accumulation and global batch give the third;
    "auto" or absent values are not guessed; gradient clipping and sub_group_size default as
    the DeepSpeed release that saved it did."""
    run = recorded_run(
        {
            "train_batch_size": 24,
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        },
        2,
        "0.19.8",
    )
    assert (run.micro_batch, run.grad_accum, run.global_batch, run.lr, run.warmup, run.total_steps, run.clip) == (
        4,
        3,
        24,
        0.01,
        0,
        None,
        1.0,
    )
    old = recorded_run({"train_micro_batch_size_per_gpu": 2}, 3, "0.14.0")
    assert (old.micro_batch, old.grad_accum, old.global_batch, old.clip, old.sub_group_size) == (
        2,
        1,
        6,
        0.0,
        1_000_000_000,
    )
    assert (
        recorded_run({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, 2, "0.19.8").global_batch
        is None
    )
    assert (
        recorded_run({"scheduler": {"type": "WarmupLR", "params": {}}}, 2, "0.19.8").other_scheduler
        == "WarmupLR scheduler"
    )
    log = recorded_run({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}}, 2, "0.19.8")
    assert (
        log.other_scheduler == "WarmupDecayLR with log warmup from 0.0 to 0.001 over 1000 of 10 steps"
        and log.lr is None
    )

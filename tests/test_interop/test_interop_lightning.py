"""Interop with PyTorch Lightning 2.6.6: its ``Trainer.fit(ckpt_path=...)`` resumes what zckpt
wrote, and Lightning's own converter agrees with ``consolidate --format lightning``. Needs
DeepSpeed and pytorch_lightning in this interpreter; skipped otherwise.

Run: ``DS_ACCELERATOR=cpu PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_lightning.py`` (about 1.5 min on 2 cores: eight Lightning runs of
5-15 s).

What the expected values are (never zckpt's code): the samples' ``reference/live*.safetensors``
(the engine's gathered fp32 masters, frozen params, buffers and Adam moments when Lightning saved
the step-4 checkpoint) and ``meta.json`` (global step, the scheduler's lr), both written by the
training run itself (scripts/make_lightning_ckpts.py); and Lightning's converter run here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import LIGHTNING_SAMPLES, Sample, assert_same_objects, same_bits, sample

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("DeepSpeed or pytorch_lightning is not installed", allow_module_level=True)

from interop_helpers import _load_script, ds_env, run_logged, shm_leak_safety_net  # noqa: E402,F401 (autouse fixture)
from zckpt import consolidate, reshard  # noqa: E402
from zckpt.ops.lightning import LIGHTNING_FILE  # noqa: E402

make_lightning = _load_script("make_lightning_ckpts")
NON_LEGACY = [s for s in LIGHTNING_SAMPLES if not s.meta["legacy_prefix"]]


def case_of(case: Sample) -> object:
    return next(c for c in make_lightning.CASES if c.name == case.name)


def fit(case: Sample, ckpt_path: Path, world_size: int, out: Path) -> int | None:
    """``Trainer.fit(ckpt_path=...)`` at `world_size` devices (0: one process without DeepSpeed),
    two more steps; returns its exit status (the run's log is ``out/run.log``)."""
    out.mkdir(parents=True)
    cmd = make_lightning.resume_command(sys.executable, case_of(case), ckpt_path, out, world_size, 2)
    return run_logged(cmd, ds_env(max(world_size, 1), sys.executable), out / "run.log", timeout=300)


def resumed(case: Sample, ckpt_path: Path, world_size: int, out: Path) -> tuple[dict, dict, dict]:
    returncode = fit(case, ckpt_path, world_size, out)
    if returncode != 0 or not (out / "resumed.json").exists():
        pytest.fail(
            f"Lightning resume at {world_size} devices: exit {returncode}\n{(out / 'run.log').read_text()[-4000:]}"
        )
    info = json.loads((out / "resumed.json").read_text())
    return load_file(out / "resumed.safetensors"), load_file(out / "resumed_optimizer.safetensors"), info


def check_resumed(case: Sample, live: dict, optim: dict, info: dict) -> None:
    """What the Trainer holds once it restored the checkpoint: the values of the save, bit for
    bit (frozen 16-bit params widened exactly where the module keeps fp32), the global step, the
    scheduler's epoch and lr; then it trained two more steps."""
    truth = case.live()
    assert sorted(live) == sorted(truth)
    for name, value in truth.items():
        assert same_bits(live[name], value.to(live[name].dtype)) and same_bits(live[name].to(value.dtype), value), name
    truth_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert sorted(optim) == sorted(truth_optim)
    for name, value in truth_optim.items():
        assert same_bits(optim[name], value), name
    assert info["global_step"] == case.meta["global_step"] == 4
    assert info["scheduler_last_epoch"] == case.meta["scheduler_last_epoch"] == 4
    assert info["last_lr"] == case.meta["last_lr"]
    assert info["end_step"] == 6 and len(info["losses_after"]) == 2
    assert all(torch.isfinite(torch.tensor(info["losses_after"])))


@pytest.mark.parametrize(
    "name,world_size",
    [
        ("lightning_z2_bf16_ws2", 3),
        ("lightning_z2_bf16_ws2", 1),
        ("lightning_z3_bf16_ws2", 3),
        ("lightning_z3_fp32_ws2", 1),
    ],
)
def test_lightning_resumes_a_resharded_checkpoint_at_another_device_count(
    name: str, world_size: int, tmp_path: Path
) -> None:
    case = sample(name)
    target = tmp_path / "resharded" / "epoch=0-step=4.ckpt"
    reshard(case.folder / "checkpoints", target, world_size=world_size)
    check_resumed(case, *resumed(case, target, world_size, tmp_path / "fit"))


def test_without_zckpt_deepspeed_refuses_another_device_count(tmp_path: Path) -> None:
    case = sample("lightning_z2_bf16_ws2")
    returncode = fit(case, case.checkpoint, 3, tmp_path / "fit")
    assert returncode not in (0, None)
    log = (tmp_path / "fit" / "run.log").read_text()
    assert "The checkpoint being loaded used a DP world size of 2 but the current world size is 3" in log


@pytest.mark.parametrize("case", NON_LEGACY, ids=lambda s: s.name)
def test_a_trainer_without_deepspeed_resumes_lightning_model_pt_with_optimizer_states(
    case: Sample, tmp_path: Path
) -> None:
    consolidate(case.folder / "checkpoints", tmp_path / "out", format="lightning", optimizer_states=True)
    live, optim, info = resumed(case, tmp_path / "out" / LIGHTNING_FILE, 0, tmp_path / "fit")
    check_resumed(case, live, optim, info)
    assert info["optimizer_steps"] == [4.0]
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0]


@pytest.mark.parametrize("case", LIGHTNING_SAMPLES, ids=lambda s: s.name)
def test_lightnings_converter_run_here_writes_what_format_lightning_writes(case: Sample, tmp_path: Path) -> None:
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    theirs = tmp_path / "theirs" / LIGHTNING_FILE
    theirs.parent.mkdir()
    convert_zero_checkpoint_to_fp32_state_dict(str(case.checkpoint), str(theirs))
    consolidate(case.folder / "checkpoints", tmp_path / "ours", format="lightning")
    ours = tmp_path / "ours" / LIGHTNING_FILE
    assert_same_objects(torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True))
    if case.meta["zero_stage"] == 3:
        assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("name", ["lightning_z3_bf16_ws2", "lightning_z2_fp32_ws2_legacy_prefix"])
def test_load_from_checkpoint_takes_the_file(name: str, tmp_path: Path) -> None:
    """``LightningModule.load_from_checkpoint``, no DeepSpeed: the module gets the saved values
    and its hyperparameters (the old ``_forward_module.`` names included)."""
    case = sample(name)
    consolidate(case.folder / "checkpoints", tmp_path, format="lightning")
    tiny_lm, _, _ = make_lightning.lightning_classes()
    model = tiny_lm.load_from_checkpoint(tmp_path / LIGHTNING_FILE, map_location="cpu")
    assert dict(model.hparams) == {"vocab": 23, "dim": 16, "hidden": 12, "lr": 1e-2}
    state = model.state_dict()
    for param_name, value in case.live().items():
        assert same_bits(state[param_name].to(value.dtype), value), param_name

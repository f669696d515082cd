"""Real DeepSpeed loads zckpt's reshard of a real ZenFlow run (sample z2_bf16_ws2_zenflow, issue 35
item 4) at another world size: its module holds the 16-bit weights DeepSpeed saved (the live
engine's, which ZenFlow leaves off the masters rounded), its optimizer the live masters and states.
A reshard that recomputed them as the masters rounded gave a module 548 of whose 4,323 elements
differ from the saved run.

A fresh sequential run of ZenFlow's other settings (ZeRO-1, fp32, select_strategy epoch,
full_warm_up_rounds, topk_ratio 0.3; ~25 s) checks verify's bound on the columns and a reshard's
load there.

A fresh run with ``overlap_step`` (ZenFlowZeroOptimizerParallel, ZeRO-1; generated here, ~40 s)
checks what that mode saves against its live engine: no optimizer moments (they live in ZenFlow's
optimizer process), 16-bit module weights a step behind the masters; and that DeepSpeed loads
zckpt's reshard of it at another world size and stage and trains on, and its universal folder
into a ZeRO-2 engine (masters only, as inspect says)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from helpers import Sample, same_bits, sample  # noqa: E402
from interop_checks import _check_loaded  # noqa: E402
from interop_helpers import (  # noqa: E402
    ds_python,
    extensions_for,
    run_probe,
    sample_generator,
    shm_leak_safety_net,  # noqa: F401 (autouse fixture)
)
from zckpt.cli.inspect import render  # noqa: E402
from zckpt.ops.consolidate import consolidate  # noqa: E402
from zckpt.ops.inspect import inspect_path  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from zckpt.ops.universal import to_universal  # noqa: E402
from zckpt.ops.verify import verify  # noqa: E402

GEN = sample_generator()
# 6 micro-steps, update_interval 2: 3 optimizer steps, the third after the process's first two
OVERLAP = GEN.Case(
    "zenflow_overlap_z1_bf16_ws2",
    "ds19",
    1,
    "bf16",
    2,
    save_steps=(6,),
    live_params16=True,
    zero_extra=(
        ("offload_optimizer", {"device": "cpu"}),
        (
            "zenflow",
            {
                "topk_ratio": 0.1,
                "select_strategy": "step",
                "select_interval": 2,
                "update_interval": 2,
                "overlap_step": True,
            },
        ),
    ),
    config_extra=(("optimizer", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
)


@pytest.mark.parametrize(("world_size", "stage"), [(3, 2)])
def test_deepspeed_loads_the_saved_zenflow_weights_at_another_world_size(
    tmp_path: Path, world_size: int, stage: int
) -> None:
    case = sample("z2_bf16_ws2_zenflow")
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(case.name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    assert state["optimizer_class"].startswith("ZenFlowZeroOptimizer"), state["optimizer_class"]
    _check_loaded(case, live, optim, state, world_size, stage)
    saved = torch.load(
        case.checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )["module"]
    module = load_file(tmp_path / "probe" / "live_module.safetensors")
    trainable = case.live_params16()
    for name in trainable:
        assert same_bits(module[name], saved[name]), name
    masters = case.live()
    rounded_differ = sum(
        int((saved[n].view(torch.int16) != masters[n].to(torch.bfloat16).view(torch.int16)).sum()) for n in trainable
    )
    assert rounded_differ == 548  # what a recomputing reshard would have put there instead


# select_strategy "epoch" without a training dataloader selects once (select_interval 0,
# runtime/zenflow/engine.py:59-60), the first micro-step after the 2 warm-up rounds; the warm-up
# micro-steps each end at a boundary, then every update_interval-th: micro-steps 1, 2 and 5 of 5 are
# boundaries (engine.py:87-90), tag global_step3, the CPU Adam's step 5 (micro-steps)
VARIANTS = GEN.Case(
    "zenflow_epoch_warmup_z1_fp32_ws2",
    "ds19",
    1,
    "fp32",
    2,
    save_steps=(5,),
    live_params16=True,
    zero_extra=(
        ("offload_optimizer", {"device": "cpu"}),
        (
            "zenflow",
            {
                "topk_ratio": 0.3,
                "select_strategy": "epoch",
                "select_interval": 1,
                "update_interval": 3,
                "full_warm_up_rounds": 2,
            },
        ),
    ),
    config_extra=(("optimizer", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
)


def _fresh(root: Path, case: object) -> Sample:
    pythons = {"ds19": ds_python()}
    GEN.generate(case, root, pythons, root, extensions=extensions_for(pythons))
    folder = root / case.name
    return Sample(case.name, folder, json.loads((folder / "meta.json").read_text()))


def test_zenflow_settings_variants_are_judged_and_resharded(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A sequential ZenFlow run of other settings: the module weights are the live engine's, off
    the masters rounded only in the columns verify allows (it passes); consolidate gives the live
    masters; DeepSpeed loads zckpt's reshard at 3 ranks (ZeRO-2) with the live masters, moments and
    steps and the saved module weights bit for bit, and trains a step on it."""
    case = _fresh(tmp_path_factory.mktemp("zenflow_variants"), VARIANTS)
    assert (case.meta["tag"], case.meta["steps"]) == ("global_step3", 5)
    module = torch.load(case.checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    masters, live16 = case.live(), case.live_params16()
    assert all(same_bits(module[n], live16[n]) for n in live16)
    assert sum(int((module[n] != masters[n]).sum()) for n in live16) > 0  # ZenFlow's columns
    report = verify(case.checkpoint)
    assert report.ok, report.problems
    check = next(c for c in report.checks if c.name == "module weights")
    assert check.ok is True and "topk_ratio 0.3" in check.detail, check
    consolidate(case.checkpoint, tmp_path / "fp32")
    ours = load_file(next((tmp_path / "fp32").glob("*.safetensors")))
    assert all(same_bits(ours[n], masters[n]) for n in live16)
    reshard(case.checkpoint, tmp_path / "out", world_size=3, stage=2)
    live, optim, state = run_probe(VARIANTS, tmp_path / "out", 3, tmp_path / "probe", stage=2, train_steps=1)
    assert state["optimizer_class"].startswith("ZenFlowZeroOptimizerSequential"), state["optimizer_class"]
    _check_loaded(case, live, optim, state, 3, 2)
    loaded = load_file(tmp_path / "probe" / "live_module.safetensors")
    assert all(same_bits(loaded[n], module[n]) for n in live16)
    # a warm-up round again (the engine counts micro-steps from 0 after a load): one optimizer step
    assert state["train"]["global_steps_after"] == 4 and all(
        torch.isfinite(torch.tensor(state["train"]["losses_mean"]))
    )


@pytest.fixture(scope="module")
def overlap(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    return _fresh(tmp_path_factory.mktemp("zenflow_overlap"), OVERLAP)


def test_zenflow_overlap_step_run_is_read_and_resharded(overlap: Sample, tmp_path: Path) -> None:
    """overlap_step: the optimizer files hold no moments or step (ZenFlow's optimizer process
    kept them); the module weights are the live engine's, most elements off the masters rounded
    (a step behind); verify passes, skipping that check and saying the moments are not saved;
    consolidate gives the live masters; DeepSpeed loads zckpt's reshard at 1 rank, ZeRO-2, with
    the saved masters and module weights bit for bit, and trains an optimizer step on it."""
    case = overlap
    tag = case.checkpoint / case.meta["tag"]
    assert case.meta["tag"] == "global_step3", case.meta["tag"]
    for rank in range(2):
        saved = torch.load(tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
        assert saved["optimizer_state_dict"]["base_optimizer_state"]["state"] == {}
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    masters, live16 = case.live(), case.live_params16()
    differ = total = 0
    for name in live16:
        assert same_bits(module[name], live16[name]), name
        differ += int((module[name].view(torch.int16) != masters[name].to(torch.bfloat16).view(torch.int16)).sum())
        total += module[name].numel()
    assert differ > total // 2, (differ, total)  # not a few selected columns: a whole step apart

    report = verify(case.checkpoint)
    assert report.ok, report.problems
    check = next(c for c in report.checks if c.name == "module weights")
    assert check.ok is None and "overlap_step" in check.detail, check
    assert any("overlap_step" in note and "does not save" in note for note in report.notes), report.notes

    consolidate(case.checkpoint, tmp_path / "fp32")
    ours = load_file(next((tmp_path / "fp32").glob("*.safetensors")))
    for name in live16:
        assert same_bits(ours[name], masters[name]), name

    resharded = reshard(case.checkpoint, tmp_path / "out", world_size=1, stage=2)
    assert any("overlap_step" in note and "does not save" in note for note in resharded.notes), resharded.notes
    live, optim, state = run_probe(OVERLAP, tmp_path / "out", 1, tmp_path / "probe", stage=2, train_steps=2)
    assert state["optimizer_class"].startswith("ZenFlowZeroOptimizerParallel"), state["optimizer_class"]
    assert optim == {}  # nothing to load: the engine starts the moments from zero
    for name, expected in masters.items():  # masters and buffers
        assert same_bits(live[name], expected), name
    loaded = load_file(tmp_path / "probe" / "live_module.safetensors")
    for name in live16:
        assert same_bits(loaded[name], module[name]), name
    assert (state["global_steps"], state["zero_stage"], state["world_size"]) == (3, 2, 1)
    train = state["train"]
    assert train["global_steps_after"] == 4 and all(torch.isfinite(torch.tensor(train["losses_mean"])))


def test_zenflow_overlap_step_universal_folder_loads_at_zero12(overlap: Sample, tmp_path: Path) -> None:
    """No optimizer state: inspect says a ZeRO-1/2 run's universal load restores the masters and a
    ZeRO-3 run's fails; DeepSpeed's ZeRO-1/2 loader loads zckpt's universal folder into a ZeRO-2
    engine with the saved masters bit for bit and no moments (ZeRO-3's, without ZenFlow, which
    needs CUDA there, stopped on the step optimizer_state.pt lacks: KeyError 0, stage3.py:3664)."""
    lines = [line for line in render(inspect_path(overlap.checkpoint)).splitlines() if line.startswith("  universal ")]
    assert "ZeRO-1/2 run's universal load restores the masters" in lines[0], lines
    assert "ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq, step)" in lines[1], lines
    result = to_universal(overlap.checkpoint, tmp_path / "uc", target_stage=2)
    assert any("does not save" in note for note in result.notes), result.notes
    live, optim, state = run_probe(OVERLAP, tmp_path / "uc", 1, tmp_path / "probe", stage=2, load_universal=True)
    assert state["optimizer_class"].startswith("ZenFlowZeroOptimizerParallel"), state["optimizer_class"]
    assert optim == {}
    masters = overlap.live()
    for name in overlap.live_params16():  # trainable params (a universal load skips buffers)
        assert same_bits(live[name], masters[name]), name

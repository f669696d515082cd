"""The DeepSpeed probe (``scripts/ds_probe.py`` via ``interop_helpers.run_probe``) checked against
independent truth: bundled sample checkpoints loaded by real DeepSpeed at their ORIGINAL world
size and stage must give back, bit for bit, the live values the training run read from its engine
just before saving (``reference/live*.safetensors``), and the step counters / loss scale the
generator recorded (``meta.json``). The reshard tests trust the probe because of this file.

Run: ``python -m pytest -m deepspeed tests/test_interop/test_probe.py`` (DeepSpeed in this interpreter, or
``ZCKPT_DS_PYTHON`` naming one; ~10-25 s per DeepSpeed run on 2 cores).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import Sample, same_bits, sample
from interop_helpers import ProbeError, run_probe, shm_leak_safety_net  # noqa: F401 (autouse fixture)

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

MICRO_BATCH = 2  # make_sample_ckpts.MICRO_BATCH

# original world size and stage of each; together: ZeRO 1/2/3, fp32/bf16/fp16, ws 2-4, several
# param groups, ZeRO-3 sub-groups, frozen, tied, round-robin, BF16_Optimizer, a scheduler, 0.14.4
CASES = [
    "z2_fp16_ws4_tied",
    "z1_bf16_ws3_groups",
    "z1_bf16_ws3_bf16optimizer_frozen",
    "z1_fp32_ws2_frozen_tied",
    "z1_fp32_ws2_roundrobin",
    "z3_bf16_ws3_subgroups_groups",
    "z3_fp16_ws4_subgroups_frozen",
    "hf_trainer",
    "ds14_z1_fp16_ws2",
    "ds14_z3_fp32_ws2_subgroups_groups",
]


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _check_tensors(s: Sample, live: dict, optim: dict, state: dict) -> None:
    ref = s.live()
    assert sorted(live) == sorted(ref)
    for name, expected in ref.items():
        if s.meta["deepspeed_version"].startswith("0.14") and name in s.meta["buffers"]:
            # 0.14 cast float buffers to the 16-bit dtype, 0.19.8 keeps them fp32: same values
            assert same_bits(_widened(live[name]), _widened(expected)), name
        else:
            assert same_bits(live[name], expected), name

    ref_optim_file = s.folder / "reference" / "live_optimizer.safetensors"
    trainable = [n for n in ref if n not in s.meta["frozen"] and n not in s.meta["buffers"]]
    assert sorted(optim) == sorted(f"{n}.{k}" for n in trainable for k in ("exp_avg", "exp_avg_sq"))
    if ref_optim_file.exists():
        for name, expected in load_file(ref_optim_file).items():
            assert same_bits(optim[name], expected), name
    else:  # the training run could not read them (DeepSpeed bugs, see sample_ckpts/README.md)
        for name in trainable:
            for key in ("exp_avg", "exp_avg_sq"):
                t = optim[f"{name}.{key}"]
                assert t.dtype == torch.float32 and t.shape == live[name].shape
                assert torch.isfinite(t).all() and t.abs().sum() > 0, f"{name}.{key}"
            assert bool((optim[f"{name}.exp_avg_sq"] >= 0).all()), name


def _check_module_values(out: Path, live: dict, state: dict) -> None:
    """The module's own (16-bit) params equal the fp32 masters rounded to the training dtype."""
    module = load_file(out / "live_module.safetensors")
    for name, value in module.items():
        if name in state["frozen"]:
            assert same_bits(value, live[name]), name
        else:
            assert same_bits(value, live[name].to(value.dtype)), name


@pytest.mark.parametrize("name", CASES)
def test_probe_reads_original_checkpoint(name: str, tmp_path: Path) -> None:
    s = sample(name)
    meta = s.meta
    ws = meta["world_size"]
    live, optim, state = run_probe(name, s.checkpoint, ws, tmp_path / "probe")

    # what was loaded
    assert state["zero_stage"] == meta["zero_stage"] and state["world_size"] == ws
    assert state["dtype"] == meta["dtype"]
    assert Path(state["load_path"]).parent.name == meta["tag"]
    assert sorted(state["frozen"]) == sorted(meta["frozen"]) and state["tied"] == meta["tied"]
    assert state["buffers"] == meta["buffers"]
    _check_tensors(s, live, optim, state)
    _check_module_values(tmp_path / "probe", live, state)

    # counters and loss scale
    steps = meta["steps"]
    assert state["global_steps"] == steps and state["skipped_steps"] == meta["skipped_steps"]
    assert state["global_samples"] == steps * MICRO_BATCH * ws
    if meta["dtype"] == "fp16":
        assert state["cur_scale"] == meta["final_loss_scale"]
        scaler = state["loss_scaler"]
        assert scaler["type"].endswith("DynamicLossScaler") and scaler["cur_scale"] == meta["final_loss_scale"]
        assert scaler["cur_iter"] == steps and state["dynamic_loss_scale"] is True
    elif state["cur_scale"] is not None:  # BF16_Optimizer has no scaler
        assert state["cur_scale"] == 1.0

    # optimizer groups: hyperparameters of the run and the Adam step of every flat group
    groups = state["param_groups"]
    assert len(groups) == meta["param_groups"]
    adam_steps = steps - meta["skipped_steps"]
    assert all(step == adam_steps for g in groups for step in g["step"]), groups
    if meta["zero_stage"] == 3:
        assert sum(len(g["step"]) for g in groups) == meta["n_fp32_sub_groups"]
    else:
        assert all(len(g["step"]) == 1 for g in groups)
    expected_lr = [1e-2, 3e-3] if len(groups) == 2 else [1e-2]
    expected_wd = [0.01, 0.0] if len(groups) == 2 else [0.01]
    for g, lr, wd in zip(groups, expected_lr, expected_wd):
        h = g["hyperparameters"]
        assert math.isclose(h["lr"], lr, rel_tol=1e-12) and h["weight_decay"] == wd
        assert h["betas"] == [0.9, 0.999] and h["eps"] == 1e-8
    if "scheduler" in meta["ds_config"]:
        # WarmupLR starts at last_batch_iteration=-1 and steps once per optimizer step
        assert state["lr_scheduler"] == {"last_batch_iteration": steps - 1}
    else:
        assert state["lr_scheduler"] is None
    assert state["client_state"]["ds_version"] == meta["deepspeed_version"]

    # how the tensors were read
    methods = state["methods"]
    cross = state["cross_checks"]
    if meta["zero_stage"] == 3:
        assert all(m.startswith("safe_get_full_optimizer_state") for m in methods["optimizer"].values())
    else:
        # after load_checkpoint DeepSpeed 0.19.8 leaves the hp->optimizer-state links unset
        assert not any(cross["optim_fragments_linked"].values())
        assert all(m == "flat_partition_allgather" for m in methods["optimizer"].values())
    if name == "z1_fp32_ws2_roundrobin":
        # DeepSpeed 0.19.8's round-robin bug: safe_get_full_fp32_param reads the wrong elements;
        # the probe notices and dumps the flat buffer's values (checked equal to the reference above)
        assert cross["fp32_master_disagreements"]
    else:
        assert not cross.get("fp32_master_disagreements") and not cross.get("optimizer_disagreements")
        assert not cross.get("offset_disagreements")


def test_probe_resumed_run_continues_the_original_run(tmp_path: Path) -> None:
    """Load the older tag (global_step2) of a two-tag checkpoint and train 1 step on the
    generator's data stream: the engine then holds what the original run held at step 3.

    Bit for bit on the kind of CPU the sample was made on; on another (this one has AVX-512,
    measured) torch's float kernels round a few elements differently: up to 2e-7 of a tensor's
    largest value. So each tensor must be within 1e-5 of its largest value of the original's,
    while the step itself moves every trainable param by at least 1e3 times that difference
    (about 1e-2 here): a misaligned batch, lr or step count would show; rounding does not."""
    s = sample("z2_fp32_ws2_twotags")
    _, _, state = run_probe(s.name, s.checkpoint, 2, tmp_path / "probe", tag="global_step2", train_steps=1)
    assert state["global_steps"] == 2 and state["param_groups"][0]["step"] == [2.0]
    train = state["train"]
    assert train["steps"] == [3] and train["global_steps_after"] == 3
    assert all(math.isfinite(x) for x in train["losses_mean"]) and len(train["losses_per_rank"][0]) == 2
    loaded = load_file(tmp_path / "probe" / "live.safetensors")  # step 2, as loaded
    after = load_file(tmp_path / "probe" / "live_after_train.safetensors")
    after_optim = load_file(tmp_path / "probe" / "live_optimizer_after_train.safetensors")
    for name, expected in s.live().items():
        off = _largest_difference(after[name], expected)
        assert off <= 1e-5 * float(expected.double().abs().max()), (name, off)
        moved = _largest_difference(expected, loaded[name])
        assert off == 0 or moved >= 1e3 * off, (name, off, moved)
    for name, expected in load_file(s.folder / "reference" / "live_optimizer.safetensors").items():
        off = _largest_difference(after_optim[name], expected)
        assert off <= 1e-5 * float(expected.double().abs().max()), (name, off)


def _largest_difference(a, b) -> float:  # type: ignore[no-untyped-def]
    assert a.dtype == b.dtype and a.shape == b.shape
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def test_probe_reports_deepspeed_refusal(tmp_path: Path) -> None:
    """A checkpoint of 2 ranks loaded at 1: DeepSpeed refuses; run_probe raises with its message."""
    s = sample("z2_fp32_ws2_twotags")
    with pytest.raises(ProbeError) as err:
        run_probe(s.name, s.checkpoint, 1, tmp_path / "probe")
    assert "ZeRORuntimeException" in err.value.error_text
    assert "DP world size of 2 but the current world size is 1" in err.value.error_text

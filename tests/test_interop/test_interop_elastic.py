"""Real DeepSpeed loads zckpt's outputs from real ZeRO-1/2 runs saved with
``zero_optimization.elastic_checkpoint`` (samples z2_bf16_ws2_elastic, z1_fp32_ws3_elastic; issue 35):
a reshard at another world size (and to ZeRO-3), written in the rigid layout, which DeepSpeed loads
into the probe's elastic engine ("loading rigid ckpt into either rigid or elastic exec",
stage_1_and_2.py), and a universal folder through load_universal. The engine then holds the live
masters and Adam moments, the run's step, and param groups equal to those DeepSpeed saved for the
same optimizer config in a rigid run (z2_fp32_ws1: the elastic files save none)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from helpers import same_bits, sample  # noqa: E402
from interop_checks import GEN, _check_loaded, _fresh_buffers  # noqa: E402
from interop_helpers import run_probe, shm_leak_safety_net  # noqa: E402,F401 (autouse fixture)
from zckpt.ops.reshard import reshard  # noqa: E402
from zckpt.ops.universal import to_universal  # noqa: E402


def _rigid_groups() -> list[dict]:
    """The param groups DeepSpeed saved for torch's AdamW (lr 1e-2, weight_decay 0.01) in a rigid run."""
    rigid = sample("z2_fp32_ws1")
    assert rigid.meta["ds_config"]["optimizer"] == sample("z2_bf16_ws2_elastic").meta["ds_config"]["optimizer"]
    saved = torch.load(
        rigid.checkpoint / rigid.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in saved["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    ]


def _check_elastic(name: str, state: dict, live: dict, optim: dict, world_size: int, stage: int) -> None:
    case = sample(name)
    assert case.meta["ds_config"]["zero_optimization"]["elastic_checkpoint"] is True
    _check_loaded(case, live, optim, state, world_size, stage)
    # the run's step, as the meta says (not as zckpt read it)
    assert [set(g["step"]) for g in state["param_groups"]] == [{float(case.meta["steps"])}]
    assert [g["hyperparameters"] for g in state["param_groups"]] == _rigid_groups()


@pytest.mark.parametrize(
    ("name", "world_size", "stage"), [("z2_bf16_ws2_elastic", 3, 2), ("z1_fp32_ws3_elastic", 2, 3)]
)
def test_deepspeed_loads_the_reshard_of_an_elastic_run(name: str, world_size: int, stage: int, tmp_path: Path) -> None:
    case = sample(name)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    _check_elastic(name, state, live, optim, world_size, stage)


def test_deepspeed_resumes_the_universal_folder_of_an_elastic_run(tmp_path: Path) -> None:
    """load_universal restores no buffers (the fresh model's), the rest as after a reshard."""
    from safetensors.torch import load_file

    name = "z2_bf16_ws2_elastic"
    case = sample(name)
    to_universal(case.checkpoint, tmp_path / "uc")
    live, optim, state = run_probe(name, tmp_path / "uc", 3, tmp_path / "probe", load_universal=True)
    assert (state["world_size"], state["zero_stage"]) == (3, 2)
    assert state["ds_config"]["checkpoint"]["load_universal"] is True
    fresh = _fresh_buffers(GEN.CASES_BY_NAME[name])
    saved_live = case.live()
    assert set(live) == set(saved_live)
    for key, expected in saved_live.items():
        if key in case.meta["buffers"]:
            expected = fresh[key].to(live[key].dtype)
        assert same_bits(live[key], expected), key
    expected_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert set(optim) == set(expected_optim)
    for key, expected in expected_optim.items():
        assert same_bits(optim[key], expected), key
    assert state["global_steps"] == case.meta["steps"]
    assert [set(g["step"]) for g in state["param_groups"]] == [{float(case.meta["steps"])}]
    assert [g["hyperparameters"] for g in state["param_groups"]] == _rigid_groups()

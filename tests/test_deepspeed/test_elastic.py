"""Real ZeRO-1/2 runs saved with zero_optimization.elastic_checkpoint (samples z2_bf16_ws2_elastic,
z1_fp32_ws3_elastic; issue 35): DeepSpeed 0.19.8 saves base_optimizer_state as a list, one dict
per param group of the group's flat partition states less the group's padding, and no param
groups. (inspect, verify, consolidate, to-dcp and to-universal against the live engine: the tests
parametrized over every sample; DeepSpeed's loads of the outputs: test_interop_elastic.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Sample, deepspeed_base_state, load_with_stand_ins, same_bits, sample
from zckpt.ops.inspect import inspect_path
from zckpt.ops.reshard import reshard

ELASTIC = [sample("z2_bf16_ws2_elastic"), sample("z1_fp32_ws3_elastic")]


def _optim_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))


@pytest.mark.parametrize("case", ELASTIC, ids=lambda s: s.name)
def test_deepspeed_saved_per_group_states_without_padding(case: Sample) -> None:
    for path in _optim_files(case.checkpoint / case.meta["tag"]):
        inner = load_with_stand_ins(path)["optimizer_state_dict"]
        base = inner["base_optimizer_state"]
        assert isinstance(base, list) and "base_optimizer_state_step" not in inner  # torch's AdamW: a step per param
        for g, group in enumerate(base):
            assert list(group) == ["step", "exp_avg", "exp_avg_sq"]
            assert group["exp_avg"].numel() == inner["single_partition_of_fp32_groups"][g].numel()


@pytest.mark.parametrize("case", ELASTIC, ids=lambda s: s.name)
def test_inspect_lists_the_states_and_says_what_is_not_saved(case: Sample) -> None:
    report = inspect_path(str(case.checkpoint))
    assert report["complete"], report["problems"]
    assert report["training_state"]["optimizer_states"] == ["exp_avg", "exp_avg_sq"]
    assert any("elastic_checkpoint" in note and "AdamW" in note for note in report["notes"])


@pytest.mark.parametrize("case", ELASTIC, ids=lambda s: s.name)
def test_identity_reshard_writes_the_rigid_layout_of_deepspeeds_states(case: Sample, tmp_path: Path) -> None:
    """The rigid files zckpt writes hold DeepSpeed's saved states (each padded partition's elements
    as saved, then zeros) and the groups DeepSpeed saved for the same optimizer config in a rigid run."""
    reshard(case.checkpoint, tmp_path / "out", world_size=case.meta["world_size"], stage=case.meta["zero_stage"])
    theirs = _optim_files(case.checkpoint / case.meta["tag"])
    ours = _optim_files(tmp_path / "out" / case.meta["tag"])
    assert [p.name for p in theirs] == [p.name for p in ours]
    for a_path, b_path in zip(theirs, ours):
        a = load_with_stand_ins(a_path)["optimizer_state_dict"]
        b = load_with_stand_ins(b_path)["optimizer_state_dict"]
        rigid = deepspeed_base_state(a)  # DeepSpeed's per-group states, its rigid run's groups
        base = b["base_optimizer_state"]
        assert isinstance(base, dict)
        assert base["param_groups"] == rigid["param_groups"]
        for g, saved in rigid["state"].items():
            assert list(base["state"][g]) == list(saved)
            assert same_bits(base["state"][g]["step"], saved["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                n = saved[key].numel()
                assert same_bits(base["state"][g][key][:n], saved[key]), (b_path.name, g, key)
                assert not base["state"][g][key][n:].any()
                assert base["state"][g][key].numel() == n + a["group_paddings"][g]
        for x, y in zip(a["single_partition_of_fp32_groups"], b["single_partition_of_fp32_groups"]):
            assert same_bits(x, y)

"""Real ZeRO-1/2 runs saved with zero_optimization.elastic_checkpoint (samples z2_bf16_ws2_elastic,
z1_fp32_ws3_elastic; issue 35): DeepSpeed 0.19.8 saves base_optimizer_state as a list, one dict
per param group of the group's flat partition states less the group's padding, and no param
groups. (inspect, verify, consolidate, to-dcp and to-universal against the live engine: the tests
parametrized over every sample; DeepSpeed's loads of the outputs: test_interop_elastic.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import (
    Sample,
    copy_checkpoint,
    deepspeed_base_state,
    load_with_stand_ins,
    rewrite_torch_file,
    same_bits,
    sample,
)
from zckpt import load_state_dict
from zckpt.core.errors import LayoutError
from zckpt.deepspeed.optimizers import engine_param_group, muon_param_groups
from zckpt.ops.consolidate import consolidate
from zckpt.ops.dcp import to_dcp
from zckpt.ops.inspect import inspect_path
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify

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
def test_identity_reshard_writes_deepspeeds_elastic_files(case: Sample, tmp_path: Path) -> None:
    """ZeRO-1/2 output of an elastic run is written in its layout, which DeepSpeed's loaders fill
    from the engine's own groups: every rank's per-group states as DeepSpeed saved them (less the
    padding), and base_optimizer_state_step None (torch's AdamW keeps its step per param; the
    elastic loader asserts the key, stage_1_and_2.py:3580)."""
    reshard(case.checkpoint, tmp_path / "out", world_size=case.meta["world_size"], stage=case.meta["zero_stage"])
    theirs = _optim_files(case.checkpoint / case.meta["tag"])
    ours = _optim_files(tmp_path / "out" / case.meta["tag"])
    assert [p.name for p in theirs] == [p.name for p in ours]
    for a_path, b_path in zip(theirs, ours):
        a = load_with_stand_ins(a_path)["optimizer_state_dict"]
        b = load_with_stand_ins(b_path)["optimizer_state_dict"]
        assert list(b) == [*list(a)[:5], "base_optimizer_state_step", *list(a)[5:]]
        assert b["base_optimizer_state_step"] is None
        assert len(a["base_optimizer_state"]) == len(b["base_optimizer_state"])
        for saved, written in zip(a["base_optimizer_state"], b["base_optimizer_state"]):
            assert list(saved) == list(written)
            for key in saved:
                assert same_bits(saved[key], written[key]), (b_path.name, key)
        for x, y in zip(a["single_partition_of_fp32_groups"], b["single_partition_of_fp32_groups"]):
            assert same_bits(x, y)
        assert a["group_paddings"] == b["group_paddings"]


def test_reshard_with_elastic_checkpoint_off_writes_the_rigid_layout(tmp_path: Path) -> None:
    """A target config without elastic_checkpoint gets the rigid layout: DeepSpeed's saved states
    (each padded partition's elements as saved, then zeros) and the groups DeepSpeed saved for the
    same optimizer config in a rigid run."""
    case = ELASTIC[0]
    off = {"zero_optimization": {"elastic_checkpoint": False}}
    reshard(case.checkpoint, tmp_path / "out", world_size=case.meta["world_size"], config=off)
    theirs = _optim_files(case.checkpoint / case.meta["tag"])
    ours = _optim_files(tmp_path / "out" / case.meta["tag"])
    for a_path, b_path in zip(theirs, ours):
        a = load_with_stand_ins(a_path)["optimizer_state_dict"]
        b = load_with_stand_ins(b_path)["optimizer_state_dict"]
        rigid = deepspeed_base_state(a)  # DeepSpeed's per-group states, its rigid run's groups
        base = b["base_optimizer_state"]
        assert isinstance(base, dict) and "base_optimizer_state_step" not in b
        assert base["param_groups"] == rigid["param_groups"]
        for g, saved in rigid["state"].items():
            assert list(base["state"][g]) == list(saved)
            assert same_bits(base["state"][g]["step"], saved["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                n = saved[key].numel()
                assert same_bits(base["state"][g][key][:n], saved[key]), (b_path.name, g, key)
                assert not base["state"][g][key][n:].any()
                assert base["state"][g][key].numel() == n + a["group_paddings"][g]


def _edit_config(tag: Path, change, inner=None) -> None:  # noqa: ANN001
    """Apply `change` to the ds_config every file of the tag folder holds (and `inner` to each
    optimizer file's optimizer_state_dict), as the run that saved them would have."""
    for path in sorted(tag.glob("*model_states.pt")):
        state = torch.load(path, weights_only=False)
        change(state["ds_config"])
        torch.save(state, path)

    def both(tree: dict) -> None:
        change(tree["ds_config"])
        if inner is not None:
            inner(tree["optimizer_state_dict"])

    for path in _optim_files(tag):
        rewrite_torch_file(path, both)


def _scripts_own_optimizer(tmp_path: Path) -> Path:
    """A real elastic run's files as a run whose training script built its own optimizer saves
    them: the same files, the config without an optimizer section (DeepSpeed's engine then takes
    the client's, runtime/engine.py _configure_optimizer)."""
    tag = copy_checkpoint(tmp_path, ELASTIC[0])
    _edit_config(tag, lambda config: config.pop("optimizer"))
    return tag.parent


def test_the_scripts_own_optimizer_is_read_and_written_where_no_hyperparameters_are_needed(tmp_path: Path) -> None:
    """inspect, verify, consolidate, diff need no hyperparameters; ZeRO-1/2 (elastic) and universal
    outputs leave them to the loading engine (universal: groups of ``params`` only, which
    DeepSpeed's universal loader sets no key from, runtime/base_optimizer.py:377-380)."""
    checkpoint = _scripts_own_optimizer(tmp_path)
    report = inspect_path(str(checkpoint))
    assert report["complete"], report["problems"]
    assert any("training script's own" in note for note in report["notes"])
    assert verify(checkpoint).ok
    consolidate(checkpoint, tmp_path / "weights")
    consolidate(checkpoint, tmp_path / "lightning", format="lightning")  # weights only: no groups needed
    theirs = load_state_dict(ELASTIC[0].checkpoint, dtype="fp32")
    ours = load_state_dict(checkpoint, dtype="fp32")
    assert sorted(theirs) == sorted(ours) and all(same_bits(theirs[n], ours[n]) for n in theirs)
    reshard(checkpoint, tmp_path / "ws3", world_size=3)
    for path in _optim_files(tmp_path / "ws3" / ELASTIC[0].meta["tag"]):
        inner = load_with_stand_ins(path)["optimizer_state_dict"]
        assert isinstance(inner["base_optimizer_state"], list) and inner["base_optimizer_state_step"] is None
    to_universal(checkpoint, tmp_path / "uc")
    folder = tmp_path / "uc" / (tmp_path / "uc" / "latest_universal").read_text().strip()
    groups = load_with_stand_ins(folder / "zero" / "optimizer_state.pt")["param_groups"]
    assert [sorted(g) for g in groups] == [["params"]]
    to_universal(checkpoint, tmp_path / "uc3", target_stage=3)  # the ZeRO-3 flavour: the same groups
    folder = tmp_path / "uc3" / (tmp_path / "uc3" / "latest_universal").read_text().strip()
    groups = load_with_stand_ins(folder / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["param_groups"]
    assert [sorted(g) for g in groups] == [["params"]]


@pytest.mark.parametrize(
    "write",
    [
        lambda c, o: reshard(c, o, world_size=2, stage=3),
        lambda c, o: reshard(c, o, world_size=3, config={"zero_optimization": {"elastic_checkpoint": False}}),
        lambda c, o: to_dcp(c, o),
        lambda c, o: consolidate(c, o, format="lightning", optimizer_states=True),
    ],
    ids=["zero3", "rigid", "dcp", "lightning"],
)
def test_outputs_that_hold_the_scripts_hyperparameters_are_refused_in_one_line(write, tmp_path: Path) -> None:  # noqa: ANN001
    checkpoint = _scripts_own_optimizer(tmp_path)
    with pytest.raises(LayoutError) as refused:
        write(checkpoint, tmp_path / "out")
    message = str(refused.value)
    assert "\n" not in message and "elastic_checkpoint" in message and "no optimizer section" in message
    assert "to-universal" in message
    assert not (tmp_path / "out").exists()


def test_deepspeeds_lion_groups_come_from_its_source_defaults(tmp_path: Path) -> None:
    """An elastic run of DeepSpeed's FusedLion (type Lion, not offloaded: GPU only), which keeps a
    group step (fused_lion.py:77-78, saved as base_optimizer_state_step): its groups are
    FusedLion's defaults over the config's params, for the outputs that hold them (to-universal
    here); reshard carries the group step."""
    tag = copy_checkpoint(tmp_path, ELASTIC[0])
    _edit_config(
        tag,
        lambda config: config.update(optimizer={"type": "Lion", "params": {"lr": 2e-4}}),
        lambda inner: inner.update(base_optimizer_state_step=0),
    )
    to_universal(tag.parent, tmp_path / "uc")
    folder = tmp_path / "uc" / (tmp_path / "uc" / "latest_universal").read_text().strip()
    groups = load_with_stand_ins(folder / "zero" / "optimizer_state.pt")["param_groups"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [
        {"lr": 2e-4, "betas": (0.9, 0.999), "weight_decay": 0.0, "step": 0}
    ]
    reshard(tag.parent, tmp_path / "ws3", world_size=3)
    for path in _optim_files(tmp_path / "ws3" / ELASTIC[0].meta["tag"]):
        assert load_with_stand_ins(path)["optimizer_state_dict"]["base_optimizer_state_step"] == 0


@pytest.mark.parametrize(
    ("section", "offload", "expected"),
    [
        ({"type": "Lion", "params": {"lr": 1e-4}}, True, {"lr": 1e-4, "betas": (0.9, 0.999), "weight_decay": 0}),
        (
            {"type": "Adagrad", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            True,
            {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.01, "amsgrad": False},
        ),
        (
            {"type": "Lamb", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            False,
            {
                "lr": 1e-3,
                "bias_correction": True,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "max_grad_norm": 0.0,
                "max_coeff": 10.0,
                "min_coeff": 0.01,
            },
        ),
    ],
    ids=["cpu_lion", "cpu_adagrad", "fused_lamb"],
)
def test_deepspeeds_own_optimizers_groups(section: dict, offload: bool, expected: dict) -> None:
    """DeepSpeedCPULion (cpu_lion.py:15,38), DeepSpeedCPUAdagrad (cpu_adagrad.py:14-16), FusedLamb
    (fused_lamb.py:41-65): their __init__'s group keys and defaults under the config's params."""
    config = {"optimizer": section, "zero_optimization": {"stage": 2}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert engine_param_group(config) == (expected, section["type"])


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({}, "no optimizer section"),
        ({"optimizer": {"type": "Muon", "params": {"lr": 1e-2}}}, "Muon"),
        ({"optimizer": {"type": "Lion", "params": {"lr": 1e-3, "eps": 1e-8}}}, "['eps']"),
    ],
    ids=["client", "muon", "unknown-param"],
)
def test_groups_zckpt_cannot_tell_say_why(config: dict, why: str) -> None:
    hyper, reason = engine_param_group(config)
    assert hyper is None and why in reason


MUON_RIGID = [sample("z1_bf16_ws2_muon"), sample("z2_fp32_ws3_muon"), sample("z2_fp32_ws3_muon_cpuoffload")]


@pytest.mark.parametrize("case", MUON_RIGID, ids=lambda s: s.name)
def test_muon_groups_from_the_config_are_those_deepspeed_saved(case: Sample) -> None:
    """An elastic Muon run keeps no groups; for one script group they are the config's
    (engine._muon_param_groups): equal, keys in order, to those the rigid Muon samples saved
    (FusedAdam's Adam half; DeepSpeedCPUAdam's where the optimizer is offloaded)."""
    (path,) = (case.checkpoint / case.meta["tag"]).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
    saved = load_with_stand_ins(path)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    expected = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    groups, why = muon_param_groups(case.meta["ds_config"], [True, False], [True, True])
    assert groups is not None, why
    assert [list(g.items()) for g in groups] == [list(g.items()) for g in expected]


def test_muon_groups_take_each_halfs_lr_and_muonwithauxadams_defaults() -> None:
    """muon_lr / adam_lr over lr, each half only its own keys, MuonWithAuxAdam's defaults
    (original_muon.py:381-396); FusedAdam's group step only once stepped (fused_adam.py:132-133)."""
    config = {"optimizer": {"type": "Muon", "params": {"lr": 1e-2, "muon_lr": 5e-2, "adam_lr": 1e-3, "eps": 1e-8}}}
    groups, _ = muon_param_groups(config, [True, False], [True, False])
    assert groups == [
        {"use_muon": True, "name": "muon-params", "lr": 5e-2, "momentum": 0.95, "weight_decay": 0, "ns_method": "gram"},
        {
            "use_muon": False,
            "name": "adam-params",
            "lr": 1e-3,
            "eps": 1e-8,
            "betas": (0.9, 0.95),
            "weight_decay": 0,
            "bias_correction": True,
        },
    ]
    torch_adam = {"optimizer": {"type": "Muon", "params": {"lr": 1e-2, "torch_adam": True}}}
    groups, _ = muon_param_groups(torch_adam, [False], [True])
    assert groups is not None and groups[0]["lr"] == 1e-2 and "amsgrad" in groups[0] and "step" not in groups[0]


@pytest.mark.parametrize("halves", [[True, False, False], [True, False, True, False], [False, True]])
def test_muon_groups_not_of_one_script_group_are_not_told(halves: list[bool]) -> None:
    """Several script groups (own values) or MoE regrouping: names and values in no file."""
    groups, why = muon_param_groups({"optimizer": {"type": "Muon", "params": {}}}, halves, [True] * len(halves))
    assert groups is None and "flat groups" in why


def test_elastic_muon_views_take_the_config_groups_told_by_any_ranks_states() -> None:
    """rigid_views: the halves are told by their states on any rank (a rank whose partition
    touches no Muon param keeps an empty state, stage_1_and_2.py:2724-2729), each view then has
    both halves' groups; three flat groups (the script's own) get none, and the note says why."""
    from zckpt.deepspeed.elastic import rigid_views

    config = {
        "optimizer": {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9}},
        "zero_optimization": {"stage": 2, "elastic_checkpoint": True},
    }
    adam = {"step": 3, "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}

    def rank(muon: dict, groups: int = 2) -> dict:
        return {
            "base_optimizer_state": [muon, *[dict(adam) for _ in range(groups - 1)]],
            "single_partition_of_fp32_groups": [torch.zeros(4)] * groups,
            "group_paddings": [0] * groups,
        }

    inner = {0: rank({"momentum_buffer": torch.zeros(6)}), 1: rank({})}
    views, refusal, notes = rigid_views(inner, config, {0: "a", 1: "b"})
    expected, _ = muon_param_groups(config, [True, False], [True, True])
    assert refusal is None and "_muon_param_groups" in notes[0]
    for view in views.values():
        groups = view["base_optimizer_state"]["param_groups"]
        assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == expected
    inner = {0: rank({"momentum_buffer": torch.zeros(6)}, 3), 1: rank({}, 3)}
    views, refusal, notes = rigid_views(inner, config, {0: "a", 1: "b"})
    assert refusal is None and "flat groups" in notes[0]
    groups = views[1]["base_optimizer_state"]["param_groups"]
    assert [set(g) for g in groups] == [{"use_muon", "params"}] * 3
    assert [g["use_muon"] for g in groups] == [True, False, False]  # rank 1's empty state: told by rank 0's

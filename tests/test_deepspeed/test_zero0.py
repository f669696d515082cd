"""ZeRO-0 checkpoints (ZeRO off; issue 19's native mixture-of-experts row at ZeRO-0): samples
written by real DeepSpeed 0.19.8 on CPU (``scripts/make_sample_ckpts.py`` z0_*,
``scripts/make_parallel_ckpts.py`` moe_z0_*). Such a run saves no optimizer files: the module (its
fp32 params are the masters) and the torch optimizer's ``state_dict()`` keyed by param index, with
no param names. The truth is the live engine before saving: every param as the module held it and
the torch optimizer's own ``state[param]`` moments, under each param's name
(``reference/live*.safetensors``), which zckpt never wrote."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import (
    Sample,
    assert_slices_are_live,
    copy_checkpoint,
    run_cli,
    same_bits,
    same_checkpoint_files,
    sample,
)
from zckpt import load_state_dict, reshard, to_universal
from zckpt.core.errors import LayoutError, UsageError
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state
from zckpt.deepspeed.zero0 import name_optimizer_params
from zckpt.io.materialize import read_scalar, read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.verify import verify

PLAIN = sample("z0_fp32_ws2_tied")
BF16 = sample("z0_bf16_ws2_tied")  # DeepSpeed's FP16_UnfusedOptimizer: fp32 masters beside the state
FP16 = sample("z0_fp16_ws2")  # the same, with a dynamic loss scaler
FROZEN = sample("z0_fp32_ws2_frozen_tied")
MOE = sample("moe_z0_fp32_ep2_dp2")
MOE_BF16 = sample("moe_z0_bf16_ep2_dp2")  # each expp_rank file FP16_UnfusedOptimizer's, masters beside
MEGATRON = sample("megatron_z0_fp32_tp2")
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.0.weight"


def _live_optimizer(case: Sample) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(case.folder / "reference" / "live_optimizer.safetensors")


def _assert_live_state(checkpoint: Path, case: Sample) -> None:
    """The training state read from `checkpoint` holds the live engine's masters and moments
    for every trainable param, and the step the run took."""
    state = open_training_state(checkpoint)
    live, moments = case.live(), _live_optimizer(case)
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[param.name]), param.name
            for key in ("exp_avg", "exp_avg_sq"):
                value = read_tensor(reader, param.states[key]).reshape(param.shape)
                assert same_bits(value, moments[f"{param.name}.{key}"]), (param.name, key)
        # DeepSpeed's FP16_UnfusedOptimizer (a 16-bit ZeRO-0 run) steps its torch optimizer once on
        # zero grads when it starts (initialize_optimizer_states): the saved step is one more
        extra = 1 if case.meta["zero_stage"] == 0 and case.meta["dtype"] != "fp32" else 0
        for group in state.groups:
            scalar = group.scalars["step"]
            step = read_scalar(reader, scalar.tensor) if scalar.tensor is not None else scalar.value
            assert step == case.meta["steps"] + extra
    assert state.global_steps == case.meta["steps"]


@pytest.mark.parametrize("case", [PLAIN, BF16, FP16, FROZEN, MOE, MOE_BF16], ids=lambda s: s.name)
def test_consolidate_gives_the_live_engines_weights(case: Sample) -> None:
    index = open_checkpoint(case.checkpoint)
    assert index.zero_stage == 0 and index.world_size == case.meta["world_size"]
    live = case.live()
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    assert sorted(state_dict) == sorted(live)
    for name, value in live.items():
        assert same_bits(state_dict[name], value.float() if value.is_floating_point() else value), name


def test_a_16bit_run_reads_its_fp32_masters_and_checks_the_module_against_them(tmp_path: Path) -> None:
    """A bf16 ZeRO-0 run's module holds bf16 copies; its fp32 masters are FP16_UnfusedOptimizer's
    fp32_groups. Consolidation gives the masters (the live engine's), verify checks each module
    weight is its master rounded, and names the file where one is not."""
    index = open_checkpoint(BF16.checkpoint)
    assert index.dtype.short == "bf16" and len(index.rounded_copies) == 14
    assert verify(BF16.checkpoint).ok

    def nudge(m: dict) -> None:
        m["module"]["fc1.weight"][0, 0] += 1

    checkpoint = _damaged(tmp_path, BF16, MODEL, nudge)
    report = verify(checkpoint)
    assert not report.ok and any("fc1.weight" in p and MODEL in p for p in report.problems), report.problems


def test_the_experts_are_every_expert_ranks() -> None:
    index = open_checkpoint(MOE.checkpoint)
    assert index.topology == Topology(ep=2, dp=2)
    assert all(EXPERT.format(e) in index.names() for e in range(4))
    assert index.placements[EXPERT.format(3)].startswith("expert 3 on expert rank 1 of 2")


@pytest.mark.parametrize("case", [PLAIN, BF16, FP16, MOE, MOE_BF16], ids=lambda s: s.name)
def test_the_optimizer_state_is_the_live_engines(case: Sample) -> None:
    """The torch optimizer's state, saved by index, lands on the right names: every moment equals
    the live optimizer's state of the param of that name (the expert ranks' own files for experts)."""
    _assert_live_state(case.checkpoint, case)
    state = open_training_state(case.checkpoint)
    aliases = {e.name for e in state.index.entries if e.kind == "tied"}  # the live dump lists tied names twice
    assert len(state.params) * 2 == len([k for k in _live_optimizer(case) if k.rsplit(".", 1)[0] not in aliases])
    if case in (MOE, MOE_BF16):
        assert len(state.groups) == 2 and state.groups[1].hyperparams.get("moe") is True
        assert {p.name for p in state.params if p.group == 1} == {n for n in state.index.names() if "experts" in n}


def test_a_tied_weight_is_one_param_and_an_alias() -> None:
    index = open_checkpoint(PLAIN.checkpoint)
    tied = [e for e in index.entries if e.kind == "tied"]
    assert [(e.name, e.alias_of) for e in tied] == [("lm_head.weight", "embed.weight")]


@pytest.mark.parametrize(
    "case, world, stage",
    [
        (PLAIN, 3, 1),
        (PLAIN, 1, 2),
        (PLAIN, 2, 3),
        (BF16, 3, 1),
        (BF16, 1, 3),
        (FP16, 3, 2),
        (MOE, 4, 2),
        (MOE, 2, 1),
        (MOE_BF16, 4, 1),
    ],
    ids=lambda v: v.name if isinstance(v, Sample) else str(v),
)
def test_reshard_as_zero_files_keeps_every_value(tmp_path: Path, case: Sample, world: int, stage: int) -> None:
    out = tmp_path / "out"
    reshard(case.checkpoint, out, world_size=world, stage=stage)
    index = open_checkpoint(out)
    assert index.zero_stage == stage and index.topology.dp == world
    _assert_live_state(out, case)
    state_dict = load_state_dict(out, dtype="fp32")
    assert all(same_bits(state_dict[n], v) for n, v in case.live().items())


@pytest.mark.parametrize("case", [PLAIN, BF16, MOE], ids=lambda s: s.name)
def test_to_universal_keeps_every_value(tmp_path: Path, case: Sample) -> None:
    result = to_universal(case.checkpoint, tmp_path / "uni")
    assert result.target_stage == 1  # DeepSpeed's universal loader is ZeRO-1/2/3's, not a torch optimizer's
    _assert_live_state(Path(result.output_dir) / result.tag, case)


def test_reshard_without_a_stage_says_to_pick_one(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="a ZeRO-0 checkpoint: pass --stage 1, 2 or 3"):
        reshard(PLAIN.checkpoint, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()


def test_an_optimizer_that_cannot_be_named_refuses_the_training_state_only(tmp_path: Path) -> None:
    """The frozen sample's optimizer holds 10 of the module's 14 params; by shape, fc2.bias and the
    frozen adapter.2.bias ([37] both) could each be the 9th: consolidation reads the module, a
    command that needs the optimizer's names says why it cannot, in one line, naming the file."""
    with pytest.raises(LayoutError, match="more than one way"):
        open_training_state(FROZEN.checkpoint)
    done = run_cli("reshard", FROZEN.checkpoint, tmp_path / "out", "-w", "1", "--stage", "1")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "mp_rank_00_model_states.pt" in lines[0] and "more than one way" in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert run_cli("consolidate", FROZEN.checkpoint, tmp_path / "weights").returncode == 0


def test_naming_matches_the_module_order_by_shape() -> None:
    module = [("a", (2, 3)), ("b", (3,)), ("frozen", (5,)), ("c", (4,))]
    assert name_optimizer_params([0, 1, 2], {0: (2, 3), 1: (3,), 2: (4,)}, module) == ["a", "b", "c"]
    # a param without per-element state matches any shape, when the rest pins it down
    assert name_optimizer_params([7, 8], {7: None, 8: (4,)}, [("x", (5,)), ("c", (4,))]) == ["x", "c"]


def test_naming_refuses_what_shapes_cannot_decide() -> None:
    module = [("w1", (3, 3)), ("b1", (3,)), ("w2", (3, 3)), ("b2", (3,))]
    ambiguous = name_optimizer_params([0, 1], {0: (3, 3), 1: (3,)}, module)
    assert isinstance(ambiguous, str) and "more than one way" in ambiguous
    # a weight-decay split: weights first, then biases, is not the module's order
    split = name_optimizer_params([0, 1, 2, 3], {0: (3, 3), 1: (3, 3), 2: (3,), 3: (3,)}, module)
    assert isinstance(split, str) and "not the module's params in module order" in split
    assert "holds 5 params, the module 4" in name_optimizer_params([0, 1, 2, 3, 4], {}, module)


def _damaged(tmp_path: Path, case: Sample, name: str, change) -> Path:  # noqa: ANN001 (a callable on the dict)
    """A copy of `case` whose file `name` (in the tag folder) was loaded, changed and saved again
    by torch (CRCs right: the damage reaches the parser); the copy's checkpoint folder."""
    tag = copy_checkpoint(tmp_path, case)
    path = tag / name
    value = torch.load(path, weights_only=True)
    change(value)
    torch.save(value, path)
    return tag.parent


def _one_line_naming(tmp_path: Path, checkpoint: Path, file: str, problem: str, *command: str) -> None:
    done = run_cli(
        *(command or ("consolidate",)),
        checkpoint,
        tmp_path / "out",
        *(("-w", "2", "--stage", "1") if command == ("reshard",) else ()),
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert file in lines[0] and problem in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


MODEL = "mp_rank_00_model_states.pt"


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda m: m["optimizer"]["state"].__setitem__(3, [1, 2]), "the optimizer state of param 3 is not a dict"),
        (
            lambda m: m["optimizer"]["param_groups"][0]["params"].append(0),
            "lists 0: not a param index, or one listed twice",
        ),
        (
            lambda m: m["optimizer"]["state"][3].__setitem__(
                "exp_avg_sq", m["optimizer"]["state"][3]["exp_avg_sq"].flatten()
            ),
            "the states of param 3 have different shapes",
        ),
    ],
    ids=["state-not-a-dict", "index-twice", "state-shapes-disagree"],
)
def test_a_damaged_optimizer_state_is_one_line_naming_the_file(tmp_path: Path, change, problem: str) -> None:  # noqa: ANN001
    checkpoint = _damaged(tmp_path, PLAIN, MODEL, change)
    _one_line_naming(tmp_path, checkpoint, MODEL, problem)


def test_an_optimizer_state_of_another_shape_leaves_the_weights_and_refuses_the_rest(tmp_path: Path) -> None:
    """A moment of another shape than its param in both states: the module is still the weights
    (consolidate gives the live values), the optimizer's params no longer match the module's."""

    def reshape(m: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq"):
            m["optimizer"]["state"][0][key] = m["optimizer"]["state"][0][key].flatten()

    checkpoint = _damaged(tmp_path, PLAIN, MODEL, reshape)
    state_dict = load_state_dict(checkpoint, dtype="fp32")
    assert all(same_bits(state_dict[n], v) for n, v in PLAIN.live().items())
    _one_line_naming(tmp_path, checkpoint, MODEL, "not the module's params in module order", "reshard")


def test_a_missing_expert_rank_optimizer_file_is_named(tmp_path: Path) -> None:
    tag = copy_checkpoint(tmp_path, MOE)
    (tag / "expp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _one_line_naming(
        tmp_path,
        tag.parent,
        "expp_rank_1_mp_rank_00_optim_states.pt",
        "missing (the optimizer state of expert rank 1 of 2)",
    )


def test_an_expert_rank_file_of_another_step_is_named(tmp_path: Path) -> None:
    def later(o: dict) -> None:
        for entry in o["optimizer"]["state"].values():
            entry["step"] = entry["step"] + 1

    checkpoint = _damaged(tmp_path, MOE, "expp_rank_1_mp_rank_00_optim_states.pt", later)
    _one_line_naming(
        tmp_path, checkpoint, "expp_rank_1_mp_rank_00_optim_states.pt", "files of different saves are mixed"
    )


def test_an_expert_file_of_another_shape_is_one_line_not_a_crash(tmp_path: Path) -> None:
    """An expert weight saved flat (the fuzz found it: an expert rank read for its weights only
    left the merge of the ranks without a training state, and consolidate crashed): the expert
    rank's optimizer no longer matches its experts, said in one line naming its file."""
    name = "layer_0_expert_2_mp_rank_00_model_states.pt"
    key = "moe.deepspeed_moe.experts.deepspeed_experts.2.0.weight"
    checkpoint = _damaged(tmp_path, MOE, name, lambda m: m.__setitem__(key, m[key].flatten()))
    _one_line_naming(
        tmp_path, checkpoint, "expp_rank_1_mp_rank_00_optim_states.pt", "not the module's params in module order"
    )


def test_each_tensor_rank_of_a_megatron_run_is_its_live_engines() -> None:
    """A Megatron-style run at ZeRO-0: each tensor rank's files are a ZeRO-0 checkpoint of its
    slices, named by module order; every slice's master and moments equal what that rank's live
    engine held (its module params, its torch optimizer's state), and the ranks merge by the
    checkpoint's patterns (DeepSpeed's cut of the merge back into slices: the interop tier)."""
    state = open_training_state(MEGATRON.checkpoint)
    assert state.index.topology == Topology(tp=2, dp=1) and state.index.zero_stage == 0
    assert len(state.tensor_shards) == 2
    assert_slices_are_live(state, MEGATRON)
    merged = load_state_dict(MEGATRON.checkpoint, dtype="fp32")
    assert merged["lm_head.weight"].shape[0] == 23  # the vocabulary cut to original_vocab_size


PIPELINE = sample("pp2_z0_fp32_dp2_untied")


def test_a_pipeline_run_at_zero0_is_the_live_engines() -> None:
    """A 2-stage PipelineModule at ZeRO-0: no file names a stage's params; the one cut of the layer
    files into stages that each stage's optimizer matches gives them, and every value and moment
    equals what the stage's live engine held (its module params, its optimizer's state)."""
    index = open_checkpoint(PIPELINE.checkpoint)
    assert index.topology == Topology(pp=2, dp=2) and index.zero_stage == 0
    assert index.placements["2.up.weight"] == "stage 0" and index.placements["5.weight"] == "stage 1"
    state_dict = load_state_dict(PIPELINE.checkpoint, dtype="fp32")
    live = PIPELINE.live()
    assert sorted(state_dict) == sorted(live)
    assert all(same_bits(state_dict[n], v) for n, v in live.items())
    _assert_live_state(PIPELINE.checkpoint, PIPELINE)


def test_a_pipeline_run_at_zero0_reshards_as_zero1(tmp_path: Path) -> None:
    out = tmp_path / "z1"
    reshard(PIPELINE.checkpoint, out, world_size=1, stage=1)
    index = open_checkpoint(out)
    assert index.topology == Topology(pp=2, dp=1) and index.zero_stage == 1
    _assert_live_state(out, PIPELINE)


def test_a_pipeline_run_cut_into_three_stages_holds_the_live_state(tmp_path: Path) -> None:
    """`--layer-partition 0,2,4,6`: the 6 layers (layer 3 a function, no file) cut into 3 stages
    as PipelineModule's "uniform" cut at 3 stages makes them (the interop tier has DeepSpeed
    load it so): each stage holds its layers' params, buffers and files, every master and
    moment is the live engine's; cut back at 2 stages it is the same checkpoint as one written
    at the run's own 2 stages."""
    out = tmp_path / "pp3"
    reshard(PIPELINE.checkpoint, out, world_size=1, stage=1, layer_partition=(0, 2, 4, 6))
    index = open_checkpoint(out)
    assert index.topology == Topology(pp=3, dp=1) and index.zero_stage == 1
    stages = {
        name: index.placements[name] for name in ("0.weight", "1.up.weight", "2.scale", "4.up.weight", "5.weight")
    }
    assert stages == {
        "0.weight": "stage 0",
        "1.up.weight": "stage 0",
        "2.scale": "stage 1",
        "4.up.weight": "stage 2",
        "5.weight": "stage 2",
    }
    _assert_live_state(out, PIPELINE)
    assert verify(str(out)).ok
    back, direct = tmp_path / "pp2", tmp_path / "pp2-direct"
    reshard(out, back, world_size=1, layer_partition=(0, 3, 6))
    reshard(PIPELINE.checkpoint, direct, world_size=1, stage=1)
    assert same_checkpoint_files(direct, back) == []


@pytest.mark.parametrize(
    "case, kwargs, message",
    [
        (
            "pp2_z1_fp32_dp1",
            {"layer_partition": (0, 2, 4, 6)},
            "the model ties tied_modules.embed.weight between stages",
        ),
        (
            "pp2_z0_fp32_dp2_untied",
            {"layer_partition": (0, 3, 4, 6)},
            "stage 1 (layers 3-3) would hold no trainable param",
        ),
        (
            "pp2_z0_fp32_dp2_untied",
            {"layer_partition": (0, 2, 5)},
            "the checkpoint has layer 5, beyond its layer count 5",
        ),
        ("pp2_z0_fp32_dp2_untied", {"layer_partition": (1, 3, 6)}, "increasing layer numbers from 0 are expected"),
        ("pp2_z0_fp32_dp2_untied", {"layer_partition": (0, 3, 3, 6)}, "increasing layer numbers from 0 are expected"),
        (
            "pp2_z0_fp32_dp2_untied",
            {"layer_partition": (0, 3, 6), "pipeline_stages": 3},
            "cuts 2 stage(s) but --pipeline-stages is 3",
        ),
        ("pp2_z0_fp32_dp2_untied", {"pipeline_stages": 3}, "pass --layer-partition"),
        (
            "pp2_megatron_z1_fp32_tp2",
            {"layer_partition": (0, 2, 3)},
            "the checkpoint has layer 3, beyond its layer count 3",
        ),
        ("z0_fp32_ws2_tied", {"layer_partition": (0, 2, 4)}, "--layer-partition is for pipeline-parallel checkpoints"),
    ],
)
def test_a_layer_partition_that_cannot_be_is_refused(tmp_path: Path, case: str, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(sample(case).checkpoint, tmp_path / "out", world_size=1, stage=1, **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_layer_partition(tmp_path: Path) -> None:
    done = run_cli(
        "reshard", PIPELINE.checkpoint, tmp_path / "out", "-w", "1", "--stage", "1", "--layer-partition", "0,2,4,6"
    )
    assert done.returncode == 0, done.stderr
    assert "3 pipeline stages x 1 data-parallel rank" in done.stdout
    bad = run_cli(
        "reshard", PIPELINE.checkpoint, tmp_path / "bad", "-w", "1", "--stage", "1", "--layer-partition", "0,two,6"
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "zckpt: error: --layer-partition 0,two,6: comma-separated layer numbers are expected"
    ]
    assert not (tmp_path / "bad").exists()


def test_a_tied_pipeline_run_at_zero0_is_refused_in_one_line(tmp_path: Path) -> None:
    """The tied embedding's key (tied_modules.<key>.weight) is in no file of a ZeRO-0 pipeline run
    (probed: scripts/make_parallel_ckpts.py's tied model at ZeRO-0): no cut of the layer files fits
    stage 1's optimizer, whose copy of the tied weight has no layer file there. Made here from the
    untied sample: its head's layer file removed, as the tied run saves none."""
    tag = copy_checkpoint(tmp_path, PIPELINE)
    (tag / "layer_05-model_states.pt").unlink()
    _one_line_naming(tmp_path, tag.parent, MODEL, "match no way of cutting the 4 layer files")

"""Tensor-parallel checkpoints of DeepSpeed's AutoTP (issue 19): samples written by real DeepSpeed
with ``"tensor_parallel": {"autotp_size": 2}`` on a tiny Hugging Face Llama (scripts/make_parallel_ckpts.py:
ZeRO-1 fp32 at 1 data rank, ZeRO-2 and ZeRO-3 bf16 at 2), read as the unsharded model. The truth is DeepSpeed's
own merge, ``ds_to_universal`` (exact for AutoTP's affine maps): every param's fp32 master and Adam
moments (``reference/universal.safetensors``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    MEGATRON_SAMPLES,
    TENSOR_PARALLEL_SAMPLES,
    Sample,
    assert_holds_the_merge,
    copy_checkpoint,
    run_cli,
    same_bits,
    same_checkpoint_files,
    sample,
)
from zckpt import load_state_dict, reshard, to_universal
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state, survey
from zckpt.ops.verify import verify

IDS = [s.name for s in TENSOR_PARALLEL_SAMPLES]
REPLICATED = {"model.embed_tokens.weight", "model.norm.weight"} | {
    f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")
}


def _reference(case: Sample) -> dict[str, torch.Tensor]:
    return load_file(case.folder / "reference" / "universal.safetensors")


def test_the_samples_are_there() -> None:
    assert {s.name for s in TENSOR_PARALLEL_SAMPLES} >= {"autotp_z1_fp32_tp2", "autotp_z2_bf16_tp2_dp2"}


@pytest.mark.parametrize("case", TENSOR_PARALLEL_SAMPLES, ids=IDS)
def test_masters_and_moments_are_deepspeeds_merge(case: Sample) -> None:
    index = open_checkpoint(case.checkpoint)
    assert index.topology == Topology(tp=2, dp=case.meta["dp"]) and index.world_size == case.meta["world_size"]
    reference = _reference(case)
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    assert sorted(state_dict) == sorted(k for k in reference if not k.endswith((".exp_avg", ".exp_avg_sq")))
    assert state_dict["model.layers.0.mlp.down_proj.weight"].shape == (32, 48)  # split by columns, merged
    for name, value in state_dict.items():
        assert same_bits(value, reference[name]), name
    state = open_training_state(case.checkpoint)
    assert_holds_the_merge(state, reference)
    assert {r.name for r in index.replicas} == REPLICATED
    assert state.client_state == {}  # universal_checkpoint_info is the engine's


@pytest.mark.slow
@pytest.mark.parametrize("case", TENSOR_PARALLEL_SAMPLES, ids=IDS)
def test_cli_inspect_verify_consolidate(tmp_path: Path, case: Sample) -> None:
    inspected = run_cli("inspect", case.checkpoint)
    assert inspected.returncode == 0 and "tensor-parallel (AutoTP): 2 tensor ranks" in inspected.stdout
    verified = run_cli("verify", case.checkpoint)
    assert verified.returncode == 0 and "replicas" in verified.stdout, verified.stdout
    done = run_cli("consolidate", case.checkpoint, tmp_path / "out")
    assert done.returncode == 0, done.stderr


FP32 = next(s for s in TENSOR_PARALLEL_SAMPLES if s.name == "autotp_z1_fp32_tp2")


# (sample, a replicated param, its element count): AutoTP's and a Megatron-style run's
REPLICAS = [
    ("autotp_z1_fp32_tp2", "model.norm.weight", 32),
    ("megatron_z1_fp32_tp2", "layers.1.input_layernorm.bias", 16),
]


@pytest.mark.parametrize("name, param, numel", REPLICAS, ids=[r[0] for r in REPLICAS])
def test_a_changed_replica_is_caught(tmp_path: Path, name: str, param: str, numel: int) -> None:
    """Tensor rank 1's master of a replicated LayerNorm param edited: verify names its file."""
    tag = copy_checkpoint(tmp_path, sample(name))
    index = open_checkpoint(tag.parent)
    replica = next(r for r in index.replicas if r.name == param).source.segments[0]
    assert replica.path.endswith("zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with open(replica.path, "r+b") as f:
        f.seek(replica.offset)
        f.write(b"\x00\x00\x80\x3f")
    report = verify(tag.parent)
    assert not report.ok
    assert any(f"{param} differs in 1 of {numel} elements" in p for p in report.problems), report.problems


def test_a_missing_tensor_rank_is_named(tmp_path: Path) -> None:
    tag = copy_checkpoint(tmp_path, FP32)
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    found = survey(tag.parent)
    assert found.index is None
    assert any("zero_pp_rank_0_mp_rank_01_optim_states.pt: missing" in str(p) for p in found.problems), [
        str(p) for p in found.problems
    ]


@pytest.mark.parametrize(
    "case", TENSOR_PARALLEL_SAMPLES + MEGATRON_SAMPLES, ids=IDS + [s.name for s in MEGATRON_SAMPLES]
)
def test_reshard_to_its_own_layout_gives_deepspeeds_files_back(tmp_path: Path, case: Sample) -> None:
    out = tmp_path / "same"
    reshard(case.checkpoint, out, world_size=case.meta["dp"])
    assert same_checkpoint_files(case.checkpoint, out) == []


@pytest.mark.parametrize("name", ["autotp_z1_fp32_tp2", "megatron_z1_fp32_tp2"])
def test_reshard_to_other_data_ranks_keeps_every_value(tmp_path: Path, name: str) -> None:
    out = tmp_path / "dp3"
    reshard(sample(name).checkpoint, out, world_size=3)
    assert open_checkpoint(out).topology == Topology(tp=2, dp=3)
    reference = _reference(sample(name))
    for key, value in load_state_dict(out, dtype="fp32").items():
        assert same_bits(value, reference[key]), key


@pytest.mark.parametrize("name, stage", [("autotp_z1_fp32_tp2", 3), ("autotp_z3_bf16_tp2_dp2", 1)])
def test_reshard_across_zero_stages_keeps_every_value(tmp_path: Path, name: str, stage: int) -> None:
    """ZeRO-1 to ZeRO-3 and back, each tensor rank laid out by the data-parallel writer (DeepSpeed
    loads them: test_interop_parallel.py)."""
    case = next(s for s in TENSOR_PARALLEL_SAMPLES if s.name == name)
    out = tmp_path / "other"
    reshard(case.checkpoint, out, world_size=2, stage=stage)
    index = open_checkpoint(out)
    assert index.topology == Topology(tp=2, dp=2) and index.zero_stage == stage
    reference = _reference(case)
    for name, value in load_state_dict(out, dtype="fp32").items():
        assert same_bits(value, reference[name]), name
    # an AutoTP run's ZeRO-3 universal folder: DeepSpeed's dicts, whose tensor ranks' pieces its ZeRO-3
    # loader cuts (test_interop_universal.py); read back, the merged model
    assert to_universal(case.checkpoint, tmp_path / "z3", target_stage=3).target_stage == 3
    for name, value in load_state_dict(tmp_path / "z3", dtype="fp32").items():
        assert same_bits(value, reference[name]), name


@pytest.mark.parametrize("case", TENSOR_PARALLEL_SAMPLES, ids=IDS)
def test_to_universal_is_the_unsharded_model_deepspeed_merges(tmp_path: Path, case: Sample) -> None:
    """Every param's folder holds the full tensor (DeepSpeed's loader cuts each tensor rank's
    piece itself, test_interop_parallel.py): masters and moments equal ds_to_universal's merge,
    and the folder read back is the whole model."""
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out, target_stage=min(case.meta["zero_stage"], 2))
    universal = open_training_state(out)
    assert universal.index.universal and universal.index.topology == Topology(dp=case.meta["dp"])
    reference = _reference(case)
    assert sorted(p.name for p in universal.params) == sorted(k for k in reference if "exp_avg" not in k)
    assert_holds_the_merge(universal, reference, masters=True)
    whole, written = load_state_dict(case.checkpoint, dtype="fp32"), load_state_dict(out, dtype="fp32")
    assert list(written) == list(whole)
    for name, value in whole.items():
        assert same_bits(written[name], value), name


@pytest.mark.parametrize("case", TENSOR_PARALLEL_SAMPLES, ids=IDS)
def test_inspect_shows_how_each_param_was_split(case: Sample) -> None:
    """The placement column against DeepSpeed's own rank files (torch.load): a param whose
    tensor-rank-0 shard is shorter in dim 0 is split by rows, in dim 1 by columns; one held whole
    on both ranks is replicated."""
    from zckpt.ops.inspect import inspect_path

    report = inspect_path(str(case.checkpoint))
    placements = {p["name"]: p.get("placement") for p in report["parameters"]}
    first = next((case.checkpoint / "global_step3").glob("*mp_rank_00_model_states.pt"))
    shapes = {n: s for group in torch.load(first, weights_only=False)["param_shapes"] for n, s in group.items()}
    full = {n: t for n, t in _reference(case).items() if not n.endswith((".exp_avg", ".exp_avg_sq"))}
    assert placements and set(placements) == set(full)
    for name, whole in full.items():
        short = [d for d, (a, b) in enumerate(zip(whole.shape, shapes[name])) if a != b]
        expected = (
            f"{['rows', 'columns'][short[0]]} split over 2 tensor ranks" if short else "replicated on 2 tensor ranks"
        )
        assert placements[name] == expected, name
    assert {n for n, p in placements.items() if p.startswith("replicated")} == REPLICATED

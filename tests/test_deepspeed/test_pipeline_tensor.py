"""Pipeline x tensor parallel checkpoints (issue 19): a sample written by real DeepSpeed's
PipelineModule over a ``PipeModelDataParallelTopology`` of 2 stages x 2 tensor ranks, its layers
the Megatron-style GPT's (vocabulary-parallel embedding and head, replicated LayerNorms, fused
q/k/v sub-params, SwiGLU halves, row-parallel projections), saved with Megatron-DeepSpeed's merge
patterns for the pipeline names (scripts/make_parallel_ckpts.py, ``pp2_megatron_z1_fp32_tp2``).
Files: ``layer_NN-model_TT-model_states.pt`` per layer and tensor rank, ``mp_rank_{stage*2+t}``.

Two independent facts: DeepSpeed's merge (``ds_to_universal``, ``reference/universal.safetensors``)
and each stage's tensor ranks' slices as the live engine held them
(``reference/live_stage{S}_tp{T}.safetensors``). DeepSpeed loading zckpt's outputs:
tests/test_interop/test_interop_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    PIPELINE_TENSOR_SAMPLES,
    assert_holds_the_merge,
    copy_checkpoint,
    megatron_slice,
    same_bits,
    same_checkpoint_files,
)
from zckpt import load_state_dict, reshard, to_universal
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state, survey
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.verify import verify

CASE = PIPELINE_TENSOR_SAMPLES[0]


def _reference() -> dict:
    return load_file(CASE.folder / "reference" / "universal.safetensors")


def _live_by_tensor_rank() -> list[dict]:
    """Each tensor rank's slices as the live engine held them, every stage's together."""
    return [
        {
            name: value
            for s in range(2)
            for name, value in load_file(CASE.folder / "reference" / f"live_stage{s}_tp{t}.safetensors").items()
        }
        for t in range(2)
    ]


def test_the_sample_is_there() -> None:
    assert [s.name for s in PIPELINE_TENSOR_SAMPLES] == ["pp2_megatron_z1_fp32_tp2"]


def test_masters_and_moments_are_deepspeeds_merge() -> None:
    index = open_checkpoint(CASE.checkpoint)
    assert index.topology == Topology(pp=2, tp=2, dp=1) and index.world_size == 4
    reference = _reference()
    state_dict = load_state_dict(CASE.checkpoint, dtype="fp32")
    assert sorted(state_dict) == sorted(k for k in reference if "exp_avg" not in k)
    assert state_dict["0.word_embeddings.weight"].shape == (23, 16) and state_dict["3.lm_head.weight"].shape == (23, 16)
    for name, value in state_dict.items():
        assert same_bits(value, reference[name]), name
    state = open_training_state(CASE.checkpoint)
    assert_holds_the_merge(state, reference)


def test_each_stages_tensor_ranks_hold_what_the_live_engine_held() -> None:
    state = open_training_state(CASE.checkpoint)
    assert [len(stage.tensor_shards) for stage in state.stages] == [2, 2]
    with FileReader() as reader:
        for s, stage in enumerate(state.stages):
            for t, shard in enumerate(stage.tensor_shards):
                live = load_file(CASE.folder / "reference" / f"live_stage{s}_tp{t}.safetensors")
                assert sorted(p.name for p in shard.params) == sorted(live)
                for param in shard.params:
                    assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[param.name])


def test_inspect_says_where_each_param_was() -> None:
    from zckpt.ops.inspect import inspect_path

    report = inspect_path(str(CASE.checkpoint))
    placements = {p["name"]: p.get("placement") for p in report["parameters"]}
    assert placements["0.norm.weight"] == "stage 0; replicated on 2 tensor ranks"
    assert placements["2.mlp.dense_4h_to_h.weight"] == "stage 1; columns split over 2 tensor ranks"
    assert placements["1.mlp.dense_h_to_4h.weight"] == "stage 0; rows split over 2 tensor ranks (2 pieces each)"
    assert any(n.startswith("pipeline-parallel: 2 stages x 2 tensor ranks (Megatron-style") for n in report["notes"])


def test_a_changed_replica_is_caught(tmp_path: Path) -> None:
    """Stage 1's tensor rank 1 copy of a replicated LayerNorm weight edited: verify names its file."""
    tag = copy_checkpoint(tmp_path, CASE)
    index = open_checkpoint(tag.parent)
    replica = next(r for r in index.replicas if r.name == "2.input_layernorm.weight").source.segments[0]
    assert replica.path.endswith("zero_pp_rank_0_mp_rank_03_optim_states.pt")
    with open(replica.path, "r+b") as f:
        f.seek(replica.offset)
        f.write(b"\x00\x00\x80\x3f")
    report = verify(tag.parent)
    assert not report.ok
    assert any("2.input_layernorm.weight differs in 1 of 16 elements" in p for p in report.problems), report.problems


def test_a_missing_layer_file_of_a_tensor_rank_is_named(tmp_path: Path) -> None:
    tag = copy_checkpoint(tmp_path, CASE)
    (tag / "layer_02-model_01-model_states.pt").unlink()
    found = survey(tag.parent)
    assert found.index is None
    assert any("layer_02-model_01-model_states.pt: missing: stage 1 lists 2." in str(p) for p in found.problems), [
        str(p) for p in found.problems
    ]


def test_reshard_to_its_own_layout_gives_deepspeeds_files_back(tmp_path: Path) -> None:
    out = tmp_path / "same"
    reshard(CASE.checkpoint, out, world_size=1)
    assert same_checkpoint_files(CASE.checkpoint, out) == []


def test_reshard_to_two_data_ranks_keeps_every_value(tmp_path: Path) -> None:
    out = tmp_path / "dp2"
    reshard(CASE.checkpoint, out, world_size=2)
    assert open_checkpoint(out).topology == Topology(pp=2, tp=2, dp=2)
    reference = _reference()
    for name, value in load_state_dict(out, dtype="fp32").items():
        assert same_bits(value, reference[name]), name


# (the output's layer partition: each stage's first layer, then the layer count)
CUTS = [(0, 4), (0, 2, 3, 4), (0, 1, 2, 3, 4)]


@pytest.mark.parametrize("parts", CUTS, ids=[f"{len(p) - 1}-stages" for p in CUTS])
def test_another_stage_count_keeps_each_tensor_ranks_slices(tmp_path: Path, parts: tuple[int, ...]) -> None:
    """The 2 x 2 run cut into 1, 3 and 4 stages at its 2 tensor ranks: each new stage's tensor rank
    t holds its layers' slices as tensor rank t's live engine held them (whatever stage held them
    before), every merged master and moment is DeepSpeed's merge, the layer files are carried."""
    out = tmp_path / "cut"
    reshard(CASE.checkpoint, out, world_size=1, layer_partition=parts)
    state = open_training_state(out)
    assert state.index.topology == Topology(pp=len(parts) - 1, tp=2, dp=1)
    assert_holds_the_merge(state, _reference(), masters=True)
    live = _live_by_tensor_rank()
    with FileReader() as reader:
        for number, (stage, first, end) in enumerate(zip(state.stages, parts, parts[1:])):
            for t, shard in enumerate(stage.tensor_shards):
                assert sorted(p.name for p in shard.params) == sorted(
                    n for n in live[t] if first <= int(n.split(".")[0]) < end
                ), (number, t)
                for param in shard.params:
                    assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[t][param.name])
    assert sorted(p.name for p in (out / "global_step3").glob("layer_*")) == sorted(
        p.name for p in (CASE.checkpoint / "global_step3").glob("layer_*")
    )
    assert verify(str(out)).ok


def test_three_stages_and_back_give_deepspeeds_files(tmp_path: Path) -> None:
    """2 -> 3 -> 2 stages (at the run's own cut, 0,2,4) writes the files DeepSpeed wrote."""
    reshard(CASE.checkpoint, tmp_path / "three", world_size=1, layer_partition=(0, 2, 3, 4))
    reshard(tmp_path / "three", tmp_path / "back", world_size=1, layer_partition=(0, 2, 4))
    assert same_checkpoint_files(CASE.checkpoint, tmp_path / "back") == []


def test_to_universal_holds_deepspeeds_merge_under_the_pipeline_names(tmp_path: Path) -> None:
    out = tmp_path / "universal"
    to_universal(CASE.checkpoint, out)
    universal = open_training_state(out)
    assert universal.index.universal and universal.index.topology == Topology(dp=1)
    reference = _reference()
    with FileReader() as reader:
        for param in universal.params:
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), reference[param.name])


@pytest.mark.parametrize("tp, parts", [(4, None), (1, None), (4, (0, 4))], ids=["tp4", "tp1", "tp4-one-stage"])
def test_another_tensor_parallel_degree_cuts_every_stage_and_layer_file(
    tmp_path: Path, tp: int, parts: tuple[int, ...] | None
) -> None:
    """The 2 x 2 run at 4 tensor ranks and at 1 (and at 4 as one stage): each stage's tensor rank
    holds the model's own cut at that degree of what the run held (its live slices joined: the
    vocabulary's padding row as trained; at one rank the vocabulary unpadded), every merged master and moment is DeepSpeed's merge, and
    the model the layer files hold, consolidated, is the run's."""
    out = tmp_path / "cut"
    reshard(CASE.checkpoint, out, world_size=1, tensor_parallel=tp, layer_partition=parts)
    state = open_training_state(out)
    stages = 2 if parts is None else len(parts) - 1
    assert state.index.topology == Topology(pp=stages, tp=tp, dp=1)
    reference = _reference()
    assert_holds_the_merge(state, reference, masters=True)
    live = _live_by_tensor_rank()
    with FileReader() as reader:
        for stage in state.stages:
            for t, shard in enumerate(stage.tensor_shards or [state]):
                for param in shard.params:
                    if param.name.endswith(("word_embeddings.weight", "lm_head.weight")):
                        rows = 24 if tp > 1 else 23  # the saved rows; unpadded at one rank
                        whole = torch.cat([live[0][param.name], live[1][param.name]])[:rows]
                    else:
                        whole = reference[param.name]
                    truth = megatron_slice(param.name, whole, tp, t)
                    assert same_bits(read_tensor(reader, param.master).reshape(param.shape), truth), (t, param.name)
    for name, value in load_state_dict(out, dtype="fp32").items():
        assert same_bits(value, reference[name]), name
    assert verify(str(out)).ok


def test_four_tensor_ranks_and_back_give_deepspeeds_files(tmp_path: Path) -> None:
    """2 -> 4 -> 2 tensor ranks: every file DeepSpeed wrote, layer files included, tree for tree
    and tensor for tensor."""
    reshard(CASE.checkpoint, tmp_path / "tp4", world_size=1, tensor_parallel=4)
    reshard(tmp_path / "tp4", tmp_path / "back", world_size=1, tensor_parallel=2)
    assert same_checkpoint_files(CASE.checkpoint, tmp_path / "back") == []


def test_one_tensor_rank_with_the_vocabulary_padded_keeps_the_saved_rows(tmp_path: Path) -> None:
    """`--tensor-parallel 1 --padded-vocab-size 24`: the stages' vocabulary params keep the 24 rows the
    tensor ranks saved (the padding row as trained), in the ZeRO files and the layer files alike."""
    out = tmp_path / "tp1"
    reshard(CASE.checkpoint, out, world_size=1, tensor_parallel=1, padded_vocab_size=24)
    state = open_training_state(out)
    live = _live_by_tensor_rank()
    with FileReader() as reader:
        for name in ("0.word_embeddings.weight", "3.lm_head.weight"):
            param = state.param(name)
            assert param.shape == (24, 16)
            whole = torch.cat([live[0][name], live[1][name]])
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), whole), name
    layer = torch.load(out / "global_step3" / "layer_00-model_00-model_states.pt", weights_only=True)
    assert layer["word_embeddings.weight"].shape == (24, 16)
    assert verify(str(out)).ok

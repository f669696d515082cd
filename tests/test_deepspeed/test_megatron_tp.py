"""Megatron-style tensor-parallel checkpoints (issue 19): samples written by real DeepSpeed with a
Megatron ``mpu`` on a tiny GPT whose ranks hold vocabulary-parallel embedding and head (23 rows
padded to 24), replicated LayerNorms, a fused query/key/value of grouped sub-params, a SwiGLU
``dense_h_to_4h`` (two sub-params) and row-parallel projections (scripts/make_parallel_ckpts.py:
ZeRO-1 fp32 at 1 data rank, ZeRO-2 bf16 at 2). Its ``universal_checkpoint_info`` (client state, as
Megatron-DeepSpeed saves it) has merge patterns and no affine map.

Two independent facts: DeepSpeed's own merge by those patterns (``ds_to_universal``,
``reference/universal.safetensors``), and each tensor rank's slices as the live engine held them
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, ``reference/live*_tp{T}``).
DeepSpeed loading zckpt's outputs: tests/test_interop/test_interop_parallel.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import MEGATRON_SAMPLES, Sample, assert_holds_the_merge, copy_checkpoint, run_cli, same_bits
from zckpt import load_state_dict, to_universal
from zckpt.core.errors import LayoutError, UsageError
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state, survey
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.torchfile import reader as torchfile

IDS = [s.name for s in MEGATRON_SAMPLES]
FP32 = next(s for s in MEGATRON_SAMPLES if s.name == "megatron_z1_fp32_tp2")
REPLICATED = (
    {"embed.norm.weight", "embed.norm.bias"}
    | {f"layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm.weight", "input_layernorm.bias")}
    | {f"layers.{i}.{n}.bias" for i in (0, 1) for n in ("self_attention.dense", "mlp.dense_4h_to_h")}
)


def _reference(case: Sample) -> dict[str, torch.Tensor]:
    return load_file(case.folder / "reference" / "universal.safetensors")


def test_the_samples_are_there() -> None:
    assert {s.name for s in MEGATRON_SAMPLES} == {
        "megatron_z1_fp32_tp2",
        "megatron_z2_bf16_tp2_dp2",
        "megatron_z3_fp32_tp2_dp2",
    }


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=IDS)
def test_masters_and_moments_are_deepspeeds_merge(case: Sample) -> None:
    index = open_checkpoint(case.checkpoint)
    assert index.topology == Topology(tp=2, dp=case.meta["dp"]) and index.world_size == case.meta["world_size"]
    reference = _reference(case)
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    assert sorted(state_dict) == sorted(k for k in reference if not k.endswith((".exp_avg", ".exp_avg_sq")))
    assert state_dict["embed.word_embeddings.weight"].shape == (23, 16)  # the vocabulary padding cut
    assert state_dict["layers.0.mlp.dense_4h_to_h.weight"].shape == (16, 12)  # row-parallel: by columns
    for name, value in state_dict.items():
        assert same_bits(value, reference[name]), name
    state = open_training_state(case.checkpoint)
    assert_holds_the_merge(state, reference)
    assert {r.name for r in index.replicas} == REPLICATED


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=IDS)
def test_each_tensor_ranks_slices_are_what_the_live_engine_held(case: Sample) -> None:
    state = open_training_state(case.checkpoint)
    assert len(state.tensor_shards) == 2
    with FileReader() as reader:
        for t, shard in enumerate(state.tensor_shards):
            live = load_file(case.folder / "reference" / f"live_tp{t}.safetensors")
            moments = load_file(case.folder / "reference" / f"live_optimizer_tp{t}.safetensors")
            assert sorted(p.name for p in shard.params) == sorted(live)
            for param in shard.params:
                assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[param.name])
                for key in ("exp_avg", "exp_avg_sq"):
                    value = read_tensor(reader, param.states[key]).reshape(param.shape)
                    assert same_bits(value, moments[f"{param.name}.{key}"]), (t, param.name, key)


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=IDS)
def test_inspect_shows_each_params_rule(case: Sample) -> None:
    from zckpt.ops.inspect import inspect_path

    report = inspect_path(str(case.checkpoint))
    placements = {p["name"]: p.get("placement") for p in report["parameters"]}
    assert {n for n, p in placements.items() if p.startswith("replicated")} == REPLICATED
    assert (
        placements["layers.0.self_attention.query_key_value.weight"] == "rows split over 2 tensor ranks (3 pieces each)"
    )
    assert placements["layers.0.mlp.dense_h_to_4h.weight"] == "rows split over 2 tensor ranks (2 pieces each)"
    assert placements["layers.1.mlp.dense_h_to_4h.weight"] == "rows split over 2 tensor ranks"
    assert placements["layers.1.self_attention.dense.weight"] == "columns split over 2 tensor ranks"
    assert placements["lm_head.weight"] == "rows split over 2 tensor ranks"
    assert any("Megatron-style, merged by its universal_checkpoint_info patterns" in n for n in report["notes"])


@pytest.mark.slow
def test_cli_inspect_verify_consolidate(tmp_path: Path) -> None:
    inspected = run_cli("inspect", FP32.checkpoint)
    assert inspected.returncode == 0 and "tensor-parallel (Megatron-style" in inspected.stdout
    verified = run_cli("verify", FP32.checkpoint)
    assert verified.returncode == 0 and "replicas" in verified.stdout, verified.stdout
    done = run_cli("consolidate", FP32.checkpoint, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    written = load_file(tmp_path / "out" / "model.safetensors")
    reference = _reference(FP32)
    assert all(same_bits(value, reference[name]) for name, value in written.items())


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=IDS)
def test_to_universal_holds_deepspeeds_merge(tmp_path: Path, case: Sample) -> None:
    """Each param's folder: the merged tensor (ds_to_universal's values) and, in front of it, the
    rule DeepSpeed's loader cuts it by (the files are compared with ds_to_universal's own in the
    interop tier)."""
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out, target_stage=min(case.meta["zero_stage"], 2))
    universal = open_training_state(out)
    assert universal.index.universal and universal.index.topology == Topology(dp=case.meta["dp"])
    reference = _reference(case)
    assert_holds_the_merge(universal, reference, masters=True)
    folder = out / "global_step3_universal" / "zero"
    row = torch.load(folder / "layers.1.mlp.dense_4h_to_h.weight" / "fp32.pt", weights_only=True)
    assert list(row) == ["cat_dim", "param"] and row["cat_dim"] == 1
    vocab = torch.load(folder / "lm_head.weight" / "exp_avg.pt", weights_only=True)
    assert list(vocab) == ["cat_dim", "vocab_tensor", "param"] and vocab["param"].shape == (23, 16)
    halves = torch.load(folder / "layers.0.mlp.dense_h_to_4h.bias" / "fp32.pt", weights_only=True)
    assert {k: v for k, v in halves.items() if k != "param"} == {"cat_dim": 0, "param_n_sub_params": 2}
    assert list(torch.load(folder / "embed.norm.weight" / "fp32.pt", weights_only=True)) == ["param"]
    with pytest.raises(UsageError, match="--target-stage 3: zckpt writes the universal folder of a tensor-par"):
        to_universal(case.checkpoint, tmp_path / "z3", target_stage=3)
    assert not (tmp_path / "z3").exists()


def _with_rules(tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the fp32 sample whose tensor ranks' universal_checkpoint_info `edit` changed
    (torch re-saves each model-states file)."""
    tag = copy_checkpoint(tmp_path, FP32)
    for path in sorted(tag.glob("mp_rank_*_model_states.pt")):
        saved = torch.load(path, weights_only=False)
        edit(saved["universal_checkpoint_info"])
        torch.save(saved, path)
    return tag.parent


def test_params_the_rules_average_whose_copies_differ_are_refused(tmp_path: Path) -> None:
    """DeepSpeed's merge writes the mean of the tensor ranks' copies: where they differ (here a
    row-parallel weight's two slices, of one shape), new numbers, so refused naming the file."""
    checkpoint = _with_rules(
        tmp_path, lambda info: info.update(parameter_to_average_patterns=[r"layers\.0\.self_attention\.dense\.weight"])
    )
    found = survey(checkpoint)
    assert found.index is None and len(found.problems) == 1
    problem = str(found.problems[0])
    assert "zero_pp_rank_0_mp_rank_01_optim_states.pt: layers.0.self_attention.dense.weight: the rules average it" in (
        problem
    )
    assert "tensor rank 1's master differs from tensor rank 0's" in problem


def test_params_the_rules_average_whose_copies_are_equal_are_taken_as_saved(tmp_path: Path) -> None:
    """The LayerNorms (replicated, so bit-equal on both ranks) marked for averaging instead: their
    mean is the saved value, so the merge is DeepSpeed's merge of the sample as it is."""

    def average(info: dict) -> None:
        layernorms = r"layers\.\d+\.input_layernorm\.(weight|bias)"
        info["tp_replicated_parameter_patterns"].remove(layernorms)
        info["parameter_to_average_patterns"] = [layernorms]

    checkpoint = _with_rules(tmp_path, average)
    state = open_training_state(checkpoint)
    assert_holds_the_merge(state, _reference(FP32), masters=True)
    assert any("4 the rules average (parameter_to_average_patterns) hold the same bits" in n for n in state.index.notes)
    reference = _reference(FP32)
    for name, value in load_state_dict(checkpoint, dtype="fp32").items():
        assert same_bits(value, reference[name]), name


def test_sub_params_of_rules_older_than_0_4_split_evenly(tmp_path: Path) -> None:
    """Rules written before universal checkpoint version 0.4 give sub-param sizes and no per-rank
    widths (DeepSpeed then splits each evenly): the same merge as the sample's 0.4 rules."""

    def legacy(info: dict) -> None:
        del info["universal_checkpoint_version"], info["sub_param_shard_widths"]

    checkpoint = _with_rules(tmp_path, legacy)
    reference = _reference(FP32)
    for name, value in load_state_dict(checkpoint, dtype="fp32").items():
        assert same_bits(value, reference[name]), name


def test_a_name_two_patterns_of_one_kind_match_is_refused(tmp_path: Path) -> None:
    checkpoint = _with_rules(
        tmp_path, lambda info: info["parameter_with_row_parallelism_patterns"].append(r"layers\.\d+\.self_attention")
    )
    with pytest.raises(LayoutError, match="matched by several merge patterns of one kind"):
        open_checkpoint(checkpoint)


def _without_rules(tmp_path: Path, case: Sample = FP32) -> tuple[Path, Path]:
    """A copy of the sample without universal_checkpoint_info, and its rules as a --tp-rules JSON file."""
    tag = copy_checkpoint(tmp_path, case)
    rules = None
    for path in sorted(tag.glob("*mp_rank_*_model_states.pt")):
        saved = torch.load(path, weights_only=False)
        rules = saved.pop("universal_checkpoint_info")
        torch.save(saved, path)
    rules_file = tmp_path / "rules.json"
    rules_file.write_text(json.dumps(rules))  # tuples become lists, as a user writes them
    return tag.parent, rules_file


def test_a_checkpoint_without_merge_rules_is_refused_in_one_line(tmp_path: Path) -> None:
    """The same shards without universal_checkpoint_info: nothing says how they merge (DeepSpeed's
    ds_to_universal concatenates every one on dim 0, FORMAT_NOTES), so zckpt refuses and says
    what to pass."""
    checkpoint, _ = _without_rules(tmp_path)
    done = run_cli("consolidate", checkpoint, tmp_path / "out")
    assert done.returncode != 0 and not (tmp_path / "out").exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not say how its shards merge: it records no universal_checkpoint_info" in lines[0]
    assert re.search(r"mp_rank_00_model_states\.pt", lines[0]) and "pass --tp-rules FILE" in lines[0]


@pytest.mark.parametrize("case", MEGATRON_SAMPLES, ids=IDS)
def test_tp_rules_merge_a_checkpoint_that_records_none(tmp_path: Path, case: Sample) -> None:
    """The rules given as a --tp-rules JSON file instead: the same merge (ds_to_universal's), the
    note says where the rules came from, and the universal folder carries them per param."""
    checkpoint, rules = _without_rules(tmp_path, case)
    done = run_cli("consolidate", checkpoint, tmp_path / "out", "--tp-rules", rules)
    assert done.returncode == 0, done.stderr
    reference = _reference(case)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == sorted(k for k in reference if "exp_avg" not in k)
    assert all(same_bits(value, reference[name]) for name, value in written.items())
    index = open_checkpoint(checkpoint, tp_rules=rules)
    assert any("merged by the --tp-rules patterns" in note for note in index.notes)
    out = tmp_path / "universal"
    to_universal(checkpoint, out, target_stage=min(case.meta["zero_stage"], 2), tp_rules=rules)
    qkv_file = out / "global_step3_universal" / "zero" / "layers.0.self_attention.query_key_value.weight" / "fp32.pt"
    qkv = torchfile.load(str(qkv_file))  # read as data: its SubparamShape is DeepSpeed's class
    assert qkv["sub_param_shape"].shape == ((8, 4, 4), 16)  # tuples again, as DeepSpeed's loader needs


def test_a_bad_tp_rules_file_is_named(tmp_path: Path) -> None:
    checkpoint, _ = _without_rules(tmp_path)
    for text, said in [
        ("{not json", "--tp-rules: not a JSON file"),
        ('{"original_vocab_size": 23}', "--tp-rules: a JSON object with at least one of"),
        ('{"tp_replicated_parameter_patterns": ["("]}', "is not a regular expression"),
        ('{"parameter_with_sub_params": [{"patterns": []}]}', "needs patterns, shape, partition_dim"),
    ]:
        rules = tmp_path / "bad.json"
        rules.write_text(text)
        done = run_cli("inspect", checkpoint, "--tp-rules", rules)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and str(rules) in lines[0] and said in lines[0], done.stderr
    done = run_cli("verify", checkpoint, "--tp-rules", tmp_path / "missing.json")
    assert done.returncode == 2 and "--tp-rules: cannot read it" in done.stderr


def test_a_sub_param_rule_not_as_deepspeed_writes_it_is_named(tmp_path: Path) -> None:
    checkpoint = _with_rules(tmp_path, lambda info: info.__setitem__("parameter_with_sub_params", ["qkv"]))
    with pytest.raises(LayoutError, match="parameter_with_sub_params holds a str, not a dict"):
        open_checkpoint(checkpoint)

"""Pipeline-parallel checkpoints (issue 19): samples written by real DeepSpeed's PipelineModule
(scripts/make_parallel_ckpts.py: 2 stages, ZeRO-1, fp32 at 1 data rank and bf16 at 2, a tied
embedding kept by both stages, a frozen layer, buffers, a function layer) read as one model.
The truth is what the live engine held: each stage's fp32 masters gathered by DeepSpeed's
``safe_get_full_fp32_param``, frozen params and buffers as the modules held them
(``reference/live_stage{S}.safetensors``, merged in ``live.safetensors``)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    PIPELINE_SAMPLES,
    Sample,
    copy_checkpoint,
    run_cli,
    same_bits,
    same_checkpoint_files,
    sample,
    tag_files,
)
from zckpt import load_state_dict, reshard
from zckpt.core.errors import CheckpointNotFoundError, LayoutError, UsageError
from zckpt.core.topology import Topology
from zckpt.deepspeed.reader import open_checkpoint, open_training_state, survey
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.verify import verify

IDS = [s.name for s in PIPELINE_SAMPLES]


def test_the_samples_are_there() -> None:
    assert {s.name for s in PIPELINE_SAMPLES} >= {"pp2_z1_fp32_dp1", "pp2_z1_bf16_dp2"}


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_topology_and_names_are_the_one_stage_models(case: Sample) -> None:
    index = open_checkpoint(case.checkpoint)
    assert index.topology == Topology(pp=case.meta["pp"], dp=case.meta["dp"])
    assert index.world_size == case.meta["world_size"] and index.zero_stage == 1
    live = case.live()
    assert sorted(index.names()) == sorted(live)
    # PipelineModule registers tied_modules before its layers: the one-stage state dict's order
    assert index.names()[0] == "tied_modules.embed.weight"
    layers = [int(n.split(".")[0]) for n in index.names()[1:]]
    assert layers == sorted(layers)
    kinds = {e.name: e.kind for e in index.entries}
    assert {n for n, k in kinds.items() if k == "frozen"} == set(case.meta["frozen"])
    assert {n for n, k in kinds.items() if k == "buffer"} == set(case.meta["buffers"])
    assert [r.name for r in index.replicas] == ["tied_modules.embed.weight"]  # stage 1's copy


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_consolidated_values_are_the_live_engines(case: Sample) -> None:
    """Trainable params: the fp32 masters of their stage; frozen params and buffers from the layer
    files, in the training dtype; every stage's tied copy equal to the one written."""
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    live = case.live()
    for name, value in live.items():
        expected = value.float() if value.is_floating_point() else value
        assert same_bits(state_dict[name], expected), name
    for stage in range(case.meta["pp"]):
        own = load_file(case.folder / "reference" / f"live_stage{stage}.safetensors")
        assert same_bits(own["tied_modules.embed.weight"], state_dict["tied_modules.embed.weight"])


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_optimizer_states_are_the_live_engines(case: Sample) -> None:
    """Moments where DeepSpeed's API gave them (meta.json's live_optimizer says where not)."""
    state = open_training_state(case.checkpoint)
    moments = case.folder / "reference" / "live_optimizer.safetensors"
    live = load_file(moments) if moments.exists() else None
    assert live is not None or "no optimizer fragment" in case.meta["live_optimizer"]
    assert {k for p in state.params for k in p.states} == {"exp_avg", "exp_avg_sq"}
    with FileReader() as reader:
        for param in state.params:
            for key, source in param.states.items() if live is not None else ():
                value = read_tensor(reader, source).reshape(param.shape)
                assert same_bits(value, live[f"{param.name}.{key}"]), (param.name, key)
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), case.live()[param.name].float())
    assert state.global_steps == case.meta["global_steps"] and len(state.groups) == 1
    assert [p.name for p in state.params] == list(state.groups[0].params)
    assert len(set(state.groups[0].params)) == len(state.groups[0].params)  # the tied param once


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_cli_consolidate_inspect_verify(tmp_path: Path, case: Sample) -> None:
    out = tmp_path / "out"
    done = run_cli("consolidate", case.checkpoint, out, "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    written = load_file(out / "model.safetensors")
    live = case.live()
    assert sorted(written) == sorted(live)
    for name, value in live.items():
        if value.dtype in (torch.float32, torch.bfloat16):
            assert same_bits(written[name], value.to(torch.bfloat16)), name
    inspected = run_cli("inspect", case.checkpoint)
    assert inspected.returncode == 0 and "pipeline-parallel: 2 stages" in inspected.stdout, inspected.stdout
    verified = run_cli("verify", case.checkpoint)
    assert verified.returncode == 0 and "replicas" in verified.stdout, verified.stdout


BF16 = next(s for s in PIPELINE_SAMPLES if s.name == "pp2_z1_bf16_dp2")
FP32 = next(s for s in PIPELINE_SAMPLES if s.name == "pp2_z1_fp32_dp1")


def test_a_changed_tied_copy_is_caught(tmp_path: Path) -> None:
    """Stage 1's master of the tied embedding edited in place: verify names the file, consolidate
    refuses rather than write one of two different values."""
    tag = copy_checkpoint(tmp_path, FP32)
    index = open_checkpoint(tag.parent)
    replica = index.replicas[0].source.segments[0]
    assert os.path.basename(replica.path) == "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    with open(replica.path, "r+b") as f:
        f.seek(replica.offset + 4 * 5)
        f.write(b"\x00\x00\x80\x3f")  # element 5 := 1.0
    report = verify(tag.parent)
    assert not report.ok
    assert any("tied_modules.embed.weight differs in 1 of 368 elements" in p for p in report.problems), report.problems
    with pytest.raises(LayoutError, match="the copies of a param that several ranks keep must be equal"):
        from zckpt.ops.consolidate import consolidate

        consolidate(tag.parent, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_changed_layer_file_weight_is_caught(tmp_path: Path) -> None:
    """A layer file's 16-bit weight edited in one element: it is no longer its stage's master
    rounded; verify names the layer file."""
    tag = copy_checkpoint(tmp_path, BF16)
    index = open_checkpoint(tag.parent)
    layer_copies = [
        c for c, _ in index.rounded_copies if os.path.basename(c.source.segments[0].path).startswith("layer_")
    ]
    assert layer_copies, [c.source.segments[0].path for c, _ in index.rounded_copies]
    copy = layer_copies[-1]
    segment = copy.source.segments[0]
    with open(segment.path, "r+b") as f:
        f.seek(segment.offset)
        f.write(b"\x00\x00" if f.read(2) != b"\x00\x00" else b"\x80\x3f")
    report = verify(tag.parent)
    assert not report.ok
    assert any(p.startswith(segment.path) and "differs in 1 of" in p for p in report.problems), report.problems


@pytest.mark.parametrize(
    "remove, expected",
    [
        ("mp_rank_01_model_states.pt", "mp_rank_01_model_states.pt: missing (the model states of pipeline stage 1)"),
        ("layer_04-model_states.pt", "layer_04-model_states.pt: missing: stage 1 lists 4.norm.weight and 6 more"),
        ("bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt: missing"),
    ],
)
def test_a_missing_stage_file_is_named(tmp_path: Path, remove: str, expected: str) -> None:
    tag = copy_checkpoint(tmp_path, BF16)
    (tag / remove).unlink()
    found = survey(tag.parent)
    assert found.index is None and found.problems
    assert any(expected in str(p) for p in found.problems), [str(p) for p in found.problems]
    with pytest.raises((CheckpointNotFoundError, LayoutError)):
        open_checkpoint(tag.parent)


def test_stages_of_different_saves_are_refused(tmp_path: Path) -> None:
    """Stage 1's files from the bf16 run beside stage 0's of the fp32 one."""
    tag = copy_checkpoint(tmp_path, FP32)
    other = BF16.checkpoint / "global_step3"
    for name in ("mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"):
        (tag / name).unlink()
    shutil.copy(other / "mp_rank_01_model_states.pt", tag)
    for rank in (0, 1):
        shutil.copy(other / f"bf16_zero_pp_rank_{rank}_mp_rank_01_optim_states.pt", tag)
    found = survey(tag.parent)
    assert found.index is None and found.problems


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_reshard_to_its_own_layout_gives_deepspeeds_files_back(tmp_path: Path, case: Sample) -> None:
    """Every file DeepSpeed wrote, rewritten by zckpt at the run's own stages and data ranks: the
    same pickled trees and tensor bytes (layer files: the same bytes)."""
    out = tmp_path / "same"
    reshard(case.checkpoint, out, world_size=case.meta["dp"])
    assert same_checkpoint_files(case.checkpoint, out) == []
    for name, path in tag_files(case.checkpoint).items():
        if name.startswith("layer_"):  # copied as they are
            assert path.read_bytes() == tag_files(out)[name].read_bytes(), name


def test_reshard_to_one_stage_and_back_to_the_values(tmp_path: Path) -> None:
    """bf16 at 2 stages x 2 data ranks -> 1 stage x 3 ranks: one model-states file, every param in
    the one-stage model's order, and the same values read back."""
    out = tmp_path / "one"
    reshard(BF16.checkpoint, out, world_size=3, pipeline_stages=1)
    files = sorted(tag_files(out))
    assert [f for f in files if "model_states" in f and not f.startswith("layer_")] == ["mp_rank_00_model_states.pt"]
    assert [f for f in files if f.endswith("optim_states.pt")] == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)
    ]
    index = open_checkpoint(out)
    assert index.topology == Topology(pp=1, dp=3) and index.replicas == ()
    assert index.names() == open_checkpoint(BF16.checkpoint).names()
    written = load_state_dict(out, dtype="fp32")
    for name, value in BF16.live().items():
        assert same_bits(written[name], value.float() if value.is_floating_point() else value), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_stages": 3}, "--pipeline-stages 3: at a stage count other than its own 2 or 1, zckpt needs"),
        ({"stage": 3}, "--stage 3: DeepSpeed's pipeline engine runs ZeRO-0/1 only"),
    ],
)
def test_pipeline_writes_it_cannot_make_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        reshard(FP32.checkpoint, tmp_path / "out", world_size=1, **kwargs)
    assert not (tmp_path / "out").exists()


def test_pipeline_stages_of_a_data_parallel_checkpoint_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--pipeline-stages is for pipeline-parallel checkpoints"):
        reshard(sample("z1_fp32_ws2_frozen_tied").checkpoint, tmp_path / "out", world_size=1, pipeline_stages=1)


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_to_universal_holds_the_live_values_under_the_pipeline_modules_names(tmp_path: Path, case: Sample) -> None:
    """A folder per trainable param, named as PipelineModule names it at any stage count (the
    names DeepSpeed's universal loader looks up, test_interop_parallel.py loads it at other
    stage counts): masters and moments the live engine's; the model-states file holds the frozen
    params and buffers, so the folder read back is the whole model."""
    out = tmp_path / "universal"
    done = run_cli("to-universal", case.checkpoint, out)
    assert done.returncode == 0, done.stderr
    universal = open_training_state(out)
    assert universal.index.universal and not universal.stages
    live = case.live()
    trainable = {n for n in live if n not in case.meta["frozen"] and n not in case.meta["buffers"]}
    assert {p.name for p in universal.params} == trainable
    assert sorted(os.listdir(out / "global_step3_universal" / "zero")) == sorted([*trainable, "optimizer_state.pt"])
    moments = case.folder / "reference" / "live_optimizer.safetensors"
    saved = load_file(moments) if moments.exists() else None
    with FileReader() as reader:
        for param in universal.params:
            assert same_bits(read_tensor(reader, param.master).reshape(param.shape), live[param.name].float())
            for key, source in param.states.items() if saved is not None else ():
                assert same_bits(read_tensor(reader, source).reshape(param.shape), saved[f"{param.name}.{key}"])
        assert read_tensor(reader, universal.groups[0].scalars["step"].tensor).item() == case.meta["global_steps"]
    written = load_state_dict(out, dtype="fp32")
    assert sorted(written) == sorted(live)
    for name, value in live.items():
        assert same_bits(written[name], value.float() if value.is_floating_point() else value), name


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=IDS)
def test_inspect_shows_each_params_stage(case: Sample) -> None:
    """The placement column against DeepSpeed's own files (torch.load): a trainable param is on
    the stage whose model states list it in ``param_shapes``; the layers' frozen params and
    buffers on the stage of their layer (the generator's uniform partition: layers 0-2, 3-5)."""
    from zckpt.ops.inspect import inspect_path

    placements = {p["name"]: p.get("placement") for p in inspect_path(str(case.checkpoint))["parameters"]}
    holders: dict[str, list[int]] = {}
    for stage in range(case.meta["pp"]):
        model = torch.load(
            case.checkpoint / "global_step3" / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False
        )
        for shapes in model["param_shapes"]:
            for name in shapes:
                holders.setdefault(name, []).append(stage)
    assert holders["tied_modules.embed.weight"] == [0, 1]
    assert placements["tied_modules.embed.weight"] == "stages 0, 1 (tied copies)"
    for name, stages in holders.items():
        if len(stages) == 1:
            assert placements[name] == f"stage {stages[0]}", name
    for name in case.meta["frozen"] + case.meta["buffers"]:
        assert placements[name] == f"stage {0 if int(name.split('.')[0]) <= 2 else 1}", name

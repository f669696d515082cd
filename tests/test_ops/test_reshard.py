"""zckpt reshard against facts DeepSpeed wrote: the sample files themselves (an identity reshard
must rebuild every key and tensor DeepSpeed saved), the live engine values captured before saving
(fp32 masters, Adam moments) at every new world size and stage, and the round trips."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    RESHARDABLE,
    SAMPLES,
    Sample,
    compare_trees,
    drop_zenflow_module_weights,
    inline,
    is_elastic,
    one_line,
    padded_paths,
    run_cli,
    run_zckpt_torchrun,
    same_bits,
    sample,
    tag_files,
)
from zckpt.deepspeed.reader import open_training_state
from zckpt.deepspeed.writer import carry
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader, read_ref
from zckpt.ops.consolidate import consolidate
from zckpt.ops.reshard import reshard
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave


@pytest.mark.slow
@pytest.mark.parametrize("case", RESHARDABLE, ids=lambda s: s.name)
def test_identity_reshard_rebuilds_what_deepspeed_wrote(case: Sample, tmp_path: Path) -> None:
    """Same world size and stage: every file, key, value and tensor as DeepSpeed saved it."""
    if is_elastic(case):  # test_interop_elastic.py has DeepSpeed load zckpt's elastic files
        pytest.skip(
            "an elastic_checkpoint run: zckpt's files add the base_optimizer_state_step that DeepSpeed's "
            "elastic loader asserts and its own files of this optimizer lack"
        )
    out = tmp_path / "out"
    reshard(case.checkpoint, out, world_size=case.meta["world_size"], stage=case.meta["zero_stage"])
    original, ours = tag_files(case.checkpoint), tag_files(out)
    assert list(original) == list(ours)
    # ZeRO-3 padding is uninitialised memory in DeepSpeed's files, Adamax's holds eps; zckpt writes zeros there
    padded = padded_paths(case, case.meta["zero_stage"])
    # with round_robin_gradients DeepSpeed's param_slice_mappings describe the param group's
    # order, not where the bytes are (sample README); the writer writes them as DeepSpeed does
    with FileReader() as reader:
        for name in original:
            a, b = torchfile.load(original[name]), torchfile.load(ours[name])
            assert compare_trees(a, b, reader, padded=padded) == [], name


def _expected_masters(case: Sample) -> dict:
    return {n: t.float() for n, t in case.live().items() if t.is_floating_point()}


TARGETS = [(ws, stage) for ws, stage in itertools.product((1, 2, 3, 4), (1, 2, 3))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["z2_fp16_ws4_tied", "z3_bf16_ws3_subgroups_groups", "z1_fp32_ws2_frozen_tied", "ds14_z2_bf16_ws3_frozen_tied"],
)
@pytest.mark.parametrize("world_size,stage", TARGETS, ids=[f"ws{w}-z{s}" for w, s in TARGETS])
def test_resharded_state_equals_the_live_engine(name: str, world_size: int, stage: int, tmp_path: Path) -> None:
    case = sample(name)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    state = open_training_state(tmp_path / "out")
    assert (state.index.world_size, state.index.zero_stage) == (world_size, stage)
    live = case.live()
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    original = open_training_state(case.checkpoint)
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name].float()), param.name
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, source), live_optim[f"{param.name}.{key}"]), (param.name, key)
        for before, after in zip(original.groups, state.groups):
            assert before.hyperparams == after.hyperparams
            assert (
                read_tensor(reader, before.scalars["step"].tensor).item()
                == read_tensor(reader, after.scalars["step"].tensor).item()
            )
        for entry in state.index.entries:
            if entry.kind in ("frozen", "buffer"):
                assert same_bits(read_tensor(reader, entry.source), live[entry.name]), entry.name
    assert (state.global_steps, state.global_samples, state.skipped_steps) == (
        original.global_steps,
        original.global_samples,
        original.skipped_steps,
    )
    assert vars(state.loss_scaler) == vars(original.loss_scaler)
    assert state.lr_scheduler == original.lr_scheduler


@pytest.mark.slow
@pytest.mark.parametrize("case", RESHARDABLE, ids=lambda s: s.name)
def test_round_trip_n_m_n_and_consolidation(case: Sample, tmp_path: Path) -> None:
    """N -> M -> N (M odd, other stage) gives DeepSpeed's files back; consolidation is unchanged."""
    if is_elastic(case):  # test_interop_elastic.py has DeepSpeed load zckpt's elastic files
        pytest.skip(
            "an elastic_checkpoint run: the step through another stage keeps no elastic layout, so the way back writes the rigid one"
        )
    ws, stage = case.meta["world_size"], case.meta["zero_stage"]
    other_stage = 3 if stage < 3 else 2
    reshard(case.checkpoint, tmp_path / "m", world_size=3 if ws != 3 else 2, stage=other_stage)
    reshard(tmp_path / "m", tmp_path / "n", world_size=ws, stage=stage)
    original, ours = tag_files(case.checkpoint), tag_files(tmp_path / "n")
    assert list(original) == list(ours)
    padded = padded_paths(case, stage)
    # ZeRO-3 saves each rank's own buffers; a ZeRO-1/2 checkpoint (one model file) or fewer ranks
    # cannot hold them, so there DeepSpeed's own layout keeps rank 0's (see README)
    rank0_buffers_only = stage == 3
    with FileReader() as reader:
        rank0_module = (
            torchfile.load(original["zero_pp_rank_0_mp_rank_00_model_states.pt"])["module"] if stage == 3 else None
        )
        for name in original:
            a, b = torchfile.load(original[name]), torchfile.load(ours[name])
            if rank0_buffers_only and "module" in a:
                for buffer in a["buffer_names"]:
                    a["module"][buffer] = rank0_module[buffer]
            drop_zenflow_module_weights(case, a, b, reader)  # neither ZeRO-3 nor universal holds them
            assert compare_trees(a, b, reader, padded=padded) == [], name
    consolidate(case.checkpoint, tmp_path / "c0")
    consolidate(tmp_path / "m", tmp_path / "c1")
    before, after = load_file(tmp_path / "c0" / "model.safetensors"), load_file(tmp_path / "c1" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(same_bits(before[n], after[n]) for n in before)


def test_same_input_gives_byte_identical_output(tmp_path: Path) -> None:
    case = sample("z3_fp16_ws4_subgroups_frozen")
    reshard(case.checkpoint, tmp_path / "a", world_size=3, stage=2)
    reshard(case.checkpoint, tmp_path / "b", world_size=3, stage=2)
    a, b = tag_files(tmp_path / "a"), tag_files(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in a.items()} == {n: p.read_bytes() for n, p in b.items()}


def test_api_yields_optimizer_states_beside_the_weights() -> None:
    import zckpt

    case = sample("z3_bf16_ws3_subgroups_groups")
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    got = {n: t for n, t in zckpt.iter_tensors(case.checkpoint, states=True) if n.endswith((".exp_avg", ".exp_avg_sq"))}
    assert sorted(got) == sorted(live_optim)
    assert all(same_bits(got[n], live_optim[n]) for n in got)


# --- bad input and the command line ---------------------------------------------------------


@pytest.mark.parametrize(
    "args,code,text",
    [
        (["--world-size", "0"], 2, "'--world-size' / '-w': Input should be greater than or equal to 1"),
        (["--world-size", "2", "--stage", "4"], 2, "4"),
        (["--world-size", "2", "--config", "missing.json"], 2, "DeepSpeed config not found"),
    ],
)
def test_bad_options_are_refused(tmp_path: Path, args: list[str], code: int, text: str) -> None:
    result = run_cli("reshard", sample("z2_fp32_ws1").checkpoint, tmp_path / "out", *args, cwd=tmp_path)
    assert result.returncode == code
    assert text in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_output_inside_the_input_is_refused(copy_checkpoint, tmp_path: Path) -> None:
    checkpoint = copy_checkpoint("z2_fp32_ws1")
    before = sorted(p.name for p in checkpoint.rglob("*"))
    result = run_cli("reshard", checkpoint, checkpoint / "resharded", "-w", "2", cwd=tmp_path)
    assert result.returncode == 2 and "is inside the input" in one_line(result)
    assert sorted(p.name for p in checkpoint.rglob("*")) == before
    result = run_cli("reshard", checkpoint, checkpoint, "-w", "2", "--overwrite", cwd=tmp_path)
    assert result.returncode == 2 and sorted(p.name for p in checkpoint.rglob("*")) == before


@pytest.mark.parametrize("world_size,stage", [(3, 3), (1, 2)])
def test_nvme_offloaded_input_reshards_for_a_run_without_nvme(world_size: int, stage: int, tmp_path: Path) -> None:
    """Masters and Adam moments come from offloaded_tensors/ and land in plain files."""
    import json

    case = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage, config=config)
    assert not list((tmp_path / "out").rglob("offloaded_tensors"))
    state = open_training_state(tmp_path / "out")
    assert (state.index.world_size, state.index.zero_stage, state.index.offload) == (world_size, stage, "cpu")
    live = case.live()
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name].float()), param.name
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, source), live_optim[f"{param.name}.{key}"]), (param.name, key)


@pytest.mark.slow
def test_damaged_input_leaves_nothing(copy_checkpoint, tmp_path: Path) -> None:
    checkpoint = copy_checkpoint("z3_fp32_ws2_tied_frozen")
    victim = checkpoint / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    result = run_cli("reshard", checkpoint, tmp_path / "out", "-w", "3", cwd=tmp_path)
    assert result.returncode == 1 and str(victim) in one_line(result)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_existing_output_needs_overwrite_and_stays_intact(tmp_path: Path) -> None:
    case = sample("z2_fp32_ws2_twotags")
    out = tmp_path / "out"
    reshard(case.checkpoint, out, world_size=3)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = run_cli("reshard", case.checkpoint, out, "-w", "2", cwd=tmp_path)
    assert result.returncode == 1 and "already exists" in one_line(result)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot
    result = run_cli("reshard", case.checkpoint, out, "-w", "2", "--overwrite", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert open_training_state(out).index.world_size == 2
    assert sorted(p.name for p in out.iterdir()) == ["global_step3", "latest"]  # no staging left


def test_full_disk_leaves_no_partial_tag_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from zckpt import OutputError
    from zckpt.deepspeed import save

    calls = {"n": 0}
    real = save.write_archive

    def failing(path, plan, reader, progress=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, plan, reader, progress)

    monkeypatch.setattr(save, "write_archive", failing)
    with pytest.raises(OutputError, match="no space left"):
        reshard(sample("z3_fp32_ws2_tied_frozen").checkpoint, tmp_path / "out", world_size=3, workers=1)
    assert not (tmp_path / "out" / "global_step3").exists() and not (tmp_path / "out" / "latest").exists()
    assert not (tmp_path / "out").exists()  # the folder it created is gone too


def test_hf_trainer_folder_is_carried_over(tmp_path: Path) -> None:
    case = sample("hf_trainer")
    out = tmp_path / "checkpoint-3"
    result = reshard(case.checkpoint, out, world_size=3, stage=2)
    carried = sorted(p.name for p in case.checkpoint.iterdir() if p.is_file() and p.name != "latest")
    assert sorted(result.carried) == carried
    for name in carried:
        assert (out / name).read_bytes() == (case.checkpoint / name).read_bytes()
    assert (out / "latest").read_text() == "global_step3"


def test_rng_states_of_missing_processes_are_dropped(tmp_path: Path) -> None:
    import shutil

    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(sample("hf_trainer").checkpoint, checkpoint)
    for rank in range(2):
        (checkpoint / f"rng_state_{rank}.pth").write_bytes(f"rng{rank}".encode())
    result = reshard(checkpoint, tmp_path / "one", world_size=1)
    # a one-process Trainer reads rng_state.pth (transformers' Trainer._load_rng_state)
    assert "rng_state.pth" in result.carried and result.dropped == ("rng_state_1.pth",)
    assert (tmp_path / "one" / "rng_state.pth").read_bytes() == b"rng0"
    assert not (tmp_path / "one" / "rng_state_0.pth").exists() and not (tmp_path / "one" / "rng_state_1.pth").exists()
    single = tmp_path / "single" / "checkpoint-3"
    reshard(tmp_path / "one", single, world_size=2)
    assert (single / "rng_state_0.pth").read_bytes() == b"rng0" and not (single / "rng_state.pth").exists()


@pytest.mark.slow
def test_torchrun_processes_split_the_files_byte_identically(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m zckpt reshard ...`: two processes write their share of
    the files into one folder; the result equals the single-process run byte for byte."""
    case = sample("z3_fp16_ws4_subgroups_frozen")
    reshard(case.checkpoint, tmp_path / "single", world_size=3, stage=2)
    result = run_zckpt_torchrun("reshard", str(case.checkpoint), str(tmp_path / "multi"), "-w", "3", "--stage", "2")
    assert result.stdout.count("wrote global_step3") == 1  # only the first process reports
    single = {
        p.relative_to(tmp_path / "single"): p.read_bytes() for p in (tmp_path / "single").rglob("*") if p.is_file()
    }
    multi = {p.relative_to(tmp_path / "multi"): p.read_bytes() for p in (tmp_path / "multi").rglob("*") if p.is_file()}
    assert single == multi


@pytest.mark.slow
def test_target_config_overrides_layout_settings(tmp_path: Path) -> None:
    """--config (the target run's ds_config) turns on round_robin_gradients and
    parameter_alignment: DeepSpeed's flat order and paddings for that run, the same values."""
    import json

    case = sample("z2_fp32_ws1")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"round_robin_gradients": True, "parameter_alignment": True}}))
    result = run_cli("reshard", case.checkpoint, tmp_path / "out", "-w", "2", "--config", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model = torchfile.load(tmp_path / "out" / "global_step3" / "mp_rank_00_model_states.pt")
    names = [n for n in model["module"] if n in model["param_shapes"][0]]  # optimizer order = module order here
    assert list(model["param_shapes"][0]) == [names[i] for i in range(0, len(names), 2)] + [
        names[i] for i in range(1, len(names), 2)
    ]
    zero = model["ds_config"]["zero_optimization"]
    assert zero["round_robin_gradients"] and zero["parameter_alignment"] and zero["stage"] == 2
    optim = torchfile.load(tmp_path / "out" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[
        "optimizer_state_dict"
    ]
    assert any(optim["param_alignment_paddings"][0])  # fp32 params aligned to 16 bytes = 4 elements
    state = open_training_state(tmp_path / "out")
    live = case.live()
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name]), param.name


@pytest.mark.parametrize(
    "checkpoint,stage",
    [
        ("peft_lora/gpt2_z2_fp32_ws2/checkpoint-3", 3),  # the Trainer saves PEFT runs with exclude_frozen_parameters
        ("peft_lora/llama_z3_bf16_ws2/checkpoint-3", 2),
        ("z3_fp32_ws2_tied_frozen/checkpoint", 2),  # frozen params in the files: recorded
        ("z3_bf16_ws3_subgroups_groups/checkpoint", 3),  # none, in a run that records them: an empty record
    ],
)
def test_frozen_params_are_recorded_as_the_input_records_them(checkpoint: str, stage: int, tmp_path: Path) -> None:
    """DeepSpeed records no frozen params (None) when a run saved with exclude_frozen_parameters, and
    its load then keeps the model's own; an empty record would make it look each one up (KeyError).
    The input's own model states say which (DeepSpeed wrote them)."""
    source = SAMPLES / checkpoint
    tag = (source / "latest").read_text().strip()
    saved = torchfile.load(sorted((source / tag).glob("*model_states.pt"))[0])
    reshard(source, tmp_path / "out", world_size=3, stage=stage)
    for path in sorted((tmp_path / "out" / tag).glob("*model_states.pt")):
        written = torchfile.load(path)
        for key in ("frozen_param_shapes", "frozen_param_fragments"):
            assert (written[key] is None) == (saved[key] is None), (path.name, key)
        if saved["frozen_param_shapes"] is not None:
            assert list(written["frozen_param_shapes"]) == list(saved["frozen_param_shapes"])


def test_saved_16bit_weights_are_carried_as_saved(tmp_path: Path) -> None:
    """A ZeRO-1/2 run's module holds its 16-bit weights, which DeepSpeed's optimizers make the
    masters rounded, but ZenFlow's the live engine's (issue: 284 of 3,201 elements differ). A
    reshard carries them as saved instead of recomputing them: here one weight saved one bf16 ulp
    off its master, as ZenFlow leaves it, is in every resharded ZeRO-1/2 file as it was saved."""
    case = sample("z2_bf16_ws3_frozen_groups")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    path = checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt"
    original = torchfile.load(path)
    with FileReader() as reader:
        saved = torch.from_numpy(read_ref(reader, original["module"]["fc1.bias"]).copy()).view(torch.bfloat16)
    changed = saved.view(torch.int16).add(1).view(torch.bfloat16)  # the next bf16 value up
    tree = carry(original)
    tree["module"]["fc1.bias"] = inline(changed)
    torchsave.save(tree, str(path) + ".new")
    os.replace(str(path) + ".new", path)
    for stage, world in ((2, 2), (1, 4)):
        out = tmp_path / f"z{stage}-ws{world}"
        reshard(checkpoint, out, world_size=world, stage=stage)
        written = torchfile.load(out / case.meta["tag"] / "mp_rank_00_model_states.pt")
        with FileReader() as reader:
            got = torch.from_numpy(read_ref(reader, written["module"]["fc1.bias"]).copy()).view(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), changed.view(torch.int16)), (stage, world)

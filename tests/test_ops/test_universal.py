"""zckpt to-universal and universal folders as input, against facts DeepSpeed wrote: the live
engine values captured before each sample was saved (fp32 masters, Adam moments), the sample's
own files (read with torch.load), and the files DeepSpeed wrote, rebuilt through a universal
round trip. Real DeepSpeed loading the outputs is in test_interop_universal.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    RESHARDABLE,
    SAMPLE_LIST,
    Sample,
    compare_trees,
    deepspeed_base_state,
    drop_zenflow_module_weights,
    is_elastic,
    load_with_stand_ins,
    one_line,
    padded_paths,
    run_cli,
    run_zckpt_torchrun,
    same_bits,
    sample,
    tag_files,
)
from zckpt.cli.inspect import render
from zckpt.core.errors import UsageError
from zckpt.deepspeed.reader import open_training_state
from zckpt.deepspeed.writer import carry
from zckpt.io.reading import FileReader
from zckpt.ops.consolidate import consolidate
from zckpt.ops.inspect import inspect_path
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave

WITH_LIVE_OPTIMIZER = [s for s in SAMPLE_LIST if (s.folder / "reference" / "live_optimizer.safetensors").exists()]


def _universal_dir(out: Path) -> Path:
    return out / (out / "latest_universal").read_text().strip()


def _original_files(case: Sample) -> dict[str, object]:
    return {n: load_with_stand_ins(p) for n, p in tag_files(case.checkpoint).items()}


def _saved_param_groups_and_steps(case: Sample) -> tuple[list[dict], list]:
    """Hyperparameters and the step of each param group, from DeepSpeed's rank-0 optimizer file."""
    rank0 = next(
        v for n, v in _original_files(case).items() if "zero_pp_rank_0_" in n and n.endswith("optim_states.pt")
    )
    inner = rank0["optimizer_state_dict"]
    torch_state = deepspeed_base_state(inner)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in torch_state["param_groups"]]
    steps = []
    for group in torch_state["param_groups"]:
        first = torch_state["state"].get(group["params"][0], {})
        steps.append(first.get("step"))
    return groups, steps


@pytest.mark.slow
@pytest.mark.parametrize("target_stage", [None, 1, 3], ids=["own-stage", "to-z1", "to-z3"])
@pytest.mark.parametrize("case", WITH_LIVE_OPTIMIZER, ids=lambda s: s.name)
def test_universal_files_hold_the_live_engine_state(case: Sample, target_stage: int | None, tmp_path: Path) -> None:
    """Every trainable param's fp32 master and optimizer states, in the flavour of the target stage,
    equal the engine's values before the save; optimizer_state.pt carries the saved groups. (Where
    DeepSpeed's loader of that stage would not restore a state, the folder is written on request:
    allow_state_loss, as test_state_loss_is_said_before_writing checks.)"""
    result = to_universal(case.checkpoint, tmp_path / "out", target_stage=target_stage, allow_state_loss=True)
    stage = target_stage or case.meta["zero_stage"]
    folder = _universal_dir(tmp_path / "out")
    assert folder.name == (case.checkpoint / "latest").read_text().strip() + "_universal"
    live = case.live()
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    original_model = load_with_stand_ins(next(p for n, p in tag_files(case.checkpoint).items() if "model_states" in n))
    aliases = set(original_model.get("shared_params") or {})  # live dumps list tied names twice
    trainable = {n.rsplit(".", 1)[0] for n in live_optim} - aliases
    assert trainable and {p.name for p in result.source.params} == trainable
    for name in trainable:
        for state in ("fp32", *case.param_state_names(name, live_optim)):
            value = load_with_stand_ins(folder / "zero" / name / f"{state}.pt")
            truth = live[name].float() if state == "fp32" else live_optim[f"{name}.{state}"]
            if stage == 3:  # ZeRO-3's loader reads a flat tensor
                assert isinstance(value, torch.Tensor) and value.dim() == 1, (name, state)
            else:  # ZeRO-1/2's wants DeepSpeed's dict with the full shape
                assert list(value) == ["cat_dim", "param"] and value["cat_dim"] == 0, (name, state)
                value = value["param"]
                assert value.shape == truth.shape, (name, state)
            assert same_bits(value.reshape(truth.shape), truth), (name, state)
    groups, steps = _saved_param_groups_and_steps(case)
    global_state = load_with_stand_ins(folder / "zero" / "optimizer_state.pt")
    assert [{k: v for k, v in g.items() if k != "params"} for g in global_state["param_groups"]] == groups
    by_group = {p.name: p.group for p in result.source.params}
    if stage == 3:
        saved = global_state["optimizer_state_dict"]["state"]
        known = [s for s in steps if s is not None]  # Muon's Muon group keeps none, SGD no group
        assert (
            all("step" not in saved[i] for i in saved)
            if not known
            else all(torch.equal(torch.as_tensor(saved[i]["step"]), torch.as_tensor(known[0])) for i in saved)
        )
    elif case.counts_steps or case.muon:  # Muon: its Adam group's params have a step
        for name in trainable:
            if steps[by_group[name]] is None:
                assert case.muon and not (folder / "zero" / name / "step.pt").exists(), name
                continue
            assert torch.equal(
                torch.as_tensor(load_with_stand_ins(folder / "zero" / name / "step.pt")),
                torch.as_tensor(steps[by_group[name]]),
            ), name
    # the model_states DeepSpeed's loader looks for in a run of that stage, with the saved counters
    model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    ours = load_with_stand_ins(folder / model_name)
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "dp_world_size"):
        assert ours[key] == original_model[key], key


@pytest.mark.slow
@pytest.mark.parametrize("case", RESHARDABLE, ids=lambda s: s.name)
def test_round_trip_through_universal_gives_deepspeeds_files_back(case: Sample, tmp_path: Path) -> None:
    """ZeRO -> universal (the other stage's flavour) -> ZeRO at the same world size and stage:
    every file, key and tensor DeepSpeed wrote, optimizer tensors bit for bit."""
    if is_elastic(case):  # test_interop_elastic.py has DeepSpeed load zckpt's elastic files
        pytest.skip(
            "an elastic_checkpoint run: the step through a universal folder keeps no elastic layout, so the way back writes the rigid one"
        )
    ws, stage = case.meta["world_size"], case.meta["zero_stage"]
    to_universal(case.checkpoint, tmp_path / "u", target_stage=3 if stage < 3 else 2, allow_state_loss=True)
    reshard(tmp_path / "u", tmp_path / "back", world_size=ws, stage=stage)
    original, ours = tag_files(case.checkpoint), tag_files(tmp_path / "back")
    assert list(original) == list(ours)
    padded = padded_paths(case, stage)
    with FileReader() as reader:
        rank0_module = (
            torchfile.load(original["zero_pp_rank_0_mp_rank_00_model_states.pt"])["module"] if stage == 3 else None
        )
        for name in original:
            a, b = torchfile.load(original[name]), torchfile.load(ours[name])
            if "roundrobin" in case.name and "optimizer_state_dict" in a:  # DeepSpeed 0.19.8 saves them wrong
                (
                    a["optimizer_state_dict"].pop("param_slice_mappings"),
                    b["optimizer_state_dict"].pop("param_slice_mappings"),
                )
            if stage == 3 and "module" in a:  # per-rank buffers cannot cross a ZeRO-1/2 layout (see README)
                for buffer in a["buffer_names"]:
                    a["module"][buffer] = rank0_module[buffer]
            drop_zenflow_module_weights(case, a, b, reader)  # neither ZeRO-3 nor universal holds them
            assert compare_trees(a, b, reader, padded=padded) == [], name


@pytest.mark.slow
@pytest.mark.parametrize("case", RESHARDABLE, ids=lambda s: s.name)
def test_universal_then_reshard_then_consolidate_equals_the_original(case: Sample, tmp_path: Path) -> None:
    ws = case.meta["world_size"]
    to_universal(case.checkpoint, tmp_path / "u", allow_state_loss=True)
    reshard(tmp_path / "u", tmp_path / "m", world_size=ws % 4 + 1)
    consolidate(case.checkpoint, tmp_path / "c0")
    consolidate(tmp_path / "m", tmp_path / "c1")
    consolidate(tmp_path / "u", tmp_path / "c2")  # the universal folder itself, as input
    before = load_file(tmp_path / "c0" / "model.safetensors")
    for out in ("c1", "c2"):
        after = load_file(tmp_path / out / "model.safetensors")
        assert sorted(before) == sorted(after)
        assert all(same_bits(before[n], after[n]) for n in before), out


def test_same_input_gives_byte_identical_output(tmp_path: Path) -> None:
    case = sample("z3_fp16_ws4_subgroups_frozen")
    to_universal(case.checkpoint, tmp_path / "a", target_stage=2)
    to_universal(case.checkpoint, tmp_path / "b", target_stage=2)
    files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}  # noqa: E731
    assert files(tmp_path / "a") == files(tmp_path / "b")


@pytest.mark.slow
def test_torchrun_processes_split_the_params_byte_identically(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m zckpt to-universal ...`: two processes write their share
    of the param files into one folder; the result equals the single-process run byte for byte."""
    case = sample("z3_bf16_ws3_subgroups_groups")
    to_universal(case.checkpoint, tmp_path / "single")
    result = run_zckpt_torchrun("to-universal", str(case.checkpoint), str(tmp_path / "multi"))
    assert result.stdout.count("wrote global_step3_universal") == 1  # only the first process reports
    files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}  # noqa: E731
    assert files(tmp_path / "single") == files(tmp_path / "multi")


def test_inspect_tells_a_universal_folder_and_the_stage_that_loads_it(tmp_path: Path) -> None:
    from zckpt.cli.inspect import render
    from zckpt.ops.inspect import inspect_path

    to_universal(sample("z2_fp16_ws4_tied").checkpoint, tmp_path / "u", target_stage=3)
    report = inspect_path(tmp_path / "u")
    assert report["universal"] and report["complete"] and report["zero_stage"] == 3 and report["world_size"] == 4
    assert report["training_state"]["optimizer_states"] == ["exp_avg", "exp_avg_sq"]
    text = render(report)
    assert text.startswith("DeepSpeed universal checkpoint") and "ZeRO-3 runs with load_universal" in text


def test_a_folder_with_latest_and_latest_universal_reads_the_plain_checkpoint(copy_checkpoint, tmp_path: Path) -> None:
    """ds_to_universal's habit: <ckpt>/<tag>_universal and latest_universal beside <ckpt>/latest."""
    checkpoint = copy_checkpoint("z2_fp32_ws2_twotags")
    to_universal(checkpoint, checkpoint)
    assert (checkpoint / "latest_universal").read_text() == "global_step3_universal"
    plain = open_training_state(checkpoint)
    assert not plain.index.universal and plain.index.tag == "global_step3"
    universal = open_training_state(checkpoint, "global_step3_universal")
    assert universal.index.universal and universal.index.source_tag == "global_step3"
    reshard(checkpoint / "global_step3_universal", tmp_path / "r", world_size=3)
    assert (tmp_path / "r" / "latest").read_text() == "global_step3"


def test_nvme_offloaded_checkpoint_converts_like_any_other(tmp_path: Path) -> None:
    """Masters and Adam moments come from offloaded_tensors/ (DeepSpeed's own converter fails)."""
    case = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    to_universal(case.checkpoint, tmp_path / "u")
    folder = _universal_dir(tmp_path / "u")
    live = case.live()
    truth = {p.name for p in open_training_state(tmp_path / "u").params}
    assert truth
    for name in truth:
        assert same_bits(
            load_with_stand_ins(folder / "zero" / name / "fp32.pt").reshape(live[name].shape), live[name].float()
        ), name


# --- bad input ---------------------------------------------------------------------------------
@pytest.fixture
def universal_copy(tmp_path: Path) -> Path:
    out = tmp_path / "u"
    to_universal(sample("z3_bf16_ws3_subgroups_groups").checkpoint, out)
    return out


def _all_commands_refuse(universal: Path, tmp_path: Path, text: str) -> None:
    for command in (
        ["consolidate", universal, tmp_path / "c"],
        ["reshard", universal, tmp_path / "r", "-w", "2"],
        ["to-universal", universal, tmp_path / "v"],
    ):
        result = run_cli(*command, cwd=tmp_path)
        assert result.returncode == 1, (command[0], result.stderr)
        assert text in one_line(result), command[0]
        assert not command[2].exists(), command[0]
    result = run_cli("inspect", universal, cwd=tmp_path)
    assert result.returncode == 3 and "complete       NO" in result.stdout and text in result.stdout


@pytest.mark.slow
def test_missing_state_file_is_named(universal_copy: Path, tmp_path: Path) -> None:
    victim = _universal_dir(universal_copy) / "zero" / "fc1.weight" / "exp_avg_sq.pt"
    victim.unlink()
    _all_commands_refuse(universal_copy, tmp_path, f"{victim}: missing")


@pytest.mark.slow
def test_mis_shaped_state_file_is_named(universal_copy: Path, tmp_path: Path) -> None:
    victim = _universal_dir(universal_copy) / "zero" / "fc2.weight" / "exp_avg.pt"
    torch.save(torch.zeros(5), victim)
    _all_commands_refuse(universal_copy, tmp_path, f"{victim}: holds a tensor of shape [5]")


@pytest.mark.slow
def test_missing_param_folder_and_optimizer_state_are_named(universal_copy: Path, tmp_path: Path) -> None:
    folder = _universal_dir(universal_copy) / "zero" / "norm.weight"
    shutil.rmtree(folder)
    _all_commands_refuse(universal_copy, tmp_path, f"{folder}: missing")
    optimizer_state = _universal_dir(universal_copy) / "zero" / "optimizer_state.pt"
    optimizer_state.unlink()
    _all_commands_refuse(universal_copy, tmp_path, f"{optimizer_state}: missing")


@pytest.mark.slow
def test_truncated_state_file_is_named(universal_copy: Path, tmp_path: Path) -> None:
    victim = _universal_dir(universal_copy) / "zero" / "embed.weight" / "fp32.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    _all_commands_refuse(universal_copy, tmp_path, str(victim))


@pytest.mark.parametrize("args,code,text", [(["--target-stage", "4"], 2, "4")])
def test_bad_options_are_refused(tmp_path: Path, args: list[str], code: int, text: str) -> None:
    result = run_cli("to-universal", sample("z2_fp32_ws1").checkpoint, tmp_path / "out", *args, cwd=tmp_path)
    assert result.returncode == code and text in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_existing_output_needs_overwrite_and_stays_intact(tmp_path: Path) -> None:
    case = sample("z2_fp32_ws2_twotags")
    out = tmp_path / "out"
    to_universal(case.checkpoint, out)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = run_cli("to-universal", case.checkpoint, out, "--target-stage", "3", cwd=tmp_path)
    assert result.returncode == 1 and "already exists" in one_line(result)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot
    result = run_cli("to-universal", case.checkpoint, out, "--target-stage", "3", "--overwrite", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert open_training_state(out).index.zero_stage == 3
    assert sorted(p.name for p in out.iterdir()) == ["global_step3_universal", "latest_universal"]  # no staging left


@pytest.mark.slow
def test_converting_a_universal_folder_onto_itself_is_refused(universal_copy: Path, tmp_path: Path) -> None:
    before = sorted(p.relative_to(universal_copy) for p in universal_copy.rglob("*"))
    result = run_cli("to-universal", universal_copy, universal_copy, "--overwrite", cwd=tmp_path)
    assert result.returncode == 2 and "would replace the input" in one_line(result)
    assert sorted(p.relative_to(universal_copy) for p in universal_copy.rglob("*")) == before


@pytest.mark.slow
def test_damaged_zero_input_leaves_nothing(copy_checkpoint, tmp_path: Path) -> None:
    checkpoint = copy_checkpoint("z3_fp32_ws2_tied_frozen")
    victim = checkpoint / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    result = run_cli("to-universal", checkpoint, tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 1 and str(victim) in one_line(result)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name,target_stage,lost",
    [
        ("z3_fp32_ws2_amsgrad", 3, "max_exp_avg_sq would not be restored"),
        ("z1_bf16_ws2_nadam", 1, "mu_product would not be restored"),
        ("z1_bf16_ws2_nadam", 3, "mu_product would not be restored"),
        ("z3_fp32_ws2_sgd_coupled_wd", 3, "its load fails, this checkpoint holding no exp_avg, exp_avg_sq, step"),
        # DeepSpeed's Muon: the ZeRO-1/2 loader lays its per-param momentum out per element; ZeRO-3's
        # reads no momentum_buffer and needs exp_avg of every param (and a step of every group)
        ("z1_bf16_ws2_muon", 1, "it lays Muon's momentum_buffer out per element of the partition"),
        ("z2_fp32_ws3_muon", 3, "momentum_buffer would not be restored"),
        ("z2_fp32_ws3_muon", 3, "its load fails, this checkpoint holding no exp_avg, exp_avg_sq, step"),
    ],
)
def test_state_loss_is_said_before_writing(name: str, target_stage: int, lost: str, tmp_path: Path) -> None:
    """DeepSpeed's universal loaders restore a fixed set of states (ZeRO-3: fp32, exp_avg,
    exp_avg_sq and a step; ZeRO-1/2: per-element states and the step): a folder that would lose
    another is refused, nothing written, the route that keeps it named; allow_state_loss writes
    it, the result saying what is lost, and inspect says the same beforehand."""
    case = sample(name)
    with pytest.raises(UsageError) as caught:
        to_universal(case.checkpoint, tmp_path / "u", target_stage=target_stage)
    assert lost in str(caught.value) and "zckpt reshard" in str(caught.value), caught.value
    assert not (tmp_path / "u").exists()
    result = to_universal(case.checkpoint, tmp_path / "u", target_stage=target_stage, allow_state_loss=True)
    assert result.loss is not None and lost in result.loss.describe()
    key = "zero3" if target_stage == 3 else "zero1_2"
    assert lost in inspect_path(str(case.checkpoint))["training_state"]["universal_loss"][key]["why"]


@pytest.mark.parametrize("name", ["z3_fp32_ws2_amsgrad", "z3_fp32_ws2_sgd_coupled_wd"])
def test_what_a_zero12_loader_restores_is_written_without_a_word(name: str, tmp_path: Path) -> None:
    """The ZeRO-1/2 loader reads every per-element state file: AMSGrad's third moment and SGD's
    momentum cross into a ZeRO-1/2 run's universal folder whole."""
    result = to_universal(sample(name).checkpoint, tmp_path / "u", target_stage=1)
    assert result.loss is None
    assert inspect_path(str(sample(name).checkpoint))["training_state"]["universal_loss"]["zero1_2"] is None


ZERO12_ALL = "a ZeRO-1/2 run's universal load restores every state"


@pytest.mark.parametrize(
    "name,lines",
    [
        ("z2_fp32_ws1", []),  # Adam: every loader restores it all, nothing said
        # DeepSpeed's CPU Adagrad keeps exp_avg_sq only; torch's Adagrad sum
        ("z2_fp32_ws2_cpuadagrad", [ZERO12_ALL, "a ZeRO-3 run's universal load fails (no exp_avg)"]),
        (
            "z3_fp32_ws2_adagrad",
            [ZERO12_ALL, "a ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq) and would not read sum"],
        ),
        (
            "z3_fp32_ws2_sgd_coupled_wd",
            [
                ZERO12_ALL,
                "a ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq, step) and would not read momentum_buffer",
            ],
        ),
        ("z3_fp32_ws2_amsgrad", [ZERO12_ALL, "a ZeRO-3 run's universal load would lose max_exp_avg_sq"]),
        (
            "z1_bf16_ws2_nadam",
            [
                "a ZeRO-1/2 run's universal load would lose mu_product",
                "a ZeRO-3 run's universal load would lose mu_product",
            ],
        ),
        # BF16_Optimizer keeps Muon's momentum per element, as the loader lays it out; ZeRO-2 does not
        (
            "z1_bf16_ws3_muon_bf16optimizer",
            [
                "a ZeRO-1 BF16_Optimizer run's universal load restores every state",
                "a ZeRO-2 or other ZeRO-1 run's universal load would misread momentum_buffer "
                "(laid out per element of the partition)",
                "a ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq, step) and would not read momentum_buffer",
            ],
        ),
    ],
)
def test_inspect_says_what_each_stages_universal_loader_does(name: str, lines: list[str]) -> None:
    """Once one loader would not restore all of the optimizer state, inspect says what each does
    (so ZeRO-3's failing is not read as ZeRO-1/2's), as to-universal judges it for that stage."""
    shown = render(inspect_path(str(sample(name).checkpoint))).splitlines()
    assert [line.removeprefix("  universal      ") for line in shown if line.startswith("  universal ")] == lines


def test_a_checkpoint_without_optimizer_state(tmp_path: Path) -> None:
    """No per-param state and no step (what torch's SGD without momentum saves; a ZenFlow
    overlap_step run's files, test_zenflow.py): the ZeRO-1/2 loader reads the files a param's
    folder has, so its folder restores the masters; ZeRO-3's wants exp_avg, exp_avg_sq and a step."""
    case = sample("z2_fp32_ws1")
    checkpoint = tmp_path / case.name
    shutil.copytree(case.checkpoint, checkpoint)
    path = checkpoint / case.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    tree = carry(torchfile.load(str(path)))
    tree["optimizer_state_dict"]["base_optimizer_state"]["state"] = {}
    torchsave.save(tree, str(path) + ".new")  # the tensors are read from `path` as it is written
    os.replace(str(path) + ".new", path)
    shown = render(inspect_path(str(checkpoint))).splitlines()
    assert [line.removeprefix("  universal      ") for line in shown if line.startswith("  universal ")] == [
        "a ZeRO-1/2 run's universal load restores the masters; the checkpoint holds no optimizer state",
        "a ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq, step)",
    ]
    assert to_universal(checkpoint, tmp_path / "u2").loss is None
    with pytest.raises(UsageError) as caught:
        to_universal(checkpoint, tmp_path / "u3", target_stage=3)
    assert "its load fails, this checkpoint holding no exp_avg, exp_avg_sq, step" in str(caught.value)


# --------------------------------------------------------------------------------------
# Layouts DeepSpeed's loaders read in one form only: --expert-parallel, --tensor-parallel
# (DeepSpeed loading them: test_interop_universal.py)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,args,text",
    [
        ("z2_fp32_ws1", ["--expert-parallel", "1"], "for mixture-of-experts checkpoints; this one has no experts"),
        ("z2_fp32_ws1", ["--tensor-parallel", "2"], "for tensor-parallel checkpoints; this one has none"),
        ("moe_z2_fp32_ep2_dp2", ["--expert-parallel", "3"], "has 4 experts, which do not divide over 3"),
        ("megatron_z3_fp32_tp2_dp2", [], "--tensor-parallel 1 for a ZeRO-3 run without tensor parallelism"),
        ("megatron_z1_fp32_tp2", ["--stage", "3", "--tensor-parallel", "2"], "`zckpt reshard --stage 3`"),
    ],
    ids=["ep-no-experts", "tp-not-sharded", "ep-not-dividing", "megatron-zero3", "megatron-zero3-tp2"],
)
def test_a_layout_no_loader_reads_is_refused_before_writing(
    name: str, args: list[str], text: str, tmp_path: Path
) -> None:
    result = run_cli("to-universal", sample(name).checkpoint, tmp_path / "out", *args, cwd=tmp_path)
    assert result.returncode == 2 and text in one_line(result)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ep", [1, 4])
def test_moe_folder_for_another_expert_parallel_degree(ep: int, tmp_path: Path) -> None:
    """Each expert param's folder under its local id at degree `ep` holds the experts that rank
    holds there (rows stacked, global expert ``e * 4 // ep + local`` in row e; at 1 the expert
    alone, unmarked), whose masters are the live engine's (the sample's reference); the expert
    group carries the name a run at that degree gives it; zckpt reads the folder back whole."""
    case = sample("moe_z2_fp32_ep2_dp2")
    live = load_file(case.folder / "reference" / "live.safetensors")
    out = tmp_path / "u"
    to_universal(case.checkpoint, out, expert_parallel=ep)
    zero = _universal_dir(out) / "zero"
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    per_rank = 4 // ep
    folders = {p.name for p in zero.iterdir() if p.name.startswith(prefix)}
    leaves = ("0.weight", "0.bias", "2.weight", "2.bias")
    assert folders == {f"{prefix}{local}.{leaf}" for local in range(per_rank) for leaf in leaves}
    for folder in folders:
        local, leaf = folder[len(prefix) :].split(".", 1)
        saved = torch.load(zero / folder / "fp32.pt", weights_only=False)
        rows = [live[f"{prefix}{e * per_rank + int(local)}.{leaf}"] for e in range(ep)]
        if ep == 1:
            assert set(saved) == {"cat_dim", "param"} and same_bits(saved["param"], rows[0]), folder
        else:
            assert saved["is_expert_param"] is True and saved["ep_num_experts"] == ep, folder
            assert same_bits(saved["param"], torch.stack(rows)), folder
    groups = load_with_stand_ins(zero / "optimizer_state.pt")["param_groups"]
    assert [g["name"] for g in groups if g.get("moe")] == [f"ep_size_{ep}"]
    consolidate(case.checkpoint, tmp_path / "a")
    consolidate(out, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(same_bits(b[k], v) for k, v in a.items())


@pytest.mark.parametrize("tensor_parallel", [None, 1], ids=["autotp", "one-tensor-rank"])
def test_autotp_zero3_folder_holds_the_merged_tensors(tensor_parallel: int | None, tmp_path: Path) -> None:
    """An AutoTP ZeRO-3 run's folder: every param's master and moments ds_to_universal's merge of
    the original (the sample's reference); by default in DeepSpeed's dicts of the full-shape
    tensor, of which its ZeRO-3 loader cuts each tensor rank's piece, with the model states' AutoTP
    map; with --tensor-parallel 1 a plain ZeRO-3 model's flat files and the model states of a run
    at one tensor rank (no map of the old ranks' pieces)."""
    case = sample("autotp_z3_bf16_tp2_dp2")
    reference = load_file(case.folder / "reference" / "universal.safetensors")
    out = tmp_path / "u"
    assert to_universal(case.checkpoint, out, tensor_parallel=tensor_parallel).target_stage == 3
    folder = _universal_dir(out)
    names = [k for k in reference if not k.endswith(("exp_avg", "exp_avg_sq"))]
    assert sorted(p.name for p in (folder / "zero").iterdir() if p.is_dir()) == sorted(names)
    for name in names:
        assert sorted(p.name for p in (folder / "zero" / name).iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"]
        for key, stem in (("", "fp32"), (".exp_avg", "exp_avg"), (".exp_avg_sq", "exp_avg_sq")):
            saved = torch.load(folder / "zero" / name / f"{stem}.pt", weights_only=False)
            if tensor_parallel == 1:
                assert same_bits(saved, reference[name + key].reshape(-1)), (name, stem)
            else:
                assert list(saved) == ["cat_dim", "param"] and same_bits(saved["param"], reference[name + key])
    model = load_with_stand_ins(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if tensor_parallel == 1:
        assert "universal_checkpoint_info" not in model and model["checkpoint_parallel_dimensions"]["tp_degree"] == 1
    else:
        assert "affine_map" in model["universal_checkpoint_info"]

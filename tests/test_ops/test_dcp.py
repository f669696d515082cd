"""zckpt to-dcp against facts DeepSpeed wrote, read back with torch's own DCP reader
(``dcp_to_torch_save``, never zckpt): the live engine values captured before each sample was saved
(fp32 masters, frozen params, buffers, Adam moments) and the sample's own files (read with
torch.load: groups, steps, counters, scheduler). FSDP2 resuming the output is in
test_interop_dcp.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zckpt.ops.dcp as dcp_op
from helpers import (
    SAMPLE_LIST,
    Sample,
    assert_same_objects,
    data_records,
    deepspeed_base_state,
    flip,
    load_with_stand_ins,
    one_line,
    record_start,
    run_cli,
    run_zckpt_torchrun,
    same_bits,
    sample,
    tag_files,
)
from zckpt.core.errors import OutputError, UsageError
from zckpt.ops.dcp import TRAIN_STATE_FILE, to_dcp

WITH_LIVE_OPTIMIZER = [s for s in SAMPLE_LIST if (s.folder / "reference" / "live_optimizer.safetensors").exists()]
# the group keys of torch's own AdamW, Adagrad, Muon (what dcp.load into them wants)
TORCH_ADAMW_KEYS = frozenset(torch.optim.AdamW([torch.zeros(1)]).param_groups[0]) - {"params"}
TORCH_ADAGRAD_KEYS = frozenset(torch.optim.Adagrad([torch.zeros(1)]).param_groups[0]) - {"params"}
TORCH_MUON_KEYS = frozenset(torch.optim.Muon([torch.zeros(2, 2)]).param_groups[0]) - {"params"}


def dcp_state_name(case: Sample, key: str) -> str:
    """What to-dcp names DeepSpeed's state `key`: torch's Adagrad's ``sum`` for DeepSpeedCPUAdagrad's
    ``exp_avg_sq`` (what torch's Adagrad, its equivalent, loads); any other as saved."""
    cpu_adagrad = case.optimizer.lower() == "adagrad" and case.cpu_optimizer
    return "sum" if cpu_adagrad and key == "exp_avg_sq" else key


def read_dcp(folder: Path, tmp_path: Path) -> dict:
    """The DCP folder as torch's converter makes it one state dict."""
    target = tmp_path / "dcp.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def saved_files(case: Sample) -> tuple[dict, dict]:
    """DeepSpeed's rank-0 model_states and optimizer state (torch's optimizer state dict inside)."""
    files = tag_files(case.checkpoint)
    model = load_with_stand_ins(next(p for n, p in sorted(files.items()) if n.endswith("model_states.pt")))
    rank0 = load_with_stand_ins(
        next(p for n, p in files.items() if "zero_pp_rank_0_" in n and n.endswith("optim_states.pt"))
    )
    return model, deepspeed_base_state(rank0["optimizer_state_dict"])


def aliases(case: Sample) -> set[str]:
    return set(case.meta.get("tied") or {})


@pytest.mark.parametrize("case", SAMPLE_LIST, ids=lambda s: s.name)
def test_model_holds_the_live_values(case: Sample, tmp_path: Path) -> None:
    """Every name of the module's state dict, tied names both: trainable params as the fp32
    masters, frozen params and buffers as the engine held them (their own dtype), bit for bit."""
    result = to_dcp(case.checkpoint, tmp_path / "dcp")
    assert sorted(result.files) == [".metadata", "__0_0.distcp", TRAIN_STATE_FILE]
    model = read_dcp(tmp_path / "dcp", tmp_path)["model"]
    live = case.live()
    assert sorted(model) == sorted(live)
    for name, truth in live.items():
        assert same_bits(model[name], truth), name


@pytest.mark.parametrize("case", WITH_LIVE_OPTIMIZER, ids=lambda s: s.name)
def test_optimizer_holds_the_live_moments_steps_and_groups(case: Sample, tmp_path: Path) -> None:
    """optim["state"] as get_state_dict keys it: each trainable param under its first name (a tied
    alias has none), its Adam moments equal to the engine's, its step a float32 0-d tensor equal
    to its group's saved step; optim["param_groups"] the saved hyperparameters and member names,
    completed where DeepSpeed's own optimizer ran with the keys of torch's equivalent (FusedAdam,
    DeepSpeedCPUAdam: AdamW or Adam; DeepSpeedCPUAdagrad: Adagrad, its exp_avg_sq as sum; Muon:
    Muon and AdamW)."""
    to_dcp(case.checkpoint, tmp_path / "dcp")
    optim = read_dcp(tmp_path / "dcp", tmp_path)["optim"]
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    trainable = {n.rsplit(".", 1)[0] for n in live_optim} - aliases(case)
    assert set(optim["state"]) == trainable
    for name in trainable:
        names = case.param_state_names(name, live_optim)  # Muon: its group's states
        step = case.counts_steps or (case.muon and "exp_avg" in names)  # Muon's Adam group keeps a step
        expected = {*(dcp_state_name(case, k) for k in names), *case.scalar_names, *(["step"] if step else [])}
        assert set(optim["state"][name]) == expected, name
        for key in names:
            assert same_bits(optim["state"][name][dcp_state_name(case, key)], live_optim[f"{name}.{key}"]), (name, key)
    _, saved = saved_files(case)
    groups = optim["param_groups"]
    section = case.meta["ds_config"].get("optimizer") or {}
    kind, params = section.get("type", "").lower(), section.get("params") or {}
    own_adam = kind in ("adam", "adamw") and not params.get("torch_adam")
    # engine._configure_basic_optimizer: AdamW, or Adam unless adam_w_mode is false, decouples the
    # decay; Muon's Adam half likewise unless adam_w_mode is false
    decoupled = kind == "adamw" or params.get("adam_w_mode", True)
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        ours = {k: v for k, v in group.items() if k != "params"}
        theirs = {k: v for k, v in saved_group.items() if k != "params"}
        assert {k: ours.get(k) for k in theirs} == theirs  # every saved value as saved
        added = {k: v for k, v in ours.items() if k not in theirs}
        if own_adam or (case.muon and not theirs["use_muon"]):
            # FusedAdam, DeepSpeedCPUAdam: completed with the keys torch's AdamW adds (AdamW: decoupled)
            assert set(added) <= TORCH_ADAMW_KEYS, sorted(ours)
            assert ours["decoupled_weight_decay"] is decoupled
        elif case.muon:  # DeepSpeed's muon_update: Nesterov, 5 quintic Newton-Schulz steps, sqrt(max(1, A/B))
            assert set(ours) >= TORCH_MUON_KEYS
            assert added == {
                "nesterov": True,
                "ns_coefficients": (3.4445, -4.775, 2.0315),
                "eps": 1e-7,
                "ns_steps": 5,
                "adjust_lr_fn": None,
            }
        elif kind == "adagrad" and case.cpu_optimizer:  # DeepSpeedCPUAdagrad: no lr decay, the sum from zero
            assert set(ours) >= TORCH_ADAGRAD_KEYS
            assert added == {k: v for k, v in torch.optim.Adagrad([torch.zeros(1)]).defaults.items() if k not in theirs}
            assert added["lr_decay"] == 0 and added["initial_accumulator_value"] == 0
        else:
            assert ours == theirs
    assert sorted(n for g in groups for n in g["params"]) == sorted(trainable)  # each once
    for group, saved_group in zip(groups, saved["param_groups"]):  # one flat param per rank
        if "step" not in saved["state"][saved_group["params"][0]]:  # SGD's, Muon's Muon group
            assert not case.counts_steps
            continue
        step = torch.as_tensor(saved["state"][saved_group["params"][0]]["step"])
        for name in group["params"]:
            value = optim["state"][name]["step"]
            assert value.dtype == torch.float32 and value.shape == () and value.item() == step.item(), name
    if case.meta["param_groups"] == 2 and not case.muon:  # make_sample_ckpts: decay (2-D and up) and no-decay params
        live = case.live()
        assert all(live[n].dim() >= 2 for n in groups[0]["params"])
        assert all(live[n].dim() < 2 for n in groups[1]["params"])


def test_bf16_rounds_only_the_trainable_params(tmp_path: Path) -> None:
    """--dtype bf16: the masters rounded as torch rounds them; frozen params, buffers and the
    optimizer's states as saved."""
    case = sample("z2_bf16_ws2_cpuoffload_frozen")
    to_dcp(case.checkpoint, tmp_path / "dcp", dtype="bf16")
    out = read_dcp(tmp_path / "dcp", tmp_path)
    live = case.live()
    frozen = set(case.meta["frozen"])
    trainable = set(out["optim"]["state"])
    for name, truth in live.items():
        expected = truth.to(torch.bfloat16) if name in trainable else truth
        assert same_bits(out["model"][name], expected), name
    assert frozen and not frozen & trainable
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert all(same_bits(out["optim"]["state"][n]["exp_avg"], live_optim[f"{n}.exp_avg"]) for n in trainable)


@pytest.mark.parametrize("name", ["hf_trainer", "z2_fp16_ws4_tied"])
def test_train_state_json_holds_the_counters_and_scheduler(name: str, tmp_path: Path) -> None:
    case = sample(name)
    to_dcp(case.checkpoint, tmp_path / "dcp")
    state = json.loads((tmp_path / "dcp" / TRAIN_STATE_FILE).read_text())
    model, _ = saved_files(case)
    assert state["format"] == "zckpt-train-state"
    assert state["global_steps"] == model["global_steps"] == case.meta["steps"]
    assert state["global_samples"] == model["global_samples"]
    assert state["skipped_steps"] == model["skipped_steps"] == case.meta["skipped_steps"]
    assert state["torchtitan"] == {"step": model["global_steps"]}
    assert state["lr_scheduler"] == (json.loads(json.dumps(model["lr_scheduler"])) if model["lr_scheduler"] else None)
    assert state["source"]["tag"] == case.meta["tag"] and state["source"]["world_size"] == case.meta["world_size"]
    if case.meta["dtype"] == "fp16":
        assert state["loss_scaler"]["state"]["cur_scale"] == case.meta["final_loss_scale"]


@pytest.mark.heavy
@pytest.mark.slow
def test_memory_holds_one_tensor_not_the_checkpoint(tmp_path: Path) -> None:
    """Python's allocations (numpy's buffers are traced) peak far below the output's size on a
    250 MB checkpoint (measured: 8 MB with direct I/O's two 8 MiB mapped buffers, 67 MB with the
    buffered path's reused 64 MiB one), where torch 2.13's own FileSystemWriter loop keeps every
    tensor of a file until it is done (286 MB here)."""
    import tracemalloc

    train = run_cli(
        *("train", "--out", tmp_path / "ckpt", "--steps", "1", "--layers", "16", "--dim", "256", "--heads", "4"),
        *("--vocab", "16384", "--seq-len", "16", "--micro-batch", "1", "--quiet"),
    )
    assert train.returncode == 0, train.stderr
    plan = dcp_op.plan_dcp(dcp_op.open_training_state(tmp_path / "ckpt"))
    total, largest = sum(t.nbytes for t in plan.tensors), max(t.nbytes for t in plan.tensors)
    assert total > 200e6 and largest < 20e6
    tracemalloc.start()
    try:
        to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.4 * total, f"peak {peak / 1e6:.0f} MB for {total / 1e6:.0f} MB written"


def test_output_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = sample("z1_fp32_ws2_frozen_tied")
    out = tmp_path / "dcp"
    calls = []
    write = dcp_op.write_archives

    def failing(path, plans, reader, progress):  # the disk fills up in the middle of the data file
        def written(nbytes: int) -> None:
            calls.append(nbytes)
            if len(calls) == 5:
                raise OSError(28, "No space left on device")
            progress(nbytes)

        write(path, plans, reader, written)

    monkeypatch.setattr(dcp_op, "write_archives", failing)
    with pytest.raises(OutputError, match="nothing was written"):
        to_dcp(case.checkpoint, out)
    assert len(calls) == 5
    assert sorted(os.listdir(tmp_path)) == []  # no folder, no staging folder, no lock
    monkeypatch.setattr(dcp_op, "write_archives", write)
    to_dcp(case.checkpoint, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    monkeypatch.setattr(dcp_op, "write_archives", failing)
    with pytest.raises(OutputError):
        to_dcp(case.checkpoint, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous output, untouched
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


def test_refusals(tmp_path: Path) -> None:
    case = sample("z2_fp32_ws1")
    (tmp_path / "empty").mkdir()
    to_dcp(case.checkpoint, tmp_path / "empty")  # an empty folder is written into
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        to_dcp(case.checkpoint, tmp_path / "empty")
    with pytest.raises(UsageError, match="inside the input"):
        to_dcp(case.checkpoint, case.checkpoint / "dcp")
    with pytest.raises(UsageError, match="holds the input"):
        to_dcp(case.checkpoint, case.folder, overwrite=True)
    with pytest.raises(UsageError, match="choose fp32, bf16 or fp16"):
        to_dcp(case.checkpoint, tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cli(tmp_path: Path) -> None:
    case = sample("ds14_z2_bf16_ws3_frozen_tied")
    done = run_cli("to-dcp", case.checkpoint, tmp_path / "dcp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote DCP of global_step3 (ZeRO-2, world size 3): ") and "fp32" in done.stdout
    again = run_cli("to-dcp", case.checkpoint, tmp_path / "dcp")
    assert again.returncode == 1 and again.stderr.startswith("zckpt: error: ") and "--overwrite" in again.stderr
    assert run_cli("to-dcp", case.checkpoint, tmp_path / "dcp", "--dtype", "fp8").returncode == 2
    bf16 = run_cli("to-dcp", case.checkpoint, tmp_path / "dcp", "--overwrite", "--dtype", "bf16", "-q")
    assert bf16.returncode == 0 and bf16.stdout == ""


@pytest.mark.slow
def test_damaged_input_is_one_line_and_leaves_nothing(copy_checkpoint, tmp_path: Path) -> None:
    """A tensor record whose bytes no longer match their CRC-32, found while the DCP is written
    (torch's writer wraps the error; the CLI still says the file and the problem)."""
    checkpoint = copy_checkpoint("z2_fp32_ws1")
    victim = next(p for n, p in tag_files(checkpoint).items() if n.endswith("optim_states.pt"))
    info = max(data_records(victim), key=lambda i: i.file_size)
    flip(victim, record_start(victim, info) + info.file_size // 3)
    done = run_cli("to-dcp", checkpoint, tmp_path / "out" / "dcp")
    assert done.returncode == 1, done.stderr
    line = one_line(done)
    assert str(victim) in line and "CRC" in line.upper(), line
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def _generator():
    """scripts/make_sample_ckpts.py (the model and groups every sample trained), imported by path."""
    import importlib.util
    import sys

    from helpers import ROOT

    if "make_sample_ckpts" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_sample_ckpts", ROOT / "scripts" / "make_sample_ckpts.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["make_sample_ckpts"]


def _resume_plain(name: str, folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """README's recipe on the sample's model, unsharded, in one process: the fresh optimizer has
    another lr and weight decay than the run, which the checkpoint's groups replace."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    gen = _generator()
    case = gen.CASES_BY_NAME[name]
    model = gen.build_model(case).float()
    optimizer = torch.optim.AdamW(
        [{"params": g["params"]} for g in gen.param_groups(model, case)]
        if case.groups
        else gen.param_groups(model, case),
        lr=0.5,
        weight_decay=0.25,
    )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    torch.distributed.checkpoint.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return model, optimizer


@pytest.mark.parametrize("name", ["z3_bf16_ws2_nvmeoffload_frozen_tied_groups", "z1_fp32_ws2_frozen_tied"])
def test_torchs_own_calls_resume_it(name: str, tmp_path: Path) -> None:
    """get_state_dict, dcp.load, set_state_dict (FSDP2 at 1-3 ranks: test_interop_dcp.py): the
    module holds the live values, the optimizer the live moments, the saved step and groups."""
    case = sample(name)
    to_dcp(case.checkpoint, tmp_path / "dcp")
    with pytest.warns(UserWarning, match="single process"):
        model, optimizer = _resume_plain(name, tmp_path / "dcp")
    live = case.live()
    state = model.state_dict()
    assert sorted(state) == sorted(live)
    for key, truth in live.items():
        assert same_bits(state[key], truth.float() if truth.is_floating_point() else truth), key
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    names = {p: n for n, p in model.named_parameters()}
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    for param in trainable:
        held = optimizer.state[param]
        assert held["step"].dtype == torch.float32 and held["step"].item() == case.meta["steps"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(held[key], live_optim[f"{names[param]}.{key}"]), (names[param], key)
    saved = [(g["lr"], g["weight_decay"]) for g in saved_files(case)[1]["param_groups"]]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == saved
    assert saved[0] == (1e-2, 0.01)


def test_groups_lacking_a_key_of_the_optimizer_are_refused_by_dcp_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a checkpoint whose groups lack a key torch's AdamW has (DeepSpeed's FusedAdam saves
    no `amsgrad`) is refused by dcp.load, naming the key."""
    import dataclasses

    case = sample("z2_fp32_ws1")
    state = dcp_op.open_training_state(case.checkpoint)
    groups = tuple(
        dataclasses.replace(g, hyperparams={k: v for k, v in g.hyperparams.items() if k != "amsgrad"})
        for g in state.groups
    )
    monkeypatch.setattr(dcp_op, "open_training_state", lambda *_: dataclasses.replace(state, groups=groups))
    to_dcp(case.checkpoint, tmp_path / "dcp")
    with (
        pytest.warns(UserWarning),
        pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\.0\.amsgrad\."),
    ):
        _resume_plain(case.name, tmp_path / "dcp")


@pytest.mark.parametrize(
    "name, reference",
    [
        ("pp2_z1_bf16_dp2", "live"),
        ("moe_z1_bf16_ep2_dp4", "live"),
        ("autotp_z2_bf16_tp2_dp2", "universal"),
        ("megatron_z2_bf16_tp2_dp2", "universal"),
        ("pp2_megatron_z1_fp32_tp2", "universal"),
    ],
)
def test_parallel_layouts_leave_as_the_unsharded_model(name: str, reference: str, tmp_path: Path) -> None:
    """A pipeline, expert or tensor parallel run goes to DCP as the model built on one rank: the
    one-stage names, every expert under its global id, every shard merged (issue 19's readers)."""
    case = sample(name)
    to_dcp(case.checkpoint, tmp_path / "dcp")
    saved = read_dcp(tmp_path / "dcp", tmp_path)
    truth = load_file(case.folder / "reference" / f"{reference}.safetensors")
    model = saved["model"]
    assert sorted(model) == sorted(k for k in truth if not k.endswith((".exp_avg", ".exp_avg_sq")))
    for key, value in model.items():  # frozen params in their saved dtype, the rest fp32
        expected = truth[key].to(value.dtype) if truth[key].is_floating_point() else truth[key]
        assert same_bits(value, expected) and (value.dtype == torch.float32) == (key not in case.meta["frozen"]), key
    if reference == "universal":  # DeepSpeed's merge of the moments too
        for key, state in saved["optim"]["state"].items():
            assert same_bits(state["exp_avg"], truth[f"{key}.exp_avg"]), key


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_torchrun_processes_share_the_tensors(processes: int, tmp_path: Path) -> None:
    """Under torchrun each process writes its share into its own ``__<rank>_0.distcp`` (torch's
    name for a rank's file) and process 0 the metadata: torch's reader gives the live values,
    and the same state dict as one process's output."""
    case = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    result = run_zckpt_torchrun("to-dcp", str(case.checkpoint), str(tmp_path / "many"), processes=processes)
    assert result.stdout.count("wrote DCP of") == 1, result.stdout
    files = sorted(os.listdir(tmp_path / "many"))
    assert files == [".metadata", *(f"__{p}_0.distcp" for p in range(processes)), TRAIN_STATE_FILE]
    sizes = [os.path.getsize(tmp_path / "many" / f"__{p}_0.distcp") for p in range(processes)]
    assert min(sizes) > 0.2 * max(sizes)  # shared by size
    to_dcp(case.checkpoint, tmp_path / "one")
    (tmp_path / "read_many").mkdir()
    (tmp_path / "read_one").mkdir()
    many = read_dcp(tmp_path / "many", tmp_path / "read_many")
    one = read_dcp(tmp_path / "one", tmp_path / "read_one")
    assert_same_objects(many, one)
    live = case.live()
    for name, truth in live.items():
        assert same_bits(many["model"][name], truth), name
    assert (tmp_path / "many" / TRAIN_STATE_FILE).read_text() == (tmp_path / "one" / TRAIN_STATE_FILE).read_text()


@pytest.mark.slow
def test_torchrun_job_refused_leaves_the_output_and_every_process_says_why(tmp_path: Path) -> None:
    case = sample("z1_fp32_ws2_frozen_tied")
    out = tmp_path / "dcp"
    to_dcp(case.checkpoint, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_zckpt_torchrun("to-dcp", str(case.checkpoint), str(out), processes=2, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("zckpt: error:")]
    assert sorted(errors) == [
        f"zckpt: error: {out}: already exists; pass --overwrite to replace it",
        f"zckpt: error: {out}: another process of this job failed (its own error says why); the previous output is kept",
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # no staging folder, no lock


@pytest.mark.parametrize(
    "optimizer, mode",
    [
        ({"type": "AdamW", "params": {"lr": 1e-3}}, True),  # FusedAdam(adam_w_mode=True)
        ({"type": "Adam", "params": {"lr": 1e-3}}, True),  # DeepSpeed's Adam decouples unless told not to
        ({"type": "Adam", "params": {"adam_w_mode": False}}, False),
        ({"type": "adamw", "params": {"adam_w_mode": False}}, True),  # type AdamW wins (engine.py)
        ({"type": "AdamW", "params": {"torch_adam": True}}, None),  # torch's own: its groups are complete
        ({"type": "Lamb", "params": {}}, None),
        (None, None),  # a client optimizer
    ],
)
def test_deepspeeds_own_adam_groups_get_torchs_other_keys(optimizer: dict | None, mode: bool | None) -> None:
    """engine._configure_basic_optimizer (0.19.8): FusedAdam/DeepSpeedCPUAdam groups hold lr,
    bias_correction, betas, eps, weight_decay (and step); torch's AdamW wants its own keys too."""
    from zckpt.deepspeed.optimizers import deepspeed_adam_w_mode
    from zckpt.ops.dcp import torch_adam_group

    config = {"optimizer": optimizer} if optimizer else {}
    assert deepspeed_adam_w_mode(config) is mode
    saved = {"lr": 0.01, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "step": 0}
    group = torch_adam_group(saved, mode)
    if mode is None:
        assert group == saved
        return
    assert group == {
        **saved,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": mode,
    }
    # every key of torch's own AdamW (or Adam) groups is there
    import torch

    fresh = (torch.optim.AdamW if mode else torch.optim.Adam)([torch.nn.Parameter(torch.zeros(1))])
    assert set(fresh.param_groups[0]) - {"params", "initial_lr"} <= set(group)


CPU_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize(
    "config, kind",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "adam"),  # FusedAdam
        ({"optimizer": {"type": "Adam", "params": {}}, **CPU_OFFLOAD}, "adam"),  # DeepSpeedCPUAdam
        ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, None),
        ({"optimizer": {"type": "Adagrad", "params": {}}}, None),  # torch's Adagrad
        ({"optimizer": {"type": "Adagrad", "params": {}}, **CPU_OFFLOAD}, "cpu_adagrad"),
        (
            {"optimizer": {"type": "Adagrad"}, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            "cpu_adagrad",
        ),
        ({"optimizer": {"type": "Lion", "params": {}}, **CPU_OFFLOAD}, "lion"),
        ({"optimizer": {"type": "Muon", "params": {}}}, "muon"),
        ({"optimizer": {"type": "SGD", "params": {}}, **CPU_OFFLOAD}, None),
        ({}, None),  # a client optimizer
    ],
)
def test_which_of_deepspeeds_own_optimizers_ran(config: dict, kind: str | None) -> None:
    """engine._configure_basic_optimizer (0.19.8): which optimizer the config made, so to-dcp
    completes its groups with the keys of torch's equivalent (dcp.load wants them all)."""
    from zckpt.deepspeed.optimizers import deepspeed_own_optimizer
    from zckpt.ops.dcp import torch_group

    assert deepspeed_own_optimizer(config) == kind
    if kind == "cpu_adagrad":  # DeepSpeedCPUAdagrad's saved group: torch's Adagrad's keys added
        group = torch_group({"lr": 0.01, "eps": 1e-10, "weight_decay": 0.0, "amsgrad": False}, config)
        assert set(group) >= TORCH_ADAGRAD_KEYS and group["lr_decay"] == 0 and group["amsgrad"] is False
    if kind == "muon":  # MuonWithAuxAdam: the Muon half gets torch's Muon keys, the Adam half AdamW's
        muon = {"use_muon": True, "name": "muon-params", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
        assert set(torch_group(muon, config)) >= TORCH_MUON_KEYS
        adam = {"use_muon": False, "lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
        assert set(torch_group(adam, config)) >= TORCH_ADAMW_KEYS
        assert torch_group(adam, config)["decoupled_weight_decay"] is True
        config["optimizer"]["params"]["adam_w_mode"] = False
        assert torch_group(adam, config)["decoupled_weight_decay"] is False


@pytest.mark.parametrize(
    "name", ["z3_bf16_ws2_nvmeoffload_frozen_tied_groups", "z2_bf16_ws3_frozen_groups", "moe_z1_bf16_ep2_dp4"]
)
def test_metadata_and_archives_are_what_torchs_own_save_writes(name: str, tmp_path: Path) -> None:
    """zckpt writes ``.metadata`` itself (torch is not imported): torch's own ``dcp.save`` of the
    same state dict, in memory, writes the same metadata (every item's properties, shape, chunk,
    path) and, item by item, the same archive bytes (but torch's random serialization ids)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from helpers import same_except_serialization_id
    from zckpt.deepspeed.reader import open_training_state
    from zckpt.io.reading import FileReader

    case = sample(name)
    to_dcp(case.checkpoint, tmp_path / "ours")
    with FileReader() as reader:
        state = dcp_op.torch_state_dict(dcp_op.plan_dcp(open_training_state(case.checkpoint)), reader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=tmp_path / "torch", no_dist=True)
    ours, theirs = (FileSystemReader(tmp_path / n).read_metadata() for n in ("ours", "torch"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)  # the order dcp_to_torch_save gives
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version
    assert ours.storage_meta.checkpoint_id == str(tmp_path / "ours") and len(ours.storage_meta.save_id) == 36
    assert set(ours.storage_data) == set(theirs.storage_data)
    for index, place in ours.storage_data.items():
        other = theirs.storage_data[index]
        for folder, where, target in (("ours", place, "a.pt"), ("torch", other, "b.pt")):
            with open(tmp_path / folder / where.relative_path, "rb") as handle:
                handle.seek(where.offset)
                (tmp_path / target).write_bytes(handle.read(where.length))
        same_except_serialization_id(tmp_path / "a.pt", tmp_path / "b.pt")


def test_flatten_is_torchs() -> None:
    """The param groups' values are stored under the names and paths torch's own flattening gives
    (lists holding dicts entered, lists of plain values kept whole, empty dicts gone)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from zckpt.torchfile.dcp_metadata import flatten

    state = {
        "optim": {
            "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"], "nested": [[1, 2], [3]]},
                {"lr": 0.2, "extra": {"x": 1, "empty": {}}, "mixed": [1, {"y": 2}], "none": None, "e": []},
            ],
            "state": {},
        },
        7: "seven",
    }
    flat, mapping = flatten_state_dict(state)
    ours = list(flatten(state, lambda v: False))
    assert [".".join(map(str, path)) for path, _ in ours] == list(flat)
    assert {".".join(map(str, path)): value for path, value in ours} == flat
    assert {".".join(map(str, path)): path for path, _ in ours} == mapping

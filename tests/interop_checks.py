"""What the interop tests judge DeepSpeed's loads by: a loaded engine's state against the live
run's values, a resumed run against the saved one, and the generator of fresh cases. Kept apart
from :mod:`interop_helpers` (the pytest plugin and launch helpers, stdlib and pytest only), which
.ci/run also imports to find and clean DeepSpeed's build and shm folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers import Sample, same_bits
from interop_helpers import sample_generator
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader


def _check_loaded(case: Sample, live: dict, optim: dict, state: dict, world_size: int, stage: int) -> None:
    """What DeepSpeed holds after load_checkpoint equals what the original engine held."""
    from safetensors.torch import load_file

    assert (state["world_size"], state["zero_stage"]) == (world_size, stage)
    meta = case.meta
    for name, expected in case.live().items():
        if name in meta["buffers"] and meta["deepspeed_version"].startswith("0.14"):
            expected, got = (
                expected.float() if expected.is_floating_point() else expected,
                live[name].float() if live[name].is_floating_point() else live[name],
            )
            assert same_bits(got, expected), name
        else:
            assert same_bits(live[name], expected), name
    optim_file = case.folder / "reference" / "live_optimizer.safetensors"
    if optim_file.exists():
        for name, expected in load_file(optim_file).items():
            assert same_bits(optim[name], expected), name
    original = open_training_state(case.checkpoint)
    assert (state["global_steps"], state["skipped_steps"], state["global_samples"]) == (
        original.global_steps,
        original.skipped_steps,
        original.global_samples,
    )
    if case.counts_steps:  # torch's SGD keeps no step
        with FileReader() as reader:
            # a torch optimizer's step is a tensor, DeepSpeed's own optimizers' a Python int
            steps = [
                s.value if s.tensor is None else read_tensor(reader, s.tensor).item()
                for s in (g.scalars["step"] for g in original.groups)
            ]
        assert [set(g["step"]) for g in state["param_groups"]] == [{s} for s in steps]
    for group, saved in zip(state["param_groups"], original.groups):
        assert group["hyperparameters"]["lr"] == saved.hyperparams["lr"]
        assert group["hyperparameters"]["weight_decay"] == saved.hyperparams["weight_decay"]
    if meta["dtype"] == "fp16":
        scaler = state["loss_scaler"]
        expected = {k: v for k, v in vars(original.loss_scaler).items() if isinstance(v, (int, float, bool))}
        if state["zero_stage"] == 0:  # FP16_UnfusedOptimizer keeps no hysteresis: the fields it has
            expected = {k: v for k, v in expected.items() if k in scaler}
            assert len(expected) == 7, expected
        for key, value in expected.items():
            assert scaler[key] == value, key
    assert state["lr_scheduler"] == original.lr_scheduler


GEN = sample_generator()


def _plain(value: Any) -> Any:
    """A JSON-like rendering (tuples as lists, 0-dim tensors as numbers), as ds_probe dumps state."""
    if torch.is_tensor(value) and value.numel() == 1 and value.dim() == 0:
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _saved(checkpoint: Path, tag: str | None = None) -> dict[str, Any]:
    """Rank 0's model_states and optim_states of a DeepSpeed checkpoint (any stage, BF16_Optimizer
    included): counters, lr scheduler, loss scaler, per-group hyperparameters, Adam steps."""
    tag = tag or (checkpoint / "latest").read_text().strip()
    folder = checkpoint / tag
    model_file = next(
        f
        for f in (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", folder / "mp_rank_00_model_states.pt")
        if f.exists()
    )
    optim_file = next(
        f
        for f in (
            folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        )
        if f.exists()
    )
    model = torch.load(model_file, map_location="cpu", weights_only=False)
    optim = torch.load(optim_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    base = optim["base_optimizer_state"] if "base_optimizer_state" in optim else optim["optimizer_state_dict"]
    return {
        "global_steps": model["global_steps"],
        "skipped_steps": model["skipped_steps"],
        "global_samples": model["global_samples"],
        "lr_scheduler": _plain(model["lr_scheduler"]),
        "loss_scaler": optim.get("loss_scaler"),
        "dynamic_loss_scale": optim.get("dynamic_loss_scale"),
        "steps": {_plain(s["step"]) for s in base["state"].values() if "step" in s},  # Muon's Muon group keeps none
        "hyperparameters": [_plain({k: v for k, v in g.items() if k != "params"}) for g in base["param_groups"]],
    }


def _fresh_buffers(case: Any) -> dict[str, torch.Tensor]:
    """The buffers of the model as the probe builds it before any load (make_sample_ckpts' seed)."""
    return {n: b.detach().clone() for n, b in GEN.build_model(case).named_buffers()}


def _check_resumed(
    case: Sample,
    spec: Any,
    live: dict,
    optim: dict,
    state: dict,
    *,
    world_size: int,
    stage: int,
    universal: bool,
    expected_optim: dict | None = None,
) -> None:
    """What DeepSpeed holds after the load equals what the original engine held when it saved.

    ``universal``: the load went through ``load_universal`` (module state dict not loaded: frozen
    params and buffers are the fresh model's; ZeRO-3's loader spreads group 0's hyperparameters).
    ``expected_optim``: the Adam states to expect, where the sample has no live_optimizer file."""
    from safetensors.torch import load_file

    meta = case.meta
    assert (state["world_size"], state["zero_stage"], state["dtype"]) == (world_size, stage, meta["dtype"])
    if universal:
        assert state["ds_config"]["checkpoint"]["load_universal"] is True
        assert Path(state["load_path"]).parent.name.endswith("_universal"), state["load_path"]
    saved_live = case.live()
    buffers = set(meta["buffers"])
    fresh = _fresh_buffers(spec) if universal else {}
    for name, expected in saved_live.items():
        if name in buffers:
            if universal:  # not restored by DeepSpeed's universal loader: the fresh model's values
                assert same_bits(live[name], fresh[name].to(live[name].dtype)), name
            elif meta["deepspeed_version"].startswith("0.14"):
                got = live[name].float() if live[name].is_floating_point() else live[name]
                assert same_bits(got, expected.float() if expected.is_floating_point() else expected), name
            else:
                assert same_bits(live[name], expected), name
        else:  # trainable: the fp32 master; frozen: its value (never trained, so also the fresh one)
            assert same_bits(live[name], expected), name
    assert set(live) == set(saved_live)
    if expected_optim is None:
        expected_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert set(optim) == set(expected_optim)
    for name, expected in expected_optim.items():
        assert same_bits(optim[name], expected), name

    saved = _saved(case.checkpoint, meta["tag"])
    assert (state["global_steps"], state["skipped_steps"], state["global_samples"]) == (
        saved["global_steps"],
        saved["skipped_steps"],
        saved["global_samples"],
    )
    assert saved["global_steps"] == meta["steps"]
    assert len(saved["steps"]) == 1  # every group stepped as often (no group skipped a step)
    assert all(
        s in saved["steps"] or (s is None and group.get("use_muon"))  # Muon's Muon group keeps no step
        for g, group in zip(state["param_groups"], saved["hyperparameters"])
        for s in g["step"]
    ), [g["step"] for g in state["param_groups"]]
    assert len(state["param_groups"]) == len(saved["hyperparameters"])
    for i, group in enumerate(state["param_groups"]):
        expected_hyper = saved["hyperparameters"][0 if (universal and stage == 3) else i]
        for key, value in expected_hyper.items():
            assert group["hyperparameters"][key] == value, (i, key)
    assert state["lr_scheduler"] == saved["lr_scheduler"]
    if meta["dtype"] == "fp16":
        assert state["cur_scale"] == meta["final_loss_scale"]
        scaler = state["loss_scaler"]
        assert scaler["type"].endswith(type(saved["loss_scaler"]).__name__)
        for key, value in vars(saved["loss_scaler"]).items():
            if isinstance(value, (int, float, bool)):
                assert scaler[key] == value, key
        assert state["dynamic_loss_scale"] == saved["dynamic_loss_scale"]


FRESH = GEN.Case(
    "fresh_uc_z3_bf16_ws3_subgroups_groups_tied_frozen_sched",
    "ds19",
    3,
    "bf16",
    3,
    tied=True,
    frozen=True,
    groups=True,
    sub_group_size=300,
    scheduler=True,
    vocab=31,
    dim=41,
    hidden=13,
    seed=11,
)


DS_TO_UNIVERSAL = r"""
import contextlib, io, json, sys, traceback
from argparse import Namespace
from deepspeed.checkpoint import ds_to_universal as D
jobs = json.loads(sys.argv[1])
results = {}
for name, (input_folder, output_folder) in jobs.items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            D.main(Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=1,
                             num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
        results[name] = None
    except BaseException as exc:
        results[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
print("RESULTS " + json.dumps(results))
"""

"""Interop with real DeepSpeed: fresh checkpoints, with model sizes and seeds that are not in the
repository, consolidated by zckpt and compared with DeepSpeed's zero_to_fp32.py and the live
engine, bit for bit. Needs DeepSpeed installed in this interpreter; skipped otherwise.

Run: ``python -m pytest -m deepspeed`` (about 20 s per case on 2 cores). Set
``ZCKPT_INTEROP_DS14_PYTHON`` to an interpreter with DeepSpeed 0.14 to add cases written by it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import Sample, load_output, same_bits
from zckpt import consolidate, inspect_path

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import extensions_for, sample_generator  # noqa: E402

GEN = sample_generator()
SIZES = {"vocab": 29, "dim": 43, "hidden": 17, "seed": 7}
CASES = [
    GEN.Case("fresh_z1_bf16_ws3_tied_frozen", "ds19", 1, "bf16", 3, tied=True, frozen=True, **SIZES),
    GEN.Case("fresh_z2_fp16_ws2_groups_frozen", "ds19", 2, "fp16", 2, groups=True, frozen=True, **SIZES),
    GEN.Case(
        "fresh_z3_bf16_ws3_subgroups_tied_frozen",
        "ds19",
        3,
        "bf16",
        3,
        tied=True,
        frozen=True,
        sub_group_size=300,
        **SIZES,
    ),
]
DS14_PYTHON = os.environ.get("ZCKPT_INTEROP_DS14_PYTHON")
if DS14_PYTHON:
    CASES += [
        GEN.Case("fresh14_z1_bf16_ws3_bf16optimizer", "ds14", 1, "bf16", 3, frozen=True, grad_accum_fp32=True, **SIZES),
        GEN.Case("fresh14_z3_fp16_ws3_subgroups_tied", "ds14", 3, "fp16", 3, tied=True, sub_group_size=300, **SIZES),
        GEN.Case("fresh14_z2_fp32_ws4_groups_frozen", "ds14", 2, "fp32", 4, groups=True, frozen=True, **SIZES),
    ]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Sample]:
    root = tmp_path_factory.mktemp("fresh")
    made = {}
    for case in CASES:
        pythons = {"ds19": sys.executable, "ds14": DS14_PYTHON or sys.executable}
        GEN.generate(case, root, pythons, root, extensions=extensions_for(pythons))
        made[case.name] = Sample(case.name, root / case.name, json.loads((root / case.name / "meta.json").read_text()))
    return made


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_fresh_checkpoint_matches_deepspeed(fresh: dict[str, Sample], tmp_path: Path, name: str) -> None:
    case = fresh[name]
    consolidate(case.checkpoint, tmp_path / "out")
    ours = load_output(tmp_path / "out")
    if case.has_reference:
        for tensor_name, tensor in case.reference().items():
            assert same_bits(ours[tensor_name], tensor), tensor_name
    for tensor_name, tensor in case.live().items():
        expected = tensor.float() if tensor.is_floating_point() else tensor
        assert same_bits(ours[tensor_name], expected), tensor_name
    report = inspect_path(str(case.checkpoint))
    spec = next(c for c in CASES if c.name == name)
    assert report["complete"] and report["zero_stage"] == spec.stage and report["world_size"] == spec.world_size
    assert report["dtype"] == spec.dtype and sorted(report["frozen"]) == sorted(case.meta["frozen"])
    assert report["tied"] == case.meta["tied"]


def test_cases_are_not_the_bundled_ones() -> None:
    bundled = {(c.vocab, c.dim, c.hidden, c.seed) for c in GEN.CASES}
    assert all((c.vocab, c.dim, c.hidden, c.seed) not in bundled for c in CASES)
    assert all(dataclasses.replace(c).name not in GEN.CASES_BY_NAME for c in CASES)


# --- reshard: real DeepSpeed loads zckpt's output at a new world size / stage ---------------------
from helpers import sample  # noqa: E402
from interop_checks import _check_loaded  # noqa: E402
from interop_helpers import needs_built_op, run_probe, shm_leak_safety_net  # noqa: E402,F401 (autouse fixture)
from zckpt import reshard  # noqa: E402

RESHARD_CASES = [  # (sample, world size, stage): odd sizes, every stage change, fp16 scaler, 0.14 format
    ("z2_fp16_ws4_tied", 3, 2),
    ("z2_fp16_ws4_tied", 1, 3),
    ("z3_bf16_ws3_subgroups_groups", 2, 3),
    ("z3_bf16_ws3_subgroups_groups", 4, 1),
    ("z3_fp16_ws4_subgroups_frozen", 3, 2),
    ("z1_fp32_ws2_frozen_tied", 3, 3),
    ("ds14_z2_bf16_ws3_frozen_tied", 2, 2),
    ("z1_bf16_ws3_bf16optimizer_frozen", 2, 1),
    ("hf_trainer", 3, 2),
    ("z1_fp32_ws2_roundrobin", 3, 1),
    ("z0_fp32_ws2_tied", 3, 1),  # ZeRO-0: the torch optimizer's state, saved by index, named and laid out
    ("z0_fp32_ws2_tied", 1, 3),
    ("z0_bf16_ws2_tied", 3, 1),  # a 16-bit ZeRO-0 run: FP16_UnfusedOptimizer's fp32 masters beside its state
    ("z0_bf16_ws2_tied", 1, 3),
    ("z0_fp16_ws2", 3, 2),  # and its dynamic loss scaler's values, into DeepSpeed's DynamicLossScaler
    # coupled weight decay: nonzero optimizer state in ZeRO-3's padding, a valid checkpoint
    ("z3_fp32_ws2_sgd_coupled_wd", 3, 3),  # SGD: momentum_buffer only, no step
    ("z3_bf16_ws3_adam_coupled_wd", 2, 1),
    # checkpoint_serialization false: legacy (non-zip) rank files in, zip files out
    ("z2_bf16_ws2_legacy_serialization", 1, 3),  # (one rank: what is read is the point, and it loads 4x faster)
    ("z3_fp32_ws2_legacy_serialization", 1, 1),
    # DeepSpeed's Muon: a Muon group's momentum_buffer holds the full momentum of each param a
    # ZeRO-1/2 partition touches, re-laid for the new partitions
    ("z1_bf16_ws2_muon", 3, 2),  # z2_fp32_ws3_muon at 2 ranks: test_muon_reshard_loads_and_trains_on
    ("z3_bf16_ws2_muon", 3, 2),  # ZeRO-3's per-element momentum laid out per whole param
    ("z1_bf16_ws3_muon_bf16optimizer", 2, 1),  # BF16_Optimizer's: per element of the partition
    ("z2_fp32_ws3_muon_cpuoffload", 2, 1),  # an offloaded optimizer's: per element too
    # one sample per optimizer family: each one's states (and a DeepSpeed optimizer's integer step)
    ("z3_fp32_ws2_adagrad", 1, 1),  # torch's Adagrad: sum (one rank: the cheapest load that re-lays every state)
    ("z2_bf16_ws2_radam", 1, 3),
    ("z1_fp32_ws3_adamax", 2, 2),  # exp_inf, eps in ZeRO-1/2's padding (zckpt writes zeros there)
    ("z3_bf16_ws2_rmsprop_centered", 1, 2),  # square_avg, momentum_buffer, grad_avg
    ("z1_bf16_ws2_fusedadam", 1, 3),
    ("z3_bf16_ws2_cpuadam", 3, 2),  # DeepSpeedCPUAdam, the optimizer offloaded at both ends
    ("z2_fp32_ws2_cpuadagrad", 3, 3),  # DeepSpeedCPUAdagrad: exp_avg_sq
    ("z2_bf16_ws2_cpulion", 3, 1),  # DeepSpeedCPULion: exp_avg (and its unused exp_avg_sq)
]


@pytest.mark.parametrize(
    "name,world_size,stage",
    [pytest.param(n, w, st, id=f"{n}-ws{w}-z{st}", marks=needs_built_op(n)) for n, w, st in RESHARD_CASES],
)
def test_deepspeed_loads_resharded_sample(name: str, world_size: int, stage: int, tmp_path: Path) -> None:
    case = sample(name)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    _check_loaded(case, live, optim, state, world_size, stage)


@pytest.mark.parametrize("name", ["z0_fp32_ws2_tied", "z0_fp16_ws2"])
def test_deepspeed_resumes_zero0_files_at_another_data_parallel_size_as_they_are(tmp_path: Path, name: str) -> None:
    """Why reshard asks a ZeRO-0 checkpoint for --stage: DeepSpeed's own load of ZeRO-0 files (the module
    and the torch optimizer's state, by index) does not depend on the data-parallel size. For the fp16
    run, the loss scaler DeepSpeed restores from them is the one zckpt writes into ZeRO files (checked
    field by field against the training state zckpt reads)."""
    case = sample(name)
    live, optim, state = run_probe(case.name, case.checkpoint, 3, tmp_path / "probe")
    _check_loaded(case, live, optim, state, 3, 0)


def test_deepspeed_loads_nvme_offloaded_sample_resharded_without_nvme(tmp_path: Path) -> None:
    """offloaded_tensors/ read, plain files written for a 3-rank run that offloads to CPU."""
    name = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"
    no_nvme = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    reshard(sample(name).checkpoint, tmp_path / "out", world_size=3, config=no_nvme)
    # the same model, groups and sub-groups, in a run whose optimizer state lives in CPU memory
    spec = dataclasses.replace(GEN.CASES_BY_NAME[name], zero_extra=(), config_extra=())
    live, optim, state = run_probe(spec, tmp_path / "out", 3, tmp_path / "probe", config_override=no_nvme)
    _check_loaded(sample(name), live, optim, state, 3, 3)


@pytest.mark.parametrize("name,world_size,stage", [(CASES[0].name, 2, 3), (CASES[1].name, 3, 1), (CASES[2].name, 1, 2)])
def test_deepspeed_loads_resharded_fresh_checkpoint(
    fresh: dict[str, Sample], name: str, world_size: int, stage: int, tmp_path: Path
) -> None:
    """Checkpoints made now with sizes and seeds not in the repository."""
    case = fresh[name]
    spec = next(c for c in CASES if c.name == name)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(spec, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    _check_loaded(case, live, optim, state, world_size, stage)


EXCLUDED = GEN.Case(
    "fresh_z2_bf16_ws2_frozen_excluded", "ds19", 2, "bf16", 2, frozen=True, exclude_frozen=True, **SIZES
)


def test_deepspeed_loads_a_reshard_of_a_run_saved_without_its_frozen_params(tmp_path: Path) -> None:
    """save_checkpoint(exclude_frozen_parameters=True) records no frozen params (None), so that a
    load keeps the model's own (the Trainer saves PEFT runs so). zckpt once wrote an empty record
    instead, and DeepSpeed's load looked every frozen param up in it: KeyError."""
    pythons = {"ds19": sys.executable}
    GEN.generate(EXCLUDED, tmp_path, pythons, tmp_path, extensions=extensions_for(pythons))
    case = Sample(
        EXCLUDED.name, tmp_path / EXCLUDED.name, json.loads((tmp_path / EXCLUDED.name / "meta.json").read_text())
    )
    model = torch.load(case.checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["frozen_param_shapes"] is None and not set(case.meta["frozen"]) & set(model["module"])
    reshard(case.checkpoint, tmp_path / "out", world_size=3, stage=3)
    live, optim, state = run_probe(EXCLUDED, tmp_path / "out", 3, tmp_path / "probe", stage=3)
    _check_loaded(case, live, optim, state, 3, 3)  # the frozen params: the model's own, as trained (never changed)


def test_muon_reshard_loads_and_trains_on(tmp_path: Path) -> None:
    """DeepSpeed's Muon: a 3-rank ZeRO-2 run (two params cut between ranks, each of whose full
    momentum two ranks hold) resharded to 2 ranks at ZeRO-1. DeepSpeed loads every master, Adam
    moment and Muon momentum as the live engine held them, each rank's momentum_buffer the full
    momenta of the params its new partition touches; the step after the load runs (a buffer laid
    out otherwise is narrowed past its end or misread there) and advances the counters."""
    case = sample("z2_fp32_ws3_muon")
    reshard(case.checkpoint, tmp_path / "out", world_size=2, stage=1)
    live, optim, state = run_probe(case.name, tmp_path / "out", 2, tmp_path / "probe", stage=1, train_steps=1)
    _check_loaded(case, live, optim, state, 2, 1)
    assert not state.get("cross_checks", {}).get("muon_copy_disagreements")
    train = state["train"]
    assert train["global_steps_after"] == case.meta["steps"] + 1 and all(math.isfinite(x) for x in train["losses_mean"])


def test_muon_reshard_to_zero3_loads_and_trains_on(tmp_path: Path) -> None:
    """ZeRO-3 keeps Muon's momentum per element of each sub-group partition (stage3.py
    _create_momentum_buffer, _muon_update_sub_group), as exp_avg is: the ZeRO-2 run's full
    momenta, cut so, load in a 2-rank ZeRO-3 run (reduce_scatter off: DeepSpeed refuses Muon
    with it) with every master and state as the live engine held them, and a step runs on."""
    case = sample("z2_fp32_ws3_muon")
    no_reduce_scatter = {"zero_optimization": {"reduce_scatter": False}}
    reshard(case.checkpoint, tmp_path / "out", world_size=2, stage=3, config=no_reduce_scatter)
    live, optim, state = run_probe(
        case.name, tmp_path / "out", 2, tmp_path / "probe", stage=3, train_steps=1, config_override=no_reduce_scatter
    )
    _check_loaded(case, live, optim, state, 2, 3)
    train = state["train"]
    assert train["global_steps_after"] == case.meta["steps"] + 1 and all(math.isfinite(x) for x in train["losses_mean"])


def test_muon_reshard_into_a_run_offloading_its_optimizer(tmp_path: Path) -> None:
    """A Muon run without offload (momentum per whole param) resharded for a 2-rank ZeRO-2 run that
    offloads its optimizer to CPU, which keeps the momentum per element of the partition (and would
    replace a buffer of another size by zeros): DeepSpeed holds every state as live, and trains on."""
    case = sample("z2_fp32_ws3_muon")
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
    reshard(case.checkpoint, tmp_path / "out", world_size=2, stage=2, config=offload)
    live, optim, state = run_probe(
        case.name, tmp_path / "out", 2, tmp_path / "probe", stage=2, train_steps=1, config_override=offload
    )
    _check_loaded(case, live, optim, state, 2, 2)
    assert state["train"]["global_steps_after"] == case.meta["steps"] + 1


def test_resharded_run_continues_like_the_original(tmp_path: Path) -> None:
    """global_step2 of a 2-rank ZeRO-2 run, resharded to 3 ranks at ZeRO-3, then one more step:
    the step counter advances from the saved one and the loss is finite (a continuation, not a
    restart; bit equality with the 2-rank run is not expected: 3 ranks see other data)."""
    case = sample("z2_fp32_ws2_twotags")
    reshard(case.checkpoint, tmp_path / "out", world_size=3, stage=3, tag="global_step2")
    _, _, state = run_probe(case.name, tmp_path / "out", 3, tmp_path / "probe", stage=3, train_steps=1)
    assert state["global_steps"] == 2 and all(s == 2.0 for g in state["param_groups"] for s in g["step"])
    train = state["train"]
    assert train["global_steps_after"] == 3 and all(math.isfinite(x) for x in train["losses_mean"])

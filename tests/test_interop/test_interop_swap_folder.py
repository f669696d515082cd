"""Real DeepSpeed resumes the state zckpt recovers from a live ZeRO-Infinity swap folder.

Two sources of truth, both the engine's own values at the moment the swap folder was copied:
the bundled sample `z3_bf16_ws2_nvme_live_swap`, and a fresh NVMe run made here (another seed
and sizes, DeepSpeed's real 1 MiB swap threshold, so it is not in the repository). The
recovered state is written for 3 ranks (``zckpt reshard --swap-folder`` and ``zckpt
to-universal --swap-folder``) and loaded by a 3-rank DeepSpeed run whose optimizer lives in CPU
memory (ds_probe does not run NVMe cases); its fp32 masters and Adam moments must equal the
truth bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import Sample, run_cli, same_bits, sample
from zckpt.ops import api
from zckpt.ops.inspect import inspect_path

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    extensions_for,
    run_probe,
    sample_generator,
    shm_leak_safety_net,
)

GEN = sample_generator()
NO_NVME = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
# Real thresholds: fc1.weight and fc2.weight (64 x 16500) give 528000 elements per rank, over
# 1 MiB as bf16 (16-bit param swaps) and as fp32 (swapped optimizer sub-groups, one each with
# sub_group_size 500000); pos.weight and the no-decay group stay in memory.
FRESH = GEN.Case(
    "fresh_z3_bf16_ws2_nvme_live_swap",
    "ds19",
    3,
    "bf16",
    2,
    frozen=True,
    tied=True,
    groups=True,
    sub_group_size=500_000,
    vocab=31,
    dim=64,
    hidden=16500,
    seed=4321,
    live_swap_steps=2,
    zero_extra=(
        ("offload_optimizer", {"device": "nvme", "nvme_path": GEN.NVME_PATH}),
        ("offload_param", {"device": "nvme", "nvme_path": GEN.NVME_PATH, "buffer_size": 1_100_000, "buffer_count": 5}),
    ),
    config_extra=(("zero_force_ds_cpu_optimizer", False),),
)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    root = tmp_path_factory.mktemp("fresh_nvme")
    pythons = {"ds19": sys.executable, "ds14": sys.executable}
    GEN.generate(FRESH, root, pythons, root, extensions=extensions_for(pythons))
    return Sample(FRESH.name, root / FRESH.name, json.loads((root / FRESH.name / "meta.json").read_text()))


def _truth(case: Sample) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The newest values that exist on disk: the engine's at the swap copy for swapped sub-groups,
    at the checkpoint for the sub-groups that never reach the swap folder."""
    swapped = {n for g in case.meta["fp32_sub_groups"] if g["swapped_to_nvme"] for n in g["params"]}
    now = (
        load_file(case.folder / "live_swap_reference" / "live.safetensors"),
        load_file(case.folder / "live_swap_reference" / "live_optimizer.safetensors"),
    )
    then = (case.live(), load_file(case.folder / "reference" / "live_optimizer.safetensors"))
    trainable = [n for g in case.meta["fp32_sub_groups"] for n in g["params"]]
    masters = {n: (now if n in swapped else then)[0][n].float() for n in trainable}
    moments = {
        f"{n}.{s}": (now if n in swapped else then)[1][f"{n}.{s}"] for n in trainable for s in ("exp_avg", "exp_avg_sq")
    }
    return masters, moments


def _check_engine(case: Sample, live: dict, optim: dict) -> None:
    masters, moments = _truth(case)
    for name, truth in masters.items():
        assert same_bits(live[name].float().reshape(truth.shape), truth), name
    for key, truth in moments.items():
        assert same_bits(optim[key].reshape(truth.shape), truth), key


def _cpu_spec(case_name: str, base: Sample | None = None):
    """The case's model, groups and sub-groups in a run whose optimizer state is in CPU memory."""
    spec = FRESH if base is not None else GEN.CASES_BY_NAME[case_name]
    return dataclasses.replace(spec, zero_extra=(), config_extra=(), live_swap_steps=0, min_aio_bytes=0)


@pytest.mark.parametrize("route", ["reshard", "universal"])
def test_deepspeed_resumes_the_samples_live_state_at_three_ranks(route: str, tmp_path: Path) -> None:
    case = sample("z3_bf16_ws2_nvme_live_swap")
    out = tmp_path / "out"
    if route == "reshard":
        (tmp_path / "cpu.json").write_text(json.dumps(NO_NVME))
        result = run_cli(
            "reshard",
            case.checkpoint,
            out,
            "-w",
            "3",
            "--swap-folder",
            case.folder / "live_swap",
            "--config",
            tmp_path / "cpu.json",
            cwd=tmp_path,
        )
    else:
        result = run_cli("to-universal", case.checkpoint, out, "--swap-folder", case.folder / "live_swap", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "may be older" in result.stderr  # the in-memory sub-groups come from the checkpoint
    live, optim, _ = run_probe(
        _cpu_spec(case.name), out, 3, tmp_path / "probe", config_override=NO_NVME, load_universal=route == "universal"
    )
    _check_engine(case, live, optim)


def test_a_fresh_nvme_run_is_recovered_bit_for_bit(fresh: Sample, tmp_path: Path) -> None:
    """Not in the repository: real thresholds, another seed and sizes."""
    swap = fresh.folder / "live_swap"
    assert any(g["swapped_to_nvme"] for g in fresh.meta["fp32_sub_groups"])
    assert any("bfloat16params" in f for f in fresh.meta["live_swap"]["files"])
    masters, moments = _truth(fresh)
    got = dict(api.iter_tensors(fresh.checkpoint, swap_folder=swap, states=True))
    for name, truth in {**masters, **moments}.items():
        assert same_bits(got[name], truth), name
    # the 16-bit param swaps against the engine's masters rounded by torch
    report = inspect_path(swap, checkpoint=fresh.checkpoint)
    assert report["complete"], report["problems"]
    now = load_file(fresh.folder / "live_swap_reference" / "live.safetensors")
    differing = elements = 0
    for name, ds_id in fresh.meta["ds_ids"].items():
        files = [swap / "zero_stage_3" / "bfloat16params" / f"rank{r}" / f"{ds_id}_param.tensor.swp" for r in range(2)]
        if name not in masters or not all(f.exists() for f in files) or name in fresh.meta["tied"]:
            continue
        share = -(-now[name].numel() // 2)
        stored = torch.cat([torch.from_numpy(np.fromfile(f, dtype=np.int16)[:share].copy()) for f in files])[
            : now[name].numel()
        ]
        differing += int((stored != now[name].reshape(-1).to(torch.bfloat16).view(torch.int16)).sum())
        elements += now[name].numel()
    assert (
        elements
        and report["agreement_16bit"]["elements"] == elements
        and report["agreement_16bit"]["differing"] == differing
    )


def test_deepspeed_resumes_a_fresh_runs_live_state_at_three_ranks(fresh: Sample, tmp_path: Path) -> None:
    (tmp_path / "cpu.json").write_text(json.dumps(NO_NVME))
    out = tmp_path / "out"
    result = run_cli(
        "reshard",
        fresh.checkpoint,
        out,
        "-w",
        "3",
        "--swap-folder",
        fresh.folder / "live_swap",
        "--config",
        tmp_path / "cpu.json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    live, optim, _ = run_probe(_cpu_spec(FRESH.name, fresh), out, 3, tmp_path / "probe", config_override=NO_NVME)
    _check_engine(fresh, live, optim)

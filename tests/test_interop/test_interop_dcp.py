"""Interop for ``zckpt to-dcp``: its output resumed by FSDP2 (``fully_shard``, gloo, CPU) at 1, 2
and 3 ranks with ``dcp.load`` + ``set_state_dict`` (``scripts/fsdp2_resume.py``), then trained on,
against real DeepSpeed training on from the same checkpoint. Needs DeepSpeed installed in this
interpreter (the training truth); skipped otherwise.

Run: ``DS_ACCELERATOR=cpu PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_dcp.py`` (about 4 minutes on 2 cores: one DeepSpeed run of ~10 s,
four FSDP2 runs of ~6 s, a Hugging Face Trainer run and its FSDP2 resume, ~25 s, a FusedAdam run
with the build of DeepSpeed's CPU FusedAdam op, ~80 s, and one FSDP2 load of ~5 s per optimizer
family's sample).

What the expected values are (never zckpt's code):

* right after the load, bit for bit: the sample's ``reference/live*.safetensors`` (the engine's
  fp32 masters, frozen params, buffers and Adam moments before it saved), and its ``meta.json``
  (steps, param groups' lr and weight decay as make_sample_ckpts set them);
* for each optimizer family's sample (torch's SGD, Adam, AdamW with AMSGrad, NAdam, RAdam, Adamax,
  Adagrad, RMSprop; DeepSpeed's FusedAdam, CPU Adam, CPU Adagrad, Muon) resumed with torch's
  equivalent optimizer: the same live files, each per-element state under torch's name for it,
  NAdam's ``mu_product`` as torch's NAdam computes it after the run's steps, the config's
  hyperparameters; the CPU Adagrad run's one more step (torch's Adagrad on the renamed ``sum``)
  against DeepSpeed's own step on the same data, as below;
* after two more steps: DeepSpeed itself resuming the original checkpoint at its own world size
  and training the same two steps on the same data (``ds_probe.py --train-steps 2 --data
  global``). FSDP2 reduces gradients in another order than DeepSpeed, so the values agree to
  float32 rounding (a few ulps), far below what one step moves them (~1e-2); a resume that lost
  the step count, the moments or the groups' hyperparameters would be off by the size of a step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, Sample, same_bits, sample

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    extensions_for,
    free_port,
    launcher,
    run_logged,
    run_probe,
    shm_leak_safety_net,
)
from zckpt import to_dcp  # noqa: E402

WORKER = ROOT / "scripts" / "fsdp2_resume.py"
TRAINED = "z3_fp32_ws2_tied_frozen"  # fp32 (DeepSpeed trains as FSDP2 does), tied, frozen, BatchNorm
STEPS = 2


def resume(
    case: Sample | None,
    dcp: Path,
    world_size: int,
    out: Path,
    train_steps: int = 0,
    hf_model: Path | None = None,
    case_json: str | None = None,
) -> Path:
    """Run scripts/fsdp2_resume.py at `world_size` ranks (a bundled case's model, or the Hugging
    Face model of `hf_model`); fail the test with its errors if it fails."""
    out.mkdir(parents=True)
    cmd = [*launcher(sys.executable), "--nproc-per-node", str(world_size)]
    cmd += ["--master-port", str(free_port()), str(WORKER), "--dcp", str(dcp), "--out", str(out)]
    if hf_model is not None:
        cmd += ["--hf-model", str(hf_model)]
    else:
        cmd += ["--case", case_json or case.name, "--train-steps", str(train_steps)]
        cmd += ["--micro-batches", str(case.meta["world_size"])]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    returncode = run_logged(cmd, env, out / "run.log", timeout=300)
    if returncode != 0 or not (out / "run.json").exists():
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error_rank*.txt")))
        pytest.fail(
            f"FSDP2 resume at {world_size} ranks: exit {returncode}\n{errors}\n{(out / 'run.log').read_text()[-3000:]}"
        )
    return out


def check_loaded(case: Sample, out: Path) -> None:
    """What FSDP2 holds after dcp.load + set_state_dict, gathered whole: the live engine's values,
    bit for bit (frozen 16-bit params widened exactly into the fp32 model), each param's step, and
    the groups' hyperparameters as the case trained with them."""
    model = load_file(out / "loaded_model.safetensors")
    optim = load_file(out / "loaded_optim.safetensors")
    info = json.loads((out / "loaded.json").read_text())
    live = case.live()
    assert sorted(model) == sorted(live)
    for name, truth in live.items():
        assert same_bits(model[name], truth.float() if truth.is_floating_point() else truth), name
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    tied = case.meta.get("tied") or {}
    assert sorted(optim) == sorted(k for k in live_optim if k.rsplit(".", 1)[0] not in tied)
    for key, value in optim.items():
        assert same_bits(value, live_optim[key]), key
    steps = info["steps"]
    assert sorted(steps) == sorted({k.rsplit(".", 1)[0] for k in optim})
    assert all(s == {"value": float(case.meta["steps"]), "dtype": "torch.float32", "shape": []} for s in steps.values())
    groups = info["param_groups"]
    assert len(groups) == case.meta["param_groups"]
    expected = [(1e-2, 0.01), (3e-3, 0.0)] if len(groups) == 2 else [(1e-2, 0.01)]  # make_sample_ckpts' groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == expected
    assert all(g["betas"] == [0.9, 0.999] and g["eps"] == 1e-8 for g in groups)


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed resuming the sample at its own world size and training STEPS more steps."""
    out = tmp_path_factory.mktemp("ds_truth")
    case = sample(TRAINED)
    _, _, state = run_probe(TRAINED, case.checkpoint, case.meta["world_size"], out, train_steps=STEPS, data="global")
    assert state["train"]["global_steps_after"] == case.meta["steps"] + STEPS
    return out


@pytest.fixture(scope="module")
def trained_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's command, through the CLI."""
    import subprocess

    out = tmp_path_factory.mktemp("dcp") / "step-3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", "to-dcp", str(sample(TRAINED).checkpoint), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fsdp2_resumes_and_trains_on_as_deepspeed_does(
    world_size: int, truth: Path, trained_dcp: Path, tmp_path: Path
) -> None:
    case = sample(TRAINED)
    out = resume(case, trained_dcp, world_size, tmp_path / "fsdp2", train_steps=STEPS)
    check_loaded(case, out)
    live = case.live()
    ds_model = load_file(truth / "live_after_train.safetensors")
    ds_optim = load_file(truth / "live_optimizer_after_train.safetensors")
    model = load_file(out / "after_train_model.safetensors")
    optim = load_file(out / "after_train_optim.safetensors")
    trainable = {k.rsplit(".", 1)[0] for k in optim}
    moved = 0.0
    for name in trainable | set(case.meta.get("tied") or {}):
        torch.testing.assert_close(model[name], ds_model[name], rtol=0, atol=1e-6, msg=name)
        moved = max(moved, (ds_model[name] - live[name]).abs().max().item())
    assert moved > 1e-2  # the tolerance is far below what the steps changed
    for key, value in optim.items():  # moments near zero differ by rounding too: measured against the largest
        scale = ds_optim[key].abs().max().item()
        torch.testing.assert_close(value, ds_optim[key], rtol=0, atol=1e-5 * scale, msg=key)
    info = json.loads((out / "after_train.json").read_text())
    assert {s["value"] for s in info["steps"].values()} == {float(case.meta["steps"] + STEPS)}
    for name in case.meta["frozen"]:
        assert same_bits(model[name], ds_model[name]), name
    if world_size > 1:  # rank 0 trained micro-batch 0 alone, as DeepSpeed's rank 0 did: same BatchNorm statistics
        for name in case.meta["buffers"]:
            torch.testing.assert_close(model[name], ds_model[name], rtol=1e-6, atol=1e-7, msg=name)
    losses = json.loads((truth / "state.json").read_text())["train"]["losses_per_microbatch"]
    ours = {}
    for rank_losses in json.loads((out / "run.json").read_text())["losses"]:
        for step, rows in enumerate(rank_losses):
            for j, weight, loss in rows:
                if weight:
                    ours[(step, j)] = loss
    assert ours == pytest.approx({(s, j): v for s, row in enumerate(losses) for j, v in enumerate(row)}, rel=1e-5)


def test_fsdp2_resumes_groups_frozen_tied_bf16_nvme_sample(tmp_path: Path) -> None:
    """A bf16 ZeRO-3 run with two param groups (other lr and weight decay), frozen bf16 params, tied
    weights and its optimizer offloaded to NVMe, resumed by an fp32 FSDP2 model at 3 ranks."""
    case = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    to_dcp(case.checkpoint, tmp_path / "dcp")
    check_loaded(case, resume(case, tmp_path / "dcp", 3, tmp_path / "fsdp2"))


def test_fsdp2_resumes_a_hugging_face_trainer_checkpoint(tmp_path: Path) -> None:
    """A real Trainer run (scripts/hf_trainer_run.py: a tiny Llama with tied embeddings, bf16 ZeRO-3
    at 2 processes, Trainer's AdamW in its two groups) exported from its output folder (the newest
    checkpoint-N) and loaded by the transformers model sharded with FSDP2 at 3 ranks: every fp32
    master equals what the engine held at the save (``masters_step2.safetensors``, dumped by the
    run), the probed params' moments equal ``safe_get_full_optimizer_state``'s, every step is 2."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from interop_helpers import run_hf_job

    trainer_out = tmp_path / "trainer"
    trainer_out.mkdir()
    cmd = [*launcher(sys.executable), "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(ROOT / "scripts" / "hf_trainer_run.py"), "--out", str(trainer_out), "--max-steps", "3"]
    cmd += ["--save-steps", "2", "--stage", "3", "--bf16", "--dump-masters", "--samples", "64", "--lr", "0.02"]
    run_hf_job("hf_trainer_run.py (2 processes, ZeRO-3 bf16)", cmd, trainer_out, 2, sys.executable, timeout=300)
    to_dcp(trainer_out / "checkpoint-2", tmp_path / "dcp")
    out = resume(None, tmp_path / "dcp", 3, tmp_path / "fsdp2", hf_model=trainer_out / "checkpoint-2")
    model = load_file(out / "loaded_model.safetensors")
    masters = load_file(trainer_out / "masters_step2.safetensors")
    assert masters and set(masters) <= set(model)
    for name, value in masters.items():
        assert same_bits(model[name], value), name
    assert same_bits(model["lm_head.weight"], masters["model.embed_tokens.weight"])  # tied
    optim = load_file(out / "loaded_optim.safetensors")
    probe = torch.load(trainer_out / "probe_step2.pt", weights_only=True)
    assert len(probe) == 4
    for name, states in probe.items():
        assert same_bits(model[name], states["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(optim[f"{name}.{key}"], states[key]), (name, key)
    info = json.loads((out / "loaded.json").read_text())
    assert {s["value"] for s in info["steps"].values()} == {2.0}
    assert sorted(info["steps"]) == sorted(n for n in masters)


def test_fsdp2_resumes_a_run_of_deepspeeds_own_adam(tmp_path: Path) -> None:
    """DeepSpeed's FusedAdam (config type AdamW without ``torch_adam``; its CPU build) saves fewer
    group keys than torch's AdamW, which dcp.load wants all of: to-dcp completes them (amsgrad
    False, decoupled_weight_decay True for AdamW, ...), and FSDP2 with torch's AdamW loads the run
    at 3 ranks with the engine's masters, moments and steps, bit for bit."""
    import dataclasses

    from helpers import Sample as SampleOf
    from interop_helpers import sample_generator

    gen = sample_generator()
    optimizer = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    case = gen.Case(
        "fused_adam_z3_fp32_ws2", "ds19", 3, "fp32", 2, tied=True, groups=True, config_extra=(("optimizer", optimizer),)
    )
    root = tmp_path / "fresh"
    root.mkdir()
    pythons = {"ds19": sys.executable}
    gen.generate(case, root, pythons, root, extensions=extensions_for(pythons))
    fresh = SampleOf(case.name, root / case.name, json.loads((root / case.name / "meta.json").read_text()))
    assert "torch_adam" not in fresh.meta["ds_config"]["optimizer"]["params"]
    to_dcp(fresh.checkpoint, tmp_path / "dcp")
    out = resume(fresh, tmp_path / "dcp", 3, tmp_path / "fsdp2", case_json=json.dumps(dataclasses.asdict(case)))
    check_loaded(fresh, out)
    groups = json.loads((out / "loaded.json").read_text())["param_groups"]
    assert all(g["decoupled_weight_decay"] is True and g["amsgrad"] is False for g in groups)


# one real DeepSpeed run per optimizer family (issue 35), each resumed once by FSDP2 with torch's
# equivalent optimizer (scripts/fsdp2_resume.py case_optimizers): at the run's own world size, two
# at another. DeepSpeedCPULion (z2_bf16_ws2_cpulion) is not here: torch 2.13 has no Lion. The CPU
# Adagrad run, whose state to-dcp renames, then trains one step on, against DeepSpeed's own step.
TRAINED_ON = "z2_fp32_ws2_cpuadagrad"
FAMILIES = [
    ("z3_fp32_ws2_sgd_coupled_wd", 2),  # SGD, Nesterov: momentum_buffer, no step
    ("z3_bf16_ws3_adam_coupled_wd", 3),  # torch's Adam, L2 decay
    ("z3_fp32_ws2_amsgrad", 2),  # torch's AdamW(amsgrad): max_exp_avg_sq
    ("z1_bf16_ws2_nadam", 3),  # NAdam at another world size: a scalar mu_product per param
    ("z2_bf16_ws2_radam", 2),
    ("z1_fp32_ws3_adamax", 3),  # exp_inf
    ("z3_fp32_ws2_adagrad", 2),  # torch's Adagrad: sum
    ("z3_bf16_ws2_rmsprop_centered", 2),  # square_avg, momentum_buffer, grad_avg
    ("z1_bf16_ws2_fusedadam", 2),  # DeepSpeed's FusedAdam as AdamW: an integer step
    ("z3_bf16_ws2_cpuadam", 2),  # DeepSpeedCPUAdam as AdamW
    ("z2_fp32_ws2_cpuadagrad", 2),  # DeepSpeedCPUAdagrad as torch's Adagrad: exp_avg_sq as sum
    ("z1_bf16_ws2_muon", 2),  # DeepSpeed's Muon as torch's Muon + AdamW
    ("z2_fp32_ws3_muon", 2),  # at another world size
    ("z3_bf16_ws2_muon", 2),  # a bf16 momentum_buffer (ZeRO-3 keeps it so): widened, exactly
]


def torch_state_name(case: Sample, key: str) -> str:
    """The name torch's equivalent optimizer gives DeepSpeed's state `key`: DeepSpeedCPUAdagrad's
    sum of squared gradients is ``exp_avg_sq``, torch's Adagrad's ``sum``."""
    return "sum" if case.optimizer.lower() == "adagrad" and case.cpu_optimizer and key == "exp_avg_sq" else key


def nadam_mu_product(steps: int, group: dict) -> torch.Tensor:
    """NAdam's mu_product after `steps` steps, from torch's NAdam itself (it depends only on the
    step count, beta1 and momentum_decay)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.NAdam([param], betas=tuple(group["betas"]), momentum_decay=group["momentum_decay"])
    for _ in range(steps):
        param.grad = torch.ones(1)
        optimizer.step()
    return optimizer.state[param]["mu_product"]


@pytest.mark.parametrize("name, world_size", FAMILIES, ids=[f"{n}-fsdp{w}" for n, w in FAMILIES])
def test_fsdp2_resumes_each_optimizer_family_bit_for_bit(name: str, world_size: int, tmp_path: Path) -> None:
    """to_dcp of the family's sample, loaded by FSDP2 at `world_size` ranks with torch's class for
    the run's optimizer and the config's hyperparameters: every fp32 master, frozen param and
    buffer, and every per-element optimizer state, is the live engine's (a bf16 Muon momentum
    widened exactly); each param's step is the run's step count as torch keeps it (a float32 0-d
    tensor; SGD and Muon's Muon group count none), NAdam's mu_product torch's after those steps;
    the groups hold the config's hyperparameters."""
    case = sample(name)
    to_dcp(case.checkpoint, tmp_path / "dcp")
    out = resume(case, tmp_path / "dcp", world_size, tmp_path / "fsdp2", train_steps=int(name == TRAINED_ON))
    model = load_file(out / "loaded_model.safetensors")
    optim = load_file(out / "loaded_optim.safetensors")
    info = json.loads((out / "loaded.json").read_text())
    live = case.live()
    assert sorted(model) == sorted(live)
    for key, truth in live.items():
        assert same_bits(model[key], truth.float() if truth.is_floating_point() else truth), key

    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    tied = set(case.meta.get("tied") or {})
    expected = {}
    for key, truth in live_optim.items():
        param, state = key.rsplit(".", 1)
        if param not in tied:
            expected[f"{param}.{torch_state_name(case, state)}"] = truth
    scalars = {k: v for k, v in optim.items() if k.rsplit(".", 1)[1] in case.scalar_names}
    assert sorted(set(optim) - set(scalars)) == sorted(expected)
    for key, truth in expected.items():  # fp32 in the fp32 model: what the engine held, exactly
        assert same_bits(optim[key], truth.float()), key
    trainable = {k.rsplit(".", 1)[0] for k in expected}
    assert trainable == {
        n for n in live if n not in tied and n not in case.meta["frozen"] and n not in case.meta["buffers"]
    }

    groups = info["param_groups"]
    if case.scalar_names:  # NAdam
        assert sorted(scalars) == sorted(f"{n}.mu_product" for n in trainable)
        truth = nadam_mu_product(case.meta["steps"], groups[0])
        for key, value in scalars.items():
            assert same_bits(value, truth), key
    counting = {n for n in trainable if case.counts_steps or f"{n}.exp_avg" in expected}  # Muon: its Adam group
    assert sorted(info["steps"]) == sorted(counting)
    step = {"value": float(case.meta["steps"]), "dtype": "torch.float32", "shape": []}
    assert all(s == step for s in info["steps"].values())

    section = case.meta["ds_config"]["optimizer"]
    config = {k: v for k, v in section["params"].items() if k not in ("torch_adam", "adam_w_mode")}
    kind = section["type"].lower()
    if case.muon:  # DeepSpeed's Muon half (lr, momentum, weight_decay) and Adam half (MuonWithAuxAdam's betas, eps)
        assert len(groups) == 2
        assert {k: groups[0][k] for k in config} == config
        assert groups[0]["nesterov"] is True and groups[0]["ns_steps"] == 5 and "betas" not in groups[0]
        adam = {"lr": config["lr"], "weight_decay": config["weight_decay"], "betas": [0.9, 0.95], "eps": 1e-10}
        assert {k: groups[1][k] for k in adam} == adam
        assert groups[1]["decoupled_weight_decay"] is True
    else:
        assert len(groups) == 1
        assert {k: groups[0][k] for k in config} == config
    if kind in ("adam", "adamw"):  # engine: AdamW decouples, Adam unless adam_w_mode is false
        assert groups[0]["decoupled_weight_decay"] is (kind == "adamw" or section["params"].get("adam_w_mode", True))
    if kind == "adagrad" and case.cpu_optimizer:  # DeepSpeedCPUAdagrad: no lr decay, its sum from zero
        assert groups[0]["lr_decay"] == 0 and groups[0]["initial_accumulator_value"] == 0
    if name == TRAINED_ON:
        trains_on_as_deepspeed_does(case, out, tmp_path / "ds_truth")


def trains_on_as_deepspeed_does(case: Sample, out: Path, truth: Path) -> None:
    """One more step of torch's Adagrad on the loaded state (its sum: DeepSpeedCPUAdagrad's
    exp_avg_sq) against DeepSpeed resuming the original checkpoint and training the same step on
    the same data: equal to float32 rounding, far below what the step moved the params."""
    run_probe(case.name, case.checkpoint, case.meta["world_size"], truth, train_steps=1, data="global")
    ds_model = load_file(truth / "live_after_train.safetensors")
    ds_optim = load_file(truth / "live_optimizer_after_train.safetensors")
    model = load_file(out / "after_train_model.safetensors")
    optim = load_file(out / "after_train_optim.safetensors")
    live = case.live()
    moved = 0.0
    for key, value in optim.items():
        param, state = key.rsplit(".", 1)
        assert state == "sum"
        torch.testing.assert_close(model[param], ds_model[param], rtol=0, atol=1e-6, msg=param)
        moved = max(moved, (ds_model[param] - live[param]).abs().max().item())
        theirs = ds_optim[f"{param}.exp_avg_sq"]
        torch.testing.assert_close(value, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item(), msg=key)
    assert moved > 1e-3
    info = json.loads((out / "after_train.json").read_text())
    assert {s["value"] for s in info["steps"].values()} == {float(case.meta["steps"] + 1)}

"""Interop with real DeepSpeed for universal checkpoints: ``zckpt to-universal``'s output resumed by
DeepSpeed (``"checkpoint": {"load_universal": true}``) at other world sizes and ZeRO stages, and
DeepSpeed's own ``ds_to_universal`` output read by zckpt. Needs DeepSpeed installed in this
interpreter; skipped otherwise.

Run: ``DS_ACCELERATOR=cpu PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_universal.py`` (4-6 minutes on 2 cores: 19 DeepSpeed runs of 8-20 s, one
fresh checkpoint, one ds_to_universal pass over every sample).

What the expected values are (never zckpt's own layout code):

* fp32 masters and Adam states: the sample's ``reference/live*.safetensors``, read from the engine
  that saved the checkpoint (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``).
* counters, lr scheduler, loss scaler, param-group hyperparameters and steps: the original
  checkpoint's rank-0 model_states / optim_states files, loaded with ``torch.load`` as DeepSpeed
  wrote them.
* DeepSpeed's loader behaviour (read in deepspeed 0.19.8 ``runtime/engine.py`` ``_load_checkpoint``,
  ``runtime/zero/stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``,
  ``runtime/base_optimizer.py`` ``load_hp_checkpoint_state_from_checkpoint_dir``, and observed
  here): a universal load skips the module state dict, so frozen params and buffers keep the
  freshly built model's values (frozen params never train, so that is their saved value too;
  buffers such as BatchNorm running stats are NOT restored, whoever wrote the universal folder);
  the ZeRO-3 loader gives every param group ``param_groups[0]``'s hyperparameters and
  ``state[0]``'s step, the ZeRO-1/2 loader restores each group's hyperparameters and the step of
  its ``step.pt`` files.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT, SAMPLE_LIST, Sample, same_bits, sample

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from helpers import load_output  # noqa: E402
from interop_checks import DS_TO_UNIVERSAL, FRESH, GEN, _check_resumed, _plain, _saved  # noqa: E402
from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ds_env,
    ds_python,
    extensions_for,
    needs_built_op,
    run_logged,
    run_probe,
    sample_generator,
    shm_leak_safety_net,
)
from zckpt import consolidate, reshard, to_universal  # noqa: E402

# --------------------------------------------------------------------------------------
# What the original checkpoint holds, read with torch.load as DeepSpeed wrote it
# --------------------------------------------------------------------------------------


def _cli(*args: str) -> None:
    """``python -m zckpt ARGS`` (this interpreter, the repository's zckpt)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "zckpt", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------------------
# 1. DeepSpeed resumes zckpt's universal output at other world sizes (same stage)
# --------------------------------------------------------------------------------------
RESUME_CASES = [  # (sample, world size, in place): ZeRO-1/2/3, fp32/bf16/fp16, frozen, tied, 2 groups, sub-groups,
    # optimizer offload, 0.14 format, world sizes 1-4
    ("z1_fp32_ws2_frozen_tied", 3, False),
    ("z2_fp16_ws4_tied", 1, False),
    ("z2_bf16_ws2_cpuoffload_frozen", 3, False),
    ("ds14_z2_bf16_ws3_frozen_tied", 1, False),
    ("z3_bf16_ws3_subgroups_groups", 2, False),
    ("z3_fp16_ws4_subgroups_frozen", 3, False),
    ("hf_trainer", 4, True),  # ZeRO-3 bf16, tied, WarmupLR scheduler; written into its checkpoint-3/ folder
    ("z3_bf16_ws2_cpuadam", 3, False),  # DeepSpeedCPUAdam: its integer step in optimizer_state.pt
]


@pytest.mark.parametrize(
    "name,world_size,in_place",
    [
        pytest.param(n, w, i, id=f"{n}-ws{w}{'-in_place' if i else ''}", marks=needs_built_op(n))
        for n, w, i in RESUME_CASES
    ],
)
def test_deepspeed_resumes_universal_output(name: str, world_size: int, in_place: bool, tmp_path: Path) -> None:
    case = sample(name)
    source = case.checkpoint
    if in_place:  # the usual layout: <tag>_universal and latest_universal beside <tag> and latest
        source = tmp_path / "uc"
        shutil.copytree(case.checkpoint, source)
    result = to_universal(source, tmp_path / "uc")
    assert result.target_stage == case.meta["zero_stage"]
    assert (tmp_path / "uc" / "latest_universal").read_text().strip() == case.meta["tag"] + "_universal"
    if in_place:
        assert (source / "latest").read_text().strip() == case.meta["tag"]
    live, optim, state = run_probe(name, tmp_path / "uc", world_size, tmp_path / "probe", load_universal=True)
    _check_resumed(
        case,
        GEN.CASES_BY_NAME[name],
        live,
        optim,
        state,
        world_size=world_size,
        stage=case.meta["zero_stage"],
        universal=True,
    )


def test_deepspeed_resumes_universal_output_of_nvme_offloaded_checkpoint(tmp_path: Path) -> None:
    """The sample whose optimizer was offloaded to NVMe (sub-groups' masters and Adam states in
    offloaded_tensors/, which ds_to_universal cannot convert), resumed by a ZeRO-3 run without
    offload at 3 ranks (the same model and groups)."""
    name = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"
    case = sample(name)
    spec = dataclasses.replace(GEN.CASES_BY_NAME[name], zero_extra=(), config_extra=())
    to_universal(case.checkpoint, tmp_path / "uc")
    live, optim, state = run_probe(spec, tmp_path / "uc", 3, tmp_path / "probe", load_universal=True)
    _check_resumed(case, spec, live, optim, state, world_size=3, stage=3, universal=True)


def test_deepspeed_resumes_universal_output_of_round_robin_checkpoint(tmp_path: Path) -> None:
    """z1_fp32_ws2_roundrobin (round_robin_gradients: the flat buffers in round-robin order, whose
    param_slice_mappings DeepSpeed 0.19.8 writes wrong, so ds_to_universal's output is wrong).

    Its sample has no live optimizer states, so the truth is what DeepSpeed holds after a plain load
    of the original at its own world size (its own partitions, read by position in the flat buffer).
    The universal run leaves round_robin_gradients off: DeepSpeed's universal loader places values
    through the same wrong links when it is on (observed: every master misplaced)."""
    name = "z1_fp32_ws2_roundrobin"
    case = sample(name)
    _, truth_optim, truth_state = run_probe(name, case.checkpoint, 2, tmp_path / "truth")
    assert truth_state["cross_checks"]["optim_fragments_linked"] == {"exp_avg": False, "exp_avg_sq": False}
    assert set(truth_state["methods"]["optimizer"].values()) == {"flat_partition_allgather"}
    to_universal(case.checkpoint, tmp_path / "uc")
    spec = dataclasses.replace(GEN.CASES_BY_NAME[name], zero_extra=())
    live, optim, state = run_probe(spec, tmp_path / "uc", 3, tmp_path / "probe", load_universal=True)
    _check_resumed(case, spec, live, optim, state, world_size=3, stage=1, universal=True, expected_optim=truth_optim)


# --------------------------------------------------------------------------------------
# 2. Across ZeRO stages: --target-stage writes the flavour the other stage's loader reads
# --------------------------------------------------------------------------------------
CROSS_STAGE_CASES = [  # (sample, target stage, world size, through the CLI)
    ("z2_fp16_ws4_tied", 3, 2, True),  # fp16 loss scaler into ZeRO-3's loader
    ("z1_fp32_ws2_frozen_tied", 3, 1, False),
    ("z3_bf16_ws3_subgroups_groups", 2, 4, False),  # 2 groups: ZeRO-2's loader restores each group
    ("z3_bf16_ws2_rmsprop_centered", 2, 3, False),  # RMSprop's three states, each a file ZeRO-2's loader reads
]


@pytest.mark.parametrize(
    "name,target,world_size,cli", CROSS_STAGE_CASES, ids=[f"{n}-z{t}-ws{w}" for n, t, w, _ in CROSS_STAGE_CASES]
)
def test_deepspeed_resumes_universal_output_at_another_stage(
    name: str, target: int, world_size: int, cli: bool, tmp_path: Path
) -> None:
    case = sample(name)
    if cli:
        _cli("to-universal", str(case.checkpoint), str(tmp_path / "uc"), "--target-stage", str(target), "-q")
    else:
        assert to_universal(case.checkpoint, tmp_path / "uc", target_stage=target).target_stage == target
    live, optim, state = run_probe(
        name, tmp_path / "uc", world_size, tmp_path / "probe", stage=target, load_universal=True
    )
    _check_resumed(
        case, GEN.CASES_BY_NAME[name], live, optim, state, world_size=world_size, stage=target, universal=True
    )


# --------------------------------------------------------------------------------------
# 3. A checkpoint made now, with sizes and a seed not in the repository
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    root = tmp_path_factory.mktemp("fresh_universal")
    pythons = {"ds19": ds_python(), "ds14": ds_python()}
    GEN.generate(FRESH, root, pythons, root, extensions=extensions_for(pythons))
    return Sample(FRESH.name, root / FRESH.name, json.loads((root / FRESH.name / "meta.json").read_text()))


def test_fresh_case_is_not_a_bundled_one() -> None:
    bundled = {(c.vocab, c.dim, c.hidden, c.seed) for c in GEN.CASES}
    assert (FRESH.vocab, FRESH.dim, FRESH.hidden, FRESH.seed) not in bundled and FRESH.name not in GEN.CASES_BY_NAME


def test_deepspeed_resumes_universal_output_of_fresh_checkpoint(fresh: Sample, tmp_path: Path) -> None:
    assert fresh.meta["n_fp32_sub_groups"] > 2 and fresh.meta["frozen"] and fresh.meta["tied"]
    to_universal(fresh.checkpoint, tmp_path / "uc")
    live, optim, state = run_probe(FRESH, tmp_path / "uc", 2, tmp_path / "probe", load_universal=True)
    _check_resumed(fresh, FRESH, live, optim, state, world_size=2, stage=3, universal=True)
    assert (
        state["lr_scheduler"] is not None and state["lr_scheduler"]["last_batch_iteration"] == fresh.meta["steps"] - 1
    )


# --------------------------------------------------------------------------------------
# DeepSpeed's ds_to_universal, run once on a copy of every sample
# --------------------------------------------------------------------------------------

# Where ds_to_universal (0.19.8) gives nothing to compare with:
# * z3_bf16_ws2_nvmeoffload_frozen_tied_groups: it fails ("start (0) + length (914) exceeds dimension
#   size (0)"): it reads the optim files' fp32_flat_groups / Adam states, empty for the sub-groups
#   swapped to NVMe, and never looks at offloaded_tensors/.
# * z1_fp32_ws2_roundrobin: it runs but writes wrong values: it cuts the flat partitions with the
#   checkpoint's param_slice_mappings, which DeepSpeed 0.19.8 computes in the original param order
#   while round_robin_gradients lays the flat buffer out in round-robin order (see the sample's notes).
# For these two zckpt's output is compared with the live truth only.
DS_TO_UNIVERSAL_UNUSABLE = {
    "z3_bf16_ws2_nvmeoffload_frozen_tied_groups": "ds_to_universal fails: it ignores offloaded_tensors/",
    "z3_bf16_ws2_nvme_live_swap": "ds_to_universal fails: it ignores offloaded_tensors/",
    "z1_fp32_ws2_roundrobin": "ds_to_universal's output is wrong: DeepSpeed's param_slice_mappings ignore round-robin order",
    "z3_fp32_ws2_sgd_coupled_wd": "ds_to_universal fails on SGD: KeyError: 'exp_avg'",
    # an elastic checkpoint's base_optimizer_state is a list (a dict per group), which it indexes as a dict
    "z2_bf16_ws2_elastic": "ds_to_universal fails on elastic_checkpoint: 'list' object has no attribute 'get'",
    "z1_fp32_ws3_elastic": "ds_to_universal fails on elastic_checkpoint: 'list' object has no attribute 'get'",
    "z1_bf16_ws2_nadam": "ds_to_universal fails on NAdam: narrow() cannot be applied to a 0-dim tensor (mu_product)",
    "z1_bf16_ws2_muon": "ds_to_universal fails on DeepSpeed's Muon: KeyError: 'exp_avg' (its Muon group keeps none)",
    "z2_fp32_ws3_muon": "ds_to_universal fails on DeepSpeed's Muon: KeyError: 'exp_avg' (its Muon group keeps none)",
    "z3_bf16_ws2_muon": "ds_to_universal fails on DeepSpeed's Muon: KeyError: 'exp_avg' (its Muon group keeps none)",
    "z1_bf16_ws3_muon_bf16optimizer": "ds_to_universal fails on DeepSpeed's Muon: KeyError: 'exp_avg'",
    "z2_fp32_ws3_muon_cpuoffload": "ds_to_universal fails on DeepSpeed's Muon: KeyError: 'exp_avg'",
    # its merge knows Adam's two moments only, and needs both
    "z3_fp32_ws2_adagrad": "ds_to_universal fails on Adagrad: KeyError: 'exp_avg'",
    "z1_fp32_ws3_adamax": "ds_to_universal fails on Adamax: KeyError: 'exp_avg_sq'",
    "z3_bf16_ws2_rmsprop_centered": "ds_to_universal fails on RMSprop: KeyError: 'exp_avg'",
    "z2_fp32_ws2_cpuadagrad": "ds_to_universal fails on DeepSpeedCPUAdagrad: KeyError: 'exp_avg'",
}
# what ds_to_universal leaves out without a word (its merge knows exp_avg and exp_avg_sq only)
DS_TO_UNIVERSAL_DROPS = {"z3_fp32_ws2_amsgrad": {"max_exp_avg_sq.pt"}}


@pytest.fixture(scope="module")
def ds_universal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path | None, str | None]]:
    """name -> (DeepSpeed's universal tag folder, or None; its error, or None), for every sample.
    Each runs on a copy (ds_to_universal writes latest_universal beside the tag folder)."""
    root = tmp_path_factory.mktemp("ds_universal")
    jobs = {}
    for s in SAMPLE_LIST:
        copy = root / s.name
        shutil.copytree(s.checkpoint, copy)
        tag = s.meta["tag"]
        jobs[s.name] = (str(copy / tag), str(copy / f"{tag}_universal"))
    python = ds_python()
    log = root / "ds_to_universal.log"
    rc = run_logged([python, "-c", DS_TO_UNIVERSAL, json.dumps(jobs)], ds_env(1, python), log, timeout=600)
    assert rc == 0, log.read_text()[-3000:]
    line = next(x for x in log.read_text().splitlines() if x.startswith("RESULTS "))
    errors = json.loads(line.removeprefix("RESULTS "))
    return {name: (None if errors[name] else Path(jobs[name][1]), errors[name]) for name in jobs}


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _tensor_of(obj: Any) -> torch.Tensor:
    """The tensor of a universal state file: ZeRO-1/2 flavour ``{"cat_dim": 0, "param": t}``, ZeRO-3 bare."""
    return obj["param"] if isinstance(obj, dict) else obj


def _param_dirs(zero: Path) -> set[str]:
    return {p.name for p in zero.iterdir() if p.is_dir()}


# --------------------------------------------------------------------------------------
# 4. zckpt reshard turns DeepSpeed's universal folder into a plain checkpoint DeepSpeed loads
# --------------------------------------------------------------------------------------
FROM_DS_UNIVERSAL_CASES = [  # (sample, world size, stage, how)
    ("z2_fp16_ws4_tied", 3, 2, "reshard-cli"),
    ("z3_fp16_ws4_subgroups_frozen", 2, 3, "reshard"),
    # DeepSpeed's ZeRO-1/2-flavour universal folder rewritten for a ZeRO-3 run
    ("z2_bf16_ws2_cpuoffload_frozen", 3, 3, "to-universal"),
]


@pytest.mark.parametrize(
    "name,world_size,stage,how",
    FROM_DS_UNIVERSAL_CASES,
    ids=[f"{n}-ws{w}-z{s}-{h}" for n, w, s, h in FROM_DS_UNIVERSAL_CASES],
)
def test_deepspeed_loads_zckpt_output_of_ds_universal(
    ds_universal: dict, name: str, world_size: int, stage: int, how: str, tmp_path: Path
) -> None:
    """``reshard``: a plain checkpoint at the new world size, loaded with a plain load_checkpoint
    (the module state dict too: frozen params and buffers restored). ``to-universal``: zckpt's
    universal folder of DeepSpeed's, in the other stage's flavour, loaded with load_universal."""
    uc_dir, error = ds_universal[name]
    assert error is None, error
    out = tmp_path / "out"
    if how == "reshard-cli":
        _cli("reshard", str(uc_dir), str(out), "--world-size", str(world_size), "--stage", str(stage), "-q")
    elif how == "reshard":
        reshard(uc_dir, out, world_size=world_size, stage=stage)
    else:
        to_universal(uc_dir, out, target_stage=stage)
    universal = how == "to-universal"
    assert (out / "latest_universal").exists() == universal and (out / "latest").exists() != universal
    live, optim, state = run_probe(name, out, world_size, tmp_path / "probe", stage=stage, load_universal=universal)
    _check_resumed(
        sample(name),
        GEN.CASES_BY_NAME[name],
        live,
        optim,
        state,
        world_size=world_size,
        stage=stage,
        universal=universal,
    )


# --------------------------------------------------------------------------------------
# 5. zckpt's universal output equals ds_to_universal's, tensor for tensor
# --------------------------------------------------------------------------------------
# What ds_to_universal writes and zckpt does not: for ZeRO-1/2 checkpoints, a zero/<name>/fp32.pt
# ({"param": value.float()}, no optimizer states, no step.pt) for every entry of the model_states
# "module" dict that has no optimizer fragment: frozen params, buffers (scale, position_ids,
# bn.running_mean/var/num_batches_tracked) and tied aliases (lm_head.weight). DeepSpeed's loaders
# never read them (they load the optimizer's params by name; frozen params and buffers are not
# restored by a universal load at all). ZeRO-3's optimizer_state.pt from ds_to_universal also keeps
# rank 0's fp32_flat_groups and Adam states (fp32 partitions the loader ignores: it reads only
# state[0]["step"]); zckpt writes the steps only. Everything else below is equal.
@pytest.mark.parametrize("case", SAMPLE_LIST, ids=lambda s: s.name)
def test_universal_output_equals_ds_to_universal(ds_universal: dict, case: Sample, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    result = to_universal(case.checkpoint, tmp_path / "uc", allow_state_loss=True)
    ours = tmp_path / "uc" / result.tag / "zero"
    stage = case.meta["zero_stage"]
    frozen, buffers = set(case.meta["frozen"]), set(case.meta["buffers"])
    tied_aliases = set(case.meta["tied"])
    trainable = {n for n in case.live() if n not in frozen and n not in buffers and n not in tied_aliases}
    assert _param_dirs(ours) == trainable

    # every file against the engine that saved the checkpoint
    live = case.live()
    optim_file = case.folder / "reference" / "live_optimizer.safetensors"
    live_optim = load_file(optim_file) if optim_file.exists() else {}
    for name in trainable:
        got = _tensor_of(_load(ours / name / "fp32.pt"))
        assert got.dtype == torch.float32 and got.numel() == live[name].numel()
        assert same_bits(got.reshape(-1), live[name].reshape(-1)), name
        for key in case.state_names:
            if f"{name}.{key}" in live_optim:
                assert same_bits(
                    _tensor_of(_load(ours / name / f"{key}.pt")).reshape(-1), live_optim[f"{name}.{key}"].reshape(-1)
                ), (name, key)
    if not live_optim:  # DeepSpeed's accessor failed on these (their meta.json says why)
        assert case.name in {"z1_fp32_ws2_roundrobin", "z1_bf16_ws3_groups", "z2_bf16_ws3_frozen_groups"}

    ds_dir, error = ds_universal[case.name]
    if case.name in DS_TO_UNIVERSAL_UNUSABLE:
        return
    assert error is None, error
    theirs = ds_dir / "zero"
    extra = _param_dirs(theirs) - _param_dirs(ours)
    assert not _param_dirs(ours) - _param_dirs(theirs)
    assert extra == (set() if stage == 3 else (frozen | buffers | tied_aliases))
    for name in extra:
        assert [f.name for f in (theirs / name).iterdir()] == ["fp32.pt"]
    for name in sorted(trainable):
        files = sorted(f.name for f in (ours / name).iterdir())
        dropped = DS_TO_UNIVERSAL_DROPS.get(case.name, set())
        assert sorted(set(files) - dropped) == sorted(f.name for f in (theirs / name).iterdir()), name
        assert files == sorted(
            [f"{k}.pt" for k in case.state_names] + ["fp32.pt"] + ([] if stage == 3 else ["step.pt"])
        )
        for file in sorted(set(files) - dropped):
            a, b = _load(ours / name / file), _load(theirs / name / file)
            if file == "step.pt":
                assert type(a) is type(b) and _plain(a) == _plain(b), (name, a, b)
                assert _plain(a) in _saved(case.checkpoint, case.meta["tag"])["steps"]
                continue
            assert type(a) is type(b), (name, file)
            if isinstance(a, dict):
                assert list(a) == list(b) and a["cat_dim"] == b["cat_dim"], (name, file, list(a), list(b))
            ta, tb = _tensor_of(a), _tensor_of(b)
            assert ta.shape == tb.shape, (name, file, ta.shape, tb.shape)
            assert same_bits(ta.reshape(-1), tb.reshape(-1)), (name, file)

    a, b = _load(ours / "optimizer_state.pt"), _load(theirs / "optimizer_state.pt")
    assert _plain(a["param_groups"]) == _plain(b["param_groups"])
    for key in ("dynamic_loss_scale", "overflow", "clip_grad", "partition_count", "zero_stage", "ds_version"):
        if key in b:
            assert _plain(a[key]) == _plain(b[key]), key
    if "loss_scaler" in b:
        assert type(a["loss_scaler"]) is type(b["loss_scaler"]) and vars(a["loss_scaler"]) == vars(b["loss_scaler"])
    if stage == 3:
        ours_state, their_state = a["optimizer_state_dict"], b["optimizer_state_dict"]
        assert _plain(ours_state["param_groups"]) == _plain(their_state["param_groups"])
        assert sorted(ours_state["state"]) == sorted(their_state["state"])
        for i, sub in their_state["state"].items():
            assert _plain(ours_state["state"][i]["step"]) == _plain(sub["step"]), i


@pytest.mark.parametrize(
    "case", [s for s in SAMPLE_LIST if s.name not in DS_TO_UNIVERSAL_UNUSABLE], ids=lambda s: s.name
)
def test_consolidate_of_ds_universal_equals_consolidate_of_original(
    ds_universal: dict, case: Sample, tmp_path: Path
) -> None:
    ds_dir, error = ds_universal[case.name]
    assert error is None, error
    consolidate(ds_dir, tmp_path / "from_universal")
    consolidate(case.checkpoint, tmp_path / "from_original")
    ours, original = load_output(tmp_path / "from_universal"), load_output(tmp_path / "from_original")
    assert sorted(ours) == sorted(original)
    for name, tensor in original.items():
        assert same_bits(ours[name], tensor), name


# --------------------------------------------------------------------------------------
# 6. Training continues from zckpt's universal output as from the original checkpoint
# --------------------------------------------------------------------------------------
def test_universal_resume_continues_like_the_original_run(tmp_path: Path) -> None:
    """z3_fp32_ws2_tied_frozen (ZeRO-3, fp32, 2 ranks) resumed twice and trained 3 more steps on
    the same global batches (ds_probe ``--data global``): the original checkpoint at its own world
    size (2 ranks x 1 micro-batch per step, plain load), and zckpt's universal output at 1 rank
    (1 x 2 micro-batches: gradient_accumulation_steps 2, load_universal).

    Tolerance: none, every loss, master and Adam state after training is compared bit for bit.
    Justification: the two runs compute the same per-micro-batch forward/backward on identical
    parameters (the resume is exact, test 1) and only group the gradient sum differently,
    (g0 + g1) / 2 across ranks versus g0 / 2 + g1 / 2 accumulated on one rank (DeepSpeed scales the
    loss by 1 / gradient_accumulation_steps). With two terms and a power-of-two divisor both are
    exactly rounded to the same fp32 value (IEEE addition is commutative and halving is exact
    away from subnormals), so fp32 training must not diverge by a single bit. A resume that lost
    anything (optimizer states, step counts for Adam's bias correction, a master) changes the
    first update by about lr = 1e-2 per element, which the check below also shows is far from 0.
    BatchNorm running stats are left out: DeepSpeed's universal load does not restore buffers.
    """
    from safetensors.torch import load_file

    name = "z3_fp32_ws2_tied_frozen"
    case = sample(name)
    to_universal(case.checkpoint, tmp_path / "uc")
    steps = 3
    _, _, original = run_probe(name, case.checkpoint, 2, tmp_path / "original", train_steps=steps, data="global")
    _, _, resumed = run_probe(
        name,
        tmp_path / "uc",
        1,
        tmp_path / "resumed",
        load_universal=True,
        train_steps=steps,
        data="global",
        config_override={"gradient_accumulation_steps": 2},
    )
    for state, world, gas in ((original, 2, 1), (resumed, 1, 2)):
        train = state["train"]
        assert (state["world_size"], train["gradient_accumulation_steps"], train["micro_batches_per_step"]) == (
            world,
            gas,
            2,
        )
        assert state["global_steps"] == case.meta["steps"] and train["global_steps_after"] == case.meta["steps"] + steps
        assert all(math.isfinite(x) for row in train["losses_per_microbatch"] for x in row)
    assert resumed["train"]["losses_per_microbatch"] == original["train"]["losses_per_microbatch"]

    buffers = set(case.meta["buffers"])
    for file in ("live_after_train.safetensors", "live_optimizer_after_train.safetensors"):
        a, b = load_file(tmp_path / "original" / file), load_file(tmp_path / "resumed" / file)
        assert sorted(a) == sorted(b)
        for key in a:
            if key not in buffers:
                assert same_bits(b[key], a[key]), (file, key)
    # the steps trained moved the masters by far more than any rounding: the comparison has teeth
    before, after = (
        load_file(tmp_path / "resumed" / "live.safetensors"),
        load_file(tmp_path / "resumed" / "live_after_train.safetensors"),
    )
    moved = max(
        (after[k] - before[k]).abs().max().item() for k in before if k not in buffers and k not in case.meta["frozen"]
    )
    assert moved > 1e-3


# --------------------------------------------------------------------------------------
# 6. What DeepSpeed's universal loaders cannot restore, said before writing (and true)
# --------------------------------------------------------------------------------------
def test_zero3_universal_load_loses_amsgrads_third_moment_and_zero1_keeps_it(tmp_path: Path) -> None:
    """zckpt refuses a ZeRO-3 universal folder of an AMSGrad run (allow_state_loss writes it):
    DeepSpeed's ZeRO-3 loader restores fp32, exp_avg and exp_avg_sq only, and here it indeed
    holds no saved max_exp_avg_sq after the load; its ZeRO-1 loader restores all three."""
    from safetensors.torch import load_file

    case = sample("z3_fp32_ws2_amsgrad")
    live_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    to_universal(case.checkpoint, tmp_path / "u3", allow_state_loss=True)
    _, optim, _ = run_probe(case.name, tmp_path / "u3", 3, tmp_path / "p3", load_universal=True)
    third = [n for n in live_optim if n.endswith(".max_exp_avg_sq")]
    assert third and not any(n in optim and same_bits(optim[n], live_optim[n]) for n in third)
    for name in (n for n in live_optim if not n.endswith(".max_exp_avg_sq")):
        assert same_bits(optim[name], live_optim[name]), name
    result = to_universal(case.checkpoint, tmp_path / "u1", target_stage=1)
    assert result.loss is None
    _, optim, _ = run_probe(case.name, tmp_path / "u1", 3, tmp_path / "p1", stage=1, load_universal=True)
    for name, expected in live_optim.items():
        assert same_bits(optim[name], expected), name


def test_muon_momentum_does_not_survive_a_zero12_universal_load(tmp_path: Path) -> None:
    """DeepSpeed's ZeRO-1/2 universal loader lays momentum_buffer.pt out per element of the
    partition (map_to_flat_opt_states), while Muon keeps the full momentum of each param its
    partition touches: the step after the load narrows past the buffer's end, as zckpt says
    before writing (test_state_loss_is_said_before_writing). reshard keeps it (test_interop.py)."""
    case = sample("z1_bf16_ws2_muon")
    to_universal(case.checkpoint, tmp_path / "u", target_stage=1, allow_state_loss=True)
    with pytest.raises(Exception, match="exceeds dimension size"):
        run_probe(case.name, tmp_path / "u", 2, tmp_path / "pu", load_universal=True, train_steps=1)


def test_muon_under_bf16_optimizer_crosses_a_universal_folder(tmp_path: Path) -> None:
    """BF16_Optimizer keeps Muon's momentum per element of the partition, as its universal loader
    lays momentum_buffer.pt out: to-universal writes the folder without a word, and DeepSpeed at
    another world size holds every master and state as the live engine did, and trains on."""
    name = "z1_bf16_ws3_muon_bf16optimizer"
    case = sample(name)
    result = to_universal(case.checkpoint, tmp_path / "u")
    assert result.loss is None
    live, optim, state = run_probe(name, tmp_path / "u", 2, tmp_path / "probe", load_universal=True, train_steps=1)
    _check_resumed(case, GEN.CASES_BY_NAME[name], live, optim, state, world_size=2, stage=1, universal=True)
    assert state["train"]["global_steps_after"] == case.meta["steps"] + 1
    assert all(math.isfinite(x) for x in state["train"]["losses_mean"])


def test_nadam_loses_mu_product_through_a_universal_folder_and_keeps_it_through_reshard(tmp_path: Path) -> None:
    """NAdam keeps a scalar mu_product beside its step: no universal file holds one DeepSpeed
    reads, and the step after a universal load raises KeyError, as zckpt says before writing.
    reshard to the same new world size resumes it, and a step follows."""
    case = sample("z1_bf16_ws2_nadam")
    to_universal(case.checkpoint, tmp_path / "u", allow_state_loss=True)
    with pytest.raises(Exception, match="mu_product"):
        run_probe(case.name, tmp_path / "u", 3, tmp_path / "pu", load_universal=True, train_steps=1)
    reshard(case.checkpoint, tmp_path / "r", world_size=3)
    _, _, state = run_probe(case.name, tmp_path / "r", 3, tmp_path / "pr", train_steps=1)
    assert state["train"]["global_steps_after"] == case.meta["steps"] + 1
    assert all(math.isfinite(x) for x in state["train"]["losses_mean"])


# --------------------------------------------------------------------------------------
# 7. Layouts DeepSpeed's universal loaders read in one form only: written for the named run
# --------------------------------------------------------------------------------------
def test_moe_universal_folder_for_expert_parallel_1_resumes_at_degree_1(tmp_path: Path) -> None:
    """moe_z1_bf16_ep2_dp4 (4 experts, expert-parallel 2, 4 ranks) written with
    ``--expert-parallel 1`` and loaded with load_universal by a run built with MoE(ep_size=1) at 2
    ranks: DeepSpeed's loader finds each expert by its local id at the loading run's degree (at 1:
    its global id, no EP slicing), so every rank holds every expert's saved master (the sample's
    live engine values), the dense params', the saved step, and saves the saved moments again
    (test_interop_parallel's MoE checks)."""
    from test_interop_parallel import MOE_LOADER, _assert_moe_loaded, _run_deepspeed

    case = sample("moe_z1_bf16_ep2_dp4")
    out = tmp_path / "universal"
    _cli("to-universal", str(case.checkpoint), str(out), "--expert-parallel", "1", "-q")
    loaded = tmp_path / "loaded"
    _run_deepspeed(MOE_LOADER, loaded, 2, out, loaded, case.meta["dtype"], case.meta["zero_stage"], 2, 1, "universal")
    _assert_moe_loaded(case, loaded, 2)


@pytest.mark.parametrize("tp", [0, 2], ids=["plain-zero3-tensor-parallel-1", "autotp-zero3-tp2"])
def test_autotp_zero3_universal_folder_resumes_at_zero3(tp: int, tmp_path: Path) -> None:
    """autotp_z3_bf16_tp2_dp2 (AutoTP at 2 tensor ranks, ZeRO-3, 4 ranks), loaded with
    load_universal by a ZeRO-3 run of 2 ranks: with ``--tensor-parallel 1`` (a plain ZeRO-3
    model's flat files) by the unsharded model without AutoTP at 2 data ranks; by default (DeepSpeed's
    dict files, of which its ZeRO-3 loader cuts each tensor rank's piece by the model's AutoTP map)
    by an AutoTP run at 2 tensor ranks and 1 data rank. Saved again, every param's master and
    moments are ds_to_universal's merge of the original (the sample's
    reference/universal.safetensors), and every group's step the saved one."""
    from test_interop_parallel import TP_LOADER, _assert_holds_the_merged_state, _run_deepspeed

    case = sample("autotp_z3_bf16_tp2_dp2")
    out = tmp_path / "universal"
    _cli("to-universal", str(case.checkpoint), str(out), "-q", *(["--tensor-parallel", "1"] if tp == 0 else []))
    loaded = tmp_path / "loaded"
    dp = 2 // max(tp, 1)
    _run_deepspeed(TP_LOADER, loaded, 2, out, loaded, case.meta["dtype"], 3, dp, tp, "universal")
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)
    from zckpt.deepspeed.reader import open_training_state
    from zckpt.io.materialize import read_tensor
    from zckpt.io.reading import FileReader

    def steps(path: Path) -> list[float]:
        with FileReader() as reader:
            found = [g.scalars["step"] for g in open_training_state(path).groups]
            return [float(s.value if s.tensor is None else read_tensor(reader, s.tensor).item()) for s in found]

    assert set(steps(loaded / "resaved")) == set(steps(case.checkpoint)) == {float(case.meta["global_steps"])}

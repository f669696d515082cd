"""Real DeepSpeed loads zckpt's outputs from real ZeRO-1/2 runs saved with
``zero_optimization.elastic_checkpoint`` (samples z2_bf16_ws2_elastic, z1_fp32_ws3_elastic; issue 35):
a reshard at another world size, written in the elastic layout (ZeRO-1/2; DeepSpeed's elastic loader
re-partitions it, stage_1_and_2.py:3743-3753) or the rigid one (ZeRO-3), and a universal folder
through load_universal. The engine then holds the live masters and Adam moments, the run's step,
and param groups equal to those DeepSpeed saved for the same optimizer config in a rigid run
(z2_fp32_ws1: the elastic files save none).

Runs whose groups no file or config tells (issue 35 leftover), made here by a short script
(``_RUN``): the training script's own optimizer (torch's SGD with momentum, two groups with their
own lr) and DeepSpeed's CPU Lion (two groups with their own lr over the config's). DeepSpeed then
resumes zckpt's reshard at another world size and (the script's optimizer) its universal folder:
every master and state bit for bit as DeepSpeed saved them, the script's groups, and one step on.
(DeepSpeed's FusedLion and FusedLamb do not run on the CPU accelerator: "This op had not been
implemented on CPU backend".)

DeepSpeed's Muon: a run of one group (the config's values) is resharded rigid (ZeRO-2, ZeRO-3) with
the groups its engine built, and resumed bit for bit; a run of the script's own groups is read
exactly and its reshard refused."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from helpers import load_with_stand_ins, same_bits, sample  # noqa: E402
from interop_checks import GEN, _check_loaded, _fresh_buffers  # noqa: E402
from interop_helpers import (  # noqa: E402
    ROOT,
    ds_env,
    ds_python,
    free_port,
    launcher,
    run_logged,
    run_probe,
    shm_leak_safety_net,  # noqa: F401 (autouse fixture)
    torch_extensions_dir,
)
from zckpt.core.errors import LayoutError, ZckptError  # noqa: E402
from zckpt.ops.dcp import to_dcp  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from zckpt.ops.universal import to_universal  # noqa: E402


def _rigid_groups() -> list[dict]:
    """The param groups DeepSpeed saved for torch's AdamW (lr 1e-2, weight_decay 0.01) in a rigid run."""
    rigid = sample("z2_fp32_ws1")
    assert rigid.meta["ds_config"]["optimizer"] == sample("z2_bf16_ws2_elastic").meta["ds_config"]["optimizer"]
    saved = torch.load(
        rigid.checkpoint / rigid.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in saved["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    ]


def _check_elastic(name: str, state: dict, live: dict, optim: dict, world_size: int, stage: int) -> None:
    case = sample(name)
    assert case.meta["ds_config"]["zero_optimization"]["elastic_checkpoint"] is True
    _check_loaded(case, live, optim, state, world_size, stage)
    # the run's step, as the meta says (not as zckpt read it)
    assert [set(g["step"]) for g in state["param_groups"]] == [{float(case.meta["steps"])}]
    assert [_without_group_step(g["hyperparameters"], stage) for g in state["param_groups"]] == _rigid_groups()


def _without_group_step(hyper: dict, stage: int) -> dict:
    """A group's hyperparameters less the ``step`` DeepSpeed's elastic loader sets in every group
    (stage_1_and_2.py:3609-3610): None, as zckpt writes ``base_optimizer_state_step`` for an
    optimizer that keeps its step per param (torch's), which DeepSpeed's loader requires."""
    if stage in (1, 2):
        assert hyper.pop("step") is None
    return hyper


@pytest.mark.parametrize(
    ("name", "world_size", "stage"), [("z2_bf16_ws2_elastic", 3, 2), ("z1_fp32_ws3_elastic", 2, 3)]
)
def test_deepspeed_loads_the_reshard_of_an_elastic_run(name: str, world_size: int, stage: int, tmp_path: Path) -> None:
    case = sample(name)
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    _check_elastic(name, state, live, optim, world_size, stage)


def test_deepspeed_resumes_the_universal_folder_of_an_elastic_run(tmp_path: Path) -> None:
    """load_universal restores no buffers (the fresh model's), the rest as after a reshard."""
    from safetensors.torch import load_file

    name = "z2_bf16_ws2_elastic"
    case = sample(name)
    to_universal(case.checkpoint, tmp_path / "uc")
    live, optim, state = run_probe(name, tmp_path / "uc", 3, tmp_path / "probe", load_universal=True)
    assert (state["world_size"], state["zero_stage"]) == (3, 2)
    assert state["ds_config"]["checkpoint"]["load_universal"] is True
    fresh = _fresh_buffers(GEN.CASES_BY_NAME[name])
    saved_live = case.live()
    assert set(live) == set(saved_live)
    for key, expected in saved_live.items():
        if key in case.meta["buffers"]:
            expected = fresh[key].to(live[key].dtype)
        assert same_bits(live[key], expected), key
    expected_optim = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    assert set(optim) == set(expected_optim)
    for key, expected in expected_optim.items():
        assert same_bits(optim[key], expected), key
    assert state["global_steps"] == case.meta["steps"]
    assert [set(g["step"]) for g in state["param_groups"]] == [{float(case.meta["steps"])}]
    assert [g["hyperparameters"] for g in state["param_groups"]] == _rigid_groups()


# --------------------------------------------------------------------------------------
# runs whose groups no file or config tells: the script's own optimizer, DeepSpeed's CPU Lion
# --------------------------------------------------------------------------------------
_RUN = '''
"""Per rank under torchrun: ROOT MODE OPTIMIZER CHECKPOINT OUT. A ZeRO-2 fp32 run of
make_sample_ckpts' model with two param groups of their own lr (1e-2, 3e-3), saved with
elastic_checkpoint after 3 steps (MODE save), or such a checkpoint loaded (load, load_universal)
and what the engine then holds captured as ds_probe captures it, then one more step. OPTIMIZER
sgd: the script's own torch SGD (momentum 0.9), no optimizer section in the config; lion:
DeepSpeed's CPU Lion (type Lion, lr 1e-3, the optimizer offloaded); muon: DeepSpeed's Muon (its
save also captures what the engine held, Muon's whole-param momenta included); muon_config: Muon
with one group (model.parameters(): the groups are the config's), its groups captured at save and
those a fresh engine built before a load (groups.json). STAGE: the ZeRO stage of the run."""
import importlib.util, json, sys
from pathlib import Path

root, mode, kind, checkpoint, out = Path(sys.argv[1]), *sys.argv[2:4], sys.argv[4], Path(sys.argv[5])
stage = int(sys.argv[6]) if len(sys.argv) > 6 else 2


def module(name):
    spec = importlib.util.spec_from_file_location(name, root / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gen, probe = module("make_sample_ckpts"), module("ds_probe")
import deepspeed, torch
import deepspeed.comm as dist
from safetensors.torch import save_file

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
zero = (("elastic_checkpoint", True),)
if kind == "lion":
    zero += (("offload_optimizer", {"device": "cpu"}),)
if stage == 3:
    zero = (("reduce_scatter", False),)  # stage3.py refuses Muon with it
case = gen.Case(f"elastic_{kind}", "ds19", stage, "fp32", world, groups=kind != "muon_config", zero_extra=zero)
config = gen.ds_config(case)
if kind == "lion":
    config["optimizer"] = {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.01}}
elif kind == "muon":
    config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9}}
elif kind == "muon_config":
    config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01, "adam_lr": 3e-3}}
else:
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True
if mode == "load_universal":
    config["checkpoint"] = {"load_universal": True}
model = gen.build_model(case)
groups = gen.param_groups(model, case)
if kind != "sgd":
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
else:
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
out.mkdir(parents=True, exist_ok=True)
built = probe.group_state(engine, stage)
if mode == "save":
    probe.train(engine, case, rank, 3)
    engine.save_checkpoint(checkpoint)
    if kind.startswith("muon"):
        names_of, params = gen.params_by_identity(engine.module)
        got = probe.capture(engine, stage, names_of, params)
        if rank == 0:
            save_file(got["live"], str(out / "live.safetensors"))
            save_file(got["optim"], str(out / "live_optimizer.safetensors"))
            groups = {"saved": probe.group_state(engine, stage)}
            (out / "groups.json").write_text(json.dumps(groups, default=str))
else:
    engine.load_checkpoint(checkpoint)
    names_of, params = gen.params_by_identity(engine.module)
    got = probe.capture(engine, stage, names_of, params)
    state = {"param_groups": probe.group_state(engine, stage), "global_steps": engine.global_steps, "built": built}
    state["train"] = probe.train(engine, case, rank, 1)
    if rank == 0:
        save_file(got["live"], str(out / "live.safetensors"))
        save_file(got["optim"], str(out / "live_optimizer.safetensors"))
        (out / "state.json").write_text(json.dumps(state, default=str))
dist.barrier()
'''

# the script's groups (make_sample_ckpts.param_groups: decay, no decay), not the config's lr
SCRIPT_LR = [1e-2, 3e-3]


def _run(
    tmp_path: Path, mode: str, kind: str, checkpoint: Path, world_size: int, out: Path, stage: int = 2
) -> tuple[dict, dict, dict]:
    """One launch of ``_RUN``; what the loaded engine held (masters, states, state.json) after a load."""
    from safetensors.torch import load_file

    python = ds_python()
    script = tmp_path / "elastic_run.py"
    script.write_text(_RUN)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher(python), "--nproc-per-node", str(world_size), "--master-port", str(free_port())]
    cmd += [str(script), str(ROOT), mode, kind, str(checkpoint), str(out), str(stage)]
    returncode = run_logged(cmd, ds_env(world_size, python), out / "run.log", 300)
    assert returncode == 0, (out / "run.log").read_text()[-3000:]
    if not (out / "live.safetensors").exists():
        return {}, {}, {}
    if mode == "save":
        return load_file(out / "live.safetensors"), load_file(out / "live_optimizer.safetensors"), {}
    state = json.loads((out / "state.json").read_text())
    return load_file(out / "live.safetensors"), load_file(out / "live_optimizer.safetensors"), state


def _saved_by_deepspeed(tag_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each param's fp32 master and per-element optimizer states as DeepSpeed saved them: its
    slices of every rank's partition, where the file's own param_slice_mappings put them."""

    def rank_of(path: Path) -> int:
        return int(path.name.split("zero_pp_rank_")[1].split("_")[0])

    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    for path in sorted(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"), key=rank_of):
        inner = load_with_stand_ins(path)["optimizer_state_dict"]
        for g, mapping in enumerate(inner["param_slice_mappings"]):
            flat = {"fp32": inner["single_partition_of_fp32_groups"][g]}
            flat.update({k: v for k, v in inner["base_optimizer_state"][g].items() if torch.is_tensor(v) and v.dim()})
            for name, fragment in mapping.items():
                for key, tensor in flat.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(
                        tensor[fragment.start : fragment.start + fragment.numel]
                    )
    return {name: {k: torch.cat(v) for k, v in keys.items()} for name, keys in pieces.items()}


def _check_resumed(saved: dict, live: dict, optim: dict, state: dict, world_size: int, steps: list) -> None:
    """The loaded engine holds every master and state bit for bit as saved, the script's groups
    (lr of its own; DeepSpeed's elastic loader sets each group's step to None, as zckpt wrote
    it), each state's step, and trained one more step."""
    assert saved and {k for v in saved.values() for k in v} - {"fp32"}
    for name, keys in saved.items():
        for key, value in keys.items():
            got = live[name] if key == "fp32" else optim[f"{name}.{key}"]
            assert same_bits(got.flatten(), value), (name, key)
    groups = state["param_groups"]
    assert [g["hyperparameters"]["lr"] for g in groups] == SCRIPT_LR
    assert [g["step"] for g in groups] == [[s] for s in steps]
    assert state["global_steps"] == 3
    train = state["train"]
    assert train["global_steps_after"] == 4 and len(train["losses_per_rank"][0]) == world_size
    assert all(math.isfinite(x) for x in train["losses_per_rank"][0])


def test_deepspeed_resumes_an_elastic_run_of_the_scripts_own_optimizer(tmp_path: Path) -> None:
    """No file or config holds the groups of torch's SGD that the script built: reshard (elastic
    layout) and to-universal leave them to the engine; ZeRO-3 and DCP, which hold them, are
    refused in one line naming what is missing and what works."""
    _run(tmp_path, "save", "sgd", tmp_path / "saved", 2, tmp_path / "save")
    saved = _saved_by_deepspeed(tmp_path / "saved" / "global_step3")
    reshard(tmp_path / "saved", tmp_path / "ws3", world_size=3)
    live, optim, state = _run(tmp_path, "load", "sgd", tmp_path / "ws3", 3, tmp_path / "load")
    _check_resumed(saved, live, optim, state, 3, [None, None])  # torch's SGD keeps no step
    assert [g["hyperparameters"]["step"] for g in state["param_groups"]] == [None, None]
    assert [g["hyperparameters"]["momentum"] for g in state["param_groups"]] == [0.9, 0.9]

    to_universal(tmp_path / "saved", tmp_path / "uc")
    live, optim, state = _run(tmp_path, "load_universal", "sgd", tmp_path / "uc", 3, tmp_path / "load_uc")
    for name, keys in saved.items():  # load_universal sets no group step
        for key, value in keys.items():
            got = live[name] if key == "fp32" else optim[f"{name}.{key}"]
            assert same_bits(got.flatten(), value), (name, key)
    assert [g["hyperparameters"]["lr"] for g in state["param_groups"]] == SCRIPT_LR
    assert state["train"]["global_steps_after"] == 4

    for write in (
        lambda: reshard(tmp_path / "saved", tmp_path / "z3", world_size=2, stage=3),
        lambda: to_dcp(tmp_path / "saved", tmp_path / "dcp"),
    ):
        with pytest.raises(LayoutError) as refused:
            write()
        message = str(refused.value)
        assert "\n" not in message and "elastic_checkpoint" in message and "optimizer section" in message
    assert not (tmp_path / "z3").exists() and not (tmp_path / "dcp").exists()


def test_deepspeed_resumes_the_reshard_of_an_elastic_cpu_lion_run(tmp_path: Path) -> None:
    """DeepSpeed's CPU Lion keeps its step per param and none in its groups, so DeepSpeed cannot
    resume its own elastic files (``_restore_step_from_elastic_checkpoint`` asserts
    base_optimizer_state_step); zckpt's reshard at 3 ranks resumes, with the script's groups."""
    if not any((torch_extensions_dir(ds_python()) / "cpu_lion").glob("*.so")):
        pytest.skip("DeepSpeed's cpu_lion op is not built (a 3-5 minute C++ build)")
    _run(tmp_path, "save", "lion", tmp_path / "saved", 2, tmp_path / "save")
    tag = tmp_path / "saved" / "global_step3"
    assert all(
        "base_optimizer_state_step" not in load_with_stand_ins(p)["optimizer_state_dict"]
        for p in tag.glob("*optim_states.pt")
    )
    saved = _saved_by_deepspeed(tag)
    reshard(tmp_path / "saved", tmp_path / "ws3", world_size=3)
    live, optim, state = _run(tmp_path, "load", "lion", tmp_path / "ws3", 3, tmp_path / "load")
    _check_resumed(saved, live, optim, state, 3, [3, 3])


def test_an_elastic_muon_run_of_the_scripts_own_groups_is_read_exactly_and_not_resharded(tmp_path: Path) -> None:
    """DeepSpeed's Muon keeps each touched param's whole momentum (ZeRO-1/2), which
    elastic_checkpoint cuts by the group's padding like any state (stage_1_and_2.py:3336-3343):
    the cut elements are in the saved storage, and zckpt reads every master and momentum as the
    engine held them. DeepSpeed's elastic loader would give every rank rank 0's momentum
    (:3566-3568), and the script's two groups (own lr) make three flat groups whose values no file
    or config holds: reshard refuses in one line."""
    from zckpt.deepspeed.reader import open_training_state
    from zckpt.io.materialize import read_tensor
    from zckpt.io.reading import FileReader

    live, optim, _ = _run(tmp_path, "save", "muon", tmp_path / "saved", 2, tmp_path / "save")
    tag = tmp_path / "saved" / "global_step3"
    inners = [load_with_stand_ins(p)["optimizer_state_dict"] for p in tag.glob("*optim_states.pt")]
    cut = [
        inner["group_paddings"][g]
        for inner in inners
        for g, group in enumerate(inner["base_optimizer_state"])
        if "momentum_buffer" in group
    ]
    assert any(cut)  # a Muon momentum_buffer was cut
    state = open_training_state(tmp_path / "saved")
    assert any(k.endswith(".momentum_buffer") for k in optim)
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name]), param.name
            assert param.states and all(
                same_bits(read_tensor(reader, source), optim[f"{param.name}.{key}"])
                for key, source in param.states.items()
            ), param.name
    with pytest.raises(LayoutError) as refused:
        reshard(tmp_path / "saved", tmp_path / "ws3", world_size=3)
    assert "\n" not in str(refused.value) and "rank 0's Muon momentum_buffer" in str(refused.value)
    assert not (tmp_path / "ws3").exists()
    with pytest.raises(ZckptError) as refused:  # nor does a universal folder's refusal send the user there
        to_universal(tmp_path / "saved", tmp_path / "uni")
    assert "\n" not in str(refused.value) and "keeps every state" not in str(refused.value), refused.value
    assert not (tmp_path / "uni").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_resumes_the_rigid_reshard_of_an_elastic_muon_run(stage: int, tmp_path: Path) -> None:
    """A Muon run of one group (model.parameters()): its Muon and Adam halves' hyperparameters are
    the config's (engine._muon_param_groups), so zckpt writes them, and the reshard at 3 ranks is
    rigid (ZeRO-2: the elastic loader would give every rank rank 0's momentum; ZeRO-3). DeepSpeed
    loads every master, momentum_buffer and Adam moment bit for bit as the run held them, groups
    equal to those the saving engine held and to those a fresh engine of the config builds (less
    FusedAdam's group step, set at its first step), and trains a step."""
    live, optim, _ = _run(tmp_path, "save", "muon_config", tmp_path / "saved", 2, tmp_path / "save")
    saved_groups = json.loads((tmp_path / "save" / "groups.json").read_text())["saved"]
    if stage == 2:  # DeepSpeed's universal loader lays whole-param momenta out per element: reshard instead
        with pytest.raises(ZckptError) as refused:
            to_universal(tmp_path / "saved", tmp_path / "uni")
        assert "\n" not in str(refused.value) and "`zckpt reshard`" in str(refused.value), refused.value
    reshard(tmp_path / "saved", tmp_path / "ws3", world_size=3, stage=stage)
    inners = [load_with_stand_ins(p)["optimizer_state_dict"] for p in (tmp_path / "ws3").rglob("*optim_states.pt")]
    if stage == 2:
        assert inners and all(isinstance(i["base_optimizer_state"], dict) for i in inners)  # rigid
    got_live, got_optim, state = _run(tmp_path, "load", "muon_config", tmp_path / "ws3", 3, tmp_path / "load", stage)
    assert set(got_live) == set(live) and set(got_optim) == set(optim)
    assert any(k.endswith(".momentum_buffer") for k in optim) and any(k.endswith(".exp_avg") for k in optim)
    for key, value in live.items():
        assert same_bits(got_live[key], value), key
    for key, value in optim.items():
        assert same_bits(got_optim[key].flatten(), value.flatten()), key
    loaded = [g["hyperparameters"] for g in state["param_groups"]]
    assert loaded == [g["hyperparameters"] for g in saved_groups]
    fresh = [g["hyperparameters"] for g in state["built"]]
    assert [{k: v for k, v in g.items() if k != "step"} for g in loaded] == fresh
    assert [g["name"] for g in loaded] == ["muon-params", "adam-params"]
    assert [set(g["step"]) for g in state["param_groups"]] == [{None}, {3}]  # Muon keeps no step
    assert state["global_steps"] == 3
    train = state["train"]
    assert train["global_steps_after"] == 4 and all(math.isfinite(x) for x in train["losses_per_rank"][0])

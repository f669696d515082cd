"""Pipeline-parallel and mixture-of-experts checkpoints against DeepSpeed's own modules (issue 19).
Needs DeepSpeed: ``pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_parallel.py``.

A mixture-of-experts checkpoint is consolidated under the names of the model built with every
expert on one rank (``MoE(ep_size=1)``); DeepSpeed builds that model and loads the file with
``strict=True`` in the same run as the one-stage pipeline models.

zckpt consolidates a 2-stage pipeline checkpoint under the names the model's ``state_dict()`` has
when built as one stage. Here DeepSpeed builds that model (the samples' PipelineModule with
``num_stages=1``, from scripts/make_parallel_ckpts.py) and loads the consolidated file with
``strict=True``: its keys, in its order, are the independent fact. One single-process run (~10 s).

``zckpt reshard`` of a pipeline checkpoint to another data-parallel size (same stages) or to one
stage is loaded by DeepSpeed's PipelineEngine with a plain ``load_checkpoint``, and what the
engine then holds (``safe_get_full_fp32_param`` per stage, the Adam moments where DeepSpeed's API
gives them, the step) is compared with what the saving run held. Four runs of 1-4 ranks (~60 s).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import MOE_SAMPLES, PIPELINE_SAMPLES, ROOT, Sample

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ds_env,
    ds_python,
    free_port,
    launcher,
    run_logged,
    shm_leak_safety_net,
)
from zckpt import consolidate, reshard, to_universal  # noqa: E402
from zckpt.core.topology import Topology  # noqa: E402
from zckpt.deepspeed.reader import open_checkpoint, open_training_state  # noqa: E402
from zckpt.io.materialize import read_tensor  # noqa: E402
from zckpt.io.reading import FileReader  # noqa: E402

WORKER = r"""
import json, sys
from pathlib import Path

import deepspeed
from safetensors.torch import load_file

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_moe, build_pipeline

deepspeed.init_distributed(dist_backend="gloo")
out = Path(sys.argv[2])
for name in sys.argv[3:]:
    if name.startswith("moe_"):  # every expert on this one rank
        module = build_moe(Case(name, 1, "fp32", pp=1, dp=1, ep=1))
    else:
        module = build_pipeline(Case(name, 1, "fp32", pp=1, dp=1))
    weights = load_file(str(out / name / "model.safetensors"))
    missing, unexpected = module.load_state_dict(weights, strict=True)
    (out / name / "one_stage.json").write_text(json.dumps({"keys": list(module.state_dict()), "loaded": True}))
"""


LOADER = r"""
import json, sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
from safetensors.torch import save_file

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_pipeline, capture_live, ds_config

checkpoint, out, dtype, pp, dp = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
universal, plain = "universal" in sys.argv[7:], "plain" in sys.argv[7:]  # plain: the model without tied or frozen layers
deepspeed.init_distributed(dist_backend="gloo")
case = Case("load", 1, dtype, pp=pp, dp=dp, plain=plain)
model = build_pipeline(case)
config = ds_config(case)
if universal:
    config["checkpoint"] = {"load_universal": True}
engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
)
path, client = engine.load_checkpoint(str(checkpoint))
assert path is not None, "load_checkpoint found nothing"
live, optim, note = capture_live(engine)
if engine.grid.data_parallel_id == 0:
    save_file(live, str(out / f"live_stage{engine.stage_id}.safetensors"))
    if optim is not None:
        save_file(optim, str(out / f"optim_stage{engine.stage_id}.safetensors"))
if dist.get_rank() == 0:
    facts = {"global_steps": engine.global_steps, "optim": note, "parts": [int(p) for p in model.parts]}
    (out / "engine.json").write_text(json.dumps(facts))
engine.save_checkpoint(str(out / "resaved"))  # what the engine loaded, as DeepSpeed saves it
dist.barrier()
"""


def _run_deepspeed(code: str, out: Path, world: int, *args: object) -> None:
    """`code` as a script under torchrun at `world` ranks in the DeepSpeed venv, with
    scripts/ (make_parallel_ckpts) and `args` on its command line; fails the test with its log."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "script.py"
    # every rank passed the script's last barrier: leave at once, as ds_probe.py does (torch 2.13's
    # gloo threads can abort the interpreter's exit, "terminate called without an active
    # exception", which torchrun reports as a failed run: seen here under load)
    script.write_text(code + "\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
    python = ds_python()
    cmd = [*launcher(python), "--nproc-per-node", str(world), "--master-port", str(free_port())]
    cmd += [str(script), str(ROOT / "scripts"), *map(str, args)]
    log = out / "run.log"
    returncode = run_logged(cmd, ds_env(world, python), log, timeout=600)
    if returncode != 0:
        pytest.fail(
            f"DeepSpeed run: exit {returncode}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )


# (sample, data-parallel ranks per stage, stages of the output): another dp size, and one stage
RESHARDS = [
    ("pp2_z1_bf16_dp2", 1, None),
    ("pp2_z1_fp32_dp1", 2, None),
    ("pp2_z1_bf16_dp2", 2, 1),
    ("pp2_z1_fp32_dp1", 1, 1),
]


@pytest.mark.parametrize("name, dp, stages", RESHARDS, ids=[f"{n}-dp{d}-pp{s or 2}" for n, d, s in RESHARDS])
def test_deepspeed_resumes_a_resharded_pipeline_checkpoint(
    tmp_path: Path, name: str, dp: int, stages: int | None
) -> None:
    case = next(s for s in PIPELINE_SAMPLES if s.name == name)
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=dp, pipeline_stages=stages)
    pp = stages or case.meta["pp"]
    loaded = tmp_path / "loaded"
    _run_deepspeed(LOADER, loaded, pp * dp, out, loaded, case.meta["dtype"], pp, dp)
    _assert_holds_the_saved_state(case, loaded, pp)


# (sample, stages and data-parallel ranks of the loading run): fewer stages, more, the same
UNIVERSAL_LOADS = [("pp2_z1_bf16_dp2", 1, 2), ("pp2_z1_fp32_dp1", 2, 2), ("pp2_z1_bf16_dp2", 2, 1)]


@pytest.mark.parametrize("name, pp, dp", UNIVERSAL_LOADS, ids=[f"{n}-pp{p}-dp{d}" for n, p, d in UNIVERSAL_LOADS])
def test_deepspeed_resumes_the_universal_checkpoint_of_a_pipeline_run(
    tmp_path: Path, name: str, pp: int, dp: int
) -> None:
    """``to-universal`` of a pipeline run, loaded by DeepSpeed's PipelineEngine with
    ``load_universal`` at another number of stages or data ranks: the engine holds the saved
    masters, moments and step. DeepSpeed's universal load skips the module (frozen params and
    buffers keep the values the loading run built, as for any universal checkpoint: README), so
    the trainable params are compared."""
    case = next(s for s in PIPELINE_SAMPLES if s.name == name)
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out)
    loaded = tmp_path / "loaded"
    _run_deepspeed(LOADER, loaded, pp * dp, out, loaded, case.meta["dtype"], pp, dp, "universal")
    trainable = {p.name for p in open_training_state(case.checkpoint).params}
    _assert_holds_the_saved_state(case, loaded, pp, trainable)


# a ZeRO-0 pipeline run (no tied or frozen layers; 6 layers, 2 stages): (how, stages and data ranks
# of the loading run); 3 stages: cut by --layer-partition as the loading run's PipelineModule
# (partition_method "uniform") cuts them
ZERO0_PIPELINE_LOADS = [("reshard", 2, 1), ("reshard", 1, 2), ("reshard", 3, 1), ("universal", 1, 2)]
UNIFORM_PARTS = {3: (0, 2, 4, 6)}


@pytest.mark.parametrize(
    "how, pp, dp", ZERO0_PIPELINE_LOADS, ids=[f"{h}-pp{p}-dp{d}" for h, p, d in ZERO0_PIPELINE_LOADS]
)
def test_deepspeed_resumes_a_zero0_pipeline_run(tmp_path: Path, how: str, pp: int, dp: int) -> None:
    """A ZeRO-0 PipelineModule run, whose files name no stage's params (zckpt finds the one cut of
    the layer files the stages' optimizers match): resharded as ZeRO-1 at its stages, as one
    stage and as three (its layers cut anew), and as a universal folder, loaded by DeepSpeed's
    PipelineEngine (ZeRO-1), holding the live engine's masters and moments and the step."""
    from helpers import sample

    case = sample("pp2_z0_fp32_dp2_untied")
    out = tmp_path / "converted"
    if how == "universal":
        to_universal(case.checkpoint, out)
    elif pp in UNIFORM_PARTS:
        reshard(case.checkpoint, out, world_size=dp, stage=1, layer_partition=UNIFORM_PARTS[pp])
    else:
        reshard(case.checkpoint, out, world_size=dp, stage=1, pipeline_stages=None if pp == 2 else pp)
    loaded = tmp_path / "loaded"
    extra = ["plain", *(["universal"] if how == "universal" else [])]
    _run_deepspeed(LOADER, loaded, pp * dp, out, loaded, "fp32", pp, dp, *extra)
    if pp in UNIFORM_PARTS:  # the loading run cut its layers where zckpt was told they are cut
        assert json.loads((loaded / "engine.json").read_text())["parts"] == list(UNIFORM_PARTS[pp])
    _assert_holds_the_saved_state(case, loaded, pp)


def _assert_holds_the_saved_state(case: Sample, loaded: Path, pp: int, only: set[str] | None = None) -> None:
    """What the loading engine held (per stage; of the names in `only` if given), its step, and
    the optimizer state it saved again, against the saving run's: the live values, the live
    moments where DeepSpeed's API gave them, else the sample's own files."""
    from safetensors.torch import load_file

    from helpers import same_bits

    truth = case.live()
    held: dict = {}
    for stage in range(pp):
        for key, value in load_file(loaded / f"live_stage{stage}.safetensors").items():
            assert key not in held or same_bits(held[key], value), key  # a tied copy per stage, equal
            held[key] = value
    assert sorted(held) == sorted(truth)
    if only is not None:
        assert only and only <= set(truth)
        truth = {key: value for key, value in truth.items() if key in only}
    for key, value in truth.items():
        assert same_bits(held[key], value), key
    engine = json.loads((loaded / "engine.json").read_text())
    assert engine["global_steps"] == case.meta["global_steps"]
    resaved = open_training_state(loaded / "resaved")
    original = open_training_state(case.checkpoint)
    moments = case.folder / "reference" / "live_optimizer.safetensors"
    saved = load_file(moments) if moments.exists() else None
    with FileReader() as reader:
        for param in original.params:
            again = resaved.param(param.name)
            for key, source in param.states.items():
                value = read_tensor(reader, again.states[key]).reshape(param.shape)
                expected = saved[f"{param.name}.{key}"] if saved else read_tensor(reader, source).reshape(param.shape)
                assert same_bits(value, expected), (param.name, key)
        step = read_tensor(reader, resaved.groups[0].scalars["step"].tensor)
        assert step.item() == case.meta["global_steps"]


MOE_LOADER = r"""
import json, sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param
from safetensors.torch import save_file

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_moe, ds_config, expert_global_name

checkpoint, out, dtype, stage, dp, ep = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:8])
deepspeed.init_distributed(dist_backend="gloo")
case = Case("load", stage, dtype, pp=1, dp=dp, ep=ep, grad_accum=1)
model = build_moe(case)
groups = split_params_into_different_moe_groups_for_optimizer(
    {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"}
)
config = ds_config(case)
if sys.argv[8:] == ["universal"]:
    config["checkpoint"] = {"load_universal": True}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
path, client = engine.load_checkpoint(str(checkpoint))
assert path is not None, "load_checkpoint found nothing"
live = {}
for name, p in engine.module.named_parameters():
    live[expert_global_name(name, p, case.experts, ep)] = safe_get_full_fp32_param(p).detach().float().clone()
save_file(live, str(out / f"live_rank{dist.get_rank()}.safetensors"))
if dist.get_rank() == 0:
    (out / "engine.json").write_text(json.dumps({"global_steps": engine.global_steps}))
engine.save_checkpoint(str(out / "resaved"))
dist.barrier()
"""

# (sample, ranks of the loading run, its ZeRO stage; None: the sample's): the same experts over twice
# or half the ranks; a ZeRO-0 run's (the torch optimizer's state by index, per expert rank) as ZeRO-2
MOE_RESHARDS = [
    ("moe_z2_fp32_ep2_dp2", 4, None),
    ("moe_z1_bf16_ep2_dp4", 2, None),
    ("moe_z0_fp32_ep2_dp2", 4, 2),
    ("moe_z0_bf16_ep2_dp2", 4, 1),
]


@pytest.mark.parametrize("universal", [False, True], ids=["plain", "universal"])
@pytest.mark.parametrize("name, world, stage", MOE_RESHARDS, ids=[f"{n}-to-{w}" for n, w, _ in MOE_RESHARDS])
def test_deepspeed_resumes_a_resharded_moe_checkpoint(
    tmp_path: Path, name: str, world: int, stage: int | None, universal: bool
) -> None:
    """DeepSpeed refuses another data-parallel size itself ("used a DP world size of ..."); zckpt's
    reshard at the same expert-parallel degree is loaded plainly, and its universal folder with
    load_universal (each expert param's folder the expert ranks' copies stacked, which DeepSpeed's
    loader slices by expert rank), with every expert's master and moments as saved."""
    from helpers import sample

    case = sample(name)
    out = tmp_path / "converted"
    meta = case.meta
    if universal:
        stage = to_universal(case.checkpoint, out).target_stage  # a ZeRO-0 run's: for ZeRO-1
    else:
        reshard(case.checkpoint, out, world_size=world, stage=stage)
    loaded = tmp_path / "loaded"
    extra = ["universal"] if universal else []
    load_stage = meta["zero_stage"] if stage is None else stage
    _run_deepspeed(MOE_LOADER, loaded, world, out, loaded, meta["dtype"], load_stage, world, meta["ep"], *extra)
    _assert_moe_loaded(case, loaded, world)


def _assert_moe_loaded(case: Sample, loaded: Path, world: int) -> None:
    """The loading run held every expert's and dense param's saved master on each rank (under
    global expert ids), the saved step, and resaved the saved moments."""
    from safetensors.torch import load_file

    from helpers import same_bits

    truth = case.live()
    held = set()
    for rank in range(world):
        for key, value in load_file(loaded / f"live_rank{rank}.safetensors").items():
            assert same_bits(value, truth[key].float()), (rank, key)
            held.add(key)
    assert held == {n for n in truth if n not in case.meta["buffers"]}  # every expert on some rank
    assert json.loads((loaded / "engine.json").read_text())["global_steps"] == case.meta["global_steps"]
    resaved, original = open_training_state(loaded / "resaved"), open_training_state(case.checkpoint)
    with FileReader() as reader:
        for param in original.params:
            again = resaved.param(param.name)
            for key, source in param.states.items():
                assert same_bits(read_tensor(reader, again.states[key]), read_tensor(reader, source)), (param.name, key)


# (sample, ranks of the loading run, its expert-parallel degree, its ZeRO stage; None: the sample's)
MOE_DEGREES = [
    ("moe_z2_fp32_ep2_dp2", 2, 1, None),
    ("moe_z2_fp32_ep2_dp2", 4, 4, None),
    ("moe_z1_bf16_ep2_dp4", 4, 4, None),
    ("moe_z0_fp32_ep2_dp2", 4, 4, 1),
]


@pytest.mark.parametrize(
    "name, world, ep, stage", MOE_DEGREES, ids=[f"{n}-to-ep{e}-of-{w}" for n, w, e, _ in MOE_DEGREES]
)
def test_deepspeed_resumes_a_moe_checkpoint_at_another_expert_parallel_degree(
    tmp_path: Path, name: str, world: int, ep: int, stage: int | None
) -> None:
    """The move no DeepSpeed tool makes (its universal loader finds experts by local id, so a
    universal folder loads at its own degree only): zckpt lays each expert out on the expert rank
    that holds it at the new degree, and a plain load_checkpoint of a run built with
    MoE(ep_size=E) holds every expert's master and moments as saved."""
    from helpers import sample

    case = sample(name)
    out = tmp_path / "converted"
    reshard(case.checkpoint, out, world_size=world, stage=stage, expert_parallel=ep)
    loaded = tmp_path / "loaded"
    load_stage = case.meta["zero_stage"] if stage is None else stage
    _run_deepspeed(MOE_LOADER, loaded, world, out, loaded, case.meta["dtype"], load_stage, world, ep)
    _assert_moe_loaded(case, loaded, world)


TP_LOADER = r"""
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_llama, ds_config

checkpoint, out, dtype, stage, dp, tp = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:8])
deepspeed.init_distributed(dist_backend="gloo")
case = Case("load", stage, dtype, pp=1, dp=dp, tp=tp, grad_accum=1)  # tp 0: the model unsharded
model = build_llama(case)
config = ds_config(case)
if sys.argv[8:] == ["universal"]:
    config["checkpoint"] = {"load_universal": True}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
path, client = engine.load_checkpoint(str(checkpoint))
assert path is not None, "load_checkpoint found nothing"
engine.save_checkpoint(str(out / "resaved"))  # what the engine loaded, as DeepSpeed saves it
dist.barrier()
"""

# (sample, data-parallel ranks and ZeRO stage of the loading run): the same tensor ranks over more
# or fewer data ranks, at the run's stage or another
TP_RESHARDS = [
    ("autotp_z1_fp32_tp2", 2, 1),
    ("autotp_z2_bf16_tp2_dp2", 1, 2),
    ("autotp_z3_bf16_tp2_dp2", 1, 3),
    ("autotp_z1_fp32_tp2", 2, 3),
]


@pytest.mark.parametrize("name, dp, stage", TP_RESHARDS, ids=[f"{n}-to-dp{d}-z{z}" for n, d, z in TP_RESHARDS])
def test_deepspeed_resumes_a_resharded_autotp_checkpoint(tmp_path: Path, name: str, dp: int, stage: int) -> None:
    """zckpt's reshard of an AutoTP checkpoint to another data-parallel size (and ZeRO stage),
    loaded by DeepSpeed's AutoTP engine with a plain load_checkpoint and saved again: every param's
    merged master and moments are DeepSpeed's own merge of the original (ds_to_universal's)."""
    from helpers import TENSOR_PARALLEL_SAMPLES

    case = next(s for s in TENSOR_PARALLEL_SAMPLES if s.name == name)
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=dp, stage=stage)
    loaded = tmp_path / "loaded"
    meta = case.meta
    _run_deepspeed(TP_LOADER, loaded, dp * meta["tp"], out, loaded, meta["dtype"], stage, dp, meta["tp"])
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


# (sample, tensor ranks (0: unsharded) and data ranks of the loading run)
TP_UNIVERSAL_LOADS = [("autotp_z1_fp32_tp2", 2, 2), ("autotp_z2_bf16_tp2_dp2", 0, 2)]


@pytest.mark.parametrize("name, tp, dp", TP_UNIVERSAL_LOADS, ids=[f"{n}-tp{t}-dp{d}" for n, t, d in TP_UNIVERSAL_LOADS])
def test_deepspeed_resumes_the_universal_checkpoint_of_an_autotp_run(
    tmp_path: Path, name: str, tp: int, dp: int
) -> None:
    """``to-universal`` of an AutoTP checkpoint (written unsharded), loaded with ``load_universal``
    by DeepSpeed's AutoTP engine at another data-parallel size, and by the unsharded model's
    engine: saved again, every param's master and moments are DeepSpeed's own merge of the
    original (ds_to_universal's)."""
    from helpers import TENSOR_PARALLEL_SAMPLES

    case = next(s for s in TENSOR_PARALLEL_SAMPLES if s.name == name)
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out)
    loaded = tmp_path / "loaded"
    meta = case.meta
    world = dp * max(tp, 1)
    _run_deepspeed(TP_LOADER, loaded, world, out, loaded, meta["dtype"], meta["zero_stage"], dp, tp, "universal")
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


MEGATRON_LOADER = r"""
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, sys.argv[1])
import make_parallel_ckpts
from make_parallel_ckpts import Case, MegatronMpu, build_megatron, ds_config, megatron_checkpoint_info

checkpoint, out, dtype, stage, dp, tp = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:8])
for arg in sys.argv[8:]:
    if arg.startswith("vocab="):  # the vocabulary padded to these rows, as a run with other padding settings pads it
        make_parallel_ckpts.padded_vocab = lambda tp, rows=int(arg[6:]): rows
deepspeed.init_distributed(dist_backend="gloo")
case = Case("load", stage, dtype, pp=1, dp=dp, mtp=tp, grad_accum=1)
mpu = MegatronMpu(tp)
model = build_megatron(case, mpu)
config = ds_config(case)
if "universal" in sys.argv[8:]:
    config["checkpoint"] = {"load_universal": True}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
path, client = engine.load_checkpoint(str(checkpoint))
assert path is not None, "load_checkpoint found nothing"
# what the engine loaded, as DeepSpeed saves it (with the merge rules, as Megatron-DeepSpeed saves them)
engine.save_checkpoint(str(out / "resaved"), client_state={"universal_checkpoint_info": megatron_checkpoint_info(tp)})
dist.barrier()
"""


@pytest.mark.parametrize("universal", [False, True], ids=["resharded-zero1", "universal"])
def test_deepspeed_cuts_a_megatron_zero0_run_back_into_its_live_slices(tmp_path: Path, universal: bool) -> None:
    """A Megatron-style run at ZeRO-0 (ds_to_universal finds no optimizer files there): zckpt's
    ZeRO-1 reshard, and its universal folder (each param merged by the patterns, DeepSpeed's loader
    cutting each tensor rank's slice by them), loaded by DeepSpeed with the same mpu at 2 tensor
    ranks; saved again, every slice's master and moments are what that rank's live engine held (the
    vocabulary's padding rows aside in the universal case: a universal folder holds the vocabulary cut
    to original_vocab_size, and DeepSpeed's loader pads it with zeros again)."""
    from helpers import assert_slices_are_live, sample

    case = sample("megatron_z0_fp32_tp2")
    original_vocab = int(case.meta["model"]["megatron_gpt"].split()[1])  # "vocab 23 padded to 24, ..."
    out = tmp_path / "converted"
    if universal:
        to_universal(case.checkpoint, out)
    else:
        reshard(case.checkpoint, out, world_size=1, stage=1)
    loaded = tmp_path / "loaded"
    _run_deepspeed(MEGATRON_LOADER, loaded, 2, out, loaded, "fp32", 1, 1, 2, *(["universal"] if universal else []))
    resaved = open_training_state(loaded / "resaved")
    assert resaved.global_steps == case.meta["global_steps"] and len(resaved.tensor_shards) == 2
    vocabulary = ("embed.word_embeddings.weight", "lm_head.weight")
    assert_slices_are_live(resaved, case, dict.fromkeys(vocabulary, original_vocab) if universal else None)


def _megatron(name: str) -> Sample:
    from helpers import MEGATRON_SAMPLES

    return next(s for s in MEGATRON_SAMPLES if s.name == name)


# (sample, data-parallel ranks and ZeRO stage of the loading run)
MEGATRON_RESHARDS = [
    ("megatron_z1_fp32_tp2", 2, 1),
    ("megatron_z2_bf16_tp2_dp2", 1, 2),
    ("megatron_z3_fp32_tp2_dp2", 1, 3),
    ("megatron_z3_fp32_tp2_dp2", 2, 1),
]


@pytest.mark.parametrize(
    "name, dp, stage", MEGATRON_RESHARDS, ids=[f"{n}-to-dp{d}-z{z}" for n, d, z in MEGATRON_RESHARDS]
)
def test_deepspeed_resumes_a_resharded_megatron_checkpoint(tmp_path: Path, name: str, dp: int, stage: int) -> None:
    """zckpt's reshard of a Megatron-style tensor-parallel checkpoint (an mpu, merge patterns) to
    another data-parallel size, loaded by DeepSpeed with the same mpu and a plain load_checkpoint,
    saved again: every param's merged master and moments are ds_to_universal's merge of the
    original."""
    case = _megatron(name)
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=dp, stage=stage)
    loaded = tmp_path / "loaded"
    meta = case.meta
    _run_deepspeed(MEGATRON_LOADER, loaded, dp * meta["tp"], out, loaded, meta["dtype"], stage, dp, meta["tp"])
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


# (sample, data-parallel ranks and ZeRO stage of the loading run, which has no tensor parallelism)
ONE_TENSOR_RANK = [
    ("autotp_z2_bf16_tp2_dp2", 2, 2),
    ("megatron_z1_fp32_tp2", 1, 1),
    ("megatron_z3_fp32_tp2_dp2", 2, 3),
]


@pytest.mark.parametrize("name, dp, stage", ONE_TENSOR_RANK, ids=[f"{n}-to-tp1-dp{d}" for n, d, _ in ONE_TENSOR_RANK])
def test_deepspeed_resumes_a_tensor_parallel_run_resharded_to_one_tensor_rank(
    tmp_path: Path, name: str, dp: int, stage: int
) -> None:
    """``reshard --tensor-parallel 1``: the unsharded model's plain checkpoint, loaded with a plain
    load_checkpoint by DeepSpeed running the model without AutoTP (the AutoTP run), or with the
    mpu at one tensor rank (the Megatron-style run; its vocabulary at 23 rows, unpadded); saved
    again, every param's master and moments are ds_to_universal's merge of the original."""
    from helpers import MEGATRON_SAMPLES, TENSOR_PARALLEL_SAMPLES

    case = next(s for s in TENSOR_PARALLEL_SAMPLES + MEGATRON_SAMPLES if s.name == name)
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=dp, tensor_parallel=1)
    loaded = tmp_path / "loaded"
    meta = case.meta
    if name.startswith("autotp"):
        _run_deepspeed(TP_LOADER, loaded, dp, out, loaded, meta["dtype"], stage, dp, 0)
    else:
        _run_deepspeed(MEGATRON_LOADER, loaded, dp, out, loaded, meta["dtype"], stage, dp, 1)
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


def test_deepspeed_resumes_a_megatron_run_at_one_tensor_rank_with_its_vocabulary_padded(tmp_path: Path) -> None:
    """``--tensor-parallel 1 --padded-vocab-size 24``: a new run that pads the vocabulary (23 rows)
    to 24 at one tensor rank, as Megatron pads to a multiple of its divisor, loads the plain
    checkpoint; saved again, the vocabulary params hold the saving run's 24 rows (its two ranks'
    live slices, the padding row included) and every other param ds_to_universal's merge."""
    case = _megatron("megatron_z1_fp32_tp2")
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=1, padded_vocab_size=24)
    loaded = tmp_path / "loaded"
    _run_deepspeed(MEGATRON_LOADER, loaded, 1, out, loaded, "fp32", 1, 1, 1, "vocab=24")
    from helpers import assert_padded_vocabulary_is_live

    assert_padded_vocabulary_is_live(open_training_state(loaded / "resaved"), case)


def test_deepspeed_resumes_a_megatron_run_at_four_tensor_ranks_and_its_own_files_back_at_two(tmp_path: Path) -> None:
    """The move DeepSpeed's offline reshape does not make (it only shrinks the degree):
    ``reshard --tensor-parallel 4`` of the 2-rank run, loaded plainly by DeepSpeed with the mpu at 4
    tensor ranks; saved again, each rank's slices are the model's own cut at 4 ranks of what the run
    held (its vocabulary's padding row included). Those files, DeepSpeed's own 4-rank checkpoint,
    resharded to 2 ranks (2 data ranks, ZeRO-2) and loaded there; saved again, each rank's slices
    are what the first run's live engine held, and the merge is ds_to_universal's."""
    from helpers import assert_megatron_slices, assert_slices_are_live

    case = _megatron("megatron_z1_fp32_tp2")
    out = tmp_path / "tp4"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=4)
    loaded = tmp_path / "loaded_tp4"
    _run_deepspeed(MEGATRON_LOADER, loaded, 4, out, loaded, "fp32", 1, 1, 4)
    assert_megatron_slices(open_training_state(loaded / "resaved"), case, 4)
    back = tmp_path / "tp2"
    reshard(loaded / "resaved", back, world_size=2, stage=2, tensor_parallel=2)
    again = tmp_path / "loaded_tp2"
    _run_deepspeed(MEGATRON_LOADER, again, 4, back, again, "fp32", 2, 2, 2)
    assert_slices_are_live(open_training_state(again / "resaved"), case)
    _assert_holds_the_merged_state(case, again / "resaved", 2)


# (sample, tensor ranks and data ranks of the loading run)
MEGATRON_UNIVERSAL_LOADS = [
    ("megatron_z1_fp32_tp2", 2, 2),
    ("megatron_z2_bf16_tp2_dp2", 1, 2),
    ("megatron_z3_fp32_tp2_dp2", 2, 1),
]


@pytest.mark.parametrize(
    "name, tp, dp", MEGATRON_UNIVERSAL_LOADS, ids=[f"{n}-tp{t}-dp{d}" for n, t, d in MEGATRON_UNIVERSAL_LOADS]
)
def test_deepspeed_resumes_the_universal_checkpoint_of_a_megatron_run(
    tmp_path: Path, name: str, tp: int, dp: int
) -> None:
    """``to-universal`` of a Megatron-style tensor-parallel checkpoint, loaded with
    ``load_universal`` by DeepSpeed with an mpu of another data-parallel size, and of one tensor
    rank (vocabulary 23 rows, not padded to 24): saved again, every param's master and moments are
    ds_to_universal's merge of the original (DeepSpeed cut each rank's slice by the merge rule
    zckpt wrote beside each tensor)."""
    case = _megatron(name)
    out = tmp_path / "universal"
    stage = min(case.meta["zero_stage"], 2)  # a ZeRO-3 run's for a ZeRO-1/2 one (the loader that cuts slices)
    to_universal(case.checkpoint, out, target_stage=stage)
    loaded = tmp_path / "loaded"
    _run_deepspeed(MEGATRON_LOADER, loaded, tp * dp, out, loaded, case.meta["dtype"], stage, dp, tp, "universal")
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


AVERAGED_LAYERNORMS = r"""
import sys, torch
from pathlib import Path
layernorms = r"layers\.\d+\.input_layernorm\.(weight|bias)"
for path in sorted(Path(sys.argv[1]).glob("global_step3/*model_states.pt")):
    saved = torch.load(path, weights_only=False)
    saved["universal_checkpoint_info"]["tp_replicated_parameter_patterns"].remove(layernorms)
    saved["universal_checkpoint_info"]["parameter_to_average_patterns"] = [layernorms]
    torch.save(saved, path)
"""


@pytest.mark.parametrize("rules_from", ["checkpoint", "tp-rules-file", "averaging-rules"])
def test_the_universal_files_of_a_megatron_run_are_ds_to_universals(tmp_path: Path, rules_from: str) -> None:
    """Every per-param file of zckpt's universal folder holds what ds_to_universal's holds: the
    same keys in the same order (cat_dim, param_n_sub_params, sub_param_shape, vocab_tensor,
    param), equal rule objects and the same tensor bits (torch.load of both); the same when the
    rules come from a --tp-rules JSON file (a copy of the checkpoint without them), and when they
    average the LayerNorms instead of replicating them (ds_to_universal's mean of equal copies)."""
    import os
    import shutil
    import subprocess

    case = _megatron("megatron_z1_fp32_tp2")
    source = case.checkpoint
    if rules_from == "averaging-rules":
        source = tmp_path / "averaged"
        shutil.copytree(case.checkpoint, source)
        subprocess.run(
            [ds_python(), "-c", AVERAGED_LAYERNORMS, str(source)],
            check=True,
            env=ds_env(1, ds_python()),
            capture_output=True,
        )
    theirs = tmp_path / "theirs"
    subprocess.run(
        [
            ds_python(),
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(source / "global_step3"),
            "--output_folder",
            str(theirs),
        ],
        check=True,
        env=ds_env(1, ds_python()),
        capture_output=True,
        cwd=tmp_path,
    )
    ours = tmp_path / "ours"
    if rules_from != "tp-rules-file":
        to_universal(source, ours)
    else:
        stripped = tmp_path / "stripped"
        shutil.copytree(case.checkpoint, stripped)
        strip = r"""
import json, sys, torch
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("global_step3/*model_states.pt")):
    saved = torch.load(path, weights_only=False)
    rules = saved.pop("universal_checkpoint_info")
    torch.save(saved, path)
Path(sys.argv[2]).write_text(json.dumps(rules))
"""
        subprocess.run(
            [ds_python(), "-c", strip, str(stripped), str(tmp_path / "rules.json")],
            check=True,
            env=ds_env(1, ds_python()),
            capture_output=True,
        )
        to_universal(stripped, ours, tp_rules=tmp_path / "rules.json")
    compare = r"""
import os, sys, torch
theirs, ours = sys.argv[1], sys.argv[2]
names = sorted(n for n in os.listdir(os.path.join(theirs, "zero")) if os.path.isdir(os.path.join(theirs, "zero", n)))
assert names == sorted(n for n in os.listdir(os.path.join(ours, "zero")) if os.path.isdir(os.path.join(ours, "zero", n)))
for name in names:
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        a = torch.load(os.path.join(theirs, "zero", name, state + ".pt"), weights_only=False)
        b = torch.load(os.path.join(ours, "zero", name, state + ".pt"), weights_only=False)
        assert list(a) == list(b), (name, state, list(a), list(b))
        for key in a:
            if key == "param":
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (name, state)
            else:
                assert type(a[key]) is type(b[key]) and vars(a[key]) == vars(b[key]) if hasattr(a[key], "__dict__") else a[key] == b[key], (name, state, key)
print("same", len(names))
"""
    done = subprocess.run(
        [ds_python(), "-c", compare, str(theirs), str(ours / "global_step3_universal")],
        env=ds_env(1, ds_python()),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "same 22" in done.stdout, done.stdout + done.stderr
    assert os.path.isdir(theirs / "zero")


PIPE_MEGATRON_LOADER = r"""
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_pipeline_megatron, ds_config, pipeline_megatron_patterns

checkpoint, out, pp, tp, dp = Path(sys.argv[2]), Path(sys.argv[3]), *map(int, sys.argv[4:7])
flags = sys.argv[7:]  # "universal", "tied" (the model ties its embedding to the head), "bf16"
deepspeed.init_distributed(dist_backend="gloo")
case = Case(
    "load", 1, "bf16" if "bf16" in flags else "fp32", pp=pp, dp=dp, mtp=tp, tied="tied" in flags,
    coupled_wd="coupled_wd" in flags,
)
model = build_pipeline_megatron(case)
config = ds_config(case)
if "universal" in flags:
    config["checkpoint"] = {"load_universal": True}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
path, client = engine.load_checkpoint(str(checkpoint))
assert path is not None, "load_checkpoint found nothing"
engine.save_checkpoint(str(out / "resaved"), client_state={"universal_checkpoint_info": pipeline_megatron_patterns(tp)})
dist.barrier()
"""

# (pipeline stages, tensor ranks, data ranks of the loading run)
PIPE_TENSOR_UNIVERSAL_LOADS = [(1, 2, 1), (2, 1, 2)]


@pytest.mark.parametrize(
    "pp, tp, dp", PIPE_TENSOR_UNIVERSAL_LOADS, ids=[f"pp{p}-tp{t}-dp{d}" for p, t, d in PIPE_TENSOR_UNIVERSAL_LOADS]
)
def test_deepspeed_resumes_the_universal_checkpoint_of_a_pipeline_tensor_run(
    tmp_path: Path, pp: int, tp: int, dp: int
) -> None:
    """``to-universal`` of the 2-stage x 2-tensor-rank checkpoint, loaded with ``load_universal``
    by DeepSpeed's PipelineEngine as one stage of 2 tensor ranks, and as 2 stages of 1 tensor rank
    over 2 data ranks: saved again, every param's master and moments are ds_to_universal's merge
    of the original."""
    from helpers import PIPELINE_TENSOR_SAMPLES

    case = PIPELINE_TENSOR_SAMPLES[0]
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out)
    loaded = tmp_path / "loaded"
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, pp * tp * dp, out, loaded, pp, tp, dp, "universal")
    _assert_holds_the_merged_state(case, loaded / "resaved", dp)


def test_deepspeed_resumes_a_resharded_pipeline_tensor_checkpoint(tmp_path: Path) -> None:
    """zckpt's reshard of the 2-stage x 2-tensor-rank checkpoint to 2 data ranks, loaded by
    DeepSpeed's PipelineEngine (8 ranks) with a plain load_checkpoint, saved again: masters and
    moments as saved."""
    from helpers import PIPELINE_TENSOR_SAMPLES

    case = PIPELINE_TENSOR_SAMPLES[0]
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=2)
    loaded = tmp_path / "loaded"
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, 8, out, loaded, 2, 2, 2)
    _assert_holds_the_merged_state(case, loaded / "resaved", 2)


# (the output's layer partition, as the loading PipelineModule's "uniform" method cuts 4 layers)
PIPE_TENSOR_CUTS = [(0, 2, 3, 4)]  # (one stage: the tensor-degree test below cuts it so too)


@pytest.mark.parametrize("parts", PIPE_TENSOR_CUTS, ids=[f"pp{len(p) - 1}-tp2" for p in PIPE_TENSOR_CUTS])
def test_deepspeed_resumes_a_pipeline_tensor_checkpoint_at_another_stage_count(
    tmp_path: Path, parts: tuple[int, ...]
) -> None:
    """zckpt's reshard of the 2-stage x 2-tensor-rank checkpoint into 3 stages at its 2 tensor
    ranks (``--layer-partition``), loaded by DeepSpeed's PipelineEngine built at that stage count
    with a plain load_checkpoint, saved again: masters and moments as saved, at the new stages."""
    from helpers import PIPELINE_TENSOR_SAMPLES

    case = PIPELINE_TENSOR_SAMPLES[0]
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=1, layer_partition=parts)
    loaded = tmp_path / "loaded"
    stages = len(parts) - 1
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, stages * 2, out, loaded, stages, 2, 1)
    _assert_holds_the_merged_state(case, loaded / "resaved", 1)
    assert open_checkpoint(loaded / "resaved").topology.pp == stages


# (tensor ranks and layer partition of the output and the loading run: one stage at 4; 2 stages at 1: the
# tied run's test below)
PIPE_TENSOR_DEGREES = [(4, (0, 4))]


@pytest.mark.parametrize(
    "tp, parts", PIPE_TENSOR_DEGREES, ids=[f"tp{t}-pp{2 if p is None else len(p) - 1}" for t, p in PIPE_TENSOR_DEGREES]
)
def test_deepspeed_resumes_a_pipeline_tensor_checkpoint_at_another_tensor_degree(
    tmp_path: Path, tp: int, parts: tuple[int, ...] | None
) -> None:
    """zckpt's reshard of the 2-stage x 2-tensor-rank checkpoint to 4 tensor ranks as one stage,
    every layer file and ZeRO file cut again, loaded by DeepSpeed's
    PipelineEngine built at that layout with a plain load_checkpoint, saved again: masters and
    moments as saved."""
    from helpers import PIPELINE_TENSOR_SAMPLES

    case = PIPELINE_TENSOR_SAMPLES[0]
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=tp, layer_partition=parts)
    loaded = tmp_path / "loaded"
    stages = 2 if parts is None else len(parts) - 1
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, stages * tp, out, loaded, stages, tp, 1)
    _assert_holds_the_merged_state(case, loaded / "resaved", 1)
    assert open_checkpoint(loaded / "resaved").topology == Topology(pp=stages, tp=tp, dp=1)


@pytest.mark.parametrize("pp, tp", [(1, 2)], ids=["pp1-tp2"])
def test_deepspeed_resumes_the_universal_checkpoint_of_a_tied_pipeline_tensor_run(
    tmp_path: Path, pp: int, tp: int
) -> None:
    """``to-universal`` of the tied run (where ds_to_universal fails), loaded with ``load_universal``
    by DeepSpeed's PipelineEngine as one stage of 2 tensor ranks: saved again,
    every tensor rank's slices of the stage that holds each layer (the tied module: the first
    stage's, which trained it) are what the saving run's live engine held, masters and moments."""
    from safetensors.torch import load_file

    from helpers import TIED_PIPELINE_TENSOR_SAMPLES, megatron_join, megatron_slice, same_bits

    case = TIED_PIPELINE_TENSOR_SAMPLES[0]
    out = tmp_path / "universal"
    to_universal(case.checkpoint, out)
    loaded = tmp_path / "loaded"
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, pp * tp, out, loaded, pp, tp, 1, "universal", "tied", "bf16")
    resaved = open_training_state(loaded / "resaved")
    reference = case.folder / "reference"
    live = {
        (s, kind): [load_file(reference / f"{kind}_stage{s}_tp{t}.safetensors") for t in range(2)]
        for s in range(2)
        for kind in ("live", "live_optimizer")
    }
    with FileReader() as reader:
        for number, stage in enumerate(resaved.stages):
            for t, shard in enumerate(stage.tensor_shards or [resaved]):
                for param in shard.params:
                    if number != 0 and param.name.startswith("tied_modules."):
                        continue  # a later stage's copy: loaded from the one universal copy, the first stage's
                    held = 1 if param.name.startswith("2.") else 0
                    pairs = [(param.master, "live", param.name)]
                    pairs += [
                        (param.states[k], "live_optimizer", f"{param.name}.{k}") for k in ("exp_avg", "exp_avg_sq")
                    ]
                    for source, kind, key in pairs:
                        whole = megatron_join(param.name, [h[key] for h in live[(held, kind)]])
                        value = read_tensor(reader, source).reshape(param.shape)
                        rows = value.shape[0]  # the vocabulary's: those below 23, DeepSpeed pads with zeros
                        if "word_embeddings" in key:
                            rows = max(0, min(rows, 23 - t * rows))
                        truth = megatron_slice(param.name, whole, tp, t)
                        assert same_bits(value[:rows], truth[:rows]), (number, t, key)


@pytest.mark.parametrize("name", ["pp2_megatron_z1_bf16_tp2_tied", "pp2_megatron_z1_bf16_tp2_tied_adam_coupled_wd"])
@pytest.mark.parametrize("tp", [1], ids=["tp1"])
def test_deepspeed_resumes_a_tied_pipeline_tensor_checkpoint(tmp_path: Path, tp: int, name: str) -> None:
    """The run that ties its embedding to the head across stages (bf16; its head's stage holds a
    LayerNorm copy DeepSpeed never trains there), resharded by zckpt at 1 tensor rank (its own
    layout gives DeepSpeed's files back and 4 ranks the live values: the default tier), loaded by
    DeepSpeed's PipelineEngine built so with a plain load_checkpoint,
    saved again: each stage's tensor ranks hold the model's cut of what that stage's live engine
    held, masters and moments, its own LayerNorm copy included (ds_to_universal fails on the run).
    With coupled weight decay (torch Adam, L2) that copy's moments are nonzero: the previous rule
    (all moments zero) wrote stage 0's copy into stage 1."""
    from helpers import TIED_PIPELINE_TENSOR_SAMPLES, assert_pipeline_slices_are_live

    case = next(s for s in TIED_PIPELINE_TENSOR_SAMPLES if s.name == name)
    out = tmp_path / "resharded"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=tp)
    loaded = tmp_path / "loaded"
    flags = ("tied", "bf16", *(("coupled_wd",) if name.endswith("_coupled_wd") else ()))
    _run_deepspeed(PIPE_MEGATRON_LOADER, loaded, 2 * tp, out, loaded, 2, tp, 1, *flags)
    assert_pipeline_slices_are_live(open_training_state(loaded / "resaved"), case, tp)


def _assert_holds_the_merged_state(case: Sample, resaved_dir: Path, dp: int) -> None:
    from safetensors.torch import load_file

    from helpers import assert_holds_the_merge

    reference = load_file(case.folder / "reference" / "universal.safetensors")
    resaved = open_training_state(resaved_dir)
    assert resaved.index.topology.dp == dp and resaved.global_steps == case.meta["global_steps"]
    assert sorted(p.name for p in resaved.params) == sorted(
        k for k in reference if not k.endswith(("exp_avg", "exp_avg_sq"))
    )
    assert_holds_the_merge(resaved, reference, masters=True)


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each sample consolidated by zckpt, then loaded by the one-stage PipelineModule."""
    out = tmp_path_factory.mktemp("pipeline")
    for case in PIPELINE_SAMPLES + MOE_SAMPLES:
        consolidate(case.checkpoint, out / case.name)
    _run_deepspeed(WORKER, out / "run", 1, out, *(c.name for c in PIPELINE_SAMPLES + MOE_SAMPLES))
    return out


@pytest.mark.parametrize("case", PIPELINE_SAMPLES + MOE_SAMPLES, ids=[s.name for s in PIPELINE_SAMPLES + MOE_SAMPLES])
def test_the_one_stage_model_loads_the_consolidated_weights(one_stage: Path, case: Sample) -> None:
    found = json.loads((one_stage / case.name / "one_stage.json").read_text())
    assert found["loaded"]  # strict: no key missing, none unexpected, every shape right
    assert open_checkpoint(case.checkpoint).names() == found["keys"]

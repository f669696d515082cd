"""Interop: DeepSpeed 0.19.8 features that change what a run saves, not sampled before (issue 35
item 4), each run for real (2 CPU ranks, tests/test_interop/feature_sweep_job.py) and judged
against DeepSpeed's own engines: the live one that saved, and the ones that load zckpt's outputs.

- fp16 with a static ``loss_scale``, ``gradient_clipping``, WarmupLR, random-LTD
  (``data_efficiency.data_routing.random_ltd``: its scheduler state in the model states' ``random_ltd``
  key; ``module`` keys without ``.random_ltd_layer``, ``engine.py:4017-4018``), client state with
  numpy's RNG state (what a curriculum ``data_sampler`` holds, ``data_sampler.py:316-325``): read,
  resharded 2 -> 3 ranks and written universal; DeepSpeed loads both with every master, moment,
  16-bit weight, the static scale, clip, scheduler, random-LTD and client state as saved.
- Muon over a native MoE layer with torch_autocast (its files are an fp32 run's), and Muon in a
  2-stage pipeline: read, resharded to 4 ranks and loaded exactly; to-universal refuses in one
  line (DeepSpeed's universal loader would misread Muon's momentum).
- ``nn.Embedding(sparse=True)``: DeepSpeed trains it only at ZeRO-0 (ZeRO-1/2 fail viewing the
  sparse gradient), where the SGD momentum is a sparse tensor: refused in one line naming it.

Run: ``PYTHONPATH=tests DS_ACCELERATOR=cpu python -m pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_feature_sweep.py``
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.deepspeed]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from helpers import same_bits  # noqa: E402
from interop_helpers import (  # noqa: E402
    ds_env,
    ds_python,
    free_port,
    launcher,
    run_logged,
    shm_leak_safety_net,  # noqa: F401 (autouse fixture)
)
from zckpt.core.errors import ZckptError  # noqa: E402
from zckpt.ops.consolidate import consolidate  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from zckpt.ops.universal import to_universal  # noqa: E402
from zckpt.ops.verify import verify  # noqa: E402

JOB = Path(__file__).with_name("feature_sweep_job.py")


def _job(case: str, out: Path, ranks: int, loads: list[str] | None = None) -> dict[int, dict]:
    """Run the job at `ranks` ranks; its captures by stage (the MoE case: by rank), per load."""
    python = ds_python()
    env = ds_env(ranks, python)
    if loads:
        env["SWEEP_LOADS"] = ",".join(loads)
    cmd = [*launcher(python), "--nproc_per_node", str(ranks), "--master_port", str(free_port()), str(JOB)]
    out.mkdir(parents=True, exist_ok=True)
    rc = run_logged([*cmd, str(out), case], env, out / "log.txt", timeout=300)
    assert rc == 0, (out / "log.txt").read_text()[-4000:]
    captures: dict[int, dict] = {}
    for path in sorted(out.glob("capture_*_stage*.pt")):
        index, stage = (int(p) for p in path.stem.removeprefix("capture_").split("_stage"))
        captures.setdefault(index, {})[stage] = torch.load(path, weights_only=False)
    return captures


def _same_engine(saved: dict, loaded: dict, world_size: int) -> None:
    """The engine that loaded holds bit for bit what the one that saved held."""
    for kind in ("live", "optim", "module"):
        assert saved[kind].keys() == loaded[kind].keys(), kind
        for name, value in saved[kind].items():
            assert same_bits(loaded[kind][name], value), (kind, name)
    for key, value in saved["info"].items():
        if key == "client":  # what load_checkpoint hands back: the saved client state
            continue
        assert loaded["info"][key] == (world_size if key == "world_size" else value), key


def _client_state_as_saved(loaded: dict) -> None:
    client = loaded["info"]["client"]
    assert client["my_epoch"] == 7
    kind, keys, pos, has_gauss, cached = client["np_rng_state"]
    np_random = importlib.import_module("numpy").random
    np_random.seed(5)
    expected = np_random.get_state()
    assert (kind, pos, has_gauss, cached) == (expected[0], *expected[2:])
    assert keys.dtype == expected[1].dtype and (keys == expected[1]).all()


def _consolidated(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    consolidate(checkpoint, out)
    return load_file(next(out.glob("*.safetensors")))


def test_fp16_static_scale_random_ltd_and_client_state(tmp_path: Path) -> None:
    saved = _job("fp16static", tmp_path / "run", 2)[0][0]
    checkpoint = tmp_path / "run" / "ckpt"
    assert saved["info"]["scaler"] == {"cur_scale": 128.0, "dynamic": False}
    assert saved["info"]["random_ltd"]["current_value"] == 8
    report = verify(checkpoint)
    assert report.ok, report.problems
    ours = _consolidated(checkpoint, tmp_path / "fp32")
    for name, value in saved["live"].items():
        assert same_bits(ours[name], value), name
    reshard(checkpoint, tmp_path / "ws3", world_size=3)
    model = torch.load(tmp_path / "ws3" / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["random_ltd"] == saved["info"]["random_ltd"]
    to_universal(checkpoint, tmp_path / "uni")
    loaded = _job("fp16static", tmp_path / "load", 3, [str(tmp_path / "ws3"), f"universal:{tmp_path / 'uni'}"])
    for index in (0, 1):
        _same_engine(saved, loaded[index][0], 3)
        _client_state_as_saved(loaded[index][0])


def test_muon_with_moe_and_torch_autocast(tmp_path: Path) -> None:
    saved = _job("muonmoe", tmp_path / "run", 2)[0]
    checkpoint = tmp_path / "run" / "ckpt"
    module = torch.load(checkpoint / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert {t.dtype for t in module.values()} == {torch.float32}  # torch_autocast saves an fp32 run
    report = verify(checkpoint)
    assert report.ok, report.problems
    ours = _consolidated(checkpoint, tmp_path / "fp32")
    for name, value in saved[0]["live"].items():  # the dense params and expert 0 (rank 0's)
        assert same_bits(ours[name], value), name
    reshard(checkpoint, tmp_path / "ws4", world_size=4)
    loaded = _job("muonmoe", tmp_path / "load", 4, [str(tmp_path / "ws4")])[0]
    for rank in (0, 1):  # ranks 0 and 1 hold experts 0 and 1, as in the run that saved
        _same_engine(saved[rank], loaded[rank], 4)
    with pytest.raises(ZckptError, match="Muon's momentum_buffer"):
        to_universal(checkpoint, tmp_path / "uni")


def test_muon_in_a_pipeline(tmp_path: Path) -> None:
    saved = _job("muonpipe", tmp_path / "run", 2)[0]
    checkpoint = tmp_path / "run" / "ckpt"
    report = verify(checkpoint)
    assert report.ok, report.problems
    ours = _consolidated(checkpoint, tmp_path / "fp32")
    live = {name: value for stage in saved.values() for name, value in stage["live"].items()}
    assert ours.keys() == live.keys()
    for name, value in live.items():
        assert same_bits(ours[name], value), name
    reshard(checkpoint, tmp_path / "dp2", world_size=2)  # 2 stages x 2 data-parallel ranks
    loaded = _job("muonpipe", tmp_path / "load", 4, [str(tmp_path / "dp2")])[0]
    for stage in (0, 1):
        _same_engine(saved[stage], loaded[stage], 4)


def test_sparse_embedding_is_refused_naming_it(tmp_path: Path) -> None:
    _job("sparse", tmp_path / "run", 2)
    checkpoint = tmp_path / "run" / "ckpt"
    with pytest.raises(ZckptError, match=r"sparse tensor \(torch.sparse_coo; nn.Embedding\(sparse=True\)"):
        consolidate(checkpoint, tmp_path / "fp32")
    report = verify(checkpoint)
    assert not report.ok and any("sparse tensor" in p for p in report.problems), report.problems

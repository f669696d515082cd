"""Real DeepSpeed loads zckpt's reshard of a real ZenFlow run (sample z2_bf16_ws2_zenflow, issue 35
item 4) at another world size: its module holds the 16-bit weights DeepSpeed saved (the live
engine's, which ZenFlow leaves off the masters rounded), its optimizer the live masters and states.
A reshard that recomputed them as the masters rounded gave a module 548 of whose 4,323 elements
differ from the saved run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from helpers import same_bits, sample  # noqa: E402
from interop_checks import _check_loaded  # noqa: E402
from interop_helpers import run_probe, shm_leak_safety_net  # noqa: E402,F401 (autouse fixture)
from zckpt.ops.reshard import reshard  # noqa: E402


@pytest.mark.parametrize(("world_size", "stage"), [(3, 2)])
def test_deepspeed_loads_the_saved_zenflow_weights_at_another_world_size(
    tmp_path: Path, world_size: int, stage: int
) -> None:
    case = sample("z2_bf16_ws2_zenflow")
    reshard(case.checkpoint, tmp_path / "out", world_size=world_size, stage=stage)
    live, optim, state = run_probe(case.name, tmp_path / "out", world_size, tmp_path / "probe", stage=stage)
    assert state["optimizer_class"].startswith("ZenFlowZeroOptimizer"), state["optimizer_class"]
    _check_loaded(case, live, optim, state, world_size, stage)
    saved = torch.load(
        case.checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )["module"]
    module = load_file(tmp_path / "probe" / "live_module.safetensors")
    trainable = case.live_params16()
    for name in trainable:
        assert same_bits(module[name], saved[name]), name
    masters = case.live()
    rounded_differ = sum(
        int((saved[n].view(torch.int16) != masters[n].to(torch.bfloat16).view(torch.int16)).sum()) for n in trainable
    )
    assert rounded_differ == 548  # what a recomputing reshard would have put there instead

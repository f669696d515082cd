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
import os
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Sample, same_bits
from zckpt import consolidate, inspect_path
from test_consolidate import load_output

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)


def _generator():
    spec = importlib.util.spec_from_file_location("make_sample_ckpts", ROOT / "scripts" / "make_sample_ckpts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


GEN = _generator()
SIZES = {"vocab": 29, "dim": 43, "hidden": 17, "seed": 7}
CASES = [
    GEN.Case("fresh_z1_bf16_ws3_tied_frozen", "ds19", 1, "bf16", 3, tied=True, frozen=True, **SIZES),
    GEN.Case("fresh_z2_fp16_ws2_groups_frozen", "ds19", 2, "fp16", 2, groups=True, frozen=True, **SIZES),
    GEN.Case("fresh_z3_bf16_ws3_subgroups_tied_frozen", "ds19", 3, "bf16", 3, tied=True, frozen=True, sub_group_size=300, **SIZES),
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
        GEN.generate(case, root, {"ds19": sys.executable, "ds14": DS14_PYTHON or sys.executable}, root)
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

"""zckpt.compat side by side with DeepSpeed's own deepspeed.utils.zero_to_fp32 functions (the
installed package's, called in this process) on the bundled samples: every key DeepSpeed returns
is zckpt's too, same dtype, shape and bits; the only extra keys are the ZeRO-1 frozen params
DeepSpeed drops (zckpt.compat's docstring says so). Needs DeepSpeed:
``DS_ACCELERATOR=cpu PYTHONPATH=tests python -m pytest -m deepspeed -p interop_helpers
tests/test_interop/test_interop_compat.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from helpers import SAMPLE_LIST, Sample, same_bits, sample

pytestmark = [pytest.mark.deepspeed]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from deepspeed.utils import zero_to_fp32 as ds  # noqa: E402

from interop_helpers import sample_generator  # noqa: E402
from zckpt import compat  # noqa: E402
from zckpt.compat import LazyTensor  # noqa: E402

GEN = sample_generator()
# every sample DeepSpeed's functions read (the others: zero_to_fp32.py fails, meta.json says how)
READABLE = [s for s in SAMPLE_LIST if s.has_reference]
# ZeRO-1 (frozen + tied, and bf16 groups), ZeRO-2 with frozen params (bf16, CPU offload), fp16
# ZeRO-2 tied, ZeRO-3 tied + frozen, fp16 ZeRO-3 with sub-groups and frozen, DeepSpeed 0.14's
CONVERTED = [
    "z1_fp32_ws2_frozen_tied",
    "z1_bf16_ws3_groups",
    "z2_bf16_ws3_frozen_groups",
    "z2_bf16_ws2_cpuoffload_frozen",
    "z2_fp16_ws4_tied",
    "z3_fp32_ws2_tied_frozen",
    "z3_fp16_ws4_subgroups_frozen",
    "ds14_z2_bf16_ws3_frozen_tied",
]


def quiet(call: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's function, its progress lines and bars kept out of the test log."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return call(*args, **kwargs)


def extras(case: Sample) -> set[str]:
    """The keys zckpt adds: a ZeRO-1 run's frozen params (DeepSpeed's functions drop them)."""
    return set(case.meta["frozen"]) if case.meta["zero_stage"] == 1 else set()


def assert_same_state(ours: dict, theirs: dict, case: Sample, aliases: bool = True) -> None:
    """Every key of DeepSpeed's in ours, same dtype/shape/bits, same order; with `aliases`, an
    alias the same object as its source where DeepSpeed's is."""
    for name, tensor in theirs.items():
        assert name in ours, name
        assert same_bits(ours[name], tensor), (name, ours[name].dtype, tensor.dtype)
    assert list(ours)[: len(theirs)] == list(theirs)
    assert set(ours) - set(theirs) == extras(case)
    for a in theirs if aliases else ():
        for b in theirs:
            if a < b and theirs[a] is theirs[b]:
                assert ours[a] is ours[b], (a, b)


def readable_by_deepspeed(case: Sample, tmp_path: Path) -> Path:
    """The checkpoint DeepSpeed's functions are given: the sample's own, or for a run saved with
    checkpoint_serialization false a copy whose legacy (non-zip) rank files torch.load +
    torch.save re-wrote as zips (they load the optimizer files with torch.load(mmap=True), which
    refuses legacy files; meta.json's reference_from_zip_copy). zckpt reads the original."""
    if "reference_from_zip_copy" not in case.meta:
        return case.checkpoint
    copy = shutil.copytree(case.checkpoint, tmp_path / "zip_copy")
    for path in copy.rglob("*.pt"):
        torch.save(torch.load(path, map_location="cpu", weights_only=False), path)
    return copy


def test_signatures_are_deepspeeds() -> None:
    for name in (
        "get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint",
        "convert_zero_checkpoint_to_fp32_state_dict",
    ):
        theirs, ours = inspect.signature(getattr(ds, name)), inspect.signature(getattr(compat, name))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.default, p.kind) for p in theirs.parameters.values()
        ], name
    # the newer one: the same but for its dtype default (torch.float32 there, "float32" here)
    theirs = inspect.signature(ds.convert_zero_checkpoint_to_state_dict).parameters
    ours = inspect.signature(compat.convert_zero_checkpoint_to_state_dict).parameters
    assert list(ours) == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in ours if n != "dtype")
    assert theirs["dtype"].default is torch.float32 and ours["dtype"].default == "float32"


@pytest.mark.parametrize("case", READABLE, ids=lambda s: s.name)
def test_state_dict_is_deepspeeds(case: Sample, tmp_path: Path) -> None:
    checkpoint = readable_by_deepspeed(case, tmp_path)
    theirs = quiet(ds.get_fp32_state_dict_from_zero_checkpoint, str(checkpoint))
    ours = compat.get_fp32_state_dict_from_zero_checkpoint(case.checkpoint)
    assert_same_state(ours, theirs, case)
    if case.meta["frozen"]:
        theirs = quiet(ds.get_fp32_state_dict_from_zero_checkpoint, str(checkpoint), exclude_frozen_parameters=True)
        ours = compat.get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, exclude_frozen_parameters=True)
        assert list(ours) == list(theirs) and all(same_bits(ours[n], t) for n, t in theirs.items())


@pytest.mark.parametrize("case", READABLE, ids=lambda s: s.name)
def test_lazy_mode_is_deepspeeds(case: Sample, tmp_path: Path) -> None:
    checkpoint = readable_by_deepspeed(case, tmp_path)
    theirs = quiet(ds.get_fp32_state_dict_from_zero_checkpoint, str(checkpoint), lazy_mode=True)
    ours = compat.get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, lazy_mode=True)
    assert all(isinstance(v, LazyTensor) for v in ours.values())
    for name, value in theirs.items():
        assert tuple(ours[name].shape) == tuple(value.shape) and ours[name].dtype == value.dtype, name
    for a in theirs:  # the same object for an alias, as DeepSpeed's
        for b in theirs:
            if a < b and theirs[a] is theirs[b]:
                assert ours[a] is ours[b], (a, b)
    # materialized one by one (DeepSpeed's plain tensors give themselves back, its pseudo tensors
    # and zckpt's a new tensor each): every key, dtype, shape and bit, the order, the extras
    materialized = ({n: v.contiguous() for n, v in d.items()} for d in (ours, theirs))
    assert_same_state(*materialized, case, aliases=False)


@pytest.mark.parametrize("name", CONVERTED)
def test_load_state_dict_from_zero_checkpoint_is_deepspeeds(name: str) -> None:
    """Two fresh models (the run's own, same seed): each function loads one; their states agree
    bit for bit, in the model's dtype (fp32, and the run's 16-bit dtype)."""
    case = sample(name)
    spec = GEN.CASES_BY_NAME[name]
    for dtype in {torch.float32, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]}:
        theirs = quiet(ds.load_state_dict_from_zero_checkpoint, GEN.build_model(spec).to(dtype), str(case.checkpoint))
        ours = compat.load_state_dict_from_zero_checkpoint(GEN.build_model(spec).to(dtype), case.checkpoint)
        theirs_state, ours_state = theirs.state_dict(), ours.state_dict()
        assert list(ours_state) == list(theirs_state)
        # ZeRO-1 frozen params: DeepSpeed leaves the model's, zckpt loads the checkpoint's; a frozen
        # param never changes in training, so here they agree too
        for key, tensor in theirs_state.items():
            assert same_bits(ours_state[key], tensor), (key, dtype)
        if spec.tied:
            assert ours.lm_head.weight is ours.embed.weight


def files_of(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each weights file's tensors, by file name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as handle:
                found[path.name] = {k: handle.get_tensor(k) for k in handle.keys()}
        elif path.suffix == ".bin":
            found[path.name] = torch.load(path, weights_only=True)
    return found


@pytest.mark.parametrize("shard", ["5GB", "10KB"])
@pytest.mark.parametrize("safe", [False, True], ids=["torch", "safetensors"])
@pytest.mark.parametrize("name", CONVERTED)
def test_convert_writes_deepspeeds_files(tmp_path: Path, name: str, safe: bool, shard: str) -> None:
    """The same file names, each file the same keys (plus ZeRO-1's frozen params, after
    DeepSpeed's tensors) with the same bits, the same index; tied params in safetensors, which
    DeepSpeed refuses ("Some tensors share memory"), written under each name."""
    case = sample(name)
    args = dict(max_shard_size=shard, safe_serialization=safe)
    if safe and case.meta["tied"]:
        with pytest.raises(RuntimeError, match="share memory"):
            quiet(ds.convert_zero_checkpoint_to_fp32_state_dict, str(case.checkpoint), str(tmp_path / "ds"), **args)
        compat.convert_zero_checkpoint_to_fp32_state_dict(case.checkpoint, tmp_path / "zckpt", **args)
        reference = quiet(ds.get_fp32_state_dict_from_zero_checkpoint, str(case.checkpoint))
        ours = {k: v for f in files_of(tmp_path / "zckpt").values() for k, v in f.items()}
        assert set(ours) - set(reference) == extras(case)
        for key, tensor in reference.items():
            expected = tensor.float() if tensor.is_floating_point() else tensor
            assert same_bits(ours[key], expected), key
        return
    quiet(ds.convert_zero_checkpoint_to_fp32_state_dict, str(case.checkpoint), str(tmp_path / "ds"), **args)
    compat.convert_zero_checkpoint_to_fp32_state_dict(case.checkpoint, tmp_path / "zckpt", **args)
    names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert sorted(p.name for p in (tmp_path / "zckpt").iterdir()) == names
    theirs, ours = files_of(tmp_path / "ds"), files_of(tmp_path / "zckpt")
    extra = extras(case)
    for file, tensors in theirs.items():
        assert set(ours[file]) - extra == set(tensors), file
        for key, tensor in tensors.items():
            assert same_bits(ours[file][key], tensor), (file, key)
    assert {k for f in ours.values() for k in f} - {k for f in theirs.values() for k in f} == extra
    if not safe:  # a tied alias is its source's storage, same place, in both
        for file, tensors in theirs.items():
            shared = {(a, b) for a in tensors for b in tensors if a < b and _same_storage(tensors[a], tensors[b])}
            assert shared == {
                (a, b) for a in ours[file] for b in ours[file] if a < b and _same_storage(ours[file][a], ours[file][b])
            }
    for index in (n for n in names if n.endswith(".index.json")):
        theirs_index = json.loads((tmp_path / "ds" / index).read_text())
        ours_index = json.loads((tmp_path / "zckpt" / index).read_text())
        assert {k: v for k, v in ours_index["weight_map"].items() if k not in extra} == theirs_index["weight_map"]
        extra_bytes = sum(t.numel() * t.element_size() for f in ours.values() for k, t in f.items() if k in extra)
        assert ours_index["metadata"]["total_size"] == theirs_index["metadata"]["total_size"] + extra_bytes
    if safe:
        for file in theirs:
            with safe_open(tmp_path / "ds" / file, "pt") as a, safe_open(tmp_path / "zckpt" / file, "pt") as b:
                assert a.metadata() == b.metadata() == {"format": "pt"}


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are one tensor's memory (DeepSpeed's ZeRO-2 files also hold every param as a
    view of one flat storage: views at other places are not aliases)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("dtype", ["bf16", torch.float16])
def test_convert_to_state_dict_in_16_bits_is_deepspeeds(tmp_path: Path, dtype: Any) -> None:
    case = sample("z3_fp16_ws4_subgroups_frozen")
    quiet(ds.convert_zero_checkpoint_to_state_dict, str(case.checkpoint), str(tmp_path / "ds"), dtype=dtype)
    compat.convert_zero_checkpoint_to_state_dict(case.checkpoint, tmp_path / "zckpt", dtype=dtype)
    theirs, ours = files_of(tmp_path / "ds"), files_of(tmp_path / "zckpt")
    assert list(theirs) == list(ours) == ["pytorch_model.bin"]
    assert list(ours["pytorch_model.bin"]) == list(theirs["pytorch_model.bin"])
    assert all(same_bits(ours["pytorch_model.bin"][n], t) for n, t in theirs["pytorch_model.bin"].items())

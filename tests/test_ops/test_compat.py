"""zckpt.compat (DeepSpeed's zero_to_fp32 functions by name) and zckpt.open (keyed lazy access),
against independent facts: each sample's zero_to_fp32.py output (``reference/zero_to_fp32``), the
live engine's values (``reference/live.safetensors``) and the shard layouts DeepSpeed 0.19.8's
convert_zero_checkpoint_to_fp32_state_dict wrote for three samples (recorded below). The same
functions side by side with DeepSpeed's own: tests/test_interop/test_interop_compat.py."""

from __future__ import annotations

import builtins
import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import zckpt
from helpers import ROOT, SAMPLE_LIST, Sample, load_output, same_bits, sample
from zckpt import UsageError, ZckptError, load_state_dict, to_universal
from zckpt.compat import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zckpt.hf.safetensors import TIED_METADATA_KEY
from zckpt.io.reading import FileReader

FROZEN_TIED = "z3_fp32_ws2_tied_frozen"  # ZeRO-3, tied embedding, frozen adapter


def _generator():
    """scripts/make_sample_ckpts.py (the model every sample trained), imported by path."""
    if "make_sample_ckpts" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_sample_ckpts", ROOT / "scripts" / "make_sample_ckpts.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["make_sample_ckpts"]


def _stored(case: Sample) -> torch.dtype:
    """The dtype a frozen param is saved in: the run's 16-bit dtype, or fp32."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.meta["dtype"]]


# --- get_fp32_state_dict_from_zero_checkpoint --------------------------------------------------
def test_state_dict_equals_zero_to_fp32_and_the_live_engine(any_sample: Sample) -> None:
    """Every key zero_to_fp32.py wrote, same bits, in its order; frozen params in their saved
    dtype (DeepSpeed's function's, not its file's fp32); extras: only ZeRO-1 frozen params."""
    ours = get_fp32_state_dict_from_zero_checkpoint(any_sample.checkpoint)
    frozen = set(any_sample.meta["frozen"])
    for name, tensor in any_sample.live().items():  # masters fp32; frozen as saved; buffers widened
        expected = tensor if name in frozen or not tensor.is_floating_point() else tensor.float()
        assert same_bits(ours[name], expected), name
    for alias, source in any_sample.meta["tied"].items():
        assert ours[alias] is ours[source]  # DeepSpeed's: the same tensor object
    if not any_sample.has_reference:
        return
    reference = any_sample.reference()
    for name, tensor in reference.items():
        assert name in ours, name
        value = ours[name].float() if name in frozen else ours[name]  # widening 16 bits is exact
        assert same_bits(value, tensor), name
        if name in frozen:
            assert ours[name].dtype == _stored(any_sample), name
    assert list(ours)[: len(reference)] == list(reference)  # DeepSpeed's order, extras after
    extra = set(ours) - set(reference)
    assert extra <= frozen and (not extra or any_sample.meta["zero_stage"] == 1), extra


def test_exclude_frozen_parameters() -> None:
    case = sample(FROZEN_TIED)
    ours = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, exclude_frozen_parameters=True)
    assert not set(ours) & set(case.meta["frozen"])
    assert set(ours) == set(case.reference()) - set(case.meta["frozen"])


def test_tag_picks_the_tag_folder() -> None:
    case = sample("z2_fp32_ws2_twotags")
    first, last = case.meta["tags"][0], case.meta["tags"][-1]
    older = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, tag=first)
    newer = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint)  # `latest`
    assert (case.checkpoint / "latest").read_text().strip() == last
    assert all(same_bits(newer[n], t) for n, t in case.reference().items())
    assert not all(same_bits(older[n], newer[n]) for n in newer)


@pytest.mark.parametrize("name", [FROZEN_TIED, "z2_bf16_ws3_frozen_groups", "z1_fp32_ws2_frozen_tied"])
def test_lazy_mode(name: str) -> None:
    """LazyTensor for every key, aliases the same object; shape and dtype without reading;
    .contiguous() reads that tensor alone and gives what the eager call gives."""
    case = sample(name)
    eager = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint)
    lazy = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, lazy_mode=True)
    assert list(lazy) == list(eager)
    assert all(isinstance(v, LazyTensor) for v in lazy.values())
    for alias, source in case.meta["tied"].items():
        assert lazy[alias] is lazy[source]
    for key, value in lazy.items():
        assert value.shape == eager[key].shape and value.dtype == eager[key].dtype, key
        tensor = value.contiguous()
        assert same_bits(tensor, eager[key]), key
        assert value.contiguous() is not tensor  # read again: a new tensor each call


def test_lazy_tensor_reads_only_its_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    case = sample(FROZEN_TIED)
    lazy = get_fp32_state_dict_from_zero_checkpoint(case.checkpoint, lazy_mode=True)
    read: list[int] = []
    original = FileReader.read_into

    def counting(self: FileReader, path: str, offset: int, dest: memoryview) -> None:
        read.append(len(dest))
        original(self, path, offset, dest)

    monkeypatch.setattr(FileReader, "read_into", counting)
    tensor = lazy["fc1.weight"].contiguous()
    assert sum(read) == tensor.numel() * 4  # its partitions on both ranks, nothing else


# --- load_state_dict_from_zero_checkpoint ------------------------------------------------------
@pytest.mark.parametrize("name", [FROZEN_TIED, "z2_bf16_ws3_frozen_groups", "z1_fp32_ws2_frozen_tied"])
def test_load_state_dict_into_the_model(name: str) -> None:
    """The sample's own model, freshly built (other values), holds the checkpoint's after the call."""
    case = sample(name)
    gen = _generator()
    model = gen.build_model(gen.CASES_BY_NAME[name]).float()
    returned = load_state_dict_from_zero_checkpoint(model, case.checkpoint)
    assert returned is model
    state = model.state_dict()
    expected = dict(case.reference())
    if case.meta["zero_stage"] == 1:  # DeepSpeed leaves these as the model had them; zckpt loads them
        expected.update({n: case.live()[n].float() for n in case.meta["frozen"]})
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert same_bits(state[key], tensor.to(state[key].dtype)), key


# --- convert_zero_checkpoint_to_fp32_state_dict ------------------------------------------------
@pytest.mark.parametrize("safe", [False, True], ids=["torch", "safetensors"])
def test_convert_writes_zero_to_fp32s_file(tmp_path: Path, safe: bool) -> None:
    case = sample("z2_bf16_ws3_frozen_groups")
    convert_zero_checkpoint_to_fp32_state_dict(case.checkpoint, tmp_path / "out", safe_serialization=safe)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.safetensors" if safe else "pytorch_model.bin"
    ]
    ours, reference = load_output(tmp_path / "out"), case.reference()
    assert (set(ours) == set(reference)) if safe else (list(ours) == list(reference))  # safetensors sorts
    assert all(same_bits(ours[n], t) for n, t in reference.items())


# The shard files DeepSpeed 0.19.8's convert_zero_checkpoint_to_fp32_state_dict wrote for these
# samples with max_shard_size="10KB" (its index json's weight_map, by file; total_size).
DEEPSPEED_SHARDS = {
    (FROZEN_TIED, False): (
        14236,
        {
            "pytorch_model-00001-of-00002.bin": "adapter.0.bias adapter.0.weight adapter.2.bias adapter.2.weight "
            "bn.num_batches_tracked bn.running_mean bn.running_var embed.weight lm_head.weight norm.bias "
            "norm.weight position_ids scale",
            "pytorch_model-00002-of-00002.bin": "bn.bias bn.weight fc1.bias fc1.weight fc2.bias fc2.weight pos.weight",
        },
    ),
    ("z2_bf16_ws3_frozen_groups", True): (
        17640,
        {
            "model-00001-of-00003.safetensors": "adapter.0.bias adapter.0.weight adapter.2.bias adapter.2.weight "
            "bn.num_batches_tracked bn.running_mean bn.running_var embed.weight position_ids scale",
            "model-00002-of-00003.safetensors": "fc1.weight fc2.weight lm_head.weight norm.weight pos.weight",
            "model-00003-of-00003.safetensors": "bn.bias bn.weight fc1.bias fc2.bias norm.bias",
        },
    ),
    # ZeRO-1: DeepSpeed's output lacks the frozen adapter; zckpt adds it after DeepSpeed's tensors
    ("z1_fp32_ws2_frozen_tied", False): (
        10788,
        {
            "pytorch_model-00001-of-00002.bin": "bn.bias bn.num_batches_tracked bn.running_mean bn.running_var "
            "bn.weight embed.weight fc1.bias fc1.weight fc2.weight lm_head.weight norm.bias norm.weight "
            "position_ids scale",
            "pytorch_model-00002-of-00002.bin": "fc2.bias pos.weight",
        },
    ),
}


@pytest.mark.parametrize("name,safe", list(DEEPSPEED_SHARDS), ids=lambda v: str(v))
def test_convert_shards_as_deepspeed_does(tmp_path: Path, name: str, safe: bool) -> None:
    case = sample(name)
    total, files = DEEPSPEED_SHARDS[(name, safe)]
    convert_zero_checkpoint_to_fp32_state_dict(
        case.checkpoint, tmp_path / "out", max_shard_size="10KB", safe_serialization=safe
    )
    index_name = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*files, index_name])
    index = json.loads((tmp_path / "out" / index_name).read_text())
    extra = set(case.meta["frozen"]) if case.meta["zero_stage"] == 1 else set()
    extra_bytes = sum(case.live()[n].numel() * 4 for n in extra)
    assert index["metadata"] == {"total_size": total + extra_bytes}
    for file, names in files.items():
        held = load_output_file(tmp_path / "out" / file)
        assert set(held) - extra == set(names.split()), file
        assert {n for n, f in index["weight_map"].items() if f == file} == set(held), file
    ours, reference = load_output(tmp_path / "out"), case.reference()
    assert all(same_bits(ours[n], t) for n, t in reference.items())
    assert set(ours) - set(reference) == extra


def load_output_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        with safe_open(path, "pt") as handle:
            return {k: handle.get_tensor(k) for k in handle.keys()}
    return torch.load(path, weights_only=True)


def test_convert_tied_as_safetensors_where_deepspeed_fails(tmp_path: Path) -> None:
    """DeepSpeed's convert raises "Some tensors share memory" here; zckpt writes both names."""
    case = sample(FROZEN_TIED)
    convert_zero_checkpoint_to_fp32_state_dict(case.checkpoint, tmp_path / "out", safe_serialization=True)
    ours, reference = load_output(tmp_path / "out"), case.reference()
    assert set(ours) == set(reference) and all(same_bits(ours[n], t) for n, t in reference.items())
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        assert json.loads(handle.metadata()[TIED_METADATA_KEY]) == case.meta["tied"]


def test_convert_in_16_bits_and_unsharded(tmp_path: Path) -> None:
    """convert_zero_checkpoint_to_state_dict's dtype: what DeepSpeed does, fp32 values .to(dtype);
    max_shard_size=None: one file."""
    case = sample(FROZEN_TIED)
    convert_zero_checkpoint_to_state_dict(case.checkpoint, tmp_path / "out", dtype=torch.bfloat16, max_shard_size=None)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["pytorch_model.bin"]
    ours = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    for name, tensor in case.reference().items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert same_bits(ours[name], expected), name
    assert ours["lm_head.weight"].untyped_storage().data_ptr() == ours["embed.weight"].untyped_storage().data_ptr()
    with pytest.raises(ValueError):  # DeepSpeed's ValueError too (zckpt's UsageError is one)
        convert_zero_checkpoint_to_state_dict(case.checkpoint, tmp_path / "x", dtype="int8")


def test_convert_output_places(tmp_path: Path, copy_checkpoint) -> None:
    """`zero_to_fp32.py . out/` (inside the checkpoint folder) works; inside the tag folder is
    refused; writing again replaces the older output, its stale shards included."""
    checkpoint = copy_checkpoint(FROZEN_TIED)
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, checkpoint / "out", max_shard_size="10KB")
    assert len(list((checkpoint / "out").glob("pytorch_model-*.bin"))) == 2
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, checkpoint / "out")
    assert sorted(p.name for p in (checkpoint / "out").iterdir()) == ["pytorch_model.bin"]
    assert zckpt.open(checkpoint).keys()  # the checkpoint still reads as before
    tag = checkpoint / (checkpoint / "latest").read_text().strip()
    with pytest.raises(UsageError, match="inside the input"):
        convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tag / "out")


def test_missing_checkpoint_is_deepspeeds_exception_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nothing")


# --- zckpt.open ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [FROZEN_TIED, "z2_bf16_ws3_frozen_groups", "z3_fp16_ws4_subgroups_frozen"])
def test_open_reads_what_load_state_dict_gives(name: str) -> None:
    case = sample(name)
    whole = load_state_dict(case.checkpoint)
    with zckpt.open(case.checkpoint) as ckpt:
        assert ckpt.keys() == list(whole) == list(ckpt)
        assert len(ckpt) == len(whole) and all(n in ckpt for n in whole) and "nope" not in ckpt
        for key in ckpt.keys():
            assert same_bits(ckpt.get_tensor(key), whole[key]), key
            assert same_bits(ckpt[key], whole[key]), key
        assert ckpt.tied == case.meta["tied"]
        assert {n for n in ckpt if ckpt.kind(n) == "frozen"} == set(case.meta["frozen"])
        meta = ckpt.metadata()
        assert meta["zero_stage"] == str(case.meta["zero_stage"]) and meta["dtype"] == case.meta["dtype"]
        assert meta["world_size"] == str(case.meta["world_size"]) and meta["tag"] == case.meta["tag"]
        assert meta["format"] == "deepspeed-zero" and all(isinstance(v, str) for v in meta.values())


def test_open_dtypes() -> None:
    case = sample("z2_bf16_ws3_frozen_groups")
    live = case.live()
    with zckpt.open(case.checkpoint, dtype="bf16") as ckpt:
        assert same_bits(ckpt.get_tensor("fc1.weight"), live["fc1.weight"].to(torch.bfloat16))  # rounded
        assert ckpt.get_tensor("position_ids").dtype == torch.int64  # integers keep theirs
        assert same_bits(ckpt.get_tensor("fc1.weight", dtype=torch.float32), live["fc1.weight"])  # per call
        assert same_bits(ckpt.get_tensor("adapter.0.weight", dtype=None), live["adapter.0.weight"])  # as saved
        assert ckpt.get_lazy("fc1.weight").dtype == torch.bfloat16
    with zckpt.open(case.checkpoint, dtype=None, device="meta") as ckpt:
        tensor = ckpt.get_tensor("adapter.0.weight")
        assert tensor.is_meta and tensor.dtype == torch.bfloat16
    with pytest.raises(UsageError):
        zckpt.open(case.checkpoint, dtype="int8")


def test_open_a_universal_folder_and_a_tag(tmp_path: Path) -> None:
    case = sample(FROZEN_TIED)
    to_universal(case.checkpoint, tmp_path / "u")
    with zckpt.open(tmp_path / "u") as ckpt:
        assert ckpt.metadata()["format"] == "deepspeed-universal"
        reference = case.reference()
        assert set(ckpt.keys()) == set(reference)
        assert all(same_bits(ckpt.get_tensor(n), t) for n, t in reference.items())
    twotags = sample("z2_fp32_ws2_twotags")
    with zckpt.open(twotags.checkpoint, twotags.meta["tags"][0]) as ckpt:
        assert ckpt.metadata()["tag"] == twotags.meta["tags"][0]


def test_open_errors_and_close(tmp_path: Path) -> None:
    case = sample(FROZEN_TIED)
    ckpt = zckpt.open(case.checkpoint, exclude_frozen=True)
    assert not set(ckpt.keys()) & set(case.meta["frozen"])
    with pytest.raises(KeyError, match="adapter.0.weight"):
        ckpt.get_tensor("adapter.0.weight")
    assert repr(ckpt).endswith(f"{len(ckpt)} tensors>")
    ckpt.close()
    with pytest.raises(ValueError, match="closed"):
        ckpt.get_tensor("fc1.weight")
    assert ckpt.keys()  # what is there stays known
    with pytest.raises(ZckptError):  # no checkpoint there
        zckpt.open(tmp_path)


def test_open_reads_one_tensor_from_threads() -> None:
    case = sample(FROZEN_TIED)
    whole = load_state_dict(case.checkpoint)
    results: dict[str, torch.Tensor] = {}
    with zckpt.open(case.checkpoint) as ckpt:
        threads = [threading.Thread(target=lambda n=n: results.update({n: ckpt.get_tensor(n)})) for n in whole]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(same_bits(results[n], t) for n, t in whole.items())


def test_open_is_in_the_api_but_not_a_star_import() -> None:
    assert "open" in dir(zckpt) and "LazyCheckpoint" in zckpt.__all__
    namespace: dict = {}
    exec("from zckpt import *", namespace)
    assert "open" not in namespace and builtins.open is open


def test_samples_cover_the_claims() -> None:
    """The samples above are what their names say (so the tests test what they claim)."""
    assert any(s.meta["zero_stage"] == 1 and s.meta["frozen"] for s in SAMPLE_LIST)
    assert sample(FROZEN_TIED).meta["tied"] and sample(FROZEN_TIED).meta["frozen"]

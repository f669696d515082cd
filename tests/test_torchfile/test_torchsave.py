"""The torch.save writer: byte-identical to torch's own writer, to DeepSpeed's files, streaming.

The oracles are independent of the code under test: torch.save itself (same objects, same
bytes), the DeepSpeed-written sample files (re-pickled from what zckpt reads back), torch's
``.to()`` for conversions, and the headers of a real 8.6 GB zip64 file written by torch.save.
"""

from __future__ import annotations

import base64
import glob
import json
import math
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import (
    ROOT,
    SAMPLES,
    Source,
    assert_same_objects,
    inline,
    load_with_stand_ins,
    same_bits,
    same_except_serialization_id,
    torch_and_ours,
)
from zckpt.core.dtypes import BF16, BY_NAME, FP16, FP32, from_torch
from zckpt.core.errors import CorruptFileError
from zckpt.core.index import Segment
from zckpt.io.reading import FileReader
from zckpt.torchfile import pickler as torchpickle
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import rebuilds, ziparchive
from zckpt.torchfile import save as torchsave
from zckpt.torchfile.legacy import is_legacy_torch_file
from zckpt.torchfile.save import (
    Copy,
    GlobalName,
    Inline,
    OutStorage,
    OutTensor,
    PickledEnum,
    PickledInstance,
    Zeros,
    archive_name_for,
    plan_archive,
    save,
    torch_size,
    write_archive,
)

# ---------------------------------------------------------------------------------------------
# Helpers


def globals_of(pickle_bytes: bytes) -> set[str]:
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(pickle_bytes) if op.name == "GLOBAL"}


def data_pkl(path: Path | str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def archive_name_in(path: Path | str) -> str:
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()[0].split("/")[0]


# ---------------------------------------------------------------------------------------------
# Against torch.save


def test_byte_identical_to_torch_save_except_the_serialization_id(tmp_path: Path) -> None:
    theirs_obj, ours_obj = torch_and_ours(Source(tmp_path / "source.bin"))
    torch.save(theirs_obj, tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    plan = plan_archive(ours_obj, "theirs")
    with FileReader() as reader:
        write_archive(tmp_path / "ours" / "theirs.pt", plan, reader)
    ours = tmp_path / "ours" / "theirs.pt"
    assert plan.pickle == data_pkl(tmp_path / "theirs.pt")
    assert plan.total_size == ours.stat().st_size
    with zipfile.ZipFile(ours) as archive:
        assert [(i.filename, i.header_offset, i.file_size) for i in archive.infolist()] == [
            (r.name, r.header_offset, r.size) for r in plan.records
        ]
        assert archive.testzip() is None  # every CRC-32 right
    same_except_serialization_id(ours, tmp_path / "theirs.pt")


def test_torch_load_reads_back_the_same_tensors(tmp_path: Path) -> None:
    source = Source(tmp_path / "source.bin")
    theirs_obj, ours_obj = torch_and_ours(source)
    plain = {k: v for k, v in ours_obj["state"].items()}
    save({"state": plain, "lr": 0.5}, tmp_path / "ours.pt")
    loaded = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert loaded["lr"] == 0.5 and list(loaded["state"]) == list(theirs_obj["state"])
    for name, tensor in theirs_obj["state"].items():
        assert same_bits(loaded["state"][name], tensor), name
    assert loaded["state"]["again"] is loaded["state"]["shared"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtypes_torch_pickles_untyped_are_byte_identical(tmp_path: Path) -> None:
    """uint16-64, float8 and complex32 go through _rebuild_tensor_v3 with an UntypedStorage
    (byte count) and the dtype; complex through ComplexFloat/DoubleStorage: as torch writes them."""
    source = Source(tmp_path / "source.bin")
    flagged = torch.tensor([3, 7], dtype=torch.int32).to(torch.uint32)
    flagged.ds_id = 4  # a Python attribute: pickled through _rebuild_from_type_v2
    theirs = OrderedDict(
        u16=torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16),
        u32=torch.tensor([[7, 2**31]], dtype=torch.int64).to(torch.uint32),
        u64=torch.tensor([2**40], dtype=torch.int64).to(torch.uint64),
        e4m3=torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
        e5m2=torch.tensor([0.5, -2.0]).to(torch.float8_e5m2),
        e4m3fnuz=torch.tensor([1.0]).to(torch.float8_e4m3fnuz),
        e5m2fnuz=torch.tensor([1.0]).to(torch.float8_e5m2fnuz),
        c32=torch.tensor([1 + 2j], dtype=torch.complex64).to(torch.complex32),
        c64=torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        c128=torch.tensor([[1 + 2j]], dtype=torch.complex128),
        flagged=flagged,
    )
    ours = OrderedDict(
        (k, source.out(v, attributes={"ds_id": 4} if k == "flagged" else None)) for k, v in theirs.items()
    )
    torch.save(theirs, tmp_path / "theirs.pt")
    plan = plan_archive(ours, "theirs")
    assert plan.pickle == data_pkl(tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    with FileReader() as reader:
        write_archive(tmp_path / "ours" / "theirs.pt", plan, reader)
    same_except_serialization_id(tmp_path / "ours" / "theirs.pt", tmp_path / "theirs.pt")


def test_read_objects_write_back_as_torch_load_reads_them(tmp_path: Path) -> None:
    """What zckpt reads, made writable (the reshard writer's carry) and written: torch.load
    gives for our file what it gives for the file torch.save wrote."""
    import argparse

    from zckpt.deepspeed.writer import carry

    np.random.seed(1)
    module = OrderedDict(w=torch.ones(2))
    module._metadata = {"": {"version": 1}}
    original = {
        "args": argparse.Namespace(
            lr=0.1, dims=[1, 2], dtype=torch.float16, fn=torch.nn.functional.relu, cls=OrderedDict
        ),
        "rng": np.random.get_state(),
        "arrays": [
            np.arange(6.0).reshape(2, 3),
            np.asfortranarray(np.ones((2, 2), np.int16)),
            np.array(["a", "bc"]),
            np.zeros(0),
        ],
        "scalars": (np.float64(0.5), np.int64(-3), np.dtype(">u2")),
        "size": torch.Size([2, 3]),
        "devices": [torch.device("cpu"), torch.device("cuda", 1)],
        "tensors": {
            "f8": torch.tensor([1.0, 2.0]).to(torch.float8_e5m2),
            "u16": torch.tensor([9], dtype=torch.int32).to(torch.uint16),
        },
        "module": module,
        "set": {1, "a"},
        "bytes": b"\x00\xff",
        "builtins": [slice(1, 5), 1 + 2j, bytearray(b"ab"), frozenset({3})],
    }
    torch.save(original, tmp_path / "theirs.pt")
    save(carry(torchfile.load(tmp_path / "theirs.pt")), tmp_path / "ours.pt")
    expected = torch.load(tmp_path / "theirs.pt", weights_only=False)
    got = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert_same_objects(got, expected)
    assert got["args"].fn is torch.nn.functional.relu and got["args"].cls is OrderedDict


def test_instances_built_with_arguments_write_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NEWOBJ arguments (a namedtuple), NEWOBJ_EX keywords (protocol 4), list and dict subclass
    items: what the reader keeps of them, the writer writes back for torch.load."""
    import collections
    import sys
    import types

    from zckpt.deepspeed.writer import carry

    module = types.ModuleType("zckpt_test_writeback")
    Pair = collections.namedtuple("Pair", "a b", module=module.__name__)

    class Items(list):
        pass

    class Table(dict):
        pass

    class Keyword:  # pickled with NEWOBJ_EX (protocol 4): its __new__ takes a keyword
        def __new__(cls, *, size: int) -> "Keyword":
            made = super().__new__(cls)
            made.size = size
            return made

        def __getnewargs_ex__(self) -> tuple:
            return ((), {"size": self.size})

        def __eq__(self, other: object) -> bool:
            return type(other) is type(self) and vars(other) == vars(self)

    for cls in (Pair, Items, Table, Keyword):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    items, table = Items([1, [2]]), Table(a=3)
    items.note = "x"
    original = {"pair": Pair(1, (2, 3)), "items": items, "table": table, "keyword": Keyword(size=4)}
    torch.save(original, tmp_path / "theirs.pt", pickle_protocol=4)
    save(carry(torchfile.load(tmp_path / "theirs.pt")), tmp_path / "ours.pt")
    got = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert got == original and type(got["items"]) is Items and vars(got["items"]) == {"note": "x"}


def test_archive_name_follows_torch(tmp_path: Path) -> None:
    for name in ("model.pt", "a.b.pt", "noext", ".hidden.pt", "ü.pt", "x."):
        torch.save({}, tmp_path / name)
        with zipfile.ZipFile(tmp_path / name) as archive:
            assert archive.namelist()[0] == archive_name_for(tmp_path / name) + "/data.pkl", name
    with pytest.raises(ValueError):
        archive_name_for("/tmp/.hidden")  # torch refuses it too
    with pytest.raises(ValueError):
        plan_archive({}, "a/b")


# ---------------------------------------------------------------------------------------------
# Against DeepSpeed's files


@dataclass(frozen=True, eq=False)
class LoadedTensor:
    """What a tensor of a torch archive is, in full: torchfile's TensorRef drops requires_grad
    and which tensors share a storage, so the test reads them with its own rebuild hooks."""

    storage: Any  # torchfile's storage record (path, offset, dtype, numel)
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    attributes: dict | None = None


class LoadedSize(tuple):
    """A torch.Size (torchfile turns them into plain tuples)."""


@pytest.fixture
def faithful_load(monkeypatch: pytest.MonkeyPatch):
    """torchfile.load, but keeping requires_grad, storage sharing and torch.Size."""

    def rebuild(
        storage: Any, offset: int, size: Any, stride: Any, requires_grad: bool = False, *_: Any
    ) -> LoadedTensor:
        return LoadedTensor(storage, offset, tuple(size), tuple(stride), bool(requires_grad))

    def from_type(func: Any, new_type: Any, args: tuple, state: dict) -> LoadedTensor:
        tensor = func(*args)
        return LoadedTensor(
            tensor.storage, tensor.offset, tensor.shape, tensor.stride, tensor.requires_grad, dict(state)
        )

    monkeypatch.setitem(rebuilds._ALLOWED, ("torch", "Size"), lambda values=(): LoadedSize(values))
    monkeypatch.setitem(rebuilds._ALLOWED, ("torch._utils", "_rebuild_tensor_v2"), rebuild)
    monkeypatch.setitem(rebuilds._ALLOWED, ("torch._tensor", "_rebuild_from_type_v2"), from_type)
    return torchfile.load


def to_writer(obj: Any, memo: dict) -> Any:
    """Turn a loaded tree into writer objects; shared objects stay shared (memo by identity)."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, LoadedTensor):
        record = obj.storage
        key = ("storage", record.path, record.offset)
        if key not in memo:
            memo[key] = OutStorage(
                record.dtype, (Copy(Segment(record.path, record.offset, record.numel), record.dtype),)
            )
        assert obj.stride == torchpickle._contiguous_stride(obj.shape) or math.prod(obj.shape) == 0
        out: Any = OutTensor(record.dtype, obj.shape, (), obj.attributes, obj.requires_grad, memo[key], obj.offset)
    elif isinstance(obj, LoadedSize):
        out = torch_size(tuple(obj))
    elif isinstance(obj, torchfile.ZeroStageEnum):
        out = PickledEnum(GlobalName("deepspeed.runtime.zero.config", "ZeroStageEnum"), int(obj))
    elif isinstance(obj, torchfile.PickledObject):
        module, name = obj.original_class.rsplit(".", 1)
        out = PickledInstance(GlobalName(module, name), to_writer(vars(obj), memo))
    elif type(obj) is OrderedDict:
        out = OrderedDict((k, to_writer(v, memo)) for k, v in obj.items())
        out.__dict__.update({k: to_writer(v, memo) for k, v in vars(obj).items()})  # state_dict's _metadata
    elif type(obj) is dict:
        out = {k: to_writer(v, memo) for k, v in obj.items()}
    elif type(obj) is list:
        out = [to_writer(v, memo) for v in obj]
    elif type(obj) is tuple:
        out = tuple(to_writer(v, memo) for v in obj)
    else:
        return obj
    memo[id(obj)] = out
    return out


SAMPLE_FILES = sorted(glob.glob(str(SAMPLES / "*" / "checkpoint" / "*" / "*.pt")))
REQUIRED = (
    "z2_bf16_ws3_frozen_groups/checkpoint/global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",  # LossScaler, fragment_address
    "z3_fp16_ws4_subgroups_frozen/checkpoint/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",  # ds_id, DynamicLossScaler.dtype
    "z2_bf16_ws3_frozen_groups/checkpoint/global_step3/mp_rank_00_model_states.pt",  # views of one flat buffer, torch.Size
    "ds14_z3_fp32_ws2_subgroups_groups/checkpoint/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",  # __builtin__.set, _metadata
)


def test_samples_cover_the_required_kinds() -> None:
    assert all(str(SAMPLES / name) in SAMPLE_FILES for name in REQUIRED)


@pytest.mark.slow
@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: os.path.relpath(p, SAMPLES))
def test_rewrites_deepspeed_files_byte_for_byte(path: str, tmp_path: Path, faithful_load) -> None:
    tree = to_writer(faithful_load(path), {})
    if is_legacy_torch_file(path):  # checkpoint_serialization false: no zip of DeepSpeed's to match
        assert_legacy_rewrite_holds_the_same(path, tree, tmp_path)
        return
    plan = plan_archive(tree, archive_name_in(path))
    assert plan.pickle == data_pkl(path)
    ours = tmp_path / os.path.basename(path)
    with FileReader() as reader:
        write_archive(ours, plan, reader)
    same_except_serialization_id(ours, Path(path))


def legacy_storage_keys(path: str) -> list[str]:
    """The storage keys of a legacy torch.save file: its fifth pickle (a list of strings)."""
    with open(path, "rb") as handle:
        for _ in range(4):
            for _ in pickletools.genops(handle):
                pass
        keys = pickle.load(handle)
    assert isinstance(keys, list) and all(type(k) is str for k in keys)
    return keys


def assert_legacy_rewrite_holds_the_same(path: str, tree: Any, tmp_path: Path) -> None:
    """A legacy (non-zip) file written again by zckpt (always the zip format, named after the
    file as torch.save names it): torch.load reads the same objects from both, and each storage
    of the legacy file is one record (views stay views)."""
    ours = tmp_path / os.path.basename(path)
    plan = plan_archive(tree, ours.stem)
    with FileReader() as reader:
        write_archive(ours, plan, reader)
    assert len([r for r in plan.records if "/data/" in r.name]) == len(legacy_storage_keys(path))
    assert_same_objects(load_with_stand_ins(ours), load_with_stand_ins(Path(path)))


def test_deepspeed_objects_from_scratch_pickle_with_deepspeed_globals(tmp_path: Path) -> None:
    """Trees built by hand (as a resharding tool builds them) use exactly the GLOBALs DeepSpeed's
    files use, and read back through zckpt's own safe reader as the same objects."""
    source = Source(tmp_path / "source.bin")
    loss_scaler = GlobalName("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    dynamic = GlobalName("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
    stage = GlobalName("deepspeed.runtime.zero.config", "ZeroStageEnum")
    fragment = GlobalName("deepspeed.utils.tensor_fragment", "fragment_address")
    z2 = {
        "optimizer_state_dict": {
            "loss_scaler": PickledInstance(loss_scaler, {"cur_scale": 1.0, "dynamic": False}),
            "zero_stage": PickledEnum(stage, 2),
            "base_optimizer_state": {
                "state": {0: {"step": inline(torch.tensor(3.0)), "exp_avg": source.out(torch.ones(5))}}
            },
            "single_partition_of_fp32_groups": [source.out(torch.arange(5.0))],
            "param_slice_mappings": [OrderedDict(w=PickledInstance(fragment, {"numel": 5, "start": 0}))],
        },
        "ds_version": "0.19.8",
    }
    z3 = {
        "optimizer_state_dict": {
            "zero_stage": PickledEnum(stage, 3),
            "loss_scaler": PickledInstance(dynamic, {"cur_scale": 256, "dynamic": True, "dtype": FP16}),
            "fp32_flat_groups": [source.out(torch.arange(4.0), attributes={"ds_id": "0_7"}, requires_grad=True)],
            "again": PickledEnum(stage, 3),  # enum members are singletons: pickled once
        },
    }
    references = {
        "z2": SAMPLES / REQUIRED[0],
        "z3": SAMPLES / REQUIRED[1],
    }
    for name, tree in (("z2", z2), ("z3", z3)):
        save(tree, tmp_path / f"{name}.pt")
        assert globals_of(data_pkl(tmp_path / f"{name}.pt")) == globals_of(data_pkl(references[name])), name
    z2_back = torchfile.load(tmp_path / "z2.pt")["optimizer_state_dict"]
    assert z2_back["zero_stage"] == torchfile.ZeroStageEnum.gradients
    assert type(z2_back["loss_scaler"]).original_class == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert vars(z2_back["param_slice_mappings"][0]["w"]) == {"numel": 5, "start": 0}
    z3_back = torchfile.load(tmp_path / "z3.pt")["optimizer_state_dict"]
    assert vars(z3_back["loss_scaler"])["dtype"] == FP16 and z3_back["again"] is z3_back["zero_stage"]
    assert z3_back["fp32_flat_groups"][0].attributes == {"ds_id": "0_7"}


# ---------------------------------------------------------------------------------------------
# Conversion, parts, validation


SPECIAL = torch.tensor(
    [
        0.0,
        -0.0,
        1.0,
        -1.5,
        3.14159265,
        1e-40,
        -1e-45,
        65504.0,
        65520.0,
        1e30,
        float("inf"),
        float("-inf"),
        float("nan"),
        1.00390625,
        1.01171875,
        2.0**-24,
        2.0**-25,
        3.0 * 2.0**-26,
        1 + 2.0**-8,
        1 + 3 * 2.0**-9,
    ],
    dtype=torch.float32,
)


def written_tensor(tmp_path: Path, tensor: OutTensor) -> torch.Tensor:
    path = tmp_path / "t.pt"
    save({"t": tensor}, path)
    return torch.load(path, weights_only=True)["t"]


@pytest.mark.parametrize(
    ("source_dtype", "target_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
)
def test_conversion_matches_torch_to(tmp_path: Path, source_dtype: torch.dtype, target_dtype: torch.dtype) -> None:
    values = torch.cat([SPECIAL, torch.randn(1000) * 1000, torch.randn(1000) * 1e-6]).to(source_dtype)
    copy = Source(tmp_path / "source.bin").out(values)
    out = OutTensor(from_torch(target_dtype), copy.shape, copy.parts)
    assert same_bits(written_tensor(tmp_path, out), values.to(target_dtype))


def test_parts_concatenate_across_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchsave, "CHUNK_BYTES", 64)  # many chunks per part, conversions included
    source = Source(tmp_path / "source.bin")
    a = torch.randn(100).to(torch.bfloat16)
    b = torch.randn(37)
    head = source.out(a).parts[0]
    tail = source.out(b).parts[0]
    out = OutTensor(FP32, (10, 30), (head, Zeros(51), Inline(np.float32([7, 8]).tobytes()), Zeros(110), tail))
    expected = torch.cat([a.float(), torch.zeros(51), torch.tensor([7.0, 8.0]), torch.zeros(110), b]).reshape(10, 30)
    assert same_bits(written_tensor(tmp_path, out), expected)


def test_zeros_are_zeros(tmp_path: Path) -> None:
    assert same_bits(
        written_tensor(tmp_path, OutTensor(BF16, (3, 5), (Zeros(15),))), torch.zeros(3, 5, dtype=torch.bfloat16)
    )


def test_shared_storage_views(tmp_path: Path) -> None:
    flat = OutStorage(FP32, (Inline(np.arange(10, dtype=np.float32).tobytes()),))
    state = {
        "w": OutTensor(FP32, (2, 3), (), storage=flat),
        "b": OutTensor(FP32, (4,), (), storage=flat, storage_offset=6),
    }
    plan = plan_archive(state, "x")
    assert list(plan.storages) == ["0"]
    save(state, tmp_path / "x.pt")
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    assert loaded["w"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
    assert loaded["b"].tolist() == [6.0, 7.0, 8.0, 9.0] and loaded["w"].reshape(-1).tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "bad",
    [
        OutTensor(FP32, (2, 3), (Zeros(5),)),  # too few elements
        OutTensor(FP32, (2,), (Zeros(1), Inline(b"\0" * 8))),  # too many
        OutTensor(FP32, (1,), (Inline(b"\0" * 3),)),  # not whole elements
        OutTensor(FP32, (-1,), ()),
        OutTensor(FP32, (3,), (), storage=OutStorage(FP32, (Zeros(4),)), storage_offset=2),  # past the storage
        OutTensor(FP16, (1,), (), storage=OutStorage(FP32, (Zeros(4),))),  # dtype differs from the storage's
    ],
)
def test_inconsistent_tensors_are_refused_at_plan_time(bad: OutTensor) -> None:
    with pytest.raises(ValueError):
        plan_archive({"t": bad}, "x")


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(1), object(), {"k": lambda: 0}, [np.array([1, None], dtype=object)], [np.ma.array([1])], {1: float}],
)
def test_objects_it_cannot_pickle_are_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        plan_archive({"x": bad}, "x")


@pytest.mark.parametrize("module", ["os\nsystem", "", "é", "a b"])
def test_global_names_cannot_smuggle_opcodes(module: str) -> None:
    with pytest.raises(ValueError):
        plan_archive({"x": PickledInstance(GlobalName(module, "C"), {})}, "x")


def test_missing_folder_and_missing_source_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        save({"a": 1}, tmp_path / "missing" / "x.pt")
    gone = OutTensor(FP32, (4,), (Copy(Segment(str(tmp_path / "gone.bin"), 0, 4), FP32),))
    with pytest.raises(CorruptFileError, match="gone.bin"):  # the reader's error, naming the source
        save({"t": gone}, tmp_path / "x.pt")


# ---------------------------------------------------------------------------------------------
# Determinism, progress


def test_same_plan_same_bytes_and_progress_counts_tensor_bytes(tmp_path: Path) -> None:
    _, ours = torch_and_ours(Source(tmp_path / "source.bin"))
    plan, again = plan_archive(ours, "model"), plan_archive(ours, "model")
    assert (plan.pickle, plan.records, plan.total_size) == (again.pickle, again.records, again.total_size)
    seen: list[int] = []
    with FileReader() as reader:
        write_archive(tmp_path / "a.pt", plan, reader, progress=seen.append)
        write_archive(tmp_path / "b.pt", plan, reader)
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert sum(seen) == plan.tensor_bytes == sum(r.size for r in plan.records if r.storage_key is not None)
    (tmp_path / "c.pt").write_bytes(b"stale" * 10_000)  # truncated, not appended to
    save(ours, tmp_path / "c.pt")
    assert (tmp_path / "c.pt").stat().st_size == plan_archive(ours, "c").total_size


# ---------------------------------------------------------------------------------------------
# zip64


# Every byte of an 8.6 GB file written by torch.save (torch 2.13) except the data of its two
# records larger than 4 GiB (zeros): [[offset, hex], ...], zlib + base64. Made by
#   torch.save({'a': torch.arange(3.), 'big1': torch.zeros(2**32 + 5, dtype=torch.uint8),
#               'b': torch.arange(2), 'big2': torch.zeros(2**32 + 7, dtype=torch.uint8),
#               'c': torch.arange(4, dtype=torch.int16)}, 'big.pt')
# It has every zip64 case: a size >= 4 GiB below 4 GiB, small and large records above 4 GiB,
# central directory above 4 GiB.
TORCH_ZIP64_SKELETON_PARTS = (
    "eNrFV1l22zAMvEpevvtBgPtZ8vKh9f5H6AASZWqz7NhppaYitQAzQxCAv77Mn49Pb1xrrHFGjoTzkaMzhoIxgUMOkcfgAkX88RBN",
    "aEPngmNiY3xzfcIhxz4SLsknQ5MD2CO4sLA6Rg42JB78GD3mOXTRmsbLfR84erkTHOYO8yFa+QKzYNk0sMKc1HKcLMdik0IMHs9t",
    "7cU0LsDaKHz86k215W4IrcHcY25nxDaaKPaC6BkdRtETxqpvkicJI9JRThnegBS+OqC2ymsU9EAgPsFF+TknT/Bc/TecPePaqv1O",
    "xz0wuBmDrocV7QZwUea4bhlyzKLVAb+x4gcrIJPwrzEe53SQeCaamK2fCDPiwpEsOKaCmJx+53UcqnWWebyDVdZiCHGPlaposWJF",
    "vIn2rJ6aRXtWNO2Cq1vh6vXtQcfjTkncZbNCl1YaWTynRaNYa8RcaRRrjdgWLOxqLOz1u6DjWGkkXtK5Rh7/y+woYmH5hlasN7NK",
    "uh7cLio5xdMtyPoVskHfHmWMuPfYi/JNNIl9h0Bph76dvJTrT7IKTBt2t6zCQwjKptfdiB0tewL7W3eK5Bg2j+WYe6elwqWNw9h3",
    "yRa9yvVHXJAdbVtzWecdjwyDnY9niO5e85YTRkgiLzN6kn+wrihgxxgjDdnwTIN/roDpEVe2qhFz1glLdlO+47/muz1lFRDdTvJw",
    "0SF52w+Wsgkzl/CCDg104INaOcKQKDD8XwVqqEgt4zRypmgRTdvJppCaX2r/K1rY7lALkt02p47V7tseuu/d+zT7/P7z8eU4O+Q7",
    "JNDSEYF5YxvquKUdIv96flAl2kMlWO3CSu5nm1Qxb38rWvYpbD0tqnSopCjzu+XZzn+sijlURbMyiZV4Pz44zetTqUYP1AmNA/QU",
    "OVvs9ljFQcj9yCjLO8/xTXGQDxm7JQ7GmRFXcZB/Iw4WNqwN7rLmyeXoGx53nNIb1hwRLVWvKLCu8kUDLjm41uDttdLK74qZc09Z",
    "+k6/1EKzromvcCYozcOq01nWHcyl889TfxAbva9aoGfI4RYVzV4RerGWWBCxHifZjBFaeIytZYwtRnIv4h5+pOCewyjrfXkj45qW",
    "M+g3S2clqSw3XeC026t7LalSeKPnWbe51KY7x9lv1SufZ10h2XNfyNJc+7zfyV4hOOvKKJwjyLRFcN1/XuE464qk0zuNdJ5+H593",
    "gVdez/oP09xhHzZeq57ryl+p+uPmEH/kTlh20/5/qq856iLu4NrWXaoqyFn8F+zPdBlXOEo1PNTneRzndX0z39b1y2jd1qz0kl6n",
    "1fgKx66O8K3uPYrjsZp4hWSbhcuVnlDkHZVKcQZslo1PVC/L/XGHcG+OTb2qya7EztpfXPKpnXMHH+xAb8LKT3uzv0Q6js/v77/+",
    "bs7L",
)


def zip64_skeleton() -> list[tuple[int, bytes]]:
    text = "".join(TORCH_ZIP64_SKELETON_PARTS)
    return [(offset, bytes.fromhex(data)) for offset, data in json.loads(zlib.decompress(base64.b64decode(text)))]


def zip64_plan() -> torchsave.ArchivePlan:
    u8 = BY_NAME["uint8"]
    state = {
        "a": inline(torch.arange(3.0)),
        "big1": OutTensor(u8, (2**32 + 5,), (Zeros(2**32 + 5),)),
        "b": inline(torch.arange(2)),
        "big2": OutTensor(u8, (2**32 + 7,), (Zeros(2**32 + 7),)),
        "c": inline(torch.arange(4, dtype=torch.int16)),
    }
    return plan_archive(state, "big")


def skeleton_of(plan: torchsave.ArchivePlan, big_crcs: dict[str, int]) -> list[tuple[int, bytes]]:
    """What write_archive writes, built from the same functions, the data of records >= 4 GiB left out."""
    layouts = ziparchive.layout([(r.name, r.size) for r in plan.records])
    regions, current, start, crcs = [], bytearray(), 0, []
    for record, lay in zip(plan.records, layouts):
        current += ziparchive.local_header(lay)
        if record.name in big_crcs:
            regions.append((start, bytes(current)))
            current, start, crc = bytearray(), lay.data_offset + lay.size, big_crcs[record.name]
        else:
            data = (
                record.content
                if record.content is not None
                else b"".join(p.data for p in plan.storages[record.storage_key].parts)
            )
            current += data
            crc = zlib.crc32(data)
        current += ziparchive.data_descriptor(lay, crc)
        crcs.append(crc)
    current += ziparchive.directory(layouts, crcs)
    regions.append((start, bytes(current)))
    return regions


def test_zip64_layout_matches_torchs_own_8gb_file() -> None:
    torch_regions = zip64_skeleton()
    plan = zip64_plan()
    assert plan.total_size == torch_regions[-1][0] + len(torch_regions[-1][1])
    # The CRC of each big record is the first field of its data descriptor, right after its data.
    big_crcs = {
        "big/data/1": struct.unpack_from("<I", torch_regions[1][1], 4)[0],
        "big/data/3": struct.unpack_from("<I", torch_regions[2][1], 4)[0],
    }
    ours = skeleton_of(plan, big_crcs)
    assert [offset for offset, _ in ours] == [offset for offset, _ in torch_regions]
    id_record = plan.records[-1]
    torch_id = torch_regions[-1][1][id_record.data_offset - torch_regions[-1][0] :][:40]
    for (offset, mine), (_, theirs) in zip(ours, torch_regions):
        mine = mine.replace(id_record.content, torch_id)
        mine = mine.replace(struct.pack("<I", zlib.crc32(id_record.content)), struct.pack("<I", zlib.crc32(torch_id)))
        assert mine == theirs, offset


def test_zip64_archive_reads_back_through_zipfile_and_torchfile(tmp_path: Path) -> None:
    """The planned 8.6 GB archive, its big records left as holes of a sparse file: zipfile and
    zckpt's reader find every record where the plan put it."""
    plan = zip64_plan()
    path = tmp_path / "big.pt"
    with open(path, "wb") as handle:
        handle.truncate(plan.total_size)
        for offset, data in skeleton_of(plan, {"big/data/1": 0, "big/data/3": 0}):
            handle.seek(offset)
            handle.write(data)
    if path.stat().st_blocks * 512 > 1 << 30:
        pytest.skip("this filesystem does not keep sparse files sparse")
    with zipfile.ZipFile(path) as archive:
        assert [(i.filename, i.header_offset, i.file_size) for i in archive.infolist()] == [
            (r.name, r.header_offset, r.size) for r in plan.records
        ]
        assert archive.read("big/data/4") == np.arange(4, dtype=np.int16).tobytes()
    state = torchfile.load(path)
    assert state["big2"].shape == (2**32 + 7,) and state["big2"].offset == plan.records[7].data_offset


@pytest.mark.parametrize(
    ("size", "header_offset", "zip64"),
    [(0xFFFFFFFE, 0, False), (0xFFFFFFFF, 0, True), (10, 0xFFFFFFFE, False), (10, 0xFFFFFFFF, True), (0, 2**33, True)],
)
def test_zip64_threshold_is_minizs(size: int, header_offset: int, zip64: bool) -> None:
    (lay,) = ziparchive.layout([("x/data/0", size)], start=header_offset)
    header = ziparchive.local_header(lay)
    assert lay.zip64 == zip64 and lay.data_offset % 64 == 0
    assert (header[30 + 8 : 32 + 8] == b"\x01\x00") == zip64  # the zip64 field comes first
    assert len(ziparchive.data_descriptor(lay, 0)) == (0 if size == 0 else 24 if zip64 else 16)


# ---------------------------------------------------------------------------------------------
# Memory


MEMORY_SCRIPT = r"""
import os, resource, sys
from zckpt.core.dtypes import BF16, FP32
from zckpt.core.index import Segment
from zckpt.io.reading import FileReader
from zckpt.torchfile.save import Copy, OutTensor, plan_archive, write_archive
folder = sys.argv[1]
source = os.path.join(folder, "source.bin")
with open(source, "wb") as handle:
    handle.truncate(300 << 20)
same = OutTensor(FP32, (75 << 20,), (Copy(Segment(source, 0, 75 << 20), FP32),))
widen = OutTensor(FP32, (25 << 20,), (Copy(Segment(source, 0, 25 << 20), BF16),))
plans = [plan_archive({"t": same}, "a"), plan_archive({"t": widen}, "b")]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with FileReader() as reader:
    for plan, name in zip(plans, "ab"):
        write_archive(os.path.join(folder, name + ".pt"), plan, reader)
        os.unlink(os.path.join(folder, name + ".pt"))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_memory_stays_bounded_by_the_buffer(tmp_path: Path) -> None:
    """A 300 MB copy and a 50 MB -> 100 MB bf16 widening grow peak RSS by far less than their size."""
    # Files in RAM where there is a tmpfs: this checks memory, not the disk's write speed.
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        result = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, str(folder)], capture_output=True, text=True, cwd=ROOT, check=True
        )
    finally:
        if folder != tmp_path:
            shutil.rmtree(folder)
    growth_mb = int(result.stdout.strip())
    assert growth_mb < 100, f"peak RSS grew by {growth_mb} MB"


def test_archives_appended_into_one_file_are_torch_save_streams(tmp_path: Path) -> None:
    """write_archives: archives one after another in one file, as torch.save writes them into
    one stream (DCP's .distcp), through the direct-I/O stream where the file is big enough: each
    is torch.save's bytes for the same tensor (but the random serialization id), and torch.load
    reads each from its own offset."""
    import io

    source = Source(tmp_path / "src.bin")
    big = torch.randn(2048, 1024)  # 8 MiB: a direct-I/O file (and, buffered, a kernel copy)
    tensors = [big, torch.tensor(3.0), torch.randn(5, 7), torch.randn(3, 1000).to(torch.bfloat16)]
    outs = [source.out(big), inline(tensors[1]), source.out(tensors[2]), source.out(tensors[3])]
    plans = [torchsave.plan_archive(out, "archive") for out in outs]
    offsets = [0]
    for plan in plans:
        offsets.append(offsets[-1] + plan.total_size)
    target = tmp_path / "all.distcp"
    with FileReader() as reader:
        torchsave.write_archives(target, plans, reader)
    data = target.read_bytes()
    assert len(data) == offsets[-1]
    for index, tensor in enumerate(tensors):
        ours = data[offsets[index] : offsets[index + 1]]
        assert same_bits(torch.load(io.BytesIO(ours), weights_only=True), tensor)
        theirs = io.BytesIO()
        torch.save(tensor, theirs)
        assert len(ours) == len(theirs.getvalue())

"""The safe torch-archive reader: what it reads, and what it refuses."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import SAMPLE_LIST
from zckpt.core.dtypes import BY_NAME
from zckpt.core.errors import CheckpointNotFoundError, CorruptFileError, UnsafePickleError
from zckpt.io.materialize import numpy_to_torch
from zckpt.io.reading import FileReader, read_ref
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile.reader import PickledObject, TensorRef, ZeroStageEnum


def rewrite_archive(
    source: Path, target: Path, edit=lambda records: records, compression: int = zipfile.ZIP_STORED
) -> None:
    """Copy a torch archive record by record, letting `edit` change the records on the way."""
    with zipfile.ZipFile(source) as archive:
        records = {i.filename: archive.read(i) for i in archive.infolist()}
    with zipfile.ZipFile(target, "w", compression=compression) as archive:
        for name, data in edit(records).items():
            archive.writestr(name, data)


def edit_record(part: str, change):
    """An `edit` for rewrite_archive changing the one record whose name contains `part`."""

    def edit(records: dict[str, bytes]) -> dict[str, bytes]:
        name = next(n for n in records if part in n)
        return {**records, name: change(records[name])}

    return edit


def read(ref: TensorRef) -> torch.Tensor:
    with FileReader() as reader:
        return numpy_to_torch(read_ref(reader, ref), ref.dtype)


def test_reads_tensors_and_plain_objects_without_loading_data(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32)
    state = {
        "f32": base.reshape(4, 6),
        "view": base[5:9],  # storage offset
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i64": torch.tensor([[1, 2, 3]]),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7.5),
        "param": torch.nn.Parameter(torch.ones(3)),
        "size": torch.Size([2, 3]),
        "nested": OrderedDict(a=[1, 2.5, "x", None, (True,)], b={3, 4}, c=b"bytes"),
        "np": np.float64(0.25),
    }
    torch.save(state, tmp_path / "x.pt")
    loaded = torchfile.load(tmp_path / "x.pt")
    for name in ("f32", "view", "bf16", "f16", "i64", "bool", "scalar", "param"):
        ref = loaded[name]
        assert isinstance(ref, TensorRef)
        assert torch.equal(read(ref), state[name].detach()), name
    assert loaded["size"] == (2, 3) and isinstance(loaded["size"], torchfile.TorchSize)
    assert loaded["nested"] == OrderedDict(a=[1, 2.5, "x", None, (True,)], b={3, 4}, c=b"bytes")
    assert loaded["np"] == 0.25 and type(loaded["np"]) is np.float64


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", sorted(BY_NAME), ids=str)
def test_every_torch_dtype_reads_as_torch_saved_it(dtype: str, tmp_path: Path) -> None:
    """Each dtype torch.save writes (v2 typed storages, v3 untyped ones: uint16-64, float8,
    complex32, bits), with a storage offset and a stride: the bytes zckpt reads are the bytes of
    the tensor torch saved, and the storage names it expects are the ones torch wrote."""
    itemsize = BY_NAME[dtype].itemsize
    raw = (torch.arange(48 * itemsize) % 251).to(torch.uint8).view(getattr(torch, dtype))  # distinct bytes
    whole = (torch.arange(48) % 3 == 0 if dtype == "bool" else raw).reshape(12, 4)
    views = {"whole": whole, "row": whole[1], "column": whole[:, 2]}
    torch.save(views, tmp_path / "t.pt")
    with zipfile.ZipFile(tmp_path / "t.pt") as archive:
        pickled = archive.read("t/data.pkl")
    storage = BY_NAME[dtype].storage
    assert (b"ctorch\n" + storage.encode() + b"\n" if storage else b"ctorch.storage\nUntypedStorage\n") in pickled
    loaded = torchfile.load(tmp_path / "t.pt")
    with FileReader() as reader:
        for name, tensor in views.items():
            ref = loaded[name]
            assert (ref.dtype.name, ref.shape, ref.stride) == (dtype, tuple(tensor.shape), tensor.stride()), name
            assert ref.offset == loaded["whole"].offset + tensor.storage_offset() * itemsize, name
            if ref.is_contiguous:
                assert read_ref(reader, ref).tobytes() == _bytes_of(tensor), name


def test_conjugate_and_negative_views_are_refused_not_misread(tmp_path: Path) -> None:
    """torch saves a conj/neg view as the unconjugated bytes plus a flag; reading the bytes alone
    would give other values."""
    torch.save({"z": torch.tensor([1 + 2j]).conj()}, tmp_path / "conj.pt")
    with pytest.raises(CorruptFileError, match="conj"):
        torchfile.load(tmp_path / "conj.pt")


@pytest.mark.parametrize(
    "case", SAMPLE_LIST[:1] + [s for s in SAMPLE_LIST if s.meta["dtype"] == "fp16"][:1], ids=lambda s: s.name
)
def test_deepspeed_classes_become_inert_stand_ins(case) -> None:
    tag_dir = case.checkpoint / case.meta["tag"]
    optim = torchfile.load(sorted(tag_dir.glob("*optim_states.pt"))[0])["optimizer_state_dict"]
    assert isinstance(optim["zero_stage"], ZeroStageEnum) and optim["zero_stage"] == case.meta["zero_stage"]
    assert isinstance(optim["loss_scaler"], PickledObject)
    assert "loss_scale" in vars(optim["loss_scaler"]) or "cur_scale" in vars(optim["loss_scaler"])


def test_truncated_garbled_and_missing_files(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    for cut in (10, len(data) // 2, len(data) - 30):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(CorruptFileError, match="cut.pt"):
            torchfile.load(tmp_path / "cut.pt")
    (tmp_path / "noise.pt").write_bytes(np.random.default_rng(1).bytes(5000))
    with pytest.raises(CorruptFileError):
        torchfile.load(tmp_path / "noise.pt")
    with pytest.raises(CheckpointNotFoundError):
        torchfile.load(tmp_path / "absent.pt")


def test_corrupted_pickle_bytes(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "ok.pt")
    rewrite_archive(
        tmp_path / "ok.pt", tmp_path / "bad.pt", edit_record("data.pkl", lambda d: d[:-5] + b"\xff\xfe\x00\x01")
    )
    with pytest.raises(CorruptFileError, match="corrupted pickle"):
        torchfile.load(tmp_path / "bad.pt")


def test_storage_size_mismatch_and_compression_are_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(8)}, tmp_path / "ok.pt")
    rewrite_archive(tmp_path / "ok.pt", tmp_path / "short.pt", edit_record("/data/", lambda d: d[:16]))
    with pytest.raises(CorruptFileError, match="holds 16 bytes"):
        torchfile.load(tmp_path / "short.pt")
    rewrite_archive(tmp_path / "ok.pt", tmp_path / "deflated.pt", compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(CorruptFileError, match="compressed"):
        torchfile.load(tmp_path / "deflated.pt")


def test_plain_pickle_helper_reads_data_and_refuses_calls() -> None:
    """A class named as a value is kept by name (never imported); calling one is refused."""
    ref = torchfile.unpickle(pickle.dumps({"cls": io.BytesIO}, protocol=2), "mem")["cls"]
    assert isinstance(ref, torchfile.PickledGlobal) and (ref.module, ref.name) == ("_io", "BytesIO")
    with pytest.raises(
        UnsafePickleError, match="mem: pickle calls collections.Counter"
    ):  # Counter pickles as Counter(dict)
        torchfile.unpickle(pickle.dumps(Counter(a=1), protocol=2), "mem")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_safetensors_codes_are_the_installed_safetensors_own() -> None:
    """Each dtype's code is what safetensors writes for it; the dtypes it cannot hold give a
    clear error when asked for, not a broken file."""
    import json
    import struct

    from safetensors.torch import save

    from zckpt.core.errors import UsageError
    from zckpt.hf.safetensors import build_header

    for dtype in BY_NAME.values():
        try:
            blob = save({"x": torch.zeros(2, dtype=dtype.torch())})
        except Exception:
            blob = None
        if dtype.safetensors_code is None:
            assert blob is None or dtype.name == "float4_e2m1fn_x2", (
                dtype
            )  # F4 counts 4-bit elements, torch bytes of two
            with pytest.raises(UsageError, match=f"safetensors has no {dtype.name} dtype.*torch format"):
                build_header([("x", dtype, (2,))])
        else:
            (length,) = struct.unpack("<Q", blob[:8])
            assert json.loads(blob[8 : 8 + length])["x"]["dtype"] == dtype.safetensors, dtype

"""The safe torch-archive reader: what it reads, and what it refuses."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SAMPLE_LIST
from zckpt import torchfile
from zckpt.errors import CheckpointNotFoundError, CorruptFileError, UnsafePickleError
from zckpt.materialize import numpy_to_torch
from zckpt.reading import FileReader, read_ref
from zckpt.torchfile import PickledObject, TensorRef, ZeroStageEnum


def rewrite_archive(source: Path, target: Path, edit=lambda records: records, compression: int = zipfile.ZIP_STORED) -> None:
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


def test_reads_tensors_of_every_dtype_without_loading_data(tmp_path: Path) -> None:
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
    assert loaded["size"] == (2, 3)
    assert loaded["nested"] == OrderedDict(a=[1, 2.5, "x", None, (True,)], b={3, 4}, c=b"bytes")
    assert loaded["np"] == 0.25


@pytest.mark.parametrize("case", SAMPLE_LIST[:1] + [s for s in SAMPLE_LIST if s.meta["dtype"] == "fp16"][:1], ids=lambda s: s.name)
def test_deepspeed_classes_become_inert_stand_ins(case) -> None:
    tag_dir = case.checkpoint / case.meta["tag"]
    optim = torchfile.load(sorted(tag_dir.glob("*optim_states.pt"))[0])["optimizer_state_dict"]
    assert isinstance(optim["zero_stage"], ZeroStageEnum) and optim["zero_stage"] == case.meta["zero_stage"]
    assert isinstance(optim["loss_scaler"], PickledObject)
    assert "loss_scale" in vars(optim["loss_scaler"]) or "cur_scale" in vars(optim["loss_scaler"])


class _RunsCode:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Evals:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch /tmp/never')",))


@pytest.mark.parametrize(
    "payload,culprit",
    [
        (lambda canary: _RunsCode(f"touch {canary}"), "system"),
        (lambda canary: _Evals(), "builtins.eval"),
        (lambda canary: __import__("argparse").Namespace(a=1), "argparse.Namespace"),
        (lambda canary: torch.nn.Linear(1, 1), "torch.nn.modules.linear.Linear"),
    ],
)
def test_unknown_globals_are_refused_and_nothing_runs(tmp_path: Path, payload, culprit: str) -> None:
    canary = tmp_path / "pwned"
    torch.save({"module": {"w": torch.ones(2)}, "evil": payload(canary)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafePickleError, match=culprit):
        torchfile.load(tmp_path / "evil.pt")
    assert not canary.exists()


def test_payload_in_a_storage_type_is_refused(tmp_path: Path) -> None:
    """A hand-written pickle that puts os.system where torch's storage class would be."""
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    rewrite_archive(tmp_path / "ok.pt", tmp_path / "bad.pt", edit_record("data.pkl", lambda d: d.replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n")))
    with pytest.raises(UnsafePickleError, match="system"):
        torchfile.load(tmp_path / "bad.pt")


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
    rewrite_archive(tmp_path / "ok.pt", tmp_path / "bad.pt", edit_record("data.pkl", lambda d: d[:-5] + b"\xff\xfe\x00\x01"))
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


def test_plain_pickle_helper_refuses_unknown_globals() -> None:
    with pytest.raises(UnsafePickleError):
        torchfile.unpickle(pickle.dumps(io.BytesIO), "mem")

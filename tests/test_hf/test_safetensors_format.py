from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from zckpt.core.dtypes import BF16, BY_NAME, FP32
from zckpt.core.errors import CorruptFileError
from zckpt.hf.safetensors import build_header, read_header


def test_streamed_file_loads_with_safetensors(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "n": torch.tensor(3, dtype=torch.int64),
        "e": torch.empty(0, 4),
    }
    specs = [(n, BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for n, t in tensors.items()]
    header, parsed = build_header(specs, {"format": "pt"})
    assert len(header) % 8 == 0
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as handle:
        handle.write(header)
        for tensor in tensors.values():
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    loaded = load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert read_header(path) == parsed


def test_reads_what_safetensors_writes(tmp_path: Path) -> None:
    save_file(
        {"a": torch.ones(2, 2), "z": torch.zeros(3, dtype=torch.bfloat16)},
        tmp_path / "y.safetensors",
        metadata={"k": "v"},
    )
    header = read_header(tmp_path / "y.safetensors")
    assert {t.name: (t.dtype, t.shape) for t in header.tensors} == {"a": (FP32, (2, 2)), "z": (BF16, (3,))}
    assert header.metadata == {"k": "v"}


def _write(path: Path, body: dict, data: bytes) -> None:
    text = json.dumps(body).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "body,data,problem",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "do not match"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
        ({"a": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unsupported"),
    ],
)
def test_bad_headers_are_refused(tmp_path: Path, body: dict, data: bytes, problem: str) -> None:
    path = tmp_path / "bad.safetensors"
    _write(path, body, data)
    with pytest.raises(CorruptFileError, match=problem):
        read_header(path)


def test_garbage_is_refused(tmp_path: Path) -> None:
    (tmp_path / "g").write_bytes(np.random.default_rng(0).bytes(100))
    with pytest.raises(CorruptFileError):
        read_header(tmp_path / "g")

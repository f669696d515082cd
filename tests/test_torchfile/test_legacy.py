"""torch.save's legacy (non-zip) format, as DeepSpeed writes every rank file of a run configured
with ``"checkpoint": {"checkpoint_serialization": false}``: read by the same safe unpickler, the
layout (five pickles, then each storage as an 8-byte element count and its bytes) as measured on
DeepSpeed 0.19.8's files, every command exact on the real samples, damage named in one line."""

from __future__ import annotations

import os
import pickle
import pickletools
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import load_output, load_with_stand_ins, run_cli, same_bits, sample
from zckpt import consolidate
from zckpt.core.errors import CorruptFileError
from zckpt.io.reading import FileReader, read_ref
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile.legacy import LEGACY_MAGIC, is_legacy_torch_file

LEGACY_SAMPLES = ["z2_bf16_ws2_legacy_serialization", "z3_fp32_ws2_legacy_serialization"]
SYS_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}


def rank_files(name: str) -> list[Path]:
    case = sample(name)
    return sorted((case.checkpoint / case.meta["tag"]).glob("*.pt"))


def pickle_extents(path: Path) -> list[tuple[int, int]]:
    """(start, end) of the five pickles, found by walking their opcodes."""
    extents = []
    with open(path, "rb") as handle:
        for _ in range(5):
            start = handle.tell()
            for _ in pickletools.genops(handle):
                pass
            extents.append((start, handle.tell()))
    return extents


def legacy_file(target: Path, main: bytes, storages: dict[str, tuple[int, bytes]] | None = None, **head) -> Path:
    """A legacy torch.save file by hand: magic, version, sys_info, `main`, the sorted keys, then
    each storage as (element count, bytes)."""
    storages = storages or {}
    keys = sorted(storages)
    parts = [
        pickle.dumps(head.get("magic", LEGACY_MAGIC), protocol=2),
        pickle.dumps(head.get("version", 1001), protocol=2),
        pickle.dumps(head.get("sys_info", SYS_INFO), protocol=2),
        main,
        pickle.dumps(keys, protocol=2),
    ]
    parts += [struct.pack("<q", storages[k][0]) + storages[k][1] for k in keys]
    target.write_bytes(b"".join(parts))
    return target


# ---------------------------------------------------------------------------------------------
# The layout, measured on DeepSpeed's files


@pytest.mark.parametrize("name", LEGACY_SAMPLES)
def test_samples_are_legacy_files_with_the_measured_layout(name: str) -> None:
    """No zip: five pickles (magic, 1001, sys_info, the object, the sorted keys), then per key an
    8-byte little-endian count of elements (not bytes) and the data, ending at the file's end."""
    for path in rank_files(name):
        assert not zipfile.is_zipfile(path) and is_legacy_torch_file(path)
        extents = pickle_extents(path)
        data = path.read_bytes()
        small = [pickle.loads(data[start:end]) for start, end in (extents[:3] + extents[4:])]
        magic, version, sys_info, keys = small
        assert (magic, version) == (LEGACY_MAGIC, 1001) and sys_info["little_endian"] is True
        assert keys == sorted(keys) and all(type(k) is str for k in keys)
        theirs = load_with_stand_ins(path)
        sizes = {}  # key -> (elements, element size), from torch's own read
        stack = [theirs]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                storage = item.untyped_storage()
                sizes[storage._cdata] = (storage.nbytes() // item.element_size(), item.element_size())
            elif isinstance(item, dict):
                stack += list(item.values())
            elif isinstance(item, (list, tuple)):
                stack += list(item)
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                stack += list(vars(item).values())
        walk = _storage_walk(data, extents[4][1], sorted(sizes.values()))  # elements, not bytes
        assert walk is not None and len(walk) == len(keys), path


def _storage_walk(data: bytes, position: int, storages: list[tuple[int, int]]) -> list[int] | None:
    """The storage headers from `position` to the end of `data`: each an 8-byte little-endian
    element count, then that many elements of one of `storages` (elements, element size; each
    used once), ending exactly at the end of the file; None if they do not."""
    if position == len(data):
        return [] if all(n == 0 for n, _ in storages) else None  # torch.load unshares empty storages
    (count,) = struct.unpack_from("<q", data, position)
    for size in sorted({s for n, s in storages if n == count}):
        rest = list(storages)
        rest.remove((count, size))
        walk = _storage_walk(data, position + 8 + count * size, rest)
        if walk is not None:
            return [count, *walk]
    return None


@pytest.mark.parametrize("name", LEGACY_SAMPLES)
def test_every_tensor_reads_as_torch_load_reads_it(name: str) -> None:
    """Each TensorRef points at the bytes torch.load takes for that tensor (views included)."""
    for path in rank_files(name):
        ours, theirs = torchfile.load(path), load_with_stand_ins(path)
        with FileReader() as reader:
            seen = _compare(ours, theirs, reader, path.name)
        assert seen > 0, path


def _compare(ours, theirs, reader: FileReader, where: str) -> int:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torchfile.TensorRef), where
        value = read_ref(reader, ours)
        expected = theirs.detach().contiguous().reshape(-1)
        assert tuple(ours.shape) == tuple(theirs.shape), where
        assert same_bits(
            torch.from_numpy(np.ascontiguousarray(value).reshape(-1).copy()).view(expected.dtype), expected
        ), where
        return 1
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        return sum(_compare(ours[k], theirs[k], reader, f"{where}/{k}") for k in theirs)
    if isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        return sum(_compare(a, b, reader, f"{where}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs)))
    return 0


# ---------------------------------------------------------------------------------------------
# Every command on the real samples


@pytest.mark.parametrize("name", LEGACY_SAMPLES)
def test_consolidate_equals_zero_to_fp32_and_the_live_engine(name: str, tmp_path: Path) -> None:
    case = sample(name)
    consolidate(case.checkpoint, tmp_path / "out")
    ours = load_output(tmp_path / "out")
    reference, live = case.reference(), case.live()
    assert sorted(ours) == sorted(reference)
    for key, value in ours.items():
        assert same_bits(value, reference[key]), key
        if key in live:
            assert same_bits(value, live[key].to(value.dtype)), key


@pytest.mark.parametrize("name", LEGACY_SAMPLES)
def test_verify_passes_and_says_no_checksum(name: str) -> None:
    report = verify(sample(name).checkpoint)
    assert report.ok, report.problems
    checks = {c.name: c for c in report.checks}
    assert checks["checksums"].ok is None and "legacy" in checks["checksums"].detail
    files = len(rank_files(name))
    assert any(n.startswith(f"{files} legacy torch.save files") and "carry no checksum" in n for n in report.notes)
    assert "legacy torch.save file" in checks["rank identity"].detail


@pytest.mark.slow
@pytest.mark.parametrize("name", LEGACY_SAMPLES)
def test_reshard_and_to_universal_write_zips_that_verify(name: str, tmp_path: Path) -> None:
    """zckpt writes the zip format (with CRC-32s) whatever it read; the values are the run's."""
    case = sample(name)
    reshard(case.checkpoint, tmp_path / "resharded", world_size=3)
    to_universal(case.checkpoint, tmp_path / "universal")
    for folder in ("resharded", "universal"):
        report = verify(tmp_path / folder)
        assert report.ok and not any("legacy" in n for n in report.notes), (folder, report.problems, report.notes)
        files = [p for p in (tmp_path / folder).rglob("*.pt")]
        assert files and all(zipfile.is_zipfile(p) for p in files), folder
    consolidate(tmp_path / "resharded", tmp_path / "out")
    consolidate(case.checkpoint, tmp_path / "original")
    ours, original = load_output(tmp_path / "out"), load_output(tmp_path / "original")
    assert sorted(ours) == sorted(original) and all(same_bits(ours[k], original[k]) for k in ours)


# ---------------------------------------------------------------------------------------------
# Damage and variants, named in one line


def _cut_points(path: Path) -> list[tuple[int, str]]:
    extents = pickle_extents(path)
    size = path.stat().st_size
    return [
        (extents[3][0] + 10, "main pickle"),
        (extents[4][0] + 3, "storage keys pickle"),
        (extents[4][1] + 4, "storage"),  # inside the first 8-byte count
        (size - 1, "storage"),  # inside the last storage's data
    ]


@pytest.mark.parametrize("cut", range(4))
def test_truncated_legacy_file_is_one_line_naming_it(cut: int, tmp_path: Path) -> None:
    checkpoint = shutil.copytree(sample(LEGACY_SAMPLES[0]).checkpoint, tmp_path / "ckpt")
    victim = next((checkpoint / "global_step3").glob("*rank_1_*optim_states.pt"))
    at, where = _cut_points(victim)[cut]
    os.truncate(victim, at)
    with pytest.raises(CorruptFileError) as caught:
        torchfile.load(victim)
    assert str(caught.value).startswith(f"{victim}: truncated") and where in str(caught.value), caught.value
    result = run_cli("consolidate", checkpoint, tmp_path / "out", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("zckpt: error: ") and victim.name in lines[0] and "truncated" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _tensor_pickle(storage_id: bytes) -> bytes:
    """{"w": a 2-float tensor of the storage with persistent id `storage_id` (opcodes)}."""
    return (
        b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n("
        + storage_id
        + b"QK\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs."
    )


def _storage(key: str = "7", numel: int = 2, view: bytes = b"N") -> bytes:
    data = key.encode()
    return (
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX"
        + struct.pack("<I", len(data))
        + data
        + b"X\x03\x00\x00\x00cpuK"
        + bytes([numel])
        + view
        + b"t"
    )


def test_a_hand_made_legacy_file_reads_and_matches_torch(tmp_path: Path) -> None:
    path = legacy_file(tmp_path / "ok.pt", _tensor_pickle(_storage()), {"7": (2, struct.pack("<2f", 1.5, -2))})
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.tensor([1.5, -2.0]))
    ref = torchfile.load(path)["w"]
    with FileReader() as reader:
        assert read_ref(reader, ref).tolist() == [1.5, -2.0]


@pytest.mark.parametrize(
    "build, words",
    [
        (
            lambda p: legacy_file(
                p, _tensor_pickle(_storage()), {"7": (2, b"\0" * 8)}, sys_info={**SYS_INFO, "little_endian": False}
            ),
            "big-endian",
        ),
        (
            lambda p: legacy_file(p, _tensor_pickle(_storage()), {"7": (2, b"\0" * 8)}, version=1000),
            "protocol version 1000",
        ),
        (
            lambda p: legacy_file(
                p, _tensor_pickle(_storage(view=b"(X\x01\x00\x00\x008K\x00K\x02t")), {"7": (2, b"\0" * 8)}
            ),
            "storage view",
        ),
        (
            lambda p: legacy_file(p, _tensor_pickle(_storage()), {"7": (3, b"\0" * 12)}),
            "holds 3 elements, the pickle records 2",
        ),
        (lambda p: legacy_file(p, _tensor_pickle(_storage()), {"8": (2, b"\0" * 8)}), "which its storage list lacks"),
        (
            lambda p: legacy_file(p, _tensor_pickle(_storage()), {"7": (2, b"\0" * 8), "9": (1, b"\0" * 4)}),
            "which its pickle does not use",
        ),
    ],
    ids=["big-endian", "version", "view", "count", "missing", "extra"],
)
def test_unread_variants_and_damage_name_the_layout(build, words: str, tmp_path: Path) -> None:
    """What zckpt does not read is named as a legacy file's variant, never as a pre-1.6 file or
    as truncated; a mismatched storage list as what it is."""
    path = build(tmp_path / "odd.pt")
    with pytest.raises(CorruptFileError) as caught:
        torchfile.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message
    assert "pre-1.6" not in message and "truncated" not in message

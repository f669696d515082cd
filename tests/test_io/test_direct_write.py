"""O_DIRECT output (zckpt.io.direct_write): the same bytes as torch.save and as page-cache writes.

Oracles: torch.save's own file for the same objects; util-linux ``findmnt`` for filesystem
types; the page-cache path's outputs, which the reshard and universal tests check against
DeepSpeed, for whole checkpoints written direct.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from helpers import SAMPLE_LIST, Source, data_records, flip, record_start, same_except_serialization_id, torch_and_ours
from zckpt.core.dtypes import BF16
from zckpt.core.errors import CorruptFileError
from zckpt.io import direct_write
from zckpt.io.reading import FileReader
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.torchfile import save as torchsave
from zckpt.torchfile.save import plan_archive, write_archive


def _direct_works(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def force_direct(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on every file the writer opens goes O_DIRECT; returns the paths opened so."""
    if not hasattr(os, "O_DIRECT") or not _direct_works(folder):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    opened: list[str] = []
    real_open = direct_write.open_output

    def recording(path: str | os.PathLike[str], size: int) -> tuple[int, bool]:
        fd, direct = real_open(path, size)
        if direct:
            opened.append(os.fspath(path))
        return fd, direct

    monkeypatch.setattr(direct_write, "wants_direct", lambda path, size: True)
    monkeypatch.setattr(torchsave, "open_output", recording)
    return opened


@pytest.fixture
def direct_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return force_direct(tmp_path, monkeypatch)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_archive_written_direct_is_torch_saves_file(tmp_path: Path, direct_everywhere: list[str]) -> None:
    theirs_obj, ours_obj = torch_and_ours(Source(tmp_path / "source.bin"))
    torch.save(theirs_obj, tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    with FileReader() as reader:
        write_archive(tmp_path / "ours" / "theirs.pt", plan_archive(ours_obj, "theirs"), reader)
    assert direct_everywhere == [str(tmp_path / "ours" / "theirs.pt")]
    same_except_serialization_id(tmp_path / "ours" / "theirs.pt", tmp_path / "theirs.pt")


@pytest.mark.parametrize("buffer_bytes", [4096, 3 * 4096, 1 << 20])
def test_sizes_across_block_and_buffer_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_everywhere: list[str], buffer_bytes: int
) -> None:
    """Tensors ending on, before and after block and buffer edges, read in windows smaller
    than a buffer: torch.save's bytes, whatever the cut."""
    monkeypatch.setattr(direct_write, "BUFFER_BYTES", buffer_bytes)
    monkeypatch.setattr(direct_write, "_POOL", direct_write._BufferPool())
    monkeypatch.setattr(torchsave, "_DIRECT_READ_BYTES", 5000)
    source = Source(tmp_path / "source.bin")
    sizes = [1, 1023, 1024, 1025, 4096 // 4 * 3 + 1, 12288 // 4, 12289, 70001]
    theirs = OrderedDict((f"t{i}", torch.arange(n, dtype=torch.float32) * (i + 1)) for i, n in enumerate(sizes))
    theirs["half"] = torch.arange(5003, dtype=torch.float32).to(torch.bfloat16)  # converted: goes through put()
    ours = OrderedDict((k, source.out(v)) for k, v in theirs.items())
    fp32 = source.out(torch.arange(5003, dtype=torch.float32))
    ours["half"] = torchsave.OutTensor(BF16, (5003,), fp32.parts)
    torch.save(theirs, tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    with FileReader() as reader:
        write_archive(tmp_path / "ours" / "theirs.pt", plan_archive(ours, "theirs"), reader)
    assert direct_everywhere
    same_except_serialization_id(tmp_path / "ours" / "theirs.pt", tmp_path / "theirs.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [s for s in SAMPLE_LIST if s.name in ("z3_bf16_ws3_subgroups_groups", "z2_fp16_ws4_tied", "z1_bf16_ws3_groups")],
    ids=lambda s: s.name,
)
def test_checkpoints_written_direct_equal_page_cache_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case
) -> None:
    buffered = {
        "reshard": reshard(case.checkpoint, tmp_path / "b-reshard", world_size=3).output_dir,
        "universal": to_universal(case.checkpoint, tmp_path / "b-universal").output_dir,
    }
    opened = force_direct(tmp_path, monkeypatch)
    direct = {
        "reshard": reshard(case.checkpoint, tmp_path / "d-reshard", world_size=3).output_dir,
        "universal": to_universal(case.checkpoint, tmp_path / "d-universal").output_dir,
    }
    assert len(opened) > 5
    for key in buffered:
        assert _tree(Path(direct[key])) == _tree(Path(buffered[key])), key


def test_damaged_input_is_caught_when_written_direct(tmp_path: Path, direct_everywhere: list[str]) -> None:
    case = next(s for s in SAMPLE_LIST if s.name == "z3_fp32_ws2_tied_frozen")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    optim = checkpoint / case.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    info = max(data_records(optim), key=lambda i: i.file_size)  # the fp32 masters: always copied
    flip(optim, record_start(optim, info) + info.file_size // 2)
    for run in (lambda out: reshard(checkpoint, out, world_size=3), lambda out: to_universal(checkpoint, out)):
        out = tmp_path / "out"
        with pytest.raises(CorruptFileError, match="CRC-32") as caught:
            run(out)
        assert str(optim) in str(caught.value)
        assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
    assert direct_everywhere


def test_truncated_source_is_named(tmp_path: Path, direct_everywhere: list[str]) -> None:
    source = Source(tmp_path / "source.bin")
    tensor = source.out(torch.arange(100_000, dtype=torch.float32))
    os.truncate(source.path, source.path.stat().st_size - 1000)
    (tmp_path / "ours").mkdir()
    with FileReader(verify=False) as reader, pytest.raises(CorruptFileError, match="truncated") as caught:
        write_archive(tmp_path / "ours" / "x.pt", plan_archive({"t": tensor}, "x"), reader)
    assert str(source.path) in str(caught.value)


def test_filesystem_refusing_the_write_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_everywhere: list[str]
) -> None:
    """Some filesystems take O_DIRECT at open and refuse the writes (EINVAL): the file is written
    all the same, through the page cache."""
    real_pwrite = os.pwrite
    refused = []

    def picky(fd: int, data, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky)
    theirs_obj, ours_obj = torch_and_ours(Source(tmp_path / "source.bin"))
    torch.save(theirs_obj, tmp_path / "theirs.pt")
    (tmp_path / "ours").mkdir()
    with FileReader() as reader:
        write_archive(tmp_path / "ours" / "theirs.pt", plan_archive(ours_obj, "theirs"), reader)
    assert refused
    same_except_serialization_id(tmp_path / "ours" / "theirs.pt", tmp_path / "theirs.pt")


def test_filesystem_refusing_the_flag_at_open_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path, flags, mode=0o777, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(direct_write, "wants_direct", lambda path, size: True)
    monkeypatch.setattr(os, "open", no_direct)
    fd, direct = direct_write.open_output(tmp_path / "x", 1 << 30)
    os.close(fd)
    assert direct is False and (tmp_path / "x").exists()


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="util-linux findmnt not installed")
@pytest.mark.parametrize("folder", ["/", "/proc", "/dev/shm", "/tmp", "tmp_path"])
def test_filesystem_type_is_findmnts(folder: str, tmp_path: Path) -> None:
    path = str(tmp_path) if folder == "tmp_path" else folder
    if not os.path.isdir(path):
        pytest.skip(f"{path} does not exist here")
    theirs = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", path], capture_output=True, text=True
    ).stdout.split()
    assert direct_write.filesystem_type(os.path.realpath(path)) in theirs  # mounts stacked on one folder: one line each


def test_small_files_and_other_filesystems_stay_buffered(tmp_path: Path) -> None:
    assert not direct_write.wants_direct(tmp_path / "x", direct_write.DIRECT_MIN_BYTES - 1)
    if os.path.isdir("/proc"):
        assert not direct_write.wants_direct("/proc/x", 1 << 40)

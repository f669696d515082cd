"""The DeepSpeed reader: finding the tag, param ids, and where its segments lie. (DeepSpeed's
layout rules against the files it wrote: tests/test_deepspeed/test_layout.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import SAMPLE_LIST, sample
from zckpt import CheckpointNotFoundError, UsageError
from zckpt.deepspeed import names as N
from zckpt.deepspeed.locate import locate
from zckpt.deepspeed.reader import open_checkpoint
from zckpt.torchfile import reader as torchfile


def test_nvme_swap_files_are_named_by_module_order_ids_too() -> None:
    """The fallback rule (ids in model.parameters() order) gives the ids DeepSpeed assigned."""
    from zckpt.deepspeed.model_states import ds_ids as _ds_ids

    case = sample("z3_bf16_ws2_nvmeoffload_frozen_tied_groups")
    model = torchfile.load(case.checkpoint / case.meta["tag"] / N.model_states_name(3, 0))
    computed = _ds_ids(model)
    recorded = {n: i for n, i in case.meta["ds_ids"].items() if n not in case.meta["tied"]}
    assert computed == recorded


def test_locate_variants(tmp_path: Path) -> None:
    case = sample("z2_fp32_ws2_twotags")
    latest, older = case.meta["tag"], [t for t in case.meta["tags"] if t != case.meta["tag"]][0]
    assert locate(case.checkpoint).tag == latest
    assert locate(case.checkpoint, older).tag == older
    assert locate(case.checkpoint / older).tag == older
    assert locate(case.checkpoint / older).tags == tuple(case.meta["tags"])
    with pytest.raises(UsageError, match="is the folder of tag"):
        locate(case.checkpoint / older, latest)
    copy = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, copy)
    (copy / "latest").unlink()
    with pytest.raises(UsageError, match="pass --tag"):
        locate(copy)
    shutil.rmtree(copy / older)
    assert locate(copy).tag == latest  # the only tag is used
    with pytest.raises(CheckpointNotFoundError):
        locate(tmp_path / "nothing")


def test_index_segments_lie_inside_their_files() -> None:
    for case in SAMPLE_LIST:
        index = open_checkpoint(case.checkpoint)
        for entry in index.entries:
            assert sum(s.numel for s in entry.source.segments) == entry.source.numel
            for segment in entry.source.segments:
                assert segment.offset + segment.numel * entry.source.dtype.itemsize <= Path(segment.path).stat().st_size


def test_file_reader_bounds_open_descriptors(tmp_path: Path) -> None:
    import numpy as np

    from zckpt.io.reading import FileReader

    paths = []
    for i in range(10):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * 8)
    with FileReader(max_open=3) as reader:
        for _ in range(2):
            for i, path in enumerate(paths):
                out = np.empty(8, dtype=np.uint8)
                reader.read_into(str(path), 0, memoryview(out))
                assert (out == i).all()
                assert len(reader._fds) <= 3

"""Slicing a tensor made of file segments (``slice_segments``, ``SegmentSlicer``): against the
elements themselves. Each segment's elements are numbered (file, element) pairs, the expected slice
is the list of those pairs cut with Python's own list slicing."""

from __future__ import annotations

import random

import pytest

from zckpt.core.dtypes import FP32
from zckpt.core.index import Segment, SegmentSlicer, TensorSource, slice_segments


def _elements(segments: list[Segment]) -> list[tuple[str, int]]:
    """Every element of `segments` as (file, byte offset), in order."""
    return [(s.path, s.offset + 4 * i) for s in segments for i in range(s.numel)]


@pytest.mark.parametrize("seed", range(20))
def test_every_slice_is_the_elements_cut(seed: int) -> None:
    draw = random.Random(seed)
    segments = [
        Segment(f"f{draw.randrange(3)}", 4 * draw.randrange(1000), draw.randrange(1, 9))
        for _ in range(draw.randrange(1, 40))
    ]
    source = TensorSource(FP32, (sum(s.numel for s in segments),), tuple(segments))
    elements = _elements(segments)
    slicer = SegmentSlicer(source)
    for _ in range(50):
        start = draw.randrange(len(elements) + 3)
        length = draw.randrange(len(elements) + 3)
        expected = elements[start : start + length]
        assert _elements(slicer.slice(start, length)) == expected
        assert _elements(slice_segments(source, start, length)) == expected
        assert all(s.numel > 0 for s in slicer.slice(start, length))

"""The streamed fp32 -> bf16/fp16 path (numpy rounding in small reused chunks, converted on
helper threads): the same bits as torch's `.to()`, whatever the values and wherever the chunk
boundaries fall."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import zckpt.io.materialize as materialize
from helpers import Sample, same_bits, sample
from zckpt import consolidate
from zckpt.core.dtypes import BF16, FP16, FP32, DType
from zckpt.core.errors import CorruptFileError
from zckpt.core.index import Segment, TensorSource
from zckpt.io.materialize import StreamWriter, convert, fp32_to_bf16, fp32_to_fp16
from zckpt.io.reading import FileReader

TARGETS = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")]


def torch_bits(bits: np.ndarray, target: DType) -> np.ndarray:
    """torch's conversion of fp32 bit patterns, as raw uint16."""
    converted = torch.from_numpy(bits.view(np.float32).copy()).to(target.torch())
    return converted.view(torch.int16).numpy().view(np.uint16)


def random_bits(count: int, seed: int = 0) -> np.ndarray:
    """Uniform over the whole 32-bit space: ~0.4% NaNs, subnormals, both signs."""
    return np.random.default_rng(seed).integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)


def special_bits() -> np.ndarray:
    """Every class where rounding can go wrong, for every sign and exponent: each rounding
    position (bf16 rounds at bit 16, fp16 at bits 13..23 through its subnormal range) with
    the bits below it just under, at and just over the halfway point, an odd and an even kept
    bit, all-zero and all-one mantissas; plus signed zeros, infinities, NaN payloads (quiet,
    signalling, sign set), fp32 subnormals, and the largest values on both sides of each
    format's overflow to Inf."""
    mantissas = {0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF}
    for k in range(1, 24):  # rounding position k: the bits below it decide
        half = 1 << (k - 1)
        for low in (half - 1, half, half + 1, (1 << k) - 1, 1):
            for high in (0, 1, 2, 3, (0x7FFFFF >> k) - 1, 0x7FFFFF >> k):
                mantissas.add(((high << k) | low) & 0x7FFFFF)
    mantissa = np.array(sorted(mantissas), dtype=np.uint32)
    exponent = np.arange(256, dtype=np.uint32) << 23
    grid = (exponent[:, None] | mantissa[None, :]).reshape(-1)
    extra = np.array(
        [
            0x477FE000,
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x477FFFFF,  # fp16: 65504, ... 65520 (rounds to Inf), ...
            0x7F7F7FFF,
            0x7F7F8000,
            0x7F7FFFFF,  # bf16: the largest finite, ties to Inf
            0x33000000,
            0x33000001,
            0x33800000,
            0x387FC000,
            0x387FE000,
            0x38800000,  # fp16 subnormal edges
            0x7FC00000,
            0x7F800001,
            0x7FBFFFFF,
            0x7FFFFFFF,
            0x7FA00000,
            0x7F812345,
        ],  # NaNs
        dtype=np.uint32,
    )
    positive = np.concatenate([grid, extra, np.arange(0, 1 << 16, dtype=np.uint32)])  # small subnormals
    return np.concatenate([positive, positive | 0x80000000])


def is_nan(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7FFFFFFF) > 0x7F800000


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("values", ["random", "special"])
def test_rounding_equals_torch(target: DType, values: str) -> None:
    bits = random_bits(4_000_000) if values == "random" else special_bits()
    assert is_nan(bits).any() and not is_nan(bits).all()
    raw = bits.view(np.float32)
    assert np.array_equal(convert(raw, FP32, target).view(np.uint16), torch_bits(bits, target))
    finite = bits[~is_nan(bits)].view(np.float32)  # the numpy arithmetic alone, no torch fallback
    numpy_path = fp32_to_bf16(finite) if target == BF16 else fp32_to_fp16(finite)
    assert numpy_path is not None and numpy_path.dtype == np.dtype(target.numpy_raw)
    assert numpy_path is not None
    assert np.array_equal(numpy_path.view(np.uint16), torch_bits(finite.view(np.uint32), target))


@pytest.mark.parametrize("target", TARGETS)
def test_a_nan_sends_the_chunk_to_torch(target: DType) -> None:
    bits = random_bits(1000, seed=1) & 0x3FFFFFFF  # no NaN
    numpy_path = fp32_to_bf16 if target == BF16 else fp32_to_fp16
    assert numpy_path(bits.view(np.float32)) is not None
    for nan in (0x7FC00000, 0xFF800001, 0x7FBFFFFF, 0xFFFFFFFF):
        bits[500] = nan
        assert numpy_path(bits.view(np.float32)) is None
        assert np.array_equal(convert(bits.view(np.float32), FP32, target).view(np.uint16), torch_bits(bits, target))


@pytest.mark.parametrize("target", TARGETS)
def test_reused_buffers_give_the_same_bits(target: DType) -> None:
    bits = random_bits(10_000, seed=2)
    bits[is_nan(bits)] = 0x3F800000  # the numpy path throughout
    out, scratch = np.full(64 * 1024, 0xAB, dtype=np.uint8), np.full(32 * 1024, 7, dtype=np.uint32)
    for start, stop in ((0, 10_000), (3, 7), (9_999, 10_000), (100, 5_101)):
        result = convert(bits[start:stop].view(np.float32), FP32, target, out, scratch)
        assert np.shares_memory(result, out)
        assert np.array_equal(result.view(np.uint16), torch_bits(bits[start:stop], target))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scratch_words", [1, 2, 7, 1000])
def test_a_scratch_shorter_than_the_array_is_used_block_by_block(target: DType, scratch_words: int) -> None:
    bits = special_bits()[::50]  # ~25K values of every class
    bits = bits[~is_nan(bits)]
    result = convert(bits.view(np.float32), FP32, target, None, np.zeros(scratch_words, np.uint32))
    assert np.array_equal(result.view(np.uint16), torch_bits(bits, target))


def write_segments(tmp_path: Path, bits: np.ndarray, cuts: list[int]) -> TensorSource:
    """`bits` split at `cuts` into segments, each in a file of its own at an odd-looking offset
    (after a few junk bytes), as ZeRO-3 spreads one tensor over the ranks' partitions."""
    segments, start = [], 0
    for index, stop in enumerate([*cuts, len(bits)]):
        path = tmp_path / f"part{index}.bin"
        junk = 4 * (index + 1) + 8
        path.write_bytes(b"\x5a" * junk + bits[start:stop].tobytes() + b"\xa5" * 12)
        segments.append(Segment(str(path), junk, stop - start))
        start = stop
    return TensorSource(FP32, (len(bits),), tuple(segments))


def stream(tmp_path: Path, source: TensorSource, target: DType) -> np.ndarray:
    out = tmp_path / f"out_{target}.bin"
    written: list[int] = []
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with FileReader() as reader:
            StreamWriter(reader, written.append).write(fd, source, target)
    finally:
        os.close(fd)
    data = np.fromfile(out, dtype=np.uint16)
    assert sum(written) == data.nbytes
    return data


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("chunk_bytes", [4, 100, 4096])
def test_stream_across_chunks_and_files_equals_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: DType, chunk_bytes: int
) -> None:
    """Chunks that do not divide the segments, segments that do not divide the chunks, some
    chunks holding a NaN (torch) and most not (numpy): the same bits as one `.to()`."""
    monkeypatch.setattr(materialize, "STREAM_CHUNK_BYTES", chunk_bytes)
    bits = random_bits(25_013, seed=3)
    bits[is_nan(bits)] = 0
    bits[[17, 9_000, 25_012]] = [0x7FC00000, 0xFF812345, 0x7F800001]
    source = write_segments(tmp_path, bits, [1, 5_001, 5_002, 19_999])
    assert np.array_equal(stream(tmp_path, source, target), torch_bits(bits, target))


def test_a_truncated_segment_is_reported_and_no_helper_is_left_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(materialize, "STREAM_CHUNK_BYTES", 64)
    bits = random_bits(5_000, seed=4) & 0x3FFFFFFF
    source = write_segments(tmp_path, bits, [2_000])
    short = Segment(source.segments[1].path, source.segments[1].offset, source.segments[1].numel + 100)
    broken = TensorSource(FP32, (5_100,), (source.segments[0], short))
    with pytest.raises(CorruptFileError, match="truncated"):
        stream(tmp_path, broken, BF16)
    assert np.array_equal(stream(tmp_path, source, BF16), torch_bits(bits, BF16))  # the writer's buffers are free again


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "name", ["z3_bf16_ws3_subgroups_groups", "z3_fp16_ws4_subgroups_frozen", "z2_bf16_ws3_paramalign"]
)
def test_consolidate_in_small_chunks_equals_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, dtype: str
) -> None:
    """End to end with chunks far smaller than the tensors (and not dividing them), so that
    chunk boundaries fall inside tensors and inside ZeRO-3 partitions."""
    monkeypatch.setattr(materialize, "STREAM_CHUNK_BYTES", 1004)
    case: Sample = sample(name)
    consolidate(case.checkpoint, tmp_path / "out", dtype=dtype)
    ours = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    target = torch.bfloat16 if dtype == "bf16" else torch.float16
    expected = case.expected_fp32()
    assert set(ours) == set(expected)
    for tensor_name, tensor in expected.items():
        assert same_bits(ours[tensor_name], tensor.to(target) if tensor.is_floating_point() else tensor), tensor_name

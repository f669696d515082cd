"""dtype conversion: the same bits as torch's own casts, special values included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import same_bits
from zckpt.core.dtypes import BF16, FP16, FP32, DType, from_torch
from zckpt.io.materialize import convert, numpy_to_torch


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float: NaN payloads, infinities, subnormals, -0."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def tricky_fp32() -> torch.Tensor:
    rng = np.random.default_rng(0)
    bits = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),  # any pattern, NaNs included
            np.array(
                [
                    0,
                    0x80000000,
                    0x7F800000,
                    0xFF800000,
                    0x7FC00000,
                    0x7F800001,
                    0x00000001,
                    0x807FFFFF,
                    0x3F808000,
                    0x3F818000,
                    0x3F80FFFF,
                    0x477FF000,
                    0x477FE000,
                    0x33800000,
                ],
                dtype=np.uint32,
            ),  # ties, overflow, tiny
        ]
    )
    return torch.from_numpy(bits.view(np.float32).copy())


def raw(tensor: torch.Tensor) -> np.ndarray:
    dtype = from_torch(tensor.dtype)
    return tensor.view(torch.int16).numpy().view(np.uint16) if dtype == BF16 else tensor.numpy()


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_widening_to_fp32_matches_torch(source: torch.dtype) -> None:
    values = every_pattern(source)
    ours = numpy_to_torch(convert(raw(values), from_torch(source), FP32), FP32)
    assert same_bits(ours, values.float())


@pytest.mark.parametrize("target", [BF16, FP16])
def test_narrowing_rounds_like_torch(target: DType) -> None:
    values = tricky_fp32()
    ours = numpy_to_torch(convert(raw(values), FP32, target), target)
    assert same_bits(ours, values.to(target.torch()))

"""Element types, named once for every file format zckpt touches.

torch is imported lazily: reading and planning need only names and item sizes, and a plain
fp32 consolidation never converts a single element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from .errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One element type: its torch name, safetensors code, torch storage class and size."""

    name: str  # torch attribute name, e.g. "float32"
    short: str  # the name users type and JSON shows, e.g. "fp32"
    safetensors: str  # safetensors header code, e.g. "F32"
    storage: str  # legacy typed storage class pickled by torch.save, e.g. "FloatStorage"
    itemsize: int
    is_floating: bool
    numpy_raw: str  # a numpy dtype with the same bytes (bf16 has none: raw uint16)

    def torch(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.short


_ALL = (
    DType("float32", "fp32", "F32", "FloatStorage", 4, True, "<f4"),
    DType("bfloat16", "bf16", "BF16", "BFloat16Storage", 2, True, "<u2"),
    DType("float16", "fp16", "F16", "HalfStorage", 2, True, "<f2"),
    DType("float64", "fp64", "F64", "DoubleStorage", 8, True, "<f8"),
    DType("int64", "int64", "I64", "LongStorage", 8, False, "<i8"),
    DType("int32", "int32", "I32", "IntStorage", 4, False, "<i4"),
    DType("int16", "int16", "I16", "ShortStorage", 2, False, "<i2"),
    DType("int8", "int8", "I8", "CharStorage", 1, False, "i1"),
    DType("uint8", "uint8", "U8", "ByteStorage", 1, False, "u1"),
    DType("bool", "bool", "BOOL", "BoolStorage", 1, False, "?"),
)

FP32, BF16, FP16 = _ALL[0], _ALL[1], _ALL[2]

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_SHORT: dict[str, DType] = {d.short: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _ALL}

# The dtypes a consolidated checkpoint can be written in.
OUTPUT_DTYPES: dict[str, DType] = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


DTypeLike = Union[str, "torch.dtype", DType]  # what the API's dtype= takes


def output_dtype(value: DTypeLike) -> DType:
    """The output DType a user named: ``fp32``/``bf16``/``fp16``, torch's names ``float32``/
    ``bfloat16``/``float16`` (any case, ``torch.`` prefix allowed), or the torch dtype itself."""
    key = value.short if isinstance(value, DType) else str(value).strip().lower().removeprefix("torch.")
    found = BY_SHORT.get(key) or BY_NAME.get(key)
    if found is None or found not in OUTPUT_DTYPES.values():
        raise UsageError(None, f"unknown dtype {value!r}: choose fp32, bf16 or fp16 (or float32, bfloat16, float16)")
    return found


def from_torch(dtype: "torch.dtype") -> DType:
    """The DType of a torch dtype (``torch.float32`` -> FP32)."""
    return BY_NAME[str(dtype).removeprefix("torch.")]


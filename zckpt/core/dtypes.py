"""Element types, named once for every file format zckpt touches.

torch is imported lazily: reading and planning need only names and item sizes, and a plain
fp32 consolidation never converts a single element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One element type: its torch name, safetensors code, torch storage class and size.

    Each DType is a singleton (pickling keeps it one: :meth:`__reduce__` names it) and immutable,
    also against a pickle's BUILD opcode, since the restricted unpickler hands these very objects
    out for ``torch.float32`` and a file must not be able to change them for the next one.
    """

    name: str  # torch attribute name, e.g. "float32"
    short: str  # the name users type and JSON shows, e.g. "fp32"
    safetensors_code: str | None  # safetensors header code, e.g. "F32"; None where safetensors has none
    # Typed storage class torch.save pickles for it (torch.FloatStorage, _rebuild_tensor_v2); None
    # for the dtypes torch pickles as torch.storage.UntypedStorage plus the dtype (_rebuild_tensor_v3).
    storage: str | None
    itemsize: int
    # Converted to the output dtype by consolidate and compared with a tolerance by diff: the
    # 16-, 32- and 64-bit floats. float8 (quantized weights, meaningless without their scales) and
    # complex tensors are kept bit for bit, like integers.
    is_floating: bool
    numpy_raw: str  # a numpy dtype with the same bytes (bf16, float8, complex32 have none: raw uints)

    @property
    def safetensors(self) -> str:
        """The safetensors header code; a clear error for dtypes safetensors cannot hold."""
        if self.safetensors_code is None:
            raise UsageError(
                None,
                f"safetensors has no {self.name} dtype: {self.name} tensors can only be written in torch format (--format torch)",
            )
        return self.safetensors_code

    def torch(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.short

    def __reduce__(self) -> tuple:
        return (by_name, (self.name,))

    def __setstate__(self, state: object) -> None:
        raise TypeError(f"dtype {self.name} is immutable")


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
    DType("complex64", "complex64", "C64", "ComplexFloatStorage", 8, False, "<c8"),
    DType("complex128", "complex128", None, "ComplexDoubleStorage", 16, False, "<c16"),
    # torch.save writes these as an UntypedStorage plus the dtype (torch.storage._new_dtypes()).
    DType("uint16", "uint16", "U16", None, 2, False, "<u2"),
    DType("uint32", "uint32", "U32", None, 4, False, "<u4"),
    DType("uint64", "uint64", "U64", None, 8, False, "<u8"),
    DType("float8_e4m3fn", "float8_e4m3fn", "F8_E4M3", None, 1, False, "u1"),
    DType("float8_e5m2", "float8_e5m2", "F8_E5M2", None, 1, False, "u1"),
    DType("float8_e4m3fnuz", "float8_e4m3fnuz", "F8_E4M3FNUZ", None, 1, False, "u1"),
    DType("float8_e5m2fnuz", "float8_e5m2fnuz", "F8_E5M2FNUZ", None, 1, False, "u1"),
    DType("float8_e8m0fnu", "float8_e8m0fnu", "F8_E8M0", None, 1, False, "u1"),
    # safetensors' F4 counts 4-bit elements, torch's float4_e2m1fn_x2 counts bytes of two: no code.
    DType("float4_e2m1fn_x2", "float4_e2m1fn_x2", None, None, 1, False, "u1"),
    DType("complex32", "complex32", None, None, 4, False, "<u4"),
    DType("bits8", "bits8", None, None, 1, False, "u1"),
    DType("bits16", "bits16", None, None, 2, False, "<u2"),
    DType("bits1x8", "bits1x8", None, None, 1, False, "u1"),
    DType("bits2x4", "bits2x4", None, None, 1, False, "u1"),
    DType("bits4x2", "bits4x2", None, None, 1, False, "u1"),
)

FP32, BF16, FP16 = _ALL[0], _ALL[1], _ALL[2]

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_SHORT: dict[str, DType] = {d.short: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors_code: d for d in _ALL if d.safetensors_code}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _ALL if d.storage}

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


def by_name(name: str) -> DType:
    """The DType of a torch dtype name ("float32"); how a pickled DType comes back as the same object."""
    return BY_NAME[name]


def from_torch(dtype: "torch.dtype") -> DType:
    """The DType of a torch dtype (``torch.float32`` -> FP32)."""
    return BY_NAME[str(dtype).removeprefix("torch.")]

"""``zckpt diff``: how two checkpoints or weights outputs differ, tensor by tensor.

Either side may be a ZeRO checkpoint (any stage or world size), a universal folder, or weights
(safetensors or torch, sharded or not): :mod:`zckpt.ops.tensor_sources` turns each into names and
file segments. Tensors present on both sides are read a range at a time (`chunk_elements` of
each side, 4M by default), compared in float64 and dropped, so memory stays bounded by a few
chunk buffers (about 200 MB) whatever the model size; two whole models are never held.

Semantics, as ``torch.allclose`` with ``equal_nan=True``: an element is equal when
``|a - b| <= atol + rtol * |b|``; NaN equals NaN at the same position; an infinity equals only
the same infinity; a NaN or infinity against anything else is an infinite difference. The
defaults (0, 0) ask for equal values (-0.0 equals 0.0). Values are compared whatever the dtypes
(a bf16 output against fp32 masters); a dtype difference is reported beside the value
difference, but the verdict is on the values: a checkpoint's bf16 frozen param and its fp32
consolidation hold the same numbers, and a checkpoint equals its own consolidation. Tensors of
different shapes differ and are not compared elementwise.

Optimizer states (with `states`): every per-element state (``<param>.exp_avg``, ...), the
per-group steps and numeric hyperparameters (``param_groups.<g>.step``, ``.lr``, ...) and the
engine's counters (``global_steps``, ...), compared when both sides are training checkpoints.
A trainable param's weight in a checkpoint is its fp32 master, so the masters are the weights
compared anyway. When only one side keeps optimizer states (a weights file), the states differ;
when neither does, there is nothing more to compare and the report says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from ..core.dtypes import BF16, FP32, DType
from ..core.errors import UsageError
from ..core.index import TensorSource
from ..core.state import ScalarState
from ..io.materialize import convert, read_scalar
from ..io.reading import FileReader, read_range
from .tensor_sources import NamedTensors, open_tensors

CHUNK_ELEMENTS = 1 << 22  # elements of each side read and compared at once
Progress = Callable[[int, int], None]  # (bytes read so far, total bytes to read)
Side = Literal["a", "b"]
TensorKind = Literal["weight", "state"]

_KIND_WORDS = {
    "zero_checkpoint": "ZeRO checkpoint",
    "universal_checkpoint": "universal checkpoint",
    "safetensors": "safetensors weights",
    "torch": "torch weights",
}


@dataclass(frozen=True)
class InputSummary:
    """One side of a comparison: what it is and what it holds."""

    path: str
    kind: str  # zero_checkpoint, universal_checkpoint, safetensors or torch
    tensors: int
    has_states: bool  # keeps optimizer states (a training checkpoint)
    tag: str | None = None
    zero_stage: int | None = None
    world_size: int | None = None
    files: int = 0
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: ``ZeRO-3 checkpoint, tag global_step3, world size 2``."""
        if self.kind == "zero_checkpoint":
            return f"ZeRO-{self.zero_stage} checkpoint, tag {self.tag}, world size {self.world_size}"
        if self.kind == "universal_checkpoint":
            return (
                f"universal checkpoint, tag {self.tag} (saved at world size {self.world_size}, ZeRO-{self.zero_stage})"
            )
        return f"{_KIND_WORDS[self.kind]}, {self.files} file{'s' * (self.files != 1)}"


@dataclass(frozen=True)
class TensorDiff:
    """One name present on both sides. Value statistics are over all elements (0 when none
    differ); they are None when the shapes differ and nothing was compared."""

    name: str
    kind: TensorKind
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    changed: int | None = 0  # elements not exactly equal (NaN equal to NaN)
    mismatched: int | None = 0  # elements outside atol + rtol * |b|
    max_abs_diff: float | None = 0.0
    max_rel_diff: float | None = 0.0  # |a - b| / |b|: infinite where b is 0 and a is not

    @property
    def numel(self) -> int:
        return math.prod(self.shape_a)

    @property
    def shape_differs(self) -> bool:
        return self.shape_a != self.shape_b

    @property
    def dtype_differs(self) -> bool:
        return self.dtype_a != self.dtype_b

    @property
    def equal(self) -> bool:
        """Same shape and every element within tolerance (the dtypes may differ)."""
        return not self.shape_differs and self.mismatched == 0


@dataclass(frozen=True)
class ScalarDiff:
    """A per-group scalar, hyperparameter or counter present on both sides."""

    name: str
    a: Any
    b: Any
    equal: bool


@dataclass(frozen=True)
class DiffReport:
    """What :func:`diff` found; `equal` is the verdict (the CLI's exit 0)."""

    a: InputSummary
    b: InputSummary
    atol: float
    rtol: float
    states: bool  # optimizer states were asked for
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    tensors: tuple[TensorDiff, ...]  # every name on both sides: weights, then states
    scalars: tuple[ScalarDiff, ...] = ()
    states_missing: tuple[Side, ...] = ()  # sides without optimizer states, when they were asked for
    notes: tuple[str, ...] = field(default=())

    @property
    def differing(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if not t.equal)

    @property
    def dtype_differences(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.dtype_differs)

    @property
    def states_differ(self) -> bool:
        """Asked for, and only one side keeps them."""
        return len(self.states_missing) == 1

    @property
    def equal(self) -> bool:
        return not (
            self.only_in_a
            or self.only_in_b
            or self.differing
            or self.states_differ
            or any(not s.equal for s in self.scalars)
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` report: plain JSON values (a non-finite float as "inf", "-inf" or "nan")."""
        return _plain(
            {
                "equal": self.equal,
                "a": _summary_dict(self.a),
                "b": _summary_dict(self.b),
                "atol": self.atol,
                "rtol": self.rtol,
                "states": self.states,
                "states_missing": list(self.states_missing),
                "only_in_a": list(self.only_in_a),
                "only_in_b": list(self.only_in_b),
                "differing": [t.name for t in self.differing],
                "dtype_differences": [t.name for t in self.dtype_differences],
                "tensors": [_tensor_dict(t) for t in self.tensors],
                "scalars": [{"name": s.name, "a": s.a, "b": s.b, "equal": s.equal} for s in self.scalars],
                "notes": list(self.notes),
            }
        )


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    states: bool = False,
    progress: Progress | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    verify: bool = True,
) -> DiffReport:
    """Compare two checkpoints or weights outputs, streaming tensor by tensor (module docstring).

    With `verify` (the default), the torch records whose bytes are compared pass their CRC-32
    check (safetensors files carry none), so damage is an error rather than a difference.
    """
    for option, value in (("atol", atol), ("rtol", rtol)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise UsageError(None, f"--{option} must be a finite number >= 0, got {value!r}")
    if chunk_elements < 1:
        raise UsageError(None, f"chunk_elements must be at least 1, got {chunk_elements}")
    left, right = open_tensors(a, states=states), open_tensors(b, states=states)
    pairs: list[tuple[str, TensorKind, TensorSource, TensorSource]]
    pairs = [(n, "weight", s, right.tensors[n]) for n, s in left.tensors.items() if n in right.tensors]
    only_a = [n for n in left.tensors if n not in right.tensors]
    only_b = [n for n in right.tensors if n not in left.tensors]
    missing: tuple[Side, ...] = ()
    notes: list[str] = []
    if states:
        missing = tuple(side for side, held in (("a", left), ("b", right)) if held.states is None)
        if left.states is not None and right.states is not None:
            pairs += [(n, "state", s, right.states[n]) for n, s in left.states.items() if n in right.states]
            only_a += [n for n in left.states if n not in right.states]
            only_b += [n for n in right.states if n not in left.states]
        for side in missing:
            notes.append(f"{side.upper()} keeps no optimizer states ({_KIND_WORDS[(left, right)[side == 'b'].kind]})")
    comparer = _Comparer(
        atol, rtol, chunk_elements, progress, sum(s.nbytes + t.nbytes for _, _, s, t in pairs if s.shape == t.shape)
    )
    with FileReader(verify=verify) as reader:
        tensors = tuple(comparer.compare(reader, name, kind, s, t) for name, kind, s, t in pairs)
        scalars: tuple[ScalarDiff, ...] = ()
        if left.scalars is not None and right.scalars is not None:
            scalars = tuple(
                _scalar_diff(reader, n, v, right.scalars[n]) for n, v in left.scalars.items() if n in right.scalars
            )
            only_a += [n for n in left.scalars if n not in right.scalars]
            only_b += [n for n in right.scalars if n not in left.scalars]
    return DiffReport(
        a=_summary(left),
        b=_summary(right),
        atol=float(atol),
        rtol=float(rtol),
        states=states,
        only_in_a=tuple(only_a),
        only_in_b=tuple(only_b),
        tensors=tensors,
        scalars=scalars,
        states_missing=missing,
        notes=tuple(notes),
    )


def _summary(held: NamedTensors) -> InputSummary:
    return InputSummary(
        path=held.path,
        kind=held.kind,
        tensors=len(held.tensors),
        has_states=held.is_checkpoint,
        tag=held.tag,
        zero_stage=held.zero_stage,
        world_size=held.world_size,
        files=len(held.files),
        notes=held.notes,
    )


class _Comparer:
    """Compares pairs of tensors a chunk at a time through two reused raw buffers."""

    def __init__(self, atol: float, rtol: float, chunk: int, progress: Progress | None, total: int) -> None:
        self.atol, self.rtol, self.chunk = atol, rtol, chunk
        self.progress, self.total, self.done = progress, total, 0
        self._buffers: dict[Side, np.ndarray] = {}

    def _raw(self, side: Side, dtype: DType, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        buffer = self._buffers.get(side)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[side] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buffer[:nbytes].view(np.dtype(dtype.numpy_raw))

    def compare(self, reader: FileReader, name: str, kind: TensorKind, a: TensorSource, b: TensorSource) -> TensorDiff:
        if a.shape != b.shape:
            return TensorDiff(name, kind, a.shape, b.shape, a.dtype.short, b.dtype.short, None, None, None, None)
        changed = mismatched = 0
        max_abs = max_rel = 0.0
        for start in range(0, a.numel, self.chunk):
            count = min(self.chunk, a.numel - start)
            raw_a, raw_b = self._raw("a", a.dtype, count), self._raw("b", b.dtype, count)
            read_range(reader, a, start, raw_a)
            read_range(reader, b, start, raw_b)
            self.done += count * (a.dtype.itemsize + b.dtype.itemsize)
            if self.progress:
                self.progress(self.done, self.total)
            if a.dtype == b.dtype and np.array_equal(raw_a.view(np.uint8), raw_b.view(np.uint8)):
                continue  # the same bits: nothing to measure
            stats = _chunk_stats(raw_a, a.dtype, raw_b, b.dtype, self.atol, self.rtol)
            changed += stats[0]
            mismatched += stats[1]
            max_abs, max_rel = max(max_abs, stats[2]), max(max_rel, stats[3])
        return TensorDiff(
            name, kind, a.shape, b.shape, a.dtype.short, b.dtype.short, changed, mismatched, max_abs, max_rel
        )


def _as_float64(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Exact: every dtype zckpt reads but int64 beyond 2**53 widens to float64 without loss."""
    if dtype == BF16:
        return convert(raw, BF16, FP32).astype(np.float64)
    return raw.astype(np.float64)


def _chunk_stats(
    raw_a: np.ndarray, dtype_a: DType, raw_b: np.ndarray, dtype_b: DType, atol: float, rtol: float
) -> tuple[int, int, float, float]:
    """(changed, mismatched, max abs diff, max rel diff) of one chunk of each side. Works in
    place on three float64 arrays of the chunk's length, which bound the memory used."""
    if not dtype_a.is_floating and not dtype_b.is_floating:  # integers and bools: equality exact
        ints_a, ints_b = raw_a.astype(np.int64), raw_b.astype(np.int64)
        same = ints_a == ints_b
        a, b = ints_a.astype(np.float64), ints_b.astype(np.float64)
        del ints_a, ints_b
        finite = None
    else:
        a, b = _as_float64(raw_a, dtype_a), _as_float64(raw_b, dtype_b)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        finite = np.isfinite(a) & np.isfinite(b)
    changed = int(same.size - np.count_nonzero(same))
    if not changed:
        return 0, 0, 0.0, 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 0 * inf: settled by `same` and `finite`
        difference = np.subtract(a, b)
        np.abs(difference, out=difference)
        difference[same] = 0.0
        difference[np.isnan(difference)] = np.inf  # a NaN against a number
        magnitude = np.abs(b, out=b)
        tolerance = np.multiply(magnitude, rtol, out=a)
        tolerance += atol
        close = difference <= tolerance
        if finite is not None:
            close &= finite
        close |= same
        relative = a  # the tolerances are spent
        relative.fill(np.inf)
        np.divide(difference, magnitude, out=relative, where=(magnitude != 0) & np.isfinite(magnitude))
        relative[difference == 0] = 0.0
    return changed, int(close.size - np.count_nonzero(close)), float(difference.max()), float(relative.max())


def _scalar_value(reader: FileReader, scalar: ScalarState) -> Any:
    if scalar.tensor is not None:
        return read_scalar(reader, scalar.tensor)
    return scalar.value


def _same_value(a: Any, b: Any) -> bool:
    """Numbers by value (a step saved as a float tensor equals the int 3), NaN equal to NaN."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers):
        return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _scalar_diff(reader: FileReader, name: str, a: ScalarState, b: ScalarState) -> ScalarDiff:
    left, right = _scalar_value(reader, a), _scalar_value(reader, b)
    return ScalarDiff(name, left, right, _same_value(left, right))


def _summary_dict(summary: InputSummary) -> dict[str, Any]:
    return {
        "path": summary.path,
        "kind": summary.kind,
        "tensors": summary.tensors,
        "has_states": summary.has_states,
        "tag": summary.tag,
        "zero_stage": summary.zero_stage,
        "world_size": summary.world_size,
        "files": summary.files,
        "notes": list(summary.notes),
    }


def _tensor_dict(t: TensorDiff) -> dict[str, Any]:
    return {
        "name": t.name,
        "kind": t.kind,
        "equal": t.equal,
        "shape_a": list(t.shape_a),
        "shape_b": list(t.shape_b),
        "dtype_a": t.dtype_a,
        "dtype_b": t.dtype_b,
        "numel": t.numel if not t.shape_differs else None,
        "changed": t.changed,
        "mismatched": t.mismatched,
        "max_abs_diff": t.max_abs_diff,
        "max_rel_diff": t.max_rel_diff,
    }


def _plain(value: Any) -> Any:
    """JSON-safe: tuples as lists, non-finite floats as strings (JSON has no inf or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)

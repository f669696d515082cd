"""Planning cost of ``reshard --tensor-parallel T``: a Megatron-style layer's tensors, merged from 2
tensor ranks (as the reader leaves them: a row-parallel weight is one file segment per rank per
row), cut for 4 ranks by the merge rules, each rank's slices found by bisection over the
segments (``SegmentSlicer``) against a walk from the first segment for every run (what
``slice_segments`` did before), timed in the same run. Planning only: no file is read or written.

    python scripts/bench_tp_cut.py --hidden 4096 --layers 2
"""

from __future__ import annotations

import argparse
import itertools
import time

from zckpt.core.dtypes import FP32
from zckpt.core.index import Segment, TensorSource
from zckpt.deepspeed import tensor_parallel
from zckpt.deepspeed.megatron_rules import megatron_specs, shard_shapes

RULES = {
    "parameter_with_row_parallelism_patterns": [r"\d+\.(dense|dense_4h_to_h)\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"\d+\.dense_h_to_4h\.weight"],
}


class WalkingSlicer:
    """The baseline: every slice walks the segments from the first."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source

    def slice(self, start: int, length: int) -> list[Segment]:
        out, base, end = [], 0, start + length
        for segment in self.source.segments:
            lo, hi = max(start, base), min(end, base + segment.numel)
            if lo < hi:
                out.append(Segment(segment.path, segment.offset + (lo - base) * 4, hi - lo))
            base += segment.numel
            if base >= end:
                break
        return out


def merged_tensors(hidden: int, layers: int) -> dict[str, TensorSource]:
    """Each layer's weights as 2 tensor ranks' slices joined: rows split (q/k/v, the SwiGLU's up
    projection) are one segment per rank, columns split (the projections back) one per rank per row."""
    tensors = {}
    for layer in range(layers):
        for name, rows, cols, split_columns in (
            ("query_key_value", 3 * hidden, hidden, False),
            ("dense", hidden, hidden, True),
            ("dense_h_to_4h", 8 * hidden, hidden, False),
            ("dense_4h_to_h", hidden, 4 * hidden, True),
        ):
            if split_columns:
                half = cols // 2
                segments = [Segment(f"rank{t}", r * half * 4, half) for r in range(rows) for t in range(2)]
            else:
                segments = [Segment(f"rank{t}", 0, rows // 2 * cols) for t in range(2)]
            tensors[f"{layer}.{name}.weight"] = TensorSource(FP32, (rows, cols), tuple(segments))
    return tensors


def plan(tensors: dict[str, TensorSource], tp: int) -> float:
    shapes = {n: shard_shapes(RULES, n, s.shape, True, tp) for n, s in tensors.items()}
    specs = megatron_specs(RULES, shapes, set(tensors))
    started = time.perf_counter()
    for (name, source), t in itertools.product(tensors.items(), range(tp)):
        tensor_parallel.cut(name, source, specs[name], t)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=4)
    args = parser.parse_args()
    tensors = merged_tensors(args.hidden, args.layers)
    gigabytes = sum(s.numel for s in tensors.values()) * 4 / 1e9
    bisecting = plan(tensors, args.tp)
    tensor_parallel.SegmentSlicer = WalkingSlicer  # type: ignore[misc,assignment]
    walking = plan(tensors, args.tp)
    print(
        f"hidden {args.hidden}, {args.layers} layers ({gigabytes:.2f} GB of fp32 masters) cut 2 -> {args.tp} tensor "
        f"ranks: bisecting {bisecting:.2f} s, walking {walking:.2f} s ({walking / bisecting:.0f}x)"
    )


if __name__ == "__main__":
    main()

"""Tensor-parallel checkpoints, ZeRO-1/2/3: DeepSpeed's AutoTP (``"tensor_parallel":
{"autotp_size": N}``) and Megatron-style runs (an ``mpu``), read as the unsharded model.

What such a run saves (DeepSpeed 0.19.8, see ``sample_ckpts/FORMAT_OBSERVED.md``): per tensor rank
t, its model-states file(s) (``mp_rank_{t:02d}_model_states.pt``; ZeRO-3: one per data rank) and
its data ranks' ZeRO files ``zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt``: each tensor rank
is its own ZeRO partitioning of its shards over its data ranks. How the shards merge is the
``universal_checkpoint_info`` of the model-states files: AutoTP's has an exact ``affine_map`` (per
param, a regular expression of its name, its logical shape and, per tensor rank, the pieces it
holds, each a strided block (``shape``) at ``source`` (offset, strides) in the logical tensor and
``dest`` in the shard, with ``locations``: every rank that holds the same piece); Megatron's has
merge patterns, which :mod:`.megatron_rules` turns into such pieces.

:func:`read_tensor_parallel` reads each tensor rank with the data-parallel reader
(:func:`~.dp_reader.read_ranks`) and assembles every tensor (masters, each optimizer state,
buffers) from its pieces as file segments: no byte is read to plan it. A piece several ranks
hold is taken from the first; the other ranks' copies of a replicated param are kept as
``replicas``, which verify compares. A tensor-parallel checkpoint without merge information is
refused rather than guessed.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import replace
from typing import Any

from ..core.errors import LayoutError
from ..core.index import CheckpointIndex, Entry, Segment, SegmentSlicer, TensorSource, merged_index
from ..core.state import ParamState, TrainingState
from ..core.topology import Topology
from ..io.materialize import unequal_elements
from ..io.reading import FileReader
from . import names as N
from .dp_reader import read_ranks
from .megatron_rules import has_merge_patterns, megatron_specs, merge_rule
from .rank_files import RankFiles, load
from .survey import Survey


def read_tensor_parallel(
    result: Survey,
    files: RankFiles,
    modules: list[dict] | None = None,
    mp_world: int | None = None,
    tp_rules: dict[str, Any] | None = None,
) -> None:
    """Read a tensor-parallel tag folder into `result`: each tensor rank as the data-parallel ZeRO
    checkpoint it is, every tensor assembled from the ranks' pieces. A pipeline stage of a
    pipeline x tensor parallel run gives each tensor rank's module state dict (`modules`, rebuilt
    from its layer files) and the run's model-parallel size (`mp_world`). `tp_rules`: merge rules
    the user gives (``--tp-rules``), used instead of the checkpoint's."""
    location = result.location
    assert location is not None
    ranks = files.tensor_ranks
    tp = max(ranks) + 1
    key = files.first  # rank 0's model-states file: ZeRO-1/2 keep one per tensor rank, ZeRO-3 one per rank
    first = files.tensor_rank(0).model.get(key)
    model0 = load(result, first) if first is not None else None
    missing = [t for t in range(tp) if t not in ranks or key not in files.tensor_rank(t).model]
    if missing:
        result.add(
            LayoutError,
            os.path.join(files.tag_dir, N.model_states_name(3 if files.zero3 else 1, 0, files.mp_rank + missing[0])),
            f"missing (tensor rank {missing[0]} of {tp})",
        )
        return
    if not isinstance(model0, dict):
        return
    info = tp_rules if tp_rules is not None else model0.get(N.UNIVERSAL_CHECKPOINT_INFO)
    affine = _affine_map(info)
    megatron = affine is None and has_merge_patterns(info)
    if affine is None and not megatron:
        result.add(
            LayoutError,
            first,
            f"a tensor-parallel checkpoint ({tp} tensor ranks) that does not say how its shards merge: it records "
            "no universal_checkpoint_info (an AutoTP affine_map or Megatron's merge patterns, saved as client "
            "state); zckpt does not guess a merge: pass --tp-rules FILE, a JSON object of Megatron's merge patterns "
            "(tp_replicated_parameter_patterns, parameter_with_row_parallelism_patterns, ...; see the README)",
        )
        return
    surveys = []
    for t in range(tp):
        sub = Survey(result.path, location=location)
        module = {None: modules[t]} if modules is not None else None
        read_ranks(sub, files.tensor_rank(t), modules=module, mp_world=mp_world or tp)
        surveys.append(sub)
    base = surveys[0]
    whole = result.take_parts(surveys)
    dp = base.world_size
    result.world_size = tp * dp if dp else None
    if not whole:
        return
    assert dp is not None
    try:
        indexes = [sub.index for sub in surveys if sub.index is not None]
        if megatron:
            affine = _megatron_map(info, indexes)
        assert affine is not None
        merge = _Merge(affine, indexes, tp)
        entries = [merge.entry(e) for e in surveys[0].index.entries]  # type: ignore[union-attr]
    except LayoutError as exc:  # the merge rules are rank 0's model-states file's: named where nothing else is
        result.problems.append(exc if exc.path else LayoutError(first, exc.problem))
        return
    averaged = [
        e.name for e in entries if megatron and e.kind != "tied" and merge_rule(info, e.name).kind == "averaged"
    ]
    if averaged and not _copies_equal(result, averaged, surveys):
        return
    result.declared = [(e.name, e.source.shape, e.kind) for e in entries if e.kind != "tied"]
    result.declared_dtypes = base.declared_dtypes
    rules = merge_rules_label(megatron, tp_rules is not None)
    result.notes.append(
        f"tensor-parallel ({rules}): {tp} tensor ranks x {dp} data-parallel rank{'s' * (dp != 1)}; "
        f"{len(merge.replicated)} params replicated on every tensor rank, the others merged from their pieces"
        + (
            f"; {len(averaged)} the rules average (parameter_to_average_patterns) hold the same bits on every "
            "rank, taken as saved"
            if averaged
            else ""
        )
    )
    assert base.index is not None
    result.index = merged_index(
        base.index,
        Topology(tp=tp, dp=dp),
        entries,
        tuple(result.files),
        tuple(result.notes),
        merge.replicas,
        merge.placements,
        [pair for sub in surveys if sub.index is not None for pair in sub.index.rounded_copies],
    )
    try:
        result.state = _merged_state(result.index, [sub.state for sub in surveys if sub.state is not None], merge)
        if megatron:
            result.state = replace(result.state, tensor_merge_rules=info)
    except LayoutError as exc:
        result.problems.append(exc)
        result.index = None


COMPARE_CHUNK = 1 << 22  # elements of two copies compared at a time: memory stays bounded


def _copies_equal(result: Survey, names: list[str], surveys: list[Survey]) -> bool:
    """Whether every tensor rank's copy of each of `names` (weights, masters, optimizer states)
    holds tensor rank 0's bits. DeepSpeed's merge writes the mean of such params; where the
    copies are equal that is the saved value, where they differ it is new numbers, which zckpt
    does not write (a problem listed, naming the rank's file)."""
    with FileReader() as reader:
        for name in names:
            copies = [_sources(sub, name) for sub in surveys]
            for t, found in enumerate(copies[1:], start=1):
                for what, source in found.items():
                    first = copies[0].get(what)
                    same = (
                        first is not None
                        and (source.shape, source.dtype) == (first.shape, first.dtype)
                        and not unequal_elements(reader, first, source, COMPARE_CHUNK)
                    )
                    if not same:
                        path = source.segments[0].path if source.segments else None
                        result.add(
                            LayoutError,
                            path,
                            f"{name}: the rules average it over the tensor ranks (parameter_to_average_patterns), and "
                            f"tensor rank {t}'s {what} differs from tensor rank 0's: their mean would be new numbers, "
                            "not the saved ones, and zckpt does not write it",
                        )
                        return False
    return True


def _sources(survey: Survey, name: str) -> dict[str, TensorSource]:
    """One tensor rank's copies of a param: its module entry (the master of a trainable one) and
    its optimizer states."""
    found: dict[str, TensorSource] = {}
    if survey.index is not None:
        entry = next((e for e in survey.index.entries if e.name == name), None)
        if entry is not None:
            found["value" if entry.kind != "param" else "master"] = entry.source
    if survey.state is not None:
        param = next((p for p in survey.state.params if p.name == name), None)
        if param is not None:
            found.update(param.states)
    return found


def merge_rules_label(megatron: bool, given: bool) -> str:
    """What a tensor-parallel run's shards were merged by, for its note."""
    if not megatron:
        return "AutoTP"
    return f"Megatron-style, merged by {'the --tp-rules' if given else 'its universal_checkpoint_info'} patterns"


def _affine_map(info: Any) -> dict[str, Any] | None:
    """The per-param pieces of an AutoTP ``universal_checkpoint_info``, if it has them."""
    affine = info.get(N.AFFINE_MAP) if isinstance(info, dict) else None
    params = affine.get("params") if isinstance(affine, dict) else None
    return params if isinstance(params, dict) and params else None


def _megatron_map(info: dict[str, Any], indexes: list[CheckpointIndex]) -> dict[str, Any]:
    """Megatron's merge patterns as an affine map keyed by each param's exact name."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    trainable = set()
    for entry in indexes[0].entries:
        if entry.kind == "tied":
            continue
        by_rank = []
        for t, index in enumerate(indexes):
            found = next((e for e in index.entries if e.name == entry.name), None)
            if found is None:
                raise LayoutError(index.tag_dir, f"tensor rank {t} has no {entry.name} (rank 0 has)")
            by_rank.append(found.source.shape)
        shapes[entry.name] = by_rank
        if entry.kind == "param":
            trainable.add(entry.name)
    return {re.escape(name): spec for name, spec in megatron_specs(info, shapes, trainable).items()}


class _Merge:
    """Every tensor of the unsharded model as segments of the tensor ranks' shards."""

    def __init__(self, affine: dict[str, Any], indexes: list[CheckpointIndex], tp: int) -> None:
        self.patterns = [(re.compile(pattern), spec) for pattern, spec in affine.items()]
        self.indexes = indexes
        self.by_name = [{e.name: e for e in index.entries} for index in indexes]  # each rank's, looked up per name
        self.tp = tp
        self.replicas: list[Entry] = []
        self.replicated: set[str] = set()
        self.placements: dict[str, str] = {}  # name -> how the tensor ranks held it

    def spec(self, name: str) -> dict[str, Any] | None:
        found = [spec for pattern, spec in self.patterns if pattern.fullmatch(name)]
        return found[0] if found else None

    def entry(self, entry: Entry) -> Entry:
        """The unsharded entry of rank 0's `entry` (its alias kept for a tied one)."""
        if entry.kind == "tied":
            return entry  # rewired below, once its source is assembled
        shards = [self._rank_entry(t, entry.name).source for t in range(self.tp)]
        spec = self.spec(entry.name)
        if spec is None:
            if entry.kind == "param":
                raise LayoutError(None, f"param {entry.name} is not in the checkpoint's affine_map: cannot merge it")
            self._replicas(entry, shards)  # a buffer or frozen param without a map: alike on every rank
            self.placements[entry.name] = f"a copy on each of {self.tp} tensor ranks"
            return entry
        source = self.assemble(entry.name, spec, shards)
        if self._whole_on_every_rank(spec):
            self.replicated.add(entry.name)
            self._replicas(entry, shards)
            self.placements[entry.name] = f"replicated on {self.tp} tensor ranks"
        else:
            self.placements[entry.name] = _split(spec, self.tp)
        return replace(entry, source=source)

    def _rank_entry(self, t: int, name: str) -> Entry:
        entry = self.by_name[t].get(name)
        if entry is None:
            raise LayoutError(self.indexes[t].tag_dir, f"tensor rank {t} has no {name} (rank 0 has)")
        return entry

    def _replicas(self, entry: Entry, shards: list[TensorSource]) -> None:
        for source in shards[1:]:
            self.replicas.append(replace(entry, source=source))

    def _whole_on_every_rank(self, spec: dict[str, Any]) -> bool:
        ranks = spec.get("ranks") or {}
        return all(
            len(r.get("pieces", [])) == 1 and sorted(r["pieces"][0].get("locations", [])) == list(range(self.tp))
            for r in ranks.values()
        )

    def assemble(self, name: str, spec: dict[str, Any], shards: list[TensorSource]) -> TensorSource:
        """The logical tensor of `spec` as segments of the ranks' shard sources."""
        shape = tuple(int(d) for d in spec["logical_shape"])
        numel = 1
        for d in shape:
            numel *= d
        runs: list[tuple[int, int, int, int]] = []  # (logical start, rank, shard start, length)
        for rank_key, held in (spec.get("ranks") or {}).items():
            t = int(rank_key)
            for piece in held.get("pieces", []):
                if int(piece["locations"][0]) != t:
                    continue  # a replicated piece: taken from the first rank that holds it
                runs.extend((logical, t, shard, length) for logical, shard, length in _rows(piece, name))
        runs.sort()
        position, segments = 0, []
        slicers = [SegmentSlicer(shard) for shard in shards]
        dtype = shards[0].dtype
        for logical, t, shard, length in runs:
            if logical != position:
                raise LayoutError(
                    None, f"{name}: its affine_map pieces leave elements {position}-{logical} uncovered or overlap"
                )
            if shards[t].dtype != dtype:
                raise LayoutError(None, f"{name}: tensor ranks hold it in different dtypes")
            segments.extend(_slice(slicers[t], shard, length))
            position += length
        if position != numel:
            raise LayoutError(None, f"{name}: its affine_map pieces cover {position} of {numel} elements")
        return TensorSource(dtype, shape, tuple(_joined(segments, dtype.itemsize)))


def cut(name: str, source: TensorSource, spec: dict[str, Any], t: int) -> TensorSource:
    """Tensor rank `t`'s shard of the logical tensor `source` by `spec` (an ``affine_map`` spec,
    :meth:`_Merge.assemble`'s inverse): the pieces it holds, as segments of `source`."""
    logical = tuple(int(d) for d in spec["logical_shape"])
    if logical != source.shape:
        raise LayoutError(None, f"{name}: its rule cuts a tensor of shape {logical}, it has {source.shape}")
    held = (spec.get("ranks") or {}).get(str(t)) or {}
    shape = tuple(int(d) for d in held.get("shard_shape", ()))
    runs = sorted(
        (shard, start, length) for piece in held.get("pieces", []) for start, shard, length in _rows(piece, name)
    )
    position, segments = 0, []
    slicer = SegmentSlicer(source)
    for shard, start, length in runs:
        if shard != position:
            raise LayoutError(
                None, f"{name}: tensor rank {t}'s pieces leave elements {position}-{shard} uncovered or overlap"
            )
        segments.extend(slicer.slice(start, length))
        position += length
    if position != math.prod(shape):
        raise LayoutError(None, f"{name}: tensor rank {t}'s pieces cover {position} of its {math.prod(shape)} elements")
    return TensorSource(source.dtype, shape, tuple(_joined(segments, source.dtype.itemsize)))


def _split(spec: dict[str, Any], tp: int) -> str:
    """How a param's affine map cuts it: the dimension its shards are shorter in ("rows" for dim
    0, "columns" for dim 1), and the pieces per rank where a rank holds several (fused q/k/v)."""
    logical = [int(d) for d in spec["logical_shape"]]
    ranks = list((spec.get("ranks") or {}).values())
    shard = [int(d) for d in (ranks[0].get("shard_shape") or logical)] if ranks else logical
    dims = [d for d, (whole, part) in enumerate(zip(logical, shard)) if whole != part]
    where = {0: "rows", 1: "columns"}.get(dims[0], f"dim {dims[0]}") if len(dims) == 1 else "pieces"
    pieces = max((len(r.get("pieces", [])) for r in ranks), default=1)
    return f"{where} split over {tp} tensor ranks" + (f" ({pieces} pieces each)" if pieces > 1 else "")


def _rows(piece: dict[str, Any], name: str) -> list[tuple[int, int, int]]:
    """A piece as runs of contiguous elements: (logical offset, shard offset, length)."""
    shape = [int(d) for d in piece["shape"]]
    source_offset, source_strides = int(piece["source"][0]), [int(s) for s in piece["source"][1]]
    dest_offset, dest_strides = int(piece["dest"][0]), [int(s) for s in piece["dest"][1]]
    if not shape:
        return [(source_offset, dest_offset, 1)]
    if source_strides[-1] != 1 or dest_strides[-1] != 1:
        raise LayoutError(None, f"{name}: an affine_map piece strided in its last dimension is not supported")
    # merge trailing dimensions that are contiguous in both the logical tensor and the shard
    run = shape[-1]
    outer = len(shape) - 1
    while outer > 0 and source_strides[outer - 1] == run and dest_strides[outer - 1] == run:
        run *= shape[outer - 1]
        outer -= 1
    out = []
    for index in itertools.product(*(range(d) for d in shape[:outer])):
        logical = source_offset + sum(i * s for i, s in zip(index, source_strides))
        shard = dest_offset + sum(i * s for i, s in zip(index, dest_strides))
        out.append((logical, shard, run))
    return out


def _slice(slicer: SegmentSlicer, start: int, length: int) -> list[Segment]:
    out = slicer.slice(start, length)
    if sum(s.numel for s in out) != length:
        segments = slicer.source.segments
        raise LayoutError(segments[0].path if segments else None, "a shard is shorter than its pieces")
    return out


def _joined(segments: list[Segment], itemsize: int) -> list[Segment]:
    """Adjacent segments of one file merged (a row-split tensor is one run per rank)."""
    out: list[Segment] = []
    for segment in segments:
        last = out[-1] if out else None
        if last is not None and last.path == segment.path and segment.offset == last.offset + last.numel * itemsize:
            out[-1] = Segment(last.path, last.offset, last.numel + segment.numel)
        else:
            out.append(segment)
    return out


def _merged_state(index: CheckpointIndex, states: list[TrainingState], merge: _Merge) -> TrainingState:
    """Rank 0's training state with every param's master and states assembled from the ranks'."""
    first = states[0]
    ranks = [{p.name: p for p in state.params} for state in states]
    params = []
    for param in first.params:
        spec = merge.spec(param.name)
        if spec is None:
            raise LayoutError(index.tag_dir, f"param {param.name} is not in the checkpoint's affine_map")
        by_rank = [rank[param.name] for rank in ranks]
        master = merge.assemble(param.name, spec, [p.master for p in by_rank])
        keys = list(param.states)
        assembled = {k: merge.assemble(param.name, spec, [p.states[k] for p in by_rank]) for k in keys}
        params.append(ParamState(param.name, master.shape, param.group, master, assembled))
    return replace(first, index=index, params=tuple(params), rank_buffers=(), tensor_shards=tuple(states))

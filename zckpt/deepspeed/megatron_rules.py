"""Megatron-style merge rules (``universal_checkpoint_info`` patterns) as pieces.

A tensor-parallel run driven by Megatron's ``mpu`` saves each tensor rank's slices and, as client
state, the rules ``ds_to_universal`` merges them by (``merge_tp_slices``, DeepSpeed 0.19.8): a
param matching a ``tp_replicated`` pattern is the same on every rank; one matching a
``2_sub_params_cat_dim_0`` pattern is two halves, each concatenated over the ranks; one with a
``parameter_with_sub_params`` shape is several sub-params (a fused query/key/value), each
concatenated on the partition dimension (per-rank widths from ``sub_param_shard_widths``); a
row-parallel one is concatenated on dim 1, any other on dim 0; a vocabulary one is then cut to
``original_vocab_size`` rows. Patterns match a name's start (``re.match``), first category first,
as DeepSpeed's do. A param matching a ``parameter_to_average`` pattern (``ds_to_universal`` writes
the mean of its copies) is read as a replicated one: the tensor-parallel reader takes it only when
every rank's copy holds the same bits, and refuses it otherwise (a mean is new numbers, not saved bits).

:func:`megatron_specs` turns those rules into the form of AutoTP's ``affine_map`` (per rank, the
strided pieces it holds of the logical tensor), so :mod:`.tensor_parallel` assembles Megatron and
AutoTP checkpoints with one routine; :func:`universal_keys` says what a universal folder holds
beside each merged tensor so DeepSpeed's loader cuts it again. Pure: names, shapes and the rules
in, specs out.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import LayoutError, UsageError
from ..torchfile.pickler import GlobalName, PickledInstance
from . import names as N

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Block:
    """Rows ``[rank_start, rank_start + length)`` of a rank's slice along `dim` are rows
    ``[logical_start, ...)`` of the logical tensor along `dim` (every other dim whole)."""

    rank: int
    dim: int
    logical_start: int
    rank_start: int
    length: int


def load_rules(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``--tp-rules`` file: a JSON object with the keys of Megatron's ``universal_checkpoint_info``
    (the pattern lists, ``original_vocab_size``, ``parameter_with_sub_params`` and
    ``sub_param_shard_widths``), for a tensor-parallel checkpoint that does not record them. Read
    as data; a sub-param ``shape`` given as lists becomes the tuples DeepSpeed saves."""
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as handle:
            rules = json.load(handle)
    except OSError as exc:
        raise UsageError(where, f"--tp-rules: cannot read it ({exc.strerror})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(where, f"--tp-rules: not a JSON file ({exc})") from None
    if not isinstance(rules, dict) or not has_merge_patterns(rules):
        keys = ", ".join(N.MEGATRON_PATTERN_KEYS)
        raise UsageError(where, f"--tp-rules: a JSON object with at least one of {keys} is expected")
    for key in N.MEGATRON_PATTERN_KEYS:
        value = rules.get(key, [])
        if key != N.PARAMETER_WITH_SUB_PARAMS and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise UsageError(where, f"--tp-rules: {key} must be a list of regular expressions")
        for pattern in value if key != N.PARAMETER_WITH_SUB_PARAMS else []:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(where, f"--tp-rules: {key}: {pattern!r} is not a regular expression ({exc})") from None
    for rule in rules.get(N.PARAMETER_WITH_SUB_PARAMS, []):
        if not isinstance(rule, dict) or not {"patterns", "shape", "partition_dim"} <= set(rule):
            raise UsageError(
                where, "--tp-rules: each parameter_with_sub_params entry needs patterns, shape, partition_dim"
            )
        rule["shape"] = _tuples(rule["shape"])
    return rules


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def has_merge_patterns(info: Any) -> bool:
    """Whether a ``universal_checkpoint_info`` states Megatron-style merge rules."""
    return isinstance(info, dict) and any(key in info for key in N.MEGATRON_PATTERN_KEYS)


def megatron_specs(info: dict[str, Any], shard_shapes: dict[str, list[Shape]], trainable: set[str]) -> dict[str, Any]:
    """Per param name, its merge as an ``affine_map`` spec (``logical_shape``, and per tensor
    rank ``shard_shape`` and ``pieces``). `shard_shapes` holds each name's slice shape on every
    tensor rank. A trainable param no pattern names is concatenated on dim 0 (DeepSpeed's
    default); a frozen param or buffer no pattern names gets no spec (a copy on each rank)."""
    specs: dict[str, Any] = {}
    for name, shapes in shard_shapes.items():
        rule = merge_rule(info, name, name in trainable)
        if rule.kind == "copies":
            continue
        blocks, logical = _blocks(info, rule, name, [tuple(s) for s in shapes])
        if rule.vocabulary:
            blocks, logical = _vocabulary_cut(info, name, blocks, logical)
        specs[name] = _spec(blocks, logical, [tuple(s) for s in shapes])
    return specs


@dataclass(frozen=True)
class MergeRule:
    """How one param's tensor-rank slices join, by the first rule that names it (DeepSpeed's
    order): `kind` is "replicated", "averaged" (replicated copies DeepSpeed averages), "halves"
    (2 sub-params on dim 0), "sub_params", "dim1" (row parallel), "dim0", or "copies" (a frozen
    param or buffer no pattern names); `vocabulary`: rows cut to ``original_vocab_size`` after the join."""

    kind: str
    vocabulary: bool = False
    sub_params: tuple[str, dict[str, Any]] | None = None  # the matched pattern and its rule

    @property
    def dim(self) -> int:
        """The dimension the tensor ranks' slices join on: a sub-param rule's ``partition_dim``, 1
        for a row-parallel param, else 0."""
        if self.sub_params is not None:
            return int(self.sub_params[1].get("partition_dim", 0))
        return 1 if self.kind == "dim1" else 0


def merge_rule(info: dict[str, Any], name: str, trainable: bool = True) -> MergeRule:
    """The rule `info` gives `name`."""
    vocabulary = _matches(info.get(N.VOCABULARY_PARAMETER_PATTERNS), name) is not None
    if _matches(info.get(N.TP_REPLICATED_PARAMETER_PATTERNS), name):
        return MergeRule("replicated", vocabulary)
    if _matches(info.get(N.PARAMETER_TO_AVERAGE_PATTERNS), name):
        return MergeRule("averaged", vocabulary)
    if _matches(info.get(N.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0), name):
        return MergeRule("halves", vocabulary)
    sub = _sub_param_rule(info, name)
    if sub is not None:
        return MergeRule("sub_params", vocabulary, sub)
    if _matches(info.get(N.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS), name):
        return MergeRule("dim1", vocabulary)
    return MergeRule("dim0" if trainable or vocabulary else "copies", vocabulary)


def universal_keys(info: dict[str, Any], name: str) -> dict[str, Any]:
    """What ``ds_to_universal`` writes beside a trainable param's merged tensor (``merge_tp_slices``,
    in its order), from which DeepSpeed's universal loader cuts each tensor rank's slice again:
    the concatenation dim, the sub-param count or shape, whether the rows are a vocabulary."""
    rule = merge_rule(info, name)
    keys: dict[str, Any] = {}
    if rule.kind == "halves":
        keys = {N.UNIVERSAL_CAT_DIM: 0, N.PARAM_N_SUB_PARAMS: 2}
    elif rule.kind == "sub_params":
        assert rule.sub_params is not None
        found = rule.sub_params[1]
        state = {key: found.get(key) for key in ("patterns", "shape", "partition_dim")}
        keys = {N.SUB_PARAM_SHAPE: PickledInstance(GlobalName(*N.SUBPARAM_SHAPE_CLASS), state)}
    elif rule.kind in ("dim0", "dim1"):
        keys = {N.UNIVERSAL_CAT_DIM: 1 if rule.kind == "dim1" else 0}
    if rule.vocabulary:
        keys[N.VOCAB_TENSOR] = True
    return keys


def rules_at_tensor_ranks(info: dict[str, Any], tp: int, padded_vocab_size: int | None = None) -> dict[str, Any]:
    """The rules a run of the same model at `tp` tensor ranks records: the same patterns, each
    sub-param's width split evenly over the ranks (Megatron splits each of a fused q/k/v's parts
    by its heads), the vocabulary padded to `padded_vocab_size` rows (default at one rank: not
    padded, ``original_vocab_size`` rows, as zckpt merges it). A sub-param that does not split
    evenly is refused: that run cannot exist."""
    out = dict(info)
    widths = info.get(N.SUB_PARAM_SHARD_WIDTHS)
    if isinstance(widths, dict):
        at_tp = {}
        for pattern, sub_params in widths.items():
            if not isinstance(sub_params, list):
                at_tp[pattern] = sub_params
                continue
            totals = [sum(int(w) for w in per_rank) for per_rank in sub_params]
            if any(total % tp for total in totals):
                raise UsageError(
                    None,
                    f"--tensor-parallel {tp}: the sub-params of the params matching {pattern} ({totals} rows) do "
                    f"not split evenly over {tp} tensor ranks",
                )
            at_tp[pattern] = [[total // tp] * tp for total in totals]
        out[N.SUB_PARAM_SHARD_WIDTHS] = at_tp
    if padded_vocab_size is not None:
        out[N.PADDED_VOCAB_SIZE] = padded_vocab_size
    elif tp == 1 and N.PADDED_VOCAB_SIZE in info and N.ORIGINAL_VOCAB_SIZE in info:
        out[N.PADDED_VOCAB_SIZE] = info[N.ORIGINAL_VOCAB_SIZE]
    return out


def shard_shapes(info: dict[str, Any], name: str, shape: Shape, trainable: bool, tp: int) -> list[Shape]:
    """The slice of a tensor of `shape` each of `tp` tensor ranks holds by the rule `info` (rules
    at `tp` ranks) gives `name`: a whole copy of a replicated one, an even share of the dimension
    it is split on (of each half, of each sub-param). Refused where that share is not whole."""
    rule = merge_rule(info, name, trainable)
    if rule.kind in ("replicated", "averaged", "copies"):
        return [shape] * tp
    dim = rule.dim
    if len(shape) <= dim:
        raise LayoutError(None, f"{name}: a {len(shape)}-d tensor cannot be split on dim {dim}")
    unit = 2 * tp if rule.kind == "halves" else tp
    if shape[dim] % unit:
        halves = " (each of its two halves)" if rule.kind == "halves" else ""
        raise UsageError(
            None,
            f"--tensor-parallel {tp}: {name} has {shape[dim]} {'columns' if dim == 1 else 'rows'}, which do not "
            f"split evenly over {tp} tensor ranks{halves}",
        )
    return [_with(shape, dim, shape[dim] // tp)] * tp


def _matches(patterns: Any, name: str) -> str | None:
    """The one pattern of `patterns` that matches `name`'s start (DeepSpeed refuses two)."""
    found = [p for p in (patterns or []) if isinstance(p, str) and re.match(p, name)]
    if len(found) > 1:
        raise LayoutError(None, f"{name}: matched by several merge patterns of one kind ({', '.join(found)})")
    return found[0] if found else None


def _blocks(info: dict[str, Any], rule: MergeRule, name: str, shapes: list[Shape]) -> tuple[list[_Block], Shape]:
    """The blocks of `name`'s logical tensor by its rule."""
    if rule.kind in ("replicated", "averaged"):
        if any(s != shapes[0] for s in shapes):
            raise LayoutError(
                None, f"{name}: {rule.kind} over the tensor ranks by its pattern, but their shapes differ"
            )
        return [], shapes[0]  # no blocks: one piece every rank holds (see _spec)
    if rule.kind == "halves":
        return _two_halves(name, shapes)
    if rule.kind == "sub_params":
        return _sub_params(info, name, shapes, rule)
    return _concatenated(name, shapes, rule.dim)


def _concatenated(name: str, shapes: list[Shape], dim: int) -> tuple[list[_Block], Shape]:
    if len(shapes[0]) <= dim:
        raise LayoutError(None, f"{name}: a {len(shapes[0])}-d tensor cannot be concatenated on dim {dim}")
    others = [tuple(d for i, d in enumerate(s) if i != dim) for s in shapes]
    if any(o != others[0] for o in others):
        raise LayoutError(None, f"{name}: its slices differ in a dimension other than {dim}: {shapes}")
    blocks, start = [], 0
    for t, shape in enumerate(shapes):
        blocks.append(_Block(t, dim, start, 0, shape[dim]))
        start += shape[dim]
    return blocks, _with(shapes[0], dim, start)


def _two_halves(name: str, shapes: list[Shape]) -> tuple[list[_Block], Shape]:
    """Each slice cut in two on dim 0 (``torch.chunk``: the first half the larger); the first
    halves concatenated, then the second ones."""
    _, logical = _concatenated(name, shapes, 0)
    halves = [((s[0] + 1) // 2, s[0] - (s[0] + 1) // 2) for s in shapes]
    blocks, start = [], 0
    for half in (0, 1):
        for t, sizes in enumerate(halves):
            blocks.append(_Block(t, 0, start, 0 if half == 0 else sizes[0], sizes[half]))
            start += sizes[half]
    return blocks, logical


def _sub_param_rule(info: dict[str, Any], name: str) -> tuple[str, dict[str, Any]] | None:
    for rule in info.get(N.PARAMETER_WITH_SUB_PARAMS) or []:
        if not isinstance(rule, dict):
            raise LayoutError(None, f"parameter_with_sub_params holds a {type(rule).__name__}, not a dict")
        for pattern in rule.get("patterns") or []:
            if isinstance(pattern, str) and re.match(pattern, name):
                return pattern, rule
    return None


def _sub_params(info: dict[str, Any], name: str, shapes: list[Shape], rule: MergeRule) -> tuple[list[_Block], Shape]:
    """Sub-params (a fused q/k/v) on the partition dimension: each rank holds its width of every
    sub-param in turn; the merge concatenates each sub-param over the ranks, then the sub-params."""
    assert rule.sub_params is not None
    pattern, found = rule.sub_params
    tp, dim = len(shapes), rule.dim
    declared = list(found.get("shape") or ())
    if dim >= len(declared) or any(len(s) != len(declared) for s in shapes):
        raise LayoutError(None, f"{name}: its sub-param shape {tuple(declared)} does not fit its slices {shapes}")
    spec = declared[dim]
    total = sum(s[dim] for s in shapes)
    widths_by_pattern = info.get(N.SUB_PARAM_SHARD_WIDTHS) or {}
    if float(info.get(N.UNIVERSAL_CHECKPOINT_VERSION, 0.0) or 0.0) >= 0.4:
        if pattern not in widths_by_pattern:
            raise LayoutError(None, f"{name}: its sub-param rule records no sub_param_shard_widths")
        widths = [[int(w) for w in per_rank] for per_rank in widths_by_pattern[pattern]]
    else:  # before 0.4: the sizes (or their count), split evenly
        sizes = [int(d) for d in spec] if isinstance(spec, (tuple, list)) else [total // int(spec)] * int(spec)
        if sum(sizes) != total or any(size % tp for size in sizes):
            raise LayoutError(None, f"{name}: sub-params {sizes} do not split evenly over {tp} tensor ranks")
        widths = [[size // tp] * tp for size in sizes]
    if any(len(w) != tp for w in widths) or sum(map(sum, widths)) != total:
        raise LayoutError(None, f"{name}: sub_param_shard_widths {widths} do not add up to its slices {shapes}")
    for t, shape in enumerate(shapes):
        if sum(w[t] for w in widths) != shape[dim]:
            raise LayoutError(
                None, f"{name}: tensor rank {t} holds {shape[dim]} on dim {dim}, its widths say otherwise"
            )
    blocks, start = [], 0
    rank_offsets = [0] * tp
    for per_rank in widths:
        for t, width in enumerate(per_rank):
            blocks.append(_Block(t, dim, start, rank_offsets[t], width))
            rank_offsets[t] += width
            start += width
    others = [_with(s, dim, 0) for s in shapes]
    if any(o != others[0] for o in others):
        raise LayoutError(None, f"{name}: its slices differ in a dimension other than {dim}: {shapes}")
    return blocks, _with(shapes[0], dim, total)


def _vocabulary_cut(
    info: dict[str, Any], name: str, blocks: list[_Block], logical: Shape
) -> tuple[list[_Block], Shape]:
    """The merged tensor's rows cut to ``original_vocab_size`` (Megatron pads the vocabulary)."""
    vocab = info.get(N.ORIGINAL_VOCAB_SIZE)
    if not isinstance(vocab, int) or not logical or not 0 < vocab <= logical[0]:
        raise LayoutError(
            None,
            f"{name}: a vocabulary param of {logical[0] if logical else 0} rows, but original_vocab_size is {vocab}",
        )
    if not blocks:
        return [], _with(logical, 0, vocab)  # replicated: every rank's copy cut alike (see _spec)
    cut = []
    for block in blocks:
        if block.dim != 0:
            cut.append(block)  # rows whole in the block: cut in _spec by the logical shape
            continue
        length = min(block.length, vocab - block.logical_start)
        if length > 0:
            cut.append(_Block(block.rank, 0, block.logical_start, block.rank_start, length))
    return cut, _with(logical, 0, vocab)


def _spec(blocks: list[_Block], logical: Shape, shapes: list[Shape]) -> dict[str, Any]:
    """The affine_map spec of `blocks` (none: one piece, the whole tensor, on every rank)."""
    tp = len(shapes)
    logical_strides = _strides(logical)  # a row's length: the same before a vocabulary cut
    ranks: dict[str, Any] = {}
    for t, shape in enumerate(shapes):
        rank_strides = _strides(shape)
        pieces = []
        if not blocks:
            pieces.append(_piece(list(logical), 0, logical_strides, 0, rank_strides, list(range(tp))))
        for block in (b for b in blocks if b.rank == t):
            piece_shape = list(shape)
            piece_shape[block.dim] = block.length
            if logical and block.dim != 0:
                piece_shape[0] = logical[0]
            pieces.append(
                _piece(
                    piece_shape,
                    block.logical_start * logical_strides[block.dim],
                    logical_strides,
                    block.rank_start * rank_strides[block.dim],
                    rank_strides,
                    [t],
                )
            )
        ranks[str(t)] = {"shard_shape": list(shape), "pieces": pieces}
    return {"logical_shape": list(logical), "ranks": ranks}


def _piece(
    shape: list[int], source: int, source_strides: list[int], dest: int, dest_strides: list[int], where: list[int]
) -> dict[str, Any]:
    return {"shape": shape, "source": [source, source_strides], "dest": [dest, dest_strides], "locations": where}


def _strides(shape: Shape | list[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _with(shape: Shape, dim: int, size: int) -> Shape:
    return tuple(size if i == dim else d for i, d in enumerate(shape))

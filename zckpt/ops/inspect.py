"""``zckpt inspect``: what a checkpoint folder or weights file holds, and whether it is complete.

Reports are plain dicts (the ``--json`` output); the command line renders one as the readable
summary (:func:`zckpt.cli.inspect.render`): the library builds reports, never text for a terminal.
Problems of an incomplete or inconsistent input are listed in the report, never raised, so a user
learns everything that is wrong in one run.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

from ..core.dtypes import BY_SHORT
from ..core.errors import CheckpointNotFoundError, UsageError, ZckptError
from ..core.index import TRAINER_MODEL_CONFIG, TRAINER_MODEL_TYPE
from ..core.state import TrainingState
from ..core.untrusted import name_problem, path_component
from ..deepspeed import names as N
from ..deepspeed import swap_folder as swap
from ..deepspeed.locate import list_tags, tag_named_in
from ..deepspeed.muon import momentum_per_element
from ..deepspeed.reader import survey
from ..deepspeed.universal import UniversalLoss, universal_loss
from ..deepspeed.zenflow import unsaved_moments_note
from ..hf import names as hf
from ..hf.safetensors import TIED_METADATA_KEY, read_header
from ..io.checksums import check_archive
from ..io.materialize import read_scalar
from ..io.output import find_leftovers
from ..io.reading import FileReader
from ..torchfile import reader as torchfile
from .classify import Kind, classify
from .peft import describe_adapter
from .tensor_sources import torch_state_refs


def inspect_path(
    path: str | os.PathLike[str],
    tag: str | None = None,
    verify: bool = False,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    tp_rules: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Report on a DeepSpeed checkpoint folder, a consolidated output folder, a weights file, or
    a live ZeRO-Infinity swap folder (`checkpoint`, of the same run, names what it holds).

    With `verify`, every checkpoint file is read in full and its CRC-32 checksums checked.
    `tp_rules`: a ``--tp-rules`` file, for a tensor-parallel run that records no merge rules.
    """
    path = os.fspath(path)
    found = classify(path)
    if found.kind is Kind.MISSING:
        raise CheckpointNotFoundError(path, "no such file or directory")
    if found.kind is Kind.SWAP_FOLDER:
        return inspect_swap_folder(path, checkpoint, tag)
    if checkpoint is not None:
        raise UsageError(path, "--checkpoint goes with a swap folder as PATH (<nvme_path> or its zero_stage_3/)")
    if os.path.isdir(path):
        if not found.is_checkpoint:  # a consolidated folder: report on its weights
            weights = found.weights_file or found.adapter_file
            if weights is not None:
                return _with_leftovers(_with_adapter(inspect_path(weights), path), path)
            if find_leftovers(path):  # only what a killed run left: say so rather than "no checkpoint"
                return _with_leftovers(
                    {
                        "kind": "folder",
                        "path": path,
                        "complete": False,
                        "problems": [f"{path}: holds no checkpoint or weights file"],
                        "parameters": [],
                    },
                    path,
                )
        return inspect_checkpoint(path, tag, verify, tp_rules)
    if found.kind is Kind.WEIGHTS_INDEX:
        return _inspect_index(path)
    if found.kind is Kind.LATEST_FILE:
        return _inspect_latest(path, tag, verify, tp_rules)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic == b"PK\x03\x04" or torchfile.is_legacy_torch_file(path):
        return _inspect_file(path, "torch", _torch_file_tensors)
    return _inspect_file(path, "safetensors", _safetensors_tensors)


def inspect_swap_folder(
    path: str, checkpoint: str | os.PathLike[str] | None = None, tag: str | None = None
) -> dict[str, Any]:
    """Report on a live swap folder: per rank its files, sizes and what each holds, gradient and
    orphan files, disk use; with `checkpoint`, the layout check and the 16-bit/fp32 agreement."""
    folder = swap.scan(path)
    problems = swap.rank_problems(folder)
    notes: list[str] = []
    report_swap = None
    if checkpoint is not None:
        found = survey(checkpoint, tag, path)
        problems += [str(p) for p in found.problems]
        report_swap = found.swap
        notes += found.swap.notes() if found.swap is not None else []
    else:
        notes.append(
            "no --checkpoint: files named by DeepSpeed param ids; pass a checkpoint of the same run to name the params, check the layout and compare the 16-bit param swaps with the fp32 masters"
        )
    rows = swap.file_roles(folder, report_swap)
    ranks = sorted({r["rank"] for r in rows if r["rank"] is not None})
    agreement = report_swap.agreement if report_swap is not None else None
    return {
        "kind": "swap_folder",
        "path": path,
        "root": folder.root,
        "checkpoint": os.fspath(checkpoint) if checkpoint is not None else None,
        "world_size": len(folder.optimizer_ranks) or len(ranks),
        "param_dtypes": list(folder.param_dtypes),
        "total_bytes": folder.total_bytes,
        "ranks": [
            {
                "rank": rank,
                "bytes": sum(r["size"] for r in rows if r["rank"] == rank),
                "files": [r for r in rows if r["rank"] == rank],
            }
            for rank in ranks
        ],
        "gradient_files": [f.path for f in folder.of_kind("gradient")],
        "orphans": [f.path for f in folder.of_kind("orphan")],
        "sub_groups": [
            {
                "index": g.index,
                "swap_id": g.swap_id,
                "params": list(g.params),
                "partition_numel": g.partition,
                "swapped": g.swapped,
            }
            for g in (report_swap.sub_groups if report_swap is not None else ())
        ],
        "agreement_16bit": None
        if agreement is None
        else {
            "dtype": agreement.dtype,
            "params": agreement.params,
            "elements": agreement.elements,
            "differing": agreement.differing,
            "per_param": agreement.per_param,
            "agrees": agreement.agrees,
        },
        "checksums": swap.NO_CRC_NOTE,
        "notes": notes,
        "complete": not problems,
        "problems": problems,
    }


def _inspect_latest(
    path: str, tag: str | None, verify: bool, tp_rules: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """DeepSpeed's `latest` (or `latest_universal`) file: report on the checkpoint it points into,
    at the tag it names (or `tag`), rather than misread it as a weights file."""
    folder = os.path.dirname(path) or "."
    base = os.path.basename(path)
    try:
        named = tag_named_in(path)
    except ZckptError:  # inspect_checkpoint below reports why, as locate() finds it
        named = ""
    chosen = tag or named
    if not chosen or not os.path.isdir(os.path.join(folder, chosen)):
        # reports `latest`'s problem, or reads the folder as zckpt would
        report = inspect_checkpoint(folder, tag, verify, tp_rules)
        if base == N.LATEST_UNIVERSAL_FILE and not any(p.startswith(path) for p in report["problems"]):
            report["problems"].append(
                f"{path}: names tag '{named}', but that folder is not in {folder} (tags here: {', '.join(list_tags(folder)) or 'none'})"
            )
            report["complete"] = False
    else:
        report = inspect_checkpoint(folder, chosen, verify, tp_rules)
    report["notes"].insert(
        0,
        f"{path} is DeepSpeed's '{base}' file (naming tag {named or 'nothing'}); this describes the checkpoint folder it belongs to",
    )
    return report


def _with_leftovers(report: dict[str, Any], folder: str) -> dict[str, Any]:
    """Add what interrupted zckpt runs left in `folder`: a live owner's files are a note (a write
    in progress), a dead owner's a problem (the input is not as a finished run leaves it)."""
    for leftover in find_leftovers(folder):
        if leftover.alive is False:
            report["problems"] = [*report.get("problems", []), leftover.describe()]
            report["complete"] = False
        else:
            report["notes"] = [*report.get("notes", []), leftover.describe()]
    return report


def _writer(checkpoint_dir: str) -> str:
    """ "zckpt train" for a folder the trainer wrote (its model_config.json), else "DeepSpeed"
    (ds_version still says which DeepSpeed's layout either follows)."""
    try:
        with open(os.path.join(checkpoint_dir, TRAINER_MODEL_CONFIG), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return "DeepSpeed"
    return "zckpt train" if isinstance(config, dict) and config.get("model_type") == TRAINER_MODEL_TYPE else "DeepSpeed"


def _param(name: str, shape: tuple[int, ...], dtype: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "shape": list(shape), "numel": math.prod(shape), "dtype": dtype, **extra}


def inspect_checkpoint(
    path: str, tag: str | None = None, verify: bool = False, tp_rules: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    found = survey(path, tag, tp_rules=tp_rules)
    checksum_problems = [p for _, _, p in map(check_archive, found.files if verify else []) if p]
    location = found.location
    report: dict[str, Any] = {
        "kind": "deepspeed_checkpoint",
        "path": path,
        "tag": location.tag if location else found.named_tag,
        "tags": list(location.tags if location else found.tags),
        "zero_stage": found.zero_stage,
        "world_size": found.world_size,
        "dtype": found.dtype.short if found.dtype else None,
        "ds_version": found.ds_version,
        "writer": _writer(location.checkpoint_dir) if location else None,
        "offload": found.offload,
        "universal": found.universal,
    }
    index = found.index
    placements = index.placements if index is not None else {}
    if index is not None:
        entries = [(e.name, e.source.shape, e.kind, e.source.dtype.short) for e in index.entries]
        tied = {e.name: e.alias_of for e in index.entries if e.kind == "tied"}
    else:  # what rank 0's model states declare; trainable params have fp32 masters
        stored = found.dtype.short if found.dtype else "?"
        held = {n: d.short for n, d in found.declared_dtypes.items()}
        entries = [(n, s, k, "fp32" if k == "param" else held.get(n, stored)) for n, s, k in found.declared]
        tied = dict(found.tied)
        shapes = {n: (s, d) for n, s, _, d in entries}
        entries += [
            (alias, shapes[source][0], "tied", shapes[source][1]) for alias, source in tied.items() if source in shapes
        ]
    params = [e for e in entries if e[2] in ("param", "frozen")]
    report.update(
        {
            "params": len(params),
            "trainable_numel": sum(math.prod(s) for _, s, k, _ in entries if k == "param"),
            "frozen_numel": sum(math.prod(s) for _, s, k, _ in entries if k == "frozen"),
            "frozen": [n for n, _, k, _ in entries if k == "frozen"],
            "tied": tied,
            "buffers": [n for n, _, k, _ in entries if k == "buffer"],
            "complete": found.complete and not checksum_problems,
            "problems": [str(p) for p in found.problems] + checksum_problems,
            "verified": verify,
            "notes": list(found.notes),
            "files": [os.path.relpath(f, location.checkpoint_dir) if location else f for f in found.files],
            "parameters": [
                _param(
                    n,
                    s,
                    d,
                    kind=k,
                    **({"alias_of": tied[n]} if k == "tied" else {}),
                    **({"placement": placements[n]} if n in placements else {}),
                )
                for n, s, k, d in entries
            ],
        }
    )
    moments = unsaved_moments_note(found.state.ds_config, found.state.state_names) if found.state is not None else None
    report["notes"] += [moments] if moments else []  # why a ZenFlow overlap_step run holds no optimizer state
    try:
        report["training_state"] = _training_state(found.state) if found.state is not None else None
    except ZckptError as exc:  # a damaged step counter: described, not raised
        report["training_state"] = None
        report["problems"].append(str(exc))
        report["complete"] = False
    _describe_peft(report, dict(found.tied), location.checkpoint_dir if location else path)
    return _with_leftovers(report, location.checkpoint_dir if location else path)


def _describe_peft(report: dict[str, Any], declared_tied: dict[str, str], checkpoint_dir: str) -> None:
    """A PEFT run's adapter, a frozen base left out of the files (the Trainer saves PEFT models
    with exclude_frozen_parameters), and tied aliases whose source is not in the files."""
    present = {p["name"] for p in report["parameters"]}
    dangling = {alias: source for alias, source in declared_tied.items() if source not in present}
    trainable = [p["name"] for p in report["parameters"] if p.get("kind") == "param"]
    _with_adapter(report, checkpoint_dir, trainable)
    adapter = report["adapter"]
    report["tied_missing_source"] = dangling
    report["frozen_excluded"] = bool(dangling) or (adapter is not None and not report["frozen"])
    if adapter is not None:
        report["notes"].append(
            "a PEFT run's checkpoint: consolidate writes PEFT's adapter folder, --merge-into BASE_DIR the base model with the adapter merged"
        )


def _with_adapter(report: dict[str, Any], folder: str, names: list[str] | None = None) -> dict[str, Any]:
    """Add the PEFT adapter described by `folder`'s adapter_config.json (None without one); a
    damaged config is a problem."""
    if names is None:
        names = [p["name"] for p in report.get("parameters", [])]
    try:
        report["adapter"] = describe_adapter(folder, names)
    except ZckptError as exc:
        report["adapter"] = None
        report["problems"] = [*report.get("problems", []), str(exc)]
        report["complete"] = False
    return report


def _training_state(state: TrainingState) -> dict[str, Any]:
    """What a resume would get: optimizer states, steps, scaler, scheduler, counters."""
    steps = []
    with FileReader() as reader:
        for group in state.groups:
            scalar = group.scalars.get("step")
            if scalar is None:
                steps.append(None)
            elif scalar.tensor is not None:
                steps.append(read_scalar(reader, scalar.tensor) if scalar.tensor.numel == 1 else None)
            else:
                steps.append(scalar.value)
    scaler = state.loss_scaler
    # what DeepSpeed's universal loader of a ZeRO-1/2 and of a ZeRO-3 run would not restore. A ZeRO-1/2
    # run offloading its optimizer (taken as this one does) keeps Muon's momentum per element, as the
    # loader lays it out, and so does BF16_Optimizer (bf16 + fp32 gradient accumulation, ZeRO-1 only):
    # a run that used it gets a ZeRO-1 entry of its own, as ZeRO-2 (and ZeRO-1 without it) may differ
    offloaded = state.index.offload != "none"
    universal = {
        "zero1_2": _loss(universal_loss(state, 2, momentum_per_element(False, offloaded))),
        "zero3": _loss(universal_loss(state, 3)),
    }
    if state.optimizer_kind == "bf16_optimizer":
        universal["zero1_bf16_optimizer"] = _loss(universal_loss(state, 1, momentum_per_element(True, offloaded)))
    return {
        "optimizer_states": state.state_names,
        # per-group values that are not per element (step, NAdam's mu_product, ...)
        "optimizer_scalars": list(dict.fromkeys(k for g in state.groups for k in g.scalars)),
        "universal_loss": universal,
        "param_groups": [
            {
                "params": len(g.params),
                "step": step,
                **{
                    k: v
                    for k, v in g.hyperparams.items()
                    # a group's own "step" hyperparameter (DeepSpeed's FusedAdam keeps one at 0) is
                    # not the optimizer's step, which the flat group's state holds
                    if k != "step" and isinstance(v, (int, float, str, bool, type(None), tuple, list))
                },
            }
            for g, step in zip(state.groups, steps)
        ],
        "global_steps": state.global_steps,
        "global_samples": state.global_samples,
        "skipped_steps": state.skipped_steps,
        "loss_scaler": None
        if scaler is None
        else {
            "class": getattr(scaler, "original_class", type(scaler).__name__),
            **{k: v for k, v in getattr(scaler, "__dict__", {}).items() if isinstance(v, (int, float, bool))},
        },
        "lr_scheduler": state.lr_scheduler is not None,
        "client_state": sorted(map(str, state.client_state)),
    }


def _loss(loss: UniversalLoss) -> dict[str, Any] | None:
    """A universal loader's loss as JSON: None when it restores everything."""
    if not loss:
        return None
    return {
        "states": list(loss.states),
        "scalars": list(loss.scalars),
        "missing": list(loss.missing),
        "per_param": list(loss.per_param),  # of `states`: restored, laid out wrongly (Muon's momentum)
        "why": loss.describe(),
    }


TensorList = tuple[list[tuple[str, tuple[int, ...], str]], dict[str, str]]


def _inspect_file(path: str, kind: str, list_tensors: Callable[[str], TensorList]) -> dict[str, Any]:
    """Report on one weights file; `list_tensors(path)` gives (name, shape, dtype, metadata)."""
    report: dict[str, Any] = {"kind": kind, "path": path}
    try:
        tensors, metadata = list_tensors(path)
    except ZckptError as exc:
        return {**report, "complete": False, "problems": [str(exc)], "parameters": []}
    listed = [(name, shape, dtype, os.path.basename(path)) for name, shape, dtype in tensors]
    return {**report, **_summary(listed, metadata), "complete": True, "problems": []}


def _safetensors_tensors(path: str) -> TensorList:
    header = read_header(path)
    return [(t.name, t.shape, t.dtype.short) for t in header.tensors], header.metadata


def _torch_file_tensors(path: str) -> TensorList:
    return [(n, r.shape, r.dtype.short) for n, r in torch_state_refs(path)], {}


def _summary(tensors: list[tuple[str, tuple[int, ...], str, str]], metadata: dict[str, str]) -> dict[str, Any]:
    tied: dict[str, str] = {}
    if TIED_METADATA_KEY in metadata:
        try:
            tied = json.loads(metadata[TIED_METADATA_KEY])
        except json.JSONDecodeError:
            tied = {}
    return {
        "tensors": len(tensors),
        "total_bytes": sum(math.prod(s) * BY_SHORT[d].itemsize for _, s, d, _ in tensors if d in BY_SHORT),
        "metadata": metadata,
        "tied": tied,
        "parameters": [_param(n, s, d, file=f) for n, s, d, f in tensors],
    }


def _inspect_index(path: str) -> dict[str, Any]:
    folder = os.path.dirname(path)
    kind = "safetensors_index" if path.endswith(hf.SAFETENSORS_INDEX) else "torch_index"
    report: dict[str, Any] = {"kind": kind, "path": path}
    problems: list[str] = []
    try:
        with open(path, encoding="utf-8") as handle:
            index = json.load(handle)
        weight_map: dict[str, str] = index["weight_map"]
        declared_total = index.get("metadata", {}).get("total_size")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {**report, "complete": False, "problems": [f"{path}: not a weights index ({exc})"], "parameters": []}
    tensors: list[tuple[str, tuple[int, ...], str, str]] = []
    metadata: dict[str, str] = {}
    files = sorted(set(weight_map.values()))
    for name in files:
        file_path = os.path.join(folder, name)
        try:
            path_component(name, path, "shard name")  # read beside the index, never elsewhere
            if kind == "safetensors_index":
                header = read_header(file_path)
                metadata = metadata or header.metadata
                held = [(t.name, t.shape, t.dtype.short, name) for t in header.tensors]
            else:
                held = [(n, r.shape, r.dtype.short, name) for n, r in torch_state_refs(file_path)]
        except ZckptError as exc:
            problems.append(str(exc))
            continue
        tensors.extend(held)
        for tensor_name, *_ in held:
            if weight_map.get(tensor_name) != name:
                problems.append(f"{file_path}: holds {tensor_name}, which the index does not map to it")
    present = {n for n, *_ in tensors}
    for tensor_name, name in weight_map.items():
        if tensor_name not in present and name_problem(name) is None and os.path.isfile(os.path.join(folder, name)):
            problems.append(f"{os.path.join(folder, name)}: lacks {tensor_name}, which the index maps to it")
    summary = _summary(tensors, metadata)
    return {
        **report,
        "files": files,
        "declared_total_size": declared_total,
        **summary,
        "complete": not problems,
        "problems": problems,
    }

"""Read a DeepSpeed ZeRO checkpoint folder into zckpt's :class:`~zckpt.core.index.CheckpointIndex`.

Only small pickles are parsed (no tensor data is read, bar a few step counters used to tell
rank files of different runs apart), the whole layout is validated, and every param's bytes
are located as file segments. :func:`survey` reports every problem it finds instead of
stopping (``zckpt inspect``); :func:`open_checkpoint` raises the first (``consolidate``).

This module is the entry point and picks the reader: :mod:`.locate` finds the tag folder,
:mod:`.zero_reader` (rank partitions) or :mod:`.universal_reader` (one folder per param) reads it
into a :class:`~.survey.Survey`. A damage the readers find is a listed problem; an exception
of another kind is a bug of zckpt's and propagates (the CLI says "internal error").
"""

from __future__ import annotations

import os
from typing import Union

from ..core.errors import CheckpointNotFoundError, CorruptFileError, UsageError, ZckptError
from ..core.index import CheckpointIndex, TensorRef
from ..core.state import TrainingState
from ..io.checksums import forget_records
from . import swap_folder as swap
from .locate import is_universal_dir, list_tags, locate, named_in_latest
from .megatron_rules import load_rules
from .survey import Survey
from .universal_reader import UniversalReader
from .zero_reader import read_zero

TpRules = Union[str, "os.PathLike[str]", dict, None]  # a --tp-rules file, or its rules


def open_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    tp_rules: TpRules = None,
) -> CheckpointIndex:
    """Read and validate a checkpoint; raise the first problem found. With `swap_folder` (a
    live ZeRO-Infinity ``<nvme_path>``), the swapped sub-groups' data comes from there; with
    `tp_rules`, a tensor-parallel run's shards merge by those Megatron-style rules."""
    result = _checked(survey(path, tag, swap_folder, tp_rules))
    assert result.index is not None
    return result.index


def _checked(result: "Survey") -> "Survey":
    """The survey, or its first problem raised (with a count of the others)."""
    if result.problems:
        first = result.problems[0]
        more = len(result.problems) - 1
        if more:
            raise type(first)(
                first.path, f"{first.problem} (and {more} more problem{'s' * (more > 1)}; see zckpt inspect)"
            )
        raise first
    return result


def open_training_state(
    path: str | os.PathLike[str],
    tag: str | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    tp_rules: TpRules = None,
) -> TrainingState:
    """Read and validate a checkpoint's whole training state; raise the first problem found.
    With `swap_folder`, masters and optimizer states of swapped sub-groups come from there."""
    result = _checked(survey(path, tag, swap_folder, tp_rules))
    if result.state is None and result.state_problem is not None:
        raise result.state_problem
    assert result.state is not None
    return result.state


def survey(
    path: str | os.PathLike[str],
    tag: str | None = None,
    swap_folder: str | os.PathLike[str] | None = None,
    tp_rules: TpRules = None,
) -> Survey:
    """Look at a checkpoint and report what it holds and what is wrong with it. With
    `swap_folder`, the checkpoint gives the layout and the live swap folder the data of every
    swapped sub-group (see :mod:`zckpt.deepspeed.swap_folder`). `tp_rules` (a ``--tp-rules``
    JSON file, or its rules as a dict): how a tensor-parallel run's shards merge, where the
    checkpoint does not say (:mod:`.megatron_rules`)."""
    forget_records()  # zip directories remembered by an earlier operation: read afresh
    folder = swap.scan(swap_folder) if swap_folder is not None else None
    rules = load_rules(tp_rules) if tp_rules is not None and not isinstance(tp_rules, dict) else tp_rules
    result = Survey(os.fspath(path))
    try:
        result.location = locate(path, tag)
    except CheckpointNotFoundError as exc:
        if exc.path == os.fspath(path):
            raise
        return _unlocated(result, exc, tag)
    except UsageError:
        raise
    except ZckptError as exc:
        return _unlocated(result, exc, tag)
    if result.location.note:
        result.notes.append(result.location.note)
    result.universal = is_universal_dir(result.location.tag_dir)
    if result.universal and folder is not None:
        raise UsageError(
            os.fspath(path), "--swap-folder needs a ZeRO-3 checkpoint of the run (its layout), not a universal folder"
        )
    try:
        if result.universal:
            UniversalReader(result).run()
        else:
            read_zero(result, folder, rules)
    except ZckptError as exc:  # a damage the readers raise rather than list: still a listed problem
        result.problems.append(exc)
        result.index = result.state = None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        if not _from_content(exc):
            raise  # a bug of zckpt's, not damage: the CLI says "internal error"
        # Values of a type no check foresaw (a damaged or hand-edited file): a problem with the
        # tag folder, so inspect still describes it and consolidate still says one line.
        result.problems.append(
            CorruptFileError(
                result.location.tag_dir, f"files not as DeepSpeed writes them ({type(exc).__name__}: {exc})"
            )
        )
        result.index = result.state = None
    return result


def _from_content(exc: Exception) -> bool:
    """Whether an exception the readers let through can come from a pickled value of a type no
    check foresaw. An attribute missing from one of zckpt's own objects (a layout, a survey, a
    reader) cannot: that is a bug, never damage. The pickles hold plain values, tensors
    (TensorRef) and the unpickler's stand-ins (zckpt.torchfile)."""
    if not isinstance(exc, AttributeError):
        return True
    owner = type(exc.obj).__module__ if getattr(exc, "obj", None) is not None else ""
    return not owner.startswith("zckpt.") or owner.startswith("zckpt.torchfile.") or isinstance(exc.obj, TensorRef)


def _unlocated(result: Survey, problem: ZckptError, tag: str | None) -> Survey:
    """A survey whose tag folder cannot be found: the problem, plus the tags that are there and
    the one asked for or named in `latest`, so a report shows what to choose from."""
    result.problems.append(problem)
    result.tags = tuple(list_tags(result.path))
    result.named_tag = tag or named_in_latest(result.path)
    return result

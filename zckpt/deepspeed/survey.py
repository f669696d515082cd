"""What a look at a checkpoint found: the :class:`Survey` that the ZeRO and universal readers
fill (:mod:`.zero_reader`, :mod:`.universal_reader`, and the pieces they compose:
:mod:`.rank_files`, :mod:`.model_states`, :mod:`.rank_checks`, :mod:`.partitions`,
:mod:`.live_swap`) and :func:`zckpt.deepspeed.reader.survey` returns, every problem listed
instead of raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

from ..core.dtypes import DType
from ..core.errors import ZckptError
from ..core.index import CheckpointIndex
from ..core.state import TrainingState
from .locate import Location
from .swap_folder import SwapReport


@dataclass
class Survey:
    """What a look at a checkpoint found: the index when the checkpoint is complete, and every
    problem seen (each a ZckptError naming a file)."""

    path: str
    location: Location | None = None
    zero_stage: int | None = None
    world_size: int | None = None
    dtype: DType | None = None
    ds_version: str | None = None
    offload: Literal["none", "cpu", "nvme"] = "none"
    files: list[str] = field(default_factory=list)
    index: CheckpointIndex | None = None
    problems: list[ZckptError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # ZeRO-3 rank files that repeat another rank's where nothing tells whether one was copied:
    # verify says so; commands read them as they are (not index notes)
    untold_copies: list[str] = field(default_factory=list)
    # rank files whose archive name (torch.save's record of the path it saved to) names no rank
    # file, as when saved to a stream: nothing in them tells which rank wrote them
    unnamed_archives: list[str] = field(default_factory=list)
    named_archives: int = 0  # rank files whose archive name is their own file name
    # What the model-states file declares, known even when the index cannot be built.
    declared: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (name, shape, kind)
    declared_dtypes: dict[str, DType] = field(default_factory=dict)  # as stored in the module state dict
    tied: dict[str, str] = field(default_factory=dict)
    # When the tag cannot be located: the tags the folder holds and the one `latest` names.
    tags: tuple[str, ...] = ()
    named_tag: str | None = None
    state: TrainingState | None = None  # the whole training state, when the checkpoint is complete
    # why the training state could not be read where the weights could (a ZeRO-0 optimizer whose
    # params its files do not name): what commands that need the state raise
    state_problem: ZckptError | None = None
    universal: bool = False  # a universal folder (zero/<param>/<state>.pt), not rank partitions
    swap: SwapReport | None = None  # read with a live swap folder: what it held and where data came from

    def add(self, error: type[ZckptError], path: str | None, text: str) -> None:
        """List one problem (a ZckptError of type `error` naming `path`)."""
        self.problems.append(error(path, text))

    def take_parts(
        self, parts: "list[Survey]", extra_files: "Iterable[str]" = (), keep_note: "Callable[[str], bool] | None" = None
    ) -> bool:
        """Take what the surveys of a checkpoint's parts (pipeline stages, expert views, tensor
        ranks) found: the first part's description of the run, every part's problems, notes (once
        each, those `keep_note` keeps) and files, plus `extra_files`. True when every part was read
        whole and none has a problem, so the parts can be merged."""
        first = parts[0]
        for name in ("zero_stage", "dtype", "ds_version", "offload", "tied"):
            setattr(self, name, getattr(first, name))
        self.problems.extend(p for part in parts for p in part.problems)
        # a part read for its weights only (a ZeRO-0 optimizer its files do not name): the merge
        # of the parts needs every part's training state, so that is the problem here
        self.problems.extend(
            part.state_problem for part in parts if part.state is None and part.state_problem and not part.problems
        )
        notes = (n for part in parts for n in part.notes)
        self.notes.extend(dict.fromkeys(n for n in notes if keep_note is None or keep_note(n)))
        self.untold_copies.extend(dict.fromkeys(n for part in parts for n in part.untold_copies))
        self.unnamed_archives.extend(dict.fromkeys(p for part in parts for p in part.unnamed_archives))
        self.named_archives += sum(part.named_archives for part in parts)
        self.files = sorted({*(f for part in parts for f in part.files), *extra_files})
        return not self.problems and all(part.index is not None and part.state is not None for part in parts)

    @property
    def complete(self) -> bool:
        return self.index is not None and not self.problems

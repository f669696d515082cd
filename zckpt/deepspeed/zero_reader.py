"""One pass over the tag folder of a ZeRO checkpoint, filling a :class:`~.survey.Survey`
(:func:`read_zero`): the rank files listed (:mod:`.rank_files`), then read as the one
data-parallel set they are (:mod:`.dp_reader`), or stage by stage for a pipeline run
(:mod:`.pipeline`).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import UsageError
from . import swap_folder as swap
from .dp_reader import read_ranks
from .moe import read_moe
from .pipeline import read_pipeline
from .rank_files import zero_rank_files
from .survey import Survey
from .tensor_parallel import read_tensor_parallel


def read_zero(
    result: Survey, swap_folder: swap.SwapFolder | None = None, tp_rules: dict[str, Any] | None = None
) -> None:
    """Read the tag folder of `result.location` into `result`: its index and training state
    when the checkpoint is complete, every problem found otherwise. `tp_rules`: the merge rules
    of a tensor-parallel run that does not record its own (``--tp-rules``)."""
    location = result.location
    assert location is not None
    files = zero_rank_files(location.tag_dir)
    result.problems.extend(files.problems)
    if files.fatal is not None:
        result.problems.append(files.fatal)
        return
    if files.pipeline:
        if swap_folder is not None:
            result.add(UsageError, location.tag_dir, "--swap-folder is for ZeRO-3 runs; a pipeline run is ZeRO-0/1")
            return
        read_pipeline(result, files, tp_rules)
        return
    if files.tensor_parallel:
        if swap_folder is not None:
            result.add(UsageError, location.tag_dir, "--swap-folder is for data-parallel ZeRO-3 runs")
            return
        read_tensor_parallel(result, files, tp_rules=tp_rules)
        return
    if files.moe:
        if swap_folder is not None:
            result.add(
                UsageError, location.tag_dir, "--swap-folder is for ZeRO-3 runs; a mixture-of-experts run is ZeRO-1/2"
            )
            return
        read_moe(result, files)
        return
    read_ranks(result, files, swap_folder)

"""ZeRO-1/2 files saved with ``zero_optimization.elastic_checkpoint`` read as the ordinary (rigid)
layout. DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py ``state_dict``, :3375-3382) then saves
``base_optimizer_state`` as a list, one dict per param group of the group's flat partition states
less the group's padding (``_get_base_optimizer_state``, :3348-3356: a 0-d ``step`` as is), and
``base_optimizer_state_step`` only where the optimizer keeps a ``step`` in its groups (FusedAdam:
0; torch's optimizers keep theirs per param); the groups' hyperparameters are not saved. Its
loaders rebuild the optimizer from the engine's own groups (``_restore_base_optimizer_state``,
:3589-3611: each group's ``step`` set to the saved one).

:func:`rigid_views` gives each rank's optimizer dict the rigid ``{state, param_groups}`` (state
``g`` the group's dict as saved; its per-element states are the partition less the padding, which
the reader takes as it takes the unpadded fp32 partitions) with the groups' hyperparameters those
of the optimizer the engine built from the saved config (:func:`.optimizers.engine_param_group`).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import LayoutError
from . import names as N
from .optimizers import engine_param_group

BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"  # stage_1_and_2.py:3382
# set in a rank's rigid view: its per-element states are the partition less the tail padding
ELASTIC_VIEW = "zckpt:elastic_checkpoint"


def is_elastic(inner: Any) -> bool:
    """A ZeRO-1/2 optimizer dict saved with elastic_checkpoint (its base state a list)."""
    return isinstance(inner, dict) and isinstance(inner.get(N.BASE_OPTIMIZER_STATE), (list, tuple))


def rigid_views(
    inner: dict[int, dict], ds_config: Any, optim_paths: dict[int, str]
) -> tuple[dict[int, dict], LayoutError | None, list[str]]:
    """Each rank's optimizer dict with its elastic base state as the rigid layout's, a refusal
    where that cannot be told, and the notes a user must hear. Files not elastic come back as
    they are."""
    if not any(is_elastic(state) for state in inner.values()):
        return inner, None, []
    path0 = optim_paths.get(0, next(iter(optim_paths.values()), ""))
    mixed = [rank for rank, state in inner.items() if not is_elastic(state)]
    if mixed:
        return inner, LayoutError(optim_paths[mixed[0]], "a rigid ZeRO file among elastic_checkpoint ones"), []
    config = ds_config if isinstance(ds_config, dict) else {}
    hyper, why = engine_param_group(config)
    if hyper is None:
        return (
            inner,
            LayoutError(
                path0,
                "a ZeRO-1/2 run with zero_optimization.elastic_checkpoint saves no param group hyperparameters, "
                f"and zckpt cannot tell them from its config: {why}",
            ),
            [],
        )
    views: dict[int, dict] = {}
    for rank, state in inner.items():
        groups = state[N.BASE_OPTIMIZER_STATE]
        partitions = state.get(N.SINGLE_PARTITION_OF_FP32_GROUPS)
        count = len(partitions) if isinstance(partitions, (list, tuple)) else None
        if not all(isinstance(g, dict) for g in groups) or (count is not None and len(groups) != count):
            return (
                inner,
                LayoutError(
                    optim_paths[rank],
                    f"base_optimizer_state lists {len(groups)} group states for {count} fp32 partitions: "
                    "not as DeepSpeed's elastic_checkpoint writes it (damaged or edited)",
                ),
                [],
            )
        step = state.get(BASE_OPTIMIZER_STATE_STEP)
        group_hyper = {**hyper, "step": step} if BASE_OPTIMIZER_STATE_STEP in state else hyper
        view = {k: v for k, v in state.items() if k != BASE_OPTIMIZER_STATE_STEP}
        view[ELASTIC_VIEW] = True
        view[N.BASE_OPTIMIZER_STATE] = {
            "state": {g: dict(group) for g, group in enumerate(groups)},
            "param_groups": [{**group_hyper, "params": [g]} for g in range(len(groups))],
        }
        views[rank] = view
    notes = [
        f"saved with zero_optimization.elastic_checkpoint, which keeps no param group hyperparameters: "
        f"each group's are those DeepSpeed built its {why} with from the saved config (values a training "
        "script gave its own groups, or a scheduler's current lr, are not in the files)"
    ]
    return views, None, notes

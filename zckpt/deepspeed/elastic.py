"""ZeRO-1/2 files saved with ``zero_optimization.elastic_checkpoint`` read as the ordinary (rigid)
layout, and written back in their own layout. DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py
``state_dict``, :3375-3382) then saves ``base_optimizer_state`` as a list, one dict per param group
of the group's flat partition states less the group's padding (``_get_base_optimizer_state``,
:3349-3356: a 0-d ``step`` or an int as is), and ``base_optimizer_state_step`` only where the
optimizer keeps a ``step`` in its groups (FusedAdam, FusedLion: :3378; torch's optimizers and
DeepSpeed's CPU Adam, Lion and Adagrad keep theirs per param); the groups' hyperparameters are in
no file. DeepSpeed's loaders take every group's hyperparameters from the engine the training
script built (``_restore_base_optimizer_state``, :3585-3610: only the states, and each group's
``step`` set to ``base_optimizer_state_step``; the elastic loader asserts that key is saved,
``_restore_step_from_elastic_checkpoint``, :3579-3583, so a run without a group step cannot
resume its own elastic files).

:func:`rigid_views` gives each rank's optimizer dict the rigid ``{state, param_groups}`` (state
``g`` the group's dict as saved; its per-element states are the partition less the padding, which
the reader takes as it takes the unpadded fp32 partitions) with each group's hyperparameters those
of the optimizer the engine built from the saved config (:func:`.optimizers.engine_param_group`;
for DeepSpeed's Muon each flat group's half, :func:`.optimizers.muon_param_groups`, the halves told
by their states) where the config tells them, none otherwise: reading weights and states needs
none. Writers ask
:func:`missing_hyperparameters` before writing a layout that holds them (ZeRO-3, rigid ZeRO-1/2,
DCP, Lightning; a universal folder then keeps each group's step only, which DeepSpeed's universal
loaders accept), and write ZeRO-1/2 output in the elastic layout (:func:`elastic_output`), which
holds none, as DeepSpeed does; a Muon run keeping whole-param momenta is written rigid, with its
groups, as the elastic loader would misplace its momenta (refused where its groups are not told).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import LayoutError
from ..core.index import TensorRef
from ..core.state import TrainingState
from ..io.checksums import archive_records
from . import muon
from . import names as N
from .optimizers import deepspeed_own_optimizer, engine_param_group, muon_param_groups, optimizer_offloaded

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
    mixed = [rank for rank, state in inner.items() if not is_elastic(state)]
    if mixed:
        return inner, LayoutError(optim_paths[mixed[0]], "a rigid ZeRO file among elastic_checkpoint ones"), []
    config = ds_config if isinstance(ds_config, dict) else {}
    hyper, why = engine_param_group(config)
    whole_momentum = _whole_muon_momentum(config)
    halves = _muon_halves(inner) if deepspeed_own_optimizer(config) == "muon" else None
    per_group: list[dict] | None = None
    if halves is not None:
        # every group stepped: _muon_halves tells none that has no state on any rank
        per_group, why = muon_param_groups(config, halves, [True] * len(halves))
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
        group_hypers = [dict(per_group[g] if per_group is not None else hyper or {}) for g in range(len(groups))]
        if BASE_OPTIMIZER_STATE_STEP in state:
            for group_hyper in group_hypers:
                group_hyper["step"] = step
        view = {k: v for k, v in state.items() if k != BASE_OPTIMIZER_STATE_STEP}
        view[ELASTIC_VIEW] = True
        states = {g: dict(group) for g, group in enumerate(groups)}
        flags: list[dict] = [{} for _ in groups]
        if whole_momentum:
            paddings = state.get(N.GROUP_PADDINGS) or [0] * len(groups)
            for g, group in states.items():
                # the run's own flag where told (a rank touching no Muon param has no buffer)
                flags[g] = {muon.MUON_FLAG: halves[g] if halves is not None else _muon_half(group)}
                if flags[g][muon.MUON_FLAG] and isinstance(group.get(muon.MOMENTUM), TensorRef) and paddings[g]:
                    group[muon.MOMENTUM] = _uncut(group[muon.MOMENTUM], paddings[g])
        view[N.BASE_OPTIMIZER_STATE] = {
            "state": states,
            "param_groups": [{**group_hypers[g], **flags[g], "params": [g]} for g in range(len(groups))],
        }
        views[rank] = view
    if per_group is not None and whole_momentum:
        notes = [
            "saved with zero_optimization.elastic_checkpoint, which keeps no param group hyperparameters: each "
            "group's are those DeepSpeed's engine built its Muon and Adam halves with from the saved config "
            "(engine._muon_param_groups; values a training script gave its own group, or a scheduler's current "
            "lr, are not in the files); ZeRO-1/2 outputs are written in the rigid layout, holding them, as "
            "DeepSpeed's elastic loader would give every rank rank 0's Muon momentum_buffer "
            "(stage_1_and_2.py:3566-3567); DeepSpeed loads rigid files into an elastic engine too (:3743-3747)"
        ]
    elif hyper is not None or per_group is not None:
        notes = [
            f"saved with zero_optimization.elastic_checkpoint, which keeps no param group hyperparameters: "
            f"each group's are those DeepSpeed built its {why} with from the saved config (values a training "
            "script gave its own groups, or a scheduler's current lr, are not in the files): ZeRO-1/2 outputs are "
            "written with elastic_checkpoint, whose loader keeps the engine's own groups; ZeRO-3, universal, DCP "
            "and Lightning outputs hold these values"
        ]
    else:
        notes = [
            "saved with zero_optimization.elastic_checkpoint, which keeps no param group hyperparameters, "
            f"and the config does not tell them ({why}): weights and optimizer states are read; ZeRO-1/2 outputs "
            "(written with elastic_checkpoint) and universal folders (groups without hyperparameters) leave them to "
            "the engine that loads them, as DeepSpeed's loaders do; outputs that hold them (ZeRO-3, DCP, Lightning) "
            "are refused"
        ]
    return views, None, notes


def _whole_muon_momentum(ds_config: dict) -> bool:
    """DeepSpeed's Muon at ZeRO-1/2 keeps a whole-param momentum_buffer (.muon), unless the
    optimizer is offloaded (then per element of the partition)."""
    return deepspeed_own_optimizer(ds_config) == "muon" and not muon.momentum_per_element(
        False, optimizer_offloaded(ds_config)
    )


def _muon_halves(inner: dict[int, dict]) -> list[bool] | None:
    """Each flat group of an elastic Muon run: whether it is the Muon half, told by its states on
    any rank (:func:`_muon_half`; a rank whose partition touches no Muon param has an empty state,
    stage_1_and_2.py:2724-2729). None where a group has no state on any rank (never stepped), or
    the ranks disagree."""
    counts = {len(state[N.BASE_OPTIMIZER_STATE]) for state in inner.values()}
    if len(counts) != 1:
        return None
    out: list[bool] = []
    for g in range(counts.pop()):
        seen = {
            _muon_half(group)
            for state in inner.values()
            if isinstance(group := state[N.BASE_OPTIMIZER_STATE][g], dict) and group
        }
        if len(seen) != 1:
            return None
        out.append(seen.pop())
    return out


def _muon_half(group: dict) -> bool:
    """A group state of MuonWithAuxAdam's Muon half: a momentum_buffer and no Adam moments (the
    Adam half keeps step, exp_avg, exp_avg_sq; runtime/zero/muon/original_muon.py)."""
    return muon.MOMENTUM in group and "exp_avg" not in group


def _uncut(ref: TensorRef, padding: int) -> TensorRef:
    """Muon's whole-param momentum_buffer as the engine held it, before ``_get_state_without_padding``
    cut the group's padding off it (stage_1_and_2.py:3336-3343 cuts every state of a dimension,
    here the last `padding` elements of the last param's momentum): torch.save wrote the view's
    whole storage, so they are in the file's record, which this widens the view to. Left as is
    where the record does not hold them (the reader then refuses the short buffer)."""
    if len(ref.shape) != 1 or not ref.is_contiguous:
        return ref
    end = ref.offset + (ref.numel + padding) * ref.dtype.itemsize
    for record in archive_records(ref.path):
        if record.start <= ref.offset < record.start + record.size:
            if end <= record.start + record.size:
                return TensorRef(ref.path, ref.offset, ref.dtype, (ref.numel + padding,), (1,), ref.attributes)
            break
    return ref


def elastic_run(ds_config: Any, stage: int | None) -> bool:
    """A ZeRO-1/2 run configured with elastic_checkpoint, whose DeepSpeedZeroOptimizer saves the
    elastic layout (stage_1_and_2.py:3375; ZeRO-3 and BF16_Optimizer have none)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return stage in (1, 2) and isinstance(zero, dict) and zero.get("elastic_checkpoint") is True


def elastic_input(state: TrainingState) -> bool:
    """The training state was read from elastic_checkpoint files (a DeepSpeedZeroOptimizer run
    configured with it: BF16_Optimizer saves the rigid layout, runtime/bf16_optimizer.py)."""
    return state.optimizer_kind == "zero" and elastic_run(state.ds_config, state.index.zero_stage)


def missing_hyperparameters(state: TrainingState, output: str) -> LayoutError | None:
    """The one-line refusal for an `output` that holds each param group's hyperparameters, where
    the input is an elastic_checkpoint run (no file holds them) whose config does not tell them
    (:func:`.optimizers.engine_param_group`; a Muon run's, :func:`.optimizers.muon_param_groups`,
    where the script gave one group); None where they are known or not needed."""
    if not elastic_input(state):
        return None
    ds_config = state.ds_config
    hyper, why = engine_param_group(ds_config)
    if hyper is not None or _muon_groups_told(state):
        return None
    if _whole_muon_momentum(ds_config):
        route = (
            "and DeepSpeed's elastic loader would give every rank rank 0's Muon momentum_buffer "
            "(stage_1_and_2.py:3566-3568: a state not of the partition's size), so no ZeRO-1/2 output is "
            "written either; inspect, verify, consolidate and diff read it"
        )
    else:
        route = (
            "reshard to ZeRO-1/2 (written with elastic_checkpoint, the groups left to the loading engine) or "
            "to-universal, which DeepSpeed resumes with the training script's own groups"
        )
    return LayoutError(
        None,
        f"{output} holds each optimizer param group's hyperparameters (lr, ...), which a run saved with "
        f"zero_optimization.elastic_checkpoint keeps in no file and its config does not tell ({why}); {route}",
    )


def reshard_refused(state: TrainingState) -> bool:
    """No reshard of this input is written (:func:`missing_hyperparameters` refuses every
    output): an elastic_checkpoint run of DeepSpeed's Muon keeping whole-param momenta whose
    groups are not told (the script's own). Other refusals point at reshard as the route that
    keeps every state; these must not."""
    return (
        elastic_input(state)
        and _whole_muon_momentum(state.ds_config)
        and engine_param_group(state.ds_config)[0] is None
        and not _muon_groups_told(state)
    )


def _muon_groups_told(state: TrainingState) -> bool:
    """An elastic Muon run whose groups the reader filled from its config (:func:`rigid_views`,
    :func:`.optimizers.muon_param_groups`: each then names its half)."""
    return (
        deepspeed_own_optimizer(state.ds_config) == "muon"
        and bool(state.groups)
        and all("name" in group.hyperparams and "lr" in group.hyperparams for group in state.groups)
    )


def elastic_output(ds_config: Any, stage: int, bf16_optimizer: bool) -> bool:
    """Whether a ZeRO-1/2 output for this config is written in the elastic layout: the config
    (the input's, with the user's overrides) has elastic_checkpoint, as the run that loads it
    would save it; DeepSpeed loads it into an elastic engine at any world size and into a rigid
    one at the output's (stage_1_and_2.py:3743-3757). Not for DeepSpeed's Muon keeping whole-param
    momenta: that loader gives every rank rank 0's (stage_1_and_2.py:3566-3568), so its output is
    rigid, which an elastic engine loads too (:3743-3747: a rigid file is detected per file)."""
    return not bf16_optimizer and elastic_run(ds_config, stage) and not _whole_muon_momentum(ds_config)


def elastic_base_state(groups: list[dict], hyperparams: list[dict]) -> dict[str, Any]:
    """``base_optimizer_state`` (one state dict per flat group, already cut to the partition less
    its padding) and ``base_optimizer_state_step`` as DeepSpeed's ``state_dict`` writes them
    (:3375-3382). The step is the groups' saved one; where the optimizer keeps none in its groups
    it is None, which DeepSpeed's elastic loader requires to be present (:3580) and then sets as
    every group's ``step``, a key torch's optimizers do not read: the files then load, where
    DeepSpeed's own would fail its assert."""
    steps = [h["step"] for h in hyperparams if "step" in h]
    return {N.BASE_OPTIMIZER_STATE: groups, BASE_OPTIMIZER_STATE_STEP: steps[0] if steps else None}

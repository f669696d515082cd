"""Read a universal checkpoint folder (zckpt's or ``ds_to_universal``'s) into a Survey.

The model_states files are read as in a ZeRO checkpoint (buffers, frozen params, tied aliases,
counters, scheduler: :mod:`~zckpt.deepspeed.model_states` does it); the trainable params
come from ``zero/<name>/<state>.pt`` instead of rank partitions. Both flavours are read: ZeRO-1/2
files hold ``{"param": full-shape tensor, ...}`` and a ``step.pt`` per param, ZeRO-3 files a flat
tensor, with the steps in ``zero/optimizer_state.pt``. Everything a resume needs is checked
(every param's folder, its fp32 master and the same states as the rest of its group, shapes
against the model_states) and every problem is reported, so ``inspect`` can judge a folder before
a job is scheduled on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointNotFoundError, CorruptFileError, LayoutError, ZckptError
from ..core.index import CheckpointIndex, Entry, TensorRef, TensorSource, slice_segments
from ..core.state import ParamGroupState, ParamState, ScalarState, TrainingState
from ..core.topology import Topology
from ..io.materialize import read_scalar
from ..io.reading import FileReader, source_of
from ..torchfile import reader as torchfile
from . import names as N
from .layout import LayoutParam, zero12_layout
from .model_states import declare, describe, module_entries, param_shapes_of, tied_entries
from .optim_state import module_buffers, optimizer_order, saved_run_state
from .optimizers import in_creation_order
from .partitions import sub_group_param_groups
from .rank_checks import check_same_run
from .rank_files import load, scan_rank_files
from .run_config import RunConfig, read_run_config
from .schema import as_shape, numel_of
from .survey import Survey


@dataclass(frozen=True)
class _ParamFiles:
    """What one param's folder holds: its master, per-element states and step."""

    master: TensorSource
    states: dict[str, TensorSource]
    step: Any = None  # the step's value, to compare across the group
    step_saved: ScalarState | None = None  # the step as stored (a tensor in the file, or a value)
    step_path: str | None = None


class UniversalReader:
    """One pass over a universal folder, filling a Survey: the model_states files read as in a
    ZeRO checkpoint (:mod:`.model_states`), the trainable params from their folders."""

    def __init__(self, result: Survey) -> None:
        assert result.location is not None
        self.result = result
        self.tag_dir = result.location.tag_dir
        self.problems = result.problems
        self.run_config: RunConfig = read_run_config({}, saved=True)  # the saved ds_config, as DeepSpeed read it
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _problem(self, error: type[ZckptError], path: str | None, text: str) -> None:
        self.result.add(error, path, text)

    def _load(self, path: str) -> Any | None:
        return load(self.result, path)

    def _path(self, name: str) -> str:
        return os.path.join(self.tag_dir, name)

    def run(self) -> None:
        model_paths = self._model_files()
        if model_paths is None:
            return
        zero3 = any(rank is not None for rank in model_paths)
        optimizer_path = os.path.join(self.tag_dir, N.UNIVERSAL_ZERO_DIR, N.UNIVERSAL_OPTIMIZER_STATE)
        self.result.files = sorted(model_paths.values()) + [optimizer_path]
        models = {rank: self._load(p) for rank, p in model_paths.items()}
        first = 0 if zero3 else None
        model0 = models.get(first)
        if first not in models:
            self._problem(
                CheckpointNotFoundError,
                self._path(N.model_states_name(3, 0)),
                "missing (rank 0 model states, which DeepSpeed's loader reads)",
            )
            return
        if isinstance(model0, dict):
            declare(self.result, model0)
        if not os.path.isfile(optimizer_path):
            self._problem(
                CheckpointNotFoundError,
                optimizer_path,
                "missing (the optimizer's global state: loss scaler, param groups, steps)",
            )
            return
        optimizer = self._load(optimizer_path)
        if any(v is None for v in models.values()) or optimizer is None:
            return
        if not self._check_kinds(models, model_paths, optimizer, optimizer_path):
            return
        self.optimizer, self.optimizer_path = optimizer, optimizer_path
        self._describe(model0, optimizer, zero3, model_paths[first])
        world = self.result.world_size
        if zero3 and any(rank not in models for rank in range(world or 0)) and model0.get(N.FROZEN_PARAM_SHAPES):
            missing = next(rank for rank in range(world or 0) if rank not in models)
            self._problem(
                CheckpointNotFoundError,
                self._path(N.model_states_name(3, missing)),
                f"missing: the frozen params' partitions of rank {missing} (world size {world}) are in it",
            )
            return
        check_same_run(self.result, models, {}, model_paths, {})
        if self.problems:
            return
        assert world is not None
        entries = module_entries(self.result, models, model_paths, zero3, world)
        if entries is None:
            return
        params = self._trainable(param_shapes_of(model0), zero3)
        if params is None or self.problems:
            return
        entries += params
        entries += tied_entries(model0, entries)
        location = self.result.location
        assert location is not None and self.result.dtype is not None
        self.result.index = CheckpointIndex(
            checkpoint_dir=location.checkpoint_dir,
            tag=location.tag,
            tag_dir=self.tag_dir,
            tags=location.tags,
            zero_stage=self.result.zero_stage or 0,
            world_size=world or 0,
            dtype=self.result.dtype,
            ds_version=self.result.ds_version,
            offload=self.result.offload,
            entries=tuple(entries),
            files=tuple(self.result.files),
            notes=tuple(self.result.notes),
            universal=True,
            # stacked expert copies: the expert-parallel degree a loading run must keep
            topology=Topology(ep=max(rows for _, _, rows in self.expert_rows.values()), dp=world or 0)
            if self.expert_rows
            else None,
        )
        self.result.state = self._training_state(models, model0, zero3)

    # --- files --------------------------------------------------------------------------------
    def _model_files(self) -> dict[int | None, str] | None:
        scanned = scan_rank_files(self.tag_dir, "universal folder")  # a universal folder holds no optimizer files
        self.problems.extend(scanned.problems)
        if scanned.fatal is not None:
            self.problems.append(scanned.fatal)
            return None
        files = scanned.model
        if not files:
            self._problem(
                CheckpointNotFoundError,
                self.tag_dir,
                "no *_model_states.pt file in the universal folder (DeepSpeed's loader reads the counters and scheduler from it)",
            )
            return None
        if None in files and len(files) > 1:
            self._problem(
                LayoutError,
                self.tag_dir,
                "holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 (zero_pp_rank_*_model_states.pt) model files: two conversions are mixed",
            )
            return None
        return files

    def _check_kinds(self, models: dict, model_paths: dict, optimizer: Any, optimizer_path: str) -> bool:
        ok = True
        for rank, state in models.items():
            if not isinstance(state, dict) or N.PARAM_SHAPES not in state or N.MODULE not in state:
                self._problem(
                    CorruptFileError,
                    model_paths[rank],
                    "not a DeepSpeed model-states file (no 'module'/'param_shapes')",
                )
                ok = False
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get(N.PARAM_GROUPS), list):
            self._problem(CorruptFileError, optimizer_path, "not a universal optimizer state (no 'param_groups' list)")
            ok = False
        return ok

    def _describe(self, model0: dict, inner0: dict, zero3: bool, model_path: str) -> None:
        self.run_config = describe(self.result, model0, inner0, "", zero3, model_path)
        # the world size of the run that saved it; partition_count in optimizer_state.pt says the same
        world = model0.get(N.DP_WORLD_SIZE)
        self.result.world_size = world if isinstance(world, int) and world >= 1 else self.result.world_size

    # --- params -------------------------------------------------------------------------------
    def _trainable(self, param_shapes: list[dict], zero3: bool) -> list[Entry] | None:
        """Each trainable param's master from ``zero/<name>/fp32.pt``, its states beside it."""
        self.param_files: dict[str, _ParamFiles] = {}
        self.shapes = {name: as_shape(shape) for group in param_shapes for name, shape in group.items()}
        self.param_shapes = param_shapes
        # the file naming the params, whose names are read as folder names under zero/
        self.declared_in = self._path(N.model_states_name(3 if zero3 else 1))
        entries = []
        self.expert_rows = self._expert_rows()
        if self.expert_rows:
            ep = max(rows for _, _, rows in self.expert_rows.values())
            self.result.notes.append(
                f"mixture-of-experts: each expert param's folder stacks its copies on {ep} expert ranks; DeepSpeed "
                f"loads it at expert-parallel degree {ep} (over any multiple of {ep} ranks)"
            )
        with FileReader() as reader:
            for name, shape in self.shapes.items():
                found = self._read_param(reader, name, shape, zero3)
                if found is not None:
                    self.param_files[name] = found
                    entries.append(Entry(name, "param", found.master))
        self._check_states_complete(param_shapes, zero3)
        self._note_extra_folders()
        return None if self.problems else entries

    def _expert_rows(self) -> dict[str, tuple[str, int, int]]:
        """Where each expert param of a mixture-of-experts run is, when its universal folder
        stacks the expert ranks' copies (zckpt's ``to-universal``, :mod:`.moe_writer`): global
        expert ``e * per_rank + local`` is row ``e`` of the folder of local id ``local``. Name ->
        (folder's param name, row, rows); empty for any other folder."""
        experts: dict[str, set[int]] = {}
        for name in self.shapes:
            found = N.expert_id(name)
            if found is not None:
                experts.setdefault(found[0], set()).add(found[1])
        rows: dict[str, tuple[str, int, int]] = {}
        stacked: dict[str, int] = {}  # folder of expert id 0 -> the rows it stacks
        for name in self.shapes:
            found = N.expert_id(name)
            if found is None:
                continue
            first = N.with_expert_id(name, 0)
            ep = stacked.setdefault(first, self._stacked_rows(first))
            if ep <= 1 or len(experts[found[0]]) % ep:
                continue
            per_rank = len(experts[found[0]]) // ep
            rows[name] = (N.with_expert_id(name, found[1] % per_rank), found[1] // per_rank, ep)
        return rows

    def _stacked_rows(self, name: str) -> int:
        """The expert ranks an expert param's folder stacks (``ep_num_experts`` of its master's
        file, marked ``is_expert_param``); 1 for a folder of one expert."""
        path = os.path.join(self.tag_dir, N.universal_param_dir(name, self.declared_in), f"{N.UNIVERSAL_FP32}.pt")
        if not os.path.isfile(path):
            return 1
        try:
            value = torchfile.load(path)
        except ZckptError:
            return 1  # the file's damage is named when it is read
        if isinstance(value, dict) and value.get(N.EP_IS_EXPERT_PARAM) is True:
            count = value.get(N.EP_NUM_EXPERTS)
            return count if isinstance(count, int) and count > 0 else 1
        return 1

    def _read_param(self, reader: FileReader, name: str, shape: tuple[int, ...], zero3: bool) -> _ParamFiles | None:
        stored, row, rows = self.expert_rows.get(name, (name, 0, 1))
        folder = os.path.join(self.tag_dir, N.universal_param_dir(stored, self.declared_in))
        try:
            stems = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".pt"))
        except FileNotFoundError:
            self._problem(
                CheckpointNotFoundError,
                folder,
                f"missing: param {name} (shape {list(shape)}) is in the model states but has no folder",
            )
            return None
        except OSError as exc:
            self._problem(CheckpointNotFoundError, folder, f"cannot list ({exc.strerror})")
            return None
        if N.UNIVERSAL_FP32 not in stems:
            self._problem(
                CheckpointNotFoundError, os.path.join(folder, "fp32.pt"), f"missing: the fp32 master of {name}"
            )
            return None
        master, states, step, step_saved, step_path = None, {}, None, None, None
        for stem in stems:
            path = os.path.join(folder, f"{stem}.pt")
            self.result.files.append(path)
            value = self._load(path)
            if value is None:
                return None
            if stem == N.UNIVERSAL_STEP:
                if isinstance(value, TensorRef):
                    step_saved = ScalarState(tensor=source_of(value))
                    step = read_scalar(reader, step_saved.tensor)
                else:
                    step_saved, step = ScalarState(value=value), value
                step_path = path
                continue
            source = self._state_source(path, value, name, shape, row, rows)
            if source is None:
                return None
            if stem == N.UNIVERSAL_FP32:
                master = source
            else:
                states[stem] = source
        assert master is not None
        states = {key: states[key] for key in in_creation_order(list(states))}  # as the optimizer saved them
        return _ParamFiles(master, states, step, step_saved, step_path)

    def _state_source(
        self, path: str, value: Any, name: str, shape: tuple[int, ...], row: int = 0, rows: int = 1
    ) -> TensorSource | None:
        """The tensor of one state file, viewed as the param's shape (flat files are accepted);
        row `row` of `rows` stacked expert copies where the file stacks them."""
        ref = value.get(N.UNIVERSAL_PARAM) if isinstance(value, dict) else value
        if not isinstance(ref, TensorRef):
            self._problem(
                CorruptFileError,
                path,
                f"holds no tensor (expected a tensor or {{'param': tensor}}, got {type(value).__name__})",
            )
            return None
        numel = numel_of(shape)
        if rows > 1:  # stacked expert copies: the whole stack, in its shape
            fits = tuple(ref.shape) == (rows, *shape)
        else:  # flat files are accepted
            fits = ref.numel == numel and (len(ref.shape) == 1 or tuple(ref.shape) == shape)
        if not fits:
            stacked = f" stacked over {rows} expert ranks ({[rows, *shape]})" if rows > 1 else ""
            self._problem(
                LayoutError,
                path,
                f"holds a tensor of shape {list(ref.shape)}; the model states give {name} shape {list(shape)}{stacked}",
            )
            return None
        if not ref.dtype.is_floating:
            self._problem(CorruptFileError, path, f"holds {ref.dtype.short} data; optimizer states are floating point")
            return None
        try:
            whole = source_of(ref)
        except CorruptFileError as exc:
            self.problems.append(exc)
            return None
        return TensorSource(ref.dtype, shape, tuple(slice_segments(whole, row * numel, numel)))

    def _check_states_complete(self, param_shapes: list[dict], zero3: bool) -> None:
        """Every param has the states the rest of its group has (a missing exp_avg.pt would
        leave the loader's buffer at zeros: the run would resume with a reset optimizer)."""
        for group in self._group_members(param_shapes, zero3):
            found = [n for n in group if n in self.param_files]
            expected: dict[str, None] = {}
            for name in found:
                expected.update(dict.fromkeys(self.param_files[name].states))
            for name in found:
                for key in expected:
                    if key not in self.param_files[name].states:
                        others = sum(1 for n in found if key in self.param_files[n].states)
                        path = os.path.join(self.tag_dir, N.universal_state_file(name, key, self.declared_in))
                        self._problem(
                            CheckpointNotFoundError, path, f"missing: {others} other param(s) of its group have {key}"
                        )

    def _group_members(self, param_shapes: list[dict], zero3: bool) -> list[list[str]]:
        if not zero3:
            return [list(group) for group in param_shapes]
        owner = sub_group_param_groups(self.optimizer, len(param_shapes))
        groups: dict[int, list[str]] = {}
        for sub_group, shapes in enumerate(param_shapes):
            groups.setdefault(owner[sub_group], []).extend(shapes)
        return [groups[g] for g in sorted(groups)]

    def _note_extra_folders(self) -> None:
        try:
            folders = os.listdir(os.path.join(self.tag_dir, N.UNIVERSAL_ZERO_DIR))
        except OSError:
            return
        known = set(self.shapes) | {name for name, _, _ in self.result.declared} | set(self.result.tied)
        extra = sorted(
            f for f in folders if f not in known and os.path.isdir(os.path.join(self.tag_dir, N.UNIVERSAL_ZERO_DIR, f))
        )
        if extra:
            self.result.notes.append(
                f"{len(extra)} folder(s) under zero/ belong to no param of the model states (ignored): {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
            )

    # --- training state -----------------------------------------------------------------------
    def _training_state(self, models: dict, model0: dict, zero3: bool) -> TrainingState:
        index = self.result.index
        assert index is not None
        round_robin = not zero3 and self.run_config.round_robin_gradients
        groups_of = self._group_members(self.param_shapes, zero3)
        group_index = {name: g for g, names in enumerate(groups_of) for name in names}
        params = [
            ParamState(name, self.shapes[name], group_index[name], files.master, files.states)
            for name, files in self.param_files.items()
        ]
        if not zero3:  # flat-group order in the model states; the optimizer's may differ (round robin)
            layout = zero12_layout(
                [
                    [LayoutParam(n, numel_of(s), g) for n, s in group.items()]
                    for g, group in enumerate(self.param_shapes)
                ],
                index.world_size,
                stage=index.zero_stage,
            )
            params = [params[i] for i in optimizer_order(layout, params, round_robin)]
        groups = self._param_groups(groups_of, zero3)
        return TrainingState(
            index=index,
            params=tuple(params),
            groups=groups,
            rank_buffers=tuple(module_buffers(models[rank]) for rank in sorted(models)) if zero3 else (),
            round_robin=round_robin,
            **saved_run_state(model0, self.optimizer),
        )

    def _param_groups(self, groups_of: list[list[str]], zero3: bool) -> tuple[ParamGroupState, ...]:
        saved = self.optimizer.get(N.PARAM_GROUPS) or []
        torch_state = (self.optimizer.get(N.OPTIMIZER_STATE_DICT) or {}).get("state") or {}
        owner = sub_group_param_groups(self.optimizer, len(self.param_shapes)) if zero3 else []
        result = []
        for g, names in enumerate(groups_of):
            hyper = saved[g] if g < len(saved) and isinstance(saved[g], dict) else {}
            element_keys: dict[str, None] = {}
            for name in names:
                element_keys.update(dict.fromkeys(self.param_files[name].states))
            scalars: dict[str, ScalarState] = {}
            keys: tuple[str, ...] = ()
            if zero3:  # the first sub-group's torch state holds the group's scalars (step)
                first = next((sub for sub, group in enumerate(owner) if group == g), None)
                entry = torch_state.get(first) if first is not None else None
                if isinstance(entry, dict):  # zckpt keeps only the scalars there; DeepSpeed all the keys
                    keys = tuple(entry) + tuple(k for k in element_keys if k not in entry)
                    for key, value in entry.items():
                        if key not in element_keys:
                            scalars[key] = (
                                ScalarState(tensor=source_of(value))
                                if isinstance(value, TensorRef)
                                else ScalarState(value=value)
                            )
            else:  # the step in each param's step.pt; other scalars where zckpt keeps them (see writer)
                scalars.update(self._group_step(names))
                entry = torch_state.get(g)
                for key, value in entry.items() if isinstance(entry, dict) else ():
                    scalars[key] = (
                        ScalarState(tensor=source_of(value))
                        if isinstance(value, TensorRef)
                        else ScalarState(value=value)
                    )
            result.append(
                ParamGroupState({k: v for k, v in hyper.items() if k != "params"}, scalars, tuple(names), keys)
            )
        return tuple(result)

    def _group_step(self, names: list[str]) -> dict[str, ScalarState]:
        """The group's step from its params' step.pt files, which must agree (DeepSpeed asserts it)."""
        found = [self.param_files[n] for n in names if self.param_files[n].step_saved is not None]
        if not found:
            return {}
        first = found[0]
        for other in found[1:]:
            if other.step != first.step:
                self._problem(
                    LayoutError,
                    other.step_path,
                    f"step {other.step} differs from {first.step} in {first.step_path}: files of different conversions are mixed",
                )
        assert first.step_saved is not None
        return {N.UNIVERSAL_STEP: first.step_saved}

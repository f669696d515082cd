"""What ``--resume`` takes from the checkpoint, what it lets a user change, and what it refuses.

A checkpoint records a run: its model (``model_config.json``, which ``zckpt train`` writes beside
its checkpoints), the compute dtype and the frozen params (the rank files), and the optimizer,
lr schedule and batch (the ds_config saved in every rank file). A resumed run is that run
continued, so:

- the model shape, the dtype and the frozen params are the checkpoint's: the params and the
  optimizer state only fit that model, the bf16/fp16 files and fp16's loss scaler belong to
  that dtype, and frozen params have no Adam moments. An option that says otherwise is refused.
- the lr, warmup, clipping, sub-group size and batch are the checkpoint's unless given: a
  DeepSpeed run takes these from its config on resume too (the checkpoint holds only the
  scheduler's step counter), and changing them is a real choice (a lower lr after a loss
  spike, another --sub-group-size for another machine's memory). ``--steps`` defaults to the
  end of the checkpoint's schedule (a run stopped early finishes as planned); a larger value
  moves the end of the lr decay with it.
- When the world size changes, the global batch (micro-batch x ranks x grad-accum) is kept by
  choosing the micro-batch and grad-accum, or, where no split gives it, the closest one; a
  note says which and why.
- Where checkpoints go and how this machine holds the state (``--out``, ``--save-every``,
  ``--nvme-path``, ``--nvme-params``, ``--bounded-memory``, ``--device``) and the data
  (``--data``, ``--seed``, which picks the synthetic stream) are not in the checkpoint: they are
  this invocation's, as for a new run.

:func:`resolve_resume` is the decision, a pure function of the checkpoint's facts, the options
given and the world size; :func:`plan_training` reads the facts and calls it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..core.errors import CorruptFileError, UsageError
from ..deepspeed.engine_config import RecordedRun, recorded_run
from ..deepspeed.reader import open_training_state
from .config import TrainConfig, check_dtype
from .model import MODEL_CONFIG_FILE, GPTConfig, load_model_config

MODEL_SHAPE = ("layers", "dim", "heads", "vocab", "seq_len")
TIED_HEAD = ("lm_head.weight", "wte.weight")  # GPT's tied alias and the param it shares


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint records about the run that saved it."""

    path: str  # as given to --resume
    model: GPTConfig | None  # its model_config.json; None when there is none (DeepSpeed writes none)
    tied: bool  # lm_head.weight is saved as an alias of wte.weight
    dtype: str  # the compute dtype: fp32, bf16 or fp16
    params: tuple[str, ...]  # every param's name, trainable or frozen (tied aliases not repeated)
    frozen: tuple[str, ...]
    world_size: int
    global_steps: int
    run: RecordedRun  # what its ds_config says


@dataclass(frozen=True)
class TrainPlan:
    """The run to start, and what a user should know about how it was chosen (one line each)."""

    config: TrainConfig
    notes: tuple[str, ...] = ()


def plan_training(options: Mapping[str, Any], world_size: int | None = None) -> TrainPlan:
    """The TrainConfig for the options a user gave (only those: a missing key means "not
    given", so a default never hides a choice). Without ``resume`` it is those options over
    TrainConfig's defaults; with it, see :func:`resolve_resume`. `world_size`: the ranks that
    will run (default: torchrun's WORLD_SIZE, else 1)."""
    resume = options.get("resume")
    if resume is None:
        return TrainPlan(TrainConfig(**options))
    if not os.path.exists(resume):
        raise UsageError(resume, "--resume: no such checkpoint")
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    return resolve_resume(options, checkpoint_facts(resume), world)


def checkpoint_facts(path: str) -> CheckpointFacts:
    """Read what `path` (any checkpoint zckpt reads) records about its run."""
    state = open_training_state(path)
    index = state.index
    model = None
    config_file = os.path.join(index.checkpoint_dir, MODEL_CONFIG_FILE)
    if os.path.exists(config_file):
        model = load_model_config(config_file)
    aliases = {e.name: e.alias_of for e in index.entries if e.kind == "tied"}
    params = tuple(e.name for e in index.entries if e.kind in ("param", "frozen"))
    frozen = tuple(e.name for e in index.entries if e.kind == "frozen")
    if index.dtype.short not in ("fp32", "bf16", "fp16"):
        raise CorruptFileError(index.tag_dir, f"trained in {index.dtype.short}; zckpt train runs fp32, bf16 or fp16")
    return CheckpointFacts(
        path=path,
        model=model,
        tied=aliases.get(TIED_HEAD[0]) == TIED_HEAD[1],
        dtype=index.dtype.short,
        params=params,
        frozen=frozen,
        world_size=index.world_size,
        global_steps=int(state.global_steps or 0),
        run=recorded_run(state.ds_config, index.world_size, index.ds_version, index.tag_dir),
    )


def resolve_resume(given: Mapping[str, Any], facts: CheckpointFacts, world: int) -> TrainPlan:
    """The resumed run's TrainConfig: the checkpoint's model, dtype and frozen params (a given
    option that differs is refused), its schedule, optimizer settings and global batch unless
    given, and the rest as given or TrainConfig's defaults. Raises UsageError (one line)."""
    options = dict(given)
    fixed = {**_model(given, facts), "dtype": facts.dtype}
    if "dtype" in given:
        check_dtype(given["dtype"])
    for name, value in fixed.items():
        if name in given and given[name] != value:
            raise UsageError(
                facts.path,
                f"{_flag(name, given[name])} contradicts the checkpoint, which has {_flag(name, value)}: "
                f"a resumed run keeps its model, dtype and frozen params (leave {_option(name)} out)",
            )
        options[name] = value
    options["freeze"] = _freeze(given.get("freeze"), facts)
    run = facts.run
    if run.other_scheduler is not None and not {"lr", "warmup", "steps"} <= set(given):
        raise UsageError(
            facts.path,
            f"its lr schedule ({run.other_scheduler}) is not one zckpt train runs (WarmupDecayLR warming up linearly "
            "from 0, or a constant lr): give --lr, --warmup and --steps",
        )
    recorded = {
        "lr": run.lr,
        "warmup": run.warmup,
        "clip": run.clip,
        "sub_group_size": run.sub_group_size,
        "betas": run.betas,
        "eps": run.eps,
        "weight_decay": run.weight_decay,
        "steps": run.total_steps,
    }
    for name, value in recorded.items():
        if name not in given and value is not None:
            options[name] = value
    _check_steps(given, options.get("steps"), facts)
    notes = []
    if run.global_batch is not None:
        micro, accum, note = _batch(run, facts.world_size, world, given.get("micro_batch"), given.get("grad_accum"))
        options["micro_batch"], options["grad_accum"] = micro, accum
        notes += [note] if note else []
    return TrainPlan(TrainConfig(**options), tuple(notes))


def _model(given: Mapping[str, Any], facts: CheckpointFacts) -> dict[str, Any]:
    """The model shape the run must have: its model_config.json, or (a checkpoint without one,
    as DeepSpeed writes them) the shape options given, which must then all be given: the
    checkpoint holds the param shapes but not the number of heads, and a guess could load."""
    if facts.model is not None:
        return {f.name: getattr(facts.model, f.name) for f in fields(GPTConfig)}
    missing = [_option(name) for name in MODEL_SHAPE if name not in given]
    if missing:
        raise UsageError(
            facts.path,
            f"no {MODEL_CONFIG_FILE} beside the checkpoint (zckpt train writes one, DeepSpeed does not): "
            f"give the model's {' '.join(map(_option, MODEL_SHAPE))} (missing: {' '.join(missing)})",
        )
    return {**{name: given[name] for name in MODEL_SHAPE}, "tie_embeddings": facts.tied}


def _freeze(pattern: str | None, facts: CheckpointFacts) -> str | None:
    """A --freeze regex that freezes exactly the checkpoint's frozen params: the one given if it
    does, else one naming them."""
    if pattern is None:
        return "^(?:" + "|".join(map(re.escape, facts.frozen)) + ")$" if facts.frozen else None
    try:
        matcher = re.compile(pattern)
    except re.error as exc:
        raise UsageError(None, f"--freeze {pattern!r} is not a regular expression: {exc}") from None
    frozen = tuple(name for name in facts.params if matcher.search(name))
    if set(frozen) != set(facts.frozen):
        raise UsageError(
            facts.path,
            f"--freeze {pattern!r} freezes {_names(frozen)}, the checkpoint froze {_names(facts.frozen)}: "
            "a resumed run keeps its model, dtype and frozen params (leave --freeze out)",
        )
    return pattern


def _check_steps(given: Mapping[str, Any], steps: int | None, facts: CheckpointFacts) -> None:
    """--steps counts from the start of the run: a run that would train no step is a mistake
    (most often --steps meant as "more steps"), said rather than exiting 0 with nothing done."""
    done = facts.global_steps
    if steps is None:
        raise UsageError(facts.path, f"the checkpoint (step {done}) records no end of its lr schedule: give --steps")
    if steps <= done and "steps" in given:
        raise UsageError(
            facts.path,
            f"--steps {steps}: the checkpoint is at step {done} already (--steps counts from the start of the run)",
        )
    if steps <= done:
        raise UsageError(
            facts.path,
            f"the checkpoint is at step {done}, the end of its run (--steps {steps}): give a larger --steps to train on",
        )


def _batch(
    run: RecordedRun, saved_world: int, world: int, micro: int | None, accum: int | None
) -> tuple[int, int, str | None]:
    """(micro-batch, grad-accum) at `world` ranks, and a note when they differ from the
    checkpoint's. The checkpoint's global batch is kept where a split gives it: the fewest
    micro-steps with no more sequences per rank than its micro-batch (memory per rank does not
    grow unasked). Where none does, the closest global batch is taken (then the fewest
    micro-steps) and the note says so. A given --micro-batch or --grad-accum is kept and the
    other one chosen; both given are used as they are."""
    target, old_micro, old_accum = run.global_batch, run.micro_batch, run.grad_accum
    assert target is not None and old_micro is not None and old_accum is not None
    if target % (old_micro * old_accum) == 0:
        saved_world = target // (
            old_micro * old_accum
        )  # the ranks the batch was recorded for (a resharded checkpoint keeps them)
    was = f"the checkpoint's global batch of {target} sequences ({old_micro} x {_ranks(saved_world)} x {old_accum})"
    if micro is None or accum is None:
        kept_option = (
            f"--micro-batch {micro}" if micro is not None else f"--grad-accum {accum}" if accum is not None else None
        )
        most = old_micro if accum is None else max(old_micro, math.ceil(target / (world * accum)))
        candidates = []
        for m in [micro] if micro is not None else range(1, most + 1):
            exact = target / (m * world)
            for a in [accum] if accum is not None else {max(1, math.floor(exact)), max(1, math.ceil(exact))}:
                candidates.append((abs(m * world * a - target), a, -m))
        _, accum, minus_micro = min(candidates)
        micro = -minus_micro
        if kept_option is None:
            why, closest = (
                f"{target} is not a multiple of {world}",
                f"the closest with at most {old_micro} sequences per rank",
            )
        else:
            why, closest = (
                f"{target} is not a multiple of {kept_option} x {_ranks(world)}",
                f"the closest with {kept_option}",
            )
        unkept = f"{was} cannot be kept at {_ranks(world)} ({why}): using {micro * world * accum} ({_split(micro, world, accum)}), {closest}"
    else:
        unkept = f"{was} becomes {micro * world * accum} at {_ranks(world)} ({_split(micro, world, accum)}, as given)"
    if (micro, accum) == (old_micro, old_accum) and world == saved_world:
        return micro, accum, None
    if micro * world * accum == target:
        return micro, accum, f"{was} is kept at {_ranks(world)} with {_split(micro, world, accum)}"
    return micro, accum, unkept


def _split(micro: int, world: int, accum: int) -> str:
    return f"--micro-batch {micro} x {_ranks(world)} x --grad-accum {accum}"


def _ranks(world: int) -> str:
    return f"{world} rank{'s' * (world != 1)}"


def _names(names: tuple[str, ...]) -> str:
    if not names:
        return "none"
    return ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:3])} and {len(names) - 3} more"


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag(name: str, value: Any) -> str:
    """How the command line spells option `name` set to `value`."""
    if isinstance(value, bool):
        return _option(name) if value else f"--no-{name.replace('_', '-')}"
    return f"{_option(name)} {value}"

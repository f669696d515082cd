"""ZenFlow (``zero_optimization.zenflow``, DeepSpeed 0.19): what its saved config says and what
its 16-bit module weights are.

ZenFlow's selective optimizer steps the selected columns of each 2-D weight (and 1-D weights
whole) in the 16-bit params after the masters were copied back
(``zenflow/zenflow_torch_adam.py:119-121``, ``:158``), so a ZeRO-1/2 ZenFlow checkpoint's module
weights are the live engine's, not the masters rounded. A layout that holds no 16-bit weights
(ZeRO-3, whose module states are placeholders; a universal folder, fp32 only) cannot keep them:
a run loading it starts from the masters rounded.

With ``overlap_step`` (DeepSpeed's ``ZenFlowZeroOptimizerParallel``) the masters are stepped by a
separate process whose Adam moments are never saved, and the 16-bit weights lag the masters by a
step (:func:`overlapped`).
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_TOPK_RATIO = 0.1  # deepspeed/runtime/zenflow/zenflow_config.py


def zenflow_settings(ds_config: object) -> dict | None:
    """The saved ds_config's ``zero_optimization.zenflow`` (None: ZenFlow off; an empty dict
    where it is on with DeepSpeed's defaults)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    zenflow = zero.get("zenflow") if isinstance(zero, dict) else None
    return None if zenflow is None else zenflow if isinstance(zenflow, dict) else {}


def topk_ratio(zenflow: dict) -> float:
    """ZenFlow's share of selected columns (DeepSpeed's default 0.1, zenflow_config.py)."""
    ratio = zenflow.get("topk_ratio", DEFAULT_TOPK_RATIO)
    return float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else DEFAULT_TOPK_RATIO


def overlapped(zenflow: dict | None) -> bool:
    """Whether a ZenFlow run stepped its masters in another process (``overlap_step``), which
    leaves two things in its files unlike any other ZeRO-1/2 run (DeepSpeed 0.19.8; real run,
    issue 35: ZeRO-2 bf16, 2 ranks, 6 micro-steps, update_interval 2).

    - **No optimizer state**: ``ZenFlowZeroOptimizer.create`` picks ``ZenFlowZeroOptimizerParallel``
      (``runtime/zenflow/zenflow_stage_1_and_2.py:88-92``), whose step submits the Adam update to
      the process (``:757-776``, ``:820-826``); that process allocates the moments itself, two sets
      used on alternate steps (``runtime/zenflow/zenflow_utils.py:125-131``;
      ``ops/csrc/adam/cpu_adam_impl.cpp`` ``ZenFlowAdam::run_step``), and the engine's own
      ``ZenFlowCPUAdam`` never steps (``ops/adam/zenflow_cpu_adam.py:15-19``), so each optimizer
      file's ``base_optimizer_state`` is ``{'state': {}, 'param_groups': [...]}``: no ``exp_avg``,
      ``exp_avg_sq`` or ``step``. A run loading the checkpoint starts the moments from zero.
    - **16-bit weights a step behind**: at each accumulation boundary the 16-bit partitions are
      set from the snapshot of the masters the process took after its *previous* step
      (``stale_param``, ``wait_last_update_and_copy``, ``zenflow_stage_1_and_2.py:710-752``), and
      only then is the next step submitted (``:823-826``); the selective optimizer steps its
      columns on top. The first two steps copy nothing (no process yet; then
      ``first_update_round_after_warmup``, ``:712-717``): the weights as initialised plus the
      selective steps. Measured at the 3rd step: 3,900 of 4,323 module elements differ from the
      saved masters rounded, in every column; 548, in at most 3 columns of each 2-D weight, from
      the 2nd step's masters rounded (which no file holds). So verify does not judge them.

    ``save_checkpoint`` does not wait for a step in flight: the masters saved are those the
    process has written when the file is (in the real run, the live masters after the last step)."""
    return zenflow is not None and bool(zenflow.get("overlap_step"))


def unsaved_moments_note(ds_config: object, state_names: Sequence[str] = ()) -> str | None:
    """The note that a ZenFlow ``overlap_step`` run's files hold no optimizer moments (see
    :func:`overlapped`), or None for any other run and for one whose files hold `state_names`
    (the setting changed in the saved config after a sequential run: the moments are there)."""
    if state_names or not overlapped(zenflow_settings(ds_config)):
        return None
    return (
        "a ZenFlow run with overlap_step (zero_optimization.zenflow): its Adam moments and step lived in "
        "ZenFlow's optimizer process, which DeepSpeed does not save, so the optimizer files hold none; "
        "a run loading this checkpoint (or zckpt's outputs of it) starts them from zero"
    )


def dcp_weights_note(ds_config: object, dtype: str) -> str | None:
    """The note for a DCP folder of a ZenFlow run (its model is the masters, in `dtype`), or None
    when the run did not use ZenFlow: the run's saved 16-bit module weights differ from the
    masters rounded in the columns ZenFlow stepped after them (see :func:`module_weights_note`)."""
    if zenflow_settings(ds_config) is None:
        return None
    held = "the fp32 masters" if dtype == "fp32" else f"the masters rounded to {dtype}"
    return (
        f"a ZenFlow run: the DCP model holds {held}, not the run's saved 16-bit module weights (the "
        f"selected columns ZenFlow stepped after the masters); `zckpt reshard` to ZeRO-1 or 2 keeps them"
    )


def module_weights_note(ds_config: object, where: str) -> str | None:
    """The note for writing a ZenFlow run into `where` (a layout without 16-bit weights), or None
    when the run did not use ZenFlow."""
    if zenflow_settings(ds_config) is None:
        return None
    return (
        f"a ZenFlow run: its saved 16-bit module weights (the selected columns ZenFlow stepped after "
        f"the masters) are not kept in {where}, which holds no 16-bit weights; a run loading it starts "
        f"from the masters rounded (`zckpt reshard` to ZeRO-1 or 2 keeps them)"
    )

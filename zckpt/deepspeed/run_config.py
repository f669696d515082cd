"""A DeepSpeed config read as DeepSpeed 0.19.8 reads it: every value zckpt uses, checked with
DeepSpeed's own rules. The one routine behind ``reshard --config`` and the checkpoint's saved
config (writer, reader), ``nvme-plan --config`` and the trainer's own ds_config.

Where the rules come from (paths under ``deepspeed/``; pydantic 2.14 does the coercion):

* ``zero_optimization``, ``bf16``/``bfloat16``, ``fp16`` and the offload sections are pydantic
  models (``runtime/zero/config.py``, ``runtime/zero/offload_config.py``,
  ``runtime/precision_config.py``). A model drops every value that is the string ``"auto"``
  before validating (``runtime/config_utils.py:55-56``), so ``"auto"`` reads as the default.
  Integers and booleans are coerced in pydantic's lax mode: ``"5"``, ``5.0`` and ``true`` are
  the integer 5, 5 and 1; ``"yes"``, ``"off"``, ``0`` and ``1.0`` are booleans; ``1e30`` (a float
  beyond 64 bits), ``5.5``, ``2`` as a boolean are refused.
* The scalar fields of ``zero_optimization`` and its offload sections that zckpt does not use
  (:data:`ZERO_INT_FIELDS`, :data:`ZERO_BOOL_FIELDS`; ``stage3_param_persistence_threshold``,
  ``reduce_bucket_size``, ``pin_memory``, ``ratio``, ...) are checked as DeepSpeedZeroConfig checks
  them (their bounds, one spelling of a field, the validators that depend on the stage), so that a
  config zckpt accepts for a run is one DeepSpeed starts; a checkpoint's saved config is held to
  them only where zckpt uses a value (its own release checked the rest). Unknown keys, which the
  model also refuses (``extra="forbid"``), and the ``zenflow`` and ``leaf_module`` sub-models are
  not checked.
* ``aio``, ``data_types`` and ``gradient_clipping`` are read with plain ``dict.get``: nothing is
  checked when the config is parsed, and ``"auto"`` stays the string ``"auto"``. Their values
  fail later, where DeepSpeed uses them; zckpt refuses them up front, saying where.
* A config for a run to come may be completed by the Hugging Face Trainer or Accelerate, which
  replace some ``"auto"`` values before DeepSpeed sees them (:data:`FILLED_BY`). zckpt cannot
  know what they will put there: such values are listed in :attr:`RunConfig.filled`, read
  meanwhile as DeepSpeed alone reads them, and a caller that needs one says so. The config a
  checkpoint holds is the one its engine ran with: its ``"auto"`` values were read by DeepSpeed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Mapping, NoReturn

from ..core.errors import CorruptFileError, UsageError, ZckptError
from ..io.reading import read_json_object
from . import names as N
from .swap_rules import (
    AIO_BLOCK_SIZE,
    AIO_BLOCK_SIZE_DEFAULT,
    AIO_INTRA_OP_PARALLELISM,
    AIO_INTRA_OP_PARALLELISM_DEFAULT,
    BUFFER_COUNT,
    BUFFER_SIZE,
    CONFIG_AIO,
    DEVICE,
    FAST_INIT,
    MAX_IN_CPU,
    MAX_IN_CPU_DEFAULT,
    NVME,
    NVME_PATH,
    OPTIMIZER_BUFFER_COUNT_DEFAULT,
    PARAM_BUFFER_COUNT_DEFAULT,
    PARAM_BUFFER_SIZE_DEFAULT,
    PIPELINE_READ,
    PIPELINE_WRITE,
    Aio,
    SwapRule,
)

AUTO = "auto"
CONFIG_ENABLED = "enabled"
CPU = "cpu"
NONE = "none"
OFFLOAD_DEVICES = (NONE, CPU, NVME)  # OffloadDeviceEnum, runtime/zero/offload_config.py:14-18
ZERO_STAGES = (0, 1, 2, 3)  # ZeroStageEnum, runtime/zero/config.py:81-87
CONFIG_CPU_OFFLOAD_PARAM = "cpu_offload_param"
# DtypeEnum (runtime/config.py:144-149): the spellings engine.get_data_types accepts (engine.py:1809)
DTYPE_SPELLINGS = {
    "torch.float16": "fp16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float32": "fp32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.int8": "int8",
    "int8": "int8",
    "torch.bfloat16": "bf16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}
C_INT_MAX = (
    2**31 - 1
)  # the async I/O op takes its sizes as C ints (ops/csrc/aio/py_lib/deepspeed_py_io_handle.cpp:38-42)
O_DIRECT_BLOCK = 512  # the smallest logical block of a disk: O_DIRECT offsets are multiples of it

STAGE_KEY = f"{N.CONFIG_ZERO}.{N.CONFIG_STAGE}"
OFFLOAD_OPTIMIZER_DEVICE_KEY = f"{N.CONFIG_ZERO}.{N.CONFIG_OFFLOAD_OPTIMIZER}.{DEVICE}"
DTYPE_KEYS = (
    f"{N.CONFIG_BF16[0]}.{CONFIG_ENABLED}",
    f"{N.CONFIG_FP16}.{CONFIG_ENABLED}",
)  # the Trainer fills these, not "bfloat16"

# DeepSpeedZeroConfig's other scalar fields (runtime/zero/config.py, at that line), which zckpt does
# not use but a config it accepts for a run must pass: (name, its alias or None, line). Integers
# with their least value (ge=0; reduce_bucket_size gt=0; None: unbounded), booleans (Optional[bool]
# ones take null too). A field is spelled by its name or its alias (populate_by_name), never both.
ZERO_INT_FIELDS = (
    ("reduce_bucket_size", None, 1, 113),
    ("allgather_bucket_size", None, 0, 132),
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 0, 222),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 0, 228),
    ("model_persistence_threshold", "stage3_model_persistence_threshold", 0, 235),
    ("max_live_parameters", "stage3_max_live_parameters", 0, 245),
    ("max_reuse_distance", "stage3_max_reuse_distance", 0, 251),
    ("module_granularity_threshold", "stage3_module_granularity_threshold", None, 265),
    ("zero_hpz_partition_size", None, 0, 324),
)
ZERO_BOOL_FIELDS = (
    ("contiguous_gradients", None, 102),
    ("reduce_scatter", None, 108),
    ("use_multi_rank_bucket_allreduce", None, 119),
    ("allgather_partitions", None, 126),
    ("compute_grad_norm", None, 143),
    ("load_from_fp32_weights", None, 150),
    ("elastic_checkpoint", None, 158),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", 257),
    ("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", 273),
    ("allgather_sequential", "stage3_allgather_sequential", 279),
    ("stage3_gather_fp16_weights_on_model_save", None, 287),  # deprecated for gather_16bit_weights_on_model_save
    ("ignore_unused_parameters", None, 294),
    ("legacy_stage1", None, 303),
    ("zero_quantized_weights", None, 328),
    ("zero_quantized_nontrainable_weights", None, 333),
    ("zero_quantized_gradients", None, 340),
    ("memory_efficient_linear", None, 346),
    ("pipeline_loading_checkpoint", None, 353),
    ("override_module_apply", None, 355),
    ("log_trace_cache_warnings", None, 360),
    ("enable_sanity_checks", None, 365),
    ("save_muon_momentum_buffer_in_memory", None, 370),
)
ZERO_OPTIONAL_BOOL_FIELDS = (("overlap_comm", 138), ("cpu_offload_use_pin_memory", 199))
COMPUTE_GRAD_NORM = "compute_grad_norm"
RATIO = "ratio"

_TRAINER = "the Hugging Face Trainer"
_ACCELERATE = "Accelerate (the Trainer's DeepSpeedPlugin)"
# "auto" values the Hugging Face Trainer (transformers 5.23, integrations/deepspeed.py) and
# Accelerate (1.15, utils/dataclasses.py:1280-1292, DeepSpeedPlugin) replace before DeepSpeed
# sees the config, among those zckpt uses; who fills each and from what
FILLED_BY = {
    DTYPE_KEYS[0]: f"{_TRAINER} from TrainingArguments.bf16 (integrations/deepspeed.py:184)",
    DTYPE_KEYS[1]: f"{_TRAINER} from TrainingArguments.fp16 (integrations/deepspeed.py:183)",
    N.CONFIG_GRADIENT_CLIPPING: f"{_TRAINER} from TrainingArguments.max_grad_norm (integrations/deepspeed.py:161)",
    STAGE_KEY: f"{_ACCELERATE} from its zero_stage, 2 unless configured",
    OFFLOAD_OPTIMIZER_DEVICE_KEY: f'{_ACCELERATE} from its offload_optimizer_device, "none" unless configured',
    f"{N.CONFIG_ZERO}.{N.CONFIG_OFFLOAD_PARAM}.{DEVICE}": f'{_ACCELERATE} from its offload_param_device, "none" unless configured',
    f"{N.CONFIG_ZERO}.{N.CONFIG_OFFLOAD_OPTIMIZER}.{NVME_PATH}": f"{_ACCELERATE} from its offload_optimizer_nvme_path",
    f"{N.CONFIG_ZERO}.{N.CONFIG_OFFLOAD_PARAM}.{NVME_PATH}": f"{_ACCELERATE} from its offload_param_nvme_path",
}


@dataclass(frozen=True)
class Offload:
    """What the two offload sections share: where the state lives."""

    device: str  # "none", "cpu" or "nvme"
    nvme_path: str | None


@dataclass(frozen=True)
class ParamOffload(Offload):
    """``zero_optimization.offload_param`` (DeepSpeedZeroOffloadParamConfig)."""

    buffer_size: int = PARAM_BUFFER_SIZE_DEFAULT
    buffer_count: int = PARAM_BUFFER_COUNT_DEFAULT
    max_in_cpu: int = MAX_IN_CPU_DEFAULT


@dataclass(frozen=True)
class OptimizerOffload(Offload):
    """``zero_optimization.offload_optimizer`` (DeepSpeedZeroOffloadOptimizerConfig)."""

    buffer_count: int = OPTIMIZER_BUFFER_COUNT_DEFAULT
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False


@dataclass(frozen=True)
class RunConfig:
    """What zckpt uses of a DeepSpeed config, with DeepSpeed's defaults filled in."""

    stage: int
    stage_set: bool  # the config names the stage (reshard takes it from --config only then)
    dtype: str  # "bf16", "fp16" or "fp32" (neither enabled)
    sub_group_size: int
    round_robin_gradients: bool
    parameter_alignment: bool
    grad_accum_dtype: str | None  # "fp32", "fp16", "bf16", "int8"; None: the training dtype
    gradient_clipping: float | None  # None: not set (the engine's default depends on the release)
    offload_param: ParamOffload | None
    offload_optimizer: OptimizerOffload | None
    aio: Aio | None  # None when the run swaps nothing to NVMe (DeepSpeed then never reads it)
    # settings left "auto" for the Trainer or Accelerate to fill in: key -> who fills it from what
    filled: Mapping[str, str] = field(default_factory=dict)

    @property
    def known_dtype(self) -> str | None:
        """The dtype it trains in; None where the Trainer fills bf16/fp16 "enabled" in."""
        return None if any(k in self.filled for k in DTYPE_KEYS) else self.dtype

    def device(self, section: str) -> str:
        """The offload device of ``offload_optimizer`` or ``offload_param`` ("none" without one)."""
        offload = self.offload_optimizer if section == N.CONFIG_OFFLOAD_OPTIMIZER else self.offload_param
        return offload.device if offload is not None else NONE

    @property
    def swap_rule(self) -> SwapRule | None:
        """Which ZeRO-3 sub-groups the run keeps on NVMe; None when it swaps no optimizer state."""
        return (
            SwapRule(self.aio)
            if self.aio is not None and self.stage == 3 and self.device(N.CONFIG_OFFLOAD_OPTIMIZER) == NVME
            else None
        )

    def bf16_optimizer(self, trains_bf16: bool) -> bool:
        """The engine picks BF16_Optimizer: bf16, fp32 gradient accumulation, ZeRO-1, optimizer
        not offloaded to CPU (engine.py:2305-2306)."""
        return (
            trains_bf16
            and self.grad_accum_dtype == "fp32"
            and self.stage == 1
            and self.device(N.CONFIG_OFFLOAD_OPTIMIZER) != CPU
        )

    def require(self, key: str, where: str | None, remedy: str) -> None:
        """Refuse (UsageError) when `key` is left for the Trainer or Accelerate to fill in: what
        follows depends on a value zckpt cannot know."""
        if key in self.filled:
            raise UsageError(
                where, f'{key} = "auto": filled in by {self.filled[key]}, which zckpt cannot know; {remedy}'
            )


def read_run_config(
    config: Any,
    where: str | None = None,
    *,
    saved: bool = False,
    swaps: bool = False,
    error: type[ZckptError] | None = None,
) -> RunConfig:
    """`config` read as DeepSpeed 0.19.8 reads it. A value DeepSpeed refuses raises `error`
    (default: CorruptFileError for a checkpoint's `saved` config, else UsageError) naming
    `where`, the key and the value. `saved`: the config the checkpoint's engine ran with, so
    every "auto" was read by DeepSpeed itself. `swaps`: check ``aio`` as a run that swaps to
    NVMe reads it even when the config itself swaps nothing (nvme-plan plans such a run)."""
    reader = _Reader(
        where, error or (CorruptFileError if saved else UsageError), "saved ds_config: " if saved else "", saved
    )
    if not isinstance(config, dict):
        reader.fail("ds_config", config, "must be a JSON object")
    return reader.read(config, swaps)


def load_config(path: str | os.PathLike[str] | None) -> dict | None:
    """A DeepSpeed config JSON of the target run (its values are checked where they are read:
    :func:`read_run_config`)."""
    return None if path is None else read_json_object(path, "DeepSpeed config")


# --- pydantic's lax coercion (pydantic-core 2.x), as DeepSpeed's models apply it ------------------
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")
# what Rust's str::trim strips (Unicode White_Space); Python's str.strip also strips \x1c-\x1f
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_TRUE = ("1", "on", "t", "true", "y", "yes")
_FALSE = ("0", "off", "f", "false", "n", "no")
_I64 = 2**63


def _lax_int(value: Any) -> tuple[int | None, str]:
    """(the integer pydantic makes of `value`, "") or (None, why it refuses it)."""
    if isinstance(value, bool):
        return int(value), ""
    if isinstance(value, int):
        return value, ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None, "not a finite number"
        if not value.is_integer():
            return None, "not a whole number"
        if not -_I64 <= value < _I64:  # pydantic: "exceeded maximum size"
            return None, "a float beyond 2**63, which pydantic does not turn into an integer"
        return int(value), ""
    if isinstance(value, str):
        text = value.strip(_WHITESPACE)
        if _INT_TEXT.fullmatch(text):
            return int(text.split(".")[0].replace("_", "")), ""
        return None, "not an integer"
    return None, "not an integer"


_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _lax_float(value: Any) -> float | None:
    """The float pydantic makes of `value` (a number, a boolean, a decimal string; "5." and "1_0"
    refused), or None where it refuses it. NaN and the infinities come back as they are."""
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer beyond a float's range
            return None
    if isinstance(value, str):
        text = value.strip(_WHITESPACE)
        return float(text) if _FLOAT_TEXT.fullmatch(text) else None
    return None


def _lax_bool(value: Any) -> bool | None:
    """The boolean pydantic makes of `value`, or None where it refuses it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    return None


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class _Reader:
    """One pass over a config; `fail` raises the caller's error for the first refused value."""

    def __init__(self, where: str | None, error: type[ZckptError], label: str, saved: bool) -> None:
        self.where, self.error, self.label, self.saved = where, error, label, saved
        self.filled: dict[str, str] = {}
        self.ratio = 1.0  # offload_optimizer.ratio

    def fail(self, key: str, value: Any, why: str) -> NoReturn:
        raise self.error(self.where, f"{self.label}{key} = {_show(value)}: {why}")

    # --- a pydantic model's fields ----------------------------------------------------------
    def model(self, section: dict, path: str) -> dict:
        """`section` as DeepSpeedConfigModel validates it: "auto" values dropped (the default
        applies; config_utils.py:55-56), those the Trainer or Accelerate fill noted first."""
        kept = {}
        for key, value in section.items():
            if isinstance(value, str) and value == AUTO:
                name = f"{path}{key}"
                if not self.saved and name in FILLED_BY:
                    self.filled[name] = FILLED_BY[name]
            else:
                kept[key] = value
        return kept

    def int_field(self, section: dict, path: str, key: str, default: int, minimum: int | None, source: str) -> int:
        if key not in section:
            return default
        number, why = _lax_int(section[key])
        if number is None:
            self.fail(f"{path}{key}", section[key], f"{why}; DeepSpeed refuses it ({source})")
        if minimum is not None and number < minimum:
            self.fail(f"{path}{key}", section[key], f"DeepSpeed requires at least {minimum} ({source})")
        return number

    def float_field(
        self, section: dict, path: str, key: str, default: float, low: float, high: float, source: str
    ) -> float:
        if key not in section:
            return default
        number = _lax_float(section[key])
        if number is None:
            self.fail(f"{path}{key}", section[key], f"not a number; DeepSpeed refuses it ({source})")
        if not low <= number <= high:  # NaN too
            self.fail(f"{path}{key}", section[key], f"DeepSpeed requires a number from {low:g} to {high:g} ({source})")
        return number

    def bool_field(self, section: dict, path: str, key: str, source: str, optional: bool = False) -> bool:
        if key not in section or optional and section[key] is None:
            return False
        flag = _lax_bool(section[key])
        if flag is None:
            self.fail(
                f"{path}{key}",
                section[key],
                f'not a boolean (true/false, 1/0, "yes"/"no", ...); DeepSpeed refuses it ({source})',
            )
        return flag

    # --- sections -----------------------------------------------------------------------------
    def read(self, config: dict, swaps: bool) -> RunConfig:
        zero_path = f"{N.CONFIG_ZERO}."
        raw = config.get(N.CONFIG_ZERO, {})
        stage_set = isinstance(raw, bool) or isinstance(raw, dict) and N.CONFIG_STAGE in raw
        if isinstance(raw, bool):  # deprecated spelling: true is stage 1, false stage 0 (zero/config.py:60-68)
            raw = {N.CONFIG_STAGE: int(raw)}
        if not isinstance(raw, dict):
            self.fail(
                N.CONFIG_ZERO,
                raw,
                "must be a JSON object (or true/false, DeepSpeed's deprecated form); "
                "DeepSpeed fails on it (DeepSpeedZeroConfig(**...), runtime/zero/config.py:78)",
            )
        zero = self.model(raw, zero_path)
        stage = self.int_field(zero, zero_path, N.CONFIG_STAGE, 0, None, "ZeroStageEnum, runtime/zero/config.py:95")
        if stage not in ZERO_STAGES:
            self.fail(
                f"{zero_path}{N.CONFIG_STAGE}",
                zero[N.CONFIG_STAGE],
                "DeepSpeed accepts 0, 1, 2 or 3 (ZeroStageEnum, runtime/zero/config.py:81-95)",
            )
        sub_group_size = self.int_field(
            zero, zero_path, N.CONFIG_SUB_GROUP_SIZE, N.DEFAULT_SUB_GROUP_SIZE, 0, "runtime/zero/config.py:182"
        )
        round_robin = self.bool_field(zero, zero_path, N.CONFIG_ROUND_ROBIN, "runtime/zero/config.py:309")
        alignment = self.bool_field(zero, zero_path, N.CONFIG_PARAMETER_ALIGNMENT, "runtime/zero/config.py:317")
        offload_param = self.offload(zero, N.CONFIG_OFFLOAD_PARAM, CONFIG_CPU_OFFLOAD_PARAM)
        offload_optimizer = self.offload(zero, N.CONFIG_OFFLOAD_OPTIMIZER, N.CONFIG_LEGACY_CPU_OFFLOAD)
        self.other_zero_fields(zero, stage if stage_set else None)
        dtype = self.dtype(config)
        grad_accum = self.grad_accum_dtype(config)
        clip = self.gradient_clipping(config)
        devices = {o.device for o in (offload_param, offload_optimizer) if o is not None}
        aio = self.aio(config, swaps or stage == 3 and NVME in devices)
        return RunConfig(
            stage,
            stage_set,
            dtype,
            sub_group_size,
            round_robin,
            alignment,
            grad_accum,
            clip,
            offload_param,
            offload_optimizer,
            aio,
            dict(self.filled),
        )

    def other_zero_fields(self, zero: dict, stage: int | None) -> None:
        """The fields of ``zero_optimization`` zckpt does not use, checked as DeepSpeedZeroConfig
        checks them (:data:`ZERO_INT_FIELDS`, :data:`ZERO_BOOL_FIELDS`); a checkpoint's saved config
        passed its own release's checks and is left alone. With the stage set, the model's
        validators that depend on it (runtime/zero/config.py:389-400)."""
        path, source = f"{N.CONFIG_ZERO}.", "runtime/zero/config.py"
        if not self.saved:
            for name, alias, minimum, line in ZERO_INT_FIELDS:
                for key in self.spellings(zero, name, alias, line):
                    self.int_field(zero, path, key, 0, minimum, f"{source}:{line}")
            for name, alias, line in ZERO_BOOL_FIELDS:
                for key in self.spellings(zero, name, alias, line):
                    self.bool_field(zero, path, key, f"{source}:{line}")
            for name, line in ZERO_OPTIONAL_BOOL_FIELDS:
                self.bool_field(zero, path, name, f"{source}:{line}", optional=True)
            new = [
                k
                for k in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")
                if k in zero
            ]
            if "stage3_gather_fp16_weights_on_model_save" in zero and new:
                self.fail(
                    f"{path}stage3_gather_fp16_weights_on_model_save",
                    zero["stage3_gather_fp16_weights_on_model_save"],
                    f"DeepSpeed refuses the deprecated spelling beside {new[0]} (runtime/config_utils.py:89-91)",
                )
        if stage is None:
            return
        if (
            COMPUTE_GRAD_NORM in zero
            and not self.bool_field(zero, path, COMPUTE_GRAD_NORM, f"{source}:143")
            and stage not in (1, 2)
        ):
            self.fail(
                f"{path}{COMPUTE_GRAD_NORM}",
                zero[COMPUTE_GRAD_NORM],
                f"DeepSpeed accepts false at ZeRO stage 1 or 2 only, this run is at stage {stage} ({source}:389-393)",
            )
        if self.ratio < 1 and stage != 3:
            self.fail(
                f"{path}{N.CONFIG_OFFLOAD_OPTIMIZER}.{RATIO}",
                self.ratio,
                f"DeepSpeed offloads part of the optimizer state at ZeRO stage 3 only, this run is at stage {stage} "
                f"({source}:395-400)",
            )

    def spellings(self, zero: dict, name: str, alias: str | None, line: int) -> list[str]:
        """The spelling of a field the section uses (its name or its alias; both: refused)."""
        given = [k for k in (name, alias) if k is not None and k in zero]
        if len(given) > 1:
            self.fail(
                f"{N.CONFIG_ZERO}.{name}",
                zero[name],
                f"DeepSpeed refuses it beside its alias {alias} (one field; runtime/zero/config.py:{line})",
            )
        return given

    def offload(self, zero: dict, key: str, deprecated: str) -> ParamOffload | OptimizerOffload | None:
        """An offload section; the deprecated boolean spelling stands for ``{"device": "cpu"}``
        and may not come with the section itself (zero/config.py:188-220, config_utils.py:89-91)."""
        path = f"{N.CONFIG_ZERO}.{key}."
        section = zero.get(key)
        if deprecated in zero:
            old = zero[deprecated]
            flag = None if old is None else _lax_bool(old)
            if old is not None and flag is None:
                self.fail(
                    f"{N.CONFIG_ZERO}.{deprecated}",
                    old,
                    f"not a boolean; DeepSpeed refuses it (runtime/zero/config.py, deprecated {deprecated})",
                )
            if key in zero:
                self.fail(
                    f"{N.CONFIG_ZERO}.{deprecated}",
                    old,
                    f"DeepSpeed refuses the deprecated {deprecated} beside {key} (runtime/config_utils.py:89-91)",
                )
            section = {DEVICE: CPU} if flag else None
        if section is None:
            return None
        if not isinstance(section, dict):
            self.fail(
                path[:-1],
                section,
                "must be a JSON object or null; DeepSpeed refuses it (runtime/zero/offload_config.py)",
            )
        section = self.model(section, path)
        device = section.get(DEVICE, NONE)
        if not isinstance(device, str) or device not in OFFLOAD_DEVICES:
            self.fail(
                f"{path}{DEVICE}",
                device,
                'DeepSpeed accepts "none", "cpu" or "nvme", exactly (OffloadDeviceEnum, runtime/zero/offload_config.py:14-18)',
            )
        nvme_path = section.get(NVME_PATH)
        if nvme_path is not None and not isinstance(nvme_path, str):
            self.fail(
                f"{path}{NVME_PATH}",
                nvme_path,
                "not a path (a string); DeepSpeed refuses it (runtime/zero/offload_config.py:30)",
            )
        nvme_path = str(PurePath(nvme_path)) if nvme_path is not None else None  # pydantic's Path: "" is "."
        source = "runtime/zero/offload_config.py"
        if not self.saved:  # the fields zckpt does not use (a saved config passed its release's checks)
            self.bool_field(section, path, "pin_memory", f"{source}:{45 if key == N.CONFIG_OFFLOAD_PARAM else 75}")
            if key == N.CONFIG_OFFLOAD_OPTIMIZER:
                self.bool_field(section, path, "super_offload", f"{source}:102")
                self.float_field(section, path, "cpuadam_cores_perc", 0.8, 0.0, 1.0, f"{source}:105")
        if key == N.CONFIG_OFFLOAD_OPTIMIZER:  # the share offloaded; below 1 at ZeRO-3 only (other_zero_fields)
            self.ratio = self.float_field(section, path, RATIO, 1.0, 0.0, 1.0, f"{source}:99")
        if key == N.CONFIG_OFFLOAD_PARAM:
            return ParamOffload(
                device,
                nvme_path,
                buffer_size=self.int_field(section, path, BUFFER_SIZE, PARAM_BUFFER_SIZE_DEFAULT, 0, f"{source}:36"),
                buffer_count=self.int_field(section, path, BUFFER_COUNT, PARAM_BUFFER_COUNT_DEFAULT, 0, f"{source}:33"),
                max_in_cpu=self.int_field(section, path, MAX_IN_CPU, MAX_IN_CPU_DEFAULT, 0, f"{source}:39"),
            )
        return OptimizerOffload(
            device,
            nvme_path,
            buffer_count=self.int_field(section, path, BUFFER_COUNT, OPTIMIZER_BUFFER_COUNT_DEFAULT, 0, f"{source}:67"),
            pipeline_read=self.bool_field(section, path, PIPELINE_READ, f"{source}:84"),
            pipeline_write=self.bool_field(section, path, PIPELINE_WRITE, f"{source}:90"),
            fast_init=self.bool_field(section, path, FAST_INIT, f"{source}:96"),
        )

    def dtype(self, config: dict) -> str:
        """bf16 (spelled "bf16", else "bfloat16"), fp16, or fp32; never both (precision_config.py,
        runtime/config.py:511-512)."""
        enabled = {}
        for name, keys in (("bf16", N.CONFIG_BF16), ("fp16", (N.CONFIG_FP16,))):
            key = next(
                (k for k in keys if config.get(k) is not None), keys[-1]
            )  # "bf16": null falls back to "bfloat16"
            section = config.get(key, {})
            if not isinstance(section, dict):
                self.fail(
                    key,
                    section,
                    f"must be a JSON object; DeepSpeed fails on it (Deep{'SpeedBF16' if name == 'bf16' else 'SpeedFP16'}Config(**...), runtime/precision_config.py)",
                )
            # the Trainer fills "bf16.enabled" / "fp16.enabled", not "bfloat16.enabled"
            enabled[name] = self.bool_field(
                self.model(section, f"{key}."), f"{key}.", CONFIG_ENABLED, "runtime/precision_config.py"
            )
        if enabled["bf16"] and enabled["fp16"]:
            self.fail(
                "fp16.enabled", True, "DeepSpeed refuses bf16 and fp16 enabled together (runtime/config.py:511-512)"
            )
        return "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"

    def grad_accum_dtype(self, config: dict) -> str | None:
        data_types = config.get(N.CONFIG_DATA_TYPES, {})
        if not isinstance(data_types, dict):
            self.fail(
                N.CONFIG_DATA_TYPES,
                data_types,
                "must be a JSON object; DeepSpeed fails on it (runtime/config.py:384, 556)",
            )
        value = data_types.get(N.CONFIG_GRAD_ACCUM_DTYPE)
        if value is None:
            return None
        if not isinstance(value, str) or value not in DTYPE_SPELLINGS:
            self.fail(
                f"{N.CONFIG_DATA_TYPES}.{N.CONFIG_GRAD_ACCUM_DTYPE}",
                value,
                f"the engine refuses it at start (DtypeEnum, engine.py:1809; it takes {', '.join(sorted(DTYPE_SPELLINGS))})",
            )
        return DTYPE_SPELLINGS[value]

    def gradient_clipping(self, config: dict) -> float | None:
        """Read raw (runtime/config.py:268-269); the ZeRO optimizers compare it with 0 at every
        step (stage_1_and_2.py:3199), so it must be a number."""
        value = config.get(N.CONFIG_GRADIENT_CLIPPING)
        if value is None:
            return None
        if value == AUTO and not self.saved:
            self.filled[N.CONFIG_GRADIENT_CLIPPING] = FILLED_BY[N.CONFIG_GRADIENT_CLIPPING]
            return None
        if not isinstance(value, (int, float)):
            self.fail(
                N.CONFIG_GRADIENT_CLIPPING,
                value,
                "not a number; DeepSpeed takes it unchecked (runtime/config.py:268) and its optimizer "
                "fails comparing it with 0 at the first step (stage_1_and_2.py:3199)",
            )
        return float(value)

    def aio(self, config: dict, swaps: bool) -> Aio | None:
        """``aio`` is taken unchecked (swap_tensor/aio_config.py:20-43) and reaches the swappers
        and the async I/O op only when the run swaps; zckpt checks it then."""
        section = config.get(CONFIG_AIO)
        if section is not None and not isinstance(section, dict):
            self.fail(
                CONFIG_AIO, section, "must be a JSON object; DeepSpeed fails on it (swap_tensor/aio_config.py:24)"
            )
        if not swaps:
            return None
        section = section or {}
        block = self.aio_int(section, AIO_BLOCK_SIZE, AIO_BLOCK_SIZE_DEFAULT)
        if block % O_DIRECT_BLOCK:
            self.fail(
                f"{CONFIG_AIO}.{AIO_BLOCK_SIZE}",
                block,
                f"not a multiple of {O_DIRECT_BLOCK}: the async I/O op writes O_DIRECT in blocks of "
                "this size and every swapped tensor spans two, the second misaligned (measured: with block_size 1000 a "
                "swap-out wrote no bytes and reading it back aborted the process)",
            )
        parallelism = self.aio_int(section, AIO_INTRA_OP_PARALLELISM, AIO_INTRA_OP_PARALLELISM_DEFAULT)
        return Aio(block, parallelism)

    def aio_int(self, section: dict, key: str, default: int) -> int:
        value = section.get(key, default)
        name = f"{CONFIG_AIO}.{key}"
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(
                name,
                value,
                "not an integer; DeepSpeed passes it unchanged (swap_tensor/aio_config.py:24-29) to its swappers and "
                "async I/O op, which take a C int (deepspeed_py_io_handle.cpp:38-42): the run fails at start",
            )
        if value > C_INT_MAX:
            self.fail(
                name,
                value,
                "DeepSpeed's async I/O op takes a C int and refuses it (deepspeed_py_io_handle.cpp:38-42): the run fails at start",
            )
        if value < 1:
            self.fail(name, value, _AIO_NOT_POSITIVE[key])
        return value


# what DeepSpeed 0.19.8's async I/O op did with such values (a 1 MiB swap file written and read back, CPU, ext4)
_AIO_NOT_POSITIVE = {
    AIO_BLOCK_SIZE: "DeepSpeed passes it unchecked (swap_tensor/aio_config.py:25) to its async I/O op, which needs a positive block "
    "size: with 0 a swap-out wrote no bytes and reading it back aborted the process, with -5 it aborted (measured)",
    AIO_INTRA_OP_PARALLELISM: "DeepSpeed passes it unchecked (swap_tensor/aio_config.py:29) to its async I/O op, which starts that many "
    "I/O threads: with 0 the first swap killed the process (division by zero), with -1 it crashed (measured)",
}

"""PEFT adapters in a ZeRO checkpoint: the adapter folder PEFT writes, or LoRA merged into a base.

A PEFT run under DeepSpeed keeps only its trainable tensors in the ZeRO files (the Trainer saves
with ``exclude_frozen_parameters``), under the module's names:
``base_model.model.<module>.lora_A.<adapter>.weight``. The frozen base is not there at all.
PEFT's ``save_pretrained`` writes those tensors under other names (``get_peft_model_state_dict``
in peft 0.21): the adapter name is removed, ``modules_to_save.<adapter>.`` is dropped and DoRA's
``lora_magnitude_vector.<adapter>.weight`` loses its ``.weight``; the ``base_model.model.``
prefix stays. :func:`peft_key` applies exactly those rules, so ``PeftModel.from_pretrained``
loads zckpt's ``adapter_model.safetensors`` as it loads PEFT's own.

Merging (:func:`plan_merge`) follows peft 0.21's LoRA ``merge`` as ``merge_and_unload()`` runs it
(``safe_merge=False``), on a base loaded in the output dtype:

* Linear: ``W += transpose(B @ A, fan_in_fan_out) * scaling`` (the fp32 delta is added into W:
  computed in fp32, rounded once to W's dtype); Embedding: ``W += (transpose(B @ A, True) *
  scaling).to(W.dtype)`` (rounded, then added, as PEFT does);
* ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` and
  ``lora_alpha`` per module from ``rank_pattern``/``alpha_pattern`` (the first key matching the
  end of the module's name, as PEFT's ``get_pattern_key``);
* ``lora_bias``: ``bias += lora_B.bias * scaling``;
* tensors the run trained outright (``modules_to_save`` copies, biases with ``bias="all"`` or
  ``"lora_only"``) replace the base's before the LoRA deltas are added.

A and B are the fp32 masters (PEFT keeps adapters in fp32 by default), so the output equals
PEFT's ``merge_and_unload()`` bit for bit. Other adapter types and LoRA variants whose merge is
something else are refused with one line.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from ..core.dtypes import FP32, OUTPUT_DTYPES, DType, DTypeLike, output_dtype
from ..core.errors import CorruptFileError, LayoutError, UsageError
from ..core.index import CheckpointIndex, Entry, TensorSource
from ..core.sizes import parse_size
from ..core.untrusted import regular_file_inside
from ..hf import names as hf
from ..hf.shards import ShardItem, plan_shards
from ..io.materialize import StreamWriter, read_tensor, write_all
from ..io.output import StagedOutput
from ..io.reading import FileReader, read_json_object
from .formats import SAFETENSORS, OutputFormat, find_format, safetensors_header, weights_format, write_safetensors
from .weights_folder import (
    ConsolidationResult,
    PlannedFile,
    Progress,
    byte_counter,
    index_text,
    plan_consolidation,
    write_consolidated,
    write_extra_files,
    write_staged,
    write_text,
)

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."  # PeftModel's path to the base model's modules (kept in adapter files)
LORA = "LORA"
# PEFT's prompt-learning types keep no per-module tensors; their file holds `prompt_embeddings`
PROMPT_LEARNING = ("PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "ADAPTION_PROMPT", "CPT")
# LoRA options whose merge is not "W += scaled B @ A", or that leave it to the model structure
MERGE_REFUSED_OPTIONS = {
    "use_dora": "DoRA",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "aLoRA",
    "arrow_config": "Arrow",
    "use_bdlora": "BD-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "target_parameters": "LoRA on nn.Parameter (target_parameters)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
# init_lora_weights that rewrite the base weights when the adapter is made (or select a variant):
# the adapter only merges into that rewritten base, which the checkpoint does not hold
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga", "mica")
# the per-module tensor names of PEFT's adapter layers, the adapter name after them
_ADAPTER_PART = re.compile(
    r"\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|modules_to_save|lora_[A-Za-z]+|ia3_l|hada_w\w*|lokr_w\w*|oft_\w+|boft_\w+|vera_lambda_\w+)\.([^.]+)(?:\.|$)"
)


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter in a checkpoint: its adapter_config.json (None with ``--peft`` and no
    config), the adapter's name in the module, and its tensors under PEFT's file names."""

    config_path: str | None
    config: dict[str, Any]
    name: str
    tensors: tuple[tuple[str, Entry], ...]  # (PEFT's key, the checkpoint's entry)

    @property
    def peft_type(self) -> str | None:
        return self.config.get("peft_type")


def peft_key(name: str, adapter: str) -> str:
    """The key PEFT's save_pretrained writes for the module tensor `name` of `adapter`.

    >>> peft_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "default")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    >>> peft_key("base_model.model.model.norm.modules_to_save.default.weight", "default")
    'base_model.model.model.norm.weight'
    >>> peft_key("base_model.model.embed.lora_embedding_B.default", "default")
    'base_model.model.embed.lora_embedding_B'
    >>> peft_key("base_model.model.fc.lora_magnitude_vector.default.weight", "default")
    'base_model.model.fc.lora_magnitude_vector'
    >>> peft_key("base_model.model.default.fc.bias", "default")  # a module named like the adapter
    'base_model.model.default.fc.bias'
    """
    key = name.replace(f".modules_to_save.{adapter}.", ".", 1)  # ModulesToSaveWrapper.adapter_state_dict
    if key.endswith(f".lora_magnitude_vector.{adapter}.weight"):  # LoraModel._get_adapter_state_dict (DoRA)
        key = key.removesuffix(".weight")
    # BaseTuner._remove_adapter_name_from_key: the adapter name at the end, or just before the last part
    if "." not in key:
        return key
    if key.endswith(f".{adapter}"):
        return key.removesuffix(f".{adapter}")
    head, _, suffix = key.rpartition(".")
    return f"{re.sub(re.escape('.' + adapter) + '$', '', head)}.{suffix}"


def read_adapter_config(path: str) -> dict[str, Any]:
    return read_json_object(path, "adapter config")


def adapter_names(names: list[str]) -> list[str]:
    """The adapter names that PEFT layer tensors among `names` carry (``default`` usually; none in
    the keys of PEFT's own files, ``lora_A.weight``)."""
    return sorted({m[1] for n in names if (m := _ADAPTER_PART.search(n)) and m[1] not in ("weight", "bias")})


def find_adapter(index: CheckpointIndex, peft: bool | None = None) -> Adapter | None:
    """The PEFT adapter of a checkpoint: there when adapter_config.json lies beside the tag
    folders (or `peft` is True); None when there is none or `peft` is False."""
    config_path = os.path.join(index.checkpoint_dir, hf.ADAPTER_CONFIG_FILE)
    has_config = regular_file_inside(config_path, index.checkpoint_dir)
    if peft is False or (peft is None and not has_config):
        return None
    config = read_adapter_config(config_path) if has_config else {}
    where = config_path if has_config else index.tag_dir
    peft_type = config.get("peft_type")
    if has_config and peft_type != LORA:
        raise LayoutError(
            config_path,
            f"adapter type {peft_type} is not supported (zckpt writes and merges LoRA adapters); pass --no-peft for the raw tensors under their training names",
        )
    trainable = [e for e in index.entries if e.kind == "param"]
    found = adapter_names([e.name for e in trainable])
    if not found:
        raise LayoutError(
            where,
            "no LoRA tensor (lora_A.<adapter>, ...) among the checkpoint's trainable params: not a PEFT run's checkpoint; pass --no-peft",
        )
    if len(found) > 1:
        raise LayoutError(
            where,
            f"holds {len(found)} adapters ({', '.join(found)}); zckpt writes one adapter at a time, pass --no-peft for the raw tensors",
        )
    tensors = tuple((peft_key(e.name, found[0]), e) for e in trainable)
    keys = [k for k, _ in tensors]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise LayoutError(where, f"two trainable params map to PEFT key {twice}")
    return Adapter(config_path if has_config else None, config, found[0], tensors)


def describe_adapter(checkpoint_dir: str, trainable: list[str]) -> dict[str, Any] | None:
    """What ``inspect`` reports of a checkpoint's PEFT adapter (None without adapter_config.json);
    a bad config raises CorruptFileError."""
    config_path = os.path.join(checkpoint_dir, hf.ADAPTER_CONFIG_FILE)
    if not regular_file_inside(config_path, checkpoint_dir):
        return None
    config = read_adapter_config(config_path)
    found = adapter_names(trainable)
    lora = [n for n in trainable if re.search(r"\.lora_(?:A|B|embedding_A|embedding_B)(\.|$)", n)]
    report: dict[str, Any] = {
        "config": config_path,
        "type": config.get("peft_type"),
        "adapter_names": found,
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "use_rslora": bool(config.get("use_rslora")),
        "rank_pattern": config.get("rank_pattern") or {},
        "alpha_pattern": config.get("alpha_pattern") or {},
        "target_modules": config.get("target_modules"),
        "modules_to_save": config.get("modules_to_save"),
        "base_model": config.get("base_model_name_or_path"),
        "lora_tensors": len(lora),
        "other_tensors": len(trainable) - len(lora),
    }
    refused = merge_refusal(config)
    report["mergeable"] = refused is None
    if refused:
        report["not_mergeable_because"] = refused
    return report


def merge_refusal(config: dict[str, Any]) -> str | None:
    """Why this adapter cannot be merged with LoRA's rule, or None."""
    peft_type = config.get("peft_type")
    if peft_type != LORA:
        return f"adapter type {peft_type} (LoRA only)"
    for option, what in MERGE_REFUSED_OPTIONS.items():
        if config.get(option):
            return f"{what} ({option} is set): its merge is not LoRA's"
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        return f"init_lora_weights={init!r} rewrote the base weights when the adapter was made; merge into that rewritten base with PEFT"
    return None


def pattern_key(keys: list[str], module: str) -> str:
    """PEFT's get_pattern_key: the first pattern matching the end of `module` (at a dot), else `module`.

    >>> pattern_key(["v_proj", "layers.1.self_attn.q_proj"], "model.layers.1.self_attn.q_proj")
    'layers.1.self_attn.q_proj'
    """
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


# --- the adapter folder ---------------------------------------------------------------------------


def write_adapter(
    index: CheckpointIndex,
    adapter: Adapter,
    output_dir: str,
    *,
    dtype: DTypeLike | None,
    format: "OutputFormat",
    overwrite: bool,
    progress: "Progress | None",
    verify: bool,
    wait: bool = False,
) -> "ConsolidationResult":
    """PEFT's adapter folder: ``adapter_model.safetensors`` (``.bin`` with format torch) under
    PEFT's keys, in fp32 by default (the masters), beside the adapter's config, model card and
    the tokenizer files the Trainer saved."""
    renamed = tuple(replace(entry, name=key) for key, entry in adapter.tensors)
    plan = plan_consolidation(
        replace(index, entries=renamed), dtype=FP32 if dtype is None else dtype, format=format, max_shard_size=1 << 62
    )
    name = weights_format(format).adapter_file
    tensors = tuple(t for f in plan.files for t in f.tensors)
    extra = hf.files_to_copy(index.checkpoint_dir, hf.ADAPTER_FILES)
    plan = replace(
        plan,
        files=(PlannedFile(name, tensors),),
        index_file=None,
        weight_map={t.name: name for t in tensors},
        extra_files=extra,
    )
    result = write_consolidated(
        index, plan, output_dir, overwrite=overwrite, progress=progress, verify=verify, wait=wait
    )
    return replace(result, dtype=plan.dtype, peft="adapter")


# --- merging into a base model ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoraDelta:
    """``transpose(B @ A, transpose) * scaling`` added to a base weight (or ``lora_B.bias *
    scaling`` to a base bias, `a` None); `round_first`: rounded to the weight's dtype before
    the add (PEFT's Embedding)."""

    module: str
    b: TensorSource
    a: TensorSource | None
    scaling: float
    transpose: bool = False
    round_first: bool = False


@dataclass(frozen=True)
class MergedTensor:
    name: str
    dtype: DType  # output dtype
    shape: tuple[int, ...]
    source: TensorSource  # the base's tensor
    replacement: TensorSource | None = None  # the trained value (modules_to_save, trained biases)
    delta: LoraDelta | None = None

    @property
    def nbytes(self) -> int:
        return self.source.numel * self.dtype.itemsize

    @property
    def changed(self) -> bool:
        return self.replacement is not None or self.delta is not None


@dataclass(frozen=True)
class MergePlan:
    base_dir: str
    files: tuple[tuple[str, tuple[MergedTensor, ...]], ...]
    index_file: str | None
    weight_map: dict[str, str]
    total_size: int
    dtype: DType
    extra_files: tuple[str, ...]  # the base folder's config/tokenizer files
    merged_modules: tuple[str, ...] = field(default=())
    replaced: tuple[str, ...] = field(default=())

    @property
    def bytes_to_write(self) -> int:
        return sum(t.nbytes for _, tensors in self.files for t in tensors)


def plan_merge(
    adapter: Adapter, base_dir: str, *, dtype: DTypeLike | None = None, max_shard_size: str | int = "5GB"
) -> MergePlan:
    """Which base tensor each adapter tensor changes, and how; reads only adapter_config.json
    and the base's safetensors headers."""
    if adapter.config_path is None:
        raise UsageError(
            None,
            f"--merge-into needs the adapter's {hf.ADAPTER_CONFIG_FILE} beside the checkpoint (for r, lora_alpha and the rest)",
        )
    config, where = adapter.config, adapter.config_path
    if refused := merge_refusal(config):
        raise LayoutError(where, f"cannot merge: {refused}")
    limit = parse_size(max_shard_size)
    base = hf.model_weights(base_dir)
    shapes = {name: source.shape for name, source in base}
    target = _default_dtype(base) if dtype is None else output_dtype(dtype)

    replacements: dict[str, TensorSource] = {}
    parts: dict[str, dict[str, Entry]] = {}  # module -> {"lora_A.weight": entry, ...}
    for key, entry in adapter.tensors:
        if not key.startswith(PEFT_PREFIX):
            raise LayoutError(
                where, f"{entry.name}: not under PEFT's {PEFT_PREFIX} prefix, so no base tensor is known for it"
            )
        path = key[len(PEFT_PREFIX) :]
        match = re.fullmatch(
            r"(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_A|lora_embedding_B)", path
        )
        if match:
            parts.setdefault(match[1], {})[match[2]] = entry
        elif re.search(r"(^|\.)(lora_\w+|token_adapter)(\.|$)", path):
            raise LayoutError(where, f"cannot merge {entry.name}: only LoRA's A/B matrices (and lora_B's bias) merge")
        else:  # trained outright: replaces the base tensor of that name
            base_name = path.replace(".base_layer.", ".")
            _check_target(base_dir, shapes, base_name, entry.source.shape, f"trained {entry.name}")
            replacements[base_name] = entry.source

    deltas: dict[str, LoraDelta] = {}
    for module, found in parts.items():
        for delta_target, delta in _module_deltas(module, found, config, where):
            if delta_target in deltas:
                raise LayoutError(where, f"two LoRA deltas for {delta_target}")
            deltas[delta_target] = delta
    for name, delta in deltas.items():
        _check_target(base_dir, shapes, name, _delta_shape(delta), f"the LoRA of {delta.module}")

    merged = [
        MergedTensor(
            name,
            target if source.dtype.is_floating else source.dtype,
            source.shape,
            source,
            replacements.get(name),
            deltas.get(name),
        )
        for name, source in base
    ]
    by_name = {t.name: t for t in merged}
    shards = plan_shards([ShardItem(t.name, t.nbytes) for t in merged], limit, SAFETENSORS.pattern)
    files = tuple((filename, tuple(SAFETENSORS.order([by_name[n] for n in names]))) for filename, names in shards.files)
    extra = hf.files_to_copy(base_dir, hf.MODEL_FILES)
    return MergePlan(
        base_dir=base_dir,
        files=files,
        index_file=SAFETENSORS.index_file if shards.is_sharded else None,
        weight_map=shards.weight_map(),
        total_size=shards.total_size,
        dtype=target,
        extra_files=extra,
        merged_modules=tuple(sorted({d.module for d in deltas.values()})),
        replaced=tuple(sorted(replacements)),
    )


def _default_dtype(base: list[tuple[str, TensorSource]]) -> DType:
    """The base's own dtype (that of its floating tensors), so the merged model is what
    merge_and_unload gives on the base as loaded; fp32 when they mix dtypes."""
    dtypes = {s.dtype for _, s in base if s.dtype.is_floating}
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in OUTPUT_DTYPES.values() else FP32


def _module_deltas(
    module: str, found: dict[str, Entry], config: dict[str, Any], where: str
) -> list[tuple[str, LoraDelta]]:
    """The LoRA deltas of one module: its weight's (and its bias's with lora_bias)."""
    embedding = "lora_embedding_A" in found or "lora_embedding_B" in found
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
    if a_key not in found or b_key not in found:
        raise LayoutError(
            where, f"{module}: the checkpoint holds {', '.join(sorted(found))} but not both LoRA matrices"
        )
    a, b = found[a_key].source, found[b_key].source
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise LayoutError(
            where, f"{module}: LoRA of a {len(a.shape)}-D layer (a convolution) is not merged by zckpt; merge with PEFT"
        )
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r = rank_pattern.get(pattern_key(list(rank_pattern), module), config.get("r"))
    alpha = alpha_pattern.get(pattern_key(list(alpha_pattern), module), config.get("lora_alpha"))
    if (
        not isinstance(r, int)
        or isinstance(r, bool)
        or r < 1
        or not isinstance(alpha, (int, float))
        or isinstance(alpha, bool)
    ):
        raise CorruptFileError(where, f"{module}: r={r!r}, lora_alpha={alpha!r} are not a positive rank and a number")
    if a.shape[0] != r or b.shape[1] != r:
        raise LayoutError(
            where,
            f"{module}: r is {r} here, but its LoRA matrices have shapes {list(a.shape)} and {list(b.shape)}: config and checkpoint do not belong together",
        )
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # LoraLayer.update_layer
    out = [
        (
            f"{module}.weight",
            LoraDelta(
                module, b, a, scaling, transpose=embedding or bool(config.get("fan_in_fan_out")), round_first=embedding
            ),
        )
    ]
    if "lora_B.bias" in found:
        out.append((f"{module}.bias", LoraDelta(module, found["lora_B.bias"].source, None, scaling)))
    return out


def _delta_shape(delta: LoraDelta) -> tuple[int, ...]:
    if delta.a is None:
        return delta.b.shape
    rows, cols = delta.b.shape[0], delta.a.shape[1]
    return (cols, rows) if delta.transpose else (rows, cols)


def _check_target(
    base_dir: str, shapes: dict[str, tuple[int, ...]], name: str, shape: tuple[int, ...], what: str
) -> None:
    if name not in shapes:
        raise LayoutError(
            base_dir,
            f"has no tensor {name} for {what}: not the base this adapter was trained on, or {name} is tied to another weight (absent from the files, so not mergeable)",
        )
    if shapes[name] != tuple(shape):
        raise LayoutError(
            base_dir,
            f"{name} has shape {list(shapes[name])}, {what} has {list(shape)}: not the base this adapter was trained on",
        )


def write_merged(
    index: CheckpointIndex,
    plan: MergePlan,
    output_dir: str,
    *,
    overwrite: bool,
    progress: "Progress | None",
    verify: bool,
    wait: bool = False,
) -> "ConsolidationResult":
    """Execute a merge plan: the base streamed tensor by tensor into staged files (unchanged
    tensors copied, changed ones computed one at a time), then moved into place."""
    names = (
        [f for f, _ in plan.files]
        + ([plan.index_file] if plan.index_file else [])
        + [os.path.basename(p) for p in plan.extra_files]
    )
    total = plan.bytes_to_write
    advance = byte_counter(progress, total)
    with (
        StagedOutput(output_dir, names, overwrite=overwrite, needed_bytes=total, wait=wait) as staged,
        FileReader(verify=verify) as reader,
    ):
        loras: dict[TensorSource, "torch.Tensor"] = {}  # the adapter's fp32 masters (small), read once
        for filename, tensors in plan.files:
            write_staged(
                staged,
                output_dir,
                filename,
                lambda path, t=tensors: _write_merged_file(path, t, reader, loras, advance),
            )
        if plan.index_file:
            write_staged(
                staged,
                output_dir,
                plan.index_file,
                lambda path: write_text(path, index_text(plan.total_size, plan.weight_map)),
            )
        write_extra_files(staged, output_dir, plan.extra_files, plan.dtype)
        reader.verify_now()  # before anything is moved into place
        staged.commit()
    return ConsolidationResult(
        output_dir, tuple(names), len(plan.weight_map), total, index, dtype=plan.dtype, peft="merged"
    )


def _write_merged_file(
    path: str, tensors: tuple[MergedTensor, ...], reader: FileReader, loras: dict, advance: Callable[[int], None]
) -> None:
    import torch

    writer = StreamWriter(reader, advance)

    def write_tensor(fd: int, tensor: MergedTensor) -> None:
        if not tensor.changed:
            writer.write(fd, tensor.source, tensor.dtype)
            return
        value = merged_value(tensor, reader, loras)
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy()
        write_all(fd, memoryview(raw))
        advance(raw.nbytes)

    write_safetensors(path, safetensors_header(tensors, {}), tensors, write_tensor)  # type: ignore[arg-type]


def merged_value(tensor: MergedTensor, reader: FileReader, loras: dict | None = None) -> "torch.Tensor":
    """One changed tensor, as PEFT's merge leaves it in a model loaded in the output dtype."""
    import torch

    loras = {} if loras is None else loras

    def master(source: TensorSource) -> torch.Tensor:
        if source not in loras:
            loras[source] = read_tensor(reader, source, FP32)
        return loras[source]

    # the base tensor as loading it in the output dtype gives it (widened exactly, or rounded)
    value = read_tensor(reader, tensor.replacement or tensor.source, tensor.dtype)  # a fresh tensor
    delta = tensor.delta
    if delta is not None:
        with torch.no_grad():
            if delta.a is None:  # lora_bias: bias.data += lora_B.bias * scaling
                step = master(delta.b) * delta.scaling
            else:
                product = master(delta.b) @ master(delta.a)
                step = (product.T if delta.transpose else product) * delta.scaling
            value += step.to(value.dtype) if delta.round_first else step
    return value


# --- the entry point consolidate() calls ---------------------------------------------------------


def consolidate_peft(
    index: CheckpointIndex,
    output_dir: str,
    *,
    peft: bool | None,
    merge_into: str | os.PathLike[str] | None,
    dtype: DTypeLike | None,
    format: "OutputFormat",
    max_shard_size: str | int,
    overwrite: bool,
    progress: "Progress | None",
    verify: bool,
    wait: bool = False,
) -> "ConsolidationResult | None":
    """The adapter folder, or with `merge_into` the merged model; None when the checkpoint is
    not a PEFT run's (and neither `peft` nor `merge_into` asks for one)."""
    if merge_into is not None and peft is False:
        raise UsageError(None, "--merge-into merges a PEFT adapter; it cannot go with --no-peft")
    adapter = find_adapter(index, True if merge_into is not None else peft)
    if adapter is None:
        return None
    if merge_into is None:
        return write_adapter(
            index,
            adapter,
            output_dir,
            dtype=dtype,
            format=format,
            overwrite=overwrite,
            progress=progress,
            verify=verify,
            wait=wait,
        )
    if find_format(format) is not SAFETENSORS:
        raise UsageError(None, "--merge-into writes safetensors; --format torch is not supported with it")
    base_dir = os.fspath(merge_into)
    if os.path.realpath(base_dir) == os.path.realpath(output_dir):
        raise UsageError(
            output_dir, "is the base model folder given to --merge-into; write the merged model to another folder"
        )
    plan = plan_merge(adapter, base_dir, dtype=dtype, max_shard_size=max_shard_size)
    return write_merged(index, plan, output_dir, overwrite=overwrite, progress=progress, verify=verify, wait=wait)

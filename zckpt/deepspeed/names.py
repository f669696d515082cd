"""DeepSpeed's file names and state-dict keys: the one place zckpt spells them.

Read from DeepSpeed 0.14 - 0.19 (``deepspeed/checkpoint/constants.py``, ``runtime/engine.py``)
and checked against files it wrote (see sample_ckpts/FORMAT_OBSERVED.md).
"""

from __future__ import annotations

import os
import re

from ..core.topology import RankCoords
from ..core.untrusted import path_component

# --- files -------------------------------------------------------------------------------------
LATEST_FILE = "latest"
LATEST_UNIVERSAL_FILE = "latest_universal"  # names the universal folder, beside `latest`
BF16_PREFIX = "bf16_"
OFFLOADED_TENSORS_DIR = "offloaded_tensors"


# The rank files of a save (DeepSpeed 0.19.8, engine._get_ckpt_name & co). `mp` is the
# model-parallel rank: the tensor rank, or stage * tp + tensor rank in a pipeline run.
MODEL_STATES_RE = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
OPTIM_STATES_RE = re.compile(r"^(?P<prefix>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
# pipeline runs (PipelineModule.ckpt_layer_path): one file per layer, per tensor rank when the
# topology has a model axis
LAYER_STATES_RE = re.compile(r"^layer_(?P<layer>\d+)(?:-model_(?P<tp>\d+))?-model_states\.pt$")
# mixture of experts: one file per expert (per MoE layer in newer releases), and the experts'
# optimizer files per expert-parallel rank
EXPERT_STATES_RE = re.compile(
    r"^(?:layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$"
)
# a native MoE expert param's name: its (local or global) expert id
EXPERT_ID_RE = re.compile(r"(?<=\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(?=\.)")


def expert_id(name: str) -> tuple[str, int] | None:
    """A native MoE expert param's module prefix (the name up to its expert id) and expert id;
    None for any other name."""
    found = EXPERT_ID_RE.search(name)
    return (name[: found.start()], int(found[1])) if found else None


def with_expert_id(name: str, expert: int) -> str:
    """An expert param's name with another expert id (a local id made global, or back)."""
    return EXPERT_ID_RE.sub(str(expert), name, count=1)


EXPERT_OPTIM_STATES_RE = re.compile(r"^expp_rank_(?P<ep>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")


# DeepSpeed's name of a native MoE layer's expert group, and of its param group (MoE.expert_group_name)
EXPERT_GROUP_PREFIX = "ep_size_"


def expert_optim_states_name(ep_rank: int, mp_rank: int = 0) -> str:
    """A ZeRO-0 mixture-of-experts run's optimizer file of one expert rank."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_states_name(zero_stage: int, dp_rank: int = 0, mp_rank: int = 0) -> str:
    """ZeRO-1/2 keep one model-states file per model-parallel rank; ZeRO-3 one per dp rank too."""
    if zero_stage >= 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    return f"{BF16_PREFIX if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def rank_model_states_name(zero_stage: int, coords: RankCoords) -> str:
    """The model-states file of the rank at `coords` (ZeRO-1/2: the one file of its tensor rank)."""
    return model_states_name(zero_stage, _data_parallel(coords).data, coords.tensor)


def rank_optim_states_name(coords: RankCoords, bf16: bool = False) -> str:
    """The optimizer-states file of the rank at `coords`."""
    return optim_states_name(_data_parallel(coords).data, coords.tensor, bf16)


def _data_parallel(coords: RankCoords) -> RankCoords:
    """Pipeline stages and experts name their files otherwise (layer and expert files)."""
    if coords.pipe or coords.expert:
        raise ValueError(f"{coords}: a pipeline stage's or an expert's files are not named by rank")
    return coords


def layer_states_name(layer: int, tp_rank: int | None = None) -> str:
    """A pipeline run's file of one layer (of one tensor rank when tp > 1)."""
    return (
        f"layer_{layer:02d}-model_states.pt"
        if tp_rank is None
        else f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"
    )


def layer_states_index(name: str) -> int | None:
    """The global layer number a layer file's name carries; None for any other name."""
    match = LAYER_STATES_RE.match(name)
    return int(match["layer"]) if match else None


def layer_of(name: str) -> int | None:
    """The layer index a pipeline param name starts with (``4.up.weight`` -> 4); None for tied
    ones (``tied_modules.<key>.<name>``)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


SWAP_SUFFIX = ".tensor.swp"


def swap_file_name(
    first_ds_id: int, last_ds_id: int, state: str | None = None, where: str | os.PathLike[str] | None = None
) -> str:
    """NVMe swap file of a ZeRO-3 optimizer sub-group, named by the ds_id of its first and last
    param: ``3_7.tensor.swp`` (fp32 master), ``exp_avg-3_7.tensor.swp`` (an Adam state). A state
    name comes from the checkpoint (`where`: the input holding it, for the message), so it must
    be one plain path component."""
    prefix = "" if state is None else path_component(state, where, "optimizer state name") + "-"
    return f"{prefix}{first_ds_id}_{last_ds_id}{SWAP_SUFFIX}"


def swap_gradient_file_name(first_ds_id: int, last_ds_id: int, offset: int, numel: int) -> str:
    """NVMe swap file of `numel` fp32 gradient elements of a sub-group, from element `offset` of
    its partition: ``3_7_gradient_0_1048576.tensor.swp`` (optimizer_utils.get_or_create_gradient_paths)."""
    return f"{first_ds_id}_{last_ds_id}_gradient_{offset}_{numel}{SWAP_SUFFIX}"


def swap_param_file_name(ds_id: int) -> str:
    """NVMe swap file of one param's partition: ``7_param.tensor.swp``
    (partitioned_param_swapper._get_swap_paths)."""
    return f"{ds_id}_param{SWAP_SUFFIX}"


def swap_params_dir(dtype_name: str) -> str:
    """The live swap folder of params of torch dtype `dtype_name` (``bfloat16params``)."""
    return f"{dtype_name}params"


def swap_rank_dir(dp_rank: int) -> str:
    """``rank3``-style folder of one rank's files in a live swap folder (not zero-padded, unlike
    offloaded_tensors/)."""
    return f"rank{dp_rank}"


def offloaded_rank_dir(dp_rank: int) -> str:
    """``rank00``-style folder of one rank's NVMe swap files inside offloaded_tensors/."""
    return f"rank{dp_rank:02d}"


# --- universal checkpoints (ds_to_universal's layout, read by "load_universal") -----------------
UNIVERSAL_SUFFIX = "_universal"  # <tag>_universal: the folder ds_to_universal is usually given
UNIVERSAL_ZERO_DIR = "zero"  # zero/<param name>/<state>.pt, zero/optimizer_state.pt
UNIVERSAL_OPTIMIZER_STATE = "optimizer_state.pt"
UNIVERSAL_FP32 = "fp32"  # the master's file stem; other stems are optimizer state names
UNIVERSAL_STEP = "step"  # ZeRO-1/2 flavour: the param group's step, one file per param
UNIVERSAL_EXP_AVG = "exp_avg"  # the two states ZeRO-3's universal loader reads beside fp32
UNIVERSAL_EXP_AVG_SQ = "exp_avg_sq"
UNIVERSAL_PARAM = "param"  # ZeRO-1/2 flavour files hold {"cat_dim": 0, "param": tensor}
UNIVERSAL_CAT_DIM = "cat_dim"
PARAM_GROUPS = "param_groups"


def universal_tag(tag: str) -> str:
    """The universal folder of a tag: ``global_step10`` -> ``global_step10_universal``."""
    return tag if tag.endswith(UNIVERSAL_SUFFIX) else tag + UNIVERSAL_SUFFIX


def universal_param_dir(param: str, where: str | os.PathLike[str] | None) -> str:
    """``zero/<param name>`` inside a universal folder. The name comes from the checkpoint
    (`where`: the input naming it, for the message) and must be one plain path component: torch
    lets a module name hold '/', and DeepSpeed's ds_to_universal then nests folders
    (``zero/a/b.weight``, see tests/test_interop/test_interop_untrusted.py); zckpt refuses such a name."""
    return f"{UNIVERSAL_ZERO_DIR}/{path_component(param, where, 'param name')}"


def universal_state_file(param: str, state: str, where: str | os.PathLike[str] | None) -> str:
    """``zero/<param name>/<state>.pt`` inside a universal folder (both names checked, as above)."""
    return f"{universal_param_dir(param, where)}/{path_component(state, where, 'optimizer state name')}.pt"


# --- model_states keys -------------------------------------------------------------------------
MODULE = "module"
BUFFER_NAMES = "buffer_names"
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"
GLOBAL_STEPS = "global_steps"
GLOBAL_SAMPLES = "global_samples"
SKIPPED_STEPS = "skipped_steps"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATA_SAMPLER = "data_sampler"
RANDOM_LTD = "random_ltd"
SPARSE_TENSOR_MODULE_NAMES = "sparse_tensor_module_names"  # DeepSpeed < 0.15
CHECKPOINT_PARALLEL_DIMENSIONS = "checkpoint_parallel_dimensions"  # DeepSpeed >= 0.15
NUM_EXPERTS = "num_experts"  # a mixture-of-experts run: experts per MoE layer
DS_AUTOEP_LAYERS = "ds_autoep_layers"  # a mixture-of-experts run, DeepSpeed >= 0.19
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # a model's merge rules (AutoTP, Megatron)
# its keys (deepspeed/checkpoint/constants.py): AutoTP's exact map, Megatron's merge patterns
AFFINE_MAP = "affine_map"
UNIVERSAL_CHECKPOINT_VERSION = "universal_checkpoint_version"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"  # per pattern, per sub-param, each rank's width
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PADDED_VOCAB_SIZE = "padded_vocab_size"
# what ds_to_universal writes beside a merged tensor, for the loader to cut it again
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"  # a SubparamShape (patterns, shape, partition_dim)
SUBPARAM_SHAPE_CLASS = ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape")
VOCAB_TENSOR = "vocab_tensor"
# an expert param's universal files: its copies on the expert ranks stacked on a new dim 0, which
# DeepSpeed's loader slices by the loading rank's expert-parallel rank (universal_checkpoint.py)
EP_IS_EXPERT_PARAM = "is_expert_param"
EP_NUM_EXPERTS = "ep_num_experts"
MEGATRON_PATTERN_KEYS = (
    VOCABULARY_PARAMETER_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    PARAMETER_TO_AVERAGE_PATTERNS,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_SUB_PARAMS,
)

# --- optim_states keys -------------------------------------------------------------------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # ZeRO-1/2
FP32_FLAT_GROUPS = "fp32_flat_groups"  # ZeRO-3
BASE_OPTIMIZER_STATE = "base_optimizer_state"  # ZeRO-1/2
GROUP_PADDINGS = "group_paddings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # DeepSpeed >= 0.18
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
ZERO12_PER_GROUP_KEYS = (
    SINGLE_PARTITION_OF_FP32_GROUPS,
    GROUP_PADDINGS,
    PARAM_ALIGNMENT_PADDINGS,
    PARTITION_COUNT,
    PARAM_SLICE_MAPPINGS,
)
LOSS_SCALER = "loss_scaler"
DYNAMIC_LOSS_SCALE = "dynamic_loss_scale"
OVERFLOW = "overflow"
CLIP_GRAD = "clip_grad"

# --- ds_config keys ----------------------------------------------------------------------------
CONFIG_ZERO = "zero_optimization"
CONFIG_STAGE = "stage"
CONFIG_OFFLOAD_OPTIMIZER = "offload_optimizer"
CONFIG_OFFLOAD_PARAM = "offload_param"
CONFIG_LEGACY_CPU_OFFLOAD = "cpu_offload"
CONFIG_SUB_GROUP_SIZE = "sub_group_size"
CONFIG_ROUND_ROBIN = "round_robin_gradients"
CONFIG_PARAMETER_ALIGNMENT = "parameter_alignment"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeedZeroConfig's default
CONFIG_BF16 = ("bf16", "bfloat16")
CONFIG_FP16 = "fp16"
CONFIG_GRADIENT_CLIPPING = "gradient_clipping"
CONFIG_DATA_TYPES = "data_types"
CONFIG_GRAD_ACCUM_DTYPE = "grad_accum_dtype"
CONFIG_OFFLOAD_DEVICE = "device"
OFFLOAD_DEVICE_NVME = "nvme"
CONFIG_AIO = "aio"  # swap_tensor/constants.py
CONFIG_AIO_BLOCK_SIZE = "block_size"
CONFIG_AIO_INTRA_OP_PARALLELISM = "intra_op_parallelism"


def version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a DeepSpeed version string such as ``0.19.8+cpu``."""
    parts = [int(p) if p.isdigit() else 0 for p in (text.split("+")[0].split(".") + ["0", "0"])[:2]]
    return parts[0], parts[1]


def default_gradient_clipping(version: tuple[int, int]) -> float:
    """The engine's gradient_clipping when the config sets none: 0.0 in the 0.14 files we
    have, 1.0 in 0.19 (``GRADIENT_CLIPPING_DEFAULT``); taken to change at 0.15."""
    return 1.0 if version >= (0, 15) else 0.0

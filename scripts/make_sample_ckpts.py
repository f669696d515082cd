#!/usr/bin/env python3
"""Regenerate the DeepSpeed ZeRO checkpoint fixtures under ``sample_ckpts/``.

This one file is both

* the **driver** (default mode, stdlib only): for every case it launches
  ``python -m torch.distributed.run`` with the right virtualenv's python, removes the
  DeepSpeed code DeepSpeed copies into the checkpoint folder, runs DeepSpeed 0.19's own
  ``zero_to_fp32`` on the result and writes ``meta.json``; and
* the **per-rank worker** (``--worker --case NAME --outdir DIR``, started by torchrun):
  builds a tiny seeded model, trains a few optimizer steps with real DeepSpeed (CPU, gloo),
  captures the live fp32 masters / Adam states / frozen params / buffers and saves the
  checkpoint.

Usage::

    python scripts/make_sample_ckpts.py                       # every case
    python scripts/make_sample_ckpts.py --only z2_fp32_ws1    # just some
    python scripts/make_sample_ckpts.py --describe FILE.pt    # print pickle GLOBALs + keys

The ``--describe`` mode needs torch and deepspeed, so run it with a venv's python.
"""

from __future__ import annotations

import argparse
import json
import os
import pickletools
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_torchrun import launcher  # noqa: E402  (torchrun, or the test suite's faster fork of it)
from shm_leaks import removing_shm_leaks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PY = {"ds19": "/work/venv-ds19/bin/python", "ds14": "/work/venv-ds14/bin/python"}
SEED = 1234
MICRO_BATCH = 2
SEQ_LEN = 5
VOCAB = 23
DIM = 37
HIDDEN = 19
# stands for the NVMe swap folder in a case's config; the driver makes a temp dir per run
# (outside the repository), passes it to the workers in $ZCKPT_NVME_PATH and removes it after
NVME_PATH = "@NVME_PATH@"


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One fixture: a DeepSpeed release, a ZeRO configuration and optional model features."""

    name: str
    release: str  # "ds19" | "ds14"
    stage: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    world_size: int
    tied: bool = False  # lm_head.weight is embed.weight
    frozen: bool = False  # the `adapter` sub-module has requires_grad=False
    # the adapter sub-module's name: torch allows '/' in it (an interop test checks what
    # DeepSpeed's universal tools do with such param names)
    adapter_name: str = "adapter"
    groups: bool = False  # two param groups (decay / no-decay, different lr)
    sub_group_size: int | None = None  # ZeRO-3 sub_group_size (None: DeepSpeed default)
    persistence_threshold: int | None = 0  # ZeRO-3 stage3_param_persistence_threshold
    save_steps: tuple[int, ...] = (3,)  # save a checkpoint after each of these steps
    checkpoint: str = "checkpoint"  # folder (inside the case dir) given to save_checkpoint
    hf_trainer: bool = False  # write HF Trainer-like extras next to the DeepSpeed files
    scheduler: bool = False  # configure a DeepSpeed WarmupLR scheduler
    zero_extra: tuple[tuple[str, Any], ...] = ()  # extra zero_optimization options
    config_extra: tuple[tuple[str, Any], ...] = ()  # extra top-level DeepSpeed config options
    # take live trainable values from the module params instead of safe_get_full_fp32_param
    # (only exact for fp32 runs) and skip the live optimizer states
    live_from_module: str = ""  # non-empty: the reason
    grad_accum_fp32: bool = False  # data_types.grad_accum_dtype=fp32: bf16 + ZeRO-1 then uses BF16_Optimizer
    notes: str = ""
    # model sizes and seed: the interop tests vary them to get checkpoints not in the repository
    vocab: int = VOCAB
    dim: int = DIM
    hidden: int = HIDDEN
    seed: int = SEED
    # NVMe cases: steps trained after the last save before the live swap folder is copied into
    # live_swap/ (with the engine's values at that moment as truth); 0: no live copy
    live_swap_steps: int = 0
    # NVMe cases: DeepSpeed's swap threshold (swap_tensor.utils.MIN_AIO_BYTES, 1 MiB) and the aio
    # block size lowered to this many bytes, so a small model has swapped params; 0: DeepSpeed's
    min_aio_bytes: int = 0
    # the per-element optimizer states read live from the engine (SGD keeps momentum_buffer)
    optim_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    # save_checkpoint(exclude_frozen_parameters=True), as the Hugging Face Trainer saves PEFT runs
    exclude_frozen: bool = False
    # also write the engine's live 16-bit module params (ZeRO-1/2: whole on every rank) at the last
    # save into reference/live_params16.safetensors (ZenFlow: they are not the masters rounded)
    live_params16: bool = False

    @property
    def steps(self) -> int:
        """Number of optimizer steps trained up to the last save."""
        return max(self.save_steps)


CASES: list[Case] = [
    # ---- DeepSpeed 0.19.8 ----
    Case(
        "z1_fp32_ws2_frozen_tied",
        "ds19",
        1,
        "fp32",
        2,
        tied=True,
        frozen=True,
        notes="ZeRO-1 writes frozen_param_shapes/frozen_param_fragments as None: the frozen "
        "values are only in the model_states 'module' dict, and DeepSpeed's zero_to_fp32 "
        "output lacks them (live.safetensors has them)",
    ),
    Case("z1_bf16_ws3_groups", "ds19", 1, "bf16", 3, groups=True),
    # coupled weight decay (the decay added to the gradient): ZeRO-3's flat fp32 partitions leave
    # their padding uninitialised, so the momentum and moments there come out nonzero
    Case(
        "z3_fp32_ws2_sgd_coupled_wd",
        "ds19",
        3,
        "fp32",
        2,
        tied=True,
        config_extra=(
            (
                "optimizer",
                {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}},
            ),
            ("zero_allow_untested_optimizer", True),
        ),
        optim_keys=("momentum_buffer",),
        notes="torch.optim.SGD (Nesterov momentum, weight_decay 0.01 added to the gradient): the only state is "
        "momentum_buffer, nonzero in ZeRO-3's padding (uninitialised fp32 padding times the decay)",
    ),
    # optimizer states beyond Adam's two: AMSGrad's max_exp_avg_sq (ZeRO-3's universal loader
    # restores only fp32, exp_avg and exp_avg_sq) and NAdam's scalar mu_product (no universal file
    # holds a scalar state but the step)
    Case(
        "z3_fp32_ws2_amsgrad",
        "ds19",
        3,
        "fp32",
        2,
        config_extra=(
            (
                "optimizer",
                {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True, "amsgrad": True}},
            ),
        ),
        optim_keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
        notes="torch.optim.AdamW(amsgrad=True): a third per-element state, max_exp_avg_sq",
    ),
    Case(
        "z1_bf16_ws2_nadam",
        "ds19",
        1,
        "bf16",
        2,
        config_extra=(
            ("optimizer", {"type": "NAdam", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
            ("zero_allow_untested_optimizer", True),
        ),
        notes="torch.optim.NAdam: exp_avg and exp_avg_sq, and a scalar mu_product per flat group beside the step",
    ),
    Case(
        "z3_bf16_ws3_adam_coupled_wd",
        "ds19",
        3,
        "bf16",
        3,
        frozen=True,
        config_extra=(
            (
                "optimizer",
                {
                    "type": "Adam",
                    "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True, "adam_w_mode": False},
                },
            ),
        ),
        notes="torch.optim.Adam with weight_decay 0.01 (L2, added to the gradient; adam_w_mode false): "
        "exp_avg and exp_avg_sq nonzero in ZeRO-3's padding",
    ),
    # one sample per optimizer family (issue 35): torch's Adagrad, RAdam, Adamax and RMSprop (built by
    # DeepSpeed from the config's type through getattr(torch.optim, type); Adagrad by name), DeepSpeed's
    # FusedAdam (Adam without torch_adam; the CPU accelerator builds it), and its CPU Adam / Adagrad /
    # Lion (the config's type with the optimizer offloaded to CPU; JIT-built C++ ops)
    Case(
        "z3_fp32_ws2_adagrad",
        "ds19",
        3,
        "fp32",
        2,
        config_extra=(
            ("optimizer", {"type": "Adagrad", "params": {"lr": 1e-2, "weight_decay": 0.01, "lr_decay": 0.01}}),
            ("zero_allow_untested_optimizer", True),
        ),
        optim_keys=("sum",),
        notes="torch.optim.Adagrad (lr_decay 0.01, weight_decay 0.01 added to the gradient): state sum and a step",
    ),
    Case(
        "z2_bf16_ws2_radam",
        "ds19",
        2,
        "bf16",
        2,
        config_extra=(
            (
                "optimizer",
                {"type": "RAdam", "params": {"lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True}},
            ),
            ("zero_allow_untested_optimizer", True),
        ),
        notes="torch.optim.RAdam (decoupled weight decay): exp_avg, exp_avg_sq and a step",
    ),
    Case(
        "z1_fp32_ws3_adamax",
        "ds19",
        1,
        "fp32",
        3,
        config_extra=(
            ("optimizer", {"type": "Adamax", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
            ("zero_allow_untested_optimizer", True),
        ),
        optim_keys=("exp_avg", "exp_inf"),
        notes="torch.optim.Adamax: exp_avg, exp_inf (the infinity norm) and a step",
    ),
    Case(
        "z3_bf16_ws2_rmsprop_centered",
        "ds19",
        3,
        "bf16",
        2,
        config_extra=(
            (
                "optimizer",
                {
                    "type": "RMSprop",
                    "params": {"lr": 1e-3, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
                },
            ),
            ("zero_allow_untested_optimizer", True),
        ),
        optim_keys=("square_avg", "momentum_buffer", "grad_avg"),
        notes="torch.optim.RMSprop (momentum 0.9, centered): square_avg, momentum_buffer, grad_avg and a step",
    ),
    Case(
        "z1_bf16_ws2_fusedadam",
        "ds19",
        1,
        "bf16",
        2,
        config_extra=(("optimizer", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
        notes="DeepSpeed's FusedAdam (AdamW without torch_adam; the CPU accelerator's fused_adam op): exp_avg, "
        "exp_avg_sq and an integer step per flat group, and a 'step' of 0 in each param group",
    ),
    Case(
        "z3_bf16_ws2_cpuadam",
        "ds19",
        3,
        "bf16",
        2,
        zero_extra=(("offload_optimizer", {"device": "cpu"}),),
        config_extra=(("optimizer", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
        notes="DeepSpeedCPUAdam (AdamW without torch_adam, the optimizer offloaded to CPU): exp_avg, exp_avg_sq "
        "(fp32) and an integer step",
    ),
    Case(
        "z2_fp32_ws2_cpuadagrad",
        "ds19",
        2,
        "fp32",
        2,
        zero_extra=(("offload_optimizer", {"device": "cpu"}),),
        config_extra=(("optimizer", {"type": "Adagrad", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
        optim_keys=("exp_avg_sq",),
        notes="DeepSpeedCPUAdagrad (Adagrad with the optimizer offloaded to CPU): exp_avg_sq (the sum of squared "
        "gradients) and an integer step",
    ),
    Case(
        "z2_bf16_ws2_cpulion",
        "ds19",
        2,
        "bf16",
        2,
        zero_extra=(("offload_optimizer", {"device": "cpu"}),),
        config_extra=(("optimizer", {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.01}}),),
        notes="DeepSpeedCPULion (Lion with the optimizer offloaded to CPU): exp_avg, an exp_avg_sq it creates and "
        "never updates (zeros), and an integer step",
    ),
    # ZenFlow (zero_optimization.zenflow; ZeRO-1/2 with the optimizer offloaded to CPU): update_interval
    # becomes gradient_accumulation_steps, so 4 micro-steps are 2 global steps; between the CPU Adam's
    # updates of the masters its selective optimizer updates the top-k columns of the 16-bit weights
    Case(
        "z2_bf16_ws2_zenflow",
        "ds19",
        2,
        "bf16",
        2,
        save_steps=(4,),
        live_params16=True,
        zero_extra=(
            ("offload_optimizer", {"device": "cpu"}),
            (
                "zenflow",
                {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 2, "update_interval": 2},
            ),
        ),
        config_extra=(("optimizer", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),),
        notes="ZenFlow (select_strategy step, select_interval 2, update_interval 2; ZenFlowCPUAdam on the masters, "
        "ZenFlowSelectiveAdamW on the top-k columns of the 16-bit weights): 4 micro-steps, tag global_step2, "
        "the CPU Adam's step 4; the saved 16-bit weights are the live engine's, not the masters rounded",
    ),
    # zero_optimization.elastic_checkpoint (ZeRO-1/2): base_optimizer_state is a list, one dict per
    # param group of the group's flat partition states without the group's padding (DeepSpeed's
    # _get_base_optimizer_state), and base_optimizer_state_step only where the optimizer keeps a
    # group 'step' (torch's AdamW does not)
    Case(
        "z2_bf16_ws2_elastic",
        "ds19",
        2,
        "bf16",
        2,
        zero_extra=(("elastic_checkpoint", True),),
        notes="elastic_checkpoint: base_optimizer_state a list of 1 dict (one per param group: exp_avg, "
        "exp_avg_sq without the group's padding, and the tensor step); no param_groups saved",
    ),
    Case(
        "z1_fp32_ws3_elastic",
        "ds19",
        1,
        "fp32",
        3,
        zero_extra=(("elastic_checkpoint", True),),
        notes="elastic_checkpoint at ZeRO-1, 3 ranks: base_optimizer_state a list of 1 dict (exp_avg, exp_avg_sq "
        "without the group's padding, and the tensor step); no param_groups saved",
    ),
    # DeepSpeed's Muon (MuonWithAuxAdam): every 2-D param whose name holds neither "embed" nor
    # "lm_head" in a Muon group (state: momentum_buffer, one full momentum per param the rank's
    # partition touches), the rest in an Adam group (exp_avg, exp_avg_sq, an integer step)
    Case(
        "z1_bf16_ws2_muon",
        "ds19",
        1,
        "bf16",
        2,
        config_extra=(("optimizer", {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01}}),),
        optim_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        notes="DeepSpeed's Muon (MuonWithAuxAdam; its Adam half is DeepSpeed's FusedAdam, built for the CPU accelerator): "
        "the Muon group's momentum_buffer holds the full momentum of every param the partition touches",
    ),
    Case(
        "z1_bf16_ws3_muon_bf16optimizer",
        "ds19",
        1,
        "bf16",
        3,
        grad_accum_fp32=True,
        config_extra=(("optimizer", {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01}}),),
        optim_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        notes="DeepSpeed's Muon under BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation): its "
        "momentum_buffer has the master partition's layout (bf16_optimizer.py _prepare_muon_updates), per element",
    ),
    Case(
        "z2_fp32_ws3_muon_cpuoffload",
        "ds19",
        2,
        "fp32",
        3,
        zero_extra=(("offload_optimizer", {"device": "cpu"}),),
        config_extra=(
            ("optimizer", {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}}),
            ("zero_force_ds_cpu_optimizer", False),
        ),
        optim_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        notes="DeepSpeed's Muon at ZeRO-2 with the optimizer offloaded to CPU: _apply_muon_updates_cpu_offload "
        "keeps momentum_buffer per element of the flat partition (zeros_like(flat_param)), not per whole param",
    ),
    Case(
        "z3_bf16_ws2_muon",
        "ds19",
        3,
        "bf16",
        2,
        zero_extra=(("reduce_scatter", False),),
        config_extra=(("optimizer", {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01}}),),
        optim_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        notes="DeepSpeed's Muon at ZeRO-3 (reduce_scatter off: stage3.py refuses Muon with it): momentum_buffer "
        "per element of the Muon sub-groups' partitions, as exp_avg is",
    ),
    Case(
        "z2_fp32_ws3_muon",
        "ds19",
        2,
        "fp32",
        3,
        config_extra=(("optimizer", {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}}),),
        optim_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        notes="DeepSpeed's Muon at ZeRO-2 over 3 ranks: params cut between two ranks have their full momentum on both",
    ),
    Case(
        "z0_fp32_ws2_tied",
        "ds19",
        0,
        "fp32",
        2,
        tied=True,
        notes="ZeRO-0 (ZeRO off): no optimizer files; the model states hold the module (the fp32 masters) and the "
        "torch optimizer's state_dict by param index, param_shapes None",
    ),
    Case(
        "z0_bf16_ws2_tied",
        "ds19",
        0,
        "bf16",
        2,
        tied=True,
        notes="ZeRO-0 bf16: DeepSpeed's FP16_UnfusedOptimizer saves each param's fp32 master (fp32_groups) beside the "
        "torch optimizer's state by index and the loss scaler's values; the module holds the bf16 copies",
    ),
    Case(
        "z0_fp16_ws2",
        "ds19",
        0,
        "fp16",
        2,
        notes="ZeRO-0 fp16: FP16_UnfusedOptimizer as for bf16, with the dynamic loss scaler's values "
        "(cur_scale, cur_iter, last_overflow_iter, scale_factor, scale_window)",
    ),
    Case(
        "z0_fp32_ws2_frozen_tied",
        "ds19",
        0,
        "fp32",
        2,
        tied=True,
        frozen=True,
        notes="ZeRO-0 with frozen params the script left out of its optimizer: the optimizer's params (by index) "
        "match the module's in more than one way by shape (fc2.bias or adapter.2.bias, both [37])",
    ),
    Case("z2_fp32_ws1", "ds19", 2, "fp32", 1),
    Case("z2_bf16_ws3_frozen_groups", "ds19", 2, "bf16", 3, frozen=True, groups=True),
    Case("z2_fp16_ws4_tied", "ds19", 2, "fp16", 4, tied=True),
    # checkpoint.checkpoint_serialization=false: TorchCheckpointEngine.save calls torch.save(...,
    # _use_new_zipfile_serialization=False), so every rank file is torch's legacy (non-zip) stream
    Case(
        "z2_bf16_ws2_legacy_serialization",
        "ds19",
        2,
        "bf16",
        2,
        frozen=True,
        config_extra=(("checkpoint", {"checkpoint_serialization": False}),),
        notes="checkpoint.checkpoint_serialization=false: every rank file is a legacy (non-zip) torch.save "
        "stream (five pickles, then each storage as an 8-byte element count and its bytes): no CRC, no name",
    ),
    Case(
        "z3_fp32_ws2_legacy_serialization",
        "ds19",
        3,
        "fp32",
        2,
        tied=True,
        config_extra=(("checkpoint", {"checkpoint_serialization": False}),),
        notes="checkpoint.checkpoint_serialization=false at ZeRO-3: every rank file a legacy (non-zip) "
        "torch.save stream",
    ),
    Case(
        "z2_bf16_ws3_paramalign",
        "ds19",
        2,
        "bf16",
        3,
        zero_extra=(("parameter_alignment", True),),
        notes="zero_optimization.parameter_alignment=true: each param starts 16-byte aligned "
        "in the flat buffer, so optim_states' param_alignment_paddings are non-zero",
    ),
    Case(
        "z1_fp32_ws2_roundrobin",
        "ds19",
        1,
        "fp32",
        2,
        zero_extra=(("round_robin_gradients", True),),
        live_from_module=(
            "DeepSpeed 0.19.8 bug: with round_robin_gradients the flat buffers and param_shapes "
            "follow the round-robin param order, but the fp32<->param links (used by "
            "safe_get_full_fp32_param / safe_get_full_optimizer_state and written as "
            "param_slice_mappings) assume the original order, so they point at the wrong "
            "elements. live.safetensors therefore holds the module's own fp32 params (equal to "
            "the fp32 masters in an fp32 run, and to zero_to_fp32's output); no "
            "live_optimizer.safetensors. The checkpoint's param_slice_mappings are WRONG here."
        ),
        notes="zero_optimization.round_robin_gradients=true: params are laid out in the flat "
        "buffer in round-robin order across ranks (param_shapes lists them in that order)",
    ),
    Case(
        "z2_fp32_ws2_twotags",
        "ds19",
        2,
        "fp32",
        2,
        save_steps=(2, 3),
        notes="checkpoint holds two tags (global_step2, global_step3); latest -> global_step3; "
        "reference/ is for the latest tag",
    ),
    Case(
        "z3_fp32_ws2_tied_frozen",
        "ds19",
        3,
        "fp32",
        2,
        tied=True,
        frozen=True,
        persistence_threshold=None,
        notes="stage3_param_persistence_threshold left at DeepSpeed's default (1e5), so every "
        "param of this tiny model is persistent; the model_states 'module' tensors are "
        "still empty placeholders",
    ),
    Case("z3_bf16_ws3_subgroups_groups", "ds19", 3, "bf16", 3, groups=True, sub_group_size=500),
    Case("z3_fp16_ws4_subgroups_frozen", "ds19", 3, "fp16", 4, frozen=True, sub_group_size=500),
    Case("z3_bf16_ws1", "ds19", 3, "bf16", 1),
    Case(
        "z3_fp32_ws2_cpuoffload_tied",
        "ds19",
        3,
        "fp32",
        2,
        tied=True,
        zero_extra=(("offload_optimizer", {"device": "cpu"}), ("offload_param", {"device": "cpu"})),
        config_extra=(("zero_force_ds_cpu_optimizer", False),),
        notes="ZeRO-3 with optimizer and params offloaded to CPU (torch AdamW, not DeepSpeedCPUAdam)",
    ),
    # ZeRO-3, optimizer offloaded to NVMe. DeepSpeed swaps a sub-group only when its fp32
    # partition is >= 1 MiB (262144 elements per rank), so this model is bigger: with
    # sub_group_size 200000 the decay group splits into [embed, fc1.weight, fc2.weight]
    # (262176 per rank: swapped, "0_7") and [pos.weight] (158: in memory, "13_13"); the
    # no-decay group (6318 per rank) is one in-memory sub-group ("1_8").
    Case(
        "z3_bf16_ws2_nvmeoffload_frozen_tied_groups",
        "ds19",
        3,
        "bf16",
        2,
        frozen=True,
        tied=True,
        groups=True,
        sub_group_size=200_000,
        vocab=29,
        dim=63,
        hidden=4147,
        zero_extra=(("offload_optimizer", {"device": "nvme", "nvme_path": NVME_PATH}),),
        config_extra=(("zero_force_ds_cpu_optimizer", False),),
        notes="ZeRO-3 with the optimizer offloaded to NVMe (torch AdamW): sub-groups whose fp32 "
        "partition is >= 1 MiB are swapped and saved as raw files under "
        "<tag>/offloaded_tensors/rankRR/ (their fp32_flat_groups entries and Adam states "
        "in the optim files are empty); smaller sub-groups stay in the optim files. "
        "nvme_path in ds_config was a temp dir, gone. DeepSpeed's zero_to_fp32 fails on "
        "it (reference_error). Bigger model: vocab 29, dim 63, hidden 4147",
    ),
    # ZeRO-Infinity (optimizer and params on NVMe), the live swap folder copied 2 steps after the
    # checkpoint. The swap threshold is lowered to 64 KiB (see min_aio_bytes) to keep the sample
    # small: with sub_group_size 30000 the decay group splits into [embed, fc1.weight] (35564 per
    # rank) and [fc2.weight] (34650), both swapped, and [pos.weight] (158, in memory); the no-decay
    # group (1746 per rank) stays in memory. fc1.weight and fc2.weight (69300 elements: 34650,
    # 69300 bf16 bytes, per rank) also get 16-bit param swap files.
    Case(
        "z3_bf16_ws2_nvme_live_swap",
        "ds19",
        3,
        "bf16",
        2,
        frozen=True,
        tied=True,
        groups=True,
        sub_group_size=30_000,
        vocab=29,
        dim=63,
        hidden=1100,
        live_swap_steps=2,
        min_aio_bytes=65536,
        zero_extra=(
            ("offload_optimizer", {"device": "nvme", "nvme_path": NVME_PATH}),
            ("offload_param", {"device": "nvme", "nvme_path": NVME_PATH, "buffer_size": 100_000, "buffer_count": 5}),
        ),
        config_extra=(("zero_force_ds_cpu_optimizer", False),),
        notes="ZeRO-3 with optimizer and params offloaded to NVMe (torch AdamW), DeepSpeed's "
        "swap threshold lowered from 1 MiB to 64 KiB (swap_tensor MIN_AIO_BYTES and aio "
        "block_size) to keep the files small. checkpoint/ is saved after step 3; after "
        "2 more steps the live swap folder <nvme_path>/zero_stage_3 was copied into "
        "live_swap/ and the engine's fp32 masters, Adam moments and 16-bit params dumped "
        "into live_swap_reference/ at the same moment",
    ),
    Case(
        "z2_bf16_ws2_cpuoffload_frozen",
        "ds19",
        2,
        "bf16",
        2,
        frozen=True,
        zero_extra=(("offload_optimizer", {"device": "cpu"}),),
        config_extra=(("zero_force_ds_cpu_optimizer", False),),
        notes="ZeRO-2 with the optimizer offloaded to CPU (torch AdamW, not DeepSpeedCPUAdam)",
    ),
    Case(
        "z1_bf16_ws3_bf16optimizer_frozen",
        "ds19",
        1,
        "bf16",
        3,
        frozen=True,
        grad_accum_fp32=True,
        notes="data_types.grad_accum_dtype=fp32: DeepSpeed uses BF16_Optimizer, whose optimizer files "
        "have no zero_stage key and keep the group padding; zero_to_fp32.py refuses them",
    ),
    Case(
        "hf_trainer",
        "ds19",
        3,
        "bf16",
        2,
        tied=True,
        checkpoint="checkpoint-3",
        hf_trainer=True,
        scheduler=True,
        notes="laid out like a Hugging Face Trainer output folder (checkpoint-3/ with "
        "config/tokenizer/trainer_state JSON files beside latest and global_step3/)",
    ),
    # ---- DeepSpeed 0.14.4 ----
    Case("ds14_z1_fp16_ws2", "ds14", 1, "fp16", 2),
    Case("ds14_z2_bf16_ws3_frozen_tied", "ds14", 2, "bf16", 3, frozen=True, tied=True),
    Case("ds14_z3_fp32_ws2_subgroups_groups", "ds14", 3, "fp32", 2, groups=True, sub_group_size=500),
]
CASES_BY_NAME = {c.name: c for c in CASES}


# --------------------------------------------------------------------------------------
# Worker (runs under torchrun, one process per rank)
# --------------------------------------------------------------------------------------
def build_model(case: Case) -> Any:
    """Build the tiny seeded model used by every case (odd sizes so padding shows up)."""
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Embedding -> LayerNorm -> MLP with BatchNorm -> adapter -> lm_head."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(case.vocab, case.dim)
            self.norm = nn.LayerNorm(case.dim)
            self.fc1 = nn.Linear(case.dim, case.hidden)
            self.bn = nn.BatchNorm1d(case.hidden)
            self.fc2 = nn.Linear(case.hidden, case.dim)
            self.add_module(
                case.adapter_name, nn.Sequential(nn.Linear(case.dim, 11), nn.Tanh(), nn.Linear(11, case.dim))
            )
            self.lm_head = nn.Linear(case.dim, case.vocab, bias=False)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, case.dim))
            self.register_buffer("position_ids", torch.arange(SEQ_LEN, dtype=torch.int64)[None])
            self.pos = nn.Embedding(SEQ_LEN, case.dim)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) + self.pos(self.position_ids[:, : tokens.shape[1]])
            h = self.norm(h) * self.scale.to(h.dtype)
            b, t, d = h.shape
            m = self.batch_norm_fp32(torch.relu(self.fc1(h)).reshape(b * t, case.hidden))
            m = m.reshape(b, t, case.hidden)
            h = h + self.fc2(m)
            h = h + getattr(self, case.adapter_name)(h)
            return self.lm_head(h)

        def batch_norm_fp32(self, x: torch.Tensor) -> torch.Tensor:
            """self.bn computed in fp32: on CPU batch_norm refuses mixed bf16/fp16/fp32 inputs,
            and DeepSpeed casts params (not necessarily buffers) to the 16-bit dtype."""
            bn = self.bn
            # clones: batch_norm updates them in place and autograd saves them
            mean = bn.running_mean.detach().float().clone()
            var = bn.running_var.detach().float().clone()
            out = nn.functional.batch_norm(
                x.float(), mean, var, bn.weight.float(), bn.bias.float(), self.training, bn.momentum, bn.eps
            )
            if self.training:
                with torch.no_grad():
                    bn.running_mean.copy_(mean)
                    bn.running_var.copy_(var)
                    bn.num_batches_tracked.add_(1)
            return out.to(x.dtype)

    torch.manual_seed(case.seed)
    model = TinyLM()
    if case.tied:
        model.lm_head.weight = model.embed.weight
    if case.frozen:
        for p in getattr(model, case.adapter_name).parameters():
            p.requires_grad_(False)
    return model


def uses_nvme(case: Case) -> bool:
    """Whether the case's config offloads to NVMe (and so needs a swap folder)."""
    return NVME_PATH in json.dumps(asdict(case))


def ds_config(case: Case) -> dict[str, Any]:
    """DeepSpeed config for a case."""
    zero: dict[str, Any] = {"stage": case.stage, **dict(case.zero_extra)}
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict) and zero[key].get("nvme_path") == NVME_PATH:
            zero[key] = {**zero[key], "nvme_path": os.environ["ZCKPT_NVME_PATH"]}
    if case.stage == 3:
        if case.persistence_threshold is not None:
            zero["stage3_param_persistence_threshold"] = case.persistence_threshold
        if case.sub_group_size is not None:
            zero["sub_group_size"] = case.sub_group_size
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    cfg.update(dict(case.config_extra))
    if case.grad_accum_fp32:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if case.min_aio_bytes:
        cfg["aio"] = {"block_size": case.min_aio_bytes}
    if case.scheduler:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 2},
        }
    return cfg


def param_groups(model: Any, case: Case) -> list[Any]:
    """Trainable params, either as one list or as decay / no-decay groups."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not case.groups:
        return [p for _, p in named]
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.01, "lr": 1e-2}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def allow_fp16_on_cpu() -> None:
    """The CPU accelerator refuses fp16 although torch computes it; lift that refusal."""
    import torch
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.is_fp16_supported = lambda: True  # type: ignore[method-assign]
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]  # type: ignore


def all_ranks_ok(ok: bool) -> bool:
    """True when `ok` holds on every rank (a MIN all-reduce)."""
    import deepspeed.comm as dist
    import torch

    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def optimizer_state_readable(model: Any, stage: int, key: str) -> tuple[bool, str]:
    """Whether safe_get_full_optimizer_state(param, key) can run for every param on every rank.

    For ZeRO-1/2 the call goes through ``param._hp_mapping.optim_fragment``. DeepSpeed 0.19.8
    links those once, right after the first param group's first optimizer step, when later
    groups have no Adam state yet, so with several groups they stay empty. A rank without a
    fragment of a param would wait in the all-reduce while another raises, so check first,
    collectively.
    """
    reason = ""
    ok = True
    if stage in (1, 2):
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:
                continue
            frag = getattr(hp, "optim_fragment", None)
            if frag is None or key not in frag:
                ok = False
                reason = (
                    f"param {n}: _hp_mapping.optim_fragment is {type(frag).__name__}"
                    f"{'' if frag is None else ' without ' + key} (DeepSpeed links the "
                    "fragments once, after the first param group's first step, before "
                    "later groups have optimizer state)"
                )
                break
    return all_ranks_ok(ok), reason


def params_by_identity(model: Any) -> tuple[dict[int, list[str]], dict[int, Any]]:
    """Each param object by id, and every name it appears under in state_dict (tied: several)."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, Any] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
        params[id(p)] = p
    return names_of, params


def capture_live(engine: Any, case: Case) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """Read the live truth from the engine (collective). Returns (weights, optim|None, note)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = engine.module
    names_of, params = params_by_identity(model)

    # ZeRO-0 (ZeRO off): an fp32 run's module params are the masters and its torch optimizer's state is
    # by param; a 16-bit run's (DeepSpeed's FP16_UnfusedOptimizer) pairs each module param with its
    # fp32 master (fp16_groups / fp32_groups), whose torch optimizer state holds the moments
    masters: dict[int, Any] = {}
    if case.stage == 0 and case.dtype != "fp32":
        opt = engine.optimizer
        for group16, group32 in zip(opt.fp16_groups, opt.fp32_groups):
            masters.update({id(p16): p32 for p16, p32 in zip(group16, group32)})
    live: dict[str, Any] = {}
    for pid, p in params.items():
        if p.requires_grad and pid in masters:
            v = masters[pid].data.detach().cpu().clone()
        elif p.requires_grad and (
            case.live_from_module or case.stage == 0
        ):  # ZeRO-0: the module's params are the masters
            assert case.dtype == "fp32" and case.stage in (0, 1, 2)
            v = p.data.detach().cpu().clone()
        elif p.requires_grad:
            v = safe_get_full_fp32_param(p)
            assert v is not None, names_of[pid]
            v = v.detach().cpu().float()
        elif case.stage == 3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                v = p.data.detach().cpu().clone()
        else:
            v = p.data.detach().cpu().clone()
        for n in names_of[pid]:
            live[n] = v.clone().contiguous()
    for n, b in model.named_buffers():
        live[n] = b.detach().cpu().clone().contiguous()

    optim: dict[str, Any] | None = {}
    note = "safe_get_full_optimizer_state worked"
    if case.live_from_module:
        return live, None, "skipped: " + case.live_from_module
    if case.stage == 0:  # ZeRO-0: the torch optimizer's own state, by param (a 16-bit run's: by its master)
        state = engine.optimizer.optimizer.state if masters else engine.optimizer.state
        for pid, p in params.items():
            if p.requires_grad:
                for key in case.optim_keys:
                    for n in names_of[pid]:
                        optim[f"{n}.{key}"] = state[masters.get(pid, p)][key].detach().cpu().clone().contiguous()
        return live, optim, "the torch optimizer's state of each param (ZeRO-0)"
    if muon(case):
        optim, note = capture_muon(engine, case, names_of, params)
        return live, optim, note
    for key in case.optim_keys:
        readable, reason = optimizer_state_readable(model, case.stage, key)
        if not readable:
            optim = None
            note = f"safe_get_full_optimizer_state(param, {key!r}) not usable: {reason or 'on another rank'}"
            break
        for pid, p in params.items():
            if not p.requires_grad:
                continue
            v = safe_get_full_optimizer_state(p, key)
            assert v is not None, names_of[pid]
            v = v.detach().cpu().float()
            for n in names_of[pid]:
                optim[f"{n}.{key}"] = v.clone().contiguous()
    return live, optim, note


def muon(case: Case) -> bool:
    """Whether the case trains with DeepSpeed's Muon (MuonWithAuxAdam)."""
    optimizer = dict(case.config_extra).get("optimizer")
    return isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() == "muon"


def capture_muon(engine: Any, case: Case, names_of: dict[int, list[str]], params: dict[int, Any]) -> tuple[Any, str]:
    """The live optimizer state of a ZeRO-1/2 Muon run, read from the torch optimizer's state of
    each flat partition (collective).

    safe_get_full_optimizer_state cannot read a Muon group: its fragments narrow the state at the
    param's offset in the flat partition, and a Muon group's momentum_buffer is laid out per param
    (the full momentum of every param in params_in_partition, in that order). So: a Muon param's
    momentum is taken at its offset in that buffer on every rank that holds it (all must agree,
    checked here); an Adam param's exp_avg / exp_avg_sq (and, with the optimizer offloaded, a Muon
    param's momentum, kept per element there) are its slices of the flat partitions, gathered
    over the ranks. ZeRO-3 and BF16_Optimizer: :func:`capture_muon_per_element`."""
    import deepspeed.comm as dist
    import torch

    opt = engine.optimizer
    if case.stage == 3:
        return capture_muon_per_element(
            engine, case, names_of, params, opt.fp32_partitioned_groups_flat, opt.fp16_groups
        )
    if not hasattr(opt, "single_partition_of_fp32_groups"):  # BF16_Optimizer: per element too
        return capture_muon_per_element(engine, case, names_of, params, opt.fp32_groups_flat_partition, opt.bf16_groups)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, Any] = {}
    for i in range(len(opt.bit16_groups)):
        flat = opt.single_partition_of_fp32_groups[i]
        state = opt.optimizer.state[flat]
        in_partition = opt.params_in_partition[i]
        if "momentum_buffer" in state and not opt.cpu_offload:  # offloaded: per element (below)
            buffer = state["momentum_buffer"].detach().cpu()
            offset = 0
            for p in in_partition:
                mine[f"{names_of[id(p)][0]}.momentum_buffer"] = (
                    buffer[offset : offset + p.numel()].view(p.shape).clone()
                )
                offset += p.numel()
            assert offset == buffer.numel(), (offset, buffer.numel())
            continue
        partition_size = flat.numel()
        start = 0
        # the flat group's order and each param's alignment padding (stage_1_and_2.py __init__)
        for p, padding in zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_padding[i]):
            lo, hi = max(start, rank * partition_size), min(start + p.numel(), (rank + 1) * partition_size)
            if lo < hi:
                for key in (k for k in case.optim_keys if k in state):  # Adam's moments; offloaded: the momentum
                    piece = state[key].detach().cpu()[lo - rank * partition_size : hi - rank * partition_size]
                    mine.setdefault(f"{names_of[id(p)][0]}.{key}", []).append((lo - start, piece.clone()))
            start += p.numel() + padding
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    optim: dict[str, Any] = {}
    holders: dict[str, int] = {}
    for pid, p in params.items():
        if not p.requires_grad:
            continue
        first = names_of[pid][0]
        for key in case.optim_keys:
            pieces = [g[f"{first}.{key}"] for g in gathered if f"{first}.{key}" in g]
            if not pieces:
                continue
            if key == "momentum_buffer" and not opt.cpu_offload:  # whole per rank
                for other in pieces[1:]:
                    assert torch.equal(other, pieces[0]), (first, "ranks hold different momenta")
                holders[first] = len(pieces)
                value = pieces[0]  # in the dtype DeepSpeed keeps it (the gradient's: bf16 in a bf16 run)
            else:
                value = torch.zeros(p.numel(), dtype=pieces[0][0][1].dtype)  # the state's own dtype
                for rank_pieces in pieces:
                    for at, piece in rank_pieces:
                        value[at : at + piece.numel()] = piece
                value = value.view(p.shape)
            for n in names_of[pid]:
                optim[f"{n}.{key}"] = value.clone().contiguous()
    shared = sorted(n for n, k in holders.items() if k > 1)
    note = (
        "read from the torch optimizer's state of each flat partition (safe_get_full_optimizer_state "
        "narrows a Muon group's per-param momentum_buffer as if it were per element): momentum_buffer "
        "at each param's offset among params_in_partition, Adam's moments as slices of the flat "
        "partitions; params whose full momentum two ranks hold, equal on both: " + (", ".join(shared) or "none")
    )
    return optim, note


def capture_muon_per_element(
    engine: Any, case: Case, names_of: dict[int, list[str]], params: dict[int, Any], flats: Any, groups: Any
) -> tuple[Any, str]:
    """The live optimizer state of a Muon run that keeps its momentum per element of the flat
    partition (collective): ZeRO-3 (stage3.py _create_momentum_buffer) and BF16_Optimizer
    (bf16_optimizer.py _prepare_muon_updates). safe_get_full_optimizer_state reads it, but only for
    the keys of the param's own flat group (`flats`, its params `groups`: a Muon group has
    momentum_buffer only, an Adam one exp_avg and exp_avg_sq)."""
    import torch
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    keys_of: dict[int, dict[str, Any]] = {}  # each param's states and the dtype DeepSpeed keeps each in
    for i, flat in enumerate(flats):
        state = opt.optimizer.state.get(flat, {})
        keys = {
            k: state[k].dtype for k in case.optim_keys if torch.is_tensor(state.get(k)) and state[k].shape == flat.shape
        }
        keys_of.update({id(p): keys for p in groups[i]})
    optim: dict[str, Any] = {}
    for pid, p in params.items():
        if not p.requires_grad:
            continue
        for key, dtype in keys_of[pid].items():
            value = safe_get_full_optimizer_state(p, key)  # gathered in fp32: exact for a bf16 momentum
            assert value is not None, names_of[pid]
            kept = value.detach().cpu().to(dtype)
            assert torch.equal(kept.float(), value.detach().cpu().float()), names_of[pid]
            for n in names_of[pid]:
                optim[f"{n}.{key}"] = kept.clone().contiguous()
    return optim, (
        "safe_get_full_optimizer_state of each param's own flat group's states (ZeRO-3 and BF16_Optimizer keep "
        "Muon's momentum per element), each in the dtype DeepSpeed keeps it"
    )


def copy_live_swap_folder(engine: Any, case: Case, casedir: Path) -> dict[str, Any] | None:
    """Copy the live swap folder into ``live_swap/`` and dump the engine's values of that moment
    (fp32 masters, Adam moments, gathered 16-bit params) into ``live_swap_reference/``
    (collective). The copy is taken first, between barriers, while no rank is swapping."""
    import deepspeed
    import deepspeed.comm as dist
    from safetensors.torch import save_file

    rank = dist.get_rank()
    root = Path(os.environ["ZCKPT_NVME_PATH"])
    dist.barrier()
    listing: dict[str, int] = {}
    if rank == 0:
        shutil.copytree(root, casedir / "live_swap")
        listing = {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}
    dist.barrier()
    live, optim, note = capture_live(engine, case)
    names_of, params = params_by_identity(engine.module)
    params16: dict[str, Any] = {}
    for pid, p in params.items():
        if p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                v = p.data.detach().cpu().clone()
            for n in names_of[pid]:
                params16[n] = v.clone().contiguous()
    if rank != 0:
        return None
    opt = engine.optimizer
    steps = []
    for flat in opt.fp32_partitioned_groups_flat:
        state = opt.optimizer.state.get(flat, {})
        step = state.get("step")
        steps.append(None if step is None else float(step))
    ref = casedir / "live_swap_reference"
    ref.mkdir(parents=True, exist_ok=True)
    save_file(live, str(ref / "live.safetensors"), metadata={"format": "pt"})
    if optim is not None:
        save_file(optim, str(ref / "live_optimizer.safetensors"), metadata={"format": "pt"})
    save_file(params16, str(ref / "params16.safetensors"), metadata={"format": "pt"})
    for f in ref.glob("*.safetensors"):
        f.chmod(0o644)
    return {
        "global_steps": engine.global_steps,
        "steps_after_checkpoint": case.live_swap_steps,
        "adam_step_per_sub_group": steps,
        "files": listing,
        "live_optimizer": note,
        "min_aio_bytes": case.min_aio_bytes,
        "copied": "shutil.copytree(<nvme_path>, live_swap/) on rank 0 between two "
        "dist.barrier() calls after the last engine.step(); then the engine's "
        "values read with safe_get_full_fp32_param / safe_get_full_optimizer_state "
        "and GatheredParameters",
    }


def write_hf_extras(ckpt_dir: Path, case: Case, steps: int) -> None:
    """Small plausible Hugging Face Trainer side files (transformers is not needed)."""
    files: dict[str, Any] = {
        "config.json": {
            "architectures": ["TinyLM"],
            "model_type": "tiny_lm",
            "vocab_size": case.vocab,
            "hidden_size": case.dim,
            "intermediate_size": case.hidden,
            "max_position_embeddings": SEQ_LEN,
            "tie_word_embeddings": case.tied,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.46.0",
        },
        "generation_config.json": {
            "_from_model_config": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "transformers_version": "4.46.0",
        },
        "tokenizer.json": {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": 0, "content": "<pad>", "special": True},
                {"id": 1, "content": "<s>", "special": True},
                {"id": 2, "content": "</s>", "special": True},
            ],
            "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"},
            "model": {
                "type": "WordLevel",
                "unk_token": "<pad>",
                "vocab": {**{"<pad>": 0, "<s>": 1, "</s>": 2}, **{f"w{i}": i for i in range(3, case.vocab)}},
            },
        },
        "tokenizer_config.json": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": SEQ_LEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        "trainer_state.json": {
            "best_metric": None,
            "best_model_checkpoint": None,
            "epoch": 0.3,
            "eval_steps": 500,
            "global_step": steps,
            "is_hyper_param_search": False,
            "is_local_process_zero": True,
            "is_world_process_zero": True,
            "log_history": [],
            "logging_steps": 500,
            "max_steps": 10,
            "num_train_epochs": 1,
            "save_steps": steps,
            "total_flos": 0.0,
            "train_batch_size": MICRO_BATCH,
            "trial_name": None,
            "trial_params": None,
        },
    }
    for fname, content in files.items():
        (ckpt_dir / fname).write_text(json.dumps(content, indent=2) + "\n")


def worker(case: Case, casedir: Path) -> None:
    """Per-rank entry point: train, capture live values, save checkpoint(s)."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import save_file

    if case.dtype == "fp16":
        allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == case.world_size, (world, case.world_size)

    if case.min_aio_bytes:  # the swappers read the threshold from their module globals
        from deepspeed.runtime.swap_tensor import optimizer_utils, partitioned_param_swapper

        optimizer_utils.MIN_AIO_BYTES = case.min_aio_bytes
        partitioned_param_swapper.MIN_AIO_BYTES = case.min_aio_bytes
    model = build_model(case)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, case), config=ds_config(case)
    )
    ckpt_dir = casedir / case.checkpoint
    gen = torch.Generator().manual_seed(case.seed + 1000 * rank)
    tags: list[str] = []
    nvme_listing: dict[str, int] | None = None
    live_swap: dict[str, Any] | None = None
    for step in range(1, case.steps + case.live_swap_steps + 1):
        tokens = torch.randint(0, case.vocab, (MICRO_BATCH, SEQ_LEN), generator=gen)
        target = torch.randint(0, case.vocab, (MICRO_BATCH, SEQ_LEN), generator=gen)
        logits = engine(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, case.vocab), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        if step in case.save_steps:
            if step == case.steps:
                live, optim, optim_note = capture_live(engine, case)
                if rank == 0:
                    ref = casedir / "reference"
                    ref.mkdir(parents=True, exist_ok=True)
                    save_file(live, str(ref / "live.safetensors"), metadata={"format": "pt"})
                    if optim is not None:
                        save_file(optim, str(ref / "live_optimizer.safetensors"), metadata={"format": "pt"})
                    if case.live_params16:
                        assert case.stage in (1, 2), case.stage
                        names_of, params = params_by_identity(engine.module)
                        params16 = {
                            n: p.data.detach().cpu().clone().contiguous()
                            for pid, p in params.items()
                            if p.requires_grad
                            for n in names_of[pid]
                        }
                        save_file(params16, str(ref / "live_params16.safetensors"), metadata={"format": "pt"})
            engine.save_checkpoint(str(ckpt_dir), exclude_frozen_parameters=case.exclude_frozen)
            dist.barrier()
            tags.append((ckpt_dir / "latest").read_text().strip())
            if rank == 0 and os.environ.get("ZCKPT_NVME_PATH"):
                # the live swap folder (all ranks) right after the save, for comparison with
                # what save_checkpoint copied; DeepSpeed empties it when the run ends
                root = Path(os.environ["ZCKPT_NVME_PATH"])
                nvme_listing = {
                    str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()
                }
        if case.live_swap_steps and step == case.steps + case.live_swap_steps:
            live_swap = copy_live_swap_folder(engine, case, casedir)

    if rank == 0:
        model = engine.module
        opt = engine.optimizer
        n_sub_groups = None
        ds_ids = sub_groups = None
        if case.stage == 3:
            n_sub_groups = len(getattr(opt, "fp32_partitioned_groups_flat", []) or [])
            # DeepSpeed's param ids (name the NVMe swap files), every name incl. tied aliases
            ds_ids = {n: p.ds_id for n, p in model.named_parameters(remove_duplicate=False)}
            name_of = {id(p): n for n, p in model.named_parameters()}
            swapped = getattr(opt, "_swappable_optimizer_subgroup", lambda i: False)
            sub_groups = [
                {
                    "ds_id": opt.fp32_partitioned_groups_flat[i].ds_id,
                    "params": [name_of[id(p)] for p in opt.fp16_groups[i]],
                    "partition_numel": opt.fp16_partitioned_groups_flat_numel[i],
                    "swapped_to_nvme": bool(swapped(i)),
                }
                for i in range(n_sub_groups)
            ]
        tied = {}
        seen: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied[n] = seen[id(p)]
            else:
                seen[id(p)] = n
        loss_scale = None
        if case.dtype == "fp16":
            loss_scale = float(getattr(opt, "loss_scale", None) or getattr(opt, "cur_scale", 0))
        info = {
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "tags": tags,
            "tag": tags[-1],
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
            "tied": tied,
            "param_groups": len(opt.param_groups),
            "buffers": [n for n, _ in model.named_buffers()],
            "n_fp32_sub_groups": n_sub_groups,
            "fp32_sub_groups": sub_groups,
            "ds_ids": ds_ids,
            "nvme_swap_folder": nvme_listing,
            "live_swap": live_swap,
            "final_loss_scale": loss_scale,
            "live_optimizer": optim_note,
            "ds_config": ds_config(case),
        }
        (casedir / "_worker_info.json").write_text(json.dumps(info, indent=2))
        if case.hf_trainer:
            write_hf_extras(ckpt_dir, case, case.steps)
    dist.barrier()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def free_port() -> int:
    """A currently free TCP port for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_env(world_size: int, **extra: str) -> dict[str, str]:
    """The environment of a CPU DeepSpeed run of `world_size` ranks. LOCAL_SIZE: the deepspeed
    launcher sets it; without it DeepSpeed 0.14's CPU accelerator runs `numactl --hardware` to
    count devices (ZeRO-3 grad reduce)."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "LOCAL_SIZE": str(world_size),
        **extra,
    }


def run_workers(
    python: str, script: Path, world_size: int, case_json: str, casedir: Path, log: Path, env: dict[str, str]
) -> None:
    """``script --worker --case-json CASE --outdir CASEDIR`` on `world_size` ranks under torchrun
    (its output appended to `log`); the /dev/shm buffers DeepSpeed leaks are removed."""
    with removing_shm_leaks():
        run(
            [
                *launcher(python),
                "--nproc_per_node",
                str(world_size),
                "--master_port",
                str(free_port()),
                str(Path(script).resolve()),
                "--worker",
                "--case-json",
                case_json,
                "--outdir",
                str(casedir.resolve()),
            ],
            cwd=REPO,
            log=log,
            env=env,
        )


def run(cmd: list[str], cwd: Path, log: Path, env: dict[str, str]) -> None:
    """Run a command, appending its output to `log`; raise with the log tail on failure."""
    with log.open("a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


def offloaded_tensors(tag_dir: Path) -> dict[str, dict[str, int]] | None:
    """NVMe swap files saved with a checkpoint: {rank folder: {file name: size in bytes}}."""
    root = tag_dir / "offloaded_tensors"
    if not root.is_dir():
        return None
    return {d.name: {f.name: f.stat().st_size for f in sorted(d.iterdir())} for d in sorted(root.iterdir())}


def legacy_serialization(case: Case) -> bool:
    """Whether the case saves with checkpoint.checkpoint_serialization false (legacy torch files)."""
    checkpoint = dict(case.config_extra).get("checkpoint")
    return isinstance(checkpoint, dict) and checkpoint.get("checkpoint_serialization") is False


_RESAVE_AS_ZIP = """
import sys, torch
for path in sys.argv[1:]:
    torch.save(torch.load(path, map_location="cpu", weights_only=False), path)
"""


def zero_to_fp32_on_zip_copy(case: Case, casedir: Path, python: str, log: Path, env: dict[str, str]) -> list[str]:
    """DeepSpeed's zero_to_fp32 run on a copy of the case's checkpoint re-saved as zip files,
    its output in reference/zero_to_fp32; returns the arguments given to python."""
    with tempfile.TemporaryDirectory(prefix="zckpt_zip_copy_") as tmp:
        copy = Path(tmp) / case.checkpoint
        shutil.copytree(casedir / case.checkpoint, copy)
        files = sorted(str(p) for p in copy.rglob("*.pt"))
        run([python, "-c", _RESAVE_AS_ZIP, *files], cwd=casedir, log=log, env=env)
        args = ["-m", "deepspeed.utils.zero_to_fp32", str(copy), "reference/zero_to_fp32"]
        run([python, *args], cwd=casedir, log=log, env=env)
    return ["-m", "deepspeed.utils.zero_to_fp32", "<zip copy of " + case.checkpoint + ">", "reference/zero_to_fp32"]


def generate(
    case: Case, out: Path, pythons: dict[str, str], logdir: Path, extensions: dict[str, str] | None = None
) -> float:
    """Generate one case from scratch; returns the seconds it took. `extensions`: release -> the
    folder DeepSpeed builds its ops into for that release's interpreter (default: one per release
    under ~/.cache); the interop tests pass the folder their own runs use, where CI built
    async_io already, so that no fresh run builds it again (5-10 minutes)."""
    extensions = extensions or {}
    t0 = time.time()
    casedir = out / case.name
    if casedir.exists():
        shutil.rmtree(casedir)
    casedir.mkdir(parents=True)
    log = logdir / f"{case.name}.log"
    log.write_text("")
    # TORCH_EXTENSIONS_DIR: DeepSpeed JIT-builds ops (deepspeed_shm_comm, async_io) into torch's
    # extension cache, which two releases on the same torch would share; a build by the other
    # release can then be loaded ("module 'deepspeed_shm_comm' has no attribute ...").
    env = cpu_env(
        case.world_size,
        TORCH_EXTENSIONS_DIR=extensions.get(case.release)
        or str(Path.home() / ".cache" / f"torch_extensions_{case.release}"),
    )

    # a fixed name (not mkdtemp's random one): it is written into ds_config in every .pt file
    nvme_dir = Path(tempfile.gettempdir()) / f"zckpt_nvme_{case.name}" if uses_nvme(case) else None
    try:
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
            nvme_dir.mkdir(parents=True)
            env["ZCKPT_NVME_PATH"] = str(nvme_dir)
        run_workers(pythons[case.release], Path(__file__), case.world_size, json.dumps(asdict(case)), casedir, log, env)
    finally:
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    env.pop("ZCKPT_NVME_PATH", None)
    env["TORCH_EXTENSIONS_DIR"] = extensions.get("ds19") or str(Path.home() / ".cache" / "torch_extensions_ds19")

    ckpt = casedir / case.checkpoint
    for fname in ("zero_to_fp32.py", "zero_to_torch.py"):
        (ckpt / fname).unlink(missing_ok=True)
    for f in (casedir / "reference").glob("*.safetensors"):
        f.chmod(0o644)  # safetensors writes 0600

    ref_args = ["-m", "deepspeed.utils.zero_to_fp32", case.checkpoint, "reference/zero_to_fp32"]
    reference_error = None
    reference_via_zip = None
    try:
        run([pythons["ds19"], *ref_args], cwd=casedir, log=log, env=env)
    except RuntimeError as exc:  # DeepSpeed's tool fails on some layouts; say how, keep the case
        reference_error = [line for line in str(exc).splitlines() if line.strip()][-1].strip()
        shutil.rmtree(casedir / "reference" / "zero_to_fp32", ignore_errors=True)
    if reference_error and legacy_serialization(case):
        # zero_to_fp32 loads the optimizer files with torch.load(mmap=True), which refuses legacy
        # (non-zip) files: run it on a copy whose files torch.load + torch.save re-wrote as zips
        reference_via_zip = reference_error
        reference_error = None
        ref_args = zero_to_fp32_on_zip_copy(case, casedir, pythons["ds19"], log, env)

    info = json.loads((casedir / "_worker_info.json").read_text())
    (casedir / "_worker_info.json").unlink()
    ref_ver = subprocess.run(
        [pythons["ds19"], "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    notes = [case.notes] if case.notes else []
    if info["skipped_steps"]:
        notes.append(f"{info['skipped_steps']} step(s) skipped by the fp16 loss scaler")
    meta = {
        "case": case.name,
        "deepspeed_version": info["deepspeed_version"],
        "torch_version": info["torch_version"],
        "zero_stage": case.stage,
        "dtype": case.dtype,
        "world_size": case.world_size,
        "checkpoint": case.checkpoint,
        "tag": info["tag"],
        "tags": info["tags"],
        "steps": case.steps,
        "skipped_steps": info["skipped_steps"],
        "frozen": info["frozen"],
        "tied": info["tied"],
        "param_groups": info["param_groups"],
        "sub_group_size": case.sub_group_size if case.stage == 3 else None,
        "n_fp32_sub_groups": info["n_fp32_sub_groups"],
        "fp32_sub_groups": info["fp32_sub_groups"],
        "offloaded_tensors": offloaded_tensors(ckpt / info["tag"]),
        "ds_ids": info["ds_ids"],
        "nvme_swap_folder_at_save": info["nvme_swap_folder"],
        "stage3_param_persistence_threshold": (
            (case.persistence_threshold if case.persistence_threshold is not None else "default")
            if case.stage == 3
            else None
        ),
        "buffers": info["buffers"],
        "final_loss_scale": info["final_loss_scale"],
        "live_source": (
            "module parameters (see live_optimizer)"
            if case.live_from_module
            else "the module's params (ZeRO-0: the fp32 masters) and buffers"
            if case.stage == 0 and case.dtype == "fp32"
            else "each param's fp32 master (ZeRO-0, 16-bit: FP16_UnfusedOptimizer's fp32_groups) and buffers"
            if case.stage == 0
            else "deepspeed.utils.safe_get_full_fp32_param (trainable), full 16-bit/fp32 value (frozen), module buffers"
        ),
        "live_optimizer": info["live_optimizer"],
        "live_optimizer_file": (casedir / "reference/live_optimizer.safetensors").exists(),
        "notes": "; ".join(notes),
        "reference_command": "python " + " ".join(ref_args),
        "reference_error": reference_error,
        **(
            {
                "reference_from_zip_copy": "zero_to_fp32 on the checkpoint itself failed ("
                + reference_via_zip
                + "): the reference is its output on a copy whose rank files torch.load + torch.save re-wrote "
                "in the zip format (the same values)"
            }
            if reference_via_zip
            else {}
        ),
        "reference_cwd": "the case directory (sample_ckpts/%s)" % case.name,
        "reference_deepspeed_version": ref_ver,
        "model": {
            "vocab": case.vocab,
            "dim": case.dim,
            "hidden": case.hidden,
            "seq_len": SEQ_LEN,
            "micro_batch": MICRO_BATCH,
            "seed": case.seed,
        },
        "ds_config": info["ds_config"],
    }
    if info.get("live_swap"):
        meta["live_swap"] = info["live_swap"]
    if case.live_params16:
        meta["live_params16"] = (
            "reference/live_params16.safetensors: each trainable param of engine.module as the engine held it "
            "(16-bit) right before the last save_checkpoint"
        )
    (casedir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return time.time() - t0


# --------------------------------------------------------------------------------------
# --describe: what a checkpoint file's pickle references and holds
# --------------------------------------------------------------------------------------
def pickle_globals(path: Path) -> list[str]:
    """GLOBAL / STACK_GLOBAL ``module.name`` pairs referenced by a torch zip file's data.pkl (a
    legacy, non-zip file's main pickle: the fourth of its pickles)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            data = zf.read(name)
    else:
        with open(path, "rb") as fh:
            for _ in range(3):  # magic number, protocol version, sys_info
                for _ in pickletools.genops(fh):
                    pass
            start = fh.tell()
            for _ in pickletools.genops(fh):
                pass
            end = fh.tell()
            fh.seek(start)
            data = fh.read(end - start)
    string_ops = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"}
    found: set[str] = set()
    pushed: list[Any] = []  # what each pushing op put on the stack (strings only, else None)
    memo: dict[int, Any] = {}
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "GLOBAL":
            mod, _, nm = arg.partition(" ")
            found.add(f"{mod}.{nm}")
            pushed.append(None)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{pushed[-2]}.{pushed[-1]}")
            pushed.append(None)
        elif op.name in string_ops:
            pushed.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
        else:
            pushed.append(None)
    return sorted(found)


def _short(v: Any) -> str:
    """One-line repr; plain objects (e.g. DeepSpeed loss scalers) via their attributes."""
    if hasattr(v, "__dict__") and not isinstance(v, type) and type(v).__module__ != "builtins":
        r = f"{type(v).__name__}({', '.join(f'{k}={a!r}' for k, a in vars(v).items())})"
    else:
        r = repr(v)
    return r if len(r) < 110 else r[:107] + "..."


def describe_obj(obj: Any, indent: int = 0, depth: int = 3) -> list[str]:
    """Short structural description (keys, types, tensor shapes/dtypes) of a loaded object."""
    import torch

    pad = "  " * indent
    lines: list[str] = []
    items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj[:4]))
    for k, v in items:
        label = repr(k) if isinstance(obj, dict) else f"[{k}]"
        if isinstance(v, torch.Tensor):
            lines.append(f"{pad}{label}: {type(v).__name__}{tuple(v.shape)} {v.dtype}")
        elif isinstance(v, (dict, list, tuple)) and not isinstance(v, torch.Size) and depth > 0 and k != "ds_config":
            lines.append(f"{pad}{label}: {type(v).__name__}[{len(v)}]")
            lines.extend(describe_obj(v, indent + 1, depth - 1))
        else:
            lines.append(f"{pad}{label}: {type(v).__name__} {_short(v)}")
    if isinstance(obj, (list, tuple)) and len(obj) > 4:
        lines.append(f"{pad}... ({len(obj)} items)")
    return lines


def describe(path: Path) -> None:
    """Print the pickle GLOBALs and the key structure of one checkpoint file."""
    import torch

    print(f"## {path}")
    print("GLOBALs:", ", ".join(pickle_globals(path)))
    obj = torch.load(path, map_location="cpu", weights_only=False)
    print("\n".join(describe_obj(obj)))


# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (driver, worker or describe mode)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "sample_ckpts")
    ap.add_argument("--only", nargs="+", metavar="CASE", choices=sorted(CASES_BY_NAME))
    ap.add_argument("--python-ds19", default=DEFAULT_PY["ds19"])
    ap.add_argument("--python-ds14", default=DEFAULT_PY["ds14"])
    ap.add_argument("--logdir", type=Path, default=Path("/tmp/make_sample_ckpts_logs"))
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case-json", help=argparse.SUPPRESS)
    ap.add_argument("--outdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--describe", nargs="+", type=Path, metavar="FILE")
    args, _unknown = ap.parse_known_args(argv)  # the deepspeed launcher appends --local_rank

    if args.worker:
        fields = json.loads(args.case_json)
        fields["save_steps"] = tuple(fields["save_steps"])
        fields["zero_extra"] = tuple(tuple(item) for item in fields["zero_extra"])
        fields["config_extra"] = tuple(tuple(item) for item in fields["config_extra"])
        fields["optim_keys"] = tuple(fields["optim_keys"])
        worker(Case(**fields), args.outdir)
        return 0
    if args.describe:
        for p in args.describe:
            describe(p)
            print()
        return 0
    if args.list:
        for c in CASES:
            print(json.dumps(asdict(c)))
        return 0

    pythons = {"ds19": args.python_ds19, "ds14": args.python_ds14}
    args.logdir.mkdir(parents=True, exist_ok=True)
    selected = [CASES_BY_NAME[n] for n in args.only] if args.only else CASES
    failures: list[str] = []
    t_all = time.time()
    for case in selected:
        print(f"[{case.name}] {case.release} zero{case.stage} {case.dtype} ws{case.world_size} ...", flush=True)
        try:
            dt = generate(case, args.out, pythons, args.logdir)
            print(f"[{case.name}] done in {dt:.0f}s", flush=True)
        except Exception as exc:  # keep going, report at the end
            failures.append(case.name)
            print(f"[{case.name}] FAILED: {exc}", flush=True)
    print(
        f"total {time.time() - t_all:.0f}s; {len(selected) - len(failures)} ok, "
        f"{len(failures)} failed {failures if failures else ''}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Load a DeepSpeed checkpoint with real DeepSpeed at M ranks and dump what the engine then holds.

Per-rank worker, started by torchrun with an interpreter that has DeepSpeed::

    DS_ACCELERATOR=cpu LOCAL_SIZE=M python -m torch.distributed.run --nproc-per-node M \\
        --master-port P scripts/ds_probe.py --case-json CASE --checkpoint DIR --out OUTDIR \\
        [--stage S] [--config-override JSON] [--load-universal] [--tag TAG] [--train-steps K]
        [--data per-rank|global]

``CASE`` is the name of a bundled sample case (``scripts/make_sample_ckpts.py --list``), the JSON
of ``dataclasses.asdict(case)``, or a path to a file holding either. The model, DeepSpeed config
and param groups are built exactly as ``make_sample_ckpts.py`` builds them for that case (the
module is imported by path and its ``build_model`` / ``ds_config`` / ``param_groups`` /
``allow_fp16_on_cpu`` are used), then ``deepspeed.initialize`` and a plain
``engine.load_checkpoint(DIR)`` (``tag=TAG`` with ``--tag``).

``--stage S`` runs ZeRO stage S instead of the case's (the config is rebuilt for the case with
that stage, so ZeRO-3-only keys appear or go as ``ds_config`` decides; ``offload_param`` and
``stage3_*`` extra keys are dropped for stages 1/2, ``round_robin_gradients`` /
``parameter_alignment`` for stage 3). ``--config-override`` is deep-merged into the config last.
``--load-universal`` sets ``"checkpoint": {"load_universal": true}``.

Rank 0 writes into OUTDIR:

* ``live.safetensors``: per trainable param name its fp32 master; frozen params their full value
  (training dtype); buffers as the module holds them; tied aliases under every name (the
  conventions of ``make_sample_ckpts.capture_live``).
* ``live_optimizer.safetensors``: ``<name>.<key>`` (fp32, full shape) for every per-element
  optimizer state key (``exp_avg``, ``exp_avg_sq``, ...).
* ``live_module.safetensors``: the module's own (16-bit for bf16/fp16 runs) param values as the
  engine holds them after the load (ZeRO-3: gathered), per name incl. tied aliases.
* ``state.json``: counters, loss scaler, lr scheduler, client state, per param group
  hyperparameters and ``step``, stage / world size / dtype, load path, which method gave which
  tensor, cross-checks, and (``--train-steps``) the losses of the steps trained after the load.
* with ``--train-steps K``: ``live_after_train.safetensors`` / ``live_optimizer_after_train.safetensors``,
  the same capture after those K steps.

Training data (``--train-steps``): by default each rank draws its own micro-batches
(``seed + 1000 * rank``, make_sample_ckpts' stream), so runs at different world sizes see different
data. ``--data global`` draws each optimizer step's global batch (``world size x
gradient_accumulation_steps`` micro-batches) from one stream shared by every rank; micro-batch
``j`` of a step goes to rank ``j % world`` at micro-step ``j // world``. Two runs whose world size x
``gradient_accumulation_steps`` agree (e.g. 2 x 1 and 1 x 2) then train on the same samples and
average the same gradients; ``state["train"]["losses_per_microbatch"]`` lists each step's losses by
``j``, comparable between them.

How the tensors are obtained (``state.json`` ``methods`` names them per tensor):

* ZeRO-3: ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
  (DeepSpeed gathers the param's slice of each rank's ``fp32_partitioned_groups_flat`` /
  ``optimizer.state[flat][key]``). Frozen params: ``zero.GatheredParameters``.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: ``flat_partition_allgather``:
  every rank's fp32 flat partition (``single_partition_of_fp32_groups[g]`` /
  ``fp32_groups_flat_partition[g]``) and base-optimizer state of that partition
  (``engine.optimizer.optimizer.state[partition][key]``) are all-gathered over the group's
  ``real_dp_process_group`` into a flat tensor as long as ``bit16_groups_flat[g]`` /
  ``bf16_groups_flat[g]``; a param's slice starts where DeepSpeed placed the param's 16-bit
  data in that flat buffer (the 16-bit params are views into it: ``(p.data_ptr() -
  flat.data_ptr()) / element_size``, cross-checked against ``round_robin_bit16_offsets``).
  For fp32 masters ``safe_get_full_fp32_param`` is also called and compared; the dumped value
  is DeepSpeed's call where the two agree (``methods`` says which was dumped, ``cross_checks``
  lists disagreements, e.g. DeepSpeed 0.19.8's round-robin link bug). For optimizer states
  ``safe_get_full_optimizer_state`` is used only where every rank has the
  ``_hp_mapping.optim_fragment`` links (after ``load_checkpoint`` 0.19.8 leaves them unset until
  the next optimizer step, so normally the flat method gives them).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
GEN_PATH = REPO / "scripts" / "make_sample_ckpts.py"
STAGE3_ONLY_ZERO_KEYS = ("offload_param", "sub_group_size", "stage3_param_persistence_threshold")
STAGE12_ONLY_ZERO_KEYS = ("round_robin_gradients", "parameter_alignment")


def load_generator() -> Any:
    """Import scripts/make_sample_ckpts.py by path (registered so its dataclasses resolve)."""
    if "make_sample_ckpts" in sys.modules:
        return sys.modules["make_sample_ckpts"]
    spec = importlib.util.spec_from_file_location("make_sample_ckpts", GEN_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def parse_case(gen: Any, text: str) -> Any:
    """A Case from a bundled case name, asdict(case) JSON, or a file holding either."""
    if not text.lstrip().startswith(("{", '"')) and Path(text).is_file():
        text = Path(text).read_text()
    text = text.strip()
    if not text.startswith(("{", '"')):
        return gen.CASES_BY_NAME[text]
    fields = json.loads(text)
    if isinstance(fields, str):
        return gen.CASES_BY_NAME[fields]
    fields = dict(fields)
    fields["save_steps"] = tuple(fields.get("save_steps", (3,)))
    fields["zero_extra"] = tuple(tuple(item) for item in fields.get("zero_extra", ()))
    fields["config_extra"] = tuple(tuple(item) for item in fields.get("config_extra", ()))
    if "optim_keys" in fields:
        fields["optim_keys"] = tuple(fields["optim_keys"])
    return gen.Case(**fields)


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` merged into a copy of ``base`` (nested dicts merged, a None value deletes)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def probe_case(gen: Any, case: Any, stage: int | None) -> Any:
    """The case to build the engine from: the given one, or a copy at another ZeRO stage."""
    if stage is None or stage == case.stage:
        return case
    drop = STAGE3_ONLY_ZERO_KEYS if stage < 3 else STAGE12_ONLY_ZERO_KEYS
    zero_extra = tuple(
        (k, v) for k, v in case.zero_extra if k not in drop and not (stage < 3 and k.startswith("stage3_"))
    )
    return dataclasses.replace(case, stage=stage, zero_extra=zero_extra)


def build_config(gen: Any, case: Any, override: dict | None, load_universal: bool) -> dict:
    cfg = gen.ds_config(case)
    if load_universal:
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
    if override:
        cfg = deep_merge(cfg, override)
    return cfg


# --------------------------------------------------------------------------------------
# JSON helpers
# --------------------------------------------------------------------------------------
def jsonable(obj: Any, depth: int = 0) -> Any:
    """A JSON-able rendering: tensors as scalars or {shape, dtype}, objects by their attributes."""
    import enum

    import torch

    if depth > 12:
        return f"<{type(obj).__name__}>"
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else repr(obj)
    if isinstance(obj, enum.Enum):
        return {
            "enum": f"{type(obj).__module__}.{type(obj).__qualname__}.{obj.name}",
            "value": jsonable(obj.value, depth + 1),
        }
    if isinstance(obj, torch.Size):
        return list(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 1 and obj.dim() == 0:
            return jsonable(obj.item(), depth + 1)
        return {"tensor": {"shape": list(obj.shape), "dtype": str(obj.dtype)}}
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in obj]
    if dataclasses.is_dataclass(obj):
        return {
            "type": type(obj).__qualname__,
            **{f.name: jsonable(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)},
        }
    if hasattr(obj, "__dict__"):  # e.g. DeepSpeed loss scalers (their __repr__ raises on dtype)
        return {
            "type": f"{type(obj).__module__}.{type(obj).__qualname__}",
            **{k: jsonable(v, depth + 1) for k, v in vars(obj).items() if not k.startswith("_")},
        }
    return {"type": type(obj).__qualname__, "str": str(obj)}


# --------------------------------------------------------------------------------------
# Reading the engine
# --------------------------------------------------------------------------------------
def all_ranks_ok(ok: bool, group: Any = None) -> bool:
    import deepspeed.comm as dist
    import torch

    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def same_on_all_ranks(value: int, group: Any = None) -> bool:
    import deepspeed.comm as dist
    import torch

    lo = torch.tensor([value], dtype=torch.int64)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return int(lo.item()) == int(hi.item()) == value


def allgather_flat(t: Any, group: Any) -> Any:
    """Concatenation, in rank order, of every rank's tensor ``t`` (same numel everywhere)."""
    import deepspeed.comm as dist
    import torch

    t = t.detach().reshape(-1).float().cpu().contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def zero12_layout(opt: Any) -> dict[str, Any]:
    """The flat-buffer bookkeeping of a ZeRO-1/2 optimizer or BF16_Optimizer, as the engine holds it."""
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return {
            "kind": type(opt).__name__,
            "params": opt.bit16_groups,
            "flat16": opt.bit16_groups_flat,
            "fp32": opt.single_partition_of_fp32_groups,
            "rr_params": getattr(opt, "round_robin_bit16_groups", None),
            "rr_offsets": getattr(opt, "round_robin_bit16_offsets", None),
            "groups": opt.real_dp_process_group,
        }
    if hasattr(opt, "fp32_groups_flat_partition"):
        return {
            "kind": type(opt).__name__,
            "params": opt.bf16_groups,
            "flat16": opt.bf16_groups_flat,
            "fp32": opt.fp32_groups_flat_partition,
            "rr_params": None,
            "rr_offsets": None,
            "groups": opt.real_dp_process_group,
        }
    raise RuntimeError(f"unknown ZeRO-1/2 optimizer {type(opt).__name__}")


def capture(engine: Any, stage: int, names_of: dict[int, list[str]], params: dict[int, Any]) -> dict:
    """Read masters, optimizer states, frozen values, module values and buffers (collective)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # ZeRO-0 (fp32): the script's torch optimizer itself
    live: dict[str, Any] = {}
    module_vals: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    methods: dict[str, dict[str, str]] = {"live": {}, "optimizer": {}, "module": {}}
    cross: dict[str, Any] = {
        "fp32_master_disagreements": [],
        "optimizer_disagreements": [],
        "offset_disagreements": [],
        "checked_fp32": 0,
        "checked_optimizer": 0,
    }

    def captured() -> dict:
        return {
            "live": live,
            "optim": optim,
            "module": module_vals,
            "methods": methods,
            "cross_checks": cross,
            "optim_keys": optim_keys,
        }

    def put(target: dict, kind: str, pid: int, value: Any, method: str, suffix: str = "") -> None:
        for n in names_of[pid]:
            target[n + suffix] = value.detach().cpu().clone().contiguous()
            methods[kind][n + suffix] = method

    # module values (16-bit as held) and frozen params
    for pid, p in params.items():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                v = p.data.detach().cpu().clone()
            m = "GatheredParameters(p).data"
        else:
            v = p.data.detach().cpu().clone()
            m = "p.data"
        put(module_vals, "module", pid, v, m)
        if not p.requires_grad:
            put(live, "live", pid, v, m + " (frozen)")

    optim_keys: list[str] = []
    if stage == 3:
        keys_of: dict[int, list[str]] = {}  # a param's sub-group's states (Muon's and Adam's differ)
        for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
            st = base.state.get(flat, {})
            for k, v in sorted(st.items()):
                if torch.is_tensor(v) and v.shape == flat.shape:
                    keys_of.update({id(q): keys_of.get(id(q), []) + [k] for q in opt.fp16_groups[i]})
                    if k not in optim_keys:
                        optim_keys.append(k)
        for pid, p in params.items():
            if not p.requires_grad:
                continue
            v = safe_get_full_fp32_param(p)
            put(live, "live", pid, v.float(), "safe_get_full_fp32_param")
            for k in keys_of.get(pid, optim_keys):
                v = safe_get_full_optimizer_state(p, k)
                put(optim, "optimizer", pid, v.float(), "safe_get_full_optimizer_state", "." + k)
        return captured()

    if stage == 0:  # ZeRO off: the module's params are the fp32 masters, the torch optimizer's state is per param
        # (a 16-bit run's FP16_UnfusedOptimizer pairs each module param with its fp32 master)
        masters = {
            id(p16): p32
            for group16, group32 in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
            for p16, p32 in zip(group16, group32)
        }
        for pid, p in params.items():
            if not p.requires_grad:
                continue
            master = masters.get(pid, p)
            put(live, "live", pid, master.data.float(), "the fp32 master (ZeRO-0)")
            for k, v in sorted(base.state.get(master, {}).items()):
                if torch.is_tensor(v) and v.shape == p.shape:
                    put(optim, "optimizer", pid, v.float(), "optimizer.state[master] (ZeRO-0)", "." + k)
                    if k not in optim_keys:
                        optim_keys.append(k)
        return captured()

    lay = zero12_layout(opt)
    flat_value: dict[tuple[int, str], Any] = {}  # (pid, key or "fp32") -> full tensor
    muon_value = muon_momenta(opt, base, names_of, params, cross)
    for g, (plist, flat16, part) in enumerate(zip(lay["params"], lay["flat16"], lay["fp32"])):
        group = lay["groups"][g]
        full = {"fp32": allgather_flat(part, group)}
        assert full["fp32"].numel() == flat16.numel(), (g, full["fp32"].numel(), flat16.numel())
        st = base.state.get(part, {})
        # sorted: after a universal load DeepSpeed inserts the keys in set order, which differs
        # between processes, and every rank must gather the same key in each collective
        keys = sorted(
            k
            for k, v in st.items()
            if torch.is_tensor(v)
            and v.shape == part.shape
            and not (k == "momentum_buffer" and muon_whole(opt, base, g))
        )
        # every rank must gather the same keys (a collective per key)
        assert same_on_all_ranks(len(keys), group), f"optimizer state keys differ between ranks: {keys}"
        for k in keys:
            full[k] = allgather_flat(st[k], group)
            if k not in optim_keys:
                optim_keys.append(k)
        esize = flat16.element_size()
        offsets_rr = {}
        if lay["rr_params"] is not None and lay["rr_offsets"] is not None:
            offsets_rr = {id(p): off for p, off in zip(lay["rr_params"][g], lay["rr_offsets"][g])}
        for p in plist:
            off_bytes = p.data.data_ptr() - flat16.data_ptr()
            assert off_bytes % esize == 0, off_bytes
            off = off_bytes // esize
            assert 0 <= off and off + p.numel() <= flat16.numel(), (off, p.numel(), flat16.numel())
            if id(p) in offsets_rr and offsets_rr[id(p)] != off:
                cross["offset_disagreements"].append(
                    {
                        "param": names_of[id(p)][0],
                        "data_ptr_offset": off,
                        "round_robin_bit16_offsets": offsets_rr[id(p)],
                    }
                )
            for k, t in full.items():
                flat_value[(id(p), k)] = t.narrow(0, off, p.numel()).view(p.shape).clone()

    # fp32 masters: DeepSpeed's accessor and the flat layout, compared
    for pid, p in params.items():
        if not p.requires_grad:
            continue
        ds_v = safe_get_full_fp32_param(p)
        ds_v = None if ds_v is None else ds_v.detach().cpu().float()
        mine = flat_value[(pid, "fp32")]
        cross["checked_fp32"] += 1
        if (
            ds_v is not None
            and ds_v.shape == mine.shape
            and torch.equal(ds_v.view(-1).view(torch.int32), mine.view(-1).view(torch.int32))
        ):
            put(live, "live", pid, ds_v, "safe_get_full_fp32_param (== flat_partition_allgather)")
        else:
            cross["fp32_master_disagreements"].append(names_of[pid][0])
            put(live, "live", pid, mine, "flat_partition_allgather (safe_get_full_fp32_param disagreed)")

    for (pid, k), v in muon_value.items():
        put(optim, "optimizer", pid, v, "Muon momentum_buffer at the param's offset among params_in_partition", "." + k)
    # optimizer states: DeepSpeed's accessor only where every rank has the fragment links
    for k in optim_keys:
        linked = True
        for pid, p in params.items():
            hp = getattr(p, "_hp_mapping", None)
            if p.requires_grad and hp is not None:
                frag = getattr(hp, "optim_fragment", None)
                if frag is None or k not in frag:
                    linked = False
        linked = all_ranks_ok(linked)
        cross.setdefault("optim_fragments_linked", {})[k] = linked
        for pid, p in params.items():
            if not p.requires_grad:
                continue
            if (pid, k) not in flat_value:  # a state of another group only (Muon's, Adam's)
                continue
            mine = flat_value[(pid, k)]
            if linked:
                ds_v = safe_get_full_optimizer_state(p, k).detach().cpu().float()
                cross["checked_optimizer"] += 1
                if torch.equal(ds_v.view(-1).view(torch.int32), mine.view(-1).view(torch.int32)):
                    put(
                        optim,
                        "optimizer",
                        pid,
                        ds_v,
                        "safe_get_full_optimizer_state (== flat_partition_allgather)",
                        "." + k,
                    )
                    continue
                cross["optimizer_disagreements"].append(f"{names_of[pid][0]}.{k}")
            put(optim, "optimizer", pid, mine, "flat_partition_allgather", "." + k)
    return captured()


def muon_group(base: Any, g: int) -> bool:
    """Whether torch optimizer group `g` is the Muon half of DeepSpeed's MuonWithAuxAdam."""
    return base.param_groups[g].get("use_muon") is True


def muon_whole(opt: Any, base: Any, g: int) -> bool:
    """Whether group `g` keeps Muon's momentum per whole param: ZeRO-1/2's DeepSpeedZeroOptimizer
    does; BF16_Optimizer (_prepare_muon_updates) and an offloaded optimizer
    (_apply_muon_updates_cpu_offload) keep it per element of the partition."""
    return (
        muon_group(base, g)
        and hasattr(opt, "single_partition_of_fp32_groups")
        and not getattr(opt, "cpu_offload", False)
    )


def muon_momenta(opt: Any, base: Any, names_of: dict, params: dict, cross: dict) -> dict[tuple[int, str], Any]:
    """ZeRO-1/2 Muon (collective): each Muon param's full momentum, taken from its offset in the
    momentum_buffer of the lowest rank whose partition touches it (the buffer holds the full
    momentum of every param in params_in_partition, end to end); ranks holding differing copies
    are listed in cross["muon_copy_disagreements"]."""
    import deepspeed.comm as dist
    import torch

    mine: dict[str, Any] = {}
    for g in range(len(base.param_groups)):
        if not muon_whole(opt, base, g):
            continue
        buffer = base.state.get(opt.single_partition_of_fp32_groups[g], {}).get("momentum_buffer")
        if buffer is None:
            continue
        needed = sum(p.numel() for p in opt.params_in_partition[g])
        if buffer.numel() != needed:  # not Muon's layout (after a universal load: per element)
            cross.setdefault("muon_buffer_not_per_param", []).append(
                {"rank": dist.get_rank(), "group": g, "numel": buffer.numel(), "muon_needs": needed}
            )
            continue
        offset = 0
        for p in opt.params_in_partition[g]:
            # a loaded buffer is fp32 (torch's load_state_dict casts it to the flat param's dtype);
            # DeepSpeed's next step converts it to the gradient's dtype (_muon_momentum_buffer)
            value = buffer.detach().cpu()[offset : offset + p.numel()].view(p.shape)
            if not torch.equal(value.to(p.dtype).float(), value.float()):
                cross.setdefault("muon_momentum_not_in_param_dtype", []).append(names_of[id(p)][0])
            mine[names_of[id(p)][0]] = value.to(p.dtype).clone()
            offset += p.numel()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[tuple[int, str], Any] = {}
    for pid in params:
        copies = [held[names_of[pid][0]] for held in gathered if names_of[pid][0] in held]
        if not copies:
            continue
        if any(not torch.equal(c, copies[0]) for c in copies[1:]):
            cross.setdefault("muon_copy_disagreements", []).append(names_of[pid][0])
        out[(pid, "momentum_buffer")] = copies[0]
    return out


def group_state(engine: Any, stage: int) -> list[dict]:
    """Per optimizer param group: hyperparameters and the ``step`` of each of its flat tensors."""
    import torch

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # ZeRO-0 (fp32): the script's torch optimizer itself
    out = []
    for gi, group in enumerate(base.param_groups):
        hyper = {k: jsonable(v) for k, v in group.items() if k != "params"}
        steps = []
        if stage == 3:
            flats = [f for si, f in enumerate(opt.fp32_partitioned_groups_flat) if opt.sub_group_to_group_id[si] == gi]
            sub_groups = [
                si for si in range(len(opt.fp32_partitioned_groups_flat)) if opt.sub_group_to_group_id[si] == gi
            ]
        else:
            flats = list(group["params"])
            sub_groups = None
        for f in flats:
            st = base.state.get(f, {})
            s = st.get("step")
            steps.append(None if s is None else (s.item() if torch.is_tensor(s) else s))
        entry = {"hyperparameters": hyper, "step": steps, "flat_numel": [int(f.numel()) for f in flats]}
        if sub_groups is not None:
            entry["sub_groups"] = sub_groups
        out.append(entry)
    return out


def scaler_state(engine: Any) -> dict:
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    cur = getattr(opt, "cur_scale", None)
    if cur is None and scaler is not None:
        cur = getattr(scaler, "cur_scale", None)
    if cur is None:
        try:
            cur = getattr(opt, "loss_scale", None)
        except Exception:  # noqa: BLE001 - some optimizers raise on it
            cur = None
    config = getattr(opt, "loss_scale_config", None)
    if scaler is None and config is not None and getattr(config, "use_grad_scaling", False):
        # a 16-bit ZeRO-0 run's FP16_UnfusedOptimizer keeps a LossScaleConfig (no hysteresis):
        # its fields under DynamicLossScaler's names
        names = {"dynamic": "dynamic_loss_scale", "min_scale": "min_loss_scale"}
        fields = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale")
        scaler = {name: getattr(config, names.get(name, name)) for name in fields}
    return {
        "cur_scale": jsonable(cur),
        "loss_scaler": jsonable(scaler) if scaler is not None else None,
        "dynamic_loss_scale": jsonable(getattr(opt, "dynamic_loss_scale", None)),
        "overflow": jsonable(getattr(opt, "overflow", None)),
        "clip_grad": jsonable(getattr(opt, "clip_grad", None)),
    }


# --------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import save_file

    gen = load_generator()
    source_case = parse_case(gen, args.case_json)
    case = probe_case(gen, source_case, args.stage)
    if gen.uses_nvme(case):
        raise SystemExit("ds_probe: NVMe-offloaded cases are out of scope")
    override = json.loads(args.config_override) if args.config_override else None
    cfg = build_config(gen, case, override, args.load_universal)

    if case.dtype == "fp16":
        gen.allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    try:
        model = gen.build_model(case)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=gen.param_groups(model, case), config=cfg)
        # a run saved without its frozen params loads as the Hugging Face Trainer loads one (its
        # module state lacks them, and the model keeps its own)
        strict = not source_case.exclude_frozen
        load_path, client_state = engine.load_checkpoint(str(args.checkpoint), tag=args.tag, load_module_strict=strict)
        if load_path is None:
            raise RuntimeError(f"engine.load_checkpoint({args.checkpoint!r}) returned (None, None): nothing loaded")
        stage = int(engine.zero_optimization_stage())

        model = engine.module
        names_of, params = gen.params_by_identity(model)
        got = capture(engine, stage, names_of, params)
        for n, b in model.named_buffers():
            got["live"][n] = b.detach().cpu().clone().contiguous()
            got["methods"]["live"][n] = "module buffer"

        sched = engine.lr_scheduler
        state = {
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "case": dataclasses.asdict(source_case),
            "probe_case": dataclasses.asdict(case),
            "ds_config": cfg,
            "checkpoint": str(args.checkpoint),
            "tag": args.tag,
            "load_path": str(load_path),
            "zero_stage": stage,
            "world_size": world,
            "dtype": case.dtype,
            "optimizer_class": type(engine.optimizer).__name__,
            "base_optimizer_class": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "loaded_checkpoint_dp_world_size": getattr(engine, "loaded_checkpoint_dp_world_size", None),
            "loaded_checkpoint_mp_world_size": getattr(engine, "loaded_checkpoint_mp_world_size", None),
            **scaler_state(engine),
            "lr_scheduler": jsonable(sched.state_dict()) if sched is not None else None,
            "lr": [g.get("lr") for g in engine.optimizer.param_groups],
            "client_state": jsonable({k: v for k, v in (client_state or {}).items() if k != "module"}),
            "client_state_keys": sorted((client_state or {}).keys()),
            "param_groups": group_state(engine, stage),
            "optimizer_state_keys": got["optim_keys"],
            "frozen": [names_of[pid][0] for pid, p in params.items() if not p.requires_grad],
            "tied": {n: names[0] for names in names_of.values() for n in names[1:]},
            "buffers": [n for n, _ in model.named_buffers()],
            "methods": got["methods"],
            "cross_checks": got["cross_checks"],
        }
        if rank == 0:
            save_file(got["live"], str(out / "live.safetensors"), metadata={"format": "pt"})
            save_file(got["optim"], str(out / "live_optimizer.safetensors"), metadata={"format": "pt"})
            save_file(got["module"], str(out / "live_module.safetensors"), metadata={"format": "pt"})
        dist.barrier()

        if args.train_steps:
            if args.data == "global":
                state["train"] = train_global(engine, case, rank, args.train_steps)
            else:
                state["train"] = train(engine, case, rank, args.train_steps)
            after = capture(engine, stage, names_of, params)
            for n, b in model.named_buffers():
                after["live"][n] = b.detach().cpu().clone().contiguous()
            state["train"]["methods"] = after["methods"]
            state["train"]["cross_checks"] = after["cross_checks"]
            if rank == 0:
                save_file(after["live"], str(out / "live_after_train.safetensors"), metadata={"format": "pt"})
                save_file(
                    after["optim"], str(out / "live_optimizer_after_train.safetensors"), metadata={"format": "pt"}
                )
        if rank == 0:
            tmp = out / "state.json.tmp"
            tmp.write_text(json.dumps(state, indent=2, sort_keys=False) + "\n")
            tmp.replace(out / "state.json")
        dist.barrier()
    except BaseException:
        (out / f"error_rank{rank}.txt").parent.mkdir(parents=True, exist_ok=True)
        (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def train(engine: Any, case: Any, rank: int, steps: int) -> dict:
    """K more steps on make_sample_ckpts' data stream (steps global_steps+1 .. +K of this rank)."""
    import deepspeed.comm as dist
    import torch

    mb, seq = load_generator().MICRO_BATCH, load_generator().SEQ_LEN
    gen = torch.Generator().manual_seed(case.seed + 1000 * rank)
    start = engine.global_steps
    for _ in range(start):  # the draws of the steps already trained (tokens, target per step)
        torch.randint(0, case.vocab, (mb, seq), generator=gen)
        torch.randint(0, case.vocab, (mb, seq), generator=gen)
    rows = []
    for step in range(start + 1, start + steps + 1):
        tokens = torch.randint(0, case.vocab, (mb, seq), generator=gen)
        target = torch.randint(0, case.vocab, (mb, seq), generator=gen)
        logits = engine(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, case.vocab), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        per_rank = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, loss.detach().float().reshape(1).cpu())
        rows.append({"step": step, "losses_per_rank": [t.item() for t in per_rank]})
    return {
        "steps": [r["step"] for r in rows],
        "losses_rank0": [r["losses_per_rank"][0] for r in rows],
        "losses_mean": [sum(r["losses_per_rank"]) / len(r["losses_per_rank"]) for r in rows],
        "losses_per_rank": [r["losses_per_rank"] for r in rows],
        "global_steps_after": engine.global_steps,
        "skipped_steps_after": engine.skipped_steps,
        **{k + "_after": v for k, v in scaler_state(engine).items() if k == "cur_scale"},
    }


def train_global(engine: Any, case: Any, rank: int, steps: int) -> dict:
    """K more optimizer steps on one data stream shared by every rank (``--data global``).

    Step ``s`` draws a global batch of ``world * gas`` micro-batches (after the draws of steps
    1..s-1, so the data depend on the step number and the global batch size only); micro-batch
    ``j`` is trained by rank ``j % world`` at micro-step ``j // world``."""
    import deepspeed.comm as dist
    import torch

    gen_mod = load_generator()
    mb, seq = gen_mod.MICRO_BATCH, gen_mod.SEQ_LEN
    world = dist.get_world_size()
    gas = int(engine.gradient_accumulation_steps())
    n_micro = world * gas
    gen = torch.Generator().manual_seed(case.seed + 7919)

    def draw() -> tuple[Any, Any]:
        tokens = torch.randint(0, case.vocab, (n_micro * mb, seq), generator=gen)
        target = torch.randint(0, case.vocab, (n_micro * mb, seq), generator=gen)
        return tokens, target

    start = engine.global_steps
    for _ in range(start):
        draw()
    rows = []
    for step in range(start + 1, start + steps + 1):
        tokens, target = draw()
        by_micro: dict[int, float] = {}
        for k in range(gas):
            j = k * world + rank
            t, y = tokens[j * mb : (j + 1) * mb], target[j * mb : (j + 1) * mb]
            logits = engine(t)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, case.vocab), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            per_rank = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(per_rank, loss.detach().float().reshape(1).cpu())
            for r, v in enumerate(per_rank):
                by_micro[k * world + r] = v.item()
        if engine.global_steps != step:
            raise RuntimeError(f"after {gas} micro-steps global_steps is {engine.global_steps}, expected {step}")
        rows.append([by_micro[j] for j in range(n_micro)])
    return {
        "data": "global",
        "gradient_accumulation_steps": gas,
        "micro_batches_per_step": n_micro,
        "steps": list(range(start + 1, start + steps + 1)),
        "losses_per_microbatch": rows,
        "losses_mean": [sum(r) / len(r) for r in rows],
        "global_steps_after": engine.global_steps,
        "skipped_steps_after": engine.skipped_steps,
        **{k + "_after": v for k, v in scaler_state(engine).items() if k == "cur_scale"},
    }


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case-json", required=True, help="case name, asdict(case) JSON, or a file holding either")
    ap.add_argument("--checkpoint", required=True, type=Path, help="folder given to engine.load_checkpoint")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3))
    ap.add_argument("--config-override", help="JSON deep-merged into the DeepSpeed config")
    ap.add_argument("--load-universal", action="store_true")
    ap.add_argument("--tag", default=None, help="tag passed to load_checkpoint (default: the 'latest' file)")
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument(
        "--data",
        choices=("per-rank", "global"),
        default="per-rank",
        help="training data after the load: per-rank streams (default) or one global stream",
    )
    args, _unknown = ap.parse_known_args(argv)  # the deepspeed launcher appends --local_rank
    worker(args)
    # every rank has passed the last barrier, state.json is written; torch 2.13's gloo threads
    # can abort the interpreter's exit ("terminate called without an active exception", seen in
    # CI after state.json was written), which torchrun reports as a failed run: leave now, as
    # ds_train_gpt.py and the trainer's ranks do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

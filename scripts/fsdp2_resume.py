#!/usr/bin/env python3
"""Resume a ``zckpt to-dcp`` folder under FSDP2 at W ranks (gloo, CPU) and dump what the run holds.

Per-rank worker, started by torchrun with an interpreter that has torch (no DeepSpeed needed)::

    python -m torch.distributed.run --nproc-per-node W --master-port P scripts/fsdp2_resume.py \\
        --case NAME --dcp DIR --out OUTDIR [--train-steps K] [--micro-batches M]

The model and its param groups are built exactly as ``make_sample_ckpts.py`` builds them for the
bundled case NAME (its ``build_model`` / ``param_groups``), in fp32; ``fc1``, ``fc2`` and then the
whole model are sharded with ``fully_shard`` (tied ``embed``/``lm_head`` and the frozen adapter in
the root's group); the optimizer is torch's class for the one the case's run used, with its config's
hyperparameters, over those groups (:func:`case_optimizers`: torch's own by its name; DeepSpeed's
FusedAdam and CPU Adam as AdamW, or Adam without ``adam_w_mode``; CPU Adagrad as Adagrad; Muon as
``torch.optim.Muon`` over DeepSpeed's Muon params plus AdamW over the rest; Lion refused, torch has
none). Then the README's recipe, word for word (``optimizer`` a list of the optimizers)::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Rank 0 writes into OUTDIR what the run holds after the load (full state dicts gathered with
``get_state_dict(..., full_state_dict=True, cpu_offload=True)``): ``loaded_model.safetensors`` (every
name of the module's state dict), ``loaded_optim.safetensors`` (``<name>.<state>`` for every
optimizer state, and scalar ones such as NAdam's ``mu_product``) and ``loaded.json`` (each param's
``step``, the param groups without their tensors, every optimizer's in order). With
``--train-steps K``, K more optimizer steps follow and the same capture is written
as ``after_train_*``; ``run.json`` has the losses.

With ``--hf-model CHECKPOINT_N`` instead of ``--case``, the model is the Hugging Face model its
``config.json`` describes (transformers' ``AutoModelForCausalLM.from_config``, fp32), each decoder
layer sharded, then the model, with AdamW over the Trainer's two groups (weight-decay names, then
the rest); only the load is captured.

Training data: ds_probe's ``--data global`` stream (make_sample_ckpts' case seed + 7919), skipped
past the checkpoint's ``train_state.json`` ``global_steps``, each step a global batch of M
micro-batches (M: the saving run's world size). Micro-batch ``j`` is trained by rank ``j % W``
with its loss scaled by W / M (FSDP2 averages gradients over W ranks; DeepSpeed over M, one each);
a rank without one runs micro-batch 0 with weight 0, so every rank joins every collective. BatchNorm
then sees the micro-batches DeepSpeed saw, and gradients are clipped to norm ``--clip-grad`` (1.0,
DeepSpeed's default ``gradient_clipping``), so the steps compare with ds_probe's at world size M.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

GEN_PATH = Path(__file__).resolve().parent / "make_sample_ckpts.py"


def load_generator() -> Any:
    """Import scripts/make_sample_ckpts.py by path (registered so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location("make_sample_ckpts", GEN_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def capture(model: Any, optimizer: Any) -> tuple[dict, dict, dict] | None:
    """Rank 0: (model tensors, optimizer tensors, json) of the full state; other ranks: None."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if torch.distributed.get_rank() != 0:
        return None
    tensors = {name: value.detach().clone().contiguous() for name, value in model_sd.items()}
    optim: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    for name, states in optim_sd["state"].items():
        for key, value in states.items():
            if key == "step":
                steps[name] = {"value": value.item(), "dtype": str(value.dtype), "shape": list(value.shape)}
            else:
                optim[f"{name}.{key}"] = value.detach().clone().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
    return tensors, optim, {"steps": steps, "param_groups": groups}


def dump(out: Path, prefix: str, captured: tuple[dict, dict, dict] | None) -> None:
    from safetensors.torch import save_file

    if captured is None:
        return
    tensors, optim, info = captured
    save_file(tensors, str(out / f"{prefix}_model.safetensors"))
    save_file(optim, str(out / f"{prefix}_optim.safetensors"))
    (out / f"{prefix}.json").write_text(json.dumps(info, indent=1))


def case_of(gen: Any, text: str) -> Any:
    """A bundled case by name, or a ``make_sample_ckpts.Case`` given as its ``asdict`` JSON (a
    case an interop test generated afresh)."""
    if not text.lstrip().startswith("{"):
        return gen.CASES_BY_NAME[text]
    fields = json.loads(text)
    for key in ("save_steps", "zero_extra", "config_extra"):
        if key in fields:
            fields[key] = tuple(tuple(x) if isinstance(x, list) else x for x in fields[key])
    return gen.Case(**fields)


def hugging_face_model(folder: Path) -> tuple[Any, Any]:
    """A transformers model built from a Trainer checkpoint's ``config.json`` in fp32, each decoder
    layer and then the model sharded, and AdamW over the Trainer's own two groups (its decay
    names first, then the rest: ``Trainer.create_optimizer``'s order)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    torch.manual_seed(0)  # any values: the load replaces them
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # self is not used
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return model, [torch.optim.AdamW(groups, lr=1e-3)]


# the config's optimizer when a case sets none (make_sample_ckpts.ds_config)
DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
# DeepSpeed 0.19.8's Muon (engine._muon_param_groups, MuonWithAuxAdam): a param is Muon's when
# deepspeed.initialize tags it so (2-D or more, "embed" and "lm_head" not in its name); the config's
# lr / momentum / weight_decay go to the Muon half, lr / betas / eps / weight_decay to the Adam half,
# which MuonWithAuxAdam completes with betas (0.9, 0.95) and eps 1e-10
MUON_KEYS, MUON_ADAM_KEYS = ("lr", "momentum", "weight_decay"), ("lr", "betas", "eps", "weight_decay")
MUON_ADAM_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-10}


def optimizer_spec(case: Any) -> dict[str, Any]:
    """The case's config ``optimizer`` section (type and params)."""
    return dict(case.config_extra).get("optimizer", DEFAULT_OPTIMIZER)


def torch_optimizer_class(kind: str, params: dict[str, Any], offloaded: bool) -> tuple[Any, dict[str, Any]]:
    """torch's class for what DeepSpeed built from config type `kind` (lower-cased) and its params,
    and the params torch's class takes. DeepSpeed's own Adams (FusedAdam, DeepSpeedCPUAdam; torch's
    Adam/AdamW with ``torch_adam``) are torch's AdamW or Adam by ``adam_w_mode`` (always AdamW for
    type AdamW), without their ``bias_correction`` (torch always corrects); DeepSpeedCPUAdagrad is
    torch's Adagrad; any other type is ``torch.optim.<type>``, as DeepSpeed builds it."""
    import torch

    params = dict(params)
    params.pop("torch_adam", None)
    if kind in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        params.pop("bias_correction", None)
        return (torch.optim.AdamW if kind == "adamw" or adam_w_mode else torch.optim.Adam), params
    if kind == "lion":
        raise SystemExit(f"torch {torch.__version__} has no Lion optimizer (DeepSpeed's {'CPU ' * offloaded}Lion ran)")
    names = {name.lower(): name for name in dir(torch.optim)}
    if kind not in names:
        raise SystemExit(f"torch.optim has no optimizer {kind!r}")
    return getattr(torch.optim, names[kind]), params


def case_optimizers(gen: Any, case: Any, model: Any) -> list[Any]:
    """torch's equivalent of the optimizer the case's run trained with, over the case's groups
    (make_sample_ckpts.param_groups), with the config's hyperparameters: one optimizer, or for
    DeepSpeed's Muon two, ``torch.optim.Muon`` over the Muon params and AdamW (Adam without
    ``adam_w_mode``) over the rest, Muon's groups first as DeepSpeed orders them."""
    import torch

    spec = optimizer_spec(case)
    kind = str(spec["type"]).lower()
    params = dict(spec.get("params") or {})
    offload = dict(case.zero_extra).get("offload_optimizer")
    offloaded = isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")
    groups = gen.param_groups(model, case)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    if kind != "muon":
        cls, kwargs = torch_optimizer_class(kind, params, offloaded)
        return [cls(groups, **kwargs)]
    names = {id(p): n for n, p in model.named_parameters()}

    def is_muon(p: Any) -> bool:
        name = names[id(p)]
        return p.ndim >= 2 and "embed" not in name and "lm_head" not in name

    adam_w_mode = params.pop("adam_w_mode", True)
    muon_groups, adam_groups = [], []
    for group in groups:
        extra = {k: v for k, v in group.items() if k != "params"}
        muon = [p for p in group["params"] if is_muon(p)]
        adam = [p for p in group["params"] if not is_muon(p)]
        if muon:
            muon_groups.append({"params": muon, **{k: v for k, v in extra.items() if k in MUON_KEYS}})
        if adam:
            adam_groups.append({"params": adam, **{k: v for k, v in extra.items() if k in MUON_ADAM_KEYS}})
    muon_kwargs = {k: params[k] for k in MUON_KEYS if k in params}
    adam_kwargs = {**MUON_ADAM_DEFAULTS, **{k: params[k] for k in MUON_ADAM_KEYS if k in params}}
    adam_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizers = [torch.optim.Muon(muon_groups, **muon_kwargs)] if muon_groups else []
    return optimizers + ([adam_cls(adam_groups, **adam_kwargs)] if adam_groups else [])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.hf_model is not None:
        model, optimizer = hugging_face_model(args.hf_model)
    else:
        gen = load_generator()
        case = case_of(gen, args.case)
        model = gen.build_model(case).float()
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
        optimizer = case_optimizers(gen, case, model)

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.dcp)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    out = Path(args.out)
    dump(out, "loaded", capture(model, optimizer))

    losses = []
    if args.train_steps:
        train_state = json.loads((Path(args.dcp) / "train_state.json").read_text())
        start = train_state["global_steps"]
        mb, seq, micro = gen.MICRO_BATCH, gen.SEQ_LEN, args.micro_batches
        data = torch.Generator().manual_seed(case.seed + 7919)

        def draw() -> tuple[Any, Any]:
            tokens = torch.randint(0, case.vocab, (micro * mb, seq), generator=data)
            target = torch.randint(0, case.vocab, (micro * mb, seq), generator=data)
            return tokens, target

        for _ in range(start):
            draw()
        model.train()
        for _ in range(args.train_steps):
            tokens, target = draw()
            mine = [(j, world / micro) for j in range(micro) if j % world == rank] or [(0, 0.0)]
            step_losses = []
            for j, weight in mine:
                t, y = tokens[j * mb : (j + 1) * mb], target[j * mb : (j + 1) * mb]
                logits = model(t)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, case.vocab), y.reshape(-1))
                (loss * weight).backward()
                step_losses.append([j, weight, loss.item()])
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            for one in optimizer:
                one.step()
                one.zero_grad()
            losses.append(step_losses)
        dump(out, "after_train", capture(model, optimizer))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        (out / "run.json").write_text(json.dumps({"world_size": world, "losses": gathered}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="a bundled case name (make_sample_ckpts.py --list), or a Case as asdict JSON")
    ap.add_argument(
        "--hf-model", type=Path, help="instead of --case: a Hugging Face Trainer checkpoint-N folder (its config.json)"
    )
    ap.add_argument("--dcp", required=True, help="the folder zckpt to-dcp wrote")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument(
        "--clip-grad", type=float, default=1.0, help="max gradient norm (DeepSpeed's default gradient_clipping: 1.0)"
    )
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (the saving run's world size)")
    args = ap.parse_args()
    if (args.case is None) == (args.hf_model is None):
        ap.error("give one of --case and --hf-model")
    if args.hf_model is not None and args.train_steps:
        ap.error("--train-steps needs --case (its data stream)")
    try:
        worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        # everything is written: skip the interpreter's teardown, where gloo's threads now and
        # then abort the process ("terminate called without an active exception", exit -6)
        os._exit(0)
    except BaseException:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"error_rank{os.environ.get('RANK', '0')}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()

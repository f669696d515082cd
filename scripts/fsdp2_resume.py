#!/usr/bin/env python3
"""Resume a ``zckpt to-dcp`` folder under FSDP2 at W ranks (gloo, CPU) and dump what the run holds.

Per-rank worker, started by torchrun with an interpreter that has torch (no DeepSpeed needed)::

    python -m torch.distributed.run --nproc-per-node W --master-port P scripts/fsdp2_resume.py \\
        --case NAME --dcp DIR --out OUTDIR [--train-steps K] [--micro-batches M]

The model and its param groups are built exactly as ``make_sample_ckpts.py`` builds them for the
bundled case NAME (its ``build_model`` / ``param_groups``), in fp32; ``fc1``, ``fc2`` and then the
whole model are sharded with ``fully_shard`` (tied ``embed``/``lm_head`` and the frozen adapter in
the root's group); the optimizer is ``torch.optim.AdamW`` over those groups. Then the README's
recipe, word for word::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Rank 0 writes into OUTDIR what the run holds after the load (full state dicts gathered with
``get_state_dict(..., full_state_dict=True, cpu_offload=True)``): ``loaded_model.safetensors`` (every
name of the module's state dict), ``loaded_optim.safetensors`` (``<name>.<state>`` for every
per-element optimizer state) and ``loaded.json`` (each param's ``step``, the param groups without
their tensors). With ``--train-steps K``, K more AdamW steps follow and the same capture is written
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
    return model, torch.optim.AdamW(groups, lr=1e-3)


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
        optimizer = torch.optim.AdamW(gen.param_groups(model, case), lr=1e-2, weight_decay=0.01)

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
            optimizer.step()
            optimizer.zero_grad()
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

#!/usr/bin/env python3
"""A tiny Accelerate + DeepSpeed ZeRO run on CPU that ends with ``accelerator.save_state(DIR)``
and dumps the engine's fp32 masters as the truth a consolidation must give back.

Run under torchrun (one process per data-parallel rank)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc-per-node 2 scripts/accelerate_run.py \\
        --out RUN --stage 3 [--bf16] [--untied] [--steps 3]

What it writes:

* ``RUN/state/``: what ``accelerator.save_state`` writes with DeepSpeed (accelerate 1.15 calls
  ``engine.save_checkpoint(RUN/state, "pytorch_model")``): ``latest`` (naming ``pytorch_model``),
  the tag folder ``pytorch_model/`` with the ZeRO files, ``zero_to_fp32.py``, accelerate's own
  ``random_states_<rank>.pkl`` (plain pickles), ``scheduler.bin`` (the torch lr scheduler that
  accelerate, not DeepSpeed, saves) and the data loader's sampler state where it has one. Then
  ``config.json`` and ``generation_config.json`` of the model (``model.config.save_pretrained``,
  which is what an Accelerate user adds to get a ``from_pretrained`` folder back).
* ``RUN/masters.safetensors`` (rank 0): every parameter's full fp32 master right after the save
  (``deepspeed.utils.safe_get_full_fp32_param``, called on every rank in the same order), under
  the module's own names (``named_parameters``: a tied ``lm_head.weight`` is not listed).
* ``RUN/run.json`` (rank 0): world_size, stage, dtype, tied, steps with their mean loss, done.
* ``RUN/error_rank<R>.txt``: a failing rank's traceback.

Model and data are those of ``scripts/hf_trainer_run.py`` (a 2-layer Llama from a ``LlamaConfig``,
vocabulary 64, hidden 32; a synthetic counting data set), built here with ``--untied`` giving
``tie_word_embeddings=False``. torch ``AdamW`` (DeepSpeed wraps it, ``zero_allow_untested_optimizer``)
and a torch ``LambdaLR`` warm-up schedule, both passed through ``accelerator.prepare``.

CPU workarounds (accelerate 1.15, DeepSpeed 0.19.8, no GPU), as in ``hf_trainer_run.py``:
accelerate's state is made first as ``PartialState(backend="gloo")`` with
``ACCELERATE_USE_DEEPSPEED=true`` set while it is made (otherwise each rank believes it is alone);
the ``Accelerator`` made next reuses it. ``cpu=True`` is not passed (it would turn DeepSpeed off).
``--bf16``: the DeepSpeed config enables bf16 and ``mixed_precision="bf16"`` is passed; CPU bf16
trains at ZeRO-1/2/3. DeepSpeed's leaked ``/dev/shm`` buffers are removed by the caller.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer_run import SEQ_LEN, VOCAB, make_dataset  # noqa: E402 (data shared with the Trainer run)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="run folder: state/, masters.safetensors, run.json")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (default fp32)")
    p.add_argument("--untied", action="store_true", help="tie_word_embeddings=False (default tied)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def ds_config(args: argparse.Namespace, world_size: int) -> dict:
    zero: dict[str, Any] = {"stage": args.stage}
    if args.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "train_batch_size": args.batch_size * world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bool(args.bf16)},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return run(args)
    except BaseException:
        (args.out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run(args: argparse.Namespace) -> int:
    import accelerate

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        accelerate.PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]

    import torch
    import torch.distributed as dist
    from accelerate.utils import DeepSpeedPlugin, set_seed
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    world_size = dist.get_world_size()
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args, world_size))
    accelerator = accelerate.Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16" if args.bf16 else "no")
    assert accelerator.num_processes == world_size, (accelerator.num_processes, world_size)

    set_seed(args.seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=not args.untied,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    loader = torch.utils.data.DataLoader(
        make_dataset(args.batch_size * world_size * args.steps, args.seed),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    record: dict[str, Any] = {
        "world_size": world_size,
        "stage": args.stage,
        "dtype": "bf16" if args.bf16 else "fp32",
        "tied": not args.untied,
        "steps": [],
    }
    engine.train()
    for step, batch in enumerate(loader, start=1):
        loss = engine(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = torch.tensor([float(loss.detach().float())], dtype=torch.float64)
        dist.all_reduce(mean)
        record["steps"].append({"step": step, "loss": float(mean.item()) / world_size})
        if step >= args.steps:
            break

    state_dir = args.out / "state"
    accelerator.save_state(str(state_dir))
    module = accelerator.unwrap_model(engine)
    masters = {
        name: safe_get_full_fp32_param(p).detach().float().cpu().clone() for name, p in module.named_parameters()
    }
    if accelerator.is_main_process:
        module.config.save_pretrained(str(state_dir))
        module.generation_config.save_pretrained(str(state_dir))
        save_file(masters, str(args.out / "masters.safetensors"))
        record["global_steps"] = int(engine.global_steps)
        record["done"] = all(math.isfinite(s["loss"]) for s in record["steps"])
        (args.out / "run.json").write_text(json.dumps(record, indent=1))
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rank_exit import leave

    leave(main())

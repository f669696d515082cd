#!/usr/bin/env python3
"""A tiny Hugging Face Trainer + DeepSpeed ZeRO run on CPU that writes ``checkpoint-N`` folders,
resumes from one, and records what the resume restored.

Run under torchrun (one process per data-parallel rank)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc-per-node P scripts/hf_trainer_run.py \\
        --out DIR --max-steps K --save-steps S --stage Z [--resume-from DIR/checkpoint-N] [--bf16]

Model and data need no download: a 2-layer Llama built from a ``LlamaConfig`` (vocabulary 64,
hidden size 32, tied embeddings, no dropout), initialised from ``--seed``, and a synthetic,
deterministic, learnable token data set (each sequence counts up by one modulo the vocabulary
from a seeded random start), so the loss falls quickly from about ln(64). Trainer's own
``adamw_torch`` optimizer (DeepSpeed wraps it in its ZeRO optimizer, ``zero_allow_untested_optimizer``)
and Trainer's own linear scheduler with warm-up (not passed to DeepSpeed: saved as ``scheduler.pt``
and restored from it by the Trainer). ``gradient_accumulation_steps`` 1, ``logging_steps`` 1.

Rank 0 writes ``DIR/run.json`` (rewritten after every step, so a crash leaves what was reached)::

    world_size, stage, dtype, resumed_from
    steps: [{"step": s, "loss": mean over ranks of the per-rank loss of optimizer step s (float,
             not Trainer's 4-digit rounding), "lr": the lr step s used, "trainer_loss": Trainer's
             logged loss}, ...]
    resume: (with --resume-from) what was loaded, read at on_step_begin of the first step after the
            load: trainer_global_step, engine_global_steps, engine_global_samples, adam_steps (every
            AdamW state "step" on every rank), exp_avg_nonzero / exp_avg_sq_nonzero (per probed
            param, via deepspeed.utils.safe_get_full_optimizer_state, called on all ranks), lr
            (the lr the next step will use), num_processes, rng_file (the RNG file the Trainer
            will look for at this process count, and whether it is there)
    probes: {global_step: same fields} for every on_step_begin at a global step in --probe-at
            (default: the multiples of --save-steps), so a resumed run can be compared with the
            original run at the same step

and ``DIR/probe_step<N>.pt`` (rank 0) per probe: ``{param name: {"fp32": full fp32 master,
"exp_avg": ..., "exp_avg_sq": ...}}`` for the probed params, for bit-for-bit comparisons.
A failing rank writes ``DIR/error_rank<R>.txt`` (its traceback).

With ``--dump-masters``, at every save (``on_save``, right after ``checkpoint-N`` is written) rank 0
writes ``DIR/masters_step<N>.safetensors``: every parameter's full fp32 master
(``safe_get_full_fp32_param`` on all ranks) under ``named_parameters`` names (a tied ``lm_head`` is
not listed). ``--untied`` builds the model with ``tie_word_embeddings=False``.

CPU workarounds (transformers 5.23, accelerate 1.15, DeepSpeed 0.19.8, no GPU; see
/work/shared/FORMAT_NOTES.md "Hugging Face Trainer / PEFT checkpoints"):

* With no GPU, accelerate picks no distributed backend and each rank believes it is alone
  (``num_processes`` 1). Fix: create ``accelerate.PartialState(backend="gloo")`` first, with
  ``ACCELERATE_USE_DEEPSPEED=true`` set while it is made (so it initialises ``deepspeed.comm`` and
  is of type DEEPSPEED, which ``TrainingArguments`` insists on), and pass
  ``accelerator_config={"use_configured_state": True}`` so ``TrainingArguments`` reuses it.
* ``use_cpu=True`` would turn DeepSpeed off, so it is not set; the device is CPU anyway.
* ``--bf16``: ``TrainingArguments(bf16=True)`` refuses without a bf16 GPU; its
  ``is_torch_bf16_gpu_available`` check is patched to return True (bf16 then trains on CPU at
  ZeRO-1/2/3). fp32 (the default) needs no patch.
* ZeRO-1/2 and ``safe_get_full_optimizer_state`` (DeepSpeed 0.19.8): a param's optimizer-state
  fragments are linked once, right after the *first param group's* optimizer step
  (``_optimizer_step`` -> ``_lazy_init_hp_params_optimizer_state``), when the state of the other
  groups does not exist yet: params of groups >= 1 (here Trainer's no-weight-decay group: the
  norms) get an empty link and the call raises "exp_avg not found in optimizer state fragment".
  After ``load_checkpoint`` nothing is linked until the next step. The probe therefore re-links
  every group itself (``mixed_precision_linkage.lazy_init_hp_params_optimizer_state``, the
  function DeepSpeed uses) before reading; the links are views into the state and change no value.
* DeepSpeed's CPU runs leak ``/dev/shm/deepspeed_allreduce_buffer_*``; the caller removes them
  (``scripts/shm_leaks.py``).
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

VOCAB = 64
SEQ_LEN = 16
PROBED_PARAMS = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="Trainer output_dir (checkpoint-N folders go here)")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, required=True)
    p.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--resume-from", type=Path, help="a checkpoint-N folder to resume from")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (default fp32)")
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--samples", type=int, default=192, help="data set size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--probe-at", type=int, nargs="*", help="global steps to probe at (default: multiples of --save-steps)"
    )
    p.add_argument("--untied", action="store_true", help="tie_word_embeddings=False (default tied)")
    p.add_argument(
        "--dump-masters",
        action="store_true",
        help="at every save, rank 0 writes OUT/masters_step<N>.safetensors: every param's full fp32 master",
    )
    return p.parse_args(argv)


def make_dataset(n: int, seed: int) -> Any:
    """n sequences of SEQ_LEN tokens counting up by one modulo VOCAB from a seeded random start."""
    import torch

    starts = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    ids = (starts[:, None] + torch.arange(SEQ_LEN)[None, :]) % VOCAB

    class Counting(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long)}

    return Counting()


def ds_config(stage: int) -> dict:
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def setup_distributed(bf16: bool) -> Any:
    """The CPU workarounds (module docstring); returns accelerate's PartialState."""
    import accelerate

    if bf16:
        import transformers.training_args as training_args

        training_args.is_torch_bf16_gpu_available = lambda *a, **k: True
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        state = accelerate.PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return state


def relink_zero12_optimizer_state(zero_opt: Any) -> None:
    """ZeRO-1/2: (re)link every param's optimizer-state fragments to the loaded/current state of its
    group's fp32 partition, so ``safe_get_full_optimizer_state`` works (see the module docstring)."""
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    if not hasattr(zero_opt, "single_partition_of_fp32_groups"):
        return  # ZeRO-3 reads the optimizer state directly
    state = zero_opt.optimizer.state
    for lp_params, flat in zip(zero_opt.bit16_groups, zero_opt.single_partition_of_fp32_groups):
        if flat in state:  # (`state` is a defaultdict: indexing would add an empty entry)
            lazy_init_hp_params_optimizer_state(lp_params, flat, state)


def optimizer_probe(trainer: Any, names: tuple[str, ...]) -> tuple[dict, dict]:
    """Collective (every rank, same order). Returns (summary, {name: tensors}) on every rank."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = trainer.model_wrapped
    zero_opt = engine.optimizer
    base = zero_opt.optimizer
    relink_zero12_optimizer_state(zero_opt)
    local_steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_steps)
    params = dict(engine.module.named_parameters())
    tensors: dict[str, dict] = {}
    has_state = len(base.state) > 0
    # all ranks must agree whether to call the collectives
    flag = torch.tensor([1 if has_state else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    for name in names:
        p = params[name]
        entry = {"fp32": safe_get_full_fp32_param(p).detach().float().cpu().clone()}
        if flag.item():
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(p, key).detach().float().cpu().clone()
        tensors[name] = entry
    summary = {
        "adam_steps": sorted({s for r in gathered for s in r}),
        "adam_steps_per_rank": gathered,
        "exp_avg_nonzero": {
            n: bool(t["exp_avg"].abs().sum() > 0) if "exp_avg" in t else False for n, t in tensors.items()
        },
        "exp_avg_sq_nonzero": {
            n: bool(t["exp_avg_sq"].abs().sum() > 0) if "exp_avg_sq" in t else False for n, t in tensors.items()
        },
        "fp32_finite": {n: bool(torch.isfinite(t["fp32"]).all()) for n, t in tensors.items()},
    }
    return summary, tensors


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
    state = setup_distributed(args.bf16)

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

    probe_at = (
        set(args.probe_at)
        if args.probe_at is not None
        else set(range(args.save_steps, args.max_steps, args.save_steps))
    )
    targs = TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=args.bf16,
        seed=args.seed,
        data_seed=args.seed,
        deepspeed=ds_config(args.stage),
        accelerator_config={"use_configured_state": True},
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert targs.world_size == state.num_processes == dist.get_world_size(), (targs.world_size, state.num_processes)

    set_seed(args.seed)  # model init (overwritten by the checkpoint when resuming)
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
    dataset = make_dataset(args.samples, args.seed)
    record: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "stage": args.stage,
        "dtype": "bf16" if args.bf16 else "fp32",
        "resumed_from": str(args.resume_from) if args.resume_from else None,
        "steps": [],
        "resume": None,
        "probes": {},
    }

    def dump() -> None:
        if dist.get_rank() == 0:
            tmp = args.out / "run.json.tmp"
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(args.out / "run.json")

    micro_losses: list[float] = []  # this rank's losses since the last optimizer step

    class RecordingTrainer(Trainer):
        """Records each micro-step's loss (exact, before Trainer's rounding for logs)."""

        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            loss = super().training_step(model, inputs, num_items_in_batch)
            micro_losses.append(float(loss.detach().float()))
            return loss

    trainer: Any = None

    class Recorder(TrainerCallback):
        first = True
        pending_lr: float | None = None
        trainer_losses: dict[int, float] = {}

        def on_step_begin(self, a, st, control, **kw):
            self.pending_lr = float(kw["lr_scheduler"].get_last_lr()[0])
            probe_now = st.global_step in probe_at or (self.first and args.resume_from is not None)
            if probe_now:
                summary, tensors = optimizer_probe(trainer, PROBED_PARAMS)
                engine = trainer.model_wrapped
                summary.update(
                    {
                        "trainer_global_step": st.global_step,
                        "engine_global_steps": int(engine.global_steps),
                        "engine_global_samples": int(engine.global_samples),
                        "lr": self.pending_lr,
                        "optimizer_lrs": [float(g["lr"]) for g in trainer.optimizer.param_groups],
                        "num_processes": dist.get_world_size(),
                    }
                )
                if self.first and args.resume_from is not None:
                    ws = dist.get_world_size()
                    rng = "rng_state.pth" if ws == 1 else f"rng_state_{dist.get_rank()}.pth"
                    present = [None] * ws
                    dist.all_gather_object(present, [rng, (args.resume_from / rng).is_file()])
                    summary["rng_files"] = present
                    record["resume"] = summary
                if st.global_step in probe_at:
                    record["probes"][str(st.global_step)] = summary
                if dist.get_rank() == 0:
                    torch.save(tensors, args.out / f"probe_step{st.global_step}.pt")
                dump()
            self.first = False

        def on_step_end(self, a, st, control, **kw):
            mean = torch.tensor([sum(micro_losses) / max(len(micro_losses), 1)], dtype=torch.float64)
            dist.all_reduce(mean)
            micro_losses.clear()
            record["steps"].append(
                {"step": st.global_step, "loss": float(mean.item()) / dist.get_world_size(), "lr": self.pending_lr}
            )
            dump()

        def on_save(self, a, st, control, **kw):
            if args.dump_masters:  # collective: every rank, same order
                from deepspeed.utils import safe_get_full_fp32_param
                from safetensors.torch import save_file

                masters = {
                    name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
                    for name, p in trainer.model_wrapped.module.named_parameters()
                }
                if dist.get_rank() == 0:
                    save_file(masters, str(args.out / f"masters_step{st.global_step}.safetensors"))
                dist.barrier()

        def on_log(self, a, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                for entry in record["steps"]:
                    if entry["step"] == st.global_step:
                        entry["trainer_loss"] = logs["loss"]
                dump()

    trainer = RecordingTrainer(model=model, args=targs, train_dataset=dataset, callbacks=[Recorder()])
    result = trainer.train(resume_from_checkpoint=str(args.resume_from) if args.resume_from else None)
    record["final_global_step"] = trainer.state.global_step
    record["train_loss"] = float(result.training_loss)
    record["done"] = all(math.isfinite(s["loss"]) for s in record["steps"])
    dump()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rank_exit import leave

    leave(main())

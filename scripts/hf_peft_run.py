#!/usr/bin/env python3
"""A tiny Hugging Face Trainer + PEFT LoRA run under DeepSpeed ZeRO on CPU, with the truth to
check zckpt's adapter and merged outputs against.

One command does it all (it starts torchrun itself, then a plain process for the merge)::

    DS_ACCELERATOR=cpu python scripts/hf_peft_run.py --out DIR --model llama --stage 3 --bf16 \\
        --processes 2 --max-steps 3

writes::

    DIR/base/                 the base model (random init from --seed, save_pretrained: config.json +
                              safetensors, bf16 with --bf16, sharded when --base-shard-size is given);
                              the run loads it with from_pretrained (under ZeRO-3 through zero.Init),
                              as users load theirs, and wraps it with get_peft_model
    DIR/checkpoint-N/         what the Trainer saved: latest, global_stepN/, adapter_config.json,
                              adapter_model.safetensors, README.md, trainer_state.json, ...
    DIR/live_stepN.safetensors  every trainable param's fp32 master, read from the live engine
                              (``safe_get_full_fp32_param``) in ``on_save``, right after the save,
                              under the module's names (``base_model.model.<...>.lora_A.default.weight``)
    DIR/merged_stepN.safetensors  PEFT's own merge: ``PeftModel.from_pretrained(base, checkpoint-N)``
                              (base loaded from DIR/base in its saved dtype), its trainable params set
                              to the live fp32 masters, then ``merge_and_unload()``; its state dict
    DIR/run.json              settings, losses, trainer_adapter_equals_live (the Trainer's own
                              adapter_model.safetensors held the masters bit for bit), files

Models (no download; vocabulary 64, 2 layers, tied embeddings, no dropout):

* ``llama``: ``LlamaForCausalLM``, hidden size 32; LoRA r=4, alpha=8 on q_proj, v_proj, o_proj with
  ``rank_pattern`` {layers.1.self_attn.q_proj: 8} and ``alpha_pattern`` {v_proj: 32}, and
  ``modules_to_save`` ["model.norm"]; with ``--embedding`` also on embed_tokens (an Embedding LoRA).
* ``gpt2``: ``GPT2LMHeadModel``, hidden size 16 (``Conv1D`` layers, so PEFT uses ``fan_in_fan_out``); LoRA r=4,
  alpha=8 on c_attn and c_fc with ``use_rslora``, ``lora_bias`` (a bias on lora_B) and
  ``bias="all"`` (every bias of the base trains too).

The data and the CPU workarounds are those of ``scripts/hf_trainer_run.py`` (imported from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer_run import SEQ_LEN, VOCAB, ds_config, make_dataset, setup_distributed  # noqa: E402
from shm_leaks import removing_shm_leaks  # noqa: E402

LORA = {
    "llama": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 8},
        alpha_pattern={"v_proj": 32},
        modules_to_save=["model.norm"],
    ),
    "gpt2": dict(
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True,
        use_rslora=True,
        lora_bias=True,
        bias="all",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", choices=sorted(LORA), default="llama")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--processes", type=int, default=2, help="torchrun processes (data-parallel ranks)")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--save-steps", type=int, help="default: --max-steps (one checkpoint)")
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--base-shard-size", help="save the base sharded at this size, e.g. 40KB")
    p.add_argument("--embedding", action="store_true", help="llama: LoRA on embed_tokens too (an Embedding LoRA)")
    p.add_argument("--master-port", type=int, default=29533)
    p.add_argument(
        "--role",
        choices=("launch", "train", "merge"),
        default="launch",
        help="launch (default): torchrun the training, then the merge; train/merge: one step",
    )
    args = p.parse_args(argv)
    args.save_steps = args.save_steps or args.max_steps
    return args


def build_base(model: str) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if model == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=None,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    return GPT2LMHeadModel(config)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """torchrun the training, then the merge in a plain process (no DeepSpeed config active)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(args.processes)}
    script = str(Path(__file__).resolve())
    train = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.processes),
        "--master-port",
        str(args.master_port),
        script,
        *argv,
        "--role",
        "train",
    ]
    with removing_shm_leaks():
        if subprocess.run(train, env=env).returncode != 0:
            return 1
    return subprocess.run([sys.executable, script, *argv, "--role", "merge"], env=env).returncode


def train(args: argparse.Namespace) -> None:
    setup_distributed(args.bf16)

    from importlib.metadata import version

    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

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
        save_only_model=False,
    )
    base_dir = args.out / "base"
    if dist.get_rank() == 0:
        set_seed(args.seed)
        base = build_base(args.model)
        if args.bf16:
            base = base.to(torch.bfloat16)  # a bf16 base, as users load Qwen/Llama for LoRA
        base.save_pretrained(base_dir, **({"max_shard_size": args.base_shard_size} if args.base_shard_size else {}))
    dist.barrier()
    # loaded as users load theirs (under ZeRO-3: partitioned at load by zero.Init)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    set_seed(args.seed)  # LoRA init
    # PEFT upcasts LoRA params to fp32 by default; ZeRO-3 partitions a base loaded through zero.Init
    # and then asserts one dtype for all trainable params (stage3 `defragment`), so a bf16 run keeps
    # them bf16 (the usual fix); the optimizer holds fp32 masters either way
    lora = dict(LORA[args.model])
    if args.embedding:
        lora["target_modules"] = [*lora["target_modules"], "embed_tokens"]
    model = get_peft_model(
        base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora), autocast_adapter_dtype=not args.bf16
    )
    record: dict[str, Any] = {
        "model": args.model,
        "stage": args.stage,
        "dtype": "bf16" if args.bf16 else "fp32",
        "world_size": dist.get_world_size(),
        "lora": lora,
        "losses": [],
        "saves": {},
        "versions": {m: version(m) for m in ("deepspeed", "torch", "transformers", "accelerate", "peft")},
        "command": "DS_ACCELERATOR=cpu python scripts/hf_peft_run.py "
        + " ".join(sys.argv[1:]).replace(" --role train", ""),
    }
    trainer: Any = None

    def dump() -> None:
        if dist.get_rank() == 0:
            (args.out / "run.json").write_text(json.dumps(record, indent=1))

    class Recorder(TrainerCallback):
        def on_save(self, a, st, control, **kw):
            module = trainer.model_wrapped.module
            live = {
                n: safe_get_full_fp32_param(p).detach().float().cpu().clone().contiguous()
                for n, p in module.named_parameters()
                if p.requires_grad
            }
            if dist.get_rank() == 0:
                name = f"live_step{st.global_step}.safetensors"
                save_file(live, str(args.out / name))
                record["saves"][str(st.global_step)] = {
                    "checkpoint": f"checkpoint-{st.global_step}",
                    "live": name,
                    "trainable": {n: list(t.shape) for n, t in live.items()},
                }
                dump()
            dist.barrier()

        def on_log(self, a, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                record["losses"].append([st.global_step, logs["loss"]])

    trainer = Trainer(
        model=model, args=targs, train_dataset=make_dataset(args.samples, args.seed), callbacks=[Recorder()]
    )
    trainer.train()
    dump()
    dist.barrier()


def merge(args: argparse.Namespace) -> None:
    """PEFT's own merge of each saved adapter (set to the engine's masters) into the base."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    record = json.loads((args.out / "run.json").read_text())
    for step, save in record["saves"].items():
        base = AutoModelForCausalLM.from_pretrained(args.out / "base")
        model = PeftModel.from_pretrained(base, args.out / save["checkpoint"])
        live = load_file(args.out / save["live"])
        params = dict(model.named_parameters())
        save["trainer_adapter_equals_live"] = all(torch.equal(params[n].detach().float(), t) for n, t in live.items())
        save["base_dtype"] = str(base.dtype).removeprefix("torch.")
        with torch.no_grad():
            for name, tensor in live.items():
                params[name].copy_(tensor)
        merged = model.merge_and_unload()
        state = {n: t.detach().clone().contiguous() for n, t in merged.state_dict().items()}
        save["merged"] = f"merged_step{step}.safetensors"
        save_file(state, str(args.out / save["merged"]))
    (args.out / "run.json").write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.role == "launch":
        return launch(args, [a for a in argv if a not in ("--role", "launch")])
    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.role == "train":
            train(args)
        else:
            merge(args)
    except BaseException:
        (args.out / f"error_{args.role}_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rank_exit import leave

    leave(0)  # a torchrun rank, done: out before gloo's teardown can abort the exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

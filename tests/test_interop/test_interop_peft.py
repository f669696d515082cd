"""PEFT LoRA runs under DeepSpeed, consolidated by zckpt, loaded by PEFT and transformers.

``scripts/hf_peft_run.py`` runs a Trainer + PEFT LoRA run (2 processes, CPU) that is not in the
repository, and records the engine's fp32 masters at the save and PEFT's own
``merge_and_unload()`` of them:

* Llama under ZeRO-3 in bf16 (base loaded through zero.Init), LoRA on q/v/o_proj and on
  embed_tokens (an Embedding LoRA), rank_pattern/alpha_pattern, modules_to_save;
* GPT-2 under ZeRO-2 in fp32: Conv1D layers (fan_in_fan_out), rsLoRA, lora_bias, bias="all".

zckpt's adapter folder must load with ``PeftModel.from_pretrained`` and hold the masters bit for
bit; its merged folder must load with ``AutoModelForCausalLM.from_pretrained`` and equal PEFT's
merge bit for bit (zckpt does PEFT's arithmetic in PEFT's order, on the same fp32 masters), in the
base's dtype and, for the bf16 base, in fp32 too (against PEFT merging into the base loaded in
fp32). About a minute on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT
from interop_helpers import ds_python, free_port, run_hf_job, shm_leak_safety_net  # noqa: F401 (autouse fixture)
from zckpt import consolidate

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "hf_peft_run.py"
STEPS = 2
RUNS = {
    "llama-z3-bf16": ["--model", "llama", "--stage", "3", "--bf16", "--embedding", "--base-shard-size", "30KB"],
    "gpt2-z2-fp32": ["--model", "gpt2", "--stage", "2"],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """run(name) -> (output folder, run.json) of that Trainer run (made once)."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    python = ds_python()
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Any]]:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            cmd = [
                python,
                str(SCRIPT),
                "--out",
                str(out),
                "--processes",
                "2",
                "--max-steps",
                str(STEPS),
                "--master-port",
                str(free_port()),
                *RUNS[name],
            ]
            made[name] = (out, run_hf_job(f"hf_peft_run.py {name}", cmd, out, 2, python))
        return made[name]

    return get


def saved(out: Path, record: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    save = record["saves"][str(STEPS)]
    return out / save["checkpoint"], save


@pytest.mark.parametrize("name", sorted(RUNS))
def test_peft_loads_zckpts_adapter_with_the_engine_masters(run: Callable, name: str, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, record = run(name)
    checkpoint, save = saved(out, record)
    live = load_file(out / save["live"])
    result = consolidate(checkpoint, tmp_path / "adapter")
    assert result.peft == "adapter" and result.tensors == len(live)
    trainer = load_file(checkpoint / "adapter_model.safetensors")
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == set(trainer)  # PEFT's own names

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), tmp_path / "adapter")
    params = dict(model.named_parameters())
    assert set(live) <= set(params)
    for key, master in live.items():
        held = params[key].detach()
        # LoRA weights load in fp32 (PEFT upcasts adapters): the masters themselves; copies of
        # base modules (modules_to_save, trained biases) take the base's dtype, as PEFT's own file would
        assert torch.equal(held, master.to(held.dtype)), key
        if held.dtype == torch.float32:
            assert torch.equal(held, master), key


@pytest.mark.parametrize("name", sorted(RUNS))
def test_merged_model_equals_peft_merge_and_unload(run: Callable, name: str, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, record = run(name)
    checkpoint, save = saved(out, record)
    truth = load_file(out / save["merged"])
    result = consolidate(checkpoint, tmp_path / "merged", merge_into=out / "base")
    assert result.dtype.name == save["base_dtype"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert str(model.dtype) == f"torch.{save['base_dtype']}"  # config.json states the dtype written
    state = model.state_dict()
    assert set(state) == set(truth)
    differing = [k for k in truth if not torch.equal(state[k], truth[k])]
    assert not differing, differing
    base = AutoModelForCausalLM.from_pretrained(out / "base").state_dict()
    assert [k for k in truth if not torch.equal(base[k], truth[k])]  # the merge changed something


def test_fp32_merge_of_a_bf16_base_equals_peft_on_the_base_loaded_in_fp32(run: Callable, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, record = run("llama-z3-bf16")
    checkpoint, save = saved(out, record)
    assert save["base_dtype"] == "bfloat16"
    consolidate(checkpoint, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    truth = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    consolidate(checkpoint, tmp_path / "merged", merge_into=out / "base", dtype="fp32")
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert all(t.dtype == torch.float32 for t in state.values())
    differing = [k for k in truth if not torch.equal(state[k], truth[k])]
    assert not differing, differing

"""zckpt's consolidation of a Hugging Face Trainer ``checkpoint-N`` loads with transformers'
``AutoModelForCausalLM.from_pretrained`` and holds the engine's fp32 masters bit for bit.

``scripts/hf_trainer_run.py --dump-masters`` runs the Trainer under DeepSpeed on CPU (2 processes,
2 steps, a tiny Llama) and, right after it saves ``checkpoint-2``, dumps every parameter's full
fp32 master (``safe_get_full_fp32_param`` on all ranks). Two runs, covering ZeRO-2/ZeRO-3, fp32/bf16
and tied/untied embeddings between them: ZeRO-2 fp32 with tied embeddings, ZeRO-3 bf16 untied.

Checked: the folder ``consolidate`` writes from ``checkpoint-2`` loads with ``from_pretrained``
with no missing or unexpected key, in fp32 (``config.json`` says ``float32`` even for the bf16
run, whose own config says ``bfloat16``), every weight equal to its master bit for bit, a tied
``lm_head`` tied again; the Trainer's output folder as CHECKPOINT gives the same file (its newest
``checkpoint-N``); ``--dtype bf16`` output loads in bf16 as the masters rounded by torch.

Needs DeepSpeed and transformers/accelerate in this interpreter (the weights are loaded here) and
in ``ds_python()``'s; skipped otherwise. About a minute on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT
from interop_helpers import (  # noqa: F401 (autouse fixture)
    ds_python,
    free_port,
    launcher,
    run_hf_job,
    shm_leak_safety_net,
)
from zckpt import consolidate

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "hf_trainer_run.py"
STEPS = 2
RUNS = {
    "z2-fp32-tied": ["--stage", "2"],
    "z3-bf16-untied": ["--stage", "3", "--bf16", "--untied"],
}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """trainer_run(name) -> (Trainer output folder, run.json), made once per name."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    python = ds_python()
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Any]]:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            cmd = [
                *launcher(python),
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(SCRIPT),
                "--out",
                str(out),
                "--max-steps",
                str(STEPS),
                "--save-steps",
                str(STEPS),
                "--batch-size",
                "8",
                "--samples",
                "64",
                "--dump-masters",
                *RUNS[name],
            ]
            made[name] = (
                out,
                run_hf_job(
                    f"hf_trainer_run.py {name}",
                    cmd,
                    out,
                    2,
                    python,
                    log_name="trainer.log",
                    outputs=(f"masters_step{STEPS}.safetensors",),
                ),
            )
        return made[name]

    return get


def check_loads_masters(folder: Path, masters: dict[str, Any], tied: bool) -> Any:
    """``from_pretrained(folder)``: fp32, no missing/unexpected keys, every weight its master."""
    import torch
    from transformers import AutoModelForCausalLM

    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert model.dtype == torch.float32
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    expected = set(masters) | {"lm_head.weight"}
    assert set(state) == expected, set(state) ^ expected
    differing = [k for k, v in masters.items() if not torch.equal(state[k], v)]
    assert not differing, differing
    assert model.config.tie_word_embeddings == tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return model


@pytest.mark.parametrize("name", sorted(RUNS))
def test_from_pretrained_loads_the_engine_masters(trainer_run: Callable, name: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out, record = trainer_run(name)
    assert [s["step"] for s in record["steps"]] == [1, 2] and record["final_global_step"] == STEPS
    checkpoint = out / f"checkpoint-{STEPS}"
    masters = load_file(out / f"masters_step{STEPS}.safetensors")
    tied = "--untied" not in RUNS[name]
    assert ("lm_head.weight" in masters) != tied
    own = json.loads((checkpoint / "config.json").read_text())
    assert own["dtype"] == ("bfloat16" if "--bf16" in RUNS[name] else "float32")

    result = consolidate(checkpoint, tmp_path / "model")
    assert result.tensors == len(masters) + tied  # a tied lm_head is written too, as zero_to_fp32 does
    check_loads_masters(tmp_path / "model", masters, tied)


def test_trainer_output_folder_and_bf16_output(trainer_run: Callable, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = trainer_run("z3-bf16-untied")
    masters = load_file(out / f"masters_step{STEPS}.safetensors")
    consolidate(out / f"checkpoint-{STEPS}", tmp_path / "direct")
    result = consolidate(out, tmp_path / "from_output_dir")  # the newest checkpoint-N
    assert any(f"checkpoint-{STEPS}" in n for n in result.index.notes), result.index.notes
    assert (tmp_path / "from_output_dir" / "model.safetensors").read_bytes() == (
        tmp_path / "direct" / "model.safetensors"
    ).read_bytes()

    consolidate(out / f"checkpoint-{STEPS}", tmp_path / "bf16", dtype="bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    differing = [k for k, v in masters.items() if not torch.equal(state[k], v.to(torch.bfloat16))]
    assert not differing, differing

"""PEFT LoRA checkpoints: the adapter folder PEFT writes, the merge into a base model, inspect.

The samples in ``sample_ckpts/peft_lora/`` were made by real Trainer + PEFT 0.21 + DeepSpeed
0.19.8 runs on CPU (``scripts/hf_peft_run.py``, command in each ``run.json``):

* ``llama_z3_bf16_ws2``: ZeRO-3, bf16, 2 ranks; LoRA on q/v/o_proj with rank_pattern and
  alpha_pattern, modules_to_save ``model.norm``; a bf16 base saved in two shards; tied embeddings
  (the model states name ``lm_head.weight`` -> ``embed_tokens.weight``, which is not in the files).
* ``gpt2_z2_fp32_ws2``: ZeRO-2, fp32, 2 ranks; GPT-2 ``Conv1D`` layers (fan_in_fan_out), rsLoRA,
  ``lora_bias`` and ``bias="all"``.

Truth, from the engine and from PEFT (nothing recomputed with zckpt's code): ``live_step3``
holds every trainable param's fp32 master read from the engine at the save; the Trainer's own
``checkpoint-3/adapter_model.safetensors`` gives PEFT's key names; ``merged_step3`` is PEFT's
``merge_and_unload()`` of that adapter (set to the masters) on the base as loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers import SAMPLES, same_bits
from zckpt import LayoutError, UsageError, consolidate, inspect_path
from zckpt.cli.app import app

PEFT_SAMPLES = SAMPLES / "peft_lora"
RUNS = ("llama_z3_bf16_ws2", "gpt2_z2_fp32_ws2")

try:  # click < 8.2 mixes stderr into output unless told not to; 8.2 always keeps it apart
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()


def run_dir(name: str) -> Path:
    return PEFT_SAMPLES / name


def checkpoint(name: str) -> Path:
    return run_dir(name) / "checkpoint-3"


def live(name: str) -> dict[str, torch.Tensor]:
    return load_file(run_dir(name) / "live_step3.safetensors")


def peft_names(name: str) -> dict[str, torch.Tensor]:
    """The engine's masters under the names PEFT's save_pretrained gives them (its documented
    rule: the adapter name goes, a modules_to_save copy is saved under the module's own name)."""
    return {k.replace(".modules_to_save.default.", ".").replace(".default", ""): t for k, t in live(name).items()}


@pytest.mark.parametrize("name", RUNS)
def test_adapter_holds_the_engine_masters_under_peft_names(name: str, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    result = consolidate(checkpoint(name), out)
    assert result.peft == "adapter" and result.dtype.short == "fp32"
    assert sorted(result.files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    written = load_file(out / "adapter_model.safetensors")
    trainer = load_file(checkpoint(name) / "adapter_model.safetensors")  # written by PEFT itself
    expected = peft_names(name)
    assert set(written) == set(trainer) == set(expected)
    for key, tensor in expected.items():
        assert same_bits(written[key], tensor), key
        # the Trainer's file holds the module's copy: the masters in fp32 runs, rounded in bf16 ones
        assert same_bits(written[key].to(trainer[key].dtype), trainer[key]), key
    with safe_open(out / "adapter_model.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # as PEFT writes it
    for copied in ("adapter_config.json", "README.md"):
        assert (out / copied).read_bytes() == (checkpoint(name) / copied).read_bytes()


def test_adapter_in_bf16_and_as_torch_file(tmp_path: Path) -> None:
    name = "llama_z3_bf16_ws2"
    consolidate(checkpoint(name), tmp_path / "bf16", dtype="bf16")
    written = load_file(tmp_path / "bf16" / "adapter_model.safetensors")
    for key, tensor in peft_names(name).items():
        assert same_bits(written[key], tensor.to(torch.bfloat16)), key
    result = consolidate(checkpoint(name), tmp_path / "bin", format="torch")
    assert "adapter_model.bin" in result.files
    loaded = torch.load(tmp_path / "bin" / "adapter_model.bin", weights_only=True)
    assert all(same_bits(loaded[k], t) for k, t in peft_names(name).items())


def test_no_peft_writes_the_training_names(tmp_path: Path) -> None:
    name = "llama_z3_bf16_ws2"
    consolidate(checkpoint(name), tmp_path / "raw", peft=False)
    written = load_file(tmp_path / "raw" / "model.safetensors")
    assert set(written) == set(live(name)) and all(same_bits(written[k], t) for k, t in live(name).items())


@pytest.mark.parametrize("name", RUNS)
def test_merge_equals_peft_merge_and_unload(name: str, tmp_path: Path) -> None:
    base = run_dir(name) / "base"
    out = tmp_path / "merged"
    result = consolidate(checkpoint(name), out, merge_into=base, max_shard_size="20KB")
    truth = load_file(run_dir(name) / "merged_step3.safetensors")
    base_dtype = json.loads((run_dir(name) / "run.json").read_text())["saves"]["3"]["base_dtype"]
    assert result.peft == "merged" and result.dtype.name == base_dtype  # default: the base's own dtype
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 20KB
    merged: dict[str, torch.Tensor] = {}
    for filename in sorted(set(index["weight_map"].values())):
        merged.update(load_file(out / filename))
    base_names = set(index["weight_map"])
    assert set(merged) == base_names and set(truth) - base_names == {"lm_head.weight"}  # tied: not in the files
    for key, tensor in merged.items():
        assert same_bits(tensor, truth[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == base_dtype
    changed = {k for k in merged if not same_bits(merged[k], load_base(base)[k])}
    assert changed  # the merge did something


def load_base(base: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_merge_streams_the_sharded_base_and_writes_one_file(tmp_path: Path) -> None:
    """A base in two shards, merged into one file: unchanged tensors are the base's bytes."""
    name = "llama_z3_bf16_ws2"
    base = run_dir(name) / "base"
    assert (base / "model.safetensors.index.json").is_file()
    consolidate(checkpoint(name), tmp_path / "m", merge_into=base)
    merged = load_file(tmp_path / "m" / "model.safetensors")
    original = load_base(base)
    assert set(merged) == set(original)
    untouched = [
        k
        for k in original
        if "self_attn.q_proj" not in k and "v_proj" not in k and "o_proj" not in k and k != "model.norm.weight"
    ]
    assert untouched and all(same_bits(merged[k], original[k]) for k in untouched)


def test_merge_in_fp32_from_a_bf16_base(tmp_path: Path) -> None:
    """--dtype fp32: the base widened exactly, the fp32 delta added without rounding to bf16."""
    name = "llama_z3_bf16_ws2"
    result = consolidate(checkpoint(name), tmp_path / "m", merge_into=run_dir(name) / "base", dtype="fp32")
    assert result.dtype.short == "fp32"
    merged = load_file(tmp_path / "m" / "model.safetensors")
    truth = load_file(run_dir(name) / "merged_step3.safetensors")  # bf16
    original = load_base(run_dir(name) / "base")
    for key, tensor in merged.items():
        assert tensor.dtype == torch.float32
        assert same_bits(tensor.to(torch.bfloat16), truth[key]), key  # rounding it gives PEFT's bf16 merge
        if same_bits(truth[key], original[key]):
            assert same_bits(tensor, original[key].float()), key
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float32"


def test_cli_adapter_and_merge(tmp_path: Path) -> None:
    name = "llama_z3_bf16_ws2"
    result = runner.invoke(app, ["consolidate", str(checkpoint(name)), str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("wrote PEFT adapter: 13 tensors") and result.output.count("\n") == 1
    base = run_dir(name) / "base"
    result = runner.invoke(app, ["consolidate", str(checkpoint(name)), str(tmp_path / "m"), "--merge-into", str(base)])
    assert result.exit_code == 0, result.output
    assert f"adapter merged into {base}" in result.output and ", bf16)" in result.output
    result = runner.invoke(
        app, ["consolidate", str(checkpoint(name)), str(tmp_path / "t"), "--merge-into", str(base), "--format", "torch"]
    )
    assert result.exit_code == 2 and "safetensors" in result.stderr
    result = runner.invoke(
        app, ["consolidate", str(checkpoint(name)), str(tmp_path / "n"), "--merge-into", str(base), "--no-peft"]
    )
    assert result.exit_code == 2


def test_merge_into_the_wrong_base_is_refused(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "consolidate",
            str(checkpoint("llama_z3_bf16_ws2")),
            str(tmp_path / "m"),
            "--merge-into",
            str(run_dir("gpt2_z2_fp32_ws2") / "base"),
        ],
    )
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not the base this adapter was trained on" in lines[0]
    assert not (tmp_path / "m").exists()
    result = runner.invoke(
        app, ["consolidate", str(checkpoint("llama_z3_bf16_ws2")), str(tmp_path / "m"), "--merge-into", str(tmp_path)]
    )
    assert result.exit_code == 1 and "not a Hugging Face model folder" in result.stderr


def edited_copy(tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of a sample's checkpoint-3 with adapter_config.json edited."""
    target = tmp_path / name / "checkpoint-3"
    shutil.copytree(checkpoint(name), target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"use_dora": True}, "DoRA"),
        ({"init_lora_weights": "pissa"}, "rewrote the base weights"),
        ({"trainable_token_indices": [1, 2]}, "trainable tokens"),
    ],
)
def test_variants_whose_merge_differs_are_refused(tmp_path: Path, changes: dict, expected: str) -> None:
    copy = edited_copy(tmp_path, "llama_z3_bf16_ws2", **changes)
    with pytest.raises(LayoutError, match=expected):
        consolidate(copy, tmp_path / "m", merge_into=run_dir("llama_z3_bf16_ws2") / "base")
    assert not (tmp_path / "m").exists()
    consolidate(copy, tmp_path / "a")  # the adapter itself is still written
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()


def test_other_adapter_types_are_refused_in_one_line(tmp_path: Path) -> None:
    copy = edited_copy(tmp_path, "llama_z3_bf16_ws2", peft_type="IA3")
    result = runner.invoke(app, ["consolidate", str(copy), str(tmp_path / "a")])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "adapter type IA3 is not supported" in lines[0] and "adapter_config.json" in lines[0]
    assert runner.invoke(app, ["consolidate", str(copy), str(tmp_path / "raw"), "--no-peft"]).exit_code == 0


def test_rank_that_disagrees_with_the_config_is_refused(tmp_path: Path) -> None:
    copy = edited_copy(tmp_path, "llama_z3_bf16_ws2", rank_pattern={})
    with pytest.raises(LayoutError, match="r is 4 here, but its LoRA matrices have shapes"):
        consolidate(copy, tmp_path / "m", merge_into=run_dir("llama_z3_bf16_ws2") / "base")


def test_peft_flag_without_config(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-3"
    shutil.copytree(checkpoint("gpt2_z2_fp32_ws2"), target)
    (target / "adapter_config.json").unlink()
    consolidate(target, tmp_path / "a", peft=True)
    written = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert set(written) == set(peft_names("gpt2_z2_fp32_ws2"))
    with pytest.raises(UsageError, match="needs the adapter's adapter_config.json"):
        consolidate(target, tmp_path / "m", merge_into=run_dir("gpt2_z2_fp32_ws2") / "base")
    consolidate(target, tmp_path / "plain")  # no config, no flag: the raw tensors
    assert (tmp_path / "plain" / "model.safetensors").is_file()


def test_peft_flag_on_a_run_without_lora_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="no LoRA tensor"):
        consolidate(SAMPLES / "z2_fp32_ws1" / "checkpoint", tmp_path / "a", peft=True)


def test_inspect_reports_adapter_excluded_base_and_dangling_alias() -> None:
    report = inspect_path(checkpoint("llama_z3_bf16_ws2"))
    adapter = report["adapter"]
    assert adapter["type"] == "LORA" and adapter["r"] == 4 and adapter["lora_alpha"] == 8
    assert adapter["rank_pattern"] == {"layers.1.self_attn.q_proj": 8} and adapter["alpha_pattern"] == {"v_proj": 32}
    assert sorted(adapter["target_modules"]) == ["o_proj", "q_proj", "v_proj"]
    assert adapter["lora_tensors"] == 12 and adapter["other_tensors"] == 1 and adapter["mergeable"]
    assert report["frozen_excluded"] is True and report["frozen"] == []
    assert report["tied_missing_source"] == {
        "base_model.model.lm_head.weight": "base_model.model.model.embed_tokens.weight"
    }
    assert report["complete"]
    from zckpt.cli.inspect import render

    text = render(report)
    assert "adapter        LORA r=4 alpha=8" in text and "frozen base    not in these files" in text
    assert "(source not in the files: left out)" in text
    plain = inspect_path(SAMPLES / "z3_fp32_ws2_tied_frozen" / "checkpoint")
    assert plain["adapter"] is None and plain["frozen_excluded"] is False and plain["tied_missing_source"] == {}


def test_inspect_of_the_adapter_folder(tmp_path: Path) -> None:
    consolidate(checkpoint("gpt2_z2_fp32_ws2"), tmp_path / "a")
    report = inspect_path(tmp_path / "a")
    assert report["kind"] == "safetensors" and report["tensors"] == 25 and report["complete"]
    assert report["adapter"]["use_rslora"] and report["adapter"]["lora_tensors"] == 12


def test_embedding_lora_merge_rounds_the_delta_first(tmp_path: Path) -> None:
    """PEFT's Embedding.merge adds delta.to(W.dtype) (rounded, then added); its Linear adds the
    fp32 delta. A bf16 embedding base and a synthetic lora_embedding_A/B show the difference."""
    from safetensors.torch import save_file

    from zckpt.core.index import Entry
    from zckpt.io.reading import FileReader
    from zckpt.ops.peft import Adapter, merged_value, plan_merge

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=generator).to(torch.bfloat16)
    a, b = torch.randn(2, 10, generator=generator), torch.randn(6, 2, generator=generator)
    base = tmp_path / "base"
    base.mkdir()
    save_file({"embed.weight": weight}, str(base / "model.safetensors"))
    save_file({"a": a, "b": b}, str(tmp_path / "lora.safetensors"))
    header = dict(_sources(tmp_path / "lora.safetensors"))
    adapter = Adapter(
        "adapter_config.json",
        {"peft_type": "LORA", "r": 2, "lora_alpha": 3},
        "default",
        (
            (
                "base_model.model.embed.lora_embedding_A",
                Entry("base_model.model.embed.lora_embedding_A.default", "param", header["a"]),
            ),
            (
                "base_model.model.embed.lora_embedding_B",
                Entry("base_model.model.embed.lora_embedding_B.default", "param", header["b"]),
            ),
        ),
    )
    plan = plan_merge(adapter, str(base))
    (merged,) = [t for _, tensors in plan.files for t in tensors]
    with FileReader() as reader:
        value = merged_value(merged, reader)
    expected = weight.clone()
    expected += ((b @ a).T * 1.5).to(torch.bfloat16)  # peft/tuners/lora/layer.py Embedding.merge
    assert same_bits(value, expected)
    assert not same_bits(value, (weight.float() + (b @ a).T * 1.5).to(torch.bfloat16))  # the Linear rule differs here


def _sources(path: Path) -> list:
    from zckpt.core.index import Segment, TensorSource
    from zckpt.hf.safetensors import read_header

    header = read_header(path)
    return [
        (t.name, TensorSource(t.dtype, t.shape, (Segment(str(path), header.data_start + t.begin, t.numel),)))
        for t in header.tensors
    ]


def test_trainer_output_folder_of_a_peft_run(tmp_path: Path) -> None:
    """The Trainer's output_dir: its newest checkpoint-N is read, and it is a PEFT one."""
    result = consolidate(run_dir("gpt2_z2_fp32_ws2"), tmp_path / "a")
    assert result.peft == "adapter" and result.index.checkpoint_dir.endswith("checkpoint-3")
    assert any(note.startswith("Trainer output folder") for note in result.index.notes)

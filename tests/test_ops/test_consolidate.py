"""Golden tests: zckpt consolidate against DeepSpeed's zero_to_fp32.py output and the live
engine values, bit for bit, on every bundled sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import SAMPLE_LIST, Sample, load_output, same_bits, sample
from zckpt import consolidate, plan_consolidation
from zckpt.deepspeed.reader import open_checkpoint
from zckpt.hf.safetensors import TIED_METADATA_KEY


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_matches_zero_to_fp32_bit_for_bit(any_sample: Sample, tmp_path: Path, fmt: str) -> None:
    reference = any_sample.reference()
    consolidate(any_sample.checkpoint, tmp_path / "out", format=fmt)
    ours = load_output(tmp_path / "out")
    for name, tensor in reference.items():
        assert name in ours, f"{name} missing"
        assert same_bits(ours[name], tensor), f"{name} differs from zero_to_fp32.py"
    # Anything extra is a frozen param zero_to_fp32.py dropped (ZeRO-1).
    assert set(ours) - set(reference) <= set(any_sample.meta["frozen"])


def test_matches_live_engine_values(any_sample: Sample, tmp_path: Path) -> None:
    consolidate(any_sample.checkpoint, tmp_path / "out")
    ours = load_output(tmp_path / "out")
    live = any_sample.live()
    assert set(live) <= set(ours)
    for name, tensor in live.items():
        # trainable params: fp32 masters, exactly; frozen params and buffers: their stored
        # 16-bit values widened to fp32, which is exact.
        expected = tensor.to(ours[name].dtype) if tensor.is_floating_point() else tensor
        assert same_bits(ours[name], expected), name


@pytest.mark.parametrize(
    "name,deepspeed_error",
    [
        # bf16 + ZeRO-1 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer
        ("z1_bf16_ws3_bf16optimizer_frozen", "is not a zero checkpoint"),
        # ZeRO-3 with the optimizer offloaded to NVMe: masters live in offloaded_tensors/
        ("z3_bf16_ws2_nvmeoffload_frozen_tied_groups", "consumed"),
    ],
)
def test_reads_checkpoints_zero_to_fp32_fails_on(tmp_path: Path, name: str, deepspeed_error: str) -> None:
    case = sample(name)
    assert deepspeed_error in case.meta["reference_error"]
    consolidate(case.checkpoint, tmp_path / "out")
    ours = load_output(tmp_path / "out")
    assert set(ours) == set(case.live())
    assert all(same_bits(ours[n], t.float() if t.is_floating_point() else t) for n, t in case.live().items())


def test_frozen_and_tied_are_present(any_sample: Sample, tmp_path: Path) -> None:
    consolidate(any_sample.checkpoint, tmp_path / "out")
    ours = load_output(tmp_path / "out")
    for name in any_sample.meta["frozen"]:
        assert name in ours
    tied = any_sample.meta["tied"]
    for alias, source in tied.items():
        assert same_bits(ours[alias], ours[source])
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata.get(TIED_METADATA_KEY, "{}")) == tied


@pytest.mark.slow
@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16bit_output_rounds_masters_to_nearest(
    any_sample: Sample, tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    consolidate(any_sample.checkpoint, tmp_path / "out", dtype=dtype)
    ours = load_output(tmp_path / "out")
    for name, tensor in any_sample.expected_fp32().items():
        expected = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
        assert same_bits(ours[name], expected), name


def test_bf16_output_of_a_bf16_run_equals_the_trained_16bit_weights(tmp_path: Path) -> None:
    """DeepSpeed copies masters into the bf16 model with the same rounding."""
    case = sample("z2_bf16_ws3_frozen_groups")
    consolidate(case.checkpoint, tmp_path / "out", dtype="bf16")
    ours = load_output(tmp_path / "out")
    from zckpt.io.materialize import read_tensor
    from zckpt.io.reading import FileReader, source_of
    from zckpt.torchfile import reader as torchfile

    module = torchfile.load(next((case.checkpoint / case.meta["tag"]).glob("mp_rank_00_model_states.pt")))["module"]
    with FileReader() as reader:
        for name in open_checkpoint(case.checkpoint).names():
            if name in module and module[name].dtype.short == "bf16":
                assert same_bits(ours[name], read_tensor(reader, source_of(module[name]))), name


def test_exclude_frozen(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "out", exclude_frozen=True)
    ours = load_output(tmp_path / "out")
    assert case.meta["frozen"] and not set(case.meta["frozen"]) & set(ours)
    assert set(ours) == set(case.reference()) - set(case.meta["frozen"])


def test_sharded_output_has_a_consistent_hf_index(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "out", max_shard_size="3KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    ours = load_output(tmp_path / "out")
    assert set(index["weight_map"]) == set(ours)
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / "out" / file, "pt") as handle:
            assert name in handle.keys()
    reference = case.reference()
    assert all(same_bits(ours[n], t) for n, t in reference.items())


def test_shard_assignment_matches_huggingface_hub(tmp_path: Path) -> None:
    """zero_to_fp32.py shards with huggingface_hub; zckpt puts each tensor in the same file."""
    hub = pytest.importorskip("huggingface_hub")
    case = sample("z3_fp32_ws2_tied_frozen")
    plan = plan_consolidation(open_checkpoint(case.checkpoint), format="torch", max_shard_size="3KB")
    # zero_to_fp32.py sizes shards on fresh empty tensors, tied names sharing one.
    reference = case.reference()
    empty = {
        name: torch.empty(t.shape, dtype=t.dtype) for name, t in reference.items() if name not in case.meta["tied"]
    }
    empty.update({alias: empty[source] for alias, source in case.meta["tied"].items()})
    split = hub.split_torch_state_dict_into_shards(
        empty, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="3KB"
    )
    assert plan.weight_map == split.tensor_to_filename
    assert plan.total_size == split.metadata["total_size"]


def test_torch_format_keeps_tied_weights_shared(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "out", format="torch")
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    for alias, source in case.meta["tied"].items():
        assert state[alias].data_ptr() == state[source].data_ptr()


def test_hf_trainer_folder_files_are_copied(tmp_path: Path) -> None:
    case = sample("hf_trainer")
    consolidate(case.checkpoint, tmp_path / "out")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "out" / name).read_bytes() == (case.checkpoint / name).read_bytes()
    assert (tmp_path / "out" / "config.json").exists()  # its dtype follows the weights: test_hf_folders.py
    assert not (tmp_path / "out" / "trainer_state.json").exists()


def test_tag_option_reads_an_older_tag(tmp_path: Path) -> None:
    case = sample("z2_fp32_ws2_twotags")
    older = [t for t in case.meta["tags"] if t != case.meta["tag"]][0]
    latest = open_checkpoint(case.checkpoint)
    chosen = open_checkpoint(case.checkpoint, older)
    assert latest.tag == case.meta["tag"] and chosen.tag == older
    consolidate(case.checkpoint, tmp_path / "a", tag=older)
    consolidate(case.checkpoint / older, tmp_path / "b")
    a, b = load_output(tmp_path / "a"), load_output(tmp_path / "b")
    assert all(same_bits(a[n], b[n]) for n in a)
    newest = load_output(Path(consolidate(case.checkpoint, tmp_path / "c").output_dir))
    assert any(not same_bits(a[n], newest[n]) for n in a if n in case.live())


def test_samples_cover_the_promised_matrix() -> None:
    covered = {(s.meta["zero_stage"], s.meta["dtype"]) for s in SAMPLE_LIST}
    assert covered >= {(z, d) for z in (1, 2, 3) for d in ("fp32", "bf16", "fp16")}
    assert {s.meta["world_size"] for s in SAMPLE_LIST} >= {1, 2, 3, 4}
    assert len({s.meta["deepspeed_version"] for s in SAMPLE_LIST}) >= 2
    assert any(s.meta["frozen"] for s in SAMPLE_LIST) and any(s.meta["tied"] for s in SAMPLE_LIST)
    assert any(s.meta["param_groups"] > 1 for s in SAMPLE_LIST)
    assert any((s.meta.get("n_fp32_sub_groups") or 1) > 1 for s in SAMPLE_LIST)


def test_torch_format_equals_torch_save_at_the_final_path(tmp_path: Path) -> None:
    """Each torch shard is written under a temporary name, but named inside (its archive name)
    as torch.save names a file at its final path: the bytes equal torch.save's there."""
    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "out", format="torch", max_shard_size="3KB")
    shards = sorted((tmp_path / "out").glob("pytorch_model-*.bin"))
    assert len(shards) > 1
    for shard in shards:
        again = tmp_path / "again" / shard.name
        again.parent.mkdir(exist_ok=True)
        torch.save(torch.load(shard, weights_only=True), again)
        assert again.read_bytes() == shard.read_bytes(), shard.name


@pytest.mark.slow
@pytest.mark.parametrize("format,shard", [("safetensors", "3KB"), ("torch", "3KB"), ("safetensors", None)])
def test_torchrun_processes_split_the_shards_byte_identically(tmp_path: Path, format: str, shard: str | None) -> None:
    """`torchrun --nproc-per-node 2 -m zckpt consolidate`: the processes write their share of
    the shards (safetensors: of every file's bytes, one file included) into one folder; the
    result equals the single-process run byte for byte."""
    from helpers import run_zckpt_torchrun

    case = sample("z3_fp32_ws2_tied_frozen")
    consolidate(case.checkpoint, tmp_path / "single", format=format, max_shard_size=shard or "5GB")
    sharding = ["--max-shard-size", shard] if shard else []
    result = run_zckpt_torchrun(
        "consolidate", str(case.checkpoint), str(tmp_path / "multi"), "--format", format, *sharding
    )
    assert result.stdout.count("wrote ") == 1  # only the first process reports
    single = {p.name: p.read_bytes() for p in (tmp_path / "single").iterdir()}
    multi = {p.name: p.read_bytes() for p in (tmp_path / "multi").iterdir()}
    assert len(single) >= (4 if shard else 1) and single == multi


@pytest.mark.parametrize("piece_bytes", [64, 1000, 1 << 20])
def test_safetensors_pieces_written_in_any_order_give_the_one_process_file(tmp_path: Path, piece_bytes: int) -> None:
    """What each torchrun process does to a shared safetensors file (file_pieces), done here in
    one process, pieces in reverse order: the file equals the one-process writer's."""
    from zckpt.io.reading import FileReader
    from zckpt.ops.file_pieces import create_files, plan_pieces, write_pieces

    case = sample("z3_bf16_ws3_subgroups_groups")
    consolidate(case.checkpoint, tmp_path / "one", dtype="bf16")
    plan = plan_consolidation(open_checkpoint(case.checkpoint), dtype="bf16")
    pieces = plan_pieces([(f.name, f.tensors) for f in plan.files], plan.tied, piece_bytes=piece_bytes)
    assert len(pieces.pieces) > len(plan.files)
    paths = {name: str(tmp_path / name) for name in pieces.headers}
    create_files(pieces, paths, lambda name, exc: exc)
    with FileReader() as reader:
        write_pieces(list(reversed(pieces.pieces)), paths, reader, lambda n: None, lambda name, exc: exc)
    for name, path in paths.items():
        assert Path(path).read_bytes() == (tmp_path / "one" / name).read_bytes(), name

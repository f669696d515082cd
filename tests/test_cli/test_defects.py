"""The defects a new user hit (issue #9, item 7), each pinned by a test that failed before its fix.

Damaged checkpoints are made by rewriting a sample's rank file with zckpt's own torch.save
writer (the DeepSpeed classes in the files need no DeepSpeed that way); interrupted runs are
real ``zckpt`` processes killed by a real signal.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from helpers import cli_env, default_signals, run_cli, same_bits, sample
from zckpt import load_into_module, load_state_dict
from zckpt.core.index import Segment, TensorSource
from zckpt.deepspeed import names as N
from zckpt.deepspeed.writer import carry, tensor_of
from zckpt.io.output import temp_name
from zckpt.io.reading import source_of
from zckpt.ops.inspect import inspect_path
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave
from zckpt.torchfile.reader import TensorRef

ZERO2 = "z2_bf16_ws3_frozen_groups"  # 3 ranks, 2 param groups, frozen params, int64 buffer
ZERO3 = "z3_fp32_ws2_tied_frozen"
LARGEST = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"  # 537k params


# ---------------------------------------------------------------------------------------------
# Helpers


def tag_dir(checkpoint: Path) -> Path:
    return checkpoint / (checkpoint / "latest").read_text().strip()


def optim_file(checkpoint: Path, rank: int) -> Path:
    return next(
        p for p in tag_dir(checkpoint).iterdir() if p.name.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    )


def rewrite(path: Path, change: Callable[[Any, Any], None]) -> None:
    """Rewrite a torch.save file: `change(original, writable)` edits the writable tree, where
    `original` is the same tree as read (TensorRefs) for reference."""
    original = torchfile.load(path)
    writable = carry(original)
    change(original, writable)
    temp = path.with_name(path.name + ".new")
    torchsave.save(writable, temp)
    os.replace(temp, path)


def resized(ref: TensorRef, numel: int, shape: tuple[int, ...] | None = None) -> Any:
    """A writable tensor of the first `numel` elements of `ref` (shape `shape`, default flat)."""
    segment = source_of(ref).segments[0]
    return tensor_of(TensorSource(ref.dtype, shape or (numel,), (Segment(segment.path, segment.offset, numel),)))


def assert_one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def assert_inspect_lists(checkpoint: Path, *expected: str) -> dict:
    """`inspect --json` describes the checkpoint, exit 3, with a problem containing `expected`."""
    result = run_cli("inspect", checkpoint, "--json", cwd=checkpoint.parent)
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert not report["complete"]
    assert any(all(text in p for text in expected) for p in report["problems"]), report["problems"]
    return report


# ---------------------------------------------------------------------------------------------
# 1. A ZeRO-1/2 last-rank partition a few elements short


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, short",
    [(ZERO2, 2), ("z2_fp16_ws4_tied", 1), ("z1_bf16_ws3_bf16optimizer_frozen", 3), ("z1_fp32_ws2_frozen_tied", 1)],
)
def test_short_last_rank_partition_is_one_line_and_listed(
    copy_checkpoint, tmp_path: Path, name: str, short: int
) -> None:
    ckpt = copy_checkpoint(name)
    world = sample(name).meta["world_size"]
    victim = optim_file(ckpt, world - 1)

    def shorten(original: Any, writable: Any) -> None:
        ref = original[N.OPTIMIZER_STATE_DICT][N.SINGLE_PARTITION_OF_FP32_GROUPS][-1]
        writable[N.OPTIMIZER_STATE_DICT][N.SINGLE_PARTITION_OF_FP32_GROUPS][-1] = resized(ref, ref.numel - short)

    rewrite(victim, shorten)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("consolidate", ckpt, out, cwd=tmp_path), victim.name)
    assert not out.exists()
    assert_inspect_lists(ckpt, victim.name)


# ---------------------------------------------------------------------------------------------
# 2. inspect reports, never raises, on a fp32 partition that is not one flat run


@pytest.mark.slow
@pytest.mark.parametrize("name, key", [(ZERO2, N.SINGLE_PARTITION_OF_FP32_GROUPS), (ZERO3, N.FP32_FLAT_GROUPS)])
def test_non_flat_fp32_partition_is_described(copy_checkpoint, tmp_path: Path, name: str, key: str) -> None:
    ckpt = copy_checkpoint(name)
    victim = optim_file(ckpt, 1)

    def reshape(original: Any, writable: Any) -> None:
        ref = original[N.OPTIMIZER_STATE_DICT][key][0]
        writable[N.OPTIMIZER_STATE_DICT][key][0] = resized(ref, ref.numel, (1, ref.numel))

    rewrite(victim, reshape)
    report = assert_inspect_lists(ckpt, victim.name, "not a flat contiguous tensor")
    assert (
        report["zero_stage"] == sample(name).meta["zero_stage"]
        and report["world_size"] == sample(name).meta["world_size"]
    )
    assert_one_line_error(run_cli("consolidate", ckpt, tmp_path / "out", cwd=tmp_path), victim.name)
    report = inspect_path(ckpt)  # the library too
    assert not report["complete"]


def _set(key: str, value: Any, inner: bool = True) -> Callable[[Any, Any], None]:
    def change(_original: Any, writable: Any) -> None:
        (writable[N.OPTIMIZER_STATE_DICT] if inner else writable)[key] = value

    return change


STRUCTURE_DAMAGE = {  # each of these ended in a TypeError/AttributeError, or never ended
    "partition_count_huge": ("z2_bf16_ws3_paramalign", "optim0", _set(N.PARTITION_COUNT, 10**12)),
    "paddings_not_lists": ("z2_bf16_ws3_paramalign", "optim0", _set(N.PARAM_ALIGNMENT_PADDINGS, 3)),
    "partitions_not_tensors": (ZERO2, "optim1", _set(N.SINGLE_PARTITION_OF_FP32_GROUPS, [(3,)])),
    "flat_groups_none": (ZERO3, "optim0", _set(N.FP32_FLAT_GROUPS, None)),
    "frozen_shapes_int": ("z1_fp32_ws2_frozen_tied", "model", _set(N.FROZEN_PARAM_SHAPES, 7, inner=False)),
    "param_shapes_str": (ZERO3, "model", _set(N.PARAM_SHAPES, "x", inner=False)),
    "loss_scaler_int": (ZERO3, "optim0", _set("loss_scaler", 7)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STRUCTURE_DAMAGE))
def test_damaged_structure_is_described(copy_checkpoint, tmp_path: Path, case: str) -> None:
    name, which, change = STRUCTURE_DAMAGE[case]
    ckpt = copy_checkpoint(name)
    victim = (
        optim_file(ckpt, int(which[-1])) if which.startswith("optim") else min(tag_dir(ckpt).glob("*model_states.pt"))
    )
    rewrite(victim, change)
    shown = run_cli("inspect", ckpt, "--json", cwd=tmp_path)
    assert shown.returncode in (0, 3) and "internal error" not in shown.stderr, (shown.returncode, shown.stderr)
    report = json.loads(shown.stdout)
    if shown.returncode == 3:
        assert any(victim.name in p or str(tag_dir(ckpt)) in p for p in report["problems"]), report["problems"]
        assert_one_line_error(run_cli("consolidate", ckpt, tmp_path / "out", cwd=tmp_path))


# ---------------------------------------------------------------------------------------------
# 3. inspect on incomplete checkpoints says what the intact files say


def test_missing_rank_file_keeps_buffer_dtypes(copy_checkpoint) -> None:
    ckpt = copy_checkpoint(ZERO2)
    optim_file(ckpt, 1).unlink()
    report = inspect_path(ckpt)
    assert not report["complete"]
    dtypes = {p["name"]: p["dtype"] for p in report["parameters"]}
    assert dtypes["position_ids"] == "int64" and dtypes["bn.num_batches_tracked"] == "int64", dtypes
    assert dtypes["embed.weight"] == "fp32" and dtypes["adapter.0.weight"] == "bf16"
    complete = {p["name"]: p["dtype"] for p in inspect_path(sample(ZERO2).checkpoint)["parameters"]}
    assert dtypes == complete, "an incomplete checkpoint lists other dtypes than the complete one"


@pytest.mark.parametrize("rank", [1, 0])
def test_corrupt_optimizer_file_keeps_what_intact_files_say(copy_checkpoint, rank: int) -> None:
    ckpt = copy_checkpoint(ZERO2)
    victim = optim_file(ckpt, rank)
    victim.write_bytes(victim.read_bytes()[:1000])
    report = inspect_path(ckpt)
    assert not report["complete"]
    assert (report["zero_stage"], report["world_size"], report["dtype"], report["ds_version"]) == (
        2,
        3,
        "bf16",
        "0.19.8",
    )
    assert report["offload"] == "none" and report["frozen"] == sample(ZERO2).meta["frozen"]
    assert any(victim.name in p for p in report["problems"])
    assert "?" not in {p["dtype"] for p in report["parameters"]}


@pytest.mark.slow
def test_latest_file_is_recognised(tmp_path: Path) -> None:
    ckpt = sample("z2_fp32_ws2_twotags").checkpoint
    report = inspect_path(ckpt / "latest")
    assert report["kind"] == "deepspeed_checkpoint" and report["complete"]
    assert report["tag"] == "global_step3" and report["zero_stage"] == 2
    assert any("latest" in note for note in report["notes"])
    result = run_cli("inspect", ckpt / "latest", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "safetensors" not in result.stdout and "global_step3" in result.stdout


def test_latest_universal_file_is_recognised(tmp_path: Path) -> None:
    from zckpt import to_universal

    to_universal(sample("z2_fp32_ws1").checkpoint, tmp_path / "uc")
    report = inspect_path(tmp_path / "uc" / "latest_universal")
    assert report["kind"] == "deepspeed_checkpoint" and report["universal"] and report["complete"]


# ---------------------------------------------------------------------------------------------
# 7. the tag line of a checkpoint whose `latest` names a missing tag


def test_tag_line_when_latest_names_a_missing_tag(copy_checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint("z2_fp32_ws2_twotags")
    (ckpt / "latest").write_text("global_step9")
    result = run_cli("inspect", ckpt, cwd=tmp_path)
    assert result.returncode == 3
    assert "None" not in result.stdout and "tags present: none" not in result.stdout, result.stdout
    assert "global_step2, global_step3" in result.stdout and "global_step9" in result.stdout
    report = inspect_path(ckpt)
    assert report["tags"] == ["global_step2", "global_step3"] and report["tag"] == "global_step9"


@pytest.mark.slow
def test_unknown_tag_is_one_line_naming_the_tags(tmp_path: Path) -> None:
    ckpt = sample("z2_fp32_ws2_twotags").checkpoint
    for command in (["inspect", ckpt], ["consolidate", ckpt, tmp_path / "out"]):
        line = assert_one_line_error(
            run_cli(*command, "--tag", "global_step9", cwd=tmp_path), "global_step9", "global_step2, global_step3"
        )
        assert "None" not in line


# ---------------------------------------------------------------------------------------------
# 5. legacy (non-zip) torch.save files: read (DeepSpeed writes them with checkpoint_serialization
# false); the one variant torch.load cannot read either is named as such, not called truncated


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [2, 1, 0])
def test_legacy_torch_file_reads_or_says_what_it_is(copy_checkpoint, tmp_path: Path, protocol: int) -> None:
    ckpt = copy_checkpoint("z2_fp32_ws1")
    victim = tag_dir(ckpt) / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3)}}, victim, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    # protocol 0 pickles the storage records as text: torch.load fails on it too
    said = "pickled with protocol 0" if protocol == 0 else "not a DeepSpeed model-states file"
    line = assert_one_line_error(run_cli("consolidate", ckpt, tmp_path / "out", cwd=tmp_path), victim.name, said)
    assert "pre-1.6" not in line and "truncated" not in line
    assert not (tmp_path / "out").exists()
    assert_inspect_lists(ckpt, victim.name, said)
    weights = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(3)}, weights, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    report = inspect_path(weights)
    assert report["kind"] == "torch"
    if protocol == 0:
        assert not report["complete"] and len(report["problems"]) == 1 and said in report["problems"][0]
    else:
        assert report["complete"] and not report["problems"], report
        assert [p["name"] for p in report["parameters"]] == ["w"]


# ---------------------------------------------------------------------------------------------
# 6. load_into_module on a model built on the meta device


class TinyModel(torch.nn.Module):
    """The samples' model (sample_ckpts/README.md), with lm_head tied to embed."""

    def __init__(self, vocab: int = 23, dim: int = 37, hidden: int = 19) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(5, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)
        self.adapter = torch.nn.Sequential(torch.nn.Linear(dim, 11), torch.nn.Tanh(), torch.nn.Linear(11, dim))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(dim))
        self.register_buffer("position_ids", torch.arange(5).unsqueeze(0))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z1_fp32_ws2_frozen_tied", "z3_fp32_ws2_tied_frozen"])
def test_load_into_meta_module_materializes(name: str) -> None:
    ckpt = sample(name).checkpoint
    with torch.device("meta"):
        model = TinyModel()
    model.adapter.requires_grad_(False)
    missing, unexpected = load_into_module(model, ckpt)
    assert (missing, unexpected) == ([], [])
    expected = load_state_dict(ckpt)
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, tensor in state.items():
        assert tensor.device.type == "cpu", key
        assert same_bits(tensor, expected[key].to(tensor.dtype)), key
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.lm_head.weight is model.embed.weight, "the tie is kept"
    assert isinstance(model.fc1.weight, torch.nn.Parameter) and model.fc1.weight.requires_grad
    assert not model.adapter[0].weight.requires_grad
    assert model.position_ids.dtype == torch.int64


@pytest.mark.slow
def test_load_into_meta_module_keeps_the_module_dtype() -> None:
    ckpt = sample("z2_fp32_ws1").checkpoint
    with torch.device("meta"):
        model = TinyModel().to(torch.bfloat16)
    load_into_module(model, ckpt, strict=False)
    expected = load_state_dict(ckpt, dtype="bf16")
    assert model.fc1.weight.dtype == torch.bfloat16 and same_bits(model.fc1.weight.detach(), expected["fc1.weight"])
    assert model.position_ids.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# 4. SIGTERM / SIGINT / SIGKILL during consolidate

# A real `zckpt` process whose tensor writes are slowed (by this wrapper, not by a hook in the
# library), so that a signal lands while its temporary files exist.
SLOW_CLI = """
import sys, time
import zckpt.io.materialize as materialize
write = materialize.StreamWriter.write
def slow(self, *args, **kwargs):
    time.sleep(0.2)
    return write(self, *args, **kwargs)
materialize.StreamWriter.write = slow
from zckpt.cli.app import main
sys.argv = ["zckpt", *sys.argv[1:]]
main()
"""


def zckpt_leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".zckpt-" in n) if folder.is_dir() else []


def killed_mid_write(tmp_path: Path, out: Path, signum: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """Start a slowed consolidate of the largest sample, wait until it has a temporary file in
    `out`, send `signum` at a random moment of the write, and return the finished process."""
    script = tmp_path / "slow_cli.py"
    script.write_text(SLOW_CLI)
    args = [
        sys.executable,
        str(script),
        "consolidate",
        str(sample(LARGEST).checkpoint),
        str(out),
        "--max-shard-size",
        "200KB",
        *extra,
    ]
    # a test run started in the background (CI under nohup, `cmd &`) inherits SIGINT ignored, and
    # zckpt rightly keeps ignored signals ignored: the child gets the default dispositions
    process = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    deadline = time.monotonic() + 60
    while not zckpt_leftovers(out):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no temporary file appeared"
        time.sleep(0.002)
    time.sleep(random.uniform(0, 1.0))  # somewhere inside the ~4 s write (20 tensors, 0.2 s each)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_consolidate_removes_temp_files(tmp_path: Path, signum: int, code: int) -> None:
    out = tmp_path / "out"
    result = killed_mid_write(tmp_path, out, signum)
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: ") and "Traceback" not in result.stderr, result.stderr
    assert not out.exists(), os.listdir(out)


@pytest.mark.slow
def test_sigterm_with_overwrite_keeps_the_old_weights(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("consolidate", sample(LARGEST).checkpoint, out, cwd=tmp_path).returncode == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    result = killed_mid_write(tmp_path, out, signal.SIGTERM, "--overwrite")
    assert result.returncode == 143, result.stderr
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


@pytest.mark.slow
def test_sigkill_leftovers_are_reported_then_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("consolidate", sample(LARGEST).checkpoint, out, cwd=tmp_path).returncode == 0
    result = killed_mid_write(tmp_path, out, signal.SIGKILL, "--overwrite")
    assert result.returncode == -signal.SIGKILL
    dead = zckpt_leftovers(out)
    assert dead, "SIGKILL cannot be caught: its temporary file stays"
    alive = temp_name("model.safetensors")  # .model.safetensors.zckpt-tmp-<host>-<pid of this live process>
    (out / alive).write_bytes(b"x")

    shown = run_cli("inspect", out, cwd=tmp_path)
    assert shown.returncode == 3, shown
    report = json.loads(run_cli("inspect", out, "--json", cwd=tmp_path).stdout)
    assert not report["complete"]
    for name in dead:
        assert any(name in p and "no longer runs" in p for p in report["problems"]), report["problems"]
    assert any(alive in n and "still running" in n for n in report["notes"]), report["notes"]
    assert not any(alive in p for p in report["problems"])

    again = run_cli("consolidate", sample(LARGEST).checkpoint, out, "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert zckpt_leftovers(out) == [alive], "the dead run's files are removed, the live one's kept"
    assert run_cli("inspect", out, cwd=tmp_path).returncode == 0

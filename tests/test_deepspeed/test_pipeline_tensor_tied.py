"""A pipeline x tensor run that ties a module across stages, as Megatron-DeepSpeed's GPTModelPipe
ties its embedding to the head (``pp2_megatron_z1_bf16_tp2_tied``: 2 stages x 2 tensor ranks, bf16,
``TiedLayerSpec("embed", ...)`` at layers 0 and 3, the tied weight its vocabulary-parallel word
embeddings). DeepSpeed keeps only the tied weight in step between the stages: the head's stage
never trains the module's LayerNorm, so that stage's copy drifts (weight decay) while its
optimizer moments stay zero. A valid checkpoint whose tied copies differ: zckpt must read it, take
the copy the model trained, and still catch a damaged copy. ``..._adam_coupled_wd`` is the same run
with torch Adam and L2 weight decay: the decay is that LayerNorm copy's gradient, so its moments
are not zero, only not stage 0's (while the tied word embeddings' moments are equal in both).

The independent fact is what each stage's live engine held (``reference/live_stage{S}_tp{T}``,
``live_optimizer_stage{S}_tp{T}``: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``);
DeepSpeed's ``ds_to_universal`` fails on this checkpoint (``meta.json``). DeepSpeed loading zckpt's
outputs: tests/test_interop/test_interop_parallel.py."""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    TIED_PIPELINE_TENSOR_SAMPLES,
    Sample,
    assert_pipeline_slices_are_live,
    copy_checkpoint,
    megatron_join,
    same_bits,
    same_checkpoint_files,
)
from zckpt import load_state_dict, reshard
from zckpt.deepspeed.reader import open_checkpoint, open_training_state
from zckpt.ops.inspect import inspect_path
from zckpt.ops.verify import verify

CASE = TIED_PIPELINE_TENSOR_SAMPLES[0]
COUPLED = next(s for s in TIED_PIPELINE_TENSOR_SAMPLES if s.name.endswith("_adam_coupled_wd"))
BOTH = pytest.mark.parametrize("case", TIED_PIPELINE_TENSOR_SAMPLES, ids=lambda s: s.name)
NORM = "tied_modules.embed.norm.weight"
WORDS = "tied_modules.embed.word_embeddings.weight"


def _live(kind: str, stage: int, case: Sample = CASE) -> list[dict]:
    return [load_file(case.folder / "reference" / f"{kind}_stage{stage}_tp{t}.safetensors") for t in range(2)]


def test_the_sample_is_there_and_its_stages_copies_differ() -> None:
    """The live engine's own fact: stage 1's copy of the tied LayerNorm is not stage 0's, and its
    moments are zero; the tied word embeddings are equal in both stages; ds_to_universal fails."""
    assert [s.name for s in TIED_PIPELINE_TENSOR_SAMPLES] == [
        "pp2_megatron_z1_bf16_tp2_tied",
        "pp2_megatron_z1_bf16_tp2_tied_adam_coupled_wd",
    ]
    first, second = _live("live", 0), _live("live", 1)
    assert not torch.equal(first[0][NORM], second[0][NORM])
    assert all(torch.equal(first[t][WORDS], second[t][WORDS]) for t in range(2))
    idle = _live("live_optimizer", 1)
    assert not idle[0][f"{NORM}.exp_avg"].any() and not idle[0][f"{NORM}.exp_avg_sq"].any()
    assert _live("live_optimizer", 0)[0][f"{NORM}.exp_avg"].any()
    assert CASE.meta["ds_to_universal_error"].startswith("ZeroDivisionError")


def test_with_coupled_weight_decay_the_idle_copy_has_moments_of_its_own() -> None:
    """The live engine's fact for the coupled run (torch Adam, weight_decay 0.01, adam_w_mode
    false): stage 1's LayerNorm weight copy, which no gradient reaches, has nonzero moments that
    are not stage 0's; the tied word embeddings have the same masters and the same moments in
    both stages (one all-reduced gradient), which is what zckpt's rule rests on."""
    assert COUPLED.meta["ds_config"]["optimizer"] == {
        "type": "Adam",
        "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True, "adam_w_mode": False},
    }
    first, second = _live("live", 0, COUPLED), _live("live", 1, COUPLED)
    moments0, moments1 = _live("live_optimizer", 0, COUPLED), _live("live_optimizer", 1, COUPLED)
    for t in range(2):
        assert not torch.equal(first[t][NORM], second[t][NORM])
        assert bool(moments1[t][f"{NORM}.exp_avg"].all()) and bool(moments1[t][f"{NORM}.exp_avg_sq"].all())
        assert not torch.equal(moments0[t][f"{NORM}.exp_avg"], moments1[t][f"{NORM}.exp_avg"])
        assert torch.equal(first[t][WORDS], second[t][WORDS])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments0[t][f"{WORDS}.{key}"], moments1[t][f"{WORDS}.{key}"])


@BOTH
def test_consolidate_is_the_model_the_first_stage_trained(case: Sample) -> None:
    """Every tensor of the one-stage model, each stage's tensor ranks joined: the tied module's
    from stage 0 (which trained all of it), its vocabulary cut to 23 rows; layer 2 from stage 1."""
    state_dict = load_state_dict(case.checkpoint, dtype="fp32")
    for name, value in state_dict.items():
        stage = 1 if name.startswith("2.") else 0
        whole = megatron_join(name, [held[name] for held in _live("live", stage, case)])
        assert same_bits(value, whole[: value.shape[0]]), name
    assert state_dict[WORDS].shape == (23, 16)


@BOTH
def test_each_stage_keeps_its_own_slices_and_moments(case: Sample) -> None:
    assert_pipeline_slices_are_live(open_training_state(case.checkpoint), case, 2)


def test_verify_passes_and_says_which_copies_it_did_not_compare() -> None:
    report = verify(str(CASE.checkpoint))
    assert report.ok, report.problems
    notes = inspect_path(str(CASE.checkpoint))["notes"]
    assert any(
        n.startswith(f"2 param(s) of a tied module ({NORM}, tied_modules.embed.norm.bias) never received a gradient")
        for n in notes
    ), notes


def test_verify_passes_a_coupled_weight_decay_run() -> None:
    """Before, verify named stage 1's LayerNorm copy as damage ('differs in 16 of 16 elements ...
    a file is from another save, or damaged'): its moments are its own, so it is not compared; the
    zero bias (its decay zero too) never received a gradient; the word embeddings are compared."""
    report = verify(str(COUPLED.checkpoint))
    assert report.ok, report.problems
    assert any(c.name == "replicas" and c.ok for c in report.checks), report.checks
    notes = inspect_path(str(COUPLED.checkpoint))["notes"]
    assert any(
        n.startswith(f"1 param(s) of a tied module ({NORM}) were trained on their own in stage(s) 1") for n in notes
    )
    assert any(n.startswith("1 param(s) of a tied module (tied_modules.embed.norm.bias) never received") for n in notes)
    assert "1 tied param(s) held by several stages, written once" in " ".join(notes)


def _write_float(path: str, offset: int, value: float) -> None:
    """An fp32 element of a torch file changed, the record's CRC-32 set right (in its data
    descriptor and the central directory, where torch's writer keeps it): the change reaches the
    comparisons, past the CRC check."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", value))
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if i.header_offset < offset), key=lambda i: i.header_offset)
    data = bytearray(Path(path).read_bytes())
    start = data.index(info.filename.encode(), info.header_offset) + len(info.filename)
    start += struct.unpack_from("<H", data, info.header_offset + 28)[0]  # the local header's extra field
    old, new = struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(data[start : start + info.file_size]))
    assert data.count(old) == 2
    Path(path).write_bytes(bytes(data).replace(old, new))


@BOTH
def test_a_changed_copy_of_the_tied_weight_is_caught(tmp_path: Path, case: Sample) -> None:
    """The word embeddings, kept in step, are still compared: stage 1's copy edited, verify names
    its file."""
    tag = copy_checkpoint(tmp_path, case)
    replica = next(
        r for r in open_checkpoint(tag.parent).replicas if r.name == WORDS and "mp_rank_02" in r.source.segments[0].path
    )
    _write_float(replica.source.segments[0].path, replica.source.segments[0].offset, 3.0)
    report = verify(tag.parent)
    assert not report.ok
    assert any(f"mp_rank_02_optim_states.pt: its copy of {WORDS} differs in 1 of" in p for p in report.problems)


def test_a_copy_with_moments_of_its_own_is_not_compared(tmp_path: Path) -> None:
    """A stage-1 LayerNorm copy whose moments are not all zero, but not stage 0's either (as
    coupled weight decay gives the copy no gradient reaches: the real run is the
    ..._adam_coupled_wd sample below): DeepSpeed keeps only the tied weight in step, so this copy
    is the stage's own: not compared, named in a note, stage 0's the model's."""
    tag = copy_checkpoint(tmp_path, CASE)
    stage = open_training_state(tag.parent).stages[1]
    own = next(p for p in stage.own_params if p.name == NORM)
    segment = own.states["exp_avg"].segments[0]
    _write_float(segment.path, segment.offset, 1.0)
    report = verify(tag.parent)
    assert report.ok, report.problems
    notes = inspect_path(str(tag.parent))["notes"]
    assert any(
        n.startswith(f"1 param(s) of a tied module ({NORM}) were trained on their own in stage(s) 1") for n in notes
    )
    assert any(n.startswith("1 param(s) of a tied module (tied_modules.embed.norm.bias) never received") for n in notes)
    assert torch.equal(
        load_state_dict(tag.parent, dtype="fp32")[NORM], load_state_dict(CASE.checkpoint, dtype="fp32")[NORM]
    )


@BOTH
def test_reshard_to_its_own_layout_gives_deepspeeds_files_back(tmp_path: Path, case: Sample) -> None:
    reshard(case.checkpoint, tmp_path / "same", world_size=1)
    assert same_checkpoint_files(case.checkpoint, tmp_path / "same") == []


@BOTH
@pytest.mark.parametrize("tp", [4, 1])
def test_another_tensor_parallel_degree_keeps_each_stages_own_copies(tmp_path: Path, tp: int, case: Sample) -> None:
    """At 4 tensor ranks and at 1, each stage's ranks hold the model's cut at that degree of what
    that stage held (stage 1's own LayerNorm copy and zero moments included), the layer files
    bf16 weights their masters rounded (verify), and 4 -> 2 gives DeepSpeed's files back."""
    out = tmp_path / f"tp{tp}"
    reshard(case.checkpoint, out, world_size=1, tensor_parallel=tp)
    assert_pipeline_slices_are_live(open_training_state(out), case, tp)
    assert verify(str(out)).ok
    if tp == 4:
        reshard(out, tmp_path / "back", world_size=1, tensor_parallel=2)
        assert same_checkpoint_files(case.checkpoint, tmp_path / "back") == []

"""A real ZenFlow run (sample z2_bf16_ws2_zenflow; DeepSpeed 0.19.8, ZeRO-2 bf16 on 2 ranks, the
optimizer offloaded to CPU, zenflow select_strategy "step", select/update interval 2, 4
micro-steps): its saved 16-bit module weights are the live engine's, which ZenFlow's selective
optimizer leaves off the masters rounded in a few columns (issue 35, item 4). Every expectation
is a fact of the run: the files as DeepSpeed wrote them (read with torch.load), the engine's
values captured before the save (reference/live*.safetensors), zero_to_fp32's output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import copy_checkpoint, runner, same_bits, sample
from zckpt.cli.app import app
from zckpt.cli.inspect import render
from zckpt.deepspeed.reader import open_training_state
from zckpt.deepspeed.writer import carry
from zckpt.deepspeed.zenflow import overlapped, topk_ratio, unsaved_moments_note, zenflow_settings
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader
from zckpt.ops.consolidate import consolidate
from zckpt.ops.dcp import to_dcp
from zckpt.ops.inspect import inspect_path
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave

CASE = sample("z2_bf16_ws2_zenflow")
TAG = CASE.meta["tag"]


def _module(folder: Path) -> dict[str, torch.Tensor]:
    """The module weights of a ZeRO-1/2 model-states file, as torch.load reads them."""
    return torch.load(folder / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def test_deepspeed_saved_the_live_engines_weights_not_the_masters_rounded() -> None:
    """The saved module weights are the engine's live 16-bit params; they differ from the live
    masters rounded (by torch) only in 1-D weights and a few columns of each 2-D weight, the ones
    ZenFlow's selective optimizer updates (what verify's check rests on)."""
    assert (TAG, CASE.meta["steps"], CASE.zenflow["update_interval"]) == ("global_step2", 4, 2)
    saved, live16, live = _module(CASE.checkpoint), CASE.live_params16(), CASE.live()
    differ = 0
    for name, value in live16.items():
        assert same_bits(saved[name], value), name
        unequal = saved[name].view(torch.int16) != live[name].to(torch.bfloat16).view(torch.int16)
        differ += int(unequal.sum())
        if value.ndim == 2:
            columns = value.shape[1]
            most = int(columns * CASE.zenflow["topk_ratio"]) + CASE.meta["world_size"]
            assert int(unequal.any(0).sum()) <= most, name
    assert (differ, sum(v.numel() for v in live16.values())) == (548, 4323)


def test_inspect_and_verify_accept_it() -> None:
    report = inspect_path(CASE.checkpoint)
    assert report["problems"] == [] and report["complete"]
    assert report["training_state"]["param_groups"][0]["step"] == 4  # the CPU Adam's step: micro-steps
    report = verify(CASE.checkpoint, scan=True)
    assert report.ok, report.problems
    check = next(c for c in report.checks if c.name == "module weights")
    assert check.ok is True and "ZenFlow" in check.detail, check


def test_verify_names_weights_changed_beyond_zenflows_columns(tmp_path: Path) -> None:
    """A model-states file whose weight differs in every column (not ZenFlow's doing: another
    save's, or damage) is named; one changed in a single column is not."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(CASE.checkpoint, checkpoint)
    path = checkpoint / TAG / "mp_rank_00_model_states.pt"

    def edit(change) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        change(state["module"]["fc1.weight"])
        torch.save(state, path)

    edit(lambda w: w[:, 0].add_(1.0))
    assert verify(checkpoint).ok
    edit(lambda w: w[0].add_(1.0))
    report = verify(checkpoint)
    assert not report.ok
    assert any("outside the columns ZenFlow's selective optimizer updates" in p for p in report.problems), report


def test_consolidate_gives_the_live_masters(tmp_path: Path) -> None:
    consolidate(CASE.checkpoint, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    live, reference = CASE.live(), CASE.reference()
    for name in CASE.live_params16():
        assert same_bits(got[name], live[name]), name
        assert same_bits(got[name], reference[name]), name


@pytest.mark.parametrize(("stage", "world_size"), [(2, 1), (2, 3), (1, 2), (1, 4)])
def test_reshard_carries_the_saved_module_weights(tmp_path: Path, stage: int, world_size: int) -> None:
    """ZeRO-1/2 at another world size: the module weights are DeepSpeed's saved ones bit for bit
    (not recomputed from the masters), the masters and the step the live engine's."""
    out = tmp_path / "out"
    reshard(CASE.checkpoint, out, world_size=world_size, stage=stage)
    saved, written = _module(CASE.checkpoint), _module(out)
    assert list(written) == list(saved)
    for name in saved:
        assert saved[name].dtype == written[name].dtype and same_bits(written[name], saved[name]), name
    state = open_training_state(out)
    live = CASE.live()
    with FileReader() as reader:
        for param in state.params:
            assert same_bits(read_tensor(reader, param.master), live[param.name]), param.name
    step = state.groups[0].scalars["step"]
    assert (step.tensor, step.value) == (None, 4)  # ZenFlowCPUAdam's int step: the micro-steps
    assert state.global_steps == 2


def test_a_layout_without_16bit_weights_says_it_does_not_keep_them(tmp_path: Path) -> None:
    """ZeRO-3 and universal folders hold no 16-bit weights: writing the ZenFlow run there says
    so (a run loading them starts from the masters rounded); ZeRO-1/2 keep them, silently."""
    from zckpt.ops.universal import to_universal

    kept = reshard(CASE.checkpoint, tmp_path / "z2", world_size=3)
    assert kept.notes == ()
    z3 = reshard(CASE.checkpoint, tmp_path / "z3", world_size=2, stage=3)
    universal = to_universal(CASE.checkpoint, tmp_path / "universal")
    for result, where in ((z3, "a ZeRO-3 checkpoint"), (universal, "a universal folder")):
        (note,) = result.notes
        assert "ZenFlow" in note and f"not kept in {where}" in note and "zckpt reshard" in note
    plain = reshard(sample("z2_fp32_ws2_cpuadagrad").checkpoint, tmp_path / "plain", world_size=2, stage=3)
    assert plain.notes == ()


def _config(**zenflow: object) -> dict:
    return {"zero_optimization": {"stage": 2, "zenflow": zenflow}}


def test_settings_overlap_and_ratio_are_read_from_the_saved_config() -> None:
    """overlap_step (the masters stepped in ZenFlow's optimizer process, whose moments no file
    holds: a real run's base_optimizer_state was {'state': {}, ...}, tests/test_interop/
    test_interop_zenflow.py) is the one setting that changes what the files hold."""
    assert zenflow_settings({"zero_optimization": {"stage": 2}}) is None
    assert zenflow_settings(_config()) == {}
    assert not overlapped(None) and not overlapped({}) and not overlapped({"overlap_step": False})
    assert overlapped({"overlap_step": True})
    assert topk_ratio({}) == 0.1 and topk_ratio({"topk_ratio": 0.3}) == 0.3 and topk_ratio({"topk_ratio": True}) == 0.1
    assert unsaved_moments_note(_config(select_strategy="epoch")) is None
    assert unsaved_moments_note({"zero_optimization": {"stage": 2}}) is None
    note = unsaved_moments_note(_config(overlap_step=True))
    assert note is not None and "overlap_step" in note and "does not save" in note


def test_verify_with_overlap_step_skips_the_module_weights(tmp_path: Path) -> None:
    """The sample's saved config set to overlap_step: the module weights, a step behind the
    masters in such a run, are not judged; its moments are in the files, so nothing is said of
    unsaved ones (the real overlap_step run, which saves none, is the interop test's)."""
    tag = copy_checkpoint(tmp_path, CASE)
    model = tag / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    state["ds_config"]["zero_optimization"]["zenflow"]["overlap_step"] = True
    torch.save(state, model)
    report = verify(tag.parent)
    assert report.ok, report.problems
    check = next(c for c in report.checks if c.name == "module weights")
    assert check.ok is None and "overlap_step" in check.detail, check
    assert not any("does not save" in n for n in report.notes), report.notes
    assert reshard(tag.parent, tmp_path / "out", world_size=3).notes == ()
    assert unsaved_moments_note(state["ds_config"], ["exp_avg", "exp_avg_sq"]) is None


def _overlap_run(tmp_path: Path) -> Path:
    """The sample as a ZenFlow overlap_step run saves it (the real one: tests/test_interop/
    test_interop_zenflow.py): overlap_step in the saved config, and each rank's
    base_optimizer_state ``{'state': {}, 'param_groups': [...]}``, the Adam moments and step having
    lived in ZenFlow's optimizer process. Returns the checkpoint folder."""
    tag = copy_checkpoint(tmp_path, CASE)
    for path in sorted(tag.glob("*.pt")):
        tree = carry(torchfile.load(str(path)))
        tree["ds_config"]["zero_optimization"]["zenflow"]["overlap_step"] = True
        if "optimizer_state_dict" in tree:
            tree["optimizer_state_dict"]["base_optimizer_state"]["state"] = {}
        torchsave.save(tree, str(path) + ".new")  # the tensors are read from `path` as it is written
        os.replace(str(path) + ".new", path)
    return tag.parent


def test_outputs_of_an_overlap_step_run_say_its_moments_are_not_saved(tmp_path: Path) -> None:
    """reshard, to-universal and to-dcp of an overlap_step run carry verify's note that no file
    holds its moments (a run loading any output starts them from zero), after what the layout
    itself does not keep; the CLI prints it as a note and puts it in --json's notes."""
    checkpoint = _overlap_run(tmp_path)
    assert open_training_state(checkpoint).state_names == []
    moments = unsaved_moments_note({"zero_optimization": {"zenflow": {"overlap_step": True}}})
    assert reshard(checkpoint, tmp_path / "z2", world_size=3).notes == (moments,)
    weights, also = reshard(checkpoint, tmp_path / "z3", world_size=2, stage=3).notes
    assert "not kept in a ZeRO-3 checkpoint" in weights and also == moments
    weights, also = to_universal(checkpoint, tmp_path / "universal").notes
    assert "not kept in a universal folder" in weights and also == moments
    weights, also = to_dcp(checkpoint, tmp_path / "dcp").notes
    assert "the DCP model holds the fp32 masters, not the run's saved 16-bit module weights" in weights
    assert also == moments
    shown = runner.invoke(app, ["reshard", str(checkpoint), str(tmp_path / "cli"), "--world-size", "1"])
    assert shown.exit_code == 0 and f"note: {moments}" in shown.stderr, shown.stderr
    shown = runner.invoke(app, ["to-dcp", str(checkpoint), str(tmp_path / "cli-dcp"), "--json"])
    assert shown.exit_code == 0 and moments in json.loads(shown.stdout)["notes"], shown.stdout
    shown = runner.invoke(app, ["to-dcp", str(checkpoint), str(tmp_path / "cli-dcp2"), "--dtype", "bf16"])
    assert "without optimizer state (the checkpoint holds none)" in shown.stdout, shown.stdout
    assert "the DCP model holds the masters rounded to bf16" in shown.stderr, shown.stderr
    quiet = runner.invoke(app, ["reshard", str(checkpoint), str(tmp_path / "quiet"), "--world-size", "1", "-q"])
    assert quiet.exit_code == 0 and quiet.stdout == quiet.stderr == ""


def test_inspect_of_an_overlap_step_run_says_which_universal_loader_fails(tmp_path: Path) -> None:
    """No optimizer state: DeepSpeed's ZeRO-1/2 universal loader restores the masters (it reads
    the files a param's folder has; DeepSpeed loaded such a folder into a ZeRO-2 engine), its
    ZeRO-3 loader fails wanting exp_avg, exp_avg_sq and a step; the note says why there are none."""
    report = inspect_path(_overlap_run(tmp_path))
    assert report["training_state"]["optimizer_states"] == []
    lines = [line.strip() for line in render(report).splitlines() if line.startswith("  universal ")]
    assert lines == [
        "universal      a ZeRO-1/2 run's universal load restores the masters; the checkpoint holds no optimizer state",
        "universal      a ZeRO-3 run's universal load fails (no exp_avg, exp_avg_sq, step)",
    ]
    assert any("overlap_step" in note and "does not save" in note for note in report["notes"]), report["notes"]

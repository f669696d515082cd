"""``zckpt diff``: every figure it reports checked against torch, on inputs modified by known amounts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import zckpt
from helpers import run_cli, sample
from zckpt.cli.app import app
from zckpt.cli.diff import render
from zckpt.io.reading import FileReader
from zckpt.ops.diff import DiffReport, TensorDiff

try:  # click < 8.2 mixes stderr into output unless told not to
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()

ZERO2 = "z2_bf16_ws3_frozen_groups"  # bf16 run: fp32 masters, bf16 frozen params, int64 buffers
ZERO3 = "z3_fp32_ws2_tied_frozen"


def consolidated(case: str, folder: Path, **options: object) -> Path:
    zckpt.consolidate(sample(case).checkpoint, folder, **options)
    return folder


def by_name(report: DiffReport) -> dict[str, TensorDiff]:
    return {t.name: t for t in report.tensors}


def torch_stats(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> tuple[int, int, float]:
    """(changed, mismatched, max abs diff), computed by torch alone in float64."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return int((~same).sum()), int((~close).sum()), float((a - b).abs().max()) if a.numel() else 0.0


# --- equal ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", [ZERO2, ZERO3, "z1_bf16_ws3_bf16optimizer_frozen", "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"]
)
def test_checkpoint_equals_its_consolidation(case: str, tmp_path: Path) -> None:
    out = consolidated(case, tmp_path / "out")
    report = zckpt.diff(sample(case).checkpoint, out)
    assert report.equal, render(report)
    assert {t.name for t in report.tensors} == set(sample(case).live())
    assert report.a.kind == "zero_checkpoint" and report.b.kind == "safetensors"
    assert all(t.changed == 0 and t.max_abs_diff == 0.0 for t in report.tensors)


def test_sharded_torch_and_safetensors_outputs_are_equal(tmp_path: Path) -> None:
    st = consolidated(ZERO3, tmp_path / "st", max_shard_size="3KB")
    pt = consolidated(ZERO3, tmp_path / "pt", max_shard_size="3KB", format="torch")
    one = consolidated(ZERO3, tmp_path / "one", format="torch")
    assert len(list(st.glob("*.safetensors"))) > 1 and len(list(pt.glob("*.bin"))) > 1
    for a, b in (
        (st, pt),
        (st / "model.safetensors.index.json", one / "pytorch_model.bin"),
        (pt / "pytorch_model.bin.index.json", one),
    ):
        report = zckpt.diff(a, b)
        assert report.equal, render(report)
        assert len(report.tensors) == 20
    assert zckpt.diff(st, pt).b.kind == "torch" and zckpt.diff(st, pt).b.files > 1


@pytest.mark.parametrize(("world_size", "stage"), [(2, 3), (4, 1)])
def test_reshard_is_equal_including_states(world_size: int, stage: int, tmp_path: Path) -> None:
    source = sample(ZERO2).checkpoint
    zckpt.reshard(source, tmp_path / "r", world_size=world_size, stage=stage)
    report = zckpt.diff(source, tmp_path / "r", states=True)
    assert report.equal, render(report)
    assert report.b.world_size == world_size and report.b.zero_stage == stage
    training = zckpt.open_training_state(source)
    states = {t.name for t in report.tensors if t.kind == "state"}
    assert states == {f"{p.name}.{k}" for p in training.params for k in p.states}
    assert len(states) == 2 * len(training.params)  # Adam: exp_avg and exp_avg_sq
    scalars = {s.name: s.a for s in report.scalars}
    assert (
        scalars["global_steps"] == sample(ZERO2).meta["steps"]
        and scalars["param_groups.0.step"] == sample(ZERO2).meta["steps"]
    )
    assert scalars["param_groups.1.lr"] == training.groups[1].hyperparams["lr"]


def test_universal_folder_is_equal_and_a_changed_state_is_reported(tmp_path: Path) -> None:
    source = sample(ZERO2).checkpoint
    zckpt.to_universal(source, tmp_path / "u")
    assert zckpt.diff(source, tmp_path / "u", states=True).equal
    state_file = tmp_path / "u" / "global_step3_universal" / "zero" / "fc1.weight" / "exp_avg.pt"
    saved = torch.load(state_file, weights_only=True)
    before = saved["param"].clone()
    saved["param"][2, 7] += 1e-3
    saved["param"][0, 0] = -saved["param"][0, 0]
    torch.save(saved, state_file)
    report = zckpt.diff(source, tmp_path / "u", states=True)
    assert not report.equal and [t.name for t in report.differing] == ["fc1.weight.exp_avg"]
    changed, mismatched, largest = torch_stats(before, saved["param"])
    found = report.differing[0]
    assert (found.kind, found.changed, found.mismatched, found.max_abs_diff) == ("state", changed, mismatched, largest)
    assert zckpt.diff(source, tmp_path / "u").equal  # weights alone are untouched


@pytest.mark.slow
def test_every_way_of_naming_an_input(tmp_path: Path) -> None:
    trainer = sample("hf_trainer")
    zckpt.to_universal(trainer.checkpoint, tmp_path / "u")
    torch.save(trainer.live(), tmp_path / "live.pt")  # plain torch.save, read without unpickling code
    inputs = {
        "trainer output folder": trainer.folder,
        "checkpoint-N": trainer.checkpoint,
        "tag folder": trainer.checkpoint / trainer.meta["tag"],
        "latest file": trainer.checkpoint / "latest",
        "universal folder": tmp_path / "u",
        "latest_universal file": tmp_path / "u" / "latest_universal",
        "torch .pt": tmp_path / "live.pt",
    }
    for what, path in inputs.items():
        report = zckpt.diff(trainer.checkpoint, path)
        assert report.equal, (what, render(report))
        assert len(report.tensors) == len(trainer.live()), what
    assert zckpt.diff(trainer.folder, trainer.checkpoint).a.notes  # says which checkpoint-N it read
    assert zckpt.diff(tmp_path / "u", trainer.checkpoint).a.kind == "universal_checkpoint"
    assert zckpt.diff(tmp_path / "live.pt", tmp_path / "u").a.kind == "torch"


# --- what differs -----------------------------------------------------------------------------


def test_one_modified_tensor_is_reported_exactly(tmp_path: Path) -> None:
    out = consolidated(ZERO3, tmp_path / "out")
    tensors = load_file(out / "model.safetensors")
    original = tensors["fc1.weight"].clone()
    tensors["fc1.weight"][3, 5] += 0.25
    tensors["fc1.weight"][0, :4] *= 1.5
    (tmp_path / "mod").mkdir()
    save_file(tensors, tmp_path / "mod" / "model.safetensors")
    changed, mismatched, largest = torch_stats(tensors["fc1.weight"], original)
    relative = float(((tensors["fc1.weight"].double() - original.double()).abs() / original.double().abs()).max())
    for a in (out, sample(ZERO3).checkpoint):  # the weights file, and the checkpoint it came from
        report = zckpt.diff(tmp_path / "mod", a)
        assert not report.equal and not report.only_in_a and not report.only_in_b
        assert [t.name for t in report.differing] == ["fc1.weight"]
        found = report.differing[0]
        assert (found.changed, found.mismatched, found.max_abs_diff) == (changed, mismatched, largest) and changed == 5
        assert found.max_rel_diff == pytest.approx(relative, rel=1e-12)
    # a tolerance that covers the change makes them equal; a hair less does not
    assert zckpt.diff(tmp_path / "mod", out, atol=largest).equal
    assert not zckpt.diff(tmp_path / "mod", out, atol=largest * 0.999).equal


def test_two_samples_differ_by_the_live_values(tmp_path: Path) -> None:
    a, b = sample(ZERO3), sample("z3_fp32_ws2_cpuoffload_tied")  # same model, other runs
    report = zckpt.diff(a.checkpoint, b.checkpoint)
    live_a, live_b = a.live(), b.live()
    assert not report.equal and not report.only_in_a and not report.only_in_b
    found = by_name(report)
    assert set(found) == set(live_a) == set(live_b)
    for name in live_a:
        changed, mismatched, largest = torch_stats(live_a[name], live_b[name])
        assert (found[name].changed, found[name].mismatched, found[name].max_abs_diff) == (
            changed,
            mismatched,
            largest,
        ), name
    assert {t.name for t in report.differing} == {n for n in live_a if not torch.equal(live_a[n], live_b[n])}


def test_names_only_on_one_side(tmp_path: Path) -> None:
    case = sample(ZERO2)
    slim = consolidated(ZERO2, tmp_path / "slim", exclude_frozen=True)
    report = zckpt.diff(case.checkpoint, slim)
    assert set(report.only_in_a) == set(case.meta["frozen"]) and report.only_in_b == ()
    assert not report.equal and not report.differing
    reverse = zckpt.diff(slim, case.checkpoint)
    assert set(reverse.only_in_b) == set(case.meta["frozen"]) and reverse.only_in_a == ()


def test_shape_and_dtype_differences(tmp_path: Path) -> None:
    weights = torch.randn(3, 4)
    save_file(
        {"w": weights, "b": torch.ones(4), "i": torch.arange(6), "gone": torch.zeros(2)}, tmp_path / "a.safetensors"
    )
    save_file(
        {
            "w": weights.reshape(4, 3).contiguous(),
            "b": torch.ones(4, dtype=torch.bfloat16),
            "i": torch.arange(6, dtype=torch.int32),
            "new": torch.zeros(1),
        },
        tmp_path / "b.safetensors",
    )
    report = zckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    found = by_name(report)
    assert report.only_in_a == ("gone",) and report.only_in_b == ("new",)
    assert found["w"].shape_differs and (found["w"].shape_a, found["w"].shape_b) == ((3, 4), (4, 3))
    assert found["w"].max_abs_diff is None and found["w"].mismatched is None  # not compared elementwise
    assert found["b"].dtype_differs and (found["b"].dtype_a, found["b"].dtype_b) == ("fp32", "bf16")
    assert found["b"].changed == 0 and found["b"].equal  # the same numbers in another dtype
    assert found["i"].dtype_differs and found["i"].changed == 0
    assert {t.name for t in report.differing} == {"w"} and {t.name for t in report.dtype_differences} == {"b", "i"}
    text = render(report)
    assert (
        "dtype        b: fp32 in A, bf16 in B; same values" in text
        and "shape        w: [3, 4] fp32 in A, [4, 3] fp32 in B" in text
    )


def test_bf16_output_against_fp32_masters(tmp_path: Path) -> None:
    fp32 = consolidated(ZERO2, tmp_path / "fp32")
    bf16 = consolidated(ZERO2, tmp_path / "bf16", dtype="bf16")
    a, b = load_file(fp32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    report = zckpt.diff(sample(ZERO2).checkpoint, bf16)
    found = by_name(report)
    for name, tensor in a.items():
        if tensor.is_floating_point():  # bf16 in B; fp32 masters in A, frozen params as the run kept them
            assert found[name].dtype_b == "bf16" and found[name].dtype_a == (
                "bf16" if name in sample(ZERO2).meta["frozen"] else "fp32"
            )
            changed, mismatched, largest = torch_stats(tensor, b[name])
            assert (found[name].changed, found[name].mismatched, found[name].max_abs_diff) == (
                changed,
                mismatched,
                largest,
            ), name
        else:
            assert found[name].equal, name  # integer buffers keep their dtype and values
    assert not report.equal
    # rounding to bf16 stays within half an ulp: 2**-8 relative covers every value; the verdict
    # is on values, the dtype difference is still named
    loose = zckpt.diff(fp32, bf16, rtol=2**-8)
    assert loose.equal and all(t.mismatched == 0 for t in loose.tensors)
    assert {t.name for t in loose.dtype_differences} == {
        n for n, t in a.items() if t.is_floating_point()
    }  # fp32 vs bf16 files
    assert not zckpt.diff(fp32, bf16, rtol=2**-10).equal


def test_damaged_bytes_are_an_error_not_a_difference(copy_checkpoint) -> None:
    damaged = copy_checkpoint(ZERO3)
    segment = zckpt.open_checkpoint(damaged).entry("fc1.weight").source.segments[0]
    with open(segment.path, "r+b") as handle:  # flip one bit of a master inside its zip record
        handle.seek(segment.offset + 4 * 3)
        byte = handle.read(1)[0]
        handle.seek(segment.offset + 4 * 3)
        handle.write(bytes([byte ^ 0x01]))
    with pytest.raises(zckpt.CorruptFileError, match="CRC"):
        zckpt.diff(damaged, sample(ZERO3).checkpoint)
    unchecked = zckpt.diff(damaged, sample(ZERO3).checkpoint, verify=False)
    assert [(t.name, t.changed) for t in unchecked.differing] == [("fc1.weight", 1)]


# --- semantics --------------------------------------------------------------------------------


def test_tolerance_nan_and_inf_follow_torch_isclose(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(5000, generator=generator, dtype=torch.float64)
    b = a + torch.randn(5000, generator=generator, dtype=torch.float64) * 10 ** torch.randint(
        -9, 0, (5000,), generator=generator
    )
    b[:40] = a[:40]
    special = torch.tensor([math.nan, math.nan, 1.0, math.inf, math.inf, -math.inf, 0.0, -0.0, 0.0, 5.0, math.inf])
    other = torch.tensor([math.nan, 1.0, math.nan, math.inf, 1.0, math.inf, -0.0, 0.0, 1e-30, 5.0, math.nan])
    a[: len(special)], b[: len(other)] = special, other
    save_file({"x": a}, tmp_path / "a.safetensors")
    save_file({"x": b}, tmp_path / "b.safetensors")
    for atol, rtol in ((0.0, 0.0), (1e-6, 0.0), (0.0, 1e-3), (1e-5, 1e-4), (0.1, 0.1)):
        found = zckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=atol, rtol=rtol).tensors[0]
        changed, mismatched, _ = torch_stats(a, b, atol, rtol)
        assert (found.changed, found.mismatched) == (changed, mismatched), (atol, rtol)
        assert found.max_abs_diff == math.inf  # a NaN or inf against a number is an infinite difference
    finite = slice(len(special), None)
    save_file({"x": a[finite].contiguous()}, tmp_path / "fa.safetensors")
    save_file({"x": b[finite].contiguous()}, tmp_path / "fb.safetensors")
    found = zckpt.diff(tmp_path / "fa.safetensors", tmp_path / "fb.safetensors").tensors[0]
    assert found.max_abs_diff == float((a[finite] - b[finite]).abs().max())
    assert found.max_rel_diff == pytest.approx(
        float(((a[finite] - b[finite]).abs() / b[finite].abs()).max()), rel=1e-12
    )
    # NaN at the same position, -0.0 against 0.0, the same infinity: equal
    save_file({"x": torch.tensor([math.nan, -0.0, math.inf])}, tmp_path / "n1.safetensors")
    save_file({"x": torch.tensor([math.nan, 0.0, math.inf])}, tmp_path / "n2.safetensors")
    assert zckpt.diff(tmp_path / "n1.safetensors", tmp_path / "n2.safetensors").equal


def test_bad_tolerances_are_usage_errors(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, tmp_path / "a.safetensors")
    for bad in ({"atol": -1.0}, {"rtol": math.nan}, {"atol": math.inf}):
        with pytest.raises(zckpt.UsageError):
            zckpt.diff(tmp_path / "a.safetensors", tmp_path / "a.safetensors", **bad)


def test_chunked_reads_give_the_same_report_and_stay_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = consolidated(ZERO3, tmp_path / "out", dtype="bf16")
    whole = zckpt.diff(sample(ZERO3).checkpoint, out, states=False)
    largest_read = 0
    original = FileReader.read_into

    def spy(self: FileReader, path: str, offset: int, dest: memoryview) -> None:
        nonlocal largest_read
        if not path.endswith(".json"):
            largest_read = max(largest_read, len(dest))
        original(self, path, offset, dest)

    monkeypatch.setattr(FileReader, "read_into", spy)
    chunked = zckpt.diff(sample(ZERO3).checkpoint, out, chunk_elements=7)
    assert chunked.tensors == whole.tensors and chunked.equal == whole.equal
    assert 0 < largest_read <= 7 * 8  # no read larger than one chunk of the widest dtype (int64 buffers)


def test_states_against_a_weights_file(tmp_path: Path) -> None:
    out = consolidated(ZERO3, tmp_path / "out")
    report = zckpt.diff(sample(ZERO3).checkpoint, out, states=True)
    assert report.states_missing == ("b",) and report.states_differ and not report.equal
    assert not report.differing and not report.only_in_a  # the weights themselves are equal
    assert "B keeps no optimizer states" in render(report)
    both = zckpt.diff(out, out, states=True)
    assert both.states_missing == ("a", "b") and both.equal and "neither side keeps optimizer states" in render(both)


def test_two_tags_differ_in_steps(tmp_path: Path) -> None:
    folder = sample("z2_fp32_ws2_twotags").checkpoint
    report = zckpt.diff(folder / "global_step2", folder / "global_step3", states=True)
    scalars = {s.name: s for s in report.scalars}
    assert (scalars["global_steps"].a, scalars["global_steps"].b) == (2, 3) and not scalars["global_steps"].equal
    assert (scalars["param_groups.0.step"].a, scalars["param_groups.0.step"].b) == (2, 3)
    assert scalars["param_groups.0.lr"].equal and not report.equal
    assert "scalar       global_steps: 2 in A, 3 in B" in render(report)


# --- command line -----------------------------------------------------------------------------


def test_cli_exit_codes_and_text(tmp_path: Path) -> None:
    out = consolidated(ZERO3, tmp_path / "out")
    ckpt = str(sample(ZERO3).checkpoint)
    same = runner.invoke(app, ["diff", ckpt, str(out)])
    assert same.exit_code == 0, same.output
    assert same.output.splitlines()[-1].startswith("equal: 20 tensors")
    tensors = load_file(out / "model.safetensors")
    tensors["norm.bias"][0] += 2.0
    (tmp_path / "mod").mkdir()
    save_file(tensors, tmp_path / "mod" / "model.safetensors")
    differ = runner.invoke(app, ["diff", ckpt, str(tmp_path / "mod")])
    assert differ.exit_code == 3, differ.output
    lines = differ.output.splitlines()
    assert [line for line in lines if line.startswith("values")] == [line for line in lines if "norm.bias" in line]
    assert lines[-1].startswith("differ: 1 of 20 tensors")
    assert runner.invoke(app, ["diff", ckpt, str(tmp_path / "mod"), "--atol", "2.0"]).exit_code == 0
    assert runner.invoke(app, ["diff", ckpt, str(tmp_path / "mod"), "--atol", "-1"]).exit_code == 2
    assert runner.invoke(app, ["diff", ckpt, str(out), "--states"]).exit_code == 3


@pytest.mark.slow
def test_cli_bad_input_is_one_line_exit_1(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    result = run_cli("diff", sample(ZERO3).checkpoint, tmp_path / "junk.safetensors", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: ") and "junk.safetensors" in lines[0]
    missing = run_cli("diff", tmp_path / "nothing", tmp_path / "junk.safetensors", cwd=tmp_path)
    assert missing.returncode == 1 and "nothing" in missing.stderr


def test_index_that_disagrees_with_its_shards_is_refused(tmp_path: Path) -> None:
    out = consolidated(ZERO3, tmp_path / "out", max_shard_size="3KB")
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    moved = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][moved] = second
    index_file.write_text(json.dumps(index))
    with pytest.raises(zckpt.CorruptFileError, match=moved):
        zckpt.diff(out, sample(ZERO3).checkpoint)


def test_json_report_schema(tmp_path: Path) -> None:
    save_file({"x": torch.tensor([1.0, 2.0]), "y": torch.zeros(2), "only": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([1.0, math.nan]), "y": torch.zeros(3)}, tmp_path / "b.safetensors")
    result = runner.invoke(app, ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json"])
    assert result.exit_code == 3
    report = json.loads(result.stdout, parse_constant=lambda token: pytest.fail(f"non-JSON token {token}"))
    assert report["schema"] == "zckpt.diff/1"
    assert set(report) == {
        "schema",
        "equal",
        "a",
        "b",
        "atol",
        "rtol",
        "states",
        "states_missing",
        "only_in_a",
        "only_in_b",
        "differing",
        "dtype_differences",
        "tensors",
        "scalars",
        "notes",
    }
    assert report["equal"] is False and report["only_in_a"] == ["only"] and report["only_in_b"] == []
    assert set(report["a"]) == {
        "path",
        "kind",
        "tensors",
        "has_states",
        "tag",
        "zero_stage",
        "world_size",
        "files",
        "notes",
    }
    assert report["a"]["kind"] == "safetensors" and report["a"]["has_states"] is False
    x, y = report["tensors"]
    assert set(x) == {
        "name",
        "kind",
        "equal",
        "shape_a",
        "shape_b",
        "dtype_a",
        "dtype_b",
        "numel",
        "changed",
        "mismatched",
        "max_abs_diff",
        "max_rel_diff",
    }
    assert (x["name"], x["max_abs_diff"], x["max_rel_diff"], x["changed"], x["mismatched"]) == ("x", "inf", "inf", 1, 1)
    assert (y["shape_a"], y["shape_b"], y["numel"], y["max_abs_diff"]) == ([2], [3], None, None)
    assert report["differing"] == ["x", "y"]
    checkpoint = json.loads(
        runner.invoke(
            app, ["diff", str(sample(ZERO3).checkpoint), str(sample(ZERO3).checkpoint), "--json", "--states"]
        ).stdout
    )
    assert checkpoint["equal"] is True and checkpoint["a"]["zero_stage"] == 3 and checkpoint["a"]["world_size"] == 2
    assert {s["name"] for s in checkpoint["scalars"]} >= {"global_steps", "param_groups.0.step", "param_groups.0.lr"}


def test_help_is_80_columns_with_examples() -> None:
    shown = runner.invoke(app, ["diff", "--help"])
    assert shown.exit_code == 0
    lines = shown.output.splitlines()
    assert lines[0] == "Usage: zckpt diff [OPTIONS] A B" and "Examples:" in shown.output
    assert max(map(len, lines)) <= 80
    for option in ("--atol", "--rtol", "--states", "--json"):
        assert option in shown.output

"""CRC-checked reads: every record whose bytes a command uses is checked against the CRC-32 torch
stored for it, so damage inside tensor data never turns into plausible output with exit 0."""

from __future__ import annotations

import os
import random
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers import as_saved_to_a_stream, data_records, flip, record_start, same_bits, sample
from zckpt import ZckptError, consolidate
from zckpt.cli.app import app
from zckpt.core.errors import CorruptFileError
from zckpt.io.checksums import RecordChecker, RepeatedRank, archive_records, crc32_combine, repeated_ranks
from zckpt.ops.reshard import reshard
from zckpt.ops.universal import to_universal
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile


def test_crc32_combine_matches_zlib_on_random_splits() -> None:
    rng = random.Random(0)
    data = rng.randbytes(1 << 16)
    for _ in range(200):
        cut = rng.randrange(len(data) + 1)
        assert crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), len(data) - cut) == zlib.crc32(data)


def test_archive_records_agree_with_zipfile(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save(
        {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16), "e": torch.zeros(0)},
        path,
    )
    records = {r.name: r for r in archive_records(str(path))}
    raw = path.read_bytes()
    for info in data_records(path):
        record = records[info.filename]
        assert (record.size, record.crc) == (info.file_size, info.CRC)
        assert zlib.crc32(raw[record.start : record.end]) == info.CRC  # the bytes are where we say
    assert archive_records(str(tmp_path / "missing.pt")) == ()
    (tmp_path / "raw.swp").write_bytes(b"\0" * 4096)
    assert archive_records(str(tmp_path / "raw.swp")) == ()  # swap files carry no checksum


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_pieces_in_any_order_from_threads_check_the_record(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "t.pt"
    torch.save({"x": torch.randn(300_000, generator=torch.Generator().manual_seed(seed))}, path)
    (info,) = data_records(path)
    start = record_start(path, info)
    raw = path.read_bytes()
    # random windows with gaps and overlaps, some reaching outside the record
    windows = [(rng.randrange(start - 100, start + info.file_size), rng.randrange(1, 100_000)) for _ in range(40)]
    checker = RecordChecker()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda w: checker.feed(str(path), w[0], raw[w[0] : w[0] + w[1]]), windows))
    checker.finish()
    assert checker.records_checked >= 1 and checker.bytes_checked >= info.file_size  # windows reach neighbours too

    # a flipped byte in a part no window covered is found by finish's own read
    covered = set()
    for offset, length in windows:
        covered.update(range(max(offset, start), min(offset + length, start + info.file_size)))
    gap = next(o for o in range(start, start + info.file_size) if o not in covered)
    flip(path, gap)
    checker = RecordChecker()
    for offset, length in windows:
        checker.feed(str(path), offset, raw[offset : offset + length])
    with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
        checker.finish()


def test_damage_in_bytes_read_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"x": torch.arange(50_000, dtype=torch.float32)}, path)
    (info,) = data_records(path)
    flip(path, record_start(path, info) + 1234)
    checker = RecordChecker()
    checker.feed(str(path), 0, path.read_bytes())
    with pytest.raises(CorruptFileError, match=r"t\.pt: record .*data/0 fails its CRC-32 check"):
        checker.finish()


# --- commands on damaged samples ------------------------------------------------------------------

CASES = [
    "z3_fp32_ws2_tied_frozen",
    "z2_bf16_ws3_frozen_groups",
    "z1_bf16_ws3_bf16optimizer_frozen",
    "z3_bf16_ws3_subgroups_groups",
]


def tensor_files(checkpoint: Path, tag: str) -> list[Path]:
    return sorted(p for p in (checkpoint / tag).glob("*.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_consolidate_never_writes_damaged_tensor_data(tmp_path: Path, name: str) -> None:
    """Flip one byte in the middle of each tensor record of each file in turn: consolidate either
    fails naming that file's CRC, or (a record it does not use) writes zero_to_fp32's output."""
    case = sample(name)
    expected = case.expected_fp32()
    caught = 0
    for victim in tensor_files(case.checkpoint, case.meta["tag"]):
        for info in data_records(victim):
            checkpoint = tmp_path / "ckpt"
            if checkpoint.exists():
                shutil.rmtree(checkpoint)
            shutil.copytree(case.checkpoint, checkpoint)
            damaged = checkpoint / case.meta["tag"] / victim.name
            flip(damaged, record_start(damaged, info) + info.file_size // 2)
            out = tmp_path / f"out-{caught}-{info.filename.replace('/', '_')}"
            try:
                consolidate(checkpoint, out)
            except ZckptError as exc:
                assert str(damaged) in str(exc) and "CRC-32" in str(exc), exc
                assert not out.exists()
                caught += 1
                continue
            written = load_file(out / "model.safetensors")
            assert set(written) == set(expected)
            for key, tensor in expected.items():
                assert same_bits(written[key], tensor), (victim.name, info.filename, key)
    assert caught > 0


def _consolidated_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2_bf16_ws3_frozen_groups", "z3_bf16_ws3_subgroups_groups"])
def test_reshard_and_to_universal_refuse_damaged_optimizer_state(tmp_path: Path, name: str) -> None:
    """Damage in any record of rank 0's optimizer file: reshard and to-universal fail with the
    CRC named and leave no output, or (a record they do not use) write what they write from
    the intact checkpoint, byte for byte. The masters and moments are always used."""
    case = sample(name)
    writers = {
        "reshard": lambda src, out: reshard(src, out, world_size=2),
        "universal": lambda src, out: to_universal(src, out),
    }
    intact = {
        key: tree_bytes(Path(run(case.checkpoint, tmp_path / f"intact-{key}").output_dir))
        for key, run in writers.items()
    }
    optim = next(
        p for p in tensor_files(case.checkpoint, case.meta["tag"]) if "rank_0_" in p.name and "optim" in p.name
    )
    caught = 0
    for number, info in enumerate(data_records(optim)):
        checkpoint = tmp_path / f"ckpt{number}"
        shutil.copytree(case.checkpoint, checkpoint)
        damaged = checkpoint / case.meta["tag"] / optim.name
        flip(damaged, record_start(damaged, info) + info.file_size // 2)
        for key, run in writers.items():
            out = tmp_path / f"out{number}-{key}"
            try:
                run(checkpoint, out)
            except CorruptFileError as exc:
                assert str(damaged) in str(exc) and "CRC-32" in str(exc), exc
                assert not out.exists() or not any(p.is_file() for p in out.rglob("*")), list(out.rglob("*"))
                caught += 1
                continue
            assert tree_bytes(out) == intact[key], (info.filename, key)
        shutil.rmtree(checkpoint)
    assert caught >= 2 * sum(1 for i in data_records(optim) if i.file_size > 4)  # every moment and master record


def test_cli_names_the_file_and_no_verify_skips_the_check(tmp_path: Path) -> None:
    case = sample("z3_fp32_ws2_tied_frozen")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    optim = checkpoint / case.meta["tag"] / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    records = [i for i in data_records(optim) if i.file_size > 8]  # not the step counters: always checked
    # the fp32 partition is the record consolidate fails on; find it by trying each
    runner = CliRunner()
    for info in records:
        flip(optim, record_start(optim, info) + info.file_size // 2)
        result = runner.invoke(app, ["consolidate", str(checkpoint), str(tmp_path / "out")])
        if result.exit_code != 0:
            break
        flip(optim, record_start(optim, info) + info.file_size // 2)  # undo; try the next record
        shutil.rmtree(tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "fails its CRC-32 check" in result.output and str(optim) in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    # unchecked, the damage goes through: this is what the check stands between
    result = runner.invoke(app, ["consolidate", str(checkpoint), str(tmp_path / "out"), "--no-verify", "-q"])
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = case.expected_fp32()
    assert any(not same_bits(written[k], expected[k]) for k in expected)


def test_api_loads_check_too(tmp_path: Path) -> None:
    import zckpt

    case = sample("z2_bf16_ws3_frozen_groups")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    optim = next(p for p in tensor_files(checkpoint, case.meta["tag"]) if "rank_1_" in p.name and "optim" in p.name)
    for info in data_records(optim):
        flip(optim, record_start(optim, info) + info.file_size // 2)
    with pytest.raises(CorruptFileError, match="CRC-32"):
        zckpt.load_state_dict(checkpoint)
    with pytest.raises(CorruptFileError, match="CRC-32"):
        dict(zckpt.iter_tensors(checkpoint))
    assert os.path.isdir(checkpoint)


# --- rank identity: swapped rank files ---------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "z2_bf16_ws3_frozen_groups",
        "z1_bf16_ws3_groups",
        "z2_fp16_ws4_tied",
        "z1_fp32_ws2_roundrobin",
        "ds14_z1_fp16_ws2",
    ],
)
def test_swapped_zero12_optimizer_files_are_refused(tmp_path: Path, name: str) -> None:
    """Two ranks' optimizer files swapped (same sizes), saved to a stream (so their archives
    do not name them): the files' param_slice_mappings, written by DeepSpeed, say which rank
    each belongs to."""
    case = sample(name)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(case.checkpoint, checkpoint)
    tag = checkpoint / case.meta["tag"]
    first, second = (
        sorted(tag.glob("*zero_pp_rank_0_*optim_states.pt"))[0],
        sorted(tag.glob("*zero_pp_rank_1_*optim_states.pt"))[0],
    )
    held = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(held)
    as_saved_to_a_stream(first)
    as_saved_to_a_stream(second)
    with pytest.raises(ZckptError) as caught:
        consolidate(checkpoint, tmp_path / "out")
    assert "param_slice_mappings" in str(caught.value) and "rank files swapped or copied" in str(caught.value), (
        caught.value
    )
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["inspect", str(checkpoint)])
    assert result.exit_code == 3 and "swapped" in result.output, result.output


# --- rank identity: copied rank files, judged by their partitions ------------------------------


def _rank_files(folder: Path, parts: list[torch.Tensor | None]) -> dict[int, tuple[str, list[tuple[int, int]]]]:
    """One torch.save file per rank: its partition (where given) beside a 128-byte buffer alike
    on every rank, as a ZeRO-3 model-states file holds them; with where each partition lies."""
    files = {}
    for rank, part in enumerate(parts):
        path = folder / f"rank{rank}.pt"
        torch.save({"buffer": torch.arange(16), **({"part": part} if part is not None else {})}, path)
        held = torchfile.load(path).get("part")
        files[rank] = (str(path), [(held.offset, held.dtype.itemsize)] if held is not None else [])
    return files


def test_small_partitions_tell_ranks_apart_and_the_buffer_does_not(tmp_path: Path) -> None:
    """Partitions of 6 bytes beside a buffer alike on both ranks: honest files differ only in
    the partitions, and a real copy repeats them."""
    generator = torch.Generator().manual_seed(3)
    files = _rank_files(tmp_path, [torch.randn(3, generator=generator).bfloat16() for _ in range(2)])
    assert repeated_ranks(files) == []
    shutil.copyfile(files[0][0], files[1][0])
    assert repeated_ranks(files) == [RepeatedRank(1, files[1][0], 0, files[0][0], partitioned=True, telling=True)]


@pytest.mark.parametrize(
    "part", [torch.ones(3, dtype=torch.bfloat16), torch.zeros(300_000)], ids=["ones", "zeros-over-1MiB"]
)
def test_constant_partitions_alike_on_honest_ranks_cannot_tell(tmp_path: Path, part: torch.Tensor) -> None:
    """Honest ranks' slices of a constant param (a LayerNorm at its init, zero moments) are the
    same bytes: a repeat of them is said to be untellable, not called a copy."""
    files = _rank_files(tmp_path, [part.clone(), part.clone()])
    assert repeated_ranks(files) == [RepeatedRank(1, files[1][0], 0, files[0][0], partitioned=True, telling=False)]
    assert repeated_ranks(_rank_files(tmp_path, [part.clone(), part + 1])) == []


def test_one_differing_element_past_the_first_read_tells(tmp_path: Path) -> None:
    part = torch.zeros(300_000)
    part[-1] = 1.0
    files = _rank_files(tmp_path, [part, part.clone()])
    assert [r.telling for r in repeated_ranks(files)] == [True]


def test_files_without_partitions_are_compared_whole_and_never_tell(tmp_path: Path) -> None:
    files = _rank_files(tmp_path, [None, None, None])
    assert [(r.rank, r.other, r.partitioned, r.telling) for r in repeated_ranks(files)] == [
        (1, 0, False, False),
        (2, 0, False, False),
    ]


@pytest.mark.slow
def test_a_zero3_checkpoint_told_apart_only_by_small_frozen_slices(tmp_path: Path) -> None:
    """DeepSpeed's sample resharded to 16 ranks: every frozen slice is under 64 bytes, and the
    rest of the model-states files of rank 0 and of the ranks reshard added (the buffers, rank
    0's) is alike. It is read (equal to DeepSpeed's zero_to_fp32 output), verify passes it, and
    a rank file copied over another of them is still refused, the files saved to a stream (so
    no archive name tells) and under their own names."""
    case = sample("z3_fp16_ws4_subgroups_frozen")
    reshard(case.checkpoint, tmp_path / "rs", world_size=16)
    tag = tmp_path / "rs" / case.meta["tag"]
    names = [tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(16)]
    first, second = (
        {i.filename.split("/data/")[1]: (i.file_size, i.CRC) for i in data_records(path)}
        for path in (names[0], names[4])
    )
    differing = [key for key in first if first[key] != second.get(key)]
    assert differing and all(first[key][0] < 64 for key in differing)
    assert any(size >= 64 for key, (size, _) in first.items() if key not in differing)  # the buffers

    consolidate(tmp_path / "rs", tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    reference = case.reference()
    assert set(written) == set(reference) and all(same_bits(written[k], t) for k, t in reference.items())
    assert verify(tmp_path / "rs").ok

    named = {path: path.read_bytes() for path in names}
    for path in names:
        as_saved_to_a_stream(path)
    for source, victim in ((0, 4), (15, 14)):
        honest = names[victim].read_bytes()
        shutil.copyfile(names[source], names[victim])
        with pytest.raises(ZckptError) as caught:
            consolidate(tmp_path / "rs", tmp_path / "copied")
        assert caught.value.path == str(names[max(source, victim)]) and "copied over another" in str(caught.value), (
            caught.value
        )
        assert not (tmp_path / "copied").exists()
        assert not verify(tmp_path / "rs").ok
        names[victim].write_bytes(honest)
    for path, data in named.items():
        path.write_bytes(data)
    shutil.copyfile(names[0], names[4])
    with pytest.raises(ZckptError, match="was saved as zero_pp_rank_0_mp_rank_00_model_states.pt"):
        consolidate(tmp_path / "rs", tmp_path / "copied")


def test_a_zip_version_zipfile_refuses_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    """A central-directory record whose 'version needed to extract' reads 6.4 (one flipped bit; the
    fuzz found it): Python's zipfile raises NotImplementedError, which verify's checksum pass
    took for a crash. Now the file is named as damaged, and nothing raises."""
    folder = tmp_path / "ckpt"
    shutil.copytree(sample("z0_fp32_ws2_tied").checkpoint, folder)
    path = folder / "global_step3" / "mp_rank_00_model_states.pt"
    raw = bytearray(path.read_bytes())
    central = raw.index(b"PK\x01\x02")
    raw[central + 6 : central + 8] = (64).to_bytes(2, "little")  # version needed to extract: 6.4
    path.write_bytes(bytes(raw))
    assert archive_records(str(path)) == ()
    report = verify(folder)
    assert not report.ok and any(str(path) in p for p in report.problems), report.problems


def test_a_record_read_in_slices_keeps_its_runs_joined() -> None:
    """Slices of a record that meet end to start are joined as they come (a ZeRO-3 partition is
    read a slice per param and output file: thousands until the job ends), in any order; slices
    read twice are kept apart; each piece's CRC is its bytes'."""
    from zckpt.io.checksums import Record, _Seen

    rng = random.Random(5)
    data = rng.randbytes(4000)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 60)))
        slices = [(a, b - a) for a, b in zip([0, *cuts], [*cuts, len(data)])]
        twice = rng.sample(slices, rng.randrange(0, 3))
        seen = _Seen(Record("x", 0, len(data), zlib.crc32(data)))
        for start, length in rng.sample(slices, len(slices)) + twice:
            seen.add(start, length, zlib.crc32(data[start : start + length]))
        assert all(zlib.crc32(data[s : s + n]) == crc for s, n, crc in seen.pieces)
        assert (0, len(data)) in [(s, n) for s, n, _ in seen.pieces]  # whole, however it came
        assert len(seen.pieces) <= 1 + len(twice)

"""What an untrusted checkpoint cannot do (README): names in it never steer a write or a read,
and files carried along never leak what a symlink points at.

Each crafted input is what an attacker would ship: a `latest` naming ``../x`` or an absolute
path, a param or optimizer-state name holding ``../``, a carried file (or a raw swap file, or
``latest`` itself) that is a link to a secret outside the checkpoint. Every writing command is
run on it through the real command line, and judged by independent facts: its exit code and
its one line on stderr; the whole folder around input and output, listed before and after
(nothing may appear or change outside the output folder); and the secret's bytes, searched for
in every output file and in what the command printed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import SAMPLES, listing, rename_everywhere, run_cli, same_bits, sample
from zckpt import OutputError, UnsafePathError, to_universal
from zckpt.core.untrusted import input_roots, name_problem, path_component, regular_file_inside
from zckpt.deepspeed.save import write_checkpoint
from zckpt.io.output import StagedOutput, path_inside
from zckpt.ops.reshard import plan_reshard

ZERO2 = "z2_fp32_ws1"  # one rank, ZeRO-2: the "small ZeRO-2 checkpoint"
TRAINER = "hf_trainer"  # a Trainer checkpoint-N folder (config, tokenizer, trainer_state beside the tag)
NVME = "z3_bf16_ws2_nvmeoffload_frozen_tied_groups"  # raw swap files in offloaded_tensors/
PEFT_RUN = SAMPLES / "peft_lora" / "gpt2_z2_fp32_ws2"
MARKER = b"zckpt-canary-5e1f0c"  # in the secret: found anywhere in an output, it leaked
SECRET = (b"-----BEGIN OPENSSH PRIVATE KEY----- " + MARKER + b"\n") * 40_000  # 2.2 MB: big enough for any swap file


# --- the facts a test judges by ---------------------------------------------------------------------


def holds_secret(root: Path) -> list[str]:
    """The files under `root` in which the secret's marker appears."""
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and MARKER in p.read_bytes()]


class World:
    """A folder holding the crafted input, a secret outside it and the command's output."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.secret = tmp_path / "home" / ".ssh" / "id_rsa"
        self.secret.parent.mkdir(parents=True)
        self.secret.write_bytes(SECRET)
        self.out = tmp_path / "out"

    def copy(self, source: Path, name: str = "ck") -> Path:
        target = self.root / name
        shutil.copytree(source, target, symlinks=True)
        return target

    def run(self, *args: str | Path, code: int, names: tuple[str, ...] = ()) -> list[str]:
        """Run zckpt; it must exit `code`, leave everything outside the output folder as it was,
        and put no byte of the secret into the output or its messages. Exit 1: one line naming
        each of `names`, and no output folder. Returns stderr's lines."""
        before = listing(self.root, skip=self.out)
        result = run_cli(*args, cwd=self.root)
        assert result.returncode == code, (args, result.returncode, result.stdout[-2000:], result.stderr[-2000:])
        assert listing(self.root, skip=self.out) == before, (
            f"{args}: something appeared or changed outside the output folder"
        )
        assert MARKER.decode() not in result.stdout + result.stderr, f"{args}: the secret was printed"
        if self.out.exists():
            assert not holds_secret(self.out), f"{args}: the secret reached the output"
        lines = result.stderr.strip().splitlines()
        if code == 1:
            assert len(lines) == 1 and lines[0].startswith("zckpt: error: ") and "Traceback" not in result.stderr, (
                result.stderr
            )
            for name in names:
                assert name in lines[0], (name, lines[0])
            assert not self.out.exists(), f"{args}: a refused run left {self.out}"
        return lines


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# --- crafting ----------------------------------------------------------------------------------------


def tag_of(checkpoint: Path) -> Path:
    return checkpoint / (checkpoint / "latest").read_text().strip()


# --- 1. the rule and the fence, as functions ------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["global_step3", "exp_avg", "base_model.model.layers.0.lora_A.weight", "a\\b", "ü" * 127, "-x", ".hidden"]
)
def test_plain_names_pass(name: str) -> None:
    assert path_component(name, "f", "name") == name


@pytest.mark.parametrize(
    "name,problem",
    [
        ("../escape_tag", "holds '/'"),
        ("/tmp/abs_target", "holds '/'"),
        ("a/b.weight", "holds '/'"),
        ("..", "'..'"),
        (".", "'.'"),
        ("", "empty"),
        ("x\x00y", "control"),
        ("global_step3\n", "control"),
        ("a\x7fb", "control"),
        ("a\x85b", "control"),
        ("x" * 256, "256 bytes"),
        ("ü" * 128, "256 bytes"),
        ("\udc80x", "not valid text"),
        (7, "int"),
        (None, "NoneType"),
    ],
)
def test_crafted_names_are_refused_naming_file_and_name(name: object, problem: str) -> None:
    assert problem in (name_problem(name) or "")
    with pytest.raises(UnsafePathError) as caught:
        path_component(name, "ck/latest", "tag")
    message = str(caught.value)
    assert message.startswith("ck/latest: tag ") and "\n" not in message and len(message) < 300


def test_the_writers_fence_keeps_every_path_inside_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path)
    assert path_inside(str(folder), "zero/a/fp32.pt") == str(folder / "zero/a/fp32.pt")
    for relative in ("../x", "/tmp/x", ".", "", "a/../../x", "link/x"):
        with pytest.raises(OutputError):
            path_inside(str(folder), relative)
    before = listing(tmp_path)
    with pytest.raises(OutputError), StagedOutput(str(tmp_path / "staged"), ["../x"]) as staged:
        staged.temp_path("../x")
    assert listing(tmp_path) == before


def test_a_writer_given_an_unchecked_tag_still_writes_nothing_outside(tmp_path: Path) -> None:
    """The second fence alone: a plan whose tag never went through the rule (a future caller's
    bug) cannot place the tag folder, nor `latest`, outside the output folder."""
    plan = plan_reshard(sample(ZERO2).checkpoint, world_size=1)
    for tag in ("../escaped", str(tmp_path / "absolute"), "."):
        before = listing(tmp_path)
        with pytest.raises(OutputError):
            write_checkpoint(dataclasses.replace(plan, tag=tag), str(tmp_path / "out"))
        assert listing(tmp_path) == before, tag


def test_links_are_followed_only_inside_the_input(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "real.json").write_text("{}")
    (tmp_path / "outside.json").write_text("{}")
    (folder / "inside.json").symlink_to("sub/real.json")
    (folder / "out.json").symlink_to("../outside.json")
    (folder / "abs.json").symlink_to(tmp_path / "outside.json")
    (folder / "dangling_out.json").symlink_to("/nonexistent/x")
    (folder / "dangling_in.json").symlink_to("sub/none.json")
    os.mkfifo(folder / "fifo")
    assert regular_file_inside(folder / "inside.json", folder)
    assert not regular_file_inside(folder / "sub", folder) and not regular_file_inside(folder / "fifo", folder)
    assert not regular_file_inside(folder / "dangling_in.json", folder) and not regular_file_inside(
        folder / "absent", folder
    )
    for name in ("out.json", "abs.json", "dangling_out.json"):
        with pytest.raises(UnsafePathError, match="outside"):
            regular_file_inside(folder / name, folder)


def test_hub_cache_snapshots_may_link_into_their_blobs_only(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/f00d")
    assert input_roots(snapshot) == (str(snapshot.resolve()), str((repo / "blobs").resolve()))
    assert regular_file_inside(snapshot / "config.json", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snapshot / "refs.json").symlink_to("../../refs/main")  # in the repo, not in blobs/
    with pytest.raises(UnsafePathError):
        regular_file_inside(snapshot / "refs.json", snapshot)
    # a blobs/ that is itself a link elsewhere lends no trust to what it points at
    fake = tmp_path / "fake" / "models--a--b"
    (fake / "snapshots" / "r").mkdir(parents=True)
    (fake / "blobs").symlink_to(tmp_path / "hub")
    (fake / "snapshots" / "r" / "tokenizer.json").symlink_to("../../blobs/models--org--name/blobs/f00d")
    with pytest.raises(UnsafePathError):
        regular_file_inside(fake / "snapshots" / "r" / "tokenizer.json", fake / "snapshots" / "r")


# --- 2. `latest` naming a folder outside the checkpoint ----------------------------------------------


def escape_latest(world: World, source: Path, how: str) -> Path:
    """A copy of `source` whose tag folder lies outside it, `latest` naming it there: relatively
    (``../escape_tag``, the issue's case), by an absolute path, or through a `latest` that is a
    symlink to the secret (whose text would name the tag)."""
    ck = world.copy(source)
    tag = tag_of(ck)
    if how == "relative":
        shutil.move(tag, world.root / "escape_tag")
        (ck / "latest").write_text("../escape_tag")
    elif how == "absolute":
        shutil.move(tag, world.root / "abs_target")
        (ck / "latest").write_text(str(world.root / "abs_target"))
    else:
        (ck / "latest").unlink()
        (ck / "latest").symlink_to(world.secret)
    return ck


WRITING_COMMANDS = {
    "consolidate": ("consolidate", "{ck}", "{out}"),
    "reshard": ("reshard", "{ck}", "{out}", "--world-size", "2"),
    "to-universal": ("to-universal", "{ck}", "{out}"),
    "to-dcp": ("to-dcp", "{ck}", "{out}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_latest_pointing_outside_is_refused_by_every_command(world: World, how: str) -> None:
    ck = escape_latest(world, sample(ZERO2).checkpoint, how)
    named = "leads to" if how == "symlink" else "../escape_tag" if how == "relative" else "abs_target"
    for command in WRITING_COMMANDS.values():
        world.run(*(a.format(ck=ck, out=world.out) for a in command), code=1, names=(str(ck / "latest"), named))
    # the readers too: inspect and verify describe it as a problem (exit 3), diff cannot compare
    for command in (("inspect", ck), ("verify", ck)):
        world.run(*command, code=3)
    world.run("diff", ck, sample(ZERO2).checkpoint, code=1, names=(named,))
    world.run("inspect", ck / "latest", code=3)


@pytest.mark.slow
def test_latest_pointing_outside_a_peft_checkpoint_is_refused(world: World) -> None:
    """consolidate's PEFT outputs (the adapter folder, the merge into a base) read the same way."""
    ck = escape_latest(world, PEFT_RUN / "checkpoint-3", "relative")
    world.run("consolidate", ck, world.out, code=1, names=("../escape_tag",))
    world.run("consolidate", ck, world.out, "--merge-into", PEFT_RUN / "base", code=1, names=("../escape_tag",))


@pytest.mark.slow
def test_tag_folder_and_carried_file_names_must_be_plain(world: World) -> None:
    """Names read from a folder listing are one component already, but may hold control
    characters: a tag folder (the one there, `latest` absent) or a carried file so named is
    refused where it would name an output folder or file."""
    ck = world.copy(sample(ZERO2).checkpoint)
    (ck / "latest").unlink()
    tag, crafted = ck / "global_step3", ck / "global_step3\x1b[2J"
    shutil.move(tag, crafted)
    world.run("reshard", ck, world.out, "-w", "1", code=1, names=("tag folder name", "'global_step3\\x1b[2J'"))
    shutil.move(crafted, tag)
    (ck / "notes\n.txt").write_text("notes")
    world.run("reshard", ck, world.out, "-w", "1", code=1, names=("file name", "'notes\\n.txt'"))


@pytest.mark.slow
def test_tag_option_with_a_path_is_refused(world: World) -> None:
    ck = world.copy(sample(ZERO2).checkpoint)
    shutil.copytree(tag_of(ck), world.root / "beside")
    world.run("to-universal", ck, world.out, "--tag", "../beside", code=1, names=("'../beside'",))
    world.run("reshard", ck, world.out, "-w", "1", "--tag", str(world.root / "beside"), code=1, names=("holds '/'",))


# --- 3. param and optimizer-state names holding a path ----------------------------------------------

PARAM = "fc1.weight"


def crafted_param_names(world: World) -> list[str]:
    """Names that, used as zero/<name>/ under the output, would land outside it (inside the
    world, where the listing sees them), or be no file name at all."""
    return ["../../../pwned_param", str(world.root / "abs_pwned"), "fc1/weight", "fc1\nweight"]


@pytest.mark.slow
def test_param_name_with_a_path_never_becomes_a_folder(world: World) -> None:
    """The issue's case: a param renamed ``../../...`` in the model states and in every rank's
    param_slice_mappings (a consistent checkpoint). to-universal, where param names become
    folders, refuses it; consolidate and reshard, where a name is only a key, write it inside
    their output, under that key."""
    expected = sample(ZERO2).expected_fp32()
    for crafted in crafted_param_names(world):
        ck = world.copy(sample(ZERO2).checkpoint)
        rename_everywhere(tag_of(ck), PARAM, crafted)
        world.run("to-universal", ck, world.out, code=1, names=(str(tag_of(ck)), "param name", repr(crafted)[:40]))
        world.run("consolidate", ck, world.out, code=0)
        written = load_file(world.out / "model.safetensors")
        assert same_bits(written[crafted], expected[PARAM]) and PARAM not in written
        shutil.rmtree(world.out)
        world.run("reshard", ck, world.out, "--world-size", "2", code=0)
        shutil.rmtree(world.out)
        shutil.rmtree(ck)


@pytest.mark.slow
def test_optimizer_state_name_with_a_path_never_becomes_a_file(world: World) -> None:
    ck = world.copy(sample(ZERO2).checkpoint)
    rename_everywhere(tag_of(ck), "exp_avg", "../../../../pwned_state")
    world.run(
        "to-universal",
        ck,
        world.out,
        code=1,
        names=(str(tag_of(ck)), "optimizer state name", "'../../../../pwned_state'"),
    )
    world.run("reshard", ck, world.out, "--world-size", "2", "--stage", "3", code=0)


@pytest.mark.slow
def test_state_name_of_a_swapped_sub_group_is_refused_on_read(world: World) -> None:
    """In an NVMe-offloaded checkpoint a state's name is part of its swap file's name: read
    as a path it would open a file outside offloaded_tensors/."""
    ck = world.copy(sample(NVME).checkpoint)
    rename_everywhere(tag_of(ck), "exp_avg", "../../../exp_avg")
    world.run(
        "consolidate", ck, world.out, code=1, names=("optim_states.pt", "optimizer state name", "'../../../exp_avg'")
    )
    world.run("inspect", ck, code=3)


@pytest.mark.slow
def test_universal_folder_whose_param_names_hold_a_path_is_refused(world: World) -> None:
    """A universal folder names each param's folder by the model states: a crafted name would
    make zckpt read the param from outside the folder (here, where it points, a real one)."""
    to_universal(sample(ZERO2).checkpoint, world.root / "uc")
    uc_tag = world.root / "uc" / "global_step3_universal"
    shutil.move(uc_tag / "zero" / PARAM, world.root / "outside_param")
    rename_everywhere(uc_tag, PARAM, "../../../outside_param")
    for command in WRITING_COMMANDS.values():
        args = [a.format(ck=world.root / "uc", out=world.out) for a in command]
        world.run(*args, code=1, names=("mp_rank_00_model_states.pt", "'../../../outside_param'"))
    world.run("inspect", world.root / "uc", code=3)


# --- 4. symlinks in the input ---------------------------------------------------------------------------


def link(path: Path, target: Path | str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(target)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_extra.json"])
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_carried_file_linked_to_a_secret_is_refused(world: World, name: str, relative: bool) -> None:
    """The issue's case: a Trainer checkpoint-N folder holding ``<name> -> /etc/passwd`` (here a
    key). reshard carries every file, consolidate the files from_pretrained reads: neither copies
    the target's bytes. consolidate does not carry tokenizer_extra.json, so it has nothing to
    refuse there."""
    ck = world.copy(sample(TRAINER).checkpoint, "checkpoint-3")
    link(ck / name, os.path.relpath(world.secret, ck) if relative else world.secret)
    world.run(
        "reshard",
        ck,
        world.out,
        "--world-size",
        "1",
        code=1,
        names=(str(ck / name), f"leads to {world.secret}", "outside"),
    )
    world.run("consolidate", ck, world.out, code=1 if name == "tokenizer.json" else 0, names=(str(ck / name),))


@pytest.mark.slow
def test_carried_file_linked_inside_the_input_is_copied_as_a_file(world: World) -> None:
    ck = world.copy(sample(TRAINER).checkpoint, "checkpoint-3")
    (ck / "shared").mkdir()
    shutil.move(ck / "tokenizer.json", ck / "shared" / "tokenizer.json")
    link(ck / "tokenizer.json", "shared/tokenizer.json")
    original = (sample(TRAINER).checkpoint / "tokenizer.json").read_bytes()
    for command in (("consolidate", ck, world.out), ("reshard", ck, world.out, "-w", "1")):
        world.run(*command, code=0)
        copied = world.out / "tokenizer.json"
        assert not copied.is_symlink() and copied.read_bytes() == original
        shutil.rmtree(world.out)


@pytest.mark.slow
def test_accelerate_folder_with_a_linked_random_state_is_refused(world: World) -> None:
    """accelerate's save_state folder: `latest` names the tag pytorch_model, its per-process
    random_states_<i>.pkl and scheduler.bin beside it; reshard copies them unopened."""
    ck = world.copy(sample(ZERO2).checkpoint, "state")
    shutil.move(tag_of(ck), ck / "pytorch_model")
    (ck / "latest").write_text("pytorch_model")
    (ck / "scheduler.bin").write_bytes(b"scheduler")
    link(ck / "random_states_0.pkl", world.secret)
    world.run("reshard", ck, world.out, "-w", "2", code=1, names=(str(ck / "random_states_0.pkl"),))
    (ck / "random_states_0.pkl").unlink()
    world.run("reshard", ck, world.out, "-w", "2", code=0)
    assert (world.out / "scheduler.bin").read_bytes() == b"scheduler"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["README.md", "adapter_config.json"])
def test_peft_adapter_files_linked_out_are_refused(world: World, name: str) -> None:
    ck = world.copy(PEFT_RUN / "checkpoint-3", "checkpoint-3")
    shutil.copy(ck / name, world.root / "home" / name)  # a plausible file, outside the checkpoint
    link(ck / name, world.root / "home" / name)
    world.run("consolidate", ck, world.out, code=1, names=(str(ck / name),))
    # a merge copies the base's files, not the adapter's card, but reads the adapter's config
    merge_reads = name == "adapter_config.json"
    world.run(
        "consolidate",
        ck,
        world.out,
        "--merge-into",
        PEFT_RUN / "base",
        code=1 if merge_reads else 0,
        names=(str(ck / name),),
    )


@pytest.mark.slow
def test_merge_base_with_a_linked_file_or_a_shard_outside_is_refused(world: World) -> None:
    ck = PEFT_RUN / "checkpoint-3"
    base = world.copy(PEFT_RUN / "base", "base")
    link(base / "tokenizer.json", world.secret)
    world.run("consolidate", ck, world.out, "--merge-into", base, code=1, names=(str(base / "tokenizer.json"),))
    # a sharded base whose index names a shard outside its folder (a real one, read if followed)
    llama = SAMPLES / "peft_lora" / "llama_z3_bf16_ws2"
    base = world.copy(llama / "base", "llama_base")
    shutil.move(base / "model-00002-of-00002.safetensors", world.root / "model-00002-of-00002.safetensors")
    index = base / "model.safetensors.index.json"
    index.write_text(
        index.read_text().replace('"model-00002-of-00002.safetensors"', '"../model-00002-of-00002.safetensors"')
    )
    world.run(
        "consolidate", llama / "checkpoint-3", world.out, "--merge-into", base, code=1, names=(str(index), "shard name")
    )
    world.run("diff", index, index, code=1, names=(str(index), "shard name"))
    world.run("inspect", index, code=3)


@pytest.mark.slow
def test_raw_swap_file_linked_to_a_secret_is_refused(world: World) -> None:
    """NVMe swap files are raw bytes with no header or checksum: followed, the link would put
    the secret into the weights (it is big enough to pass the size check)."""
    ck = world.copy(sample(NVME).checkpoint)
    swap = next(tag_of(ck).glob("offloaded_tensors/rank00/*.tensor.swp"))
    assert swap.stat().st_size <= len(SECRET)
    link(swap, world.secret)
    for command in WRITING_COMMANDS.values():
        world.run(*(a.format(ck=ck, out=world.out) for a in command), code=1, names=(str(swap), "outside"))


@pytest.mark.slow
def test_rank_files_may_link_to_another_folder(world: World) -> None:
    """Clusters link rank files between checkpoint folders: a torch archive is followed wherever
    it lies, since it must parse as an archive of the layout the checkpoint declares; a link to
    anything else (the secret) is refused as such, in one line that prints none of it."""
    ck = world.copy(sample(ZERO2).checkpoint)
    rank_file = tag_of(ck) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shared = world.root / "shared" / rank_file.name
    shared.parent.mkdir()
    shutil.move(rank_file, shared)
    link(rank_file, shared)
    world.run("consolidate", ck, world.out, code=0)
    written, expected = load_file(world.out / "model.safetensors"), sample(ZERO2).expected_fp32()
    assert set(written) == set(expected) and all(same_bits(written[k], t) for k, t in expected.items())
    shutil.rmtree(world.out)
    link(rank_file, world.secret)
    for command in WRITING_COMMANDS.values():
        world.run(*(a.format(ck=ck, out=world.out) for a in command), code=1, names=(str(rank_file),))
    # a whole tag folder linked from elsewhere reads as well
    link(rank_file, shared)
    shutil.move(tag_of(ck), world.root / "shared" / "global_step3")
    link(ck / "global_step3", "../shared/global_step3")
    world.run("reshard", ck, world.out, "-w", "2", code=0)
    assert sorted(p.name for p in (world.out / "global_step3").iterdir()) == sorted(
        p.name for p in (sample(ZERO2).checkpoint / "global_step3").iterdir()
    ) + ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def hub_snapshot(world: World, source: Path, repo: str) -> Path:
    """`source` laid out as huggingface_hub's cache leaves a snapshot_download: every file of
    ``<repo>/snapshots/<revision>/`` a relative link to ``<repo>/blobs/<sha256>``."""
    repo_dir = world.root / "hub" / repo
    snapshot = repo_dir / "snapshots" / "4f8e0c1d2b3a"
    (repo_dir / "blobs").mkdir(parents=True)
    for path in sorted(source.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            target = snapshot / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.path.relpath(blob, target.parent))
    return snapshot


@pytest.mark.slow
def test_hub_cache_snapshots_are_read_and_copied(world: World) -> None:
    """snapshot_download's folders link every file into the repo's blobs/: their files are
    the input's own, copied as files."""
    ck = hub_snapshot(world, sample(TRAINER).checkpoint, "models--org--trained")
    tokenizer = (sample(TRAINER).checkpoint / "tokenizer.json").read_bytes()
    for command in (("consolidate", ck, world.out), ("reshard", ck, world.out, "-w", "1")):
        world.run(*command, code=0)
        assert (
            not (world.out / "tokenizer.json").is_symlink() and (world.out / "tokenizer.json").read_bytes() == tokenizer
        )
        shutil.rmtree(world.out)
    base = hub_snapshot(world, PEFT_RUN / "base", "models--org--base")
    world.run("consolidate", PEFT_RUN / "checkpoint-3", world.out, "--merge-into", base, code=0)
    merged, expected = load_file(world.out / "model.safetensors"), load_file(PEFT_RUN / "merged_step3.safetensors")
    assert set(merged) and all(same_bits(t, expected[k]) for k, t in merged.items())  # PEFT's merge_and_unload
    assert (world.out / "config.json").is_file() and not (world.out / "config.json").is_symlink()


# --- 5. the trainer's resume-then-save ---------------------------------------------------------------

SMALL = ("--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "31", "--seq-len", "8", "--micro-batch", "2")


@pytest.mark.heavy
@pytest.mark.slow
def test_train_resume_then_save_writes_only_its_output(world: World) -> None:
    """`zckpt train --resume` reads a checkpoint as every command does (a crafted `latest` or a
    linked one is refused before any step), and its saves land in --out only."""
    run_cli("train", "--out", world.root / "run", "--steps", "2", *SMALL, cwd=world.root).check_returncode()
    world.run("train", "--resume", world.root / "run", "--out", world.out, "--steps", "3", *SMALL, code=0)
    assert (world.out / "latest").read_text() == "global_step3"
    shutil.rmtree(world.out)
    for how in ("relative", "absolute", "symlink"):
        ck = escape_latest(world, world.root / "run", how)
        world.run(
            "train", "--resume", ck, "--out", world.out, "--steps", "3", *SMALL, code=1, names=(str(ck / "latest"),)
        )
        shutil.rmtree(ck)
        for moved in ("escape_tag", "abs_target"):
            shutil.rmtree(world.root / moved, ignore_errors=True)
    ck = world.copy(world.root / "run")
    rename_everywhere(tag_of(ck), "blocks.0.attn.qkv.weight", "../../../pwned_param")
    world.run("train", "--resume", ck, "--out", world.out, "--steps", "3", *SMALL, code=1, names=("absent",))

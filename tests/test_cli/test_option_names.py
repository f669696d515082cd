"""Every command's options held to one table of names (issue 37: one name per idea), read from the
live click command tree: an option a command shows must be an idea of :data:`IDEAS` (its one long
spelling, its short flag, its metavar) or listed as that command's own in :data:`OWN`, so a new
option, or a second spelling of an old idea, fails here until the table says what it is. Old
spellings live on as hidden aliases (:data:`ALIASES`), which still work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
import typer.main

from helpers import runner, sample
from zckpt.cli.app import app
from zckpt.cli.shared import HIDDEN_SPELLINGS

ROOT_COMMAND = typer.main.get_command(app)
COMMANDS = ROOT_COMMAND.commands


class Idea:
    def __init__(self, long: str, short: Optional[str] = None, metavar: Optional[str] = None, one_help: bool = True):
        self.long, self.short, self.metavar, self.one_help = long, short, metavar, one_help


# idea -> its one spelling, short flag and metavar; one_help: the same help text in every command
IDEAS: dict[str, Idea] = {
    "help": Idea("--help", "-h"),
    "quiet": Idea("--quiet", "-q"),
    "json output": Idea("--json"),
    "traceback on error": Idea("--debug", "-d"),
    "tag to read": Idea("--tag", "-t", "TAG"),
    "threads reading or writing files": Idea("--workers", None, "N"),
    "world size of the target run": Idea("--world-size", "-w", "N", one_help=False),  # nvme-plan's has a default
    "ZeRO stage of the target run": Idea("--stage", None, "STAGE"),
    "ZeRO-Infinity swap folder": Idea("--swap-folder", None, "NVME_PATH"),
    "tensor-parallel merge rules": Idea("--tp-rules", None, "FILE"),
    "wait for another writer": Idea("--wait"),
    "skip the CRC-32 check": Idea("--no-verify"),
    "replace existing output": Idea("--overwrite", one_help=False),  # says what is replaced
    "a DeepSpeed config": Idea("--config", None, "FILE", one_help=False),  # says what is taken from it
    "dtype": Idea("--dtype", None, "DTYPE", one_help=False),  # of what, per command
    "a checkpoint beside a swap folder": Idea("--checkpoint", None, "CKPT", one_help=False),
    # reshard's and to-universal's: the layout of the run that will load the output (help per command)
    "tensor ranks of the target run": Idea("--tensor-parallel", None, "T", one_help=False),
    "expert-parallel degree of the target run": Idea("--expert-parallel", None, "E", one_help=False),
}
EVERY_COMMAND = ("help", "quiet", "json output", "traceback on error")

# each command's own options: long spelling -> short flag (or None)
OWN: dict[str, dict[str, Optional[str]]] = {
    "": {"--version": None, "--install-completion": None, "--show-completion": None},
    "consolidate": {
        "--format": "-f",
        "--max-shard-size": None,
        "--exclude-frozen": None,
        "--peft": None,
        "--merge-into": None,
        "--optimizer-states": None,
    },
    "inspect": {"--verify": None},
    "verify": {"--scan": None},
    "reshard": {
        "--pipeline-stages": None,
        "--layer-partition": None,
        "--padded-vocab-size": None,
    },
    "to-universal": {"--allow-state-loss": None},
    "to-dcp": {},
    "diff": {"--atol": None, "--rtol": None, "--states": None},
    "nvme-plan": {"--memory-budget": None, "--frozen": None},
    "train": {
        name: None
        for name in (
            "--out",
            "--steps",
            "--save-every",
            "--layers",
            "--dim",
            "--heads",
            "--vocab",
            "--seq-len",
            "--micro-batch",
            "--grad-accum",
            "--lr",
            "--warmup",
            "--clip",
            "--tie-embeddings",
            "--freeze",
            "--sub-group-size",
            "--nvme-path",
            "--nvme-params",
            "--bounded-memory",
            "--resume",
            "--seed",
            "--data",
            "--device",
        )
    },
}

# old spelling -> (the commands that take it, the spelling it stands for); hidden, still working
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "--target-stage": (("reshard", "to-universal"), "--stage"),
    "--max_shard_size": (("consolidate",), "--max-shard-size"),
    "--exclude_frozen_parameters": (("consolidate",), "--exclude-frozen"),
}
# whole options kept hidden for zero_to_fp32.py's users (no-ops or aliases of a default)
HIDDEN_OPTIONS = {"consolidate": {"--safe_serialization"}}


def options(command: Any) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def shown_names(param: Any) -> list[str]:
    return [o for o in param.opts + param.secondary_opts if o not in HIDDEN_SPELLINGS]


def idea_of(long: str) -> Optional[Idea]:
    return next((idea for idea in IDEAS.values() if idea.long == long), None)


def all_commands() -> list[tuple[str, Any]]:
    return [("", ROOT_COMMAND), *COMMANDS.items()]


def test_the_table_lists_every_command_and_no_short_flag_twice() -> None:
    assert set(OWN) == {"", *COMMANDS}
    shorts = [i.short for i in IDEAS.values() if i.short] + [s for own in OWN.values() for s in own.values() if s]
    assert len(shorts) == len(set(shorts)), f"a short flag means two things: {sorted(shorts)}"
    longs = [i.long for i in IDEAS.values()]
    assert not set(longs) & {name for own in OWN.values() for name in own}, "an idea listed as a command's own"


@pytest.mark.parametrize("name, command", all_commands(), ids=[n or "zckpt" for n, _ in all_commands()])
def test_every_shown_option_is_in_the_table(name: str, command: Any) -> None:
    for param in options(command):
        if param.hidden:
            assert param.opts[0] in HIDDEN_OPTIONS.get(name, set()), f"{name}: hidden {param.opts} not in the table"
            continue
        names = shown_names(param)
        longs = [n for n in names if n.startswith("--")]
        shorts = [n for n in names if not n.startswith("--")]
        long = longs[0]
        assert all(n.startswith("--no-") for n in longs[1:]), f"{name}: {long} has other long spellings {longs[1:]}"
        idea = idea_of(long)
        if idea is None:
            assert long in OWN[name], f"zckpt {name}: {long} is neither an idea of the table nor listed as its own"
            expected_short = OWN[name][long]
        else:
            expected_short = idea.short
            if not param.is_flag:
                assert param.metavar == idea.metavar, (
                    f"zckpt {name} {long}: metavar {param.metavar}, not {idea.metavar}"
                )
        assert shorts == ([expected_short] if expected_short else []), f"zckpt {name} {long}: short flags {shorts}"
    if name:
        for key in EVERY_COMMAND:
            long = IDEAS[key].long
            assert any(long in p.opts for p in options(command)) or long == "--help", f"zckpt {name} lacks {long}"
        shown = runner.invoke(app, [name, "-h"])
        assert shown.exit_code == 0 and shown.output.startswith(f"Usage: zckpt {name} "), shown.output


def test_one_help_text_per_shared_idea() -> None:
    texts: dict[str, set[str]] = {}
    for _, command in COMMANDS.items():
        for param in options(command):
            idea = idea_of(param.opts[0]) or next(
                (i for i in IDEAS.values() if i.long in param.opts + param.secondary_opts), None
            )
            if idea is not None and idea.one_help and param.help:
                texts.setdefault(idea.long, set()).add(param.help)
    drifted = {long: sorted(t) for long, t in texts.items() if len(t) > 1}
    assert not drifted, f"one idea, several help texts: {drifted}"


def test_aliases_are_hidden_and_stand_for_the_new_spelling() -> None:
    assert set(ALIASES) == set(HIDDEN_SPELLINGS)
    for alias, (commands, new) in ALIASES.items():
        for name in commands:
            owner = [p for p in options(COMMANDS[name]) if alias in p.opts + p.secondary_opts]
            assert len(owner) == 1 and new in owner[0].opts, f"zckpt {name} {alias}"
            shown = runner.invoke(app, [name, "--help"]).output
            assert alias not in shown.split("Examples")[0].split("Options:")[1], f"zckpt {name} --help shows {alias}"


def test_old_spelling_target_stage_still_works(tmp_path: Path) -> None:
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    for spelling, out in (("--target-stage", "old"), ("--stage", "new")):
        result = runner.invoke(app, ["to-universal", checkpoint, str(tmp_path / out), spelling, "3", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["outputs"]["zero_stage"] == 3
    old = sorted(p.name for p in (tmp_path / "old").rglob("*"))
    assert old == sorted(p.name for p in (tmp_path / "new").rglob("*"))
    result = runner.invoke(app, ["reshard", checkpoint, str(tmp_path / "r"), "-w", "2", "--target-stage", "1", "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()


def test_nvme_plan_takes_w_like_reshard() -> None:
    checkpoint = str(sample("z2_fp32_ws1").checkpoint)
    short = runner.invoke(app, ["nvme-plan", checkpoint, "-w", "4", "--json"])
    long = runner.invoke(app, ["nvme-plan", checkpoint, "--world-size", "4", "--json"])
    assert short.exit_code == long.exit_code == 0, short.output
    assert json.loads(short.stdout)["world_size"] == json.loads(long.stdout)["world_size"] == 4

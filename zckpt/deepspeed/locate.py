"""Where a DeepSpeed checkpoint's tag folder is: a checkpoint folder and the tag its `latest` (or
`latest_universal`) names, a tag folder, a folder and a tag, the one tag folder there, a
Trainer's output folder (its newest ``checkpoint-N``), or a Lightning ``ModelCheckpoint`` folder
(its newest ``*.ckpt`` folder). Names taken from the input (the tag in
`latest`, folder names) must be plain folder names below the checkpoint folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..core.errors import CheckpointNotFoundError, CorruptFileError, UsageError, ZckptError
from ..core.run_folders import (
    LIGHTNING_FOLDER_NOTE,
    TRAINER_FOLDER_NOTE,
    newest_lightning_checkpoint,
    newest_trainer_checkpoint,
)
from ..core.untrusted import path_component, regular_file_inside
from . import names as N


def natural_key(text: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def is_tag_dir(path: str) -> bool:
    """A tag folder: it holds a *_model_states.pt."""
    try:
        return any(N.MODEL_STATES_RE.match(name) for name in os.listdir(path))
    except OSError:
        return False


def is_universal_dir(path: str) -> bool:
    """A universal checkpoint folder: ``zero/`` beside model_states files, no optimizer files."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return (
        N.UNIVERSAL_ZERO_DIR in names
        and os.path.isdir(os.path.join(path, N.UNIVERSAL_ZERO_DIR))
        and not any(N.OPTIM_STATES_RE.match(n) for n in names)
    )


def list_tags(checkpoint_dir: str) -> list[str]:
    """Tag folders (those holding a *_model_states.pt) in a checkpoint folder, in natural order."""
    try:
        children = os.listdir(checkpoint_dir)
    except OSError:
        return []
    # zckpt's staging and moved-aside folders (`.<tag>.zckpt-staging`) are not tags
    tags = [c for c in children if ".zckpt-" not in c and is_tag_dir(os.path.join(checkpoint_dir, c))]
    return sorted(tags, key=natural_key)


def looks_like_checkpoint(path: str) -> bool:
    """A folder with `latest`, a tag folder, or one holding tag folders."""
    return os.path.isfile(os.path.join(path, N.LATEST_FILE)) or is_tag_dir(path) or bool(list_tags(path))


@dataclass(frozen=True)
class Location:
    checkpoint_dir: str
    tag: str
    tags: tuple[str, ...]
    note: str | None = None  # how it was found, when the user named another folder

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.checkpoint_dir, self.tag)


def locate(path: str | os.PathLike[str], tag: str | None = None) -> Location:
    """Resolve a checkpoint folder (with `latest`), a tag folder, or a folder plus `tag`.

    Whatever names the tag (`tag`, `latest`, the one tag folder, the folder given) must be one
    plain folder name: it is read below `path`, and the writers name their output's tag folder
    and `latest` after it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(path, "no such file or directory")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(
            path, "expected a DeepSpeed checkpoint folder (the one holding 'latest'), got a file"
        )
    if tag is not None:
        path_component(tag, path, "tag")
    if is_tag_dir(path):
        parent, own_tag = os.path.split(os.path.normpath(path))
        if tag is not None and tag != own_tag:
            raise UsageError(path, f"is the folder of tag '{own_tag}', but --tag {tag} was given")
        parent = parent or "."
        return Location(
            parent, path_component(own_tag, path, "tag folder name"), tuple(list_tags(parent)) or (own_tag,)
        )
    tags = tuple(list_tags(path))
    listed = ", ".join(tags) if tags else "none"
    if tag is not None:
        if not os.path.isdir(os.path.join(path, tag)):
            # named after `path`, like a missing `path`: survey() raises it rather than listing it as a problem
            raise CheckpointNotFoundError(path, f"tag folder '{tag}' not found (tags here: {listed})")
        return Location(path, tag, tags)
    latest = os.path.join(path, N.LATEST_FILE)
    if not os.path.isfile(latest):  # a folder of universal checkpoints (zckpt to-universal's output)
        latest = os.path.join(path, N.LATEST_UNIVERSAL_FILE)
    if os.path.isfile(latest):
        named = tag_named_in(latest)
        if not os.path.isdir(os.path.join(path, named)):
            raise CheckpointNotFoundError(
                latest, f"names tag '{named}', but folder {os.path.join(path, named)} is missing (tags here: {listed})"
            )
        return Location(path, named, tags)
    if len(tags) == 1:
        return Location(path, path_component(tags[0], path, "tag folder name"), tags)
    if tags:
        raise UsageError(path, f"no 'latest' file and {len(tags)} tags ({listed}); pass --tag")
    newest = newest_trainer_checkpoint(path, looks_like_checkpoint)
    if newest is not None:  # a Trainer's output_dir: its newest checkpoint-N, as get_last_checkpoint picks
        found = locate(os.path.join(path, newest[0]), tag)
        note = f"{TRAINER_FOLDER_NOTE}: read {newest[0]}, the newest of {newest[1]} checkpoint-N folder(s)"
        return Location(found.checkpoint_dir, found.tag, found.tags, note)
    lightning = newest_lightning_checkpoint(path, looks_like_checkpoint)
    if lightning is not None:  # a Lightning ModelCheckpoint dirpath: as ckpt_path="last" picks
        found = locate(os.path.join(path, lightning[0]), tag)
        note = f"{LIGHTNING_FOLDER_NOTE}: read {lightning[0]}, {lightning[2]} of {lightning[1]} .ckpt folder(s)"
        return Location(found.checkpoint_dir, found.tag, found.tags, note)
    raise CheckpointNotFoundError(
        path, "no DeepSpeed checkpoint here (no 'latest' file, no tag folder holding *_model_states.pt)"
    )


def tag_named_in(latest: str) -> str:
    """The tag that DeepSpeed's `latest` (or `latest_universal`) file names, taken as a name from
    the input: the file must lie inside its checkpoint folder (a link out is refused and never
    read: its target's text would be echoed in messages) and name one plain folder."""
    regular_file_inside(latest, os.path.dirname(latest) or ".")
    try:
        with open(latest, encoding="utf-8") as handle:
            named = handle.read(4096).strip()  # a tag is short; more is refused by its length
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptFileError(latest, f"cannot read the tag it names ({exc})") from None
    if not named:
        raise CorruptFileError(
            latest,
            f"is empty; it should name a tag such as global_step100{N.UNIVERSAL_SUFFIX if latest.endswith(N.LATEST_UNIVERSAL_FILE) else ''}",
        )
    return path_component(named, latest, "tag")


def named_in_latest(checkpoint_dir: str) -> str | None:
    """The tag a folder's `latest` (or `latest_universal`) file names, or None if it names none
    that could be used (unreadable, empty, not a plain folder name)."""
    for name in (N.LATEST_FILE, N.LATEST_UNIVERSAL_FILE):
        if os.path.isfile(os.path.join(checkpoint_dir, name)):
            try:
                return tag_named_in(os.path.join(checkpoint_dir, name))
            except ZckptError:
                return None
    return None

"""The architecture rules, checked: the layers import downwards only (:data:`MAY_IMPORT`), no
module imports itself back through others, zckpt never imports DeepSpeed, DeepSpeed's names live
only in zckpt/deepspeed/, and nothing imports the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zckpt"
FORMAT_WORDS = (
    "optimizer_state_dict",
    "fp32_flat_groups",
    "single_partition_of_fp32_groups",
    "zero_pp_rank",
    "param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "partition_count",
)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


# --- the layers ----------------------------------------------------------------------------------
# Each part of the package (a subpackage, or a top module: __init__, __main__, compat) and the parts it may
# import besides itself, lowest layer first: core -> io -> torchfile -> {hf, deepspeed} -> ops ->
# {trainer, compat} -> cli. The container (torchfile) sits below the two formats that use it; hf and
# deepspeed never import each other (operations compose them); io moves bytes and knows no format.
# Function-level imports (lazy ones, TYPE_CHECKING ones) count as much as the module's own.
BELOW_OPS = {"core", "io", "torchfile", "hf", "deepspeed"}
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "io": {"core"},
    "torchfile": {"core", "io"},
    "hf": {"core", "io", "torchfile"},
    "deepspeed": {"core", "io", "torchfile"},
    "ops": BELOW_OPS,
    "trainer": BELOW_OPS | {"ops"},  # its round trip drives the operations; no operation knows the trainer
    # zckpt.compat: DeepSpeed's zero_to_fp32 functions by name, a facade over the operations
    "compat": BELOW_OPS | {"ops"},
    "cli": BELOW_OPS | {"ops", "trainer", "zckpt"},  # zckpt: the package's __version__
    "zckpt": {"core", "io", "deepspeed", "ops"},  # __init__: the errors, the start-up signal handler, the lazy API
    "__main__": {"io", "cli"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or the top module's name."""
    parts = module.split(".")
    return "zckpt" if len(parts) == 1 else parts[1]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every zckpt module `path` imports anywhere in it (inside functions and
    TYPE_CHECKING blocks too), relative imports resolved; ``from X import y`` names module X.y
    when y is a module, else X."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "zckpt"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "zckpt":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                where = PACKAGE.parent.joinpath(*sub.split("."))
                found.append((node.lineno, sub if where.with_suffix(".py").is_file() or where.is_dir() else target))
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): {target for _, target in imports_of(path)} for path in modules()}


def test_every_part_is_in_the_table() -> None:
    parts = {part_of(module_name(path)) for path in modules()}
    assert parts <= set(MAY_IMPORT), (
        f"place {sorted(parts - set(MAY_IMPORT))} in MAY_IMPORT (a module at the top level belongs in a layer's folder)"
    )


def test_layers_import_downwards_only() -> None:
    wrong = []
    for path in modules():
        part = part_of(module_name(path))
        for line, target in imports_of(path):
            if part_of(target) not in MAY_IMPORT[part] | {part}:
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} ({part} may import {', '.join(sorted(MAY_IMPORT[part])) or 'nothing else'})"
                )
    assert not wrong, "\n".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every import below it is
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


@pytest.mark.slow
def test_no_import_cycles() -> None:
    """A cycle hidden by a function-level import is still a cycle: the two modules are one."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_never_imports_deepspeed() -> None:
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "deepspeed" for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert (node.module or "").split(".")[0] != "deepspeed", path


def test_deepspeed_names_live_in_one_subpackage() -> None:
    for path in modules():
        if path.parent.name == "deepspeed" or path == PACKAGE / "torchfile" / "reader.py":
            continue
        text = path.read_text()
        for word in FORMAT_WORDS:
            assert f'"{word}' not in text and f"'{word}" not in text, f"{path.name} spells DeepSpeed's {word}"


def test_nothing_imports_the_cli() -> None:
    for path in modules():
        if path.parent.name == "cli" or path.name == "__main__.py":
            continue
        imported = {
            n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not any("cli" in module.split(".") for module in imported), path


def test_reading_needs_neither_deepspeed_nor_eager_torch() -> None:
    code = (
        "import sys, zckpt.deepspeed.reader as r, zckpt.ops.consolidate;"
        "print('deepspeed' in sys.modules, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_conversions_never_import_torch(tmp_path: Path) -> None:
    """reshard, to-universal and to-dcp write torch's formats without torch (seconds of import
    and 230 MB on a small checkpoint): run in one process, none of them loads it."""
    ckpt = PACKAGE.parent / "sample_ckpts" / "z3_bf16_ws2_nvmeoffload_frozen_tied_groups" / "checkpoint"
    code = (
        "import sys\n"
        "from zckpt.ops.reshard import reshard\n"
        "from zckpt.ops.universal import to_universal\n"
        "from zckpt.ops.dcp import to_dcp\n"
        f"reshard({str(ckpt)!r}, {str(tmp_path / 'r')!r}, world_size=3)\n"
        f"to_universal({str(ckpt)!r}, {str(tmp_path / 'u')!r})\n"
        f"to_dcp({str(ckpt)!r}, {str(tmp_path / 'd')!r})\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.stdout.split() == ["False"], result.stderr

"""The architecture rules, checked: zckpt never imports DeepSpeed, DeepSpeed's names live only in
zckpt/deepspeed/, and nothing imports the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zckpt"
FORMAT_WORDS = ("optimizer_state_dict", "fp32_flat_groups", "single_partition_of_fp32_groups", "zero_pp_rank", "param_shapes", "frozen_param_fragments", "shared_params", "partition_count")


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


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
        imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any("cli" in module.split(".") for module in imported), path


def test_reading_needs_neither_deepspeed_nor_eager_torch() -> None:
    code = (
        "import sys, zckpt.deepspeed.reader as r, zckpt.ops.consolidate;"
        "print('deepspeed' in sys.modules, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.stdout.split() == ["False", "False"], result.stderr

"""Write docs/reference/cli.md from the live CLI: every command, its arguments and its options
(hidden aliases left out), with the help texts the code declares.

    python scripts/gen_cli_reference.py          # rewrite the page
    python scripts/gen_cli_reference.py --check  # exit 1 when the page is stale

tests/test_docs_facts.py fails when the committed page differs from a fresh generation.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import typer.main

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"


def _clean(text: str | None) -> str:
    """A help text as markdown: click's \\b (keep line breaks) markers dropped, paragraphs kept."""
    if not text:
        return ""
    text = inspect.cleandoc(text).replace("\b\n", "").replace("\b", "")
    return text.strip()


def _help_md(text: str | None) -> str:
    """A help text as markdown: prose paragraphs as they are, indented ones (tables such as the
    exit codes) in a text block, so their alignment survives."""
    out = []
    for paragraph in _clean(text).split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.startswith(" ") for line in lines[1:]) or (lines and lines[0].startswith(" ")):
            head = [] if lines[0].startswith(" ") else [lines.pop(0)]
            out.append("\n".join([*head, "", "```text", textwrap.dedent("\n".join(lines)), "```"]).strip("\n"))
        else:
            out.append(paragraph)
    return "\n\n".join(out)


def _option_line(param) -> str:
    metavar = ""
    if not getattr(param, "is_flag", False) and not getattr(param, "count", False):
        metavar = f" {param.metavar}" if param.metavar else f" {param.type.name.upper()}"
    # the long spelling first, with its value: `--tag TAG`, `-t`
    names = sorted([*param.opts, *param.secondary_opts], key=lambda o: not o.startswith("--"))
    spellings = ", ".join(f"`{o}{metavar}`" if i == 0 else f"`{o}`" for i, o in enumerate(names))
    required = " (required)" if param.required else ""
    help_text = " ".join(_clean(getattr(param, "help", "")).split())
    return f"- {spellings}{required}: {help_text}".rstrip(": ")


def _argument_line(param) -> str:
    help_text = " ".join(_clean(getattr(param, "help", "")).split())
    return f"- `{(param.metavar or param.name).upper()}`: {help_text}".rstrip(": ")


def _examples(epilog: str) -> str:
    lines = _clean(epilog).splitlines()
    if lines and lines[0].strip().rstrip(":").lower() == "examples":
        lines = lines[1:]
    body = textwrap.dedent("\n".join(lines)).strip("\n")
    return f"Examples, as `--help` prints them:\n\n```text\n{body}\n```\n"


def render() -> str:
    from zckpt.cli.app import app

    group = typer.main.get_command(app)
    out = [
        "# Command-line reference",
        "",
        "Generated from the CLI by `scripts/gen_cli_reference.py`; `zckpt COMMAND --help` prints the same.",
        "Older spellings of some options are still accepted and not listed here.",
        "",
        "## zckpt",
        "",
        _help_md(group.help),
        "",
        *(_option_line(p) for p in group.params if not getattr(p, "hidden", False)),
        "",
    ]
    for name, cmd in group.commands.items():
        if getattr(cmd, "hidden", False):
            continue
        pieces = " ".join(cmd.collect_usage_pieces(cmd.context_class(cmd, info_name=name)))
        out += [f"## zckpt {name}", "", "```text", f"zckpt {name} {pieces}", "```", "", _help_md(cmd.help), ""]
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        options = [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]
        if arguments:
            out += ["Arguments:", "", *(_argument_line(p) for p in arguments), ""]
        if options:
            out += ["Options:", "", *(_option_line(p) for p in options), ""]
        if cmd.epilog:
            out += [_examples(cmd.epilog)]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

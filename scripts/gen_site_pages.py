"""MkDocs hook (mkdocs.yml `hooks:`): a page holding `<!-- include: README.md -->` gets that
file from the repository root, its links rewritten for the site: `docs/x.md` -> `x.md`,
README.md -> the home page, BENCHMARKS.md -> the benchmarks page, and links to other root files
(CONTRIBUTING.md, LICENSE, ...) kept as plain text, since the site does not hold them. So
README.md and BENCHMARKS.md are written once and read on GitHub and in the site alike."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE_NAMES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md"}


def _link(match: re.Match[str]) -> str:
    bang, text, target = match[1], match[2], match[3]
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return match[0]
    path, _, anchor = target.partition("#")
    if path.startswith("docs/"):
        path = path[len("docs/") :]
    elif path in SITE_NAMES:
        path = SITE_NAMES[path]
    else:
        return text  # a root file the site does not hold
    return f"{bang}[{text}]({path}{'#' + anchor if anchor else ''})"


def include(name: str) -> str:
    text = (ROOT / name).read_text()
    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", _link, text)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' signature)
    return re.sub(r"^<!-- include: (\S+) -->$", lambda m: include(m[1]), markdown, flags=re.M)

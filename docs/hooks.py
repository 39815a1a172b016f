"""MkDocs hook: the parts of pages that restate the code are written from it when the site is
built, so they say what the code says, never an older copy.

Markers (one line each): ``<!-- qkv:lecture NAME -->`` (NAME: the start of a lecture's name in
:data:`qkv.explain.lectures.LECTURES`, e.g. ``CS189 Lecture 21``) becomes that lecture's sections
with their commands, as ``qkv explain --lectures`` and ``/lectures`` list them;
``<!-- qkv:lecture-index -->`` the overview table; ``<!-- qkv:assets -->`` the offline assets
(:data:`qkv.assets.ASSETS`); ``<!-- qkv:page-screens -->`` the page's screenshots under
``docs/img/``. ``tests/test_docs.py`` checks that every lecture has exactly one page and that the
generated text names no file the repository lacks.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- qkv:lecture (?P<name>[^>]+?) -->$", re.M)
INDEX = "<!-- qkv:lecture-index -->"
ASSETS = "<!-- qkv:assets -->"
SCREENS = "<!-- qkv:page-screens -->"
# The index's ``missing`` texts point at the project's asset notes, a file outside this
# repository; on the site they point at the page that lists the offline assets instead.
_ASSETS_NOTE = re.compile(r"\s*\(ASSETS\.md\)")
ASSETS_PAGE = "the offline assets: [Pretrained models](../pretrained.md#the-offline-assets)"


def _lectures() -> tuple[Any, ...]:
    from qkv.explain.lectures import LECTURES

    return LECTURES


def find_lecture(name: str) -> Any:
    """The one lecture whose name starts with ``name``."""
    found = [lec for lec in _lectures() if lec.name.startswith(name)]
    if len(found) != 1:
        raise ValueError(f"docs: {len(found)} lectures are named {name!r}; "
                         f"choose from {[lec.name for lec in _lectures()]}")
    return found[0]


def _missing(text: str) -> str:
    return _ASSETS_NOTE.sub(f" ({ASSETS_PAGE})", text)


def lecture_markdown(lecture: Any) -> str:
    """A lecture's sections, in the notes' order: each section's title as a heading, the commands
    that show it (each runs as written: tests/explain/test_lectures.py), and where it is measured."""
    out: list[str] = []
    for s in lecture.sections:
        out.append(f"### {s.title}\n")
        if not s.demos:
            out.append(f"No command shows this: {_missing(s.missing or '')}.\n")
            continue
        for d in s.demos:
            out.append(f"- `{d.command}`: {d.shows}")
        if s.measured:
            out.append(f"- measured at a larger scale: `benchmarks/{s.measured}` "
                       "([Performance](../performance.md), [the record](../benchmarks.md))")
        out.append("")
    return "\n".join(out)


def index_markdown() -> str:
    """One row per lecture: its sections, how many have a command, its guide."""
    from pathlib import PurePosixPath

    rows = ["| lecture | sections | with a command |", "|---|---:|---:|"]
    for lec in _lectures():
        page = PurePosixPath(GUIDES.get(lec.name.split(":")[0], "index.md")).name
        shown = sum(bool(s.demos) for s in lec.sections)
        rows.append(f"| [{lec.name}]({page}) | {len(lec.sections)} | {shown} |")
    return "\n".join(rows) + "\n"


# The guide of each lecture (the part of its name before the colon).
GUIDES = {
    "CS189 Lecture 21": "lectures/cs189-lec21.md",
    "CS189 Lecture 22": "lectures/cs189-lec22.md",
    "CS189 Discussion 10": "lectures/cs189-dis10.md",
    "CS231N Lecture 8": "lectures/cs231n-lec8.md",
}


def assets_markdown() -> str:
    """The offline assets as ``qkv assets`` lists them: name, what it is, how it installs."""
    from qkv.assets import ASSETS

    rows = ["| name | what | package (pinned) | download |", "|---|---|---|---:|"]
    for a in ASSETS.values():
        via = f"`{a.requirement}` ({'pip' if a.kind == 'pip' else 'Debian, apt'})"
        rows.append(f"| `{a.name}` | {a.description} | {via} | {a.download_size / 1e6:.1f} MB |")
    return "\n".join(rows) + "\n"


def screens_markdown() -> str:
    """Every screenshot of the page's views under docs/img/ (``page-*.png``, written by the page's
    screenshot script), in name order, so that a new or renamed view shows up by itself."""
    from pathlib import Path

    shots = sorted((Path(__file__).parent / "img").glob("page-*.png"))
    if not shots:
        return "(No screenshots of the page in this checkout.)\n"
    out = []
    for shot in shots:
        view = shot.stem.removeprefix("page-").replace("-", " ")
        out.append(f"![the page of qkv serve: {view}](img/{shot.name})\n\n*{view}*\n")
    return "\n".join(out)


def expand(markdown: str) -> str:
    """Replace the markers in a page's Markdown by the generated text."""
    markdown = MARKER.sub(lambda m: lecture_markdown(find_lecture(m["name"])), markdown)
    markdown = markdown.replace(ASSETS, assets_markdown())
    markdown = markdown.replace(SCREENS, screens_markdown())
    return markdown.replace(INDEX, index_markdown())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: expand the lecture markers of every page."""
    return expand(markdown)

"""The documentation: the site builds strictly (every link, anchor and API reference resolves),
an offline link checker over README.md and every page (relative links and anchors resolve, no
file named that the repository lacks), the README's length and Quickstart, the lecture guides
written from the lecture index, the figures drawn by docs/figures.py, and `qkv docs` (build,
serve, stop; its one-line errors)."""

from __future__ import annotations

import importlib.util
import re
import socket
import subprocess
import sys
import threading
import unicodedata
import urllib.request
from pathlib import Path

import pytest
from helpers import assert_one_line_error, call

from qkv.commands import docs as docs_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
QUICKSTART = (
    "pip install torch==2.13.0 -e '.[all]' && qkv assets install shakespeare && qkv train   # the main job",
    "pip install torch==2.13.0 -e '.[dev]' && pytest                                         # the tests",
)


def _hooks():
    spec = importlib.util.spec_from_file_location("qkv_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def source(path: Path) -> str:
    """A page as the site renders it: the hook's generated parts expanded, snippets included."""
    text = path.read_text(encoding="utf-8")
    if path.is_relative_to(DOCS):
        text = _hooks().expand(text)
    return re.sub(r'^--8<-- "([^"]+)"$', lambda m: (ROOT / m[1]).read_text(encoding="utf-8"), text,
                  flags=re.M)


# --------------------------------------------------------------------------- the link checker

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]*`")  # a code span may go on over a line break
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+(?:\([^()]*\))?[^()\s]*)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug_site(title: str) -> str:
    """MkDocs' anchors (Python-Markdown's toc ``slugify``): NFKD to ASCII, drop what is not a word
    character, a space or a hyphen, lower case, runs of spaces and hyphens to one hyphen."""
    ascii_ = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_).strip().lower())


def slug_github(title: str) -> str:
    """GitHub's anchors for a README's links: lower case, drop punctuation (keeping letters of any
    script, digits, ``_``, ``-``), each space to a hyphen."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def heading_text(raw: str) -> str:
    """A heading as rendered text: links to their text, code and emphasis marks dropped."""
    raw = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return raw.replace("`", "").replace("**", "")


def anchors(path: Path, slug) -> set[str]:
    return {slug(heading_text(m[2])) for m in HEADING.finditer(FENCE.sub("", source(path)))}


def broken_links(path: Path, slug=None) -> list[str]:
    """Each relative link or image of ``path`` that does not resolve: a missing file, a link
    leaving the repository, or an anchor no heading of the target has."""
    slug = slug or (slug_site if path.is_relative_to(DOCS) else slug_github)
    problems = []
    for m in LINK.finditer(prose(source(path))):
        target = m[1]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(ROOT) or not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
            continue
        if anchor and (dest.suffix != ".md" or anchor not in anchors(dest, slug)):
            problems.append(f"{path.name}: {target}: no heading with that anchor")
    return problems


def repository_files() -> set[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {ROOT / p for p in listed}


# A file name in backquotes or in prose: a path under one of the repository's top folders, or a
# bare name with one of its source suffixes. A name that goes on as a pattern (`test_*.py`,
# `{q4,int8}`, `lens-*.png`) is not one file, and is not read.
FILE_NAME = re.compile(r"(?<![\w./~-])(?:(?:qkv|tests|benchmarks|docs|\.ci)/[\w./-]*[\w/]"
                       r"|[\w-]+\.(?:md|py|toml|yml|cpp|js|css|html))(?![\w/*{<-]|\.\w)")
# Named as another project's files, said so where they are named: not the repository's.
FOREIGN = {"convert_hf_to_gguf.py", "model.py", "engine.py", "llama.cpp"}
# BENCHMARKS.md (shown whole on the site) names no file the repository lacks either: past runs'
# uncommitted results and removed modules are described, not named.
RECORD: set[str] = set()


def missing_files(text: str, files: set[Path], base: Path = ROOT) -> list[str]:
    """File names in ``text`` that the repository lacks: a path (from the repository's root, or
    from ``base``, the page's folder) that is neither a file nor a folder of it; a bare name that
    no file has. An upper-case stem (`NAME.py`) is a placeholder, not a name."""
    names = {p.name for p in files}
    dirs = {ROOT / d for p in files for d in p.relative_to(ROOT).parents}
    missing = []
    for name in sorted(set(FILE_NAME.findall(text))):
        if "/" not in name:
            stem, suffix = name.rsplit(".", 1)
            if name not in names and name not in FOREIGN and not (stem.isupper() and suffix != "md"):
                missing.append(name)
        elif not any(p / name in files or (p / name.rstrip("/")).resolve() in dirs for p in (ROOT, base)):
            missing.append(name)
    return missing


def test_the_link_checker_finds_what_is_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself can fail: a missing file, a missing anchor, a link out of the tree and a
    file the repository lacks are each reported; good links, code and web links are not."""
    page = DOCS / "zz-checker-probe.md"  # inside docs/ so that relative links resolve as a page's
    monkeypatch.setattr(sys.modules[__name__], "source", lambda p: p.read_text())
    page.write_text("# Probe\n\n## A heading: with `code`\n\n"
                    "[ok](index.md) [ok](#a-heading-with-code) [ok](performance.md#the-cpus-measured)\n"
                    "[gone](nowhere.md) [bad anchor](#no-such-heading) [out](../../etc/passwd)\n"
                    "[bad anchor there](performance.md#not-there) [web](https://example.org/x.md)\n"
                    "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n")
    try:
        problems = broken_links(page)
    finally:
        page.unlink()
    assert problems == ["zz-checker-probe.md: nowhere.md: no such file",
                        "zz-checker-probe.md: #no-such-heading: no heading with that anchor",
                        "zz-checker-probe.md: ../../etc/passwd: no such file",
                        "zz-checker-probe.md: performance.md#not-there: no heading with that anchor"]
    files = repository_files()
    assert missing_files("see `DESIGN.md`, qkv/attention/nothing.py and ASSETS.md", files) == [
        "ASSETS.md", "DESIGN.md", "qkv/attention/nothing.py"]
    assert missing_files("`qkv/attention/functional.py`, BENCHMARKS.md, `qkv/lens/`, .ci/run, `NAME.py`, "
                         "`tests/learn/test_*.py`, lectures/index.md.", files, DOCS) == []


def test_slugs_follow_the_renderers() -> None:
    """Anchors as MkDocs and GitHub write them, computed by hand for headings of these pages."""
    assert slug_site("Opening any model: one rule, one typed value") == \
        "opening-any-model-one-rule-one-typed-value"
    assert slug_site("qkv.attention") == "qkvattention"
    assert slug_site("一 Content-based attention: hardmax vs softmax") == \
        "content-based-attention-hardmax-vs-softmax"
    assert slug_github("一 Content-based attention") == "一-content-based-attention"
    assert slug_github("Real pretrained models, in qkv's own modules") == \
        "real-pretrained-models-in-qkvs-own-modules"


@pytest.mark.parametrize("path", [ROOT / "README.md", *pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", [ROOT / "README.md", *pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_named_that_the_repository_lacks(path: Path) -> None:
    missing = set(missing_files(source(path), repository_files(), path.parent))
    assert missing == (RECORD if path.name == "benchmarks.md" else set())


def test_every_page_is_in_the_site_and_every_docs_image_is_used() -> None:
    """mkdocs.yml's nav names every page; every picture under docs/ is shown somewhere."""
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages():
        assert str(page.relative_to(DOCS)) in nav, page
    shown = "\n".join(source(p) for p in [ROOT / "README.md", *pages()])
    for image in [*DOCS.glob("*.png"), *DOCS.glob("img/*.png")]:
        assert image.name in shown, f"{image.relative_to(ROOT)} is not shown on any page"


# --------------------------------------------------------------------------- the README


def test_readme_is_short_and_keeps_the_quickstart() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    for command in QUICKSTART:
        assert command in lines
        assert command in (DOCS / "getting-started.md").read_text(encoding="utf-8").splitlines()
    readme = "\n".join(lines)
    for place in ("docs/getting-started.md", "docs/lectures/index.md", "docs/performance.md", "qkv docs"):
        assert place in readme


DURATION = re.compile(r"\b\d+(?:[.,]\d+)?(?:–\d+(?:[.,]\d+)?)? ?(?:s|ms|seconds?|minutes?|min)\b")
# An option's default and the compile probe's prior are settings, not times promised.
SETTING = re.compile(r"default \d+ s|assumes an? \d+ s")
CPUS = re.compile(r"Zen 3|Zen 4|Zen 5|Sapphire Rapids|Emerald Rapids|Granite Rapids|AVX2")


def test_times_promised_name_the_cpus_and_the_busy_machine() -> None:
    """Every paragraph of the README and the pages (BENCHMARKS.md aside: each of its sections
    names its machine above its tables) that gives a duration names the CPU class it was
    measured on; the pages a newcomer reads first say that a busy machine takes longer."""
    checked = 0
    for path in [ROOT / "README.md", *pages()]:
        if path.name == "benchmarks.md":
            continue
        for para in re.split(r"\n\s*\n", prose(source(path))):
            text = SETTING.sub("", para)
            if para.lstrip().startswith("#") or not DURATION.search(text):
                continue
            checked += 1
            assert CPUS.search(text), f"{path.name}: a time without its CPU: {para[:160]!r}"
    assert checked >= 20  # the check reads the pages' times, not nothing
    for path in (ROOT / "README.md", DOCS / "getting-started.md", DOCS / "performance.md"):
        assert "busy machine takes longer" in path.read_text(encoding="utf-8"), path


# --------------------------------------------------------------------------- lectures and figures


def test_the_lens_page_states_the_threshold_the_code_uses() -> None:
    from qkv.lens import NAMED_AT

    page = (DOCS / "lens.md").read_text(encoding="utf-8")
    assert f"highest score from {NAMED_AT} up (`qkv.lens.NAMED_AT`" in page


def test_each_lecture_has_one_guide_with_every_section_and_command() -> None:
    from qkv.explain.lectures import LECTURES

    hooks = _hooks()
    raw = {p: p.read_text(encoding="utf-8") for p in pages()}
    for lec in LECTURES:
        guides = [p for p, text in raw.items()
                  if any(lec.name.startswith(m) for m in hooks.MARKER.findall(text))]
        assert len(guides) == 1, f"{lec.name}: {len(guides)} guides"
        page = source(guides[0])
        for s in lec.sections:
            assert f"### {s.title}\n" in page
            for d in s.demos:
                assert f"`{d.command}`" in page
        assert "ASSETS.md" not in page and ".txt" not in prose(page)


def test_every_figure_is_drawn_by_the_script() -> None:
    """docs/img/ holds what docs/figures.py draws, each with a qkv command (and the page's
    screenshots, ``page-*.png``, which the page's own script takes)."""
    spec = importlib.util.spec_from_file_location("qkv_docs_figures", DOCS / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = figures  # dataclasses look their module up there
    spec.loader.exec_module(figures)
    drawn = {f.name for f in figures.FIGURES}
    assert {p.name for p in (DOCS / "img").glob("*.png") if not p.name.startswith("page-")} == drawn
    from qkv import cli

    commands = {c for c in cli.build_parser()._subparsers._group_actions[0].choices}
    for f in figures.FIGURES:
        assert f.argv[0] in commands and "{out}" in f.argv


# --------------------------------------------------------------------------- the build and `qkv docs`


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built strictly, once, by `qkv docs`'s own build (as CI's `mkdocs build --strict`)."""
    pytest.importorskip("mkdocs", reason="the documentation needs MkDocs: pip install -e '.[docs]'")
    return docs_command.build_site(tmp_path_factory.mktemp("docs") / "site", strict=True)


def test_the_strict_build_succeeds(site: Path) -> None:
    for page in pages():
        assert (site / page.relative_to(DOCS)).with_suffix(".html").is_file(), page
    api = (site / "api.html").read_text(encoding="utf-8")
    for name in ("MultiHeadAttention", "scaled_dot_product_attention", "run_with_cache", "CausalLM"):
        assert name in api  # from the docstrings
    lec = (site / "lectures" / "cs189-dis10.html").read_text(encoding="utf-8")
    assert "qkv explain worked-example" in lec
    assert "fonts.googleapis" not in (site / "index.html").read_text(encoding="utf-8")


def test_mkdocs_cli_strict_build(tmp_path: Path) -> None:
    """The command CI runs, as CI runs it."""
    pytest.importorskip("mkdocs", reason="the documentation needs MkDocs: pip install -e '.[docs]'")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")]
    env = {**_env(), "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "s" / "index.html").is_file()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_serve_answers_then_frees_its_port(site: Path) -> None:
    server = docs_command.make_server(site, "127.0.0.1", 0)
    port = server.server_address[1]
    stop, urls = threading.Event(), []
    t = threading.Thread(target=docs_command.serve_site, args=(server,),
                         kwargs={"on_ready": urls.append, "stop": stop})
    t.start()
    try:
        while not urls:
            t.join(0.01)
        with urllib.request.urlopen(urls[0] + "getting-started.html", timeout=10) as r:
            assert r.read() == (site / "getting-started.html").read_bytes()
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    with socket.socket() as s:  # the port is free again: we can listen on it ourselves
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed connection's TIME_WAIT
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_failed_build_keeps_the_old_site(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the documentation needs MkDocs: pip install -e '.[docs]'")
    root = tmp_path / "checkout"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "index.md").write_text("# Home\n\n[gone](nowhere.md)\n")
    (root / "mkdocs.yml").write_text("site_name: t\nnav:\n  - index.md\n")
    out = tmp_path / "site"
    out.mkdir()
    (out / "old.html").write_text("old")
    with pytest.raises(docs_command.InputError, match="did not build"):
        docs_command.build_site(out, root=root, strict=True)
    assert [p.name for p in out.iterdir()] == ["old.html"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-built folder
    docs_command.build_site(out, root=root, strict=False)  # not strict: a warning, and it builds
    assert (out / "index.html").is_file() and not (out / "old.html").exists()


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    rc, _, err = call(["docs", "--port", "70000"])
    assert rc == 2 and "is not a port" in err and len(err.strip().splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, _, err = call(["docs", "--port", str(s.getsockname()[1]), "-o", str(tmp_path / "s")])
    line = assert_one_line_error(rc, err)
    assert "cannot listen" in line and "--port" in line
    assert not (tmp_path / "s").exists()  # the port is checked before building
    (tmp_path / "file").write_text("x")
    pytest.importorskip("mkdocs", reason="the documentation needs MkDocs: pip install -e '.[docs]'")
    rc, _, err = call(["docs", "--no-serve", "-o", str(tmp_path / "file")])
    assert "is a file, not a folder" in assert_one_line_error(rc, err)

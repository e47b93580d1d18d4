"""The documentation stays true to the code: the API reference is the docstrings' own
text, every relative link leads somewhere, and the pages carry no development diary."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = (sorted(DOCS.glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "benchmarks").glob("*/README.md"))
         + sorted((ROOT / "benchmarks").glob("*/RESULTS.md")))
#: docs/benchmarks.md holds each benchmark's headline; every row is on the benchmark's RESULTS.md.
BENCHMARKS_PAGE_LINES = 350
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _make_api():
    spec = importlib.util.spec_from_file_location("make_api", DOCS / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown file outside fenced code, with inline code removed."""
    out, in_code = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def _anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, numbered the way GitHub numbers repeats."""
    anchor = _make_api().anchor
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            base = anchor(line)
            out.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return out


def test_api_reference_is_generated_from_the_current_docstrings():
    text = _make_api().render()
    assert (DOCS / "api.md").read_text() == text, "docs/api.md is out of date: run python docs/make_api.py"


def test_the_benchmarks_page_holds_headlines_and_links_every_row():
    page = (DOCS / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= BENCHMARKS_PAGE_LINES, "move a section's detail below render_docs.DETAIL"
    for results in sorted((ROOT / "benchmarks").glob("*/RESULTS.md")):
        assert f"(../benchmarks/{results.parent.name}/RESULTS.md)" in page, f"nothing links {results}"


def test_docstrings_become_markdown_sections_lists_and_code():
    make_api = _make_api()
    doc = '''Do a thing with ``x``, see :func:`~autopipe.partition`.

    Args:
        x: the input,
            over two lines.
        y: another.

    Example:
        >>> f(1)  # doctest: +SKIP
        2
    '''
    assert make_api.docstring_to_markdown(doc) == (
        "Do a thing with `x`, see `partition`.\n\n**Args**\n\n- `x`: the input, over two lines.\n- `y`: another.\n\n"
        "**Example**\n\n```python\n>>> f(1)\n2\n```")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    broken = []
    for n, line in _prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here
                continue
            file_part, _, fragment = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"line {n}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"line {n}: {target} (no heading '#{fragment}' in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


# A diary reads like "in session 4", "runs 11-13", "the first full run": what was tried
# when. The docs say what is true now and link to the benchmarks for the figures.
DIARY = re.compile(r"\bsessions? \d|(?<!-)\bruns? \d+\b(?![.,]\d|%| ?(?:ranks?|times|steps|rounds))"
                   r"|\bfirst full run\b|\bwe (?:found|tried)\b|\b(?:we|it|they) used to\b|\bused to be\b"
                   r"|\bearlier runs?\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_read_as_documentation_not_as_a_diary(page):
    hits = [f"line {n}: {m.group(0)!r} in {line.strip()[:100]!r}" for n, line in _prose(page)
            for m in DIARY.finditer(line)]
    assert not hits, f"{page.relative_to(ROOT)}:\n" + "\n".join(hits)


DOTTED = re.compile(r"\bautopipe(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    """Whether ``autopipe.a.b.c`` names a module, or an attribute reached from one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                # a dataclass field or an instance attribute set in __init__ is documented too
                fields = getattr(obj, "__dataclass_fields__", {}) or getattr(obj, "__annotations__", {})
                if name not in fields:
                    return False
                obj = None
            else:
                obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "api.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_autopipe_name_a_page_mentions_exists(page):
    text = page.read_text()
    names = sorted({m.group(0) for span in re.findall(r"`([^`\n]+)`", text) for m in DOTTED.finditer(span)}
                   | set(re.findall(r"^\s*from (autopipe[\w.]*) import", text, re.M)))
    missing = [n for n in names if not _resolves(n)]
    paths = sorted(set(re.findall(r"\bautopipe/[\w/]+\.py\b", text)))
    missing += [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"

"""Writing reports to disk: the format from the file's suffix, and paths checked before any work.

Example:
    >>> from autopipe.reporting.files import report_format
    >>> report_format("out/report.md")
    'markdown'
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: File suffix -> report format.
REPORT_SUFFIXES = {".html": "html", ".htm": "html", ".md": "markdown", ".markdown": "markdown", ".json": "json"}


def report_format(path: str | os.PathLike) -> str:
    """The report format a path asks for, from its suffix.

    Example:
        >>> report_format("r.HTML")
        'html'
    """
    suffix = Path(path).suffix.lower()
    if suffix not in REPORT_SUFFIXES:
        raise ValueError(
            f"report path {os.fspath(path)!r} has suffix {suffix or '(none)'!r}; use one of "
            f"{', '.join(REPORT_SUFFIXES)} (HTML page, Markdown with PNG figures, JSON data)"
        )
    return REPORT_SUFFIXES[suffix]


def check_writable(path: str | os.PathLike, *, what: str = "output", directory: bool = False) -> Path:
    """Fail early, before minutes of profiling, if ``path`` cannot be written.

    Example:
        >>> check_writable("/tmp/plan.json", what="--out").name
        'plan.json'
    """
    p = Path(path).expanduser()
    if directory:
        if p.exists() and not p.is_dir():
            raise OSError(f"{what} {os.fspath(path)!r} exists and is not a folder")
    elif p.is_dir():
        raise OSError(f"{what} {os.fspath(path)!r} is a folder; give a file name")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise OSError(f"{what} {os.fspath(path)!r} is not writable")
        return p
    parent = p.parent if str(p.parent) else Path(".")
    if not directory and not parent.exists():
        # A mistyped folder would otherwise appear silently, and the file in it go unnoticed.
        raise OSError(f"{what} {os.fspath(path)!r}: the folder {os.fspath(parent)!r} does not exist; create it "
                      f"first (mkdir -p {os.fspath(parent)})")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OSError(f"{what} {os.fspath(path)!r}: {os.fspath(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OSError(f"{what} {os.fspath(path)!r}: folder {os.fspath(parent)!r} is not writable")
    return p


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as indented JSON (creating the folder), returning the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    return p


def write_report(data: dict[str, Any], path: str | os.PathLike) -> list[Path]:
    """Write a plan's report to ``path`` in the format its suffix names.

    Args:
        data: :func:`~autopipe.reporting.data.report_data` of a plan.
        path: ``*.html``, ``*.md`` or ``*.json``.

    Returns:
        Every file written (the Markdown report's PNG figures included).

    Raises:
        ValueError: unknown suffix.
        OSError: the file cannot be written.

    Example:
        >>> write_report(report_data(plan), "report.html")  # doctest: +SKIP
        [PosixPath('report.html')]
    """
    fmt = report_format(path)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        return [write_json(data, p)]
    if fmt == "html":
        from .html import plan_to_html

        p.write_text(plan_to_html(data), encoding="utf-8")
        return [p]
    from .charts import save_pngs
    from .markdown import plan_to_markdown

    images_dir = p.parent / f"{p.stem}_files"
    pngs = save_pngs(data, images_dir)
    relative = {name: f"{images_dir.name}/{png.name}" for name, png in pngs.items()}
    p.write_text(plan_to_markdown(data, images=relative), encoding="utf-8")
    return [p, *pngs.values()]

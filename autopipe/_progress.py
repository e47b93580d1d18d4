"""Progress bars for long work (tracing, profiling), quiet when asked or when not on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress_iter(items: Iterable[T], description: str, *, enabled: bool = True) -> Iterator[T]:
    """Yield ``items`` while a rich progress bar on stderr counts them."""
    items = list(items)
    if not enabled or not sys.stderr.isatty():
        yield from items
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=len(items))
        for item in items:
            yield item
            bar.advance(task)

"""Terminal reports with rich: the plan, the baselines, the per-layer profile, as tables.

Example:
    >>> from autopipe.reporting.terminal import print_layers
    >>> print_layers([{"index": 0, "name": "<input>", "modules": ["fc"], "fwd_s": 1e-3, "bwd_s": 2e-3,
    ...                "param_bytes": 64, "act_bytes": 0, "out_bytes": 32}])  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from typing import IO, Any

from .tables import (Table, alternatives_table, baseline_table, layer_table, measured_table, split_spec_code,
                     stage_table, summary_lines)

def make_console(file: IO[str] | None = None, *, stderr: bool = False) -> Any:
    """A rich ``Console`` on ``file`` (stdout by default), 140 columns when not a terminal.

    Example:
        >>> make_console().width >= 80
        True
    """
    from rich.console import Console

    stream = file or (sys.stderr if stderr else sys.stdout)
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if is_tty else 140, highlight=False,
                   no_color=not is_tty, emoji=False)


def rich_table(table: Table) -> Any:
    """A :class:`~autopipe.reporting.tables.Table` as a ``rich.table.Table``; the chosen row in bold.

    Example:
        >>> from autopipe.reporting.tables import Table
        >>> rich_table(Table("t", ["a"], [["1"]], [True])).row_count
        1
    """
    from rich import box
    from rich.table import Table as RichTable

    numeric = table.numeric or [False] * len(table.header)
    out = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
    for col, (h, n) in enumerate(zip(table.header, numeric)):
        # Names wrap only past 32 characters; numbers never wrap.
        widest = max([len(h), *(len(r[col]) for r in table.rows)])
        out.add_column(h, justify="right" if n else "left", overflow="fold", no_wrap=n,
                       min_width=None if n else min(widest, 32))
    for i, row in enumerate(table.rows):
        chosen = bool(table.highlight) and i < len(table.highlight) and table.highlight[i]
        out.add_row(*row, style="bold" if chosen else None)
    return out


def _print_table(console: Any, table: Table) -> None:
    """The table, then its notes as plain lines (a rich caption would be cut at the table's width)."""
    console.print(rich_table(table))
    for note in table.notes:
        console.print(f"  {note}", markup=False, style="dim")
    console.print()


def print_plan(data: dict[str, Any], *, console: Any = None, gantt: str | None = None) -> None:
    """Print a plan's report: summary, ``split_spec``, stages, baselines, alternatives, timeline.

    Example:
        >>> print_plan(report_data(plan))  # doctest: +SKIP
    """
    console = console or make_console()
    s = data["summary"]
    console.print(f"[bold]autopipe plan for {s['model'] or 'model'}[/bold]")
    for line in summary_lines(data):
        console.print(line, markup=False)
    console.print()
    console.print(split_spec_code(data), markup=False, soft_wrap=True)
    console.print()
    _print_table(console, stage_table(data))
    if data["baselines"]:
        _print_table(console, baseline_table(data))
    alt = alternatives_table(data)
    if alt is not None:
        _print_table(console, alt)
    if gantt:
        console.print(f"[bold]Simulated {s['schedule']} step[/bold] (F = forward, B = backward, "
                      "digits = micro-batch, . = idle)")
        console.print(gantt, markup=False, soft_wrap=True)
        console.print()
    measured = measured_table(data)
    if measured is not None:
        _print_table(console, measured)


def print_layers(rows: list[dict[str, Any]], *, console: Any = None, title: str | None = None,
                 totals_of: list[dict[str, Any]] | None = None) -> None:
    """Print the per-layer profile table (rows in the order given), then the model's totals.

    Example:
        >>> print_layers(layer_rows(traced, costs))  # doctest: +SKIP
    """
    from ..machine.device import format_bytes
    from .units import format_seconds

    console = console or make_console()
    table = layer_table(rows)
    if title:
        table.title = title
    every = rows if totals_of is None else totals_of
    if every:
        fwd = sum(r["fwd_s"] for r in every)
        bwd = sum(r["bwd_s"] for r in every)
        params = sum(r["param_bytes"] for r in every)
        acts = sum(r["act_bytes"] for r in every)
        table.notes.append(f"all {len(every)} layers together: forward {format_seconds(fwd)}, backward "
                           f"{format_seconds(bwd)}, parameters {format_bytes(params)}, activations {format_bytes(acts)}")
    _print_table(console, table)

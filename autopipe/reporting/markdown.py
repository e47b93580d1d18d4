"""A plan's report as Markdown (GitHub-flavoured tables), with the figures as PNG files beside it.

Example:
    >>> from autopipe.reporting.markdown import plan_to_markdown
    >>> text = plan_to_markdown(report_data(plan), images={"timeline": "report_files/timeline.png"})  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .data_parallel import dp_table
from .tables import (Table, alternatives_table, baseline_table, layer_table, measured_table, split_spec_code,
                     stage_table, summary_lines, tail_note)

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def table_to_markdown(table: Table) -> str:
    """A :class:`~autopipe.reporting.tables.Table` as a GitHub-flavoured Markdown table.

    Example:
        >>> from autopipe.reporting.tables import Table
        >>> print(table_to_markdown(Table("t", ["a", "b"], [["x", "1"]], [False, True])))
        | a | b |
        |:--|--:|
        | x | 1 |
    """
    numeric = table.numeric or [False] * len(table.header)
    lines = ["| " + " | ".join(_cell(h) for h in table.header) + " |",
             "|" + "|".join("--:" if n else ":--" for n in numeric) + "|"]
    for i, row in enumerate(table.rows):
        chosen = bool(table.highlight) and i < len(table.highlight) and table.highlight[i]
        cells = [f"**{_cell(c)}**" if chosen and c else _cell(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *[f"_{_cell(n)}_  " for n in table.notes]] if table.notes else []
    return "\n".join(lines).rstrip()


def plan_to_markdown(data: dict[str, Any], *, images: Mapping[str, str] | None = None) -> str:
    """Render a plan's report as Markdown.

    Example:
        >>> plan_to_markdown(report_data(plan)).startswith("# autopipe plan")  # doctest: +SKIP
        True
    """
    images = dict(images or {})
    s = data["summary"]

    def image(name: str, alt: str) -> list[str]:
        return [f"![{alt}]({images[name]})", ""] if name in images else []

    out = [f"# autopipe plan: {s['model'] or 'model'}, {s['num_stages']} stages", ""]
    out += [*summary_lines(data), ""]
    out += ["## Where to cut", "", "```python", split_spec_code(data), "```", ""]
    out += ["## Stages", "", table_to_markdown(stage_table(data)), ""]
    out += image("stages", "per-stage balance: time, communication, memory vs capacity")
    if data["layers"]:
        out += ["## Per-layer cost", ""]
        out += image("layers", "per-layer forward/backward time and memory, coloured by stage")
        out += ["<details><summary>table of layers</summary>", "",
                table_to_markdown(layer_table(data["layers"], with_stage=True)), "", "</details>", ""]
    if data["baselines"]:
        out += ["## The chosen split beside the usual ones", "", table_to_markdown(baseline_table(data)), ""]
        out += image("baselines", "predicted step time of the chosen split and the baselines")
    out += ["## Timeline of one step", ""]
    out += image("timeline", "Gantt chart of one simulated step")
    out += [f"Simulated {s['schedule']}: step {data['timeline']['step_s'] * 1e3:.2f} ms, "
            f"bubble {data['timeline']['bubble_fraction']:.1%}.{tail_note(data)}", ""]
    alt = alternatives_table(data)
    if alt is not None:
        out += ["## Alternatives considered", "", table_to_markdown(alt), ""]
        out += image("alternatives", "predicted step of each schedule considered")
    dp = dp_table(data["plan"].get("data_parallel"))
    if dp is not None:
        out += ["## Pipeline x data parallel", "", table_to_markdown(dp), ""]
    measured = measured_table(data)
    if measured is not None:
        out += ["## Measured run", "", table_to_markdown(measured), ""]
    return "\n".join(out).rstrip() + "\n"

"""A plan's report as one self-contained HTML file: tables and inline SVG figures.

Example:
    >>> from autopipe.reporting.html import plan_to_html
    >>> html = plan_to_html(report_data(plan))  # doctest: +SKIP
    >>> open("report.html", "w").write(html)  # doctest: +SKIP
"""

from __future__ import annotations

from html import escape
from typing import Any

from .tables import (Table, alternatives_table, baseline_table, layer_table, measured_table, split_spec_code,
                     stage_table, summary_lines, tail_note)

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
p.lead { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.25em 0.7em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen td { background: #eaf1fb; font-weight: 600; }
pre { background: #f6f8fa; padding: 0.7em 1em; overflow-x: auto; }
figure { margin: 0.8em 0; }
figure svg { max-width: 100%; height: auto; }
figcaption, .note { color: #555; font-size: 0.88em; }
"""


def _table_html(table: Table, *, numbered_heading: bool = True) -> str:
    numeric = table.numeric or [False] * len(table.header)
    head = "".join(f'<th class="{"num" if n else "text"}">{escape(h)}</th>' for h, n in zip(table.header, numeric))
    body = []
    for i, row in enumerate(table.rows):
        cls = ' class="chosen"' if table.highlight and i < len(table.highlight) and table.highlight[i] else ""
        cells = "".join(f'<td class="{"num" if n else "text"}">{escape(c)}</td>' for c, n in zip(row, numeric))
        body.append(f"<tr{cls}>{cells}</tr>")
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in table.notes)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{notes}"


def _figure_html(svg: str | None, caption: str) -> str:
    if not svg:
        return ""
    return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def plan_to_html(data: dict[str, Any], *, figures: bool = True) -> str:
    """Render a plan's report as a self-contained HTML page.

    Example:
        >>> "<svg" in plan_to_html(report_data(plan))  # doctest: +SKIP
        True
    """
    svgs: dict[str, str] = {}
    if figures:
        from .charts import figure_svg, report_figures

        svgs = {name: figure_svg(fig) for name, fig in report_figures(data).items()}
    s = data["summary"]
    title = f"autopipe plan: {s['model'] or 'model'}, {s['num_stages']} stages"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"/>',
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        "".join(f'<p class="lead">{escape(line)}</p>' for line in summary_lines(data)),
        "<h2>Where to cut</h2>",
        f"<pre><code>{escape(split_spec_code(data))}</code></pre>",
        '<p class="note">Pass it to torch.distributed.pipelining.pipeline(model, mb_args, split_spec=...), '
        "or hand the plan file to autopipe.Pipeline.</p>",
        "<h2>Stages</h2>",
        _table_html(stage_table(data)),
        _figure_html(svgs.get("stages"), "Per-stage balance: time per micro-batch (the dashed line is the lower "
                     "bound no split can beat), bytes sent across each cut with their transfer time, and peak "
                     "memory against capacity."),
    ]
    if data["layers"]:
        parts += [
            "<h2>Per-layer cost</h2>",
            _figure_html(svgs.get("layers"), "Each layer's forward and backward time and memory, coloured by the "
                         "stage it lands in; dashed lines are the split points."),
            f"<details><summary>table of {len(data['layers'])} layers</summary>"
            f"{_table_html(layer_table(data['layers'], with_stage=True))}</details>",
        ]
    if data["baselines"]:
        parts += [
            "<h2>The chosen split beside the usual ones</h2>",
            _table_html(baseline_table(data)),
            _figure_html(svgs.get("baselines"), "Predicted step time of each split under the same costs and schedule."),
        ]
    parts += [
        "<h2>Timeline of one step</h2>",
        _figure_html(svgs.get("timeline"), "Simulated schedule: one row per rank, one box per forward or backward "
                     "of a micro-batch; white space is the bubble."),
        f'<p class="note">Simulated with torch\'s own action order for {escape(s["schedule"])}; '
        f"step {data['timeline']['step_s'] * 1e3:.2f} ms, bubble {data['timeline']['bubble_fraction']:.1%}."
        f"{escape(tail_note(data))}</p>",
    ]
    alt = alternatives_table(data)
    if alt is not None:
        parts += ["<h2>Alternatives considered</h2>", _table_html(alt),
                  _figure_html(svgs.get("alternatives"), "Predicted step of every schedule the planner weighed.")]
    measured = measured_table(data)
    if measured is not None:
        parts += ["<h2>Measured run</h2>", _table_html(measured)]
    parts += [
        '<hr/><p class="note">Generated by autopipe. Times are per micro-batch unless marked "step"; '
        "bytes in powers of 1024. Every number is in the JSON report (autopipe report --report x.json).</p>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"

"""Reports of plans and profiles, one module per format, all drawn from the same data.

- :mod:`~autopipe.reporting.data`: :func:`report_data` - every number of a report as JSON-ready data;
- :mod:`~autopipe.reporting.timeline`: :func:`plan_timeline` - the simulated step of a plan;
- :mod:`~autopipe.reporting.text`: the plain-text report of ``plan.report()``;
- :mod:`~autopipe.reporting.terminal`: rich tables for the command line;
- :mod:`~autopipe.reporting.html` / :mod:`~autopipe.reporting.markdown`: report files;
- :mod:`~autopipe.reporting.charts`: matplotlib figures (PNG, inline SVG);
- :mod:`~autopipe.reporting.chrome`: Chrome traces of simulated and measured steps;
- :mod:`~autopipe.reporting.files`: :func:`write_report`, the format from the file's suffix.

Example:
    >>> from autopipe.reporting import report_data, write_report  # doctest: +SKIP
    >>> write_report(report_data(plan), "report.html")  # doctest: +SKIP
"""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "plan_to_text": "text",
    "format_bytes": ".machine.device",
    "format_seconds": "units",
    "report_data": "data",
    "layer_rows": "data",
    "write_report": "files",
    "plan_timeline": "timeline",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)

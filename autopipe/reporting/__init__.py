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

from .text import plan_to_text
from .units import format_bytes, format_seconds
from .data import report_data, layer_rows
from .files import write_report
from .timeline import plan_timeline

__all__ = ["plan_to_text", "format_bytes", "format_seconds", "report_data", "layer_rows", "write_report",
           "plan_timeline"]

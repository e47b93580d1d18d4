"""Reports of plans and profiles: plain text here; richer formats in sibling modules."""

from .text import plan_to_text, format_bytes, format_seconds

__all__ = ["plan_to_text", "format_bytes", "format_seconds"]

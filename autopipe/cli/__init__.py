"""The front ends: the ``autopipe`` command line (:mod:`.main`), the demo it runs
(:mod:`.demo`) and the model specs it accepts (:mod:`.modelspec`)."""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "run_demo": "demo",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)

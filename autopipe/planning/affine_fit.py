"""Fit a cost measured at a few micro-batch sizes as ``a + c*b``, and evaluate it at any size.

Example:
    >>> fit = fit_affine([1, 2, 4], [300, 500, 900], integer=True)
    >>> fit.expr, fit.rel_error
    (200*b + 100, 0.0)
    >>> evaluate(fit.expr, 8)
    1700.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np
import sympy

#: The micro-batch size symbol every fitted expression is written in.
B = sympy.Symbol("b", positive=True, integer=True)


@dataclass(frozen=True)
class AffineFit:
    """One quantity as ``a + c*b``: the expression, how well it matches, and whether it was clamped."""

    expr: sympy.Expr  # in the symbol B
    rel_error: float  # max over sizes of |fit - measured| / measured (see fit_affine)
    clamped: bool  # True when the least-squares fit was moved to keep it >= 0 and non-decreasing


def _rel_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """max |predicted - measured| / |measured|; a zero sample is compared with the largest one."""
    scale = float(np.max(np.abs(measured))) if len(measured) else 0.0
    if scale == 0.0:
        return 0.0 if np.all(predicted == 0) else math.inf
    denom = np.where(measured != 0, np.abs(measured), scale)
    with np.errstate(over="ignore"):  # a subnormal sample gives inf, which is the honest answer
        return float(np.max(np.abs(predicted - measured) / denom))


def _affine_expr(intercept: float | int, slope: float | int) -> sympy.Expr:
    to_sym = sympy.Integer if isinstance(intercept, int) and isinstance(slope, int) else sympy.Float
    expr = sympy.Integer(0)
    if slope != 0:
        expr += to_sym(slope) * B
    if intercept != 0:
        expr += to_sym(intercept)
    return expr


def fit_affine(sizes: Sequence[int], values: Sequence[float], *, integer: bool = False) -> AffineFit:
    """Least-squares fit of ``values`` measured at micro-batch ``sizes`` as ``a + c*b``.

    Example:
        >>> fit_affine([1, 2, 4], [1024 + 256, 1024 + 512, 1024 + 1024], integer=True).expr
        256*b + 1024
    """
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(values, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"sizes ({len(sizes)} entries) and values ({len(values)} entries) must be equal-length lists")
    if len(set(x.tolist())) < 2:
        raise ValueError(f"sizes={list(sizes)!r} must hold at least two distinct micro-batch sizes to fit a slope")
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, y, rcond=None)
    clamped = False
    # A relative tolerance so round-off on exact data does not count as a violation.
    tol = 1e-12 * max(float(np.max(np.abs(y))), 1e-300)
    if c < -tol or a + c < -tol:
        clamped = True
        # The feasible set is the cone c >= 0, a + c >= 0; the optimum lies on one of its rays.
        const = (max(float(np.mean(y)), 0.0), 0.0)
        w = x - 1.0
        ray_slope = max(float(np.dot(w, y) / np.dot(w, w)), 0.0)
        through_one = (-ray_slope, ray_slope)
        a, c = min((const, through_one), key=lambda ac: float(np.sum((ac[0] + ac[1] * x - y) ** 2)))
    # Within the round-off tolerance: snap onto the constraints so they hold exactly.
    c = max(float(c), 0.0)
    a = max(float(a), -c)
    if integer:
        ai, ci = int(round(a)), int(round(c))
        if np.array_equal(ai + ci * x, y) and ci >= 0 and ai + ci >= 0:
            return AffineFit(expr=_affine_expr(ai, ci), rel_error=0.0, clamped=clamped)
    return AffineFit(expr=_affine_expr(a, c), rel_error=_rel_error(a + c * x, y), clamped=clamped)


@functools.lru_cache(maxsize=4096)
def _evaluator(expr: sympy.Expr) -> Callable[[float], float]:
    """A fast numeric function of b for ``expr`` (the planner evaluates many sizes)."""
    return sympy.lambdify(B, expr, modules="math")


def evaluate(expr: sympy.Expr, b: int) -> float:
    """The value of a fitted expression at micro-batch size ``b``.

    Example:
        >>> evaluate(256 * B + 1024, 4)
        2048.0
    """
    return float(_evaluator(expr)(b))



def parse_expr(text: str, what: str) -> sympy.Expr:
    """Read back an expression written as ``str(expr)``, with ``b`` as :data:`B`.

    Example:
        >>> parse_expr("512*b + 64", "cut_fwd_bytes").subs(B, 2)
        1088
    """
    try:
        expr = sympy.sympify(text, locals={"b": B})
    except (sympy.SympifyError, TypeError, SyntaxError) as e:
        raise ValueError(f"{what}={text!r} is not an expression in b") from e
    if not expr.free_symbols <= {B}:
        raise ValueError(f"{what}={text!r} uses symbols other than b: {sorted(map(str, expr.free_symbols))}")
    return expr


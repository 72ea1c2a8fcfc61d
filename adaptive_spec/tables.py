"""Markdown tables and the number formats the reports share."""
from __future__ import annotations

import math


def md_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; cells that are not strings go through `cell`."""
    def line(cells):
        return "| " + " | ".join(c if isinstance(c, str) else cell(c) for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def is_missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(x, spec: str = ".2f", dash: str = "—") -> str:
    """`format(x, spec)`, or `dash` for None / NaN."""
    return dash if is_missing(x) else format(x, spec)


def fixed(x, nd: int = 2) -> str:
    """x to nd decimals; "-" for None, and for a float that is NaN or infinite (the GPU check's reports)."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def cell(v, dash: str = "-") -> str:
    """A value in a table of mixed columns: floats to 4 decimals (integral ones plain), the rest str()."""
    if is_missing(v):
        return dash
    if isinstance(v, float):
        return f"{v:g}" if v.is_integer() else f"{v:.4f}"
    return str(v)

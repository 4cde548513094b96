"""A lesson's claims, checked and printed in one line each: the same text on every CPU, every false claim named.

    with claims() as c:
        c.below(rel_err, 1e-5, "loss, FSDP vs one process, every step")   # ... < 1e-05  ✓
        c.equal(sent, 3 * psi * 4 * (n - 1) // n, "bytes sent per rank and step")   # ... 12,288  ✓

Rounding noise differs from CPU to CPU in its digits, not in being below a bound: `below` prints the bound; exact
values (counts, bytes, shapes) are printed as they are. At the end of the block every false claim is named at once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["ClaimsFailed", "Claims", "claims"]

MARK = {True: "✓", False: "✗"}


class ClaimsFailed(AssertionError):
    """At least one claim of the block was false; the message names each with what was measured."""


@dataclass
class _Claim:
    label: str
    shown: str  # what the line prints (machine-independent when the claim holds)
    holds: bool
    measured: str  # what was measured, for the failure message


def _number(x: Any) -> float:
    value = x.item() if hasattr(x, "item") else x  # a 0-dim tensor or a numpy scalar
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # int, float, Fraction
        raise TypeError(f"a claim compares numbers, got {type(x).__name__}")
    return float(value)


def _bound(bound: Any) -> float:
    b = _number(bound)
    if not math.isfinite(b):
        raise ValueError(f"a bound must be a finite number, got {bound!r}")
    return b


def _fmt(b: float) -> str:
    """A bound as a reader writes it: 2, 0.5, 1e-05."""
    return f"{b:g}" if b == 0 or 1e-3 <= abs(b) < 1e5 else f"{b:.0e}"


def _show(x: Any) -> str:
    """An exact value as a reader wants it: 12,288 for an int, the value for the rest."""
    if hasattr(x, "tolist") and not isinstance(x, (int, float)):
        x = x.tolist()
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def _equal(a: Any, b: Any) -> bool:
    if hasattr(a, "shape") and hasattr(b, "shape"):  # tensors (torch.equal: same shape, same values)
        import torch

        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return bool(a == b)


class Claims:
    """The claims of one block (see `claims`). Each method records one claim and returns whether it holds."""

    def __init__(self) -> None:
        self.made: list[_Claim] = []

    def _add(self, label: str, shown: str, holds: bool, measured: str) -> bool:
        if not isinstance(label, str) or not label.strip():
            raise ValueError("a claim needs its sentence: the label says what is claimed")
        self.made.append(_Claim(label, shown, bool(holds), measured))
        return bool(holds)

    def below(self, x: Any, bound: Any, label: str) -> bool:
        """`x < bound` (a difference, an error): prints the bound, e.g. `< 1e-05` (`< 0.5`)."""
        value, b = _number(x), _bound(bound)
        return self._add(label, f"< {_fmt(b)}", value < b, f"{value:.2e}")

    def above(self, x: Any, bound: Any, label: str) -> bool:
        """`x > bound` (a step that moved, a speed-up): prints the bound, e.g. `> 2`."""
        value, b = _number(x), _bound(bound)
        return self._add(label, f"> {_fmt(b)}", value > b, f"{value:.3g}")

    def between(self, x: Any, low: Any, high: Any, label: str) -> bool:
        """`low <= x <= high`: prints the interval."""
        value, lo, hi = _number(x), _bound(low), _bound(high)
        if lo > hi:
            raise ValueError(f"between: low {low!r} is above high {high!r}")
        return self._add(label, f"in [{_fmt(lo)}, {_fmt(hi)}]", lo <= value <= hi, f"{value:.3g}")

    def equal(self, x: Any, expected: Any, label: str) -> bool:
        """`x == expected` (counts, bytes, shapes, lists; tensors by torch.equal): prints the value itself."""
        return self._add(label, _show(x), _equal(x, expected), f"{_show(x)} instead of {_show(expected)}")

    def true(self, condition: Any, label: str, shown: str = "") -> bool:
        """Any other claim: `condition` holds; `shown` is what the line prints beside it (machine-independent)."""
        return self._add(label, shown, bool(condition), "false")

    def lines(self) -> list[str]:
        """One line per claim: the sentence, what it shows, ✓ or ✗; aligned."""
        width = max((len(c.label) for c in self.made), default=0)
        shown = max((len(c.shown) for c in self.made), default=0)
        return [f"{c.label:<{width}}  {c.shown:>{shown}}  {MARK[c.holds]}".rstrip() for c in self.made]


@contextmanager
def claims() -> Iterator[Claims]:
    """Collect the block's claims; at its end print one line each and raise `ClaimsFailed` naming every false one.
    If the block itself raises, the claims made so far are printed and its error goes on."""
    c = Claims()
    try:
        yield c
    finally:
        if c.made:
            print("\n".join(c.lines()))
    false = [claim for claim in c.made if not claim.holds]
    if false:
        raise ClaimsFailed(f"{len(false)} of {len(c.made)} claims are false: "
                           + "; ".join(f"{claim.label!r} (measured {claim.measured})" for claim in false))

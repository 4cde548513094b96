"""Which checkers passed in this kernel, and with which of the learner's functions: a demo after a checker runs only
on an answer the checker accepted, so it never draws a wrong answer's picture as if it were right.

Kept outside the checks package on purpose: the grader runs a private copy of the checkers, and both copies record
here. `recording` wraps each checker (checks/__init__.py); a demo cell asks `demo_ready(check, fn)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_course.i18n import language
from fsdp_course.i18n.messages import catalogue

__all__ = ["demo_ready", "recording"]

T = catalogue("progress")  # fsdp_course/i18n/catalogues/progress.yml

_PASSED: dict[str, tuple[int, ...]] = {}  # checker name -> ids of the learner's callables it last passed with


def _learners(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(id(a) for a in args if callable(a))


def recording(check: Callable[..., None]) -> Callable[..., None]:
    """`check`, remembering the learner's functions (or classes) each time it returns without failing."""

    @functools.wraps(check)
    def run(*args: Any, **kwargs: Any) -> None:
        _PASSED.pop(check.__name__, None)
        check(*args, **kwargs)
        _PASSED[check.__name__] = _learners(args)

    return run


def demo_ready(check: Callable[..., None], *fns: Callable[..., Any]) -> bool:
    """True if `check` last passed with exactly these functions; else say what to do (in the course's language)."""
    if _PASSED.get(check.__name__) == _learners(fns):
        return True
    name = " / ".join(getattr(f, "__name__", "your function") for f in fns)
    print(T("not_yet", check=check.__name__, name=name).render(language()))
    return False

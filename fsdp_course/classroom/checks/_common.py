"""What every exercise checker shares: the failure report, running the learner's code, comparing tensors.

Cites the style of ARENA's checkers.
Design notes: docs/CLASSROOM.md, "Checkers", `_common.py`.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TextIO

import torch

from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n import language
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch
from fsdp_course.runtime.simulate import RankError, run_ranks

__all__ = ["CHECK_TIMEOUT", "CheckFailed", "CheckFailure", "Message", "T", "call_learner", "compare_tensor",
           "exception_hint", "factor_mistake", "format_tensor", "headed_output", "hints", "in_ipython", "known_mistake",
           "learner_frames",
           "not_implemented", "say_passed",
           "padded_flat_grads", "render_for_ipython", "require_callable", "require_learner",
           "require_world_sizes", "run_checked", "say"]

LIBRARY_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # .../fsdp_course/
_NOT_LEARNER = tuple({LIBRARY_DIR, *(os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                                     for k in ("stdlib", "purelib", "platlib"))})  # this library, torch, Python
CHECK_TIMEOUT = 10.0  # seconds per run_ranks call: a correct solution needs well under one

T = catalogue("common")  # fsdp_course/i18n/catalogues/common.yml


@dataclass
class CheckFailure:
    """What a checker found wrong, printed for the learner before the AssertionError. The problem and the hint are
    catalogued Messages (`fsdp_course.i18n.messages`), so each has its Chinese."""

    check: str  # e.g. "check_all_reduce"
    where: str  # e.g. "world size 3, input shape (5,)"
    problem: Message  # one line: what differs
    hint: Message
    details: list[str] = field(default_factory=list)  # tensors, differences, traceback lines

    def __post_init__(self) -> None:
        for name in ("problem", "hint"):
            if not isinstance(getattr(self, name), Message):
                raise TypeError(f"CheckFailure's {name} must be a Message of a catalogue (fsdp_course.i18n.messages), "
                                f"so that it has its Chinese; got {getattr(self, name)!r}")

    def report(self) -> str:
        """The report a learner reads. In Chinese (`fsdp_course.i18n.language()`), the problem and the hint are
        followed by their Chinese; the English stays (it is what one searches for)."""
        chinese = language() == "zh"
        lines = [f"{self.check} FAILED at {self.where}", f"  {self.problem.en}"]
        if chinese:
            lines.append(f"  问题：{self.problem.zh}")
        lines += [f"  {line}" for line in self.details]
        lines.append(f"  hint: {self.hint.en}")
        if chinese:
            lines.append(f"  提示：{self.hint.zh}")
        return "\n".join(lines)

    def summary(self) -> str:
        """The report in one line (`str` of the exception)."""
        return f"{self.check} failed at {self.where}: {self.problem} (hint: {self.hint})"

    def fail(self) -> NoReturn:
        """Raise `CheckFailed` (a grader scores the cell 0); outside IPython, print the report first."""
        if not in_ipython():
            print(self.report())
        raise CheckFailed(self) from None


class CheckFailed(AssertionError):
    """A checker found the learner's code wrong. `str()` is one line; IPython shows `failure.report()` once,
    after the learner's own frames only (the checker's frames are left out)."""

    def __init__(self, failure: CheckFailure) -> None:
        super().__init__(failure.summary())
        self.failure = failure

    def _render_traceback_(self) -> list[str]:
        """IPython's hook: the lines it shows for this exception instead of its own traceback."""
        return render_for_ipython(self, self.failure.report())


def known_mistake(got: Any, mistakes: Iterable[tuple[Any, Callable[[], Message]]],
                  same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> Message | None:
    """The one judge of the checkers' tables of known mistakes: each entry is what that mistake gives (None where it
    does not apply) and its hint. The hint of the first mistake whose result is `got` (a table lists the likelier
    mistake first), or None."""
    return next((hint() for value, hint in mistakes if value is not None and same(got, value)), None)


def say_passed(check: str, what: Message | Iterable[int], *lines: Message) -> None:
    """A checker's success: "All tests in {check} passed ({what})", `what` a Message or world sizes, then `lines`."""
    what = what if isinstance(what, Message) else T("world_sizes", sizes=", ".join(map(str, what)))
    say(T("passed", check=check, what=what), *lines)


def factor_mistake(got: torch.Tensor, expected: torch.Tensor,
                   mistakes: Iterable[tuple[float | None, Callable[[], Message]]]) -> Message | None:
    """`known_mistake` of mistakes that scale the result, each by its factor: the first whose factor got is of
    expected (`scale_ratio`, within 1e-3), or None."""
    c = scale_ratio(got, expected, rtol=1e-3)
    return None if c is None else known_mistake(c, mistakes, lambda a, k: abs(a / k - 1) < 1e-3)


def say(*lines: Message) -> None:
    """Print what passed, one catalogued message per line, in the course's language only (a failure's report shows
    both: its English is what one searches for)."""
    lang = language()
    for line in lines:
        print(line.render(lang))


def in_ipython() -> bool:
    """True inside an IPython shell (a Jupyter kernel): exceptions there render through `_render_traceback_`."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def render_for_ipython(exc: BaseException, report: str) -> list[str]:
    """The learner's frames of `exc`'s traceback, as IPython names cells ("Cell In[3], line 1"), then `report`."""
    lines = []
    for frame in learner_frame_summaries(exc):
        label = f"File {frame.filename}, line {frame.lineno}"
        with contextlib.suppress(Exception):  # IPython's own name of a cell's code, when it knows it
            named = sys.modules["IPython"].get_ipython().compile.format_code_name(frame.filename)
            if named is not None:
                label = f"{named[0]} {named[1]}, line {frame.lineno}"
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        lines += [label, f"----> {code}", ""] if code else [label, ""]
    return lines + report.splitlines()  # IPython joins the strings with newlines


def require_callable(check: str, fn: object, example: str = "my_function") -> str:
    """The learner's function's name; a TypeError if they passed something else (e.g. its name as a string)."""
    if not callable(fn):
        raise TypeError(f"{check} takes your function itself, e.g. {check}({example}); got {type(fn).__name__}")
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "your function")


def require_learner(check: str, fn: object, example: str, world_sizes: Sequence[int]) -> tuple[str, list[int]]:
    """`require_callable` and `require_world_sizes` of a checker's arguments: the function's name and the sizes."""
    return require_callable(check, fn, example), require_world_sizes(world_sizes)


def require_world_sizes(world_sizes: Sequence[int]) -> list[int]:
    sizes = list(world_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"world_sizes must be positive ints, got {world_sizes!r}")
    return sizes


def padded_flat_grads(numels: Sequence[int], world_size: int, values: Callable[[int], torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Full flat gradients padded for `world_size` (zeros in the padding, `values(numel)` before it), and each rank's
    shards of them (copies): what the sharded-gradient checkers hand out."""
    fulls = []
    for numel in numels:
        full = torch.zeros(padded_numel(numel, world_size))
        full[:numel] = values(numel)
        fulls.append(full)
    return fulls, [[f.chunk(world_size)[r].clone() for f in fulls] for r in range(world_size)]


def format_tensor(t: torch.Tensor, limit: int = 16) -> str:
    """A short, deterministic rendering of a tensor's values: integers without '.0', at most `limit`."""
    flat = t.detach().reshape(-1).tolist()
    shown = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in flat[:limit]]
    more = f", ... ({len(flat)} values)" if len(flat) > limit else ""
    return f"[{', '.join(shown)}{more}] shape {tuple(t.shape)}"


def not_implemented(name: str) -> NotImplementedError:
    """The one short error of a function still at its stub; IPython shows it without the checker's frames, and in
    Chinese (`fsdp_course.i18n.language()`) with its Chinese below it, as a checker's report."""
    message = T("stub", name=name)
    exc = NotImplementedError(message.en)
    shown = f"NotImplementedError: {exc}" + (f"\n提示：{message.zh}" if language() == "zh" else "")
    exc._render_traceback_ = lambda: render_for_ipython(exc, shown)  # type: ignore[attr-defined]
    return exc


class _Headed:
    """A stream that writes `header` once, before the first text written to it (the learner's prints)."""

    def __init__(self, original: TextIO, header: str) -> None:
        self._original, self._header = original, header

    def write(self, text: str) -> int:
        if text and self._header:
            self._original.write(self._header + "\n")
            self._header = ""
        return self._original.write(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, attr: str) -> Any:  # flush, encoding, isatty, fileno, ... of the real stream
        return getattr(self._original, attr)


@contextlib.contextmanager
def headed_output(header: str) -> Iterator[None]:
    """Within the block, what is printed (to stdout or stderr) comes after one line `header`."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Headed(saved[0], header), _Headed(saved[1], header)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _stub_name(exc: BaseException, default: str) -> str:
    """The learner's function that raised NotImplementedError (e.g. a method of their class)."""
    frames = learner_frame_summaries(exc)
    return frames[-1].name if frames and frames[-1].name != "<module>" else default


def run_checked(check: str, name: str, fn: Callable[[RankContext], Any], world_size: int,
                where: Callable[[int], str], hint_for: Callable[[BaseException], Message]) -> list[Any]:
    """`run_ranks(fn, world_size)`, turning failures into a learner-facing report.

    `name` is the learner's function; `where(rank)` says which case that rank was in when it
    failed; `hint_for(exc)` suggests a fix for an exception raised inside the learner's code.
    Raises NotImplementedError if every failing rank is still at a stub, else AssertionError.
    """
    try:
        with headed_output(f"--- world size {world_size} ---"):  # the learner's prints, once per world size
            return run_ranks(fn, world_size, timeout=CHECK_TIMEOUT)
    except RankError as err:
        failures = err.failures
        if all(isinstance(e, NotImplementedError) for e in failures.values()):
            raise not_implemented(_stub_name(failures[min(failures)], name)) from None
        rank = min(failures)
        exc = failures[rank]
        first, *rest = str(exc).splitlines() or [""]
        others = sorted(set(failures) - {rank})
        details = list(rest)  # the rest of a multi-line message, e.g. each rank's call in a mismatch
        if others:
            details.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too")
        details += learner_frames(exc)
        CheckFailure(check, where(rank), T("raised", rank=rank, kind=type(exc).__name__, text=first), hint_for(exc),
                     details).fail()


def call_learner(check: str, name: str, fn: Callable[..., Any], *args: Any, where: str,
                 hint_for: Callable[[BaseException], Message] | None = None) -> Any:
    """`fn(*args)` in this thread, with the same reporting as `run_checked` (for pure functions)."""
    try:
        return fn(*args)
    except NotImplementedError as exc:
        raise not_implemented(_stub_name(exc, name)) from None
    except Exception as exc:  # noqa: BLE001  (reported to the learner)
        hint = hint_for(exc) if hint_for is not None else exception_hint(exc)
        problem = T("learner_raised", name=name, kind=type(exc).__name__, text=str(exc))
        CheckFailure(check, where, problem, hint, learner_frames(exc)).fail()


def learner_frame_summaries(exc: BaseException) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(exc.__traceback__)
            if not os.path.abspath(f.filename).startswith(_NOT_LEARNER)]


def learner_frames(exc: BaseException) -> list[str]:
    """The traceback lines that are in the learner's code (not in this library), innermost last."""
    lines = [f"line {f.lineno} in {f.name}: {(f.line or '').strip()}" for f in learner_frame_summaries(exc)[-3:]]
    return ["where, in your code:"] + [f"  {line}" for line in lines] if lines else []


def hints(*causes: tuple[str | type[BaseException], Message]) -> Callable[[BaseException], Message]:
    """A `hint_for`: the hint of the first cause that `exc` is (an exception class) or that its text contains, then
    of the causes every exercise can meet (collectives misused, shapes lost), else "read the traceback"."""
    def hint_for(exc: BaseException) -> Message:
        for cause, hint in causes + _EVERY_EXERCISE:
            if cause in str(exc) if isinstance(cause, str) else isinstance(exc, cause):
                return hint
        return T("read_traceback")
    return hint_for


_EVERY_EXERCISE = (("must divide by the world size", T("divisible")), (CollectiveMismatch, T("mismatch")),
                   (CollectiveHang, T("skipped")), ("is invalid for input of size", T("gathered_padding")),
                   ("post accumulate grad hooks should return None", T("hook_returns")),
                   ("must have at least one dimension", T("flatten")))
exception_hint = hints()  # the hint for the exceptions every exercise can meet


def compare_tensor(expected: torch.Tensor, got: object, *, world_size: int, rank: int,
                   padded_numel: int | None = None) -> tuple[Message, Message, list[str]] | None:
    """None if `got` matches `expected`, else (problem, hint, detail lines) for a CheckFailure.

    The hints recognise the usual mistakes of a sharded collective: a result N times too small
    (averaged instead of summed), N times too large (summed twice), the padding left on, only this
    rank's chunk returned, a lost shape or dtype.
    """
    n = world_size
    if not isinstance(got, torch.Tensor):
        return T("not_tensor", rank=rank, kind=type(got).__name__), T("return_result"), []
    details = [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"]
    if tuple(got.shape) != tuple(expected.shape):
        problem = T("shape_differs", rank=rank, got=tuple(got.shape), expected=tuple(expected.shape))
        numel = expected.numel()
        hint = known_mistake(got.numel(), [  # the padding left on, one chunk only, the shape lost
            (padded_numel if padded_numel != numel else None, lambda: T("padding_left", numel=numel)),
            (padded_numel // n if padded_numel is not None and n > 1 else None, lambda: T("one_chunk")),
            (numel, lambda: T("reshape"))])
        return problem, hint or T("pad_and_cut"), details
    if got.dtype != expected.dtype:
        return T("dtype_differs", rank=rank, got=got.dtype, expected=expected.dtype), T("keep_dtype"), details
    got_f, exp_f = got.detach().double(), expected.double()
    if torch.allclose(got_f, exp_f, rtol=1e-5, atol=1e-6):
        return None
    diff = (got_f - exp_f).abs()
    index = int(diff.reshape(-1).argmax())
    details.append(f"max difference {diff.max().item():g} at flat index {index}")
    hint = known_mistake(scale_ratio(got_f, exp_f), [  # averaged instead of summed, summed twice
        (1 / n if n > 1 else None, lambda: T("too_small", rank=rank, n=n)),
        (n if n > 1 else None, lambda: T("too_large", rank=rank, n=n)),
    ], lambda c, v: c is not None and abs(c / v - 1) < 1e-3)
    return T("values_differ", rank=rank), hint or T("first_difference"), details


def scale_ratio(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> float | None:
    """c if got == c * expected elementwise (expected not all zero, c != 1), else None."""
    got, expected = got.detach().double().reshape(-1), expected.detach().double().reshape(-1)
    if got.shape != expected.shape or not expected.ne(0).any():
        return None
    c = float(got.dot(expected) / expected.dot(expected))
    if c == 0 or abs(c - 1) < rtol:
        return None
    if torch.allclose(got, c * expected, rtol=rtol, atol=1e-7 * float(expected.abs().max())):
        return c
    return None



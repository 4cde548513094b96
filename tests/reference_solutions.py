"""Load the reference solutions out of solutions/NN_topic.ipynb (a helper module, not a test file), and
`fails` / `passes`: how the tests of the checkers call one and read its report.

A planted mistake is named by the id of the catalogued message (`fsdp_course.i18n.messages`) that diagnoses it, not
by its English: `fails(check_hsdp_grad, all_reduce_sums, says="hsdp.replicas_summed", fields={"n": 2}, capsys=capsys)`.
Rewording a message in its catalogue then costs no edit here; the English layout of a report is tested once, in
test_checks_report.py.

`load("01_collectives")` runs the notebook's first code cell (its imports) and its nbgrader solution cells,
and returns the namespace: the reference functions and classes, exactly as the notebook defines them.
Each cell's source is registered with `linecache` under a name of its own, as IPython does, so that
`inspect.getsource` works on them (the checkpoint checker ships `load` to torchrun by its source).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import nbformat
import pytest

from fsdp_course.classroom.checks import CheckFailure
from fsdp_course.i18n.messages import CATALOGUE, Message

ROOT = Path(__file__).resolve().parents[1]


@cache
def load(notebook: str) -> dict[str, Any]:
    nb = nbformat.read(ROOT / "solutions" / f"{notebook}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    namespace: dict[str, Any] = {"__name__": f"solution_{notebook}"}
    for i, cell in enumerate(code):
        if i == 0 or cell.metadata.get("nbgrader", {}).get("solution"):
            filename = f"<solution {notebook} cell {cell.id}>"
            linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
            exec(compile(cell.source, filename, "exec"), namespace)  # noqa: S102  (our own notebooks)
    return namespace


def fails(check: Callable[..., None], *args: Any, capsys: pytest.CaptureFixture[str], says: str | None = None,
          fields: Mapping[str, Any] | None = None, hint: str | None = None, **kwargs: Any) -> str:
    """Run a checker that must fail (`kwargs` go to the checker): its report says "<check> FAILED at", never that it
    passed, and

    - `says`: the failure carries the catalogued message of that id: as its problem, its hint, or a Message among
      their fields (at any depth), with every field in `fields` equal to the value given there (a nested Message
      matches its id, or a Message of that id with some of its fields; a value that is not a string also
      matches the string it prints as); the report shows it;
    - `hint`: the report contains this text; for what is not a message (the `where`, a details line).

    Returns the report as printed."""
    if says is None and hint is None:
        raise TypeError("fails: say what the failure must name: says=<message id> (or hint=<text of the report>)")
    if fields and says is None:
        raise TypeError("fails: fields= are the fields of the message says= names")
    if says is not None and says not in CATALOGUE:
        raise ValueError(f"fails: there is no message {says!r} in the catalogue")
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    out = capsys.readouterr().out
    assert f"{check.__name__} FAILED at " in out, out
    assert f"All tests in {check.__name__} passed" not in out, out
    if says is not None:
        failure = getattr(info.value, "failure", None)
        assert isinstance(failure, CheckFailure), f"{check.__name__} raised {info.value!r}, not a CheckFailed"
        message = says_message(failure, says, fields or {})
        assert message.en in out, out
    if hint is not None:
        assert hint in out, out
    return out


def messages_of(failure: CheckFailure) -> Iterator[tuple[str, Message]]:
    """The failure's problem and hint and every Message in their fields, each with where it sits ("hint.missing")."""
    def walk(message: Message, path: str) -> Iterator[tuple[str, Message]]:
        yield path, message
        for name, value in message.fields.items():
            if isinstance(value, Message):
                yield from walk(value, f"{path}.{name}")

    yield from walk(failure.problem, "problem")
    yield from walk(failure.hint, "hint")


def says_message(failure: CheckFailure, says: str, fields: Mapping[str, Any]) -> Message:
    """The message of id `says` among the failure's, with `fields`; an AssertionError naming what it carries if none."""
    found = [(path, m) for path, m in messages_of(failure) if m.id == says]
    for _, message in found:
        if all(name in message.fields and _same(message.fields[name], value) for name, value in fields.items()):
            return message
    wanted = f"{says} {_fields(fields)}" if fields else says
    carried = "\n".join(f"  {path}: {m.id} {_fields(m.fields)}\n    {m.en!r}" for path, m in messages_of(failure))
    if found:
        raise AssertionError(f"{failure.check} failed with {says}, but not with the fields {_fields(fields)}; "
                             f"its messages:\n{carried}")
    raise AssertionError(f"{failure.check} did not say {wanted}; it failed at {failure.where} with:\n{carried}")


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(actual, Message) and isinstance(expected, str):
        return actual.id == expected
    if isinstance(actual, Message) and isinstance(expected, Message):
        return actual.id == expected.id and all(
            name in actual.fields and _same(actual.fields[name], value) for name, value in expected.fields.items())
    if isinstance(actual, list | tuple) and isinstance(expected, list | tuple):  # JSON (torchrun) turns tuples to lists
        return len(actual) == len(expected) and all(map(_same, actual, expected))
    if isinstance(expected, str) and not isinstance(actual, str):
        return str(actual) == expected
    return bool(actual == expected)


def _fields(fields: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v.id + _fields(v.fields) if isinstance(v, Message) else repr(v)}"
                           for k, v in fields.items()) + "}"


def passes(check: Callable[..., None], *args: Any, capsys: pytest.CaptureFixture[str], **kwargs: Any) -> str:
    check(*args, **kwargs)
    out = capsys.readouterr().out
    assert out.startswith(f"All tests in {check.__name__} passed (world sizes ")
    return out

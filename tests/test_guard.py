"""The grader's guard (fsdp_course/classroom/guard.py) as a unit, in an IPython shell of this process: it hands out
checkers that no `sys.modules` entry reaches, flags a rebound public checker without failing, and fails a check when
what the checkers use was patched. tests/test_grading.py shows the same through graded notebooks."""

from __future__ import annotations

import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

from fsdp_course.classroom import autograde
from fsdp_course.classroom.guard import make_guard

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the guard reads torch's deprecated aliases too


@pytest.fixture(scope="module")
def guard():
    shell = InteractiveShell.instance()
    reports: list[dict] = []
    shell.display_pub.publish = lambda data, **_: reports.append(data)
    made = make_guard(autograde._preload(), autograde.GUARD_MIME, autograde.CHECKS_PACKAGE)
    yield made, reports, shell
    InteractiveShell.clear_instance()


def _flags(reports: list[dict]) -> list[str]:
    return reports[-1][autograde.GUARD_MIME]["flags"]


def test_the_checkers_it_hands_out_are_a_private_copy(guard) -> None:
    made, reports, _ = guard
    public = sys.modules[autograde.CHECKS_PACKAGE]
    private = made.get("check_all_reduce")
    assert private is not public.check_all_reduce and private.__name__ == "check_all_reduce"
    assert all(getattr(m, "check_all_reduce", None) is not private for m in list(sys.modules.values()))
    made.begin("cell-a")
    assert _flags(reports) == []


def test_a_rebound_public_checker_is_flagged_and_a_patched_dependency_fails(guard, monkeypatch) -> None:
    made, reports, shell = guard
    shell.user_ns["check_all_reduce"] = lambda fn: None
    made.done("cell-a", "nonce")
    assert _flags(reports) == ["the notebook's name check_all_reduce was rebound"]
    del shell.user_ns["check_all_reduce"]
    import fsdp_course.runtime.simulate as simulate

    monkeypatch.setattr(simulate, "run_ranks", lambda *a, **k: [])
    with pytest.raises(Exception, match=r"not scored: .*fsdp_course\.runtime\.simulate\.run_ranks was replaced"):
        made.done("cell-b", "nonce")

"""A demo cell after a checker runs only on an answer that checker accepted (fsdp_course/classroom/progress.py)."""

from __future__ import annotations

import pytest
import torch

from fsdp_course.classroom.checks import CheckFailed, check_all_reduce
from fsdp_course.classroom.progress import demo_ready


def right(ctx, tensor):
    flat = torch.cat([tensor.reshape(-1), tensor.new_zeros(-tensor.numel() % ctx.world_size)])
    return ctx.all_gather(ctx.reduce_scatter(flat))[:tensor.numel()].reshape(tensor.shape)


def wrong(ctx, tensor):
    return tensor.clone()


def test_a_demo_waits_for_the_checker_to_pass_with_that_very_function(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COURSE_LANG", "en")
    torch.manual_seed(0)
    assert not demo_ready(check_all_reduce, right)
    assert "check_all_reduce has not passed with this right yet" in capsys.readouterr().out
    with pytest.raises(CheckFailed):
        check_all_reduce(wrong, world_sizes=(2,))
    assert not demo_ready(check_all_reduce, wrong)  # a failed check does not count
    check_all_reduce(right, world_sizes=(2,))
    capsys.readouterr()
    assert demo_ready(check_all_reduce, right) and capsys.readouterr().out == ""
    assert not demo_ready(check_all_reduce, wrong)  # another function: the checker has not seen it pass
    with pytest.raises(CheckFailed):
        check_all_reduce(wrong, world_sizes=(2,))
    assert not demo_ready(check_all_reduce, right)  # the last run failed: run the checker again
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")
    demo_ready(check_all_reduce, right)
    assert "check_all_reduce 还没有用这个 right 通过" in capsys.readouterr().out

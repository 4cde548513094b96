"""The checkers of exercise 01 and the shared machinery: the reference passes, planted mistakes get the right hint.

The checkers of the later exercises are tested the same way in test_checks_exercises.py.
"""

from __future__ import annotations

import pytest
import torch
from reference_solutions import fails, load

from fsdp_course import RankContext, run_ranks
from fsdp_course.classroom.checks import check_all_reduce, check_ring_all_reduce, compare_tensor, format_tensor

PASSED = "All tests in check_all_reduce passed (world sizes 1, 2, 3, 4)"


def _solution(name: str) -> object:
    """The function `name` as defined by the solution cells of solutions/01_collectives.ipynb."""
    return load("01_collectives")[name]


def _pad(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return torch.cat([flat, flat.new_zeros((-flat.numel()) % ctx.world_size)])


def averages(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    full = ctx.all_gather(ctx.reduce_scatter(_pad(ctx, tensor), op="mean"))
    return full[: tensor.numel()].reshape(tensor.shape)


def keeps_padding(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    return ctx.all_gather(ctx.reduce_scatter(_pad(ctx, tensor)))


def keeps_padding_then_reshapes(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    return ctx.all_gather(ctx.reduce_scatter(_pad(ctx, tensor))).reshape(tensor.shape)


def never_pads(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    return ctx.all_gather(ctx.reduce_scatter(tensor.reshape(-1))).reshape(tensor.shape)


def cuts_down(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    kept = flat[: flat.numel() // ctx.world_size * ctx.world_size]  # rounds the length down instead of padding up
    return ctx.all_gather(ctx.reduce_scatter(kept))[: flat.numel()].reshape(tensor.shape)


def uses_all_reduce(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    return ctx.all_reduce(tensor.clone())


def returns_own_chunk(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    return ctx.reduce_scatter(_pad(ctx, tensor))


def pads_by_rank(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    padded = torch.cat([_pad(ctx, tensor), tensor.new_zeros(ctx.world_size * ctx.rank)])  # rank-dependent
    full = ctx.all_gather(ctx.reduce_scatter(padded))
    return full[: tensor.numel()].reshape(tensor.shape)


def stub(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    # YOUR CODE HERE
    raise NotImplementedError()


def test_reference_solution_passes_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    check_all_reduce(_solution("my_all_reduce"))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == PASSED
    assert "reduce_scatter 48 B + all_gather 48 B = 96 B sent" in out


def test_world_sizes_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    check_all_reduce(_solution("my_all_reduce"), world_sizes=(3, 5))
    assert capsys.readouterr().out.startswith("All tests in check_all_reduce passed (world sizes 3, 5)\n")


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (averages, "common.too_small", {"rank": 0, "n": 2}),
    (keeps_padding, "common.padding_left", {}),
    (keeps_padding_then_reshapes, "common.gathered_padding", {}),
    (never_pads, "common.divisible", {}),
    (cuts_down, "collectives.cut_short", {}),
    (uses_all_reduce, "collectives.only_rs_ag", {}),
    (returns_own_chunk, "collectives.rs_then_ag", {}),
    (pads_by_rank, "collectives.mismatch", {}),
])
def test_planted_mistake_fails_with_hint(fn: object, says: str, fields: dict,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_all_reduce, fn, world_sizes=(1, 2, 3), says=says, fields=fields, capsys=capsys)  # all by N = 2
    assert "check_all_reduce FAILED at world size" in out


def test_failure_report_names_world_size_rank_tensors_and_difference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError):
        check_all_reduce(averages, world_sizes=(4,))
    out = capsys.readouterr().out
    assert out.startswith("check_all_reduce FAILED at world size 4, input shape (1,)\n")
    for text in ("rank 0: values differ", "rank 3 input [", "expected [", "got      [", "max difference",
                 "4x too small"):
        assert text in out


def test_exception_report_points_into_the_learners_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError):
        check_all_reduce(never_pads)
    out = capsys.readouterr().out
    assert "rank 0 raised ValueError" in out
    assert "in never_pads: return ctx.all_gather" in out
    assert "simulate.py" not in out  # library frames are left out


def test_stub_reports_not_implemented(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet") as info:
        check_all_reduce(stub)
    assert "FAILED" not in capsys.readouterr().out
    assert not any("提示" in line for line in info.value._render_traceback_())
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")  # a Chinese kernel: the Chinese below the English
    with pytest.raises(NotImplementedError) as info:
        check_all_reduce(stub)
    assert "提示：stub 还没有实现：把它所在单元格里的 `raise NotImplementedError()` 换成你的代码" in "\n".join(
        info.value._render_traceback_())


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="takes your function itself"):
        check_all_reduce("my_all_reduce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_sizes"):
        check_all_reduce(stub, world_sizes=(0,))
    with pytest.raises(ValueError, match="world_sizes"):
        check_all_reduce(stub, world_sizes=())


def test_compare_tensor_hints() -> None:
    expected = torch.tensor([4.0, 8.0, 12.0])
    assert compare_tensor(expected, expected.clone(), world_size=4, rank=0) is None
    problem, hint, details = compare_tensor(expected, expected * 4, world_size=4, rank=2)
    assert problem.en == "rank 2: values differ" and "4x too large" in hint.en
    assert "max difference 36 at flat index 2" in details
    _, hint, _ = compare_tensor(expected, torch.tensor([4.0, 8.0, 12.0, 0.0]), world_size=4, rank=1,
                                padded_numel=4)
    assert "did you remove the padding?" in hint.en
    _, hint, _ = compare_tensor(expected, torch.tensor([4.0]), world_size=3, rank=1, padded_numel=3)
    assert "that is one chunk" in hint.en
    _, hint, _ = compare_tensor(expected, expected.double(), world_size=2, rank=0)
    assert "keep the input's dtype" in hint.en
    problem, _, _ = compare_tensor(expected, None, world_size=2, rank=1)
    assert problem.en == "rank 1 returned NoneType, not a tensor"


def test_format_tensor() -> None:
    assert format_tensor(torch.tensor([1.0, 2.5, -3.0])) == "[1, 2.5, -3] shape (3,)"
    assert format_tensor(torch.arange(20), limit=3) == "[0, 1, 2, ... (20 values)] shape (20,)"


# -- the ring all-reduce ------------------------------------------------------------------------------
def _ring_pad(ctx: RankContext, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    buf = _pad(ctx, tensor)
    return buf, buf.chunk(ctx.world_size)


def ring_reduce_scatter_only(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    buf, chunks = _ring_pad(ctx, tensor)
    _ring_reduce_scatter(ctx, chunks)
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_mirrored(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """Right values, but around the ring the other way: rank r sends to r - 1."""
    n, r = ctx.world_size, ctx.rank
    buf, chunks = _ring_pad(ctx, tensor)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r + step) % n]], (r - 1) % n, step)
        ctx.group.recv([incoming], (r + 1) % n, step).wait()
        work.wait()
        chunks[(r + step + 1) % n].add_(incoming)
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r - 1 + step) % n]], (r - 1) % n, n + step)
        ctx.group.recv([chunks[(r + step) % n]], (r + 1) % n, n + step).wait()
        work.wait()
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_whole_tensor(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """Right values: pass the whole running sum around the ring, N - 1 times."""
    n, r = ctx.world_size, ctx.rank
    total, passing, incoming = tensor.clone(), tensor.clone(), torch.empty_like(tensor)
    for step in range(n - 1):
        work = ctx.group.send([passing], (r + 1) % n, step)
        ctx.group.recv([incoming], (r - 1) % n, step).wait()
        work.wait()
        total += incoming
        passing = incoming.clone()
    return total


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (ring_reduce_scatter_only, "collectives.too_few", {}),
    (ring_mirrored, "collectives.neighbours", {"right": 1}),
    (ring_whole_tensor, "collectives.one_chunk_per_step", {}),
    (uses_all_reduce, "collectives.only_send_recv", {}),
])
def test_ring_planted_mistake_fails_with_hint(fn: object, says: str, fields: dict,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ring_all_reduce, fn, world_sizes=(1, 3), says=says, fields=fields, capsys=capsys)
    assert "check_ring_all_reduce FAILED at world size" in out


def test_ring_reference_passes_and_reports_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    check_ring_all_reduce(_solution("ring_all_reduce"))
    out = capsys.readouterr().out
    assert out.startswith("All tests in check_ring_all_reduce passed (world sizes 1, 2, 3, 4)\n")
    assert "2(N-1) = 6 messages of one 16 B chunk = 96 B sent" in out


def test_ring_stub_and_a_send_that_is_never_received(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_ring_all_reduce(stub, world_sizes=(2,))

    def sends_only(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
        if ctx.rank == 1:  # waits for a message rank 0 never sends
            ctx.group.recv([torch.empty(1)], 0, 99).wait()
        return tensor

    from fsdp_course.classroom.checks import _common

    monkeypatch.setattr(_common, "CHECK_TIMEOUT", 2.0)  # read by run_checked at each call
    out = fails(check_ring_all_reduce, sends_only, world_sizes=(2,), says="collectives.unmatched", capsys=capsys)
    assert "rank 1 raised CollectiveHang: rank 1: recv from rank 0 (reduce-scatter step 1 of 1, tag 99, 1 elements) " \
        "failed: rank(s) 0 ended without posting the matching send or recv" in out


# -- the ring: mistakes named by chunk, the caller's input, the deadlock ------------------------------
def _ring_reduce_scatter(ctx: RankContext, chunks: tuple[torch.Tensor, ...]) -> None:
    """The right reduce-scatter half: rank r ends with the whole sum of chunk (r + 1) % N."""
    n, r = ctx.world_size, ctx.rank
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r - step) % n]], (r + 1) % n, step)
        ctx.group.recv([incoming], (r - 1) % n, step).wait()
        work.wait()
        chunks[(r - step - 1) % n].add_(incoming)


def _ring_all_gather(ctx: RankContext, chunks: tuple[torch.Tensor, ...], shift: int = 0) -> None:
    n, r = ctx.world_size, ctx.rank
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r + 1 - step) % n]], (r + 1) % n, n + step)
        ctx.group.recv([chunks[(r - step + shift) % n]], (r - 1) % n, n + step).wait()
        work.wait()


def ring_recv_overwrites(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter half receives straight into the chunk: each chunk keeps one rank's values."""
    n, r = ctx.world_size, ctx.rank
    buf, chunks = _ring_pad(ctx, tensor)
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r - step) % n]], (r + 1) % n, step)
        ctx.group.recv([chunks[(r - step - 1) % n]], (r - 1) % n, step).wait()
        work.wait()
    _ring_all_gather(ctx, chunks)
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_wrong_gather_index(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """The all-gather half receives each finished chunk one index too low (at N = 3, not the chunk being sent)."""
    buf, chunks = _ring_pad(ctx, tensor)
    _ring_reduce_scatter(ctx, chunks)
    _ring_all_gather(ctx, chunks, shift=-1)
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_in_place(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """Right values, but when no padding is needed the chunks are views of the caller's tensor."""
    flat = tensor.reshape(-1)
    buf = flat if flat.numel() % ctx.world_size == 0 else _pad(ctx, tensor)
    chunks = buf.chunk(ctx.world_size)
    _ring_reduce_scatter(ctx, chunks)
    _ring_all_gather(ctx, chunks)
    return buf[: tensor.numel()].reshape(tensor.shape).clone()


def ring_send_waits_first(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """Waits on each send before posting the recv: every rank blocks in its first send."""
    n, r = ctx.world_size, ctx.rank
    buf, chunks = _ring_pad(ctx, tensor)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        ctx.group.send([chunks[(r - step) % n]], (r + 1) % n, step).wait()
        ctx.group.recv([incoming], (r - 1) % n, step).wait()
        chunks[(r - step - 1) % n].add_(incoming)
    _ring_all_gather(ctx, chunks)
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_all_gather_sends_unfinished_chunks(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter half is right; the all-gather half starts one chunk early (r - s instead of r + 1 - s)."""
    n, r = ctx.world_size, ctx.rank
    buf, chunks = _ring_pad(ctx, tensor)
    _ring_reduce_scatter(ctx, chunks)
    for step in range(n - 1):
        send = ctx.group.send([chunks[(r - step) % n]], (r + 1) % n, 100 + step)
        ctx.group.recv([chunks[(r - step - 1) % n]], (r - 1) % n, 100 + step).wait()
        send.wait()
    return buf[: tensor.numel()].reshape(tensor.shape)


def ring_adds_into_the_chunk_just_sent(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter half adds what arrives into the chunk the rank has just sent (off by one)."""
    n, r = ctx.world_size, ctx.rank
    buf, chunks = _ring_pad(ctx, tensor)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        work = ctx.group.send([chunks[(r - step) % n]], (r + 1) % n, step)
        ctx.group.recv([incoming], (r - 1) % n, step).wait()
        work.wait()
        chunks[(r - step) % n].add_(incoming)
    _ring_all_gather(ctx, chunks)
    return buf[: tensor.numel()].reshape(tensor.shape)


@pytest.mark.parametrize(("fn", "n", "says"), [
    (ring_all_gather_sends_unfinished_chunks, 2, "collectives.or_unfinished"),  # the same numbers as the next
    (ring_recv_overwrites, 2, "collectives.or_unfinished"),  # mistake's at any N: the hint names both
    (ring_adds_into_the_chunk_just_sent, 2, "collectives.ring_added_into_sent"),
    (ring_adds_into_the_chunk_just_sent, 3, "collectives.ring_added_into_sent"),
])
def test_ring_wrong_chunk_schedules_are_named(fn: object, n: int, says: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_ring_all_reduce, fn, world_sizes=(n,), says=says, capsys=capsys)


def test_ring_schedule_is_the_ring_and_two_mistakes_give_the_same_numbers() -> None:
    from fsdp_course.classroom.checks.collectives import ring_schedule
    inputs = [torch.arange(7.0) * (r + 1) for r in range(3)]
    assert all(torch.equal(out, sum(inputs)) for out in ring_schedule(inputs, 3))
    early = ring_schedule(inputs, 3, ag_send=lambda r, s, n: (r - s) % n, ag_recv=lambda r, s, n: (r - s - 1) % n)
    overwritten = run_ranks(lambda ctx: ring_recv_overwrites(ctx, inputs[ctx.rank].clone()), 3)  # a real ring
    assert all(torch.equal(a, b) for a, b in zip(early, overwritten, strict=True))


def test_ring_recv_that_overwrites_names_the_missing_contributions(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ring_all_reduce, ring_recv_overwrites, world_sizes=(3,),
                says="collectives.missing", capsys=capsys)
    assert "on rank 0: chunk 0 (flat elements 0..4) is missing ranks 1, 2's contribution (it holds only rank 0's)" \
        in out
    assert "on rank 0: chunk 2 (flat elements 10..12) is missing ranks 0, 1's contribution" in out
    assert "look at the first element that differs" not in out


def test_ring_wrong_gather_index_names_the_chunk_it_holds(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ring_all_reduce, ring_wrong_gather_index, world_sizes=(3,),
                says="collectives.chunk_moved", fields={"k": 1, "m": 2}, capsys=capsys)
    assert "on rank 0: chunk 0 (flat elements 0..4) is missing ranks 1, 2's contribution (it holds only rank 0's)" \
        in out  # never received: still rank 0's own values
    assert "on rank 0: chunk 1 (flat elements 5..9) holds chunk 2's values (rank 2's values of chunk 2)" in out
    assert "on rank 0: chunk 2 (flat elements 10..12) holds chunk 0's values (the sum of chunk 0)" in out


def test_ring_that_changes_the_callers_tensor_fails(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ring_all_reduce, ring_in_place, world_sizes=(1, 3), says="collectives.work_on_copy",
                capsys=capsys)
    assert "FAILED at world size 3, input shape (3, 5)" in out  # 15 elements: no padding, views of the input
    assert "rank 0's result is right, but your function changed the tensor it was given" in out


def test_all_reduce_that_changes_the_callers_tensor_fails(capsys: pytest.CaptureFixture[str]) -> None:
    def adds_into_input(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
        result = _solution("my_all_reduce")(ctx, tensor.clone())
        return tensor.copy_(result)  # returns the caller's tensor, overwritten

    fails(check_all_reduce, adds_into_input, world_sizes=(2,), says="collectives.work_on_copy", capsys=capsys)


def test_ring_deadlock_names_the_send_and_the_step(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_course.classroom.checks import _common

    # the deadlock is named when the first send times out, from every rank's state: every rank must have reached
    # its send by then, which a loaded machine can take seconds to do
    monkeypatch.setattr(_common, "CHECK_TIMEOUT", 15.0)
    out = fails(check_ring_all_reduce, ring_send_waits_first, world_sizes=(3,),
                says="collectives.deadlock", capsys=capsys)
    assert ("deadlock: every rank waits in send while no rank receives (rank r waits in send to rank (r + 1) % N, "
            "its right neighbour, at reduce-scatter step 1 of 2; a send completes only once its peer posts the "
            "matching recv)") in out
    assert "rank 2: waiting in send to rank 0 (reduce-scatter step 1 of 2, tag 0, 5 elements)" in out
    assert "read the end of the traceback" not in out and "GLHF" not in out
    assert "in ring_send_waits_first: ctx.group.send(" in out
    assert "simulate.py" not in out and "results[rank] = fn(ctx)" not in out  # only the learner's frames


def test_chunk_diagnosis_cannot_solve_chunks_smaller_than_the_world() -> None:
    from fsdp_course.classroom.checks.collectives import chunk_diagnosis

    inputs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]
    assert chunk_diagnosis(inputs, torch.tensor([1.0, 7.0]), 2) is None  # one element per chunk, two ranks
    lines, hint = chunk_diagnosis([torch.tensor([1.0, 2.0, 4.0, 3.0]), torch.tensor([3.0, 5.0, 1.0, 1.0])],
                                  torch.tensor([7.0, 12.0, 5.0, 4.0]), 2)
    assert lines == ["chunk 0 (flat elements 0..1) has rank 1's contribution twice"]
    assert "added twice" in hint.en


def test_the_judge_of_known_mistakes_names_the_first_that_gives_the_result_or_none() -> None:
    from fsdp_course.classroom.checks._common import T, known_mistake

    divisible, skipped = (lambda: T("divisible")), (lambda: T("skipped"))
    assert known_mistake(4, [(3, divisible), (4, skipped)]).id == "common.skipped"
    assert known_mistake(3, [(None, skipped), (3.0, divisible)]).id == "common.divisible"  # None: does not apply
    assert known_mistake(3, [(3, skipped), (3, divisible)]).id == "common.skipped"  # the table's order: the likelier
    assert known_mistake(5, [(3, divisible)]) is None

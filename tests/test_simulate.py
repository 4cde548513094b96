"""The in-notebook rank simulator: results, output, failures, hangs, mismatches and hygiene."""

import os
import tempfile
import threading
import time

import pytest
import torch

from fsdp_course import CollectiveHang, CollectiveMismatch, RankError, run_ranks
from fsdp_course.runtime.simulate import MAX_WORLD_SIZE


def leftovers() -> tuple[list[str], list[str]]:
    threads = [t.name for t in threading.enumerate() if t.name.startswith("fsdp-rank")]
    dirs = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("fsdp_course_")]  # run_ranks' dirs
    return threads, dirs


def test_results_come_back_in_rank_order_with_distinct_groups() -> None:
    def fn(ctx):
        time.sleep(0.01 * (ctx.world_size - ctx.rank))  # finish in reverse order
        return ctx.rank, ctx.world_size, ctx.group.rank(), ctx.group.size(), id(ctx.group)

    results = run_ranks(fn, 4)
    assert [r[:4] for r in results] == [(r, 4, r, 4) for r in range(4)]
    assert len({r[4] for r in results}) == 4


def test_prints_are_replayed_in_rank_order_with_rank_marks(capsys) -> None:
    def fn(ctx):
        time.sleep(0.02 * (3 - ctx.rank))
        print(f"first line of {ctx.rank}")
        print("second", end="")
        print(" part")
        import sys
        print("to stderr", file=sys.stderr)

    run_ranks(fn, 3)
    out, err = capsys.readouterr()
    expected = []
    for r in range(3):
        expected += [f"[rank {r}] first line of {r}", f"[rank {r}] second part"]
    assert out.splitlines() == expected
    assert err.splitlines() == [f"[rank {r}] to stderr" for r in range(3)]


def test_output_of_a_failing_run_is_still_shown(capsys) -> None:
    def fn(ctx):
        print("before")
        if ctx.rank == 1:
            raise KeyError("lost")

    with pytest.raises(RankError):
        run_ranks(fn, 2)
    assert capsys.readouterr().out.splitlines() == ["[rank 0] before", "[rank 1] before"]


def test_other_threads_print_normally_while_ranks_run(capsys) -> None:
    started = threading.Event()

    def fn(ctx):
        if ctx.rank == 0:
            started.wait(5)

    outsider = threading.Thread(target=lambda: (print("outsider"), started.set()))
    runner = threading.Thread(target=run_ranks, args=(fn, 2))
    runner.start()
    time.sleep(0.2)
    outsider.start()
    outsider.join()
    runner.join()
    assert capsys.readouterr().out == "outsider\n"


def test_a_failing_rank_is_named_with_type_message_and_traceback_and_releases_peers() -> None:
    def fn(ctx):
        if ctx.rank == 2:
            raise ValueError("bad shard on purpose")
        ctx.all_reduce(torch.ones(3))  # the others wait here for rank 2 ...

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(fn, 4, timeout=120)
    elapsed = time.monotonic() - start
    err = info.value
    assert str(err) == "rank 2 failed with ValueError: bad shard on purpose"
    assert list(err.failures) == [2] and isinstance(err.failures[2], ValueError)
    assert "raise ValueError" in err.tracebacks[2]
    assert any("traceback of rank 2" in note for note in err.__notes__)
    assert err.released == [0, 1, 3]
    # ... not for the 120 s timeout: released at once (half the timeout leaves room for a loaded machine)
    assert elapsed < 60, f"peers were not released promptly ({elapsed:.1f} s)"


def test_mismatched_collectives_are_reported_by_name() -> None:
    def fn(ctx):
        if ctx.rank == 1:
            ctx.all_reduce(torch.ones(4, dtype=torch.float64))
        else:
            ctx.all_reduce(torch.ones(4))

    with pytest.raises(RankError) as info:
        run_ranks(fn, 3, timeout=20)
    assert sorted(info.value.failures) == [0, 1, 2]
    assert all(isinstance(e, CollectiveMismatch) for e in info.value.failures.values())
    text = str(info.value)
    assert "collective mismatch at call #1" in text
    assert "rank 1: all_reduce #1 (shapes [(4,)], float64, op=sum)" in text
    assert "rank 0: all_reduce #1 (shapes [(4,)], float32, op=sum)" in text


def test_different_operations_are_a_mismatch() -> None:
    def fn(ctx):
        ctx.barrier()
        if ctx.rank == 0:
            ctx.all_gather(torch.ones(2))
        else:
            ctx.reduce_scatter(torch.ones(2))

    with pytest.raises(RankError, match="mismatch at call #2"):
        run_ranks(fn, 2, timeout=20)


def test_a_collective_a_peer_never_joins_reports_every_rank_state() -> None:
    def fn(ctx):
        ctx.all_reduce(torch.ones(2))
        if ctx.rank == 0:
            ctx.all_gather(torch.ones(5))

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(fn, 3, timeout=120)
    assert time.monotonic() - start < 60  # reported at once, not after the 120 s timeout (room for a loaded machine)
    err = info.value
    assert list(err.failures) == [0] and isinstance(err.failures[0], CollectiveHang)
    text = str(err)
    assert "all_gather #2 can never complete: rank(s) 1, 2 ended without joining it" in text
    assert "rank 0: waiting in all_gather #2 (shapes [(5,)], float32)" in text
    assert "rank 1: finished after 1 collective(s)" in text


def test_a_peer_stuck_computing_times_out_with_its_state() -> None:
    def fn(ctx):
        if ctx.rank == 1:
            time.sleep(1.5)
        ctx.all_reduce(torch.ones(2))

    with pytest.raises(RankError) as info:
        run_ranks(fn, 2, timeout=0.5)
    text = str(info.value)
    assert "timed out after 0.5 s in all_reduce #1: rank(s) 1 had not joined it by then" in text
    assert "rank 1: running, no collective yet" in text
    assert "can never complete" in text  # rank 1 arrives late and is told rank 0 left


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(fn=42, world_size=2), TypeError, "fn must be a function"),
    (dict(fn=print, world_size=0), ValueError, "between 1 and"),
    (dict(fn=print, world_size=MAX_WORLD_SIZE + 1), ValueError, "between 1 and"),
    (dict(fn=print, world_size=2.0), TypeError, "world_size must be an int"),
    (dict(fn=print, world_size=2, timeout=0), ValueError, "positive"),
    (dict(fn=print, world_size=2, timeout=-1.0), ValueError, "positive"),
    (dict(fn=print, world_size=2, timeout="10"), TypeError, "number of seconds"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, words) -> None:
    fn = kwargs.pop("fn")
    world_size = kwargs.pop("world_size")
    with pytest.raises(error, match=words):
        run_ranks(fn, world_size, **kwargs)


def test_each_rank_has_its_own_seeded_generator() -> None:
    def fn(ctx):
        return torch.rand(3, generator=ctx.generator)

    first, again = run_ranks(fn, 3, seed=7), run_ranks(fn, 3, seed=7)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], run_ranks(fn, 3, seed=8)[0])


def test_many_runs_with_failures_leave_nothing_behind(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # other test workers use /tmp too
    before = leftovers()

    def ok(ctx):
        return ctx.all_reduce(torch.ones(2)).sum().item()

    def fails(ctx):
        if ctx.rank == 0:
            raise RuntimeError("planted")
        ctx.barrier()

    def mismatch(ctx):
        ctx.all_reduce(torch.ones(ctx.rank + 1))

    for i in range(24):  # every (kind, world size) pair of the 12 twice: a leak of any kind shows as a count
        fn = (ok, fails, mismatch)[i % 3]
        if fn is ok:
            assert run_ranks(fn, 1 + i % 4) == [2.0 * (1 + i % 4)] * (1 + i % 4)
        else:
            with pytest.raises(RankError):
                run_ranks(fn, 2 + i % 3, timeout=10)
    assert leftovers() == before == ([], [])


def _gloo_threads() -> int | None:
    """Gloo's C++ threads in this process (Linux: /proc names them), or None where /proc is not there."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for t in os.listdir(tasks):
        try:
            with open(f"{tasks}/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


@pytest.mark.parametrize("engine", ["ddp", "zero1", "zero2", "fsdp", "hsdp"])
def test_an_engine_and_its_process_group_go_when_the_run_ends(engine: str) -> None:
    # an engine's gradient hooks sit on its own parameters; if they held the engine strongly, the cycle would run
    # through autograd's C++ hook list, which the garbage collector cannot see: every run would keep its model and
    # its process groups, with Gloo's threads (hundreds of threads after a test file or a long notebook)
    import copy
    import gc
    import weakref

    from torch import nn

    from fsdp_course import DDP, FSDP, ZeRO1, ZeRO2

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def adam(params):
        return torch.optim.Adam(params, lr=0.1)

    def fn(ctx):
        model = copy.deepcopy(base)
        made = {"ddp": lambda: DDP(model, ctx), "zero1": lambda: ZeRO1(model, ctx, adam),
                "zero2": lambda: ZeRO2(model, ctx, adam), "fsdp": lambda: FSDP(model, ctx, wrap={nn.Linear}),
                "hsdp": lambda: FSDP(model, ctx, wrap={nn.Linear}, mesh=ctx.mesh(2, 2))}[engine]()
        opt = made if engine.startswith("zero") else adam(made.parameters())  # ZeRO's engine steps its optimizer
        made(torch.ones(3, 4)).sum().backward()
        opt.step()
        return weakref.ref(made), weakref.ref(ctx.group)

    gc.collect()
    before = _gloo_threads()
    refs = run_ranks(fn, 4)
    gc.collect()
    assert all(engine_ref() is None and group_ref() is None for engine_ref, group_ref in refs)
    if before is not None:
        assert _gloo_threads() == before


def test_a_timeout_too_short_to_meet_says_so() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(lambda ctx: ctx.all_reduce(torch.ones(2)), 2, timeout=1e-6)
    assert "A timeout of 1e-06 s is shorter than ranks take to reach a collective" in str(info.value)

"""Bad input and stuck ranks: run_ranks always returns, and NaN, inf and half-precision means come out right."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from fsdp_course import RankError, run_ranks
from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.zero import ZeRO1, ZeRO2
from fsdp_course.fsdp.api import FSDP
from fsdp_course.holders import HeldError
from fsdp_course.runtime.monitor import CollectiveHang
from fsdp_course.runtime.simulate import _grace


def test_a_rank_stuck_outside_torch_cannot_hang_run_ranks() -> None:
    release = threading.Event()

    def fn(ctx):
        if ctx.rank == 0:
            ctx.barrier()
        else:
            release.wait()  # stuck outside torch: no collective, no Gloo timeout will free it

    start = time.monotonic()
    try:
        with pytest.raises(RankError) as info:
            run_ranks(fn, 2, timeout=1)
        elapsed = time.monotonic() - start
    finally:
        release.set()  # let the daemon thread end: nothing outlives the test
    bound = 1 + _grace(1)
    # it returns at all (a hang is forever); the 30 s margin is for a loaded machine, not a promise of speed
    assert elapsed < bound + 30, f"run_ranks took {elapsed:.1f} s, bound {bound:g} s"
    err = info.value
    assert sorted(err.failures) == [0, 1]
    assert "barrier #1: rank(s) 1 had not joined it by then" in str(err.failures[0])
    stuck = str(err.failures[1])
    assert isinstance(err.failures[1], CollectiveHang)
    assert "stuck outside the course's collectives" in stuck and "release.wait()" in stuck
    assert "left running as a daemon" in stuck


def test_a_rank_that_never_ends_after_its_peers_finished_is_reported() -> None:
    release = threading.Event()

    def fn(ctx):
        if ctx.rank == 1:
            release.wait()
        return ctx.rank

    start = time.monotonic()
    try:
        with pytest.raises(RankError, match="rank 1 did not end within") as info:
            run_ranks(fn, 2, timeout=0.5)
    finally:
        release.set()
    assert time.monotonic() - start < _grace(0.5) + 30  # returns at all; margin for a loaded machine
    assert list(info.value.failures) == [1]


def test_a_rank_finishing_later_within_the_grace_is_fine() -> None:
    def fn(ctx):
        if ctx.rank == 1:
            time.sleep(0.5)
        return ctx.rank

    assert run_ranks(fn, 2, timeout=1) == [0, 1]


@pytest.mark.parametrize("holder", [0, 1, 2])
def test_max_keeps_a_nan_whichever_rank_holds_it(holder: int) -> None:
    def fn(ctx):
        t = torch.tensor([1.0, 2.0, float("-inf"), 4.0]) * (ctx.rank + 1)
        if ctx.rank == holder:
            t[1] = float("nan")
        if ctx.rank == 2:
            t[3] = float("inf")
        return ctx.all_reduce(t, op="max")

    for out in run_ranks(fn, 3):
        expected = torch.tensor([3.0, float("nan"), float("-inf"), float("inf")])
        torch.testing.assert_close(out, expected, equal_nan=True)


def test_max_norm_clipping_sees_a_nan_on_any_rank() -> None:
    """The infinity-norm of sharded gradients: one process's clip_grad_norm_ returns nan, so must the ranks."""
    grads = [torch.tensor([0.5, -1.93]), torch.tensor([float("nan"), 0.1])]
    one = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))
    assert one.isnan()

    def fn(ctx):
        return ctx.all_reduce(grads[ctx.rank].abs().max().reshape(1), op="max").item()

    assert all(v != v for v in run_ranks(fn, 2))  # nan != nan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_mean_is_one_process_mean_and_does_not_overflow(dtype: torch.dtype) -> None:
    # float16: each `big` fits, their sum does not. bfloat16 (float32's range, 8 bits of mantissa): 1 + 0.01 + 0.01
    # summed in bfloat16 and divided by 3 gives 0.3379, one process's mean rounded once gives 0.3398.
    big = torch.finfo(dtype).max / 2 if dtype == torch.float16 else 1001.0
    per_rank = [torch.tensor([big, 1.0, -3.0], dtype=dtype)] + [torch.tensor([big, 0.01, -3.0], dtype=dtype)] * 2

    def fn(ctx):
        chunks = per_rank[ctx.rank].repeat(2)  # (6,): three chunks of two
        return ctx.all_reduce(per_rank[ctx.rank].clone(), op="mean"), ctx.reduce_scatter(chunks, op="mean"), \
            ctx.ledger

    one_process = torch.stack(per_rank).float().mean(0).to(dtype)  # summed wide, rounded once
    scattered_one = torch.stack([p.repeat(2) for p in per_rank]).float().mean(0).to(dtype)
    for rank, (mean, scattered, ledger) in enumerate(run_ranks(fn, 3)):
        assert mean.dtype == dtype and scattered.dtype == dtype
        assert torch.isfinite(mean).all() and torch.equal(mean, one_process), (mean, one_process)
        assert torch.equal(scattered, scattered_one[2 * rank:2 * rank + 2])
        assert ledger.select("all_reduce")[0].payload_bytes == 3 * 2  # the logical payload, in the tensor's dtype
        assert ledger.select("reduce_scatter")[0].payload_bytes == 6 * 2


def test_sums_propagate_inf_and_nan_like_one_process() -> None:
    def fn(ctx):
        t = torch.tensor([float("inf"), 1.0, float("inf")])
        if ctx.rank == 1:
            t = torch.tensor([1.0, float("nan"), float("-inf")])
        return ctx.all_reduce(t)

    for out in run_ranks(fn, 2):
        torch.testing.assert_close(out, torch.tensor([float("inf"), float("nan"), float("nan")]), equal_nan=True)


def test_an_infinite_timeout_is_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="timeout must be finite"):
        run_ranks(print, 2, timeout=float("inf"))


def test_a_tiny_timeout_still_connects_and_times_out_collectives_only() -> None:
    """Gloo's connect with a 1 ms timeout failed, and sometimes crashed the process: the group connects first."""
    code = (
        "import torch\n"
        "from fsdp_course import run_ranks, RankError\n"
        "for _ in range(3):\n"
        "    assert run_ranks(lambda c: c.rank, 3, timeout=1e-3) == [0, 1, 2]\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_send_and_recv_around_a_ring() -> None:
    def ring(ctx):
        right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
        work = ctx.isend(torch.full((3,), float(ctx.rank)), right, tag=7)
        got = ctx.recv(torch.empty(3), left, tag=7)
        work.wait()
        return got

    for rank, got in enumerate(run_ranks(ring, 3)):
        assert torch.equal(got, torch.full((3,), float((rank - 1) % 3)))


def test_every_rank_sending_first_is_named_a_deadlock() -> None:
    def everyone_sends_first(ctx):
        right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
        ctx.send(torch.ones(1 << 20), right)  # 4 MB: no socket buffer absorbs it, the send waits for a recv
        ctx.recv(torch.empty(1 << 20), left)

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(everyone_sends_first, 3, timeout=1)
    assert time.monotonic() - start < 1 + _grace(1) + 30  # returns at all; margin for a loaded machine
    text = str(info.value)
    assert "deadlock: every rank waits in send while no rank receives" in text
    assert "rank 2: waiting in send to rank 0 (tag 0, shape (1048576,), float32)" in text
    assert "Post the receive first" in text


def test_the_deadlock_is_named_by_every_rank_whichever_timed_out_first() -> None:
    # on a loaded machine one rank's wait fails, that rank ends, and only then does the next rank's wait fail: the
    # next rank must still see the first one as waiting in its send, not leave it out of the deadlock
    from fsdp_course.runtime.monitor import WorldMonitor

    monitor = WorldMonitor(3, timeout=1.0)
    for rank in range(3):
        monitor.p2p_waiting(rank, f"send to rank {(rank + 1) % 3} (ring step 1 of 2, tag 0)")
    first = monitor.p2p_diagnosis(1)
    monitor.set_failed(1, CollectiveHang(first))
    second = monitor.p2p_diagnosis(0)
    for text in (first, second):
        assert text.startswith("deadlock: every rank waits in send while no rank receives (rank r waits in send "
                               "to rank (r + 1) % N, its right neighbour, at ring step 1 of 2;"), text
    # each rank's line says where it waited, and what happened since
    assert ("rank 1: waiting in send to rank 2 (ring step 1 of 2, tag 0), until that wait failed (then failed with "
            "CollectiveHang after 0 collective(s))") in second


def test_a_send_to_itself_or_outside_the_world_is_refused() -> None:
    def fn(ctx):
        with pytest.raises(ValueError, match="the peer must be another rank in 0..1"):
            ctx.send(torch.ones(2), ctx.rank)
        with pytest.raises(ValueError, match="got 5"):
            ctx.recv(torch.ones(2), 5)

    run_ranks(fn, 2)


def test_a_send_to_a_rank_that_ended_is_not_called_a_deadlock() -> None:
    def fn(ctx):
        if ctx.rank == 0:
            ctx.send(torch.ones(1 << 20), 1)  # rank 1 returns without receiving

    with pytest.raises(RankError) as info:
        run_ranks(fn, 2, timeout=1)
    text = str(info.value)
    assert "rank(s) 1 ended without posting the matching send or recv" in text and "deadlock" not in text


def test_a_checkpoint_a_rank_cannot_write_fails_on_every_rank(tmp_path) -> None:
    from torch import nn

    from fsdp_course.fsdp.api import FSDP

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "shard_rank1.pt").mkdir()  # rank 1 cannot open its file for writing

    def fn(ctx):
        import copy
        FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}).save_sharded(str(target))

    with pytest.raises(RankError) as info:
        run_ranks(fn, 2, timeout=10)
    assert sorted(info.value.failures) == [0, 1]
    assert "rank(s) [1] could not write their file" in str(info.value.failures[0])
    assert not (target / "metadata.json").exists()


ENGINES = {
    "DDP": lambda m, ctx: DDP(m, ctx),
    "ZeRO1": lambda m, ctx: ZeRO1(m, ctx, lambda p: torch.optim.SGD(p, lr=0.1)),
    "ZeRO2": lambda m, ctx: ZeRO2(m, ctx, lambda p: torch.optim.SGD(p, lr=0.1)),
    "FSDP": lambda m, ctx: FSDP(m, ctx),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


@pytest.mark.parametrize("kind", ENGINES)
def test_one_module_wrapped_by_every_rank_is_refused_before_anything_changes(kind: str) -> None:
    shared = _mlp()  # built once, as in a notebook cell, and wrapped by every rank thread without a copy
    before = {n: p.detach().clone() for n, p in shared.named_parameters()}
    with pytest.raises(RankError, match=f"rank [01]'s {kind} already holds this module: the ranks share one module "
                                        r"object.*Give each rank its own copy: " + kind + r"\(copy.deepcopy\(model\)"):
        run_ranks(lambda ctx: ENGINES[kind](shared, ctx) and None, 2, timeout=10)
    if kind != "FSDP":  # the rank that claimed it first wrapped it; it was not changed (one rank: no averaging)
        assert all(torch.equal(p, before[n]) for n, p in shared.named_parameters())


def test_wrapping_twice_or_nesting_is_refused_and_a_later_run_may_wrap_again() -> None:
    model = _mlp()

    def twice(ctx):
        ddp = DDP(model, ctx)
        with pytest.raises(HeldError, match="already wrapped by a DDP on this rank: wrap a model once"):
            DDP(model, ctx)
        with pytest.raises(HeldError, match="FSDP around DDP: a model is wrapped once"):
            FSDP(ddp, ctx)
        return ddp

    kept = run_ranks(twice, 1)  # the engines live on after their run ...
    run_ranks(lambda ctx: DDP(model, ctx) and None, 1)  # ... and a later run wraps the same module again
    assert kept[0].module is model

    fresh = _mlp()

    def fsdp_twice(ctx):
        fsdp = FSDP(fresh, ctx)
        with pytest.raises(HeldError, match="FSDP around FSDP: a model is wrapped once"):
            FSDP(fsdp, ctx)
        return fsdp

    kept = run_ranks(fsdp_twice, 1)
    with pytest.raises(RankError, match="was wrapped by an FSDP already: its parameters now live in that FSDP's"):
        run_ranks(lambda ctx: FSDP(fresh, ctx) and None, 1)  # even in another run: its parameters are gone


def test_a_constructor_that_raised_leaves_the_module_free() -> None:
    model = _mlp()

    def fn(ctx):
        with pytest.raises(ValueError, match="prefetch must be"):
            FSDP(model, ctx, prefetch=-1)
        return FSDP(model, ctx) is not None

    assert run_ranks(fn, 1) == [True]

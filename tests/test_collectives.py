"""Every collective against a pure-Python computation of the answer, for world sizes 1-8."""

import pytest
import torch

from fsdp_course import run_ranks
from fsdp_course.runtime.collectives import ONE_TENSOR_REDUCE_SCATTER_BELOW


def rank_tensor(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that differs per rank and per element, with exact float sums."""
    return (torch.arange(numel, dtype=torch.float64) * 10 + rank).to(dtype)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_collectives_match_reference(world_size: int) -> None:
    numel = 2 * world_size

    def fn(ctx):
        out = {}
        t = rank_tensor(ctx.rank, 5)
        out["sum"] = ctx.all_reduce(t.clone(), op="sum")
        out["mean"] = ctx.all_reduce(t.clone(), op="mean")
        out["max"] = ctx.all_reduce(t.clone(), op="max")
        out["gather"] = ctx.all_gather(rank_tensor(ctx.rank, 3).reshape(3, 1))
        out["rs"] = ctx.reduce_scatter(rank_tensor(ctx.rank, numel), op="sum")
        out["rs_mean"] = ctx.reduce_scatter(rank_tensor(ctx.rank, numel), op="mean")
        src = world_size - 1
        out["bcast"] = ctx.broadcast(rank_tensor(ctx.rank, 4), src=src)
        out["ints"] = ctx.all_reduce(torch.tensor([ctx.rank, 1]), op="sum")
        ctx.barrier()
        return out

    results = run_ranks(fn, world_size, timeout=20)
    ranks = range(world_size)
    expect_sum = sum(rank_tensor(r, 5) for r in ranks)
    expect_gather = torch.cat([rank_tensor(r, 3) for r in ranks]).reshape(-1, 1)
    full_rs = sum(rank_tensor(r, numel) for r in ranks)
    for rank, out in enumerate(results):
        assert torch.equal(out["sum"], expect_sum), rank
        torch.testing.assert_close(out["mean"], expect_sum / world_size)
        assert torch.equal(out["max"], rank_tensor(world_size - 1, 5))
        assert torch.equal(out["gather"], expect_gather)
        assert torch.equal(out["rs"], full_rs[2 * rank: 2 * rank + 2])
        torch.testing.assert_close(out["rs_mean"], full_rs[2 * rank: 2 * rank + 2] / world_size)
        assert torch.equal(out["bcast"], rank_tensor(world_size - 1, 4))
        assert out["ints"].tolist() == [sum(ranks), world_size]


def test_all_gather_into_given_buffer() -> None:
    def fn(ctx):
        out = torch.zeros(2 * ctx.world_size)
        result = ctx.all_gather(torch.full((2,), float(ctx.rank)), out=out)
        return result is out, out.tolist()

    for same, values in run_ranks(fn, 3):
        assert same
        assert values == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_both_gloo_forms_agree_with_the_sum(world_size: int) -> None:
    """Below the threshold the one-tensor form runs, above it the list form: same answer, same layout."""
    small, large = 6 * 1000, ONE_TENSOR_REDUCE_SCATTER_BELOW + 2  # both divide by 2 and 3

    def fn(ctx):
        out = {}
        for numel in (small, large):
            t = torch.arange(numel, dtype=torch.int64) * (ctx.rank + 1)  # exact sums
            out[numel] = ctx.reduce_scatter(t, out=torch.empty(numel // ctx.world_size, dtype=torch.int64))
        return out

    factor = sum(range(1, world_size + 1))
    for rank, out in enumerate(run_ranks(fn, world_size)):
        for numel, got in out.items():
            chunk = numel // world_size
            assert torch.equal(got, torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64) * factor)


@pytest.mark.parametrize("call, error, words", [
    (lambda ctx: ctx.reduce_scatter(torch.ones(5)), ValueError, "pad"),
    (lambda ctx: ctx.all_reduce(torch.ones(2), op="avg"), ValueError, "op must be one of"),
    (lambda ctx: ctx.all_reduce(torch.ones(2, dtype=torch.int64), op="mean"), TypeError, "floating-point"),
    (lambda ctx: ctx.all_reduce([1.0, 2.0]), TypeError, "torch.Tensor"),
    (lambda ctx: ctx.all_reduce(torch.ones(4, 4).t()), ValueError, "contiguous"),
    (lambda ctx: ctx.all_reduce(torch.ones(4).to_sparse()), ValueError, "is sparse (torch.sparse_coo); "
     "collectives take dense tensors: call .to_dense() first"),
    pytest.param(lambda ctx: ctx.broadcast(torch.eye(2).to_sparse_csr()), ValueError, "call .to_dense() first",
                 marks=pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")),
    (lambda ctx: ctx.broadcast(torch.ones(2), src=7), ValueError, "src must be a rank"),
    (lambda ctx: ctx.all_gather(torch.tensor(1.0)), ValueError, "at least one dimension"),
    (lambda ctx: ctx.all_gather(torch.ones(2), out=torch.ones(3)), ValueError, "out must have shape"),
    (lambda ctx: ctx.reduce_scatter(torch.ones(4), out=torch.ones(2, 2).t()[0]), ValueError, "contiguous"),
])
def test_bad_input_is_a_clear_error(call, error, words) -> None:
    from fsdp_course import RankError

    with pytest.raises(RankError) as info:
        run_ranks(call, 2, timeout=10)
    for exc in info.value.failures.values():
        assert isinstance(exc, error)
        assert words in str(exc)

"""The checker of exercise 04 (ZeRO-2's bucketed reduce-scatter) passes the reference solution and fails planted
mistakes with the diagnosis that names them: each planted function is the reference with one thing wrong, as a
learner would get it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from reference_solutions import fails, load, passes
from torch import nn

from fsdp_course import RankContext, run_ranks
from fsdp_course.classroom.checks import check_zero2_reduce
from fsdp_course.classroom.checks.zero import CASES, cut_buckets, expected_chunks, rank_grads
from fsdp_course.engines.zero import ZeRO2, bucket_parameters
from fsdp_course.i18n.messages import Message

ZERO = load("04_zero")


def _padded(ctx: RankContext, bucket: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    return torch.cat([flat, flat.new_zeros(-flat.numel() % ctx.world_size)])


def _buckets(ctx, grads, bucket_numel, reduce, *, flush_last=True):
    chunks, bucket, size = [], [], 0
    for g in grads:
        if bucket and size + g.numel() > bucket_numel:
            chunks.append(reduce(ctx, bucket))
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket and flush_last:
        chunks.append(reduce(ctx, bucket))
    return chunks


def summed(ctx, grads, bucket_numel):  # op="sum": the ranks' gradients added, not averaged
    return _buckets(ctx, grads, bucket_numel, lambda c, b: c.reduce_scatter(_padded(c, b), op="sum"))


def never_flushed(ctx, grads, bucket_numel):  # the last bucket is left in the loop's variables
    return _buckets(ctx, grads, bucket_numel, lambda c, b: c.reduce_scatter(_padded(c, b), op="mean"),
                    flush_last=False)


def wrong_rank(ctx, grads, bucket_numel):  # all-reduce the bucket, then cut the next rank's chunk
    def reduce(c, b):
        return c.all_reduce(_padded(c, b), op="mean").chunk(c.world_size)[(c.rank + 1) % c.world_size].clone()
    return _buckets(ctx, grads, bucket_numel, reduce)


def all_reduce_then_cut(ctx, grads, bucket_numel):  # right values, but every rank receives the whole bucket
    def reduce(c, b):
        return c.all_reduce(_padded(c, b), op="mean").chunk(c.world_size)[c.rank].clone()
    return _buckets(ctx, grads, bucket_numel, reduce)


def every_gradient_alone(ctx, grads, bucket_numel):  # one reduce-scatter per gradient: no buckets
    return [ctx.reduce_scatter(_padded(ctx, [g]), op="mean") for g in grads]


def held_until_the_end(ctx, grads, bucket_numel):  # right buckets, but every gradient held before reducing any
    return _buckets(ctx, list(grads), bucket_numel, lambda c, b: c.reduce_scatter(_padded(c, b), op="mean"))


def no_padding(ctx, grads, bucket_numel):  # the bucket's length must divide by the world size
    return _buckets(ctx, grads, bucket_numel,
                    lambda c, b: c.reduce_scatter(torch.cat([g.reshape(-1) for g in b]), op="mean"))


def whole_bucket(ctx, grads, bucket_numel):  # returns the all-reduced bucket instead of this rank's chunk
    return _buckets(ctx, grads, bucket_numel, lambda c, b: c.all_reduce(_padded(c, b), op="mean"))


def one_big_bucket(ctx, grads, bucket_numel):  # ignores bucket_numel: everything in one bucket
    return [ctx.reduce_scatter(_padded(ctx, list(grads)), op="mean")]


def trims_padding(ctx, grads, bucket_numel):  # the last rank cuts the padding off its chunk
    def reduce(c, b):
        chunk = c.reduce_scatter(_padded(c, b), op="mean")
        real = sum(g.numel() for g in b) - c.rank * chunk.numel()
        return chunk[:real] if c.rank == c.world_size - 1 else chunk
    return _buckets(ctx, grads, bucket_numel, reduce)


def stub(ctx, grads, bucket_numel):
    raise NotImplementedError()


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_zero2_reduce, ZERO["zero2_reduce"], capsys=capsys)
    assert "one reduce-scatter (mean) per bucket" in out


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (summed, "zero.summed", {"rank": 0, "n": 2}),
    (never_flushed, "zero.last_never", {"got": 3, "count": 4,
                                        "span": Message("zero.span_many", {"first": 4, "last": 5})}),
    (wrong_rank, "zero.other_chunk", {"label": Message("zero.bucket", {"b": 0}), "rank": 0, "other": 1}),
    (every_gradient_alone, "zero.reduced_alone", {"scatters": 6, "grads": 6, "count": 4}),
    (all_reduce_then_cut, "zero.other_ops", {"ops": "all_reduce"}),
    (held_until_the_end, "zero.held", {"label": Message("zero.bucket", {"b": 0}), "k": 2}),
    (no_padding, "zero.pad_bucket", {}),
    (whole_bucket, "zero.whole_bucket", {}),
    (one_big_bucket, "zero.chunk_count", {"chunks": Message("zero.chunk_one", {"n": 1}), "count": 4}),
])
def test_planted(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_zero2_reduce, fn, world_sizes=(2,), says=says, fields=fields, capsys=capsys)
    assert "FAILED at world size 2, case 0" in out


def test_three_ranks_pad_the_last_bucket_and_tell_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_zero2_reduce, wrong_rank, world_sizes=(3,), capsys=capsys, says="zero.other_chunk",
                fields={"rank": 0, "other": 1})
    assert "world size 3, case 0" in out
    fails(check_zero2_reduce, summed, world_sizes=(3,), capsys=capsys, says="zero.summed", fields={"n": 3})


def test_the_last_rank_trimming_its_padding_is_told_to_keep_the_chunk_whole(
        capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_zero2_reduce, trims_padding, world_sizes=(2,), capsys=capsys, says="zero.keep_whole")


def test_one_rank_cannot_tell_a_sum_but_still_sees_the_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    check_zero2_reduce(summed, world_sizes=(1,))  # one rank: the sum is the mean
    capsys.readouterr()
    fails(check_zero2_reduce, never_flushed, world_sizes=(1,), capsys=capsys, says="zero.last_never")


def test_the_stub_gives_one_short_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_zero2_reduce(stub, world_sizes=(2,))


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_zero2_reduce\(zero2_reduce\)"):
        check_zero2_reduce("zero2_reduce")


def test_the_cases_cut_like_the_engine_and_need_padding() -> None:
    for shapes, bucket_numel in CASES:
        named = [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
        engine = [[int(name[1:]) for name, _ in b] for b in bucket_parameters(named, bucket_numel)]
        assert cut_buckets([torch.zeros(s).numel() for s in shapes], bucket_numel) == engine
    sizes = {sum(torch.zeros(CASES[c][0][i]).numel() for i in b) for c in range(len(CASES))
             for b in cut_buckets([torch.zeros(s).numel() for s in CASES[c][0]], CASES[c][1])}
    assert any(s % 2 for s in sizes) and any(s % 3 for s in sizes), "padding is needed at N = 2 and at N = 3"


def test_the_reference_chunks_are_the_engines_shard_grads() -> None:
    """The checker's one-process chunks equal what `ZeRO2` reduce-scatters, on a model whose parameters get the
    checker's gradients in the checker's order (the engine learns that order in its first backward)."""
    shapes, bucket_numel = CASES[0]
    n = 2
    grads = rank_grads(shapes, n)

    class Chain(nn.Module):  # loss = sum_i <p_i, g_i>: p_i's gradient is g_i (the rank's own)
        def __init__(self) -> None:
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in reversed(shapes)])

        def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
            total = torch.zeros(())
            for p, g in zip(self.ps, reversed(gs), strict=True):
                total = (p * g).sum() + total * 1.0
            return total

    model = Chain()

    def rank_fn(ctx: RankContext) -> list[torch.Tensor]:
        engine = ZeRO2(copy.deepcopy(model), ctx, lambda p: torch.optim.SGD(p, lr=0.1), bucket_numel=bucket_numel)
        engine(grads[ctx.rank]).backward()  # learns the order, rebuilds
        engine.zero_grad()
        engine(grads[ctx.rank]).backward()
        return [b.shard.grad.clone() for b in engine.buckets]

    expected = expected_chunks(grads, bucket_numel)
    for rank, got in enumerate(run_ranks(rank_fn, n)):
        assert len(got) == len(expected[rank])
        assert all(torch.allclose(a, b) for a, b in zip(got, expected[rank], strict=True))

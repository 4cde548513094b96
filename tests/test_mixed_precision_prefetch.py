"""Mixed precision, prefetch and fp16 loss scaling in the course's FSDP (fsdp_course/fsdp/{policy,param_group,
grad_scaler}.py), each against one process on the same global batch.

Mixed precision: at N = 1 FSDP is bit-identical to one process under the same policy (`MixedPrecisionReference`).
At N > 1 each rank rounds its own slice's bf16 gradient, so "one process on the global batch" differs by bf16 rounding;
the exact reference is one process that computes each rank's slice in bf16 and averages the fp32 casts, which is what
the reduce-scatter in fp32 computes: checked at 1e-5. Prefetch changes when collectives run, never what they compute:
equal to one process at the usual 1e-5, with the next unit's all-gather started before the current unit computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_cases import standard_cases, standard_references
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_course.engines.equivalence import Trainee, check_equivalence, one_process
from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.grad_scaler import ShardedGradScaler
from fsdp_course.fsdp.policy import MixedPrecision
from fsdp_course.models import MLP
from fsdp_course.runtime.simulate import RankError, run_ranks

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def make(**kwargs):
    def build(model, ctx, optimizer_factory):
        wrap = {nn.Linear} if isinstance(model, MLP) else {nn.TransformerEncoderLayer}
        return Trainee.fsdp(FSDP(model, ctx, wrap=wrap, **kwargs), optimizer_factory)
    return build


def test_bf16_at_one_rank_is_bit_identical_to_one_process_under_the_policy():
    cases = standard_cases()
    references = [one_process(c.model, c.batches, c.optimizer_factory, param_dtype=torch.bfloat16) for c in cases]
    results = check_equivalence(cases, make(mp_policy=BF16), 1, references=references, tol=0.0)
    assert all(v == 0.0 for r in results.values() for v in r.errors.values())


@pytest.mark.parametrize(("world_size", "dtype"), [(2, torch.bfloat16), (3, torch.bfloat16), (2, torch.float16)])
def test_mixed_precision_equals_one_process_on_the_same_slices(world_size, dtype):
    cases = standard_cases()
    references = [one_process(c.model, c.batches, c.optimizer_factory, slices=world_size, param_dtype=dtype)
                  for c in cases]
    check_equivalence(cases, make(mp_policy=MixedPrecision(dtype, torch.float32)), world_size,
                      references=references, tol=1e-5, timeout=60)


def small() -> nn.Sequential:
    """Built outside the rank threads (they share the global RNG), each rank wraps a deep copy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def test_bf16_all_gathers_half_the_bytes_and_reduces_in_reduce_dtype():
    base = small()

    def one_step(policy):
        def fn(ctx):
            fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, mp_policy=policy)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
            out = fsdp(x)
            out.float().sum().backward()
            h = fsdp.handles[0]
            dtypes = (h.shard.dtype, h.unsharded.dtype, h.shard.grad.dtype, out.dtype)
            return ({op: ctx.ledger.summary()[op]["payload"] for op in ("all_gather", "reduce_scatter")}, dtypes)
        return run_ranks(fn, 2)[0]

    fp32, (dtypes32) = one_step(None)
    bf16, dtypes = one_step(BF16)
    bf16_reduce, _ = one_step(MixedPrecision(torch.bfloat16, torch.bfloat16))
    assert bf16["all_gather"] * 2 == fp32["all_gather"]
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
    assert bf16_reduce["reduce_scatter"] * 2 == fp32["reduce_scatter"]
    assert dtypes == (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    assert dtypes32 == (torch.float32,) * 4


def test_no_sync_accumulates_in_reduce_dtype():
    """Two micro-batches without sync then one with: the kept gradient is fp32 (reduce_dtype), and the result equals
    reducing every micro-batch (sums in another order: 1e-5)."""
    base = small()

    def fn(ctx):
        out = []
        for accumulate in (True, False):
            fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, mp_policy=BF16)
            g = torch.Generator().manual_seed(ctx.rank)
            xs = [torch.randn(4, 8, generator=g) for _ in range(3)]
            kept = None
            for i, x in enumerate(xs):
                fsdp.set_requires_gradient_sync(not accumulate or i == len(xs) - 1)
                fsdp(x).float().sum().backward()
                if accumulate and i == 0:
                    kept = fsdp.handles[0].accumulated.dtype
            out.append(([h.shard.grad.clone() for h in fsdp.handles], kept))
        return out

    for (acc, kept), (every, _) in run_ranks(fn, 2):
        assert kept == torch.float32
        for a, b in zip(acc, every, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_prefetch_equals_one_process(world_size):
    check_equivalence(standard_cases(), make(prefetch=1), world_size, references=standard_references(), timeout=60)


class Chain(nn.Module):
    def __init__(self, depth: int = 4, d: int = 16, ac: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(d, 5)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ac else b(x)
        return self.head(x)


@pytest.mark.parametrize("ac", [False, True])
def test_prefetch_issues_the_next_gather_before_this_unit_computes(ac):
    """Second step (the first has no order to follow in forward): forward unit i+1's all-gather starts before unit
    i's compute, backward unit i-1's before unit i's; as many collectives as without prefetch; results equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = Chain(ac=ac)

    def fn(ctx):
        out = {}
        for prefetch in (0, 1):
            fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Sequential}, prefetch=prefetch)
            opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in range(2):
                ctx.ledger.clear()
                fsdp(torch.randn(6, 16, generator=g)).sum().backward()
                opt.step()
                opt.zero_grad()
            gathers = [r for r in ctx.ledger if r.op == "all_gather"]
            out[prefetch] = (list(fsdp.trace), gathers, len(ctx.ledger.records),
                             [p.detach().clone() for p in fsdp.parameters()])
        return out

    for result in run_ranks(fn, 2):
        spans, gathers, calls, params = result[1]
        _, _, calls0, params0 = result[0]
        assert calls == calls0
        assert all(torch.equal(a, b) for a, b in zip(params, params0, strict=True))
        fwd = [s for s in spans if s.phase == "forward"]
        bwd = [s for s in spans if s.phase == "backward"]
        assert [s.unit for s in fwd] == [f"blocks.{i}" for i in range(4)]
        # forward: gathers 0..3 in order, the root (head) first; gather of block i+1 starts before block i computes
        fwd_gathers = gathers[1:5]
        for i in range(3):
            assert fwd_gathers[i + 1].start < fwd[i].start, f"block {i + 1} gathered after block {i} began"
        # backward: the root (resharded after forward) again, then blocks 3, 2, 1, 0; the gather of block i-1 starts
        # before block i's backward begins
        back_gathers = gathers[6:]
        assert len(back_gathers) == 4 and [s.unit for s in bwd][:4] == [f"blocks.{i}" for i in (3, 2, 1, 0)]
        for k in range(3):
            assert back_gathers[k + 1].start < bwd[k].start


def scaled_steps(ctx):
    """Three fp16 steps with loss scaling; an inf planted in rank 1's shard gradient at the second."""
    fsdp = FSDP(small(), ctx, wrap={nn.Linear}, mp_policy=MixedPrecision(torch.float16, torch.float32))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    scaler = ShardedGradScaler(ctx, init_scale=2.0**10)
    g = torch.Generator().manual_seed(ctx.rank)
    stepped = []
    for step in range(3):
        scaler.scale(fsdp(torch.randn(4, 8, generator=g)).float().pow(2).mean()).backward()
        if step == 1 and ctx.rank == 1:
            fsdp.handles[0].shard.grad[0] = float("inf")
        stepped.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
    return stepped, [s for s, _ in scaler.history]


def test_scaler_skips_on_every_rank_when_one_rank_overflows():
    results = run_ranks(scaled_steps, 2)
    assert [r[0] for r in results] == [[True, False, True]] * 2
    assert [r[1] for r in results] == [[1024.0, 1024.0, 512.0]] * 2


def test_a_found_inf_decided_per_rank_splits_the_ranks(monkeypatch):
    """The planted bug (each rank decides on its own shards): rank 0 steps while rank 1 skips, and the scales part."""
    import fsdp_course.fsdp.grad_scaler as gs
    monkeypatch.setattr(gs, "found_inf_everywhere", lambda ctx, flag: flag.float().reshape(1))
    results = run_ranks(scaled_steps, 2)
    assert [r[0] for r in results] == [[True, True, True], [True, False, True]]


def test_bad_arguments_say_what_to_pass():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="MixedPrecision"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="cast_forward_inputs must be True or False, got 'no'"):
        MixedPrecision(cast_forward_inputs="no")  # a non-empty string is true: it would cast
    with pytest.raises(RankError, match="prefetch must be the number of units"):
        run_ranks(lambda ctx: FSDP(copy.deepcopy(model), ctx, prefetch=-1), 1)
    with pytest.raises(RankError, match="mp_policy must be a fsdp_course.MixedPrecision"):
        run_ranks(lambda ctx: FSDP(copy.deepcopy(model), ctx, mp_policy=torch.bfloat16), 1)

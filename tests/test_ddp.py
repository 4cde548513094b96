"""Tests for fsdp_course.engines.ddp: equal to one process, rank 0's state, 2Ψ(N−1)/N traffic, 16Ψ memory, no_sync."""

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_cases import differing_replicas, standard_cases, standard_references
from torch import nn

from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.equivalence import Trainee, check_equivalence, digits_batches
from fsdp_course.memory import total_bytes, zero_formula
from fsdp_course.models import MLP
from fsdp_course.runtime.simulate import run_ranks


def make_ddp(model, ctx, optimizer_factory):
    return Trainee(DDP(model, ctx), optimizer_factory)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ddp_matches_one_process_with_ring_traffic_and_16_psi_memory(world_size):
    """Every case, every step: equal to one process (check_equivalence raises otherwise); replicas equal bit for
    bit; one all-reduce of 2Ψ(N−1)/N, issued in backward; 16Ψ with AdamW."""
    n = world_size
    results = check_equivalence(standard_cases(), make_ddp, n, references=standard_references())
    for case in standard_cases():
        result = results[case.name]
        # the harness allows each rank 1e-5 from one process; the replicas themselves must not drift apart
        assert not (differ := differing_replicas(result.traces)), (case.name, differ[:3])
        params = list(case.model.parameters())
        psi = sum(p.numel() for p in params)
        for rank, trace in enumerate(result.traces):
            for step, (sent, calls) in enumerate(zip(trace.sent, trace.calls, strict=True)):
                expected = {"all_reduce": 2 * psi * 4 * (n - 1) / n} if n > 1 else {"all_reduce": 0.0}
                assert sent == pytest.approx(expected), f"{case.name}, step {step + 1}, rank {rank}: {sent}"
                # one flat buffer (one dtype), reduced once in backward; one call per parameter moves the same bytes
                assert calls == [("backward", "all_reduce")], f"{case.name}, step {step + 1}, rank {rank}: {calls}"
            if "adamw" in case.name:
                mem = trace.memory[-1]
                assert mem["params"] == 4 * psi and mem["grads"] == 4 * psi, (case.name, rank, mem)
                # Adam's two moments, plus one 4-byte step counter per parameter tensor
                assert mem["optimizer"] == 8 * psi + 4 * len(params), (case.name, rank, mem)
                formula = zero_formula(psi, n, "ddp")["total"]  # 16 Psi
                measured = total_bytes(mem)
                assert formula <= measured <= formula * 1.01, (case.name, rank, measured, formula)


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x):
        return self.linear(x) + self.running


def test_ddp_starts_from_rank_0_parameters_and_buffers():
    torch.manual_seed(0)
    base = WithBuffer()
    copies = [copy.deepcopy(base) for _ in range(3)]

    def fn(ctx):
        model = copies[ctx.rank]
        with torch.no_grad():  # every rank starts different, as if seeded differently
            for t in [*model.parameters(), *model.buffers()]:
                t.add_(10.0 * ctx.rank)
        DDP(model, ctx)
        return {k: v.clone() for k, v in model.state_dict().items()}

    states = run_ranks(fn, 3)
    for rank in (1, 2):
        for key, value in states[0].items():
            assert torch.equal(states[rank][key], value), f"rank {rank}: {key} differs from rank 0"
    assert torch.equal(states[0]["linear.weight"], base.linear.weight.detach())


def test_no_sync_accumulates_locally_then_averages_once():
    torch.manual_seed(0)
    base = MLP([64, 16, 10])
    x, y = digits_batches("vectors", steps=1)[0]  # 12 samples: two micro-batches of 6
    micro = [(x[:6], y[:6]), (x[6:], y[6:])]
    reference = copy.deepcopy(base)
    for xm, ym in micro:  # one process accumulates both micro-batches
        F.cross_entropy(reference(xm), ym).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}

    def fn(ctx):
        ddp = DDP(copy.deepcopy(base), ctx)
        r, n = ctx.rank, ctx.world_size
        local = [(xm[r * 6 // n:(r + 1) * 6 // n], ym[r * 6 // n:(r + 1) * 6 // n]) for xm, ym in micro]
        ctx.ledger.clear()
        with ddp.no_sync():
            F.cross_entropy(ddp(local[0][0]), local[0][1]).backward()
        calls_inside = len(ctx.ledger)
        local_grad = ddp.module.layers[0].weight.grad.clone()
        F.cross_entropy(ddp(local[1][0]), local[1][1]).backward()
        grads = {name: p.grad.clone() for name, p in ddp.named_parameters()}
        return calls_inside, len(ctx.ledger), local_grad, grads

    results = run_ranks(fn, 2)
    for rank, (calls_inside, calls_after, _, grads) in enumerate(results):
        assert calls_inside == 0, f"rank {rank}: no_sync() issued {calls_inside} collectives"
        assert calls_after == 1, f"rank {rank}: expected one all-reduce after no_sync, got {calls_after}"
        for name, g in grads.items():
            err = ((g - expected[name]).norm() / expected[name].norm()).item()
            assert err <= 1e-5, f"rank {rank}, {name}: relative difference {err:.2e}"
    assert not torch.allclose(results[0][2], results[1][2]), "inside no_sync each rank keeps its own gradient"


def test_unused_parameter_gets_zero_gradient_and_does_not_hang():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    base = Branchy()

    def fn(ctx):
        ddp = DDP(copy.deepcopy(base), ctx)
        ddp(torch.ones(2, 4)).sum().backward()
        return ddp.module.unused.weight.grad.clone(), ddp.module.used.weight.grad.clone()

    for unused, used in run_ranks(fn, 2, timeout=10):
        assert torch.equal(unused, torch.zeros(2, 4))
        assert used.abs().sum() > 0

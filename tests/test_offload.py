"""CPU offload in the course's FSDP (OffloadPolicy) and the memory tracker's device budget (DeviceOutOfMemory)."""

import copy

import pytest
import torch
from torch import nn

from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.policy import OffloadPolicy
from fsdp_course.memory import (
    HOST,
    DeviceOutOfMemory,
    attach,
    budget_formula,
    offload_copy_formula,
    pool_bytes,
    record_event,
    zero_formula,
)
from fsdp_course.models import MLP
from fsdp_course.runtime.simulate import run_ranks

SIZES = [64, 128, 128, 10]  # units: layers.0 8320, layers.1 16512 (the largest), layers.2 1290 parameters
STEPS = 3


def make_model() -> MLP:
    torch.manual_seed(0)
    return MLP(SIZES)


BASE = make_model()
UNIT_NUMELS = [sum(p.numel() for p in layer.parameters()) for layer in BASE.layers]


def padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def train(ctx, offload: bool, capacity: int | None = None, steps: int = STEPS):
    """Adam steps on the rank's own batches; per step: loss, the recorder's peaks and copies, the last snapshot."""
    model = copy.deepcopy(BASE)
    fsdp = FSDP(model, ctx, wrap={nn.Linear}, offload_policy=OffloadPolicy() if offload else None)
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    rec = attach(fsdp, opt, capacity=capacity)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    log = []
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
        rec.reset()
        fsdp.copies.reset()
        with rec.track_activations():
            loss = nn.functional.cross_entropy(fsdp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        record_event(fsdp, "optimizer step")
        peak_snap = next(s for label, s in rec.events if label == rec.peak_device_label)
        log.append({"loss": loss.detach().clone(), "peak_device": rec.peak_device, "peak_host": rec.peak_host,
                    "peak_snap": peak_snap, "peak_label": rec.peak_device_label,
                    "h2d": fsdp.copies.h2d, "d2h": fsdp.copies.d2h,
                    "h2d_bytes": fsdp.copies.h2d_bytes, "d2h_bytes": fsdp.copies.d2h_bytes,
                    "last": dict(rec.events[-1][1]),
                    "device": pool_bytes(rec.events[-1][1], fsdp), "host": pool_bytes(rec.events[-1][1], fsdp, HOST)})
    shards = [h.shard.detach().clone() for h in fsdp.handles]
    return log, shards


@pytest.mark.parametrize("n", [2, 3])
def test_offload_trains_bit_for_bit_like_without(n):
    plain = run_ranks(lambda ctx: train(ctx, False), n)
    offloaded = run_ranks(lambda ctx: train(ctx, True), n)
    for rank in range(n):
        (log_a, shards_a), (log_b, shards_b) = plain[rank], offloaded[rank]
        assert all(torch.equal(a["loss"], b["loss"]) for a, b in zip(log_a, log_b, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(shards_a, shards_b, strict=True))
        assert all(a["h2d"] == a["d2h"] == 0 for a in log_a)  # no offload: no copies
        # the memory: between steps nothing of the model states stays on the device, the host holds 16 Psi / N
        psi = sum(padded(u, n) for u in UNIT_NUMELS)
        for step in log_b:
            last = step["last"]
            states_on_device = sum(v for c, v in last.items() if c not in ("sharded_params", "sharded_grads",
                                                                            "optimizer", "activations"))
            assert states_on_device == 0
            assert last["sharded_params"] == 4 * psi // n and last["sharded_grads"] == 0
            assert 8 * psi // n <= last["optimizer"] <= 8 * psi // n + 4 * len(UNIT_NUMELS)  # + Adam's step counters
            # the device holds only the next batch (inputs and labels are alive in the loop)
            assert step["device"] == last["activations"] == 8 * 64 * 4 + 8 * 8
        # the peak on the device: the largest unit gathered with its gradient, plus activations
        largest = max(padded(u, n) for u in UNIT_NUMELS)
        for step in log_b[1:]:
            snap = step["peak_snap"]
            assert snap["gathered_params"] + snap["grads"] == 8 * largest, step["peak_label"]
            assert step["peak_device"] == 8 * largest + snap["activations"]
            assert 0 < snap["activations"] < largest  # a few KiB at batch 8
            assert step["peak_host"] >= 16 * psi // n  # sharded params + their gradients + Adam's moments
        # without offload the same states are device memory: 16 Psi / N more at the peak
        for a, b in zip(log_a[1:], log_b[1:], strict=True):
            assert a["peak_host"] == 0
            assert a["peak_device"] >= b["peak_device"] + 16 * psi // n - 4 * psi // n  # grads freed by zero_grad


@pytest.mark.parametrize("n", [1, 2, 3])
def test_copies_are_real_and_counted(n):
    def fn(ctx):
        model = copy.deepcopy(BASE)
        fsdp = FSDP(model, ctx, wrap={nn.Linear}, offload_policy=OffloadPolicy())
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
        shard_ptrs = {h.shard.untyped_storage().data_ptr() for h in fsdp.handles}
        gathered_inputs, real_all_gather = [], ctx.all_gather
        reduced, real_reduce_scatter = [], ctx.reduce_scatter

        def watched_all_gather(t, *args, **kwargs):  # what goes into each all-gather: a pointer, and the values
            gathered_inputs.append((t.untyped_storage().data_ptr(), t.clone()))
            return real_all_gather(t, *args, **kwargs)

        def watched_reduce_scatter(t, *args, **kwargs):
            out = real_reduce_scatter(t, *args, **kwargs)
            reduced.append(out)  # kept alive, so no later tensor can reuse its address
            return out

        ctx.all_gather, ctx.reduce_scatter = watched_all_gather, watched_reduce_scatter
        try:
            x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
            fsdp.copies.reset()
            nn.functional.cross_entropy(fsdp(x), y).backward()
        finally:
            ctx.all_gather, ctx.reduce_scatter = real_all_gather, real_reduce_scatter
        grad_ptrs = {h.shard.grad.untyped_storage().data_ptr() for h in fsdp.handles}
        values_equal = all(any(torch.equal(v, h.shard.detach()) for h in fsdp.handles) for _, v in gathered_inputs)
        opt.step()
        state_on_host = all(s["exp_avg"].untyped_storage().data_ptr() not in grad_ptrs | shard_ptrs
                            and s["exp_avg"].shape == h.shard.shape
                            for h, s in ((h, opt.state[h.shard]) for h in fsdp.handles))
        copies = fsdp.copies
        reduced_ptrs = {t.untyped_storage().data_ptr() for t in reduced}
        return ({p for p, _ in gathered_inputs} & shard_ptrs, reduced_ptrs & grad_ptrs, values_equal, state_on_host,
                (copies.h2d, copies.d2h, copies.h2d_bytes, copies.d2h_bytes), list(copies.shapes))

    for overlap_in, overlap_out, values_equal, state_on_host, counts, shapes in run_ranks(fn, n):
        assert overlap_in == set()  # every all-gather read a fresh copy, never the host shard itself
        assert overlap_out == set()  # every sharded gradient is a host copy, not the reduce-scatter's output
        assert values_equal and state_on_host
        units = len(UNIT_NUMELS)
        psi = sum(padded(u, n) for u in UNIT_NUMELS)
        formula = offload_copy_formula(psi, n)  # forward and backward gather every unit: 2 copies in, 1 out
        assert counts == (2 * units, units, formula["h2d"], formula["d2h"])
        assert formula["h2d"] == 8 * psi / n and formula["d2h"] == 4 * psi / n
        assert sorted(shapes) == sorted([("h2d", padded(u, n) // n) for u in UNIT_NUMELS] * 2
                                        + [("d2h", padded(u, n) // n) for u in UNIT_NUMELS])


def first_oom(ctx, offload: bool, capacity: int, activations: bool = False, batch: int = 8):
    """Train with a budget; the DeviceOutOfMemory's facts, or None if every step fitted."""
    try:
        model = copy.deepcopy(BASE)
        fsdp = FSDP(model, ctx, wrap={nn.Linear}, offload_policy=OffloadPolicy() if offload else None)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
        rec = attach(fsdp, opt, capacity=capacity)
        for _ in range(2):
            x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
            with rec.track_activations() if activations else _nothing():
                loss = nn.functional.cross_entropy(fsdp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            record_event(fsdp, "optimizer step")
    except torch.cuda.OutOfMemoryError as e:  # what torch.cuda raises: DeviceOutOfMemory is one
        assert isinstance(e, DeviceOutOfMemory)
        return e.label, e.category, e.requested, e.free, e.capacity, str(e)
    return None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_budget_raises_at_the_predicted_point_and_names_the_category():
    n = 2
    largest = max(padded(u, n) for u in UNIT_NUMELS)  # layers.1
    psi = sum(padded(u, n) for u in UNIT_NUMELS)
    # offload: the device holds a gathered unit (4 bytes/param), then with its gradient (8 bytes/param)
    label, category, requested, free, cap, message = run_ranks(
        lambda ctx: first_oom(ctx, True, 8 * largest - 1), n)[0]
    assert (label, category, requested, free) == ("post_backward: grads ready layers.1", "grads", 4 * largest,
                                                  4 * largest - 1)
    assert "Tried to allocate 0.06 MiB for gradients" in message and "total capacity of 0.13 MiB" in message
    assert "Host memory (not counted against the budget): parameters (sharded)" in message
    assert "shard the gradients" in message
    label, category, requested, *_ = run_ranks(lambda ctx: first_oom(ctx, True, 4 * largest - 1), n)[0]
    assert (label, category, requested) == ("forward: unshard layers.1", "gathered_params", 4 * largest)
    assert run_ranks(lambda ctx: first_oom(ctx, True, 8 * largest), n) == [None, None]  # exactly enough
    # no offload: the sharded parameters alone pass a budget of 4 Psi / N - 1: at once, when attaching
    label, category, requested, free, _, message = run_ranks(lambda ctx: first_oom(ctx, False, 4 * psi // n - 1),
                                                             n)[0]
    assert (label, category, requested, free) == ("attach", "sharded_params", 4 * psi // n, 4 * psi // n - 1)
    assert "offload the shards to the host" in message
    # without offload, the peak comes in step 2, when Adam's state exists: at layers.1's gradient, beside the sharded
    # gradient already reduced for layers.2 (the formula's 16 Psi / N + 8 * largest is a bound: not every sharded
    # gradient exists yet at that moment)
    adam = 8 * psi // n + 4 * len(UNIT_NUMELS)  # two moments per element, plus a 4-byte step counter per tensor
    exact = 4 * psi // n + adam + 8 * largest + 4 * padded(UNIT_NUMELS[2], n) // n
    assert exact < zero_formula(psi, n, 3, gathered_numel=largest)["total"]
    label, category, requested, free, _, message = run_ranks(lambda ctx: first_oom(ctx, False, exact - 1), n)[0]
    assert (label, category, requested, free) == ("post_backward: grads ready layers.1", "grads", 4 * largest,
                                                  4 * largest - 1)
    assert "optimizer state 0.10 MiB" in message
    assert run_ranks(lambda ctx: first_oom(ctx, False, exact), n) == [None, None]
    # activations count against the device too, once tracked: a batch of 1024 saves its 256 KiB input in layers.0
    label, category, requested, *_, message = run_ranks(
        lambda ctx: first_oom(ctx, True, 8 * largest, activations=True, batch=1024), n)[0]
    assert (label, category, requested) == ("forward: reshard layers.0", "activations", 1024 * 64 * 4)
    assert "a smaller batch per rank, or activation checkpointing" in message
    assert run_ranks(lambda ctx: first_oom(ctx, True, 8 * largest, activations=False, batch=1024), n) == [None, None]


def test_formulas_and_pools():
    f = budget_formula(1000, 4, 3, offload=True, gathered_numel=100, activation_bytes=50)
    assert f["host"] == 16 * 1000 / 4 and f["device"] == 800 + 50
    g = budget_formula(1000, 4, "zero3", gathered_numel=100)
    assert g["device"] == 16 * 1000 / 4 + 800 and g["host"] == 0
    with pytest.raises(ValueError, match="ZeRO-3"):
        budget_formula(1000, 4, 2, offload=True)
    assert offload_copy_formula(1000, 4) == {"h2d": 2000, "d2h": 1000}
    with pytest.raises(ValueError, match="capacity"):
        attach(BASE_ENGINE(), capacity=-1)
    with pytest.raises(Exception, match="TypeError: offload_policy must be"):
        run_ranks(lambda ctx: FSDP(copy.deepcopy(BASE), ctx, offload_policy=object()), 1)


class BASE_ENGINE:  # noqa: N801  (a tiny engine: one tensor)
    def memory_tensors(self):
        return {"params": [torch.zeros(4)]}


@pytest.mark.parametrize("options", [{"prefetch": 1}, {"mp": True}])
def test_offload_composes_with_prefetch_and_mixed_precision(options):
    from fsdp_course.fsdp.policy import MixedPrecision

    def fn(ctx, offload):
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if options.get("mp") else None
        fsdp = FSDP(copy.deepcopy(BASE), ctx, wrap={nn.Linear}, mp_policy=mp, prefetch=options.get("prefetch", 0),
                    offload_policy=OffloadPolicy() if offload else None)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(2):
            x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
            fsdp.copies.reset()
            nn.functional.cross_entropy(fsdp(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in fsdp.parameters()], fsdp.copies.h2d, fsdp.copies.d2h

    plain, offloaded = run_ranks(lambda c: fn(c, False), 2), run_ranks(lambda c: fn(c, True), 2)
    for (a, *_), (b, h2d, d2h) in zip(plain, offloaded, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert (h2d, d2h) == (2 * len(UNIT_NUMELS), len(UNIT_NUMELS))

"""The FSDP unit's life cycle beyond a plain step (fsdp_course/fsdp/param_group.py): activation checkpointing,
frozen weights freed as soon as their unit's backward is over, and a backward that raises.

Each is compared with one process on the same global batch, at world sizes 2 and 3 (3 pads every flat parameter).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.common import ShardedState, TrainingState
from fsdp_course.memory import attach
from fsdp_course.runtime.simulate import RankError, run_ranks

D, CLASSES, BATCH, STEPS = 19, 5, 12, 2  # a 19x19 Linear has 380 elements: a block does not divide by 3
TOL = 1e-5


class Block(nn.Module):
    def __init__(self, d: int, checkpoint_inside: bool = False) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)
        self.checkpoint_inside = checkpoint_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.l1, x, use_reentrant=False) if self.checkpoint_inside else self.l1(x)
        return x + self.l2(torch.tanh(h))


class Net(nn.Module):
    """`mode`: None, "inside" (a part of each unit is checkpointed), "around" (each unit is), "span" (two units
    in one checkpoint)."""

    def __init__(self, mode: str | None = None, depth: int = 3) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList(Block(D, checkpoint_inside=mode == "inside") for _ in range(depth))
        self.out = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "span":
            h = checkpoint(lambda t: self.blocks[1](self.blocks[0](t)), h, use_reentrant=False)
            rest = self.blocks[2:]
        else:
            rest = self.blocks
        for b in rest:
            h = checkpoint(b, h, use_reentrant=False) if self.mode == "around" else b(h)
        return self.out(h)


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def one_process(base: nn.Module, data: list) -> list[tuple[float, dict[str, torch.Tensor]]]:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
        opt.zero_grad()
    return out


def distributed(base: nn.Module, data: list, world_size: int, wrap: set, step_fn=None, **kwargs) -> list:
    def rank_fn(ctx):
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap=wrap, **kwargs)
        opt = torch.optim.SGD([p for p in fsdp.parameters() if p.requires_grad], lr=0.1)
        b = BATCH // ctx.world_size
        out = []
        for step, (x, y) in enumerate(data):
            if step_fn is not None:
                step_fn(fsdp, opt, step)
            ctx.ledger.clear()
            loss = F.cross_entropy(fsdp(x[ctx.rank * b:(ctx.rank + 1) * b]), y[ctx.rank * b:(ctx.rank + 1) * b])
            loss.backward()
            gathers = len(ctx.ledger.select("all_gather"))
            global_loss = ctx.all_reduce(loss.detach().reshape(1), op="mean").item()
            out.append((global_loss, fsdp.full_grads(), gathers))
            opt.step()
            opt.zero_grad()
        states = {(u.sharded_state, u.training_state) for u in fsdp.units}
        return out, states
    return run_ranks(rank_fn, world_size, timeout=60)


def assert_same(reference: list, results: list) -> None:
    for rank, (records, states) in enumerate(results):
        assert states == {(ShardedState.SHARDED, TrainingState.IDLE)}, f"rank {rank}: {states}"
        for step, ((ref_loss, ref_grads), (loss, grads, _)) in enumerate(zip(reference, records, strict=True)):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"step {step} rank {rank}: {loss} vs {ref_loss}"
            for name, g in ref_grads.items():
                d = ((grads[name] - g).norm() / g.norm()).item()
                assert d <= TOL, f"step {step} rank {rank} {name}: relative difference {d:.2e}"


# ------------------------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["inside", "around", "span"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_activation_checkpointing_equals_one_process(mode: str, world_size: int, early_stop: bool) -> None:
    """early_stop (torch's default) ends the recomputation once the saved tensors are back, before the unit's forward
    returns; without it the recomputed forward runs to the end, post_forward included (which must not reshard)."""
    torch.manual_seed(0)
    base, data = Net(mode), batches()
    plain = distributed(Net(None), data, world_size, {Block})
    with set_checkpoint_early_stop(early_stop):  # a global: set here, before the rank threads start
        results = distributed(base, data, world_size, {Block})
    assert_same(one_process(base, data), results)
    for (records, _), (plain_records, _) in zip(results, plain, strict=True):
        gathers, plain_gathers = records[0][2], plain_records[0][2]
        # inside / around: the recomputed forward finds its unit gathered by pre_backward; span: the first unit of the
        # span is gathered for the recomputation and stays gathered until its own backward (as FSDP2): no extra gather
        assert gathers == plain_gathers == 2 * 4  # 3 blocks + the root, in forward and in backward


def test_activation_checkpointing_with_the_root_kept_gathered() -> None:
    torch.manual_seed(0)
    base, data = Net("inside"), batches()
    assert_same(one_process(base, data), distributed(base, data, 3, {Block}, reshard_root_after_forward=False))


# ------------------------------------------------------------------------------------ frozen weights
class LoRABlock(nn.Module):
    """A frozen d x d weight plus a trainable rank-r update B @ A (LoRA, arXiv:2106.09685)."""

    def __init__(self, d: int, r: int, frozen: bool = True) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(not frozen)
        self.a = nn.Parameter(torch.randn(r, d) / d)
        self.b = nn.Parameter(torch.randn(d, r) / r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + x @ self.a.t() @ self.b.t())


def lora_model(depth: int = 4, d: int = 64, r: int = 2, frozen_block: int | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [LoRABlock(d, r) for _ in range(depth)]
    if frozen_block is not None:  # a block with no trainable parameter at all
        blocks[frozen_block].requires_grad_(False)
    return nn.Sequential(*blocks)


def lora_step(world_size: int, model: nn.Module) -> list:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 64, (BATCH,), generator=g)

    def rank_fn(ctx):
        fsdp = FSDP(copy.deepcopy(model), ctx, wrap={LoRABlock})
        opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=1e-3)
        recorder = attach(fsdp, opt)
        b = BATCH // ctx.world_size
        for _ in range(2):  # the first step creates Adam's state; measure the second
            recorder.reset()
            F.cross_entropy(fsdp(x[ctx.rank * b:(ctx.rank + 1) * b]), y[ctx.rank * b:(ctx.rank + 1) * b]).backward()
            opt.step()
            recorder.record("optimizer.step")
            opt.zero_grad()
        sizes = [[(h.layout.padded_numel, h.requires_grad) for h in u.handles] for u in fsdp.units]
        return recorder.peak_total, recorder.peak_label, recorder.peak, sizes, list(fsdp.timeline)
    return run_ranks(rank_fn, world_size, timeout=60)


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_weights_are_freed_after_their_units_backward(world_size: int) -> None:
    """Peak = every shard + Adam's state and sharded gradients of the adapters + one unit gathered with its adapters'
    unsharded gradient. Kept gathered until the end of backward, the frozen weights of every unit would add up."""
    n = world_size
    for peak, label, by_category, sizes, _ in lora_step(n, lora_model()):
        trainable = sum(s for unit in sizes for s, grad in unit if grad)
        frozen = sum(s for unit in sizes for s, grad in unit if not grad)
        unit_all, unit_trainable = sum(s for s, _ in sizes[0]), sum(s for s, g in sizes[0] if g)
        # the peak comes when blocks.0's gradient is ready: every other unit's sharded gradient exists, not its own
        formula = 4 * (frozen + trainable) / n + 8 * trainable / n + 4 * (trainable - unit_trainable) / n \
            + 4 * unit_all + 4 * unit_trainable + 4 * len(sizes)  # + AdamW's 4-byte step count per trainable shard
        assert label == "post_backward: grads ready 0"
        assert peak == formula, f"peak {peak} != formula {formula} ({by_category})"
        assert by_category["gathered_params"] == 4 * unit_all  # never two units' frozen weights at once


def test_a_wholly_frozen_unit_is_freed_before_the_next_unit_gathers() -> None:
    for *_, sizes, timeline in lora_step(2, lora_model(frozen_block=2)):
        assert all(grad is False for _, grad in sizes[2])
        labels = [label for label, _ in timeline]
        freed = labels.index("post_backward: reshard 2") if "post_backward: reshard 2" in labels else \
            labels.index("pre_backward: reshard 2")
        assert freed < labels.index("pre_backward: unshard 1"), labels
        unit = 4 * sum(s for s, _ in sizes[0])
        assert max(snap["gathered_params"] for _, snap in timeline) == unit


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_base_with_adapters_equals_one_process(world_size: int) -> None:
    base, data = lora_model(d=D, frozen_block=1), [(torch.randn(BATCH, D), torch.randint(0, D, (BATCH,)))
                                                   for _ in range(STEPS)]
    results = distributed(base, data, world_size, {LoRABlock})
    assert_same(one_process(base, data), results)


# ------------------------------------------------------------------------------------ a backward that raises
class Boom(torch.autograd.Function):
    """Raises in backward on the ranks (threads) that armed it."""

    state = threading.local()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if getattr(Boom.state, "armed", False):
            raise RuntimeError("planted failure in backward")
        return grad


class Fragile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net.inp(x)
        h = self.net.blocks[0](h)
        h = Boom.apply(h)  # blocks 1, 2 and the output layer have run their backward hooks when this raises
        for b in self.net.blocks[1:]:
            h = b(h)
        return self.net.out(h)


def test_a_backward_that_raises_leaves_the_engine_usable() -> None:
    torch.manual_seed(0)
    base, data = Fragile(), batches()
    failures = []

    def fail_first(fsdp: FSDP, opt: torch.optim.Optimizer, step: int) -> None:
        if step:
            return
        x, y = data[0]
        b = BATCH // fsdp.ctx.world_size
        Boom.state.armed = True
        try:
            F.cross_entropy(fsdp(x[:b]), y[:b]).backward()
        except RuntimeError as exc:
            failures.append(str(exc))
        finally:
            Boom.state.armed = False
        failures.append(sorted(u.training_state.name for u in fsdp.units))
        opt.zero_grad()

    results = distributed(base, data, 3, {Block}, step_fn=fail_first)
    assert sum("planted failure" in str(f) for f in failures) == 3
    assert any("POST_BACKWARD" in f for f in failures if isinstance(f, list)), failures  # hooks had run
    assert_same(one_process(base, data), results)


def test_a_failed_backward_without_recovery_still_raises_clearly() -> None:
    """The planted failure surfaces as the rank's error, not as a hang of the other ranks."""
    torch.manual_seed(0)
    base = Fragile()

    def rank_fn(ctx):
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap={Block})
        Boom.state.armed = True
        F.cross_entropy(fsdp(torch.randn(4, 16)), torch.zeros(4, dtype=torch.long)).backward()

    with pytest.raises(RankError, match="planted failure in backward"):
        run_ranks(rank_fn, 2, timeout=20)

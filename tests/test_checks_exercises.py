"""The checkers of exercises 02 to 10 pass the reference solutions and fail planted mistakes with the right hint.

Each planted mistake is the reference with one thing wrong, the way a learner would get it wrong; the test asserts
the checker's report names it (the hint) and that the stub's NotImplementedError comes out as one short message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from reference_solutions import fails, load, passes
from torch import nn

from fsdp_course import RankContext
from fsdp_course.classroom.checks import (
    check_broadcast_parameters,
    check_clip_grad_norm,
    check_ddp,
    check_flat_param,
    check_fsdp_unit,
    check_sharded_checkpoint,
    check_train_step,
    check_zero_memory,
)

# -- 02 DDP ------------------------------------------------------------------------------------------
DDP = load("02_ddp")


def no_broadcast(ctx: RankContext, model: nn.Module) -> None:
    pass


def broadcast_from_1(ctx: RankContext, model: nn.Module) -> None:
    for p in model.parameters():
        ctx.broadcast(p.data, src=1)


def averages_params(ctx: RankContext, model: nn.Module) -> None:
    for p in model.parameters():
        ctx.all_reduce(p.data, op="mean")


def new_parameters(ctx: RankContext, model: nn.Module) -> None:
    for name, p in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(ctx.broadcast(p.detach().clone())))


@pytest.mark.parametrize(("fn", "hint"), [
    (no_broadcast, "rank 1's `0.weight` still holds its own initial values"),
    (broadcast_from_1, "rank 0's `0.weight` differs"),
    (averages_params, "that is the average of the ranks' values"),
    (new_parameters, "copy into the existing parameters in place"),
])
def test_broadcast_planted(fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_broadcast_parameters, fn, world_sizes=(2,), hint=hint, capsys=capsys)


def sum_hooks(ctx: RankContext, model: nn.Module) -> None:
    for p in model.parameters():
        p.register_hook(lambda grad: ctx.all_reduce(grad.clone()))


def no_hooks(ctx: RankContext, model: nn.Module) -> None:
    pass


def twice_averaged(ctx: RankContext, model: nn.Module) -> None:
    for p in model.parameters():
        p.register_hook(lambda grad: ctx.all_reduce(grad.clone(), op="mean") / ctx.world_size)


def returning_post_hook(ctx: RankContext, model: nn.Module) -> None:
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ctx.all_reduce(p.grad, op="mean"))


def test_ddp_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    passes(check_broadcast_parameters, DDP["broadcast_parameters"], capsys=capsys)
    out = passes(check_ddp, DDP["broadcast_parameters"], DDP["add_gradient_hooks"], capsys=capsys)
    assert "every rank's gradients and parameters equal one process's" in out


@pytest.mark.parametrize(("hooks", "hint"), [
    (sum_hooks, "rank 0's gradient is 2x the one-process gradient: the hooks summed it"),
    (no_hooks, "rank 0's gradient is its own slice's gradient, not averaged over the ranks"),
    (twice_averaged, "rank 0's gradient is 2x too small: it was averaged twice"),
    (returning_post_hook, "a post-accumulate-grad hook must return None"),
])
def test_ddp_planted(hooks: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ddp, DDP["broadcast_parameters"], hooks, world_sizes=(1, 2), hint=hint, capsys=capsys)
    assert "FAILED at world size" in out


def test_ddp_without_broadcast_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_ddp, no_broadcast, DDP["add_gradient_hooks"], world_sizes=(2,),
           hint="(check_broadcast_parameters shows more)", capsys=capsys)


def test_ddp_stub(capsys: pytest.CaptureFixture[str]) -> None:
    def add_gradient_hooks(ctx: RankContext, model: nn.Module) -> None:
        raise NotImplementedError()

    with pytest.raises(NotImplementedError, match="add_gradient_hooks is not implemented yet"):
        check_ddp(DDP["broadcast_parameters"], add_gradient_hooks, world_sizes=(2,))


# -- 03 ZeRO memory ----------------------------------------------------------------------------------
zero_memory = load("03_memory")["zero_memory"]


def _scaled(**factors: float) -> Callable[[int, int, int], dict[str, float]]:
    def fn(numel: int, world_size: int, stage: int) -> dict[str, float]:
        d = zero_memory(numel, world_size, stage)
        for key, factor in factors.items():
            d[key] *= factor
        d["total"] = d["params"] + d["grads"] + d["optimizer"]
        return d
    return fn


def one_stage_ahead(numel: int, world_size: int, stage: int) -> dict[str, float]:
    return zero_memory(numel, world_size, min(stage + 1, 3))


def one_stage_behind(numel: int, world_size: int, stage: int) -> dict[str, float]:
    return zero_memory(numel, world_size, max(stage - 1, 0))


def bad_total(numel: int, world_size: int, stage: int) -> dict[str, float]:
    return dict(zero_memory(numel, world_size, stage), total=0)


def no_dict(numel: int, world_size: int, stage: int) -> float:
    return zero_memory(numel, world_size, stage)["total"]


def test_zero_memory_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_zero_memory, zero_memory, capsys=capsys)
    assert "ZeRO-3/FSDP   4           2,720       2,724" in out


@pytest.mark.parametrize(("fn", "hint"), [
    (_scaled(optimizer=0.5), "Adam keeps two fp32 tensors per parameter"),
    (_scaled(params=0.25, grads=0.25, optimizer=0.25), "those are elements, not bytes"),
    (one_stage_ahead, "DDP does not shard the Adam state yet"),
    (one_stage_behind, "ZeRO-1 shards the Adam state: each rank keeps 1/N of them"),
    (bad_total, "total is params + grads + optimizer"),
    (no_dict, "return a dict with the keys"),
])
def test_zero_memory_planted(fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_zero_memory, fn, hint=hint, capsys=capsys)


def test_zero_memory_stub() -> None:
    def zero_memory(numel: int, world_size: int, stage: int) -> dict[str, float]:
        raise NotImplementedError()

    with pytest.raises(NotImplementedError, match="zero_memory is not implemented yet"):
        check_zero_memory(zero_memory)


# -- 05 flat parameter -------------------------------------------------------------------------------
FLAT = load("05_flat_param")
FLAT_FNS = (FLAT["flatten_with_padding"], FLAT["shard_range"], FLAT["unflatten_views"])


def no_padding(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def pads_with_ones(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_ones((-flat.numel()) % world_size)])


def reversed_order(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    return FLAT["flatten_with_padding"](tensors[::-1], world_size)


def article_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    size = -(-numel // world_size)
    return rank * size, min(numel, (rank + 1) * size)


def floor_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    size = numel // world_size
    return rank * size, (rank + 1) * size


def copies(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [v.clone() for v in FLAT["unflatten_views"](flat, shapes)]


def pads_a_whole_rank(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(world_size - flat.numel() % world_size)])  # world_size zeros if it divides


def no_offset(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [flat[:torch.Size(s).numel()].view(s) for s in shapes]


def test_flat_param_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_flat_param, *FLAT_FNS, capsys=capsys)
    assert "32 elements padded to 33, shards (0, 11), (11, 22), (22, 33)" in out


@pytest.mark.parametrize(("index", "fn", "hint"), [
    (0, no_padding, "no padding: 16 elements over 3 ranks: pad with zeros to the next multiple of 3"),
    (0, pads_with_ones, "the padding must be zeros"),
    (0, reversed_order, "right values, wrong order"),
    (0, pads_a_whole_rank, "one rank holds everything, so there is nothing to pad: the flat tensor is the 16 elements"),
    (1, article_range, "rank 2's shard has 4 elements, the others 6: this is the article's bug"),
    (1, floor_range, "16 / 3 is not whole: shards have ceil(numel / N) = 6 elements"),
    (2, copies, "tensor 0 is a copy, not a view of the flat buffer"),
    (2, no_offset, "keep a running offset"),
])
def test_flat_param_planted(index: int, fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fns = list(FLAT_FNS)
    fns[index] = fn
    fails(check_flat_param, *fns, hint=hint, capsys=capsys)


def test_flat_param_stub() -> None:
    def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
        raise NotImplementedError()

    with pytest.raises(NotImplementedError, match="shard_range is not implemented yet"):
        check_flat_param(FLAT_FNS[0], shard_range, FLAT_FNS[2])


# -- 06 the FSDP unit ----------------------------------------------------------------------------------
Unit = load("06_fsdp")["FSDPUnit"]


class SummingUnit(Unit):
    def post_backward(self) -> None:
        self.shard.grad = self.ctx.reduce_scatter(self.full.grad, op="sum")
        self.full.grad = None
        self.reshard()


class NoPreBackward(Unit):
    def post_forward(self, output: torch.Tensor) -> None:
        self.reshard()


class GathersIntoTheLeaf(Unit):
    def unshard(self) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.ctx.all_gather(self.shard.detach(), out=self.full)


class KeepsGathered(Unit):
    def post_forward(self, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: self.pre_backward())


class KeepsFullGrad(Unit):
    def post_backward(self) -> None:
        self.shard.grad = self.ctx.reduce_scatter(self.full.grad.clone(), op="mean")
        self.reshard()


class FullGradInShard(Unit):
    def post_backward(self) -> None:
        self.shard.grad = self.full.grad.clone()
        self.full.grad = None
        self.reshard()


class OverwritesGrad(Unit):
    """Right for one backward per step; a second backward before the step replaces the first's gradient."""

    def post_backward(self) -> None:
        self.shard.grad = self.ctx.reduce_scatter(self.full.grad, op="mean")
        self.full.grad = None
        self.reshard()


class ViewsOnlyOnce(Unit):
    """Points the module at views of self.full in its first forward only, and reuses them after."""

    def pre_forward(self) -> None:
        self.unshard()
        if not getattr(self, "views_made", False):
            self.set_params(self.layout.unflatten(self.full))
            self.views_made = True


def test_fsdp_unit_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_fsdp_unit, Unit, capsys=capsys)
    assert "after each unit's forward and after backward, the gathered parameters were freed" in out
    assert "step 2 accumulated two backward passes in shard.grad; every forward made fresh views" in out


@pytest.mark.parametrize(("cls", "hint"), [
    (SummingUnit, "rank 0's gradient chunk is 2x too large: did you average over the world size"),
    (NoPreBackward, "a unit's backward ran while its parameters were freed"),
    (GathersIntoTheLeaf, "gather into self.full.data, not self.full"),
    (KeepsGathered, "after its forward, unit 0 still holds its gathered parameters"),
    (KeepsFullGrad, "after backward, unit 0's full gradient (self.full.grad) is still alive"),
    (FullGradInShard, "self.shard.grad must have the shard's shape"),
    (OverwritesGrad, "rank 0's gradient chunk is half of one process's after two backward passes: the second "
                     "overwrote the first's gradient"),
    (ViewsOnlyOnce, "make fresh views in every pre_forward"),
])
def test_fsdp_unit_planted(cls: type, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_fsdp_unit, cls, world_sizes=(2,), hint=hint, capsys=capsys)


def test_fsdp_unit_stub() -> None:
    class Stub(Unit):
        def pre_forward(self) -> None:
            raise NotImplementedError()

    with pytest.raises(NotImplementedError, match="pre_forward is not implemented yet"):
        check_fsdp_unit(Stub, world_sizes=(2,))


# -- 08 sharded checkpoint -----------------------------------------------------------------------------
CKPT = load("08_transformer")


def load_any_world_size(ctx: RankContext, directory: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(directory, f"rank{ctx.rank}.pt"), weights_only=True)


def save_without_barrier(ctx: RankContext, state: dict[str, torch.Tensor], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, f"rank{ctx.rank}.pt"))
    if ctx.rank == 0:
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump({"world_size": ctx.world_size}, f)


def load_as_double(ctx: RankContext, directory: str) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in CKPT["load_sharded"](ctx, directory).items()}


def test_checkpoint_exercise_imports_what_it_promises() -> None:
    """The text says load_sharded may use `os`, `json`, `Path` and `torch`: the notebook's first cell imports them."""
    from pathlib import Path

    assert CKPT["Path"] is Path and CKPT["os"] is os and CKPT["json"] is json and CKPT["torch"] is torch


def test_checkpoint_reference_passes_in_threads(capsys: pytest.CaptureFixture[str]) -> None:
    passes(check_sharded_checkpoint, CKPT["save_sharded"], CKPT["load_sharded"], torchrun=False, capsys=capsys)


@pytest.mark.parametrize(("save", "load_fn", "hint"), [
    (CKPT["save_sharded"], load_any_world_size, "in load, raise (e.g. ValueError) on every rank"),
    (save_without_barrier, CKPT["load_sharded"], "end save with ctx.barrier()"),
    (CKPT["save_sharded"], load_as_double, "exp_avg.0: torch.float64 (377,), saved torch.float32 (377,)"),
])
def test_checkpoint_planted(save: Callable, load_fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_sharded_checkpoint, save, load_fn, world_sizes=(2,), torchrun=False, hint=hint, capsys=capsys)


def load_with_outside_helper(ctx: RankContext, directory: str) -> dict[str, torch.Tensor]:
    return CKPT["load_sharded"](ctx, directory)  # fine in this process; torchrun's processes have no CKPT


def test_checkpoint_loaded_by_torchrun_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """The torchrun half: the load function runs by its source in two fresh processes (here it needs a helper)."""
    out = fails(check_sharded_checkpoint, CKPT["save_sharded"], load_with_outside_helper, world_sizes=(2,),
                 hint="runs in a fresh process", capsys=capsys)
    assert "FAILED at world size 2, loaded by torchrun" in out
    assert "NameError: name 'CKPT' is not defined" in out


# -- 10 distributed pitfalls ---------------------------------------------------------------------------
PIT = load("10_distributed_pitfalls")


def clips_by_own_norm(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    total = torch.sqrt(sum((g.pow(2).sum() for g in shards), torch.zeros(())))
    for g in shards:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def adds_norms(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    own = torch.sqrt(sum((g.pow(2).sum() for g in shards), torch.zeros(())))
    return ctx.all_reduce(own.reshape(1))[0]


def mean_of_squares(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    local = sum((g.pow(2).sum() for g in shards), torch.zeros(()))
    return ctx.all_reduce(local.reshape(1), op="mean")[0].sqrt()


def global_norm_no_scaling(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    local = sum((g.pow(2).sum() for g in shards), torch.zeros(()))
    return ctx.all_reduce(local.reshape(1))[0].sqrt()


def always_scales(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    total = global_norm_no_scaling(ctx, shards, max_norm)
    for g in shards:
        g.mul_(max_norm / (total + 1e-6))
    return total


def right_norm_own_scale(ctx: RankContext, shards: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    total = global_norm_no_scaling(ctx, shards, max_norm)
    clips_by_own_norm(ctx, shards, max_norm)
    return total


def test_clip_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    passes(check_clip_grad_norm, PIT["clip_grad_norm_sharded"], capsys=capsys)


@pytest.mark.parametrize(("fn", "hint"), [
    (clips_by_own_norm, "is rank 0's own shard's norm: the article's bug"),
    (adds_norms, "norms do not add up"),
    (mean_of_squares, "that is sqrt(mean of the squared norms)"),
    (global_norm_no_scaling, "the shards were not scaled"),
    (right_norm_own_scale, "rank 0 scaled by max_norm / its own norm"),
])
def test_clip_planted(fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_clip_grad_norm, fn, world_sizes=(2,), hint=hint, capsys=capsys)


def test_clip_scaling_below_max_norm_is_caught(capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_clip_grad_norm, always_scales, world_sizes=(1,), hint="clip only when it exceeds it", capsys=capsys)


def buggy_step(ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        ctx.all_reduce(p.grad)
    if ctx.rank == 0:
        ctx.all_reduce(loss.detach().reshape(1), op="mean")
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def summing_step(ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor) -> float:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        ctx.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad()
    return ctx.all_reduce(loss.detach().reshape(1), op="mean").item()


def local_loss_step(ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> float:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        ctx.all_reduce(p.grad, op="mean")
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_train_step_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    passes(check_train_step, PIT["train_step"], capsys=capsys)


@pytest.mark.parametrize(("fn", "hint"), [
    (buggy_step, "a rank made a collective that the others did not"),
    (summing_step, "the parameters moved 2x as far as one process's at world size 2"),
    (local_loss_step, "rank 0 returned its own slice's loss"),
])
def test_train_step_planted(fn: Callable, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_train_step, fn, world_sizes=(1, 2), hint=hint, capsys=capsys)
    assert "world size 2, rank 0, step 1" in out

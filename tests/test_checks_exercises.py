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
from fsdp_course.i18n.messages import Message

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


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (no_broadcast, "ddp.own_values", {"rank": 1, "name": "0.weight"}),
    (broadcast_from_1, "ddp.not_broadcast", {"rank": 0, "name": "0.weight"}),
    (averages_params, "ddp.averaged", {}),
    (new_parameters, "ddp.copy_in_place", {}),
])
def test_broadcast_planted(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_broadcast_parameters, fn, world_sizes=(2,), says=says, fields=fields, capsys=capsys)


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


@pytest.mark.parametrize(("hooks", "says", "fields"), [
    (sum_hooks, "ddp.summed", {"rank": 0, "n": 2}),
    (no_hooks, "ddp.own_slice", {"rank": 0}),
    (twice_averaged, "ddp.averaged_twice", {"rank": 0, "n": 2}),
    (returning_post_hook, "common.hook_returns", {}),
])
def test_ddp_planted(hooks: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_ddp, DDP["broadcast_parameters"], hooks, world_sizes=(1, 2), says=says, fields=fields,
                capsys=capsys)
    assert "FAILED at world size" in out


def test_ddp_without_broadcast_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_ddp, no_broadcast, DDP["add_gradient_hooks"], world_sizes=(2,),
           says="ddp.shows_more", fields={"hint": "ddp.own_values"}, capsys=capsys)


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


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (_scaled(optimizer=0.5), "memory.adam_two", {}),
    (_scaled(params=0.25, grads=0.25, optimizer=0.25), "memory.elements", {}),
    (one_stage_ahead, "memory.not_yet", {"stage_name": "DDP", "what": "memory.adam_state"}),
    (one_stage_behind, "memory.shards", {"stage_name": "ZeRO-1", "what": "memory.adam_state"}),
    (bad_total, "memory.total", {}),
    (no_dict, "memory.return_dict", {}),
])
def test_zero_memory_planted(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_zero_memory, fn, says=says, fields=fields, capsys=capsys)


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


def none_after_rank_0(numel: int, world_size: int, rank: int) -> tuple[int, int] | None:
    if world_size == 1:
        return 0, numel
    return (1, 2) if rank == 0 else None  # wrong on rank 0, and a branch that forgets to return


def no_offset(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [flat[:torch.Size(s).numel()].view(s) for s in shapes]


def test_flat_param_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_flat_param, *FLAT_FNS, capsys=capsys)
    assert "32 elements padded to 33, shards (0, 11), (11, 22), (22, 33)" in out


@pytest.mark.parametrize(("index", "fn", "says", "fields"), [
    (0, no_padding, "flat_param.no_padding", {"hint": Message("flat_param.pad_to", {"numel": 16, "n": 3})}),
    (0, pads_with_ones, "flat_param.padding_zeros", {}),
    (0, reversed_order, "flat_param.wrong_order", {}),
    (0, pads_a_whole_rank, "flat_param.one_rank", {"numel": 16}),
    (1, article_range, "flat_param.article_bug", {"last": 2, "short": 4, "size": 6}),
    (1, floor_range, "flat_param.not_whole", {"numel": 16, "n": 3, "shard": 6}),
    (1, none_after_rank_0, "flat_param.range_returned", {"r": 1, "got": "None"}),
    (2, copies, "flat_param.copy", {"i": 0}),
    (2, no_offset, "flat_param.running_offset", {}),
])
def test_flat_param_planted(index: int, fn: Callable, says: str, fields: dict,
                            capsys: pytest.CaptureFixture[str]) -> None:
    fns = list(FLAT_FNS)
    fns[index] = fn
    fails(check_flat_param, *fns, says=says, fields=fields, capsys=capsys)


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


@pytest.mark.parametrize(("cls", "says", "fields"), [
    (SummingUnit, "fsdp_unit.too_large", {"rank": 0, "n": 2}),
    (NoPreBackward, "fsdp_unit.freed_backward", {}),
    (GathersIntoTheLeaf, "fsdp_unit.full_data", {}),
    (KeepsGathered, "fsdp_unit.held_after_forward", {"k": 0}),
    (KeepsFullGrad, "fsdp_unit.full_grad_alive", {"k": 0}),
    (FullGradInShard, "fsdp_unit.grad_size", {}),
    (OverwritesGrad, "fsdp_unit.half", {"rank": 0}),
    (ViewsOnlyOnce, "fsdp_unit.fresh_views", {}),
])
def test_fsdp_unit_planted(cls: type, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_fsdp_unit, cls, world_sizes=(2,), says=says, fields=fields, capsys=capsys)


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


@pytest.mark.parametrize(("save", "load_fn", "says", "fields"), [
    (CKPT["save_sharded"], load_any_world_size, "checkpoint.refuse_world_size", {}),
    (save_without_barrier, CKPT["load_sharded"], "checkpoint.end_with_barrier", {}),
    (CKPT["save_sharded"], load_as_double, "checkpoint.dtype_shape",
     {"name": "exp_avg.0", "got": "torch.float64 (377,)", "saved": "torch.float32 (377,)"}),
])
def test_checkpoint_planted(save: Callable, load_fn: Callable, says: str, fields: dict,
                            capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_sharded_checkpoint, save, load_fn, world_sizes=(2,), torchrun=False, says=says, fields=fields,
          capsys=capsys)


def load_with_outside_helper(ctx: RankContext, directory: str) -> dict[str, torch.Tensor]:
    return CKPT["load_sharded"](ctx, directory)  # fine in this process; torchrun's processes have no CKPT


def test_checkpoint_loaded_by_torchrun_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """The torchrun half: the load function runs by its source in two fresh processes (here it needs a helper)."""
    out = fails(check_sharded_checkpoint, CKPT["save_sharded"], load_with_outside_helper, world_sizes=(2,),
                 says="checkpoint.fresh_process_helper", capsys=capsys)
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


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (clips_by_own_norm, "pitfalls.own_norm", {"rank": 0}),
    (adds_norms, "pitfalls.norms_add", {}),
    (mean_of_squares, "pitfalls.sqrt_mean", {}),
    (global_norm_no_scaling, "pitfalls.not_scaled", {}),
    (right_norm_own_scale, "pitfalls.own_scale", {"rank": 0}),
])
def test_clip_planted(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_clip_grad_norm, fn, world_sizes=(2,), says=says, fields=fields, capsys=capsys)


def test_clip_scaling_below_max_norm_is_caught(capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_clip_grad_norm, always_scales, world_sizes=(1,), says="pitfalls.below_max", capsys=capsys)


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


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (buggy_step, "pitfalls.collective_on_rank0", {}),
    (summing_step, "pitfalls.grads_summed", {"n": 2}),
    (local_loss_step, "pitfalls.own_loss", {"rank": 0}),
])
def test_train_step_planted(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_train_step, fn, world_sizes=(1, 2), says=says, fields=fields, capsys=capsys)
    assert "world size 2, rank 0, step 1" in out

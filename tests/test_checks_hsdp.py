"""The checker of exercise 16 (HSDP's gradient path) passes the reference solution and fails planted mistakes with the
diagnosis that names them: each planted function is the reference with one thing wrong, as a learner would get it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference_solutions import fails, load, passes

from fsdp_course.classroom.checks import check_hsdp_grad

HSDP = load("16_hsdp")


def all_reduce_sums(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="mean")
    return mesh.replicate.all_reduce(local, op="sum")


def reduce_scatter_sums(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="sum")
    return mesh.replicate.all_reduce(local, op="mean")


def both_sum(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="sum")
    return mesh.replicate.all_reduce(local, op="sum")


def no_all_reduce(mesh, grad):
    return mesh.shard.reduce_scatter(grad, op="mean")


def all_reduce_in_shard_group(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="mean")
    return mesh.shard.all_reduce(local, op="mean")


def all_reduce_over_world(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="mean")
    return mesh.world.all_reduce(local, op="mean")


def reduce_scatter_over_world(mesh, grad):
    local = mesh.world.reduce_scatter(grad, op="mean")
    return mesh.replicate.all_reduce(local, op="mean")


def groups_swapped(mesh, grad):  # reduce-scatter across the replicas, all-reduce along the row
    local = mesh.replicate.reduce_scatter(grad, op="mean")
    return mesh.shard.all_reduce(local, op="mean")


def both_over_world(mesh, grad):
    local = mesh.world.reduce_scatter(grad, op="mean")
    return mesh.world.all_reduce(local, op="mean")


def all_reduce_first(mesh, grad):  # right values, S times the inter-group bytes
    mesh.replicate.all_reduce(grad, op="mean")
    return mesh.shard.reduce_scatter(grad, op="mean")


def returns_whole_gradient(mesh, grad):
    local = mesh.shard.reduce_scatter(grad, op="mean")
    mesh.replicate.all_reduce(local, op="mean")
    return grad


def stub(mesh, grad):
    raise NotImplementedError()


def test_reference_solution_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_hsdp_grad, HSDP["hsdp_reduce_grad"], capsys=capsys)
    assert "meshes 2x3, 2x2, 1x4, 3x1" in out


@pytest.mark.parametrize(("planted", "hint"), [
    (all_reduce_sums, "2x too large (R = 2): the all-reduce summed the replicas"),
    (reduce_scatter_sums, "3x too large (S = 3): the reduce-scatter summed the shard group"),
    (both_sum, "6x too large (N = R x S = 6): both collectives summed"),
    (groups_swapped, "both collectives ran in the wrong group (the two groups swapped): the reduce-scatter in "
                     "mesh.replicate, the all-reduce in mesh.shard"),
    (both_over_world, "both collectives ran in the wrong group: the reduce-scatter in the whole world (ctx), the "
                      "all-reduce in the whole world (ctx)"),
    (no_all_reduce, "replicas disagree: ranks 0 and 3 hold shard 0 but different values"),
    (all_reduce_in_shard_group, "all-reduce over the wrong group: it ran in mesh.shard"),
    (all_reduce_over_world, "all-reduce over the wrong group: it ran over the whole world"),
    (reduce_scatter_over_world, "reduce_scatter ran over the whole world (ctx)"),
    (all_reduce_first, "the whole gradient crosses the slow link, 3x HSDP's inter-group bytes"),
    (returns_whole_gradient, "returned shape (12,), expected (4,)"),
])
def test_planted_mistakes_are_named(planted: Callable[..., torch.Tensor], hint: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_hsdp_grad, planted, hint=hint, capsys=capsys)
    assert "mesh replicate=2, shard=3" in out  # the first mesh, where R, S and N differ


def test_a_stub_says_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_hsdp_grad(stub)

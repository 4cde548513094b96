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


@pytest.mark.parametrize(("planted", "says", "fields"), [
    (all_reduce_sums, "hsdp.replicas_summed", {"n": 2}),
    (reduce_scatter_sums, "hsdp.shards_summed", {"n": 3}),
    (both_sum, "hsdp.all_summed", {"n": 6}),
    (groups_swapped, "hsdp.both_wrong", {"swapped": "hsdp.swapped", "scatter_in": "mesh.replicate",
                                         "reduce_in": "mesh.shard"}),
    (both_over_world, "hsdp.both_wrong", {"swapped": "", "scatter_in": "hsdp.world", "reduce_in": "hsdp.world"}),
    (no_all_reduce, "hsdp.replicas_disagree", {"first": 0, "rank": 3, "s": 0}),
    (all_reduce_in_shard_group, "hsdp.all_reduce_shard", {}),
    (all_reduce_over_world, "hsdp.all_reduce_world", {}),
    (reduce_scatter_over_world, "hsdp.ran_over_world", {"ops": "reduce_scatter"}),
    (all_reduce_first, "hsdp.whole_gradient", {"factor": 3}),
    (returns_whole_gradient, "hsdp.shape", {"got": (12,), "expected": (4,)}),
])
def test_planted_mistakes_are_named(planted: Callable[..., torch.Tensor], says: str, fields: dict,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_hsdp_grad, planted, says=says, fields=fields, capsys=capsys)
    assert "mesh replicate=2, shard=3" in out  # the first mesh, where R, S and N differ


def test_a_stub_says_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_hsdp_grad(stub)

"""Checker of exercise 16: HSDP's gradient path for one flat gradient.

The learner writes `hsdp_reduce_grad(mesh, grad)`: `mesh` is this rank's `ctx.mesh(replicate=R, shard=S)`
(runtime/mesh.py: `mesh.shard` and `mesh.replicate` are rank contexts over its row and its column), `grad` this
rank's unsharded flat gradient (padded to a multiple of S) from its own slice of the batch. It returns this rank's
shard of the mean over all N = R x S ranks' gradients, the way FSDP2's HSDP computes it
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, `foreach_reduce`) and the course's
`FSDP(..., mesh=mesh)` does: a reduce-scatter (mean) in the shard group, then an all-reduce (mean) of that shard
across the replicate group.

Checked on every rank at meshes 2x3, 2x2, 1x4 and 3x1 (a flat gradient of 11 elements: padded at S = 2, 3 and 4):
the result against the mean of all ranks' gradients, cut at shard s; and from the three ledgers (the world's, the
shard group's, the replicate group's) which collective ran in which group. Diagnosed by name: a collective in the
wrong group (both named when both are, e.g. the groups swapped), replicas that disagree (no all-reduce across the
replicate group), a result R, S or N times too large (a sum instead of a mean; the factor and its value named), and
an all-reduce of the whole gradient instead of the shard (right values, S times the inter-group bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    exception_hint,
    format_tensor,
    require_callable,
    run_checked,
)
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.runtime.context import RankContext

__all__ = ["check_hsdp_grad", "hsdp_grads"]

MESHES = ((2, 3), (2, 2), (1, 4), (3, 1))  # (replicate, shard); 2x3 first: R, S and N tell a sum apart
NUMEL = 11  # padded to 12 at S = 2, 3 and 4
SEED = 14
TOL = 1e-5


def hsdp_grads(replicate: int, shard: int) -> list[torch.Tensor]:
    """Every rank's unsharded flat gradient (padded to a multiple of `shard`, zeros in the padding)."""
    g = torch.Generator().manual_seed(SEED + 100 * replicate + shard)
    out = []
    for _ in range(replicate * shard):
        full = torch.zeros(padded_numel(NUMEL, shard))
        full[:NUMEL] = torch.randn(NUMEL, generator=g)
        out.append(full)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check_hsdp_grad(fn: Callable[[Any, torch.Tensor], torch.Tensor],
                    meshes: Sequence[tuple[int, int]] = MESHES) -> None:
    """Check `fn(mesh, grad) -> shard`: the mean over all ranks of their gradients, this rank's shard of it, by a
    reduce-scatter in the shard group and an all-reduce of the shard in the replicate group."""
    check = "check_hsdp_grad"
    name = require_callable(check, fn, "hsdp_reduce_grad")
    for replicate, shard in meshes:
        grads = hsdp_grads(replicate, shard)

        def rank_fn(ctx: RankContext, replicate: int = replicate, shard: int = shard,
                    grads: list[torch.Tensor] = grads) -> dict[str, Any]:
            mesh = ctx.mesh(replicate=replicate, shard=shard)
            ctx.ledger.clear()
            out = fn(mesh, grads[ctx.rank].clone())
            return {"out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
                    "world": [(r.op, r.payload_bytes) for r in ctx.ledger],
                    "shard": [(r.op, r.payload_bytes) for r in mesh.shard.ledger],
                    "replicate": [(r.op, r.payload_bytes) for r in mesh.replicate.ledger]}

        where_mesh = f"mesh replicate={replicate}, shard={shard}"
        results = run_checked(check, name, rank_fn, replicate * shard, lambda r, w=where_mesh: f"{w}, rank {r}",
                              exception_hint)
        _judge(check, replicate, shard, grads, results)
    shapes = ", ".join(f"{r}x{s}" for r, s in meshes)
    print(f"All tests in {check} passed (world sizes {', '.join(str(r * s) for r, s in meshes)}; meshes {shapes})")
    print("  reduce-scatter (mean) in the shard group, all-reduce (mean) of the shard in the replicate group: every "
          "rank holds its shard of the mean over all ranks, and the replicas of a shard agree")


def _judge(check: str, replicate: int, shard: int, grads: list[torch.Tensor], results: list[dict[str, Any]]) -> None:
    n = replicate * shard
    mean = torch.stack(grads).mean(0)
    expected = list(mean.chunk(shard))
    shard_bytes = expected[0].numel() * 4
    mesh_where = f"mesh replicate={replicate}, shard={shard}"
    for rank, res in enumerate(results):  # which collective ran in which group
        where = f"{mesh_where}, rank {rank}"
        world, rows, columns = res["world"], res["shard"], res["replicate"]
        scatter_in = ("the whole world (ctx)" if any(op == "reduce_scatter" for op, _ in world) else
                      "mesh.replicate" if any(op == "reduce_scatter" for op, _ in columns) else None)
        reduce_in = ("the whole world (ctx)" if any(op == "all_reduce" for op, _ in world) else
                     "mesh.shard" if any(op == "all_reduce" for op, _ in rows) else None)
        if scatter_in and reduce_in:
            swapped = " (the two groups swapped)" if (scatter_in, reduce_in) == ("mesh.replicate", "mesh.shard") else ""
            CheckFailure(check, where, f"both collectives ran in the wrong group{swapped}: the reduce-scatter in "
                         f"{scatter_in}, the all-reduce in {reduce_in}",
                         "reduce-scatter in mesh.shard (the S ranks that split the gradient), then all-reduce the "
                         "shard in mesh.replicate (the R ranks that hold the same shard)").fail()
        if any(op == "all_reduce" for op, _ in world):
            CheckFailure(check, where, "all-reduce over the wrong group: it ran over the whole world (ctx), whose "
                         "ranks hold different shards", "all-reduce the reduced shard across mesh.replicate: the "
                         "ranks in this rank's column hold the same shard").fail()
        if world:
            ops = ", ".join(op for op, _ in world)
            CheckFailure(check, where, f"{ops} ran over the whole world (ctx), not in a group of the mesh",
                         "reduce-scatter in mesh.shard (the S ranks that split the gradient), then all-reduce in "
                         "mesh.replicate (the R ranks that hold the same shard)").fail()
        if any(op == "all_reduce" for op, _ in rows):
            CheckFailure(check, where, "all-reduce over the wrong group: it ran in mesh.shard, whose ranks hold "
                         "different shards", "all-reduce the reduced shard across mesh.replicate: the ranks in "
                         "this rank's column hold the same shard").fail()
        if any(op == "reduce_scatter" for op, _ in columns):
            CheckFailure(check, where, "reduce-scatter over the wrong group: it ran in mesh.replicate",
                         "reduce-scatter in mesh.shard: the gradient is split into S shards, one per rank of a "
                         "row").fail()
        if [op for op, _ in rows] != ["reduce_scatter"]:
            CheckFailure(check, where, f"the shard group ran {[op for op, _ in rows] or 'nothing'}, expected one "
                         "reduce_scatter", "mesh.shard.reduce_scatter(grad, op='mean') gives this rank its shard of "
                         "the row's mean").fail()
        big = [b for op, b in columns if op == "all_reduce" and b != shard_bytes]
        if big and replicate > 1:
            CheckFailure(check, where, f"the replicate group all-reduced {big[0]} bytes, the shard has {shard_bytes}"
                         f": the whole gradient crosses the slow link, {big[0] // shard_bytes}x HSDP's inter-group "
                         "bytes", "reduce-scatter first, then all-reduce only the shard it returns "
                         "(FSDP2's order)").fail()
    for rank, res in enumerate(results):  # what came back
        where = f"{mesh_where}, rank {rank}"
        got, want = res["out"], expected[rank % shard]
        if not isinstance(got, torch.Tensor):
            CheckFailure(check, where, f"returned {type(got).__name__}, not a tensor",
                         "return this rank's shard (what reduce_scatter returned, after the all-reduce)").fail()
        if tuple(got.shape) != tuple(want.shape):
            CheckFailure(check, where, f"returned shape {tuple(got.shape)}, expected {tuple(want.shape)} (the "
                         f"padded gradient of {grads[0].numel()} elements in {shard} shards)",
                         "return the shard that mesh.shard.reduce_scatter gave this rank, not the whole "
                         "gradient").fail()
    for s in range(shard):  # the replicas of shard s: ranks s, S + s, ...
        column = [r * shard + s for r in range(replicate)]
        first = results[column[0]]["out"]
        for rank in column[1:]:
            if not torch.allclose(results[rank]["out"], first, rtol=TOL, atol=TOL):
                CheckFailure(check, f"{mesh_where}, ranks {column[0]} and {rank}",
                             f"replicas disagree: ranks {column[0]} and {rank} hold shard {s} but different values",
                             "after the reduce-scatter, all-reduce the shard (op='mean') across mesh.replicate, so "
                             "every replica holds the mean over all R x S ranks",
                             [f"rank {column[0]}: {format_tensor(first, 6)}",
                              f"rank {rank}: {format_tensor(results[rank]['out'], 6)}"]).fail()
    for rank, res in enumerate(results):
        where = f"{mesh_where}, rank {rank}"
        got, want = res["out"], expected[rank % shard]
        if _rel(got, want) <= TOL:
            continue
        details = [f"expected {format_tensor(want, 6)}", f"got      {format_tensor(got, 6)}"]
        factors = {n: f"{n}x too large (N = R x S = {n}): both collectives summed (op='sum'); use op='mean' in "
                      "both"}
        factors.setdefault(replicate, f"{replicate}x too large (R = {replicate}): the all-reduce summed the replicas "
                                      "(op='sum'); use op='mean' across mesh.replicate")
        factors.setdefault(shard, f"{shard}x too large (S = {shard}): the reduce-scatter summed the shard group "
                                  "(op='sum'); use op='mean'")
        for factor, problem in factors.items():
            if factor > 1 and _rel(got, factor * want) <= TOL:
                CheckFailure(check, where, problem, "the gradient is the mean over all ranks' slices, as one "
                             "process's mean loss gives it", details).fail()
        CheckFailure(check, where, f"the shard differs from the mean over all {n} ranks' gradients "
                     f"({_rel(got, want):.2e} relative)", "reduce-scatter (mean) in mesh.shard, then all-reduce "
                     "(mean) of the result in mesh.replicate, and return that shard", details).fail()

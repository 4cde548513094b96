"""Checker of exercise 16: HSDP's gradient path for one flat gradient.

Cites FSDP2's foreach_reduce (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
Design notes: docs/CLASSROOM.md, "Checkers", `hsdp.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    exception_hint,
    format_tensor,
    padded_flat_grads,
    require_callable,
    run_checked,
    say_passed,
)
from fsdp_course.engines.equivalence import norm_rel_diff
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["check_hsdp_grad", "hsdp_grads"]

MESHES = ((2, 3), (2, 2), (1, 4), (3, 1))  # (replicate, shard); 2x3 first: R, S and N tell a sum apart
NUMEL = 11  # padded to 12 at S = 2, 3 and 4
SEED = 14
TOL = 1e-5

T = catalogue("hsdp")  # fsdp_course/i18n/catalogues/hsdp.yml


def hsdp_grads(replicate: int, shard: int) -> list[torch.Tensor]:
    """Every rank's unsharded flat gradient (padded to a multiple of `shard`, zeros in the padding)."""
    g = torch.Generator().manual_seed(SEED + 100 * replicate + shard)
    return padded_flat_grads([NUMEL] * (replicate * shard), shard, lambda numel: torch.randn(numel, generator=g))[0]


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
    what = T("meshes", sizes=", ".join(str(r * s) for r, s in meshes), shapes=shapes)
    say_passed(check, what, T("passed"))


def _judge(check: str, replicate: int, shard: int, grads: list[torch.Tensor], results: list[dict[str, Any]]) -> None:
    n = replicate * shard
    mean = torch.stack(grads).mean(0)
    expected = list(mean.chunk(shard))
    shard_bytes = expected[0].numel() * 4
    mesh_where = f"mesh replicate={replicate}, shard={shard}"
    for rank, res in enumerate(results):  # which collective ran in which group
        where = f"{mesh_where}, rank {rank}"
        world, rows, columns = ([op for op, _ in res[group]] for group in ("world", "shard", "replicate"))
        scatter_in = (T("world") if "reduce_scatter" in world else
                      "mesh.replicate" if "reduce_scatter" in columns else None)
        reduce_in = T("world") if "all_reduce" in world else "mesh.shard" if "all_reduce" in rows else None
        if scatter_in and reduce_in:
            swapped = T("swapped") if (scatter_in, reduce_in) == ("mesh.replicate", "mesh.shard") else ""
            CheckFailure(check, where, T("both_wrong", swapped=swapped, scatter_in=scatter_in, reduce_in=reduce_in),
                         T("order")).fail()
        if "all_reduce" in world:
            CheckFailure(check, where, T("all_reduce_world"), T("across_replicate")).fail()
        if world:
            CheckFailure(check, where, T("ran_over_world", ops=", ".join(world)), T("order_short")).fail()
        if "all_reduce" in rows:
            CheckFailure(check, where, T("all_reduce_shard"), T("across_replicate")).fail()
        if "reduce_scatter" in columns:
            CheckFailure(check, where, T("scatter_replicate"), T("scatter_in_shard")).fail()
        if rows != ["reduce_scatter"]:
            CheckFailure(check, where, T("shard_group_ran", ops=rows or T("nothing")), T("shard_reduce_scatter")).fail()
        big = [b for op, b in res["replicate"] if op == "all_reduce" and b != shard_bytes]
        if big and replicate > 1:
            CheckFailure(check, where, T("whole_gradient", got=big[0], shard=shard_bytes,
                                         factor=big[0] // shard_bytes), T("scatter_first")).fail()
    for rank, res in enumerate(results):  # what came back
        where = f"{mesh_where}, rank {rank}"
        got, want = res["out"], expected[rank % shard]
        if not isinstance(got, torch.Tensor):
            CheckFailure(check, where, T("not_tensor", kind=type(got).__name__), T("return_shard")).fail()
        if tuple(got.shape) != tuple(want.shape):
            CheckFailure(check, where, T("shape", got=tuple(got.shape), expected=tuple(want.shape),
                                         numel=grads[0].numel(), shard=shard), T("not_whole")).fail()
    for s in range(shard):  # the replicas of shard s: ranks s, S + s, ...
        column = [r * shard + s for r in range(replicate)]
        first = results[column[0]]["out"]
        for rank in column[1:]:
            if not torch.allclose(results[rank]["out"], first, rtol=TOL, atol=TOL):
                CheckFailure(check, f"{mesh_where}, ranks {column[0]} and {rank}",
                             T("replicas_disagree", first=column[0], rank=rank, s=s), T("all_reduce_replicas"),
                             [f"rank {column[0]}: {format_tensor(first, 6)}",
                              f"rank {rank}: {format_tensor(results[rank]['out'], 6)}"]).fail()
    for rank, res in enumerate(results):
        where = f"{mesh_where}, rank {rank}"
        got, want = res["out"], expected[rank % shard]
        if norm_rel_diff(got, want) <= TOL:
            continue
        details = [f"expected {format_tensor(want, 6)}", f"got      {format_tensor(got, 6)}"]
        for factor, problem in ((n, T("all_summed", n=n)), (replicate, T("replicas_summed", n=replicate)),
                                (shard, T("shards_summed", n=shard))):  # the first that explains the result
            if norm_rel_diff(got, factor * want) <= TOL:  # (a factor 1 cannot: got differs from want)
                CheckFailure(check, where, problem, T("mean_of_slices"), details).fail()
        CheckFailure(check, where, T("differs", n=n, rel=norm_rel_diff(got, want)), T("path"), details).fail()

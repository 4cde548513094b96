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
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["check_hsdp_grad", "hsdp_grads"]

MESHES = ((2, 3), (2, 2), (1, 4), (3, 1))  # (replicate, shard); 2x3 first: R, S and N tell a sum apart
NUMEL = 11  # padded to 12 at S = 2, 3 and 4
SEED = 14
TOL = 1e-5

T = catalogue("hsdp", {
    "world": ("the whole world (ctx)", "ctx（整个 world）"),
    "both_wrong": ("both collectives ran in the wrong group{swapped}: the reduce-scatter in {scatter_in}, the "
                   "all-reduce in {reduce_in}",
                   "两个集合通信都在错误的组里运行{swapped}：归约分散用的是 {scatter_in}，全归约用的是 {reduce_in}"),
    "swapped": (" (the two groups swapped)", "（两个组弄反了）"),
    "order": ("reduce-scatter in mesh.shard (the S ranks that split the gradient), then all-reduce the shard in "
              "mesh.replicate (the R ranks that hold the same shard)",
              "在 mesh.shard（切分梯度的 S 个 rank）中归约分散，再在 mesh.replicate（持有同一分片的 R 个 rank）中全归约"
              "该分片"),
    "all_reduce_world": ("all-reduce over the wrong group: it ran over the whole world (ctx), whose ranks hold "
                         "different shards",
                         "全归约用错了组：它在整个 world（ctx）上运行，而这些 rank 持有不同的分片"),
    "across_replicate": ("all-reduce the reduced shard across mesh.replicate: the ranks in this rank's column hold the "
                         "same shard",
                         "在 mesh.replicate 上对归约分散得到的分片做全归约：这个 rank 所在列的各 rank 持有同一个分片"),
    "ran_over_world": ("{ops} ran over the whole world (ctx), not in a group of the mesh",
                       "{ops} 在整个 world（ctx）上运行，而不是在 mesh 的某个组里"),
    "order_short": ("reduce-scatter in mesh.shard (the S ranks that split the gradient), then all-reduce in "
                    "mesh.replicate (the R ranks that hold the same shard)",
                    "在 mesh.shard（切分梯度的 S 个 rank）中归约分散，再在 mesh.replicate（持有同一分片的 R 个 rank）中"
                    "全归约"),
    "all_reduce_shard": ("all-reduce over the wrong group: it ran in mesh.shard, whose ranks hold different shards",
                         "全归约用错了组：它在 mesh.shard 中运行，而这些 rank 持有不同的分片"),
    "scatter_replicate": ("reduce-scatter over the wrong group: it ran in mesh.replicate",
                          "归约分散用错了组：它在 mesh.replicate 中运行"),
    "scatter_in_shard": ("reduce-scatter in mesh.shard: the gradient is split into S shards, one per rank of a row",
                         "在 mesh.shard 中归约分散：梯度被切成 S 个分片，一行中的每个 rank 一个"),
    "shard_group_ran": ("the shard group ran {ops}, expected one reduce_scatter",
                        "分片组运行的集合通信：{ops}，应为一次 reduce_scatter"),
    "nothing": ("nothing", "无"),
    "shard_reduce_scatter": ("mesh.shard.reduce_scatter(grad, op='mean') gives this rank its shard of the row's mean",
                             "mesh.shard.reduce_scatter(grad, op='mean') 给出这一行梯度平均值中属于这个 rank 的分片"),
    "whole_gradient": ("the replicate group all-reduced {got} bytes, the shard has {shard}: the whole gradient "
                       "crosses the slow link, {factor}x HSDP's inter-group bytes",
                       "副本组全归约了 {got} 字节，而分片只有 {shard} 字节：整个梯度都走了慢速链路，"
                       "是 HSDP 组间字节数的 {factor} 倍"),
    "scatter_first": ("reduce-scatter first, then all-reduce only the shard it returns (FSDP2's order)",
                      "先归约分散，再只对它返回的分片做全归约（FSDP2 的顺序）"),
    "not_tensor": ("returned {kind}, not a tensor", "返回了 {kind}，不是张量"),
    "return_shard": ("return this rank's shard (what reduce_scatter returned, after the all-reduce)",
                     "返回这个 rank 的分片（即 reduce_scatter 返回、再经过全归约的结果）"),
    "shape": ("returned shape {got}, expected {expected} (the padded gradient of {numel} elements in {shard} shards)",
              "返回的形状是 {got}，应为 {expected}（{numel} 个元素的填充后梯度，分成 {shard} 个分片）"),
    "not_whole": ("return the shard that mesh.shard.reduce_scatter gave this rank, not the whole gradient",
                  "返回 mesh.shard.reduce_scatter 给这个 rank 的分片，而不是整个梯度"),
    "replicas_disagree": ("replicas disagree: ranks {first} and {rank} hold shard {s} but different values",
                          "副本不一致：rank {first} 和 rank {rank} 持有分片 {s}，但数值不同"),
    "all_reduce_replicas": ("after the reduce-scatter, all-reduce the shard (op='mean') across mesh.replicate, so "
                            "every replica holds the mean over all R x S ranks",
                            "归约分散之后，在 mesh.replicate 上全归约该分片（op='mean'），"
                            "让每个副本都持有全部 R x S 个 rank 的平均"),
    "all_summed": ("{n}x too large (N = R x S = {n}): both collectives summed (op='sum'); use op='mean' in both",
                   "大了 {n} 倍（N = R x S = {n}）：两个集合通信都求了和（op='sum'）；两个都用 op='mean'"),
    "replicas_summed": ("{n}x too large (R = {n}): the all-reduce summed the replicas (op='sum'); use op='mean' across "
                        "mesh.replicate",
                        "大了 {n} 倍（R = {n}）：全归约对各副本求了和（op='sum'）；在 mesh.replicate 上用 op='mean'"),
    "shards_summed": ("{n}x too large (S = {n}): the reduce-scatter summed the shard group (op='sum'); use "
                      "op='mean'", "大了 {n} 倍（S = {n}）：归约分散对分片组求了和（op='sum'）；用 op='mean'"),
    "mean_of_slices": ("the gradient is the mean over all ranks' slices, as one process's mean loss gives it",
                       "梯度是所有 rank 数据切片梯度的平均，与单进程用平均损失得到的梯度相同"),
    "differs": ("the shard differs from the mean over all {n} ranks' gradients ({rel:.2e} relative)",
                "该分片与全部 {n} 个 rank 梯度的平均不同（相对误差 {rel:.2e}）"),
    "path": ("reduce-scatter (mean) in mesh.shard, then all-reduce (mean) of the result in mesh.replicate, and return "
             "that shard",
             "在 mesh.shard 中归约分散（mean），再在 mesh.replicate 中对结果全归约（mean），并返回该分片"),
    # what passed
    "meshes": ("world sizes {sizes}; meshes {shapes}", "world size 为 {sizes}；mesh 为 {shapes}"),
    "passed": ("  reduce-scatter (mean) in the shard group, all-reduce (mean) of the shard in the replicate group: "
               "every rank holds its shard of the mean over all ranks, and the replicas of a shard agree",
               "  在分片组中归约分散（mean），再在副本组中对分片全归约（mean）：每个 rank 都持有所有 rank 平均值中"
               "属于自己的分片，且同一分片的各个副本一致"),
})


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
    what = T("meshes", sizes=", ".join(str(r * s) for r, s in meshes), shapes=shapes)
    say(COMMON("passed", check=check, what=what), T("passed"))


def _judge(check: str, replicate: int, shard: int, grads: list[torch.Tensor], results: list[dict[str, Any]]) -> None:
    n = replicate * shard
    mean = torch.stack(grads).mean(0)
    expected = list(mean.chunk(shard))
    shard_bytes = expected[0].numel() * 4
    mesh_where = f"mesh replicate={replicate}, shard={shard}"
    for rank, res in enumerate(results):  # which collective ran in which group
        where = f"{mesh_where}, rank {rank}"
        world, rows, columns = res["world"], res["shard"], res["replicate"]
        scatter_in = (T("world") if any(op == "reduce_scatter" for op, _ in world) else
                      "mesh.replicate" if any(op == "reduce_scatter" for op, _ in columns) else None)
        reduce_in = (T("world") if any(op == "all_reduce" for op, _ in world) else
                     "mesh.shard" if any(op == "all_reduce" for op, _ in rows) else None)
        if scatter_in and reduce_in:
            swapped = T("swapped") if (scatter_in, reduce_in) == ("mesh.replicate", "mesh.shard") else ""
            CheckFailure(check, where, T("both_wrong", swapped=swapped, scatter_in=scatter_in, reduce_in=reduce_in),
                         T("order")).fail()
        if any(op == "all_reduce" for op, _ in world):
            CheckFailure(check, where, T("all_reduce_world"), T("across_replicate")).fail()
        if world:
            ops = ", ".join(op for op, _ in world)
            CheckFailure(check, where, T("ran_over_world", ops=ops), T("order_short")).fail()
        if any(op == "all_reduce" for op, _ in rows):
            CheckFailure(check, where, T("all_reduce_shard"), T("across_replicate")).fail()
        if any(op == "reduce_scatter" for op, _ in columns):
            CheckFailure(check, where, T("scatter_replicate"), T("scatter_in_shard")).fail()
        if [op for op, _ in rows] != ["reduce_scatter"]:
            ops = [op for op, _ in rows] or T("nothing")
            CheckFailure(check, where, T("shard_group_ran", ops=ops), T("shard_reduce_scatter")).fail()
        big = [b for op, b in columns if op == "all_reduce" and b != shard_bytes]
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
        if _rel(got, want) <= TOL:
            continue
        details = [f"expected {format_tensor(want, 6)}", f"got      {format_tensor(got, 6)}"]
        factors = {n: T("all_summed", n=n)}  # the first factor that explains the result names the mistake
        factors.setdefault(replicate, T("replicas_summed", n=replicate))
        factors.setdefault(shard, T("shards_summed", n=shard))
        for factor, problem in factors.items():
            if factor > 1 and _rel(got, factor * want) <= TOL:
                CheckFailure(check, where, problem, T("mean_of_slices"), details).fail()
        CheckFailure(check, where, T("differs", n=n, rel=_rel(got, want)), T("path"), details).fail()

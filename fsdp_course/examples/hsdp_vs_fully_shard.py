"""Lesson 16: the course's HSDP and `fully_shard` on a 2-D mesh, trained side by side in 4 processes.

`torchrun --nproc-per-node 4 -m fsdp_course.examples.hsdp_vs_fully_shard REPORTS`: each rank writes
REPORTS/rank{r}.json (the mesh and groups of both, one parameter's placement, the losses of 4 AdamW steps)."""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_course.engines.equivalence import digits_batches, local_slice
from fsdp_course.fsdp import FSDP
from fsdp_course.models import MLP
from fsdp_course.runtime.context import RankContext

R, S = 2, 2  # replicate x shard = the 4 processes


def train(model: nn.Module, ctx: RankContext, batches: list) -> list[float]:
    """4 AdamW steps, each rank on its slice of the global batch; the loss of each step on this rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        x, y = local_slice(batch, ctx.rank, ctx.world_size)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(reports: str) -> None:
    torch.set_num_threads(1)
    ctx = RankContext.from_env(backend="gloo", timeout=60)          # RANK, WORLD_SIZE, MASTER_*: from torchrun
    torch.manual_seed(0)
    base = MLP([64, 33, 10])                                        # the same values in every process
    batches = digits_batches("vectors", 4, 24)

    mesh = ctx.mesh(replicate=R, shard=S)                           # the course's: new_group rows, then columns
    ours = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, mesh=mesh)
    report: dict[str, Any] = {"ours": train(ours, ctx, batches),
                              "our_groups": [mesh.shard.ledger.ranks, mesh.replicate.ledger.ranks]}

    device_mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer, mesh=device_mesh)                        # a 2-D mesh: HSDP
    fully_shard(model, mesh=device_mesh)
    w = model.layers[0].weight
    rows = w.to_local().shape[0]
    block = ctx.rank % S                                            # this rank's place in its shard group
    report.update(
        mesh=device_mesh.mesh.tolist(),
        torch_groups=[dist.get_process_group_ranks(device_mesh.get_group(d)) for d in ("shard", "replicate")],
        dtensor=isinstance(w, DTensor), placements=str(w.placements), full_shape=list(w.shape), local_rows=rows,
        local_is_row_block=torch.equal(w.to_local(), base.layers[0].weight.detach()[block * 17:block * 17 + rows]),
        torch=train(model, ctx, batches))
    with open(os.path.join(reports, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(report, f)
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1])

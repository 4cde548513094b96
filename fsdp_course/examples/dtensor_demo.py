"""Lesson 11: what `fully_shard` makes of a parameter (a DTensor holding this rank's rows), seen from each rank.

`torchrun --nproc-per-node 2 -m fsdp_course.examples.dtensor_demo REPORTS`: each rank writes REPORTS/rank{r}.txt."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_course.fsdp.meta_init import init_weights
from fsdp_course.models import TransformerClassifier, TransformerConfig


def main(reports: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # RANK, WORLD_SIZE, MASTER_*: from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))                        # a 1-D mesh: the data-parallel ranks
    model = init_weights(TransformerClassifier(TransformerConfig.small()), 0)  # the same values on every rank
    full = model.encoder.layers[0].linear1.weight.detach().clone()  # kept to compare with the shard
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)                               # one unit per layer
    fully_shard(model, mesh=mesh)                                   # the root: embeddings, positions, final norm, head

    layer0 = model.encoder.layers[0]
    w = layer0.linear1.weight
    local = w.to_local()                                            # the rows this rank stores
    rows = local.shape[0]
    mine = torch.equal(local, full[rank * rows:(rank + 1) * rows])
    group = layer0._get_fsdp_state()._fsdp_param_group              # private: only to name the classes
    lines = [f"rank {rank} of {world}",
             f"  class of the layer    {type(layer0).__name__}",
             f"  linear1.weight        {type(w).__name__}, nn.Parameter: {isinstance(w, nn.Parameter)}",
             f"  placements            {w.placements} on mesh {w.device_mesh.mesh.tolist()}",
             f"  global shape          {tuple(w.shape)}, local shard {tuple(local.shape)}",
             f"  the shard is rows {rank * rows}..{rank * rows + rows - 1} of the full weight: {mine}",
             f"  layer 0's unit        {type(group).__name__} of {len(group.fsdp_params)} "
             f"{type(group.fsdp_params[0]).__name__}s"]
    layer0.unshard()                                                # all-gather this unit by hand
    w = layer0.linear1.weight
    lines.append(f"  after unshard()       {type(w).__name__} {tuple(w.shape)}, equal to the full weight: "
                 f"{torch.equal(w.detach(), full)}")
    layer0.reshard()                                                # and free it again
    lines.append(f"  after reshard()       {type(layer0.linear1.weight).__name__}")
    held = sum(p.to_local().numel() for p in model.parameters())
    lines.append(f"  elements stored       {held:,} of {sum(p.numel() for p in model.parameters()):,}, "
                 f"embedding.weight {tuple(model.embedding.weight.to_local().shape)} "
                 f"of {tuple(model.embedding.weight.shape)}")
    model(torch.zeros(2, 8, dtype=torch.long))                      # one forward, no backward
    lines.append(f"  after a forward       layer 0: {type(layer0.linear1.weight).__name__}, "
                 f"root's fc.weight: {type(model.fc.weight).__name__}")
    with open(os.path.join(reports, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Lesson 10, no padding: the article's shardParameters() and allGatherToModel(), three thread-ranks over raw Gloo.

`python -m fsdp_course.examples.no_padding TOTAL WORLD`: Gloo aborts the process when the shards are unequal."""

from __future__ import annotations

import sys

import torch
from torch._C._distributed_c10d import AllgatherOptions

from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.simulate import run_ranks


def all_gather_to_model(ctx: RankContext, total: int) -> torch.Tensor:
    shard_size = (total + ctx.world_size - 1) // ctx.world_size            # shardParameters()
    start = ctx.rank * shard_size
    shard = torch.zeros(min(start + shard_size, total) - start)            # shardedParam: the last one is short
    gathered = [torch.empty(shard.numel()) for _ in range(ctx.world_size)]  # allGatherToModel(): sized by its own
    ctx.group.allgather([gathered], [shard], AllgatherOptions()).wait()    # raw Gloo: no referee in between
    return torch.cat(gathered)[:total]


def main(total: str, world: str) -> None:
    run_ranks(lambda ctx: all_gather_to_model(ctx, int(total)), int(world), timeout=10)
    print("all-gather finished")


if __name__ == "__main__":
    main(*sys.argv[1:])

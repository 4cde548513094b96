"""Lesson 10, pitfall 5.5: join the world a launcher describes and report it, one file per rank.

`python -m fsdp_course.examples.peers REPORTS` (under torchrun, or with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import os
import sys

import torch

from fsdp_course.runtime.context import RankContext


def main(reports: str) -> None:
    ctx = RankContext.from_env(timeout=30)   # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; refuses without them
    t = torch.tensor([ctx.rank + 1.0])
    ctx.all_reduce(t)                        # the sum of (rank + 1) over the world
    with open(os.path.join(reports, f"rank{ctx.rank}.txt"), "w") as f:
        f.write(f"rank {ctx.rank} of {ctx.world_size}: {ctx.world_size - 1} peer rank(s), all-reduced {t.item():g}")
    ctx.barrier()                            # leave together: an early exit can abort a peer still talking
    ctx.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

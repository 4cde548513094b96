"""A tiny rank function run two ways by tests/test_torchrun.py: in threads and under torchrun."""

import torch

from fsdp_course import RankContext


def hello(ctx: RankContext) -> list[float]:
    t = torch.arange(4, dtype=torch.float32) + ctx.rank
    ctx.all_reduce(t, op="sum")
    gathered = ctx.all_gather(torch.tensor([float(ctx.rank)]))
    shard = ctx.reduce_scatter(torch.ones(2 * ctx.world_size), op="mean")
    return t.tolist() + gathered.tolist() + shard.tolist()


if __name__ == "__main__":
    ctx = RankContext.from_env(timeout=30)
    try:
        print(f"RESULT rank={ctx.rank} world={ctx.world_size} {hello(ctx)} ledger={len(ctx.ledger)}", flush=True)
        ctx.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
    finally:
        ctx.close()

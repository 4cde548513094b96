"""The ledger records every collective with the ring cost model's bytes."""

import pytest
import torch

from fsdp_course import run_ranks
from fsdp_course.runtime.ledger import ring_bytes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ledger_bytes_follow_the_ring_formulas(world_size: int) -> None:
    n = world_size

    def fn(ctx):
        ctx.ledger.mark("step 1")
        ctx.all_reduce(torch.ones(6))  # 24 bytes
        ctx.all_gather(torch.ones(3, dtype=torch.float64))  # output 3n float64
        ctx.reduce_scatter(torch.ones(4 * n, dtype=torch.float16))  # input 8n bytes
        ctx.ledger.mark("step 2")
        ctx.broadcast(torch.ones(5), src=0)  # 20 bytes
        ctx.barrier()
        return ctx.ledger

    for rank, ledger in enumerate(run_ranks(fn, n)):
        ops = [r.op for r in ledger]
        assert ops == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"]
        assert [r.seq for r in ledger] == [1, 2, 3, 4, 5]
        ar, ag, rs, bc, bar = ledger.records
        assert ar.payload_bytes == 24 and ar.sent_bytes == pytest.approx(2 * (n - 1) / n * 24)
        assert ag.payload_bytes == 24 * n and ag.recv_bytes == pytest.approx((n - 1) * 24)
        assert ag.dtype == "float64" and ag.shapes == ((3,),)
        assert rs.payload_bytes == 8 * n and rs.sent_bytes == pytest.approx((n - 1) * 8)
        assert bc.recv_bytes == (0 if rank == 0 or n == 1 else 20)
        assert bc.sent_bytes == (0 if rank == n - 1 else 20)
        assert bar.sent_bytes == 0
        assert ledger.total(label="step 2")[0] == bc.sent_bytes
        assert ledger.summary()["all_reduce"]["calls"] == 1
        assert "ring cost model" in ledger.table()


def test_broadcast_from_another_root_sums_to_n_minus_1_payloads() -> None:
    sent = [ring_bytes("broadcast", 100, 4, rank, src=2)[0] for rank in range(4)]
    received = [ring_bytes("broadcast", 100, 4, rank, src=2)[1] for rank in range(4)]
    assert sum(sent) == sum(received) == 300
    assert received[2] == 0 and sent[1] == 0


def test_ring_bytes_rejects_unknown_ops() -> None:
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("all_to_all", 10, 2)

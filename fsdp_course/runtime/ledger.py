"""The traffic ledger: every collective a rank issues, with its bytes under the ring cost model.

Each rank keeps its own `Ledger` (ranks are threads, so nothing here is shared). A `Record` says
which collective ran, in what order, on which dtype and shapes, and how many bytes this rank sends
and receives *under the textbook ring algorithm*:

    all_gather, reduce_scatter:  sent = received = (N - 1) / N * payload
    all_reduce:                  sent = received = 2 (N - 1) / N * payload
    broadcast (pipelined chain): every rank but the root receives the payload,
                                 every rank but the last one in the chain sends it
    barrier:                     nothing

where `payload` is the size in bytes of the *full* (unsharded) tensor: the output of an all-gather,
the input of a reduce-scatter. These are the formulas behind the ZeRO paper's communication
analysis (Rajbhandari et al., arXiv:1910.02054, section 7): DDP moves 2Ψ per step, FSDP 3Ψ.

This is the logical cost model, counted at the call. Gloo's own algorithms may move more: its
reduce_scatter is built from all-reduces, for instance. The ledger never claims to have measured
the wire.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Ledger", "Record", "ring_bytes", "traffic_formula"]


def ring_bytes(op: str, payload: int, world_size: int, rank: int = 0, src: int = 0) -> tuple[float, float]:
    """Bytes (sent, received) by `rank` for one collective of `payload` bytes under the ring model."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {n}")
    if n == 1 or op == "barrier":
        return 0.0, 0.0
    if op in ("all_gather", "reduce_scatter"):
        moved = (n - 1) / n * payload
        return moved, moved
    if op == "all_reduce":
        moved = 2 * (n - 1) / n * payload
        return moved, moved
    if op == "broadcast":
        last = (src - 1) % n  # the chain runs src, src+1, ..., src-1
        sent = 0.0 if rank == last else float(payload)
        received = 0.0 if rank == src else float(payload)
        return sent, received
    raise ValueError(f"unknown collective {op!r}")


def traffic_formula(psi_bytes: float, world_size: int) -> dict[str, float]:
    """Ring-model bytes sent per rank per step (ZeRO, arXiv:1910.02054, section 7), `psi_bytes` = the payload in
    bytes (Psi parameters x bytes per element): DDP one all-reduce, 2 Psi (N-1)/N elements; FSDP / ZeRO-3 all-gather
    twice and reduce-scatter once, 3 Psi (N-1)/N elements."""
    if world_size < 1 or psi_bytes < 0:
        raise ValueError(f"need world_size >= 1 and psi_bytes >= 0, got {world_size}, {psi_bytes}")
    f = (world_size - 1) / world_size * psi_bytes
    return {"ddp": 2 * f, "fsdp": 3 * f}


@dataclass(frozen=True)
class Record:
    """One collective as one rank saw it."""

    op: str  # "broadcast" | "all_reduce" | "all_gather" | "reduce_scatter" | "barrier"
    seq: int  # 1, 2, ... in the order this rank issued its collectives
    dtype: str  # e.g. "float32"
    shapes: tuple[tuple[int, ...], ...]  # shapes of the input tensors
    payload_bytes: int  # bytes of the full (unsharded) tensor
    sent_bytes: float  # ring model, this rank
    recv_bytes: float  # ring model, this rank
    label: str = ""  # the phase set by Ledger.mark(), e.g. "step 3"
    start: float | None = None  # time.perf_counter() when every rank had joined and the call started
    end: float | None = None  # when it completed (an async_op collective: when Gloo finished it, not when waited)


class Ledger:
    """The collectives one rank has issued, in order."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.records: list[Record] = []
        self.label = ""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def mark(self, label: str) -> None:
        """Start a named phase ("step 1", "forward", ...): later records carry this label."""
        self.label = str(label)

    def clear(self) -> None:
        """Forget every record (the sequence numbers of the collectives go on)."""
        self.records.clear()

    def add(self, op: str, seq: int, dtype: str, shapes: tuple[tuple[int, ...], ...],
            payload_bytes: int, src: int = 0, *, start: float | None = None, end: float | None = None) -> Record:
        """Record one collective and return the record (`start`, `end`: its perf_counter times, when known)."""
        sent, received = ring_bytes(op, payload_bytes, self.world_size, self.rank, src)
        record = Record(op, seq, dtype, shapes, payload_bytes, sent, received, self.label, start, end)
        self.records.append(record)
        return record

    def select(self, op: str | None = None, label: str | None = None) -> list[Record]:
        """The records of one operation and/or one phase."""
        return [r for r in self.records
                if (op is None or r.op == op) and (label is None or r.label == label)]

    def total(self, op: str | None = None, label: str | None = None) -> tuple[float, float]:
        """Total (sent, received) bytes, optionally for one operation and/or one phase."""
        chosen = self.select(op, label)
        return sum(r.sent_bytes for r in chosen), sum(r.recv_bytes for r in chosen)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per operation: number of calls, payload bytes, bytes sent and received."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            row = out.setdefault(r.op, {"calls": 0, "payload": 0, "sent": 0.0, "received": 0.0})
            row["calls"] += 1
            row["payload"] += r.payload_bytes
            row["sent"] += r.sent_bytes
            row["received"] += r.recv_bytes
        return out

    def table(self) -> str:
        """A fixed-width table of the records, for printing in a lesson."""
        head = f"{'#':>3}  {'op':<14} {'dtype':<8} {'shapes':<18} {'payload B':>10} {'sent B':>10} {'recv B':>10}"
        lines = [f"ledger of rank {self.rank} of {self.world_size} (ring cost model)", head]
        for r in self.records:
            shapes = ",".join("x".join(map(str, s)) or "()" for s in r.shapes)
            lines.append(f"{r.seq:>3}  {r.op:<14} {r.dtype:<8} {shapes:<18} {r.payload_bytes:>10} "
                         f"{r.sent_bytes:>10.1f} {r.recv_bytes:>10.1f}")
        sent, received = self.total()
        lines.append(f"{'':>3}  {'total':<14} {'':<8} {'':<18} {'':>10} {sent:>10.1f} {received:>10.1f}")
        return "\n".join(lines)

"""A 2-D mesh of ranks for HSDP (hybrid sharded data parallel): shard inside a group, replicate across groups.

`ctx.mesh(replicate=R, shard=S)` (context.py) lays the world's N = R x S ranks out as PyTorch's
`init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))` does (its mesh holds the ranks
0 .. N-1 in row-major order, as `arange(N).view(R, S)`; tests/test_hsdp.py compares them): rank = r * S + s, so

  - the *shard group* of a rank is its row, ranks r*S .. r*S + S-1: within it FSDP all-gathers the
    parameters and reduce-scatters the gradients ("intra-group" traffic: on a real cluster, one node's
    fast links);
  - the *replicate group* is its column, ranks s, S + s, ..., (R-1)*S + s: the ranks that hold the same shard;
    across it the reduced shard is all-reduced ("inter-group": across nodes, the slower network).

This is FSDP2's HSDP (`fully_shard(model, mesh=mesh_2d)`: placements (Replicate(), Shard(0)), reduce-scatter in
the shard group, then all-reduce across the replicate group; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
and the PyTorch FSDP paper's hybrid sharding (arXiv:2304.11277, section 3.2.2). Each group's collectives go
through its own `RankContext`, with its own ledger (`GroupLedger`, labelled "intra-group" or "inter-group") and,
in a simulated world, its own referee (monitor.py's `child`).

Per rank and step, under the ring model (ledger.py), with Psi the bytes of the (padded) flat parameters:
  intra-group  3 Psi (S-1)/S           two all-gathers and one reduce-scatter among S ranks
  inter-group  2 (Psi/S) (R-1)/R       one all-reduce of the reduced shard (Psi/S bytes) among R ranks
(`hsdp_traffic_formula`). FSDP over all N ranks moves 3 Psi (N-1)/N, on rings that cross the slow links once the
world spans several nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_course.runtime.ledger import Ledger

__all__ = ["GroupLedger", "Mesh", "check_mesh_shape", "hsdp_traffic_formula", "mesh_grid", "mesh_groups"]

INTRA, INTER = "intra-group", "inter-group"


def _factorizations(n: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def check_mesh_shape(replicate: object, shard: object, world_size: int) -> tuple[int, int]:
    """(replicate, shard) as ints, or a ValueError (TypeError for non-ints) that says what to pass."""
    pairs = ", ".join(f"replicate={r}, shard={s}" for r, s in _factorizations(world_size))
    for name, value in (("replicate", replicate), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"mesh: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"mesh: {name} must be a positive number of ranks, got {value}; "
                             f"for a world of {world_size} pass one of: {pairs}")
    if replicate * shard != world_size:  # type: ignore[operator]
        raise ValueError(f"mesh: replicate x shard must equal the world size {world_size}, got {replicate} x {shard}"
                         f" = {replicate * shard}; pass one of: {pairs}")  # type: ignore[operator]
    return int(replicate), int(shard)  # type: ignore[call-overload]


def mesh_grid(replicate: int, shard: int) -> list[list[int]]:
    """The ranks laid out as init_device_mesh's `arange(N).view(R, S)`: row r holds ranks r*S .. r*S + S-1."""
    return [[r * shard + s for s in range(shard)] for r in range(replicate)]


def mesh_groups(replicate: int, shard: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups): the rows of the grid, and its columns."""
    grid = mesh_grid(replicate, shard)
    return grid, [[row[s] for row in grid] for s in range(shard)]


def hsdp_traffic_formula(psi_bytes: float, replicate: int, shard: int) -> dict[str, float]:
    """Ring-model bytes each rank sends per HSDP step: {"intra": 3 Psi (S-1)/S, "inter": 2 (Psi/S) (R-1)/R}, with
    `psi_bytes` the bytes of the flat parameters (padded to a multiple of S). R = 1 is FSDP, S = 1 is DDP."""
    if replicate < 1 or shard < 1 or psi_bytes < 0:
        raise ValueError(f"need replicate, shard >= 1 and psi_bytes >= 0, got {replicate}, {shard}, {psi_bytes}")
    return {"intra": 3 * psi_bytes * (shard - 1) / shard,
            "inter": 2 * (psi_bytes / shard) * (replicate - 1) / replicate}


class GroupLedger(Ledger):
    """The ledger of one subgroup's collectives; `kind` says which: "intra-group" (shard) or "inter-group"
    (replicate). Ranks and world size are the group's own (the ring runs inside the group)."""

    def __init__(self, rank: int, world_size: int, kind: str, ranks: list[int]) -> None:
        super().__init__(rank, world_size)
        self.kind = kind
        self.ranks = list(ranks)  # world ranks of the group's members

    def table(self) -> str:
        head, _, rest = super().table().partition("\n")
        return f"{head}, {self.kind}: world ranks {self.ranks}\n{rest}"


@dataclass
class Mesh:
    """One rank's place in an (R, S) mesh: `shard` and `replicate` are RankContexts over the real subgroups
    (their `rank` and `world_size` are the group's own), `world` the context it was made from."""

    world: Any  # the RankContext of the whole world
    replicate_size: int
    shard_size: int
    shard: Any  # RankContext over this rank's shard group (its row)
    replicate: Any  # RankContext over this rank's replicate group (its column)

    @property
    def shape(self) -> tuple[int, int]:
        return self.replicate_size, self.shard_size

    @property
    def coordinate(self) -> tuple[int, int]:
        """(r, s): this rank's row (which replica) and column (which shard)."""
        return divmod(self.world.rank, self.shard_size)

    def grid(self) -> list[list[int]]:
        return mesh_grid(self.replicate_size, self.shard_size)

    def describe(self) -> str:
        """The grid as text: rows are shard groups, columns replicate groups."""
        width = len(str(self.world.world_size - 1))
        lines = [f"mesh (replicate={self.replicate_size}, shard={self.shard_size}): "
                 "rows = shard groups (intra), columns = replicate groups (inter)"]
        for r, row in enumerate(self.grid()):
            lines.append(f"  replica {r}: " + "  ".join(f"rank {x:>{width}}" for x in row))
        return "\n".join(lines)

    def traffic(self, label: str | None = None) -> dict[str, float]:
        """Bytes this rank sent under the ring model, {"intra": shard group's, "inter": replicate group's}
        (optionally for one ledger phase `label`)."""
        return {"intra": self.shard.ledger.total(label=label)[0], "inter": self.replicate.ledger.total(label=label)[0]}

    def mark(self, label: str) -> None:
        """Start a named phase in both groups' ledgers (and the world's)."""
        for ctx in (self.world, self.shard, self.replicate):
            ctx.ledger.mark(label)

    def clear(self) -> None:
        """Forget the records of both groups' ledgers."""
        self.shard.ledger.clear()
        self.replicate.ledger.clear()

    def __repr__(self) -> str:
        r, s = self.coordinate
        return (f"Mesh(replicate={self.replicate_size}, shard={self.shard_size}, rank {self.world.rank} at ({r}, {s}):"
                f" shard group {self.shard.ledger.ranks}, replicate group {self.replicate.ledger.ranks})")

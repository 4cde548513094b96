"""The rank context: who this rank is, its process group, its RNG, its ledger and its collectives.

Code written for the course takes a `RankContext` and never a global default group, so the same
function runs in two places unchanged:

- in a notebook, where `run_ranks` builds one context per thread, each with its own
  `ProcessGroupGloo` over one `FileStore` (see simulate.py);
- in a real process started by `torchrun`, where `RankContext.from_env()` reads RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT and joins the real world (Gloo on CPU, NCCL when a GPU is present).

The article builds the same pieces by hand in Java: `new FileStore(path, worldSize)` and
`new ProcessGroupGloo(store, rank, worldSize, options)`.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdp_course.runtime import collectives
from fsdp_course.runtime.ledger import Ledger
from fsdp_course.runtime.monitor import Signature, WorldMonitor

__all__ = ["RankContext", "gloo_group"]


CONNECT_TIMEOUT = 2.0  # seconds the ranks get to connect, however short the collectives' timeout


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: float) -> dist.ProcessGroup:
    """A real `ProcessGroupGloo` on the loopback device whose collectives time out after `timeout` seconds.

    Gloo uses one timeout for connecting the ranks and for every collective. Connecting takes tens of
    milliseconds (more on a loaded machine), and a connection that times out can crash the process (seen here
    with 3 ranks and 1 ms), so the group connects with at least `CONNECT_TIMEOUT` and then sets `timeout` as the
    default of its collectives (`_set_default_timeout`). Gloo's raw `send`/`recv` works still wait up to the connect
    timeout unless `wait()` is given one (`collectives.isend`/`irecv` pass `timeout`); at 2 s that stays inside the
    time `run_ranks` gives the other ranks once one has ended (1.5 * timeout + 2 s).
    """
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=max(timeout, CONNECT_TIMEOUT))
    group = dist.ProcessGroupGloo(store, rank, world_size, opts)
    if timeout < CONNECT_TIMEOUT:
        group._set_default_timeout(datetime.timedelta(seconds=timeout))
    return group


class RankContext:
    """One rank's view of the world. Collectives are methods, so `ctx.all_reduce(t)` reads naturally."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup, *,
                 device: torch.device | None = None, seed: int = 0,
                 monitor: WorldMonitor | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        # Threads share the global RNG: each rank draws its own data from its own generator.
        self.generator = torch.Generator().manual_seed(1000 * seed + rank)
        self.ledger = Ledger(rank, world_size)
        self.simulated = monitor is not None
        self._monitor = monitor
        self._seq = 0
        self._started: dict[int, float] = {}  # seq -> perf_counter when the collective started

    def __repr__(self) -> str:
        kind = "simulated thread" if self.simulated else "process"
        return f"RankContext(rank={self.rank}, world_size={self.world_size}, {kind}, device={self.device})"

    # -- the bookkeeping around every collective -----------------------------------------------
    @property
    def monitor(self) -> WorldMonitor | None:
        """The referee of a simulated world (None in a real process)."""
        return self._monitor

    def begin_collective(self, op: str, tensors: list[torch.Tensor], extra: str = "") -> Signature:
        """Before a collective: take the next sequence number; a simulated world's referee compares the call
        (operation, shapes, dtype, `extra` such as the reduce op) with the other ranks' and raises on a mismatch."""
        self._seq += 1
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
        sig = Signature(op, self._seq, tuple(tuple(t.shape) for t in tensors), dtype, extra)
        if self._monitor is not None:
            self._monitor.check(self.rank, sig)
        self._started[sig.seq] = time.perf_counter()
        return sig

    def end_collective(self, sig: Signature, payload_bytes: int, src: int = 0, *, end: float | None = None) -> None:
        """After a collective: record it in the ledger (its logical payload, its start and `end` time, default now)
        and tell the referee it is done."""
        start = self._started.pop(sig.seq, None)
        self.ledger.add(sig.op, sig.seq, sig.dtype, sig.shapes, payload_bytes, src, start=start,
                        end=time.perf_counter() if end is None else end)
        if self._monitor is not None:
            self._monitor.collective_done(self.rank, sig)

    # -- collectives (see collectives.py) ------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return collectives.broadcast(self, tensor, src)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return collectives.all_reduce(self, tensor, op)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, *, async_op: bool = False) -> Any:
        return collectives.all_gather(self, tensor, out, async_op=async_op)

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None, *,
                       async_op: bool = False) -> Any:
        return collectives.reduce_scatter(self, tensor, op, out, async_op=async_op)

    def barrier(self) -> None:
        collectives.barrier(self)

    # -- point to point (see collectives.py): the referee names a deadlock when Gloo times out ---------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        collectives.send(self, tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        return collectives.recv(self, tensor, src, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> collectives.P2PWork:
        return collectives.isend(self, tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> collectives.P2PWork:
        return collectives.irecv(self, tensor, src, tag)

    # -- a real process under torchrun ---------------------------------------------------------
    @classmethod
    def from_env(cls, backend: str | None = None, *, timeout: float = 60.0, seed: int = 0) -> RankContext:
        """Join the world a launcher such as `torchrun` described in the environment.

        Raises a RuntimeError that says how to launch when RANK / WORLD_SIZE are missing: run
        without them, a Gloo group would wait for peers that were never started (the article's
        "Rank 0 is connected to 0 peer ranks").
        """
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: this script joins a process group and must be started by a "
                "launcher, e.g. `torchrun --nproc-per-node 2 script.py` (or run_ranks in a notebook)")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size < 1 or not 0 <= rank < world_size:
            raise RuntimeError(f"RANK={rank} is not a rank of WORLD_SIZE={world_size}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = torch.device("cpu")
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        group = dist.distributed_c10d._get_default_group()
        return cls(rank, world_size, group, device=device, seed=seed)

    def close(self) -> None:
        """Leave the world joined by `from_env` (a no-op for simulated ranks: run_ranks cleans up)."""
        if not self.simulated and dist.is_initialized():
            dist.destroy_process_group()

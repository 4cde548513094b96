"""The rank context: who this rank is, its process group, its RNG, its ledger and its collectives.

Code written for the course takes a `RankContext` and never a global default group, so the same
function runs in two places unchanged:

- in a notebook, where `run_ranks` builds one context per thread, each with its own
  `ProcessGroupGloo` over one `FileStore` (see simulate.py);
- in a real process started by `torchrun`, where `RankContext.from_env()` reads RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT and joins the real world (Gloo on CPU, NCCL when a GPU is present).

The article builds the same pieces by hand in Java: `new FileStore(path, worldSize)` and
`new ProcessGroupGloo(store, rank, worldSize, options)`.

`ctx.mesh(replicate=R, shard=S)` splits the world into an (R, S) mesh for HSDP (mesh.py): two more real groups per
rank, each with its own context. Simulated: `ProcessGroupGloo`s over `PrefixStore`s of the run's store, as
`torch.distributed.new_group` builds them; under torchrun: `new_group`.
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
from fsdp_course.runtime.mesh import INTER, INTRA, GroupLedger, Mesh, check_mesh_shape, mesh_groups
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


def article_gloo_group(store: dist.Store, rank: int, world_size: int, *, seconds: float,
                       hostname: str = "127.0.0.1") -> dist.ProcessGroup:
    """A `ProcessGroupGloo` built as the article's Java constructor builds it: one device on `hostname`
    (`createDeviceForHostname`) and one timeout (`options.timeout`), which Gloo uses to connect and for every
    collective. Lesson 10 and its programs; `gloo_group` above is what the course itself uses."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = datetime.timedelta(seconds=seconds)
    return dist.ProcessGroupGloo(store, rank, world_size, options)


class RankContext:
    """One rank's view of the world. Collectives are methods, so `ctx.all_reduce(t)` reads naturally."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup, *,
                 device: torch.device | None = None, seed: int = 0,
                 monitor: WorldMonitor | None = None, store: dist.Store | None = None) -> None:
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
        self.store = store  # the run's store (simulated worlds): subgroups are built on prefixes of it
        self.parent: RankContext | None = None  # the world's context, for a subgroup's (mesh)
        self.subgroups: list[dist.ProcessGroup] = []  # groups made by mesh(): run_ranks shuts them down
        self._meshes = 0  # mesh() calls so far: each gets fresh store prefixes

    def __repr__(self) -> str:
        kind = "simulated thread" if self.simulated else "process"
        if isinstance(self.ledger, GroupLedger):
            kind += f", {self.ledger.kind} over world ranks {self.ledger.ranks}"
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
        """Copy rank `src`'s `tensor` into `tensor` on every rank. In place: every rank passes a tensor of the same
        shape and dtype, and rank `src`'s values overwrite the others'. Returns `tensor`. The ledger records the
        tensor's bytes as the payload (the chain: every rank but `src` receives it once)."""
        return collectives.broadcast(self, tensor, src)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` elementwise over all ranks and leave the result on every rank. In place: `tensor` is
        overwritten (clone it first to keep your input); returns it. `op`: "sum", "mean" (floating point only) or
        "max". The ledger records the tensor's bytes as the payload: 2 (N-1)/N of it sent per rank (the ring)."""
        return collectives.all_reduce(self, tensor, op)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, *, async_op: bool = False) -> Any:
        """Concatenate every rank's `tensor` along dim 0, in rank order. Not in place: `tensor` is unchanged and a
        new tensor of shape (N * tensor.shape[0], ...) is returned, or `out` (of that shape and dtype) is filled and
        returned. Every rank's `tensor` must have the same shape. `async_op=True` returns a `CollectiveWork` whose
        `wait()` returns the gathered tensor. The ledger records the output's bytes as the payload: (N-1)/N of it
        sent per rank."""
        return collectives.all_gather(self, tensor, out, async_op=async_op)

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None, *,
                       async_op: bool = False) -> Any:
        """Reduce `tensor` over all ranks ("sum" or "mean"), split the result into N equal chunks along dim 0, and
        return this rank's chunk (rank r gets chunk r). Not in place: `tensor` is unchanged; a new tensor of shape
        (tensor.shape[0] // N, ...) is returned, or `out` is filled and returned. `tensor.shape[0]` must divide by N
        (pad first). `async_op=True` returns a `CollectiveWork` whose `wait()` returns the chunk. The ledger records
        the input's bytes as the payload: (N-1)/N of it sent per rank."""
        return collectives.reduce_scatter(self, tensor, op, out, async_op=async_op)

    def barrier(self) -> None:
        """Wait until every rank has reached this point. The ledger records it with no bytes."""
        collectives.barrier(self)

    # -- point to point (see collectives.py): the referee names a deadlock when Gloo times out ---------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send `tensor` to rank `dst` and block until rank `dst` has received it (so a ring where every rank sends
        first deadlocks: post the receive first, or use isend/irecv). `tensor` is unchanged. Not in the ledger."""
        collectives.send(self, tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive from rank `src` into `tensor`, overwriting it (add it to a sum yourself); blocks until it arrives;
        returns `tensor`. Shape, dtype and tag must match the sender's. Not in the ledger."""
        return collectives.recv(self, tensor, src, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> collectives.P2PWork:
        """Start sending `tensor` to rank `dst` and return at once; call `.wait()` on the result before changing or
        reusing `tensor`. Not in the ledger."""
        return collectives.isend(self, tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> collectives.P2PWork:
        """Start receiving from rank `src` into `tensor` and return at once; `tensor` holds the values (overwritten)
        after `.wait()` on the result. Not in the ledger."""
        return collectives.irecv(self, tensor, src, tag)

    # -- a 2-D mesh for HSDP (mesh.py) ---------------------------------------------------------
    def _agree_on_mesh(self, replicate: object, shard: object) -> None:
        """Every rank must ask for the same (replicate, shard): compared first (one all-gather of two ints on the
        raw group, outside the ledger), so a rank that asked for another mesh fails at once on every rank instead
        of waiting out the timeout in groups the others never build."""
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (replicate, shard)):
            return  # check_mesh_shape says what to pass
        mine = torch.tensor([replicate, shard], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.group.allgather([every], [mine]).wait()
        asked = [tuple(t.tolist()) for t in every]
        if len(set(asked)) > 1:
            listing = ", ".join(f"rank {r} ({a[0]}, {a[1]})" for r, a in enumerate(asked))
            raise ValueError(f"mesh: the ranks asked for different meshes (replicate, shard): {listing}. Every rank "
                             "must call ctx.mesh(replicate=R, shard=S) with the same R and S")

    def mesh(self, replicate: int, shard: int) -> Mesh:
        """Split the world into an (replicate, shard) mesh, rank = r * shard + s (init_device_mesh's order).

        A collective call: every rank calls it, with the same arguments. Returns a `Mesh` whose `.shard` and
        `.replicate` are contexts over this rank's row and column, each a real process group with its own ledger
        ("intra-group", "inter-group") and, simulated, its own referee. Raises ValueError unless
        replicate x shard == world_size, both positive.
        """
        if self.parent is not None:
            raise ValueError("mesh: call it on the world's context, not on a subgroup's")
        self._agree_on_mesh(replicate, shard)
        replicate, shard = check_mesh_shape(replicate, shard, self.world_size)
        rows, columns = mesh_groups(replicate, shard)
        r, s = divmod(self.rank, shard)
        index, self._meshes = self._meshes, self._meshes + 1
        suffix = "" if index == 0 else f" of mesh #{index + 1}"
        made = {}
        for kind, groups, mine in ((INTRA, rows, r), (INTER, columns, s)):
            ranks = groups[mine]
            local = ranks.index(self.rank)
            name = f"{'shard' if kind == INTRA else 'replicate'} group {ranks}{suffix}"
            monitor = None
            if self.simulated:
                if self.store is None:
                    raise RuntimeError("mesh: this simulated context has no store to build subgroups on")
                assert self._monitor is not None
                timeout = self._monitor.timeout
                prefix = f"fsdp_course/mesh{index}/{kind}/{mine}"
                group = gloo_group(dist.PrefixStore(prefix, self.store), local, len(ranks), timeout)
                monitor = self._monitor.child(name, ranks)
            else:  # every rank creates every group, in the same order (new_group's rule)
                group = None
                for candidate in groups:
                    made_here = dist.new_group(candidate)
                    if candidate is ranks:
                        group = made_here
            self.subgroups.append(group)
            sub = RankContext(local, len(ranks), group, device=self.device, monitor=monitor)
            sub.simulated = self.simulated
            sub.generator = self.generator
            sub.parent = self
            sub.ledger = GroupLedger(local, len(ranks), kind, ranks)
            made[kind] = sub
        return Mesh(self, replicate, shard, shard=made[INTRA], replicate=made[INTER])

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
        """Leave the world joined by `from_env` (a no-op for simulated ranks, whom run_ranks cleans up, and for a
        mesh's subgroup contexts)."""
        if self.parent is None and not self.simulated and dist.is_initialized():
            dist.destroy_process_group()

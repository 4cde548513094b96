"""Lesson 10's machinery: the run loops, tables and set-ups around its measurements of the article's trainer.

The lesson keeps the lines that are the idea (the engines compared, the article's clip, its `worldSize > 0`); what
runs them, records them and prints them is here:

- `one_step_peaks` / `print_peaks`: every rank's peak memory over one SGD step, per engine and world size;
- `article_trainer_peak` / `print_article_table`: the tensors the article's `FSDPTrainerComplete` holds, allocated
  as its Java code allocates them, and its peak beside DDP's and FSDP's;
- `fixed_batch_losses`: a few steps on one fixed batch (a model that learns lowers the loss);
- `run_peers`: `fsdp_course/examples/peers.py` as real processes, its reports in rank order;
- `train_sgd`: FSDP on N ranks, or one process, trained with plain SGD and, if given, a gradient clip;
- `pinned_world`: two thread-ranks on Gloo devices pinned to one hostname, and what each wrote into the store;
- `wait_on_fresh_store`: rank 0 on an empty store, its peer never started.
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.fsdp.api import FSDP
from fsdp_course.memory import attach, measure_tensors, total_bytes
from fsdp_course.runtime.context import RankContext, article_gloo_group, gloo_group
from fsdp_course.runtime.simulate import run_ranks
from fsdp_course.sampler import global_batch, rank_slice
from fsdp_course.viz.style import format_bytes

__all__ = ["StepPeak", "Trained", "article_trainer_peak", "fixed_batch_losses", "one_step_peaks", "pinned_world",
           "print_article_table", "print_peaks", "run_peers", "train_sgd", "wait_on_fresh_store"]

MakeEngine = Callable[[nn.Module, RankContext], nn.Module]


# -- pitfall 5.3: peaks per rank over one step ------------------------------------------------------------------
@dataclass
class StepPeak:
    """One rank's memory over one step: FSDP's units (padded numel by name; empty for DDP), the peak of
    parameters + gradients + optimizer state, the peak of gathered parameters, and the recorded timeline."""

    units: dict[str, int]
    peak: int
    gathered: int
    timeline: list[tuple[str, dict[str, int]]] = field(repr=False)


def _one_step(ctx: RankContext, make: MakeEngine, model: nn.Module, x: Tensor, y: Tensor, batch: int,
              lr: float) -> StepPeak:
    engine = make(copy.deepcopy(model), ctx)
    optimizer = torch.optim.SGD(engine.parameters(), lr=lr)
    recorder = attach(engine, optimizer)
    idx = rank_slice(global_batch(len(x), batch, 0), ctx.rank, ctx.world_size)
    F.cross_entropy(engine(x[idx]), y[idx]).backward()
    optimizer.step()
    optimizer.zero_grad()
    recorder.record("after step")
    units = engine.unit_numels() if isinstance(engine, FSDP) else {}
    return StepPeak(units, recorder.peak_total, recorder.peak.get("gathered_params", 0), list(engine.timeline))


def one_step_peaks(model: nn.Module, engines: Mapping[str, MakeEngine], worlds: Sequence[int], x: Tensor, y: Tensor,
                   *, batch: int = 24, lr: float = 1e-3) -> dict[tuple[str, int], list[StepPeak]]:
    """Each engine (`make(model, ctx)`) on each world size: one plain-SGD step on the first global batch of
    `batch` samples, each rank on its slice, memory recorded (`memory.attach`); per (name, N), every rank's peak."""
    return {(name, n): run_ranks(lambda ctx, make=make: _one_step(ctx, make, model, x, y, batch, lr), n)
            for n in worlds for name, make in engines.items()}


def print_peaks(measured: Mapping[tuple[str, int], Sequence[StepPeak]], psi: int) -> None:
    """The table of `one_step_peaks` for a model of `psi` float32 parameters: rank 0's row per (engine, N), its
    units, largest unit and peaks."""
    print(f"Ψ = {psi:,} parameters, float32, SGD: peaks of rank 0 over one step\n")
    print(f"{'ranks':>5}  {'engine':<31} {'units':>5} {'largest unit':>12} {'peak gathered':>14} "
          f"{'peak params+grads':>18}")
    for (name, n), per_rank in measured.items():
        units = per_rank[0].units
        print(f"{n:>5}  {name:<31} {len(units) or '-':>5} {max(units.values(), default='-'):>12} "
              f"{format_bytes(per_rank[0].gathered):>14} {format_bytes(per_rank[0].peak):>18}")


# -- what the article's trainer holds ----------------------------------------------------------------------------
def article_trainer_peak(ctx: RankContext, model: nn.Module, x: Tensor, y: Tensor, batch: int,
                         steps: int = 2) -> int:
    """The article's `FSDPTrainerComplete` on this rank: its tensors allocated as its Java code allocates them, its
    collectives run for real (Gloo's list forms, as it calls them), `steps` calls of `trainStep()`. Returns this
    rank's peak bytes of live storages, every temporary counted as freed as soon as the Java code stops using it."""
    model = copy.deepcopy(model)                                 # this.model: the whole model, on every rank
    params = list(model.parameters())                            # getModelParams(model)
    total = sum(p.numel() for p in params)                       # totalParamNumel
    shard_size = (total + ctx.world_size - 1) // ctx.world_size  # shardParameters() ...
    start = ctx.rank * shard_size
    shard = torch.cat([p.detach().flatten() for p in params])[start:min(start + shard_size, total)]  # flattenParams
    shard = shard.clone().requires_grad_(True)                   # shardedParamForOpt: the flat copy is freed
    shard_grad = torch.zeros_like(shard)

    def held(*temporaries: Tensor) -> int:                       # this rank's live storages, in bytes
        return total_bytes(measure_tensors({"params": params, "grads": [p.grad for p in params],
                                            "sharded_params": [shard], "sharded_grads": [shard_grad],
                                            "gathered_params": temporaries}))
    peaks = []
    for step in range(steps):                                    # trainStep()
        for p in params:
            if p.grad is not None:
                p.grad.zero_()                                   # "clear the model's gradients": zeroed, kept
        shard_grad = torch.zeros_like(shard)                     # "re-initialise the gradient container"
        gathered = [torch.empty(shard_size) for _ in range(ctx.world_size)]  # allGatherToModel()
        ctx.group.allgather([gathered], [shard.detach()]).wait()
        full = torch.cat(gathered)[:total]
        peaks.append(held(*gathered, full))
        with torch.no_grad():                                    # unflattenParams(full, model)
            for p, values in zip(params, full.split([p.numel() for p in params]), strict=True):
                p.copy_(values.view_as(p))
        del gathered, full
        idx = rank_slice(global_batch(len(x), batch, step), ctx.rank, ctx.world_size)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        peaks.append(held(torch.cat([p.grad.flatten() for p in params])))  # flattenGrads(model): the norm's print
        grad_flat = torch.cat([p.grad.flatten() for p in params])        # reduceScatterGradients()
        local_grad = torch.empty_like(shard)
        ctx.group.reduce_scatter([local_grad], [list(grad_flat.split(shard_size))]).wait()
        peaks.append(held(grad_flat, local_grad))
        shard_grad.copy_(local_grad / ctx.world_size)
        del grad_flat, local_grad
        norm = shard_grad.norm().item()                          # stepOptimizer(): clip, then a manual SGD step
        shard.data.add_(shard_grad * (-0.001 / (norm + 1e-6) if norm > 1.0 else -0.001))
    return max(peaks)


def print_article_table(article: Mapping[int, int], ddp: Mapping[int, int], fsdp: Mapping[int, int],
                        psi: int) -> None:
    """Peak bytes per rank by world size, for a model of `psi` parameters: the article's trainer, DDP, FSDP ('-'
    where not measured), and their ratios to DDP."""
    print(f"Ψ = {psi:,}: peak bytes per rank of parameters, gradients and flat buffers\n")
    print(f"{'ranks':>5} {'article':>10} {'DDP':>9} {'FSDP':>9}   {'article / DDP':>13} {'FSDP / DDP':>10}")
    for n, peak in article.items():
        line = f"{n:>5} {format_bytes(peak):>10} {format_bytes(ddp[n]):>9} "
        line += f"{format_bytes(fsdp[n]):>9}" if n in fsdp else f"{'-':>9}"
        line += f"   {peak / ddp[n]:>13.2f} "
        print(line + (f"{fsdp[n] / ddp[n]:>10.2f}" if n in fsdp else f"{'-':>10}"))


# -- pitfall 5.4: a few steps on one fixed batch -----------------------------------------------------------------
def fixed_batch_losses(module: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, steps: int = 3,
                       before: Callable[[], None] | None = None) -> list[float]:
    """`steps` steps of `optimizer` on the same batch (x, y), `before()` run at the start of each; the losses,
    rounded to 3 decimals (what the lesson prints)."""
    losses = []
    for _ in range(steps):
        if before is not None:
            before()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 3))
    return losses


# -- pitfall 5.5: the peers program as real processes --------------------------------------------------------------
def run_peers(workdir: str, launcher: Sequence[str] = (), env: Mapping[str, str] | None = None,
              drop: Sequence[str] = ()) -> tuple[int, list[str]]:
    """Run `fsdp_course/examples/peers.py` (`examples.run`'s launcher, env and drop); print its exit code, each
    rank's report (one file per rank, in rank order) and, when it failed, the error it stopped with. Returns the
    exit code and the reports."""
    import fsdp_course.examples as examples

    reports = tempfile.mkdtemp(dir=workdir)
    proc = examples.run("peers", reports, workdir=workdir, launcher=launcher, env=env, drop=drop)
    print("exit code", proc.returncode)
    texts = []
    for name in sorted(os.listdir(reports)):
        with open(os.path.join(reports, name)) as f:
            texts.append(f.read())
        print(texts[-1])
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1])
    return proc.returncode, texts


# -- clipping, padding: N ranks against one process ----------------------------------------------------------------
@dataclass
class Trained:
    """What one rank (or the one process) saw: the scale its clip applied at each step (1.0 without a clip), and
    the full parameters after the last step."""

    scales: list[float]
    state: dict[str, Tensor]


def train_sgd(ctx: RankContext | None, model: nn.Module, x: Tensor, y: Tensor, *,
              clip: Callable[[nn.Module], float] | None = None, steps: int = 5, batch: int = 32,
              lr: float = 0.5) -> Trained:
    """Plain SGD for `steps` steps on the global batches of `batch` samples (`sampler.global_batch`): the course's
    FSDP on this rank's slices, or, with `ctx=None`, one process on the whole batches. `clip(module)`, if given,
    runs between backward and step and returns the scale it applied."""
    module = copy.deepcopy(model) if ctx is None else FSDP(copy.deepcopy(model), ctx)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    scales = []
    for step in range(steps):
        idx = global_batch(len(x), batch, step)
        if ctx is not None:
            idx = rank_slice(idx, ctx.rank, ctx.world_size)
        F.cross_entropy(module(x[idx]), y[idx]).backward()
        scales.append(1.0 if clip is None else clip(module))
        optimizer.step()
        optimizer.zero_grad()
    state = module.state_dict() if ctx is None else module.full_state_dict()
    return Trained(scales, {k: v.detach().clone() for k, v in state.items()})


# -- going deeper: the pinned device, the fresh store ------------------------------------------------------------
def _published_address(record: bytes) -> tuple[str, int]:
    """The IPv4 socket address in a Gloo store record: the first sockaddr_in with a port, i.e. the family AF_INET
    (2, little-endian), then the port (big-endian), then the address."""
    at = record.find(b"\x02\x00")
    while 0 <= at <= len(record) - 8:
        port, ip = int.from_bytes(record[at + 2:at + 4], "big"), record[at + 4:at + 8]
        if port:
            return socket.inet_ntoa(ip), port
        at = record.find(b"\x02\x00", at + 1)
    raise ValueError("no IPv4 address in this store record")


def pinned_world(hostname: str, world_size: int = 2, seconds: float = 2.0) -> tuple[list[float], list[tuple[str, int]]]:
    """`world_size` thread-ranks on a fresh FileStore, each with the article's Gloo group (`article_gloo_group`, its
    device pinned to `hostname`), all-reduce (rank + 1). Returns each rank's sum, and the (address, port) each rank
    wrote into the store for its peers to dial (its device's socket address)."""
    folder = tempfile.mkdtemp(prefix="fsdp_course_")
    joined: dict[int, tuple[dist.Store, dist.ProcessGroup]] = {}
    sums: dict[int, float] = {}

    def join(rank: int) -> None:
        store = dist.FileStore(os.path.join(folder, "store"), world_size)
        group = article_gloo_group(store, rank, world_size, seconds=seconds, hostname=hostname)
        t = torch.tensor([rank + 1.0])
        group.allreduce([t]).wait()
        joined[rank], sums[rank] = (store, group), t.item()

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        store = joined[0][0]
        store.set_timeout(datetime.timedelta(seconds=seconds))  # every key is there: never wait long for one
        addresses = [_published_address(store.get(f"0/{rank}")) for rank in range(world_size)]
    finally:
        joined.clear()  # the groups go: nothing is in flight
        shutil.rmtree(folder)
    return [sums.get(rank, float("nan")) for rank in range(world_size)], addresses


def wait_on_fresh_store(seconds: float = 1.0) -> str:
    """Rank 0 of 2 on a new, empty FileStore, rank 1 never started: the error it stops with after `seconds`."""
    folder = tempfile.mkdtemp(prefix="fsdp_course_")
    store = dist.FileStore(os.path.join(folder, "store"), 2)
    store.set_timeout(datetime.timedelta(seconds=seconds))
    try:
        gloo_group(store, 0, 2, seconds)
        return "rank 0 joined"
    except RuntimeError as err:
        return str(err)
    finally:
        del store
        shutil.rmtree(folder)

"""Train the article's Transformer on the digits under torchrun: the course's FSDP, PyTorch's, or DDP.

    torchrun --nproc-per-node 2 -m fsdp_course.train --engine ours --steps 50
    torchrun --nproc-per-node 2 -m fsdp_course.train --engine torch --config article --meta-init

Several machines: the same command on every node, with `--nnodes 2 --node-rank K --rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-conf join_timeout=60` (HOST = the first node; a static --master-port
waits up to 10 minutes for a peer that never comes). Gloo on CPU, NCCL with CUDA, same code path.

The three engines see the same run: the same initial weights (piecewise seeded init, meta_init.py,
on every rank, or materialized from the meta device), AdamW, and the same data order: the course's
sampler fixes the global batch of each step (`sampler.global_batch`: the epoch's DistributedSampler
order, cut into batches of `--batch-size`), each rank trains on its contiguous slice of it
(`sampler.rank_slice`). Gradients are averaged over ranks, so every engine and every world size
computes the step one process would on the global batch.
  --engine ours   fsdp_course.fsdp.api.FSDP, one unit per TransformerEncoderLayer plus the root, the root
                  kept gathered from forward to backward as fully_shard keeps its root
  --engine torch  torch.distributed.fsdp.fully_shard with the same units (torch_fsdp.py), following
                  https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
  --engine ddp    fsdp_course.engines.ddp.DDP, the whole model on every rank
FSDP itself: the PyTorch FSDP paper, arXiv:2304.11277; ZeRO-3, arXiv:1910.02054.

Reported per rank: peak RSS (the OS: resource.getrusage) and peak live tensor bytes (PyTorch's
MemTracker over one step, activations included), beside the median step time and the bytes
each rank sends per step under the ring model (the ledger). On CPU, glibc's malloc keeps freed
memory, so RSS can be 2-3x the live bytes: launch with MALLOC_MMAP_THRESHOLD_=65536 for an RSS that
follows them (benchmarks/fsdp_vs_torch.py measures both). A non-finite loss stops every rank at
that step with exit 1: the run diverged (lower --lr). Bad option values fail in the parser, before any
process group exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.data import train_test_split_digits
from fsdp_course.fsdp.meta_init import init_weights, materialize
from fsdp_course.models import TransformerClassifier, TransformerConfig, count_parameters
from fsdp_course.runtime.context import RankContext
from fsdp_course.sampler import global_batch, rank_slice

__all__ = ["main", "parse_args"]

ENGINES = ("ours", "torch", "ddp")
CONFIGS: dict[str, Callable[[], TransformerConfig]] = {"small": TransformerConfig.small,
                                                       "article": TransformerConfig.article}


def positive_int(text: str) -> int:
    """An argparse type: argparse turns the ArgumentTypeError into `argument --steps: must be ...`."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def learning_rate(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (seconds), got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked here (argparse's usage error, exit 2) before any process group exists."""
    p = argparse.ArgumentParser(prog="python -m fsdp_course.train", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=ENGINES, default="ours")
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--steps", type=positive_int, default=50)
    p.add_argument("--batch-size", type=positive_int, default=32, help="global batch, split over the ranks")
    p.add_argument("--lr", type=learning_rate, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--meta-init", action="store_true",
                   help="build on the meta device and materialize only this rank's shards")
    p.add_argument("--checkpoint", type=Path, help="save the full model here at the end (rank 0 writes)")
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--timeout", type=seconds, default=60.0, help="seconds for the rendezvous and each collective")
    p.add_argument("--json", type=Path, help="rank 0 writes the per-step log and the summary here")
    return p.parse_args(argv)


def fail(message: str) -> NoReturn:
    raise SystemExit(f"fsdp_course.train: error: {message}")


class Diverged(RuntimeError):
    """The all-reduced loss is not finite: every rank sees the same value and stops at the same step."""


def join_world(args: argparse.Namespace) -> RankContext:
    """Check the launch, then join. Every rank checks the same things, so a bad launch fails everywhere."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and args.batch_size % int(world):
        n = int(world)
        fail(f"the global batch {args.batch_size} does not split into {n} equal slices (WORLD_SIZE={n}): "
             f"use a multiple of {n}, e.g. --batch-size {max(n, args.batch_size // n * n)}")
    env_complete = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    try:
        return RankContext.from_env(timeout=args.timeout, seed=args.seed)
    except RuntimeError as err:  # DistStoreError / DistNetworkError are RuntimeErrors too
        if not env_complete:
            fail(str(err))
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        fail(f"rank {os.environ['RANK']} of {world} could not meet the other ranks at the rendezvous {where} "
             f"within {args.timeout:g} s ({first}). Start every process (on every node the same torchrun "
             "command, with the same --rdzv-endpoint), check the address, the port and the firewall; "
             "--timeout sets this limit. Across machines, launch with torchrun's c10d rendezvous and a join "
             "timeout (--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf join_timeout=60) rather than "
             "a static --master-port, where torchrun waits up to 10 minutes for peers that never come")


@dataclass
class Engine:
    """What the loop needs from an engine, whichever it is."""

    model: nn.Module  # called on this rank's slice of the batch
    params: list[torch.Tensor]  # what the optimizer steps (shards for ours and torch)
    full_state_dict: Callable[[], dict[str, torch.Tensor]]  # a collective: call on every rank
    tracked: list[Any] = field(default_factory=list)  # alive before a step: for MemTracker
    counting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def meta_model(config: TransformerConfig) -> TransformerClassifier:
    with torch.device("meta"):
        return TransformerClassifier(config)  # shapes only, no storage


def build_engine(args: argparse.Namespace, ctx: RankContext, config: TransformerConfig) -> Engine:
    if args.meta_init:
        model = meta_model(config)  # no rank ever holds the whole model
    else:
        model = init_weights(TransformerClassifier(config), args.seed).to(ctx.device)  # drawn on the CPU
    if args.engine == "torch":
        from fsdp_course.engines.torch_fsdp import count_collectives, full_state_dict, shard_with_fully_shard

        shard_with_fully_shard(model, ctx, seed=args.seed)
        return Engine(model, list(model.parameters()), lambda: full_state_dict(model), [model],
                      lambda: count_collectives(ctx))
    if args.engine == "ours":
        from fsdp_course.fsdp.api import FSDP

        # on the meta device, each rank fills its shards one piece at a time (fsdp.py, meta_init.py)
        init = (lambda m: materialize(m, args.seed)) if args.meta_init else None
        # the root stays gathered from forward to backward, as fully_shard's root does: the same traffic
        engine: Any = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer}, init=init,
                           reshard_root_after_forward=False)
        state = engine.full_state_dict
    else:
        from fsdp_course.engines.ddp import DDP

        if args.meta_init:  # DDP keeps the whole model anyway: materialize it all
            model = model.to_empty(device=ctx.device)
            with torch.no_grad():
                params = dict(model.named_parameters())
                for _, piece in materialize(meta_model(config), args.seed):
                    for name, value in piece.items():
                        params[name].copy_(value)

        engine = DDP(model, ctx)
        state = lambda: {k: v.detach().clone() for k, v in model.state_dict().items()}  # noqa: E731
    tracked = [t for ts in engine.memory_tensors().values() for t in ts]
    return Engine(engine, list(engine.parameters()), state, [engine, *tracked])


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def memory_tracker(engine: Engine, optimizer: torch.optim.Optimizer) -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*engine.tracked, optimizer)
    return tracker


def peak_tracked_bytes(tracker: Any) -> int:
    return max((snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("peak").values()), default=0)


@torch.no_grad()
def accuracy(engine: Engine, ctx: RankContext, x: torch.Tensor, y: torch.Tensor, chunk: int) -> float:
    """Held-out accuracy: each rank scores one slice, in chunks of `chunk` images, the counts summed over ranks.

    Every rank runs the same number of forwards (FSDP gathers in each), an empty chunk included."""
    xs, ys = (rank_slice(t, ctx.rank, ctx.world_size, allow_uneven=True) for t in (x, y))
    n_chunks = math.ceil(math.ceil(len(x) / ctx.world_size) / chunk)  # equal on every rank
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    for xc, yc in zip(torch.tensor_split(xs, n_chunks), torch.tensor_split(ys, n_chunks), strict=True):
        correct += (engine.model(xc.to(ctx.device)).argmax(-1) == yc.to(ctx.device)).sum()
    counts = torch.stack([correct, torch.tensor(len(ys), device=ctx.device)]).double()
    ctx.all_reduce(counts, op="sum")
    return (counts[0] / counts[1]).item()


def train(args: argparse.Namespace, ctx: RankContext) -> dict[str, Any]:
    from tqdm import tqdm

    config = CONFIGS[args.config]()
    engine = build_engine(args, ctx, config)
    optimizer = torch.optim.AdamW(engine.params, lr=args.lr)
    x_train, y_train, x_test, y_test = train_test_split_digits("tokens", seed=0)
    local = args.batch_size // ctx.world_size
    tracked_step = 1 if args.steps > 1 else 0  # step 0 creates the optimizer state: track the next
    losses: list[float] = []
    times: list[float] = []
    sent: list[float] = []
    live_peak = 0
    bar = tqdm(total=args.steps, disable=ctx.rank != 0, desc=f"{args.engine} N={ctx.world_size}",
               file=sys.stderr, mininterval=1.0)
    for step in range(args.steps):
        batch = global_batch(len(x_train), args.batch_size, step, seed=args.seed)  # (batch_size,) indices
        idx = rank_slice(batch, ctx.rank, ctx.world_size)  # (local,) my contiguous slice of it
        x, y = x_train[idx].to(ctx.device), y_train[idx].to(ctx.device)
        tracker = memory_tracker(engine, optimizer) if step == tracked_step else None
        ctx.ledger.mark(f"step {step}")
        start = time.perf_counter()
        with engine.counting(), tracker if tracker is not None else contextlib.nullcontext():
            loss = F.cross_entropy(engine.model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - start
        ctx.ledger.mark("metrics")
        if tracker is not None:
            live_peak = peak_tracked_bytes(tracker)
        elif step > 0:  # step 0 warms up: with 1 or 2 steps, nothing is timed
            times.append(elapsed)
        sent.append(ctx.ledger.total(label=f"step {step}")[0])
        losses.append(ctx.all_reduce(loss.detach().reshape(1).clone(), op="mean").item())
        bar.update()
        if ctx.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            bar.write(f"step {step + 1:>5}/{args.steps}  loss {losses[-1]:.7f}  time {elapsed * 1e3:8.1f} ms  "
                      f"sent {sent[-1] / 1e3:9.1f} kB{'  (memory tracked)' if tracker else ''}")
        if not math.isfinite(losses[-1]):  # all-reduced: the same on every rank, so all stop here
            bar.close()
            raise Diverged(f"the loss is {losses[-1]} at step {step + 1}/{args.steps}: the run diverged "
                           f"(lower --lr, now {args.lr:g}; the default is 1e-3)")
    bar.close()
    per_rank = torch.tensor([[peak_rss_bytes(), live_peak]], dtype=torch.float64, device=ctx.device)
    per_rank = ctx.all_gather(per_rank).cpu()  # (world_size, 2): training only, before evaluation and checkpoint
    acc = accuracy(engine, ctx, x_test, y_test, chunk=local)
    summary = {
        "engine": args.engine, "config": args.config, "world_size": ctx.world_size, "steps": args.steps,
        "batch_size": args.batch_size, "meta_init": args.meta_init, "device": str(ctx.device),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "params": count_parameters(meta_model(config)),
        "losses": losses, "final_loss": losses[-1], "accuracy": acc,
        "step_times_s": times, "median_step_s": statistics.median(times) if times else None,
        "bytes_sent_per_step": statistics.median(sent),
        "peak_rss_bytes": [int(v) for v in per_rank[:, 0]], "peak_live_bytes": [int(v) for v in per_rank[:, 1]],
    }
    if args.checkpoint is not None:
        save_checkpoint(args, ctx, engine, summary)
    return summary


def save_checkpoint(args: argparse.Namespace, ctx: RankContext, engine: Engine, summary: dict[str, Any]) -> None:
    """The full model, keyed as TransformerClassifier.state_dict(), whichever engine trained it."""
    state = engine.full_state_dict()  # a collective: every rank
    if ctx.rank == 0:
        args.checkpoint.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in state.items()}, args.checkpoint / "model.pt")
        meta = {k: summary[k] for k in ("engine", "config", "world_size", "steps", "final_loss", "accuracy")}
        (args.checkpoint / "meta.json").write_text(json.dumps({**meta, "seed": args.seed}, indent=1))


def report(summary: dict[str, Any]) -> str:
    s = summary
    median = ("n/a (too few steps: the warm-up and the memory-tracked steps are not timed; use --steps 3 or more)"
              if s["median_step_s"] is None else f"{1e3 * s['median_step_s']:.1f} ms")
    lines = [f"summary: engine={s['engine']} config={s['config']} params={s['params']:,} world={s['world_size']} "
             f"steps={s['steps']} batch={s['batch_size']} meta_init={s['meta_init']} device={s['device']}",
             f"  final loss {s['final_loss']:.6f}   held-out accuracy {100 * s['accuracy']:.1f}%",
             f"  median step time {median} (timings vary)   "
             f"sent per rank per step {s['bytes_sent_per_step'] / 1e6:.3f} MB (ledger, ring model)",
             f"  {'rank':>4}  {'peak RSS':>12}  {'peak live tensors':>18}"]
    for r, (rss, live) in enumerate(zip(s["peak_rss_bytes"], s["peak_live_bytes"], strict=True)):
        lines.append(f"  {r:>4}  {rss / 2**20:>9.1f} MiB  {live / 2**20:>15.2f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = join_world(args)
    try:
        summary = train(args, ctx)
        if ctx.rank == 0:
            print(report(summary), flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(summary, indent=1))
        ctx.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
    except Diverged as err:
        if ctx.rank == 0:  # before the barrier: torchrun stops the other ranks once one has exited
            print(f"fsdp_course.train: error: {err}", file=sys.stderr, flush=True)
        ctx.barrier()
        raise SystemExit(1) from None
    finally:
        ctx.close()


if __name__ == "__main__":
    main()

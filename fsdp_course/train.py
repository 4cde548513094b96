"""Train the article's Transformer on the digits under torchrun: the course's FSDP, PyTorch's, or DDP.

    torchrun --nproc-per-node 2 -m fsdp_course.train --engine ours --steps 50
    torchrun --nproc-per-node 2 -m fsdp_course.train --engine torch --config article --meta-init
    torchrun --nproc-per-node 2 -m fsdp_course.train --engine ours --mixed-precision bf16 --prefetch \
        --checkpoint-activations --accumulate 4

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

Four options, each the same in the engines that have it; where torch has no such feature, the parser refuses it
and says what to use instead:
  --mixed-precision bf16|fp16  ours: FSDP(..., mp_policy=MixedPrecision(dtype, reduce_dtype=fp32)); torch:
                  fully_shard(..., mp_policy=MixedPrecisionPolicy(dtype, reduce_dtype=fp32)). fp32 shards and
                  optimizer, all-gather and compute in the half dtype, gradients reduced in fp32; the logits are
                  cast to fp32 for the loss. fp16 adds loss scaling (arXiv:1710.03740): fsdp_course's
                  ShardedGradScaler for ours, torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler for
                  torch (it unscales fully_shard's DTensor gradients and all-reduces its found-inf flag over
                  Gloo; tests/test_train_features.py checks both, an inf on one rank only included); the steps it
                  skipped are reported. ddp: refused, DDP (the course's and torch's) has no parameter-dtype policy.
  --prefetch      ours: FSDP(..., prefetch=1); torch: set_modules_to_forward_prefetch /
                  set_modules_to_backward_prefetch one unit ahead (torch_fsdp.py). ddp: refused, it gathers nothing.
  --checkpoint-activations  every TransformerEncoderLayer recomputed in backward (torch's composable
                  `checkpoint`, non-reentrant torch.utils.checkpoint, applied before wrapping); all engines.
  --accumulate K  each rank's slice of the global batch in K micro-batches, each loss divided by K, gradients
                  synchronized in the last backward only (ours and torch: set_requires_gradient_sync(False) for
                  the first K-1; ddp: its no_sync()). The global batch, and so the losses, stay those of K=1.
The summary (--json, and the report) records them: mixed_precision, prefetch, checkpoint_activations,
accumulate, and under fp16 skipped_steps (indices into losses) and loss_scale (the final scale).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.data import NUM_IMAGES, train_test_split_digits
from fsdp_course.fsdp.meta_init import init_weights, materialize
from fsdp_course.models import TransformerClassifier, TransformerConfig, count_parameters
from fsdp_course.runtime.context import RankContext
from fsdp_course.sampler import global_batch, rank_slice

__all__ = ["main", "parse_args"]

ENGINES = ("ours", "torch", "ddp")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --mixed-precision: the compute dtype
CONFIGS: dict[str, Callable[[], TransformerConfig]] = {"small": TransformerConfig.small,
                                                       "article": TransformerConfig.article}
TRAIN_IMAGES = NUM_IMAGES - round(NUM_IMAGES * 0.2)  # train_test_split_digits' default split: 1438


def _writable_file(p: argparse.ArgumentParser, option: str, path: Path | None) -> None:
    """A file rank 0 will write at the end: refused now, before any training, if it cannot be written."""
    if path is None:
        return
    if path.is_dir():
        p.error(f"{option} {path} is a folder: name the file to write, e.g. {option} {path / 'summary.json'}")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        p.error(f"{option} {path}: the folder {folder} does not exist: create it, or name a file in an existing one")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        p.error(f"{option} {path} cannot be written (permissions): name a file you can write")


def _writable_folder(p: argparse.ArgumentParser, option: str, path: Path | None) -> None:
    """A folder rank 0 will create (if needed) and write into at the end: checked now."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        p.error(f"{option} {path} is a file: it names the folder to save model.pt and meta.json in")
    existing = next(q for q in (path, *path.parents) if q.exists())  # the folder that exists, or one above
    if not os.access(existing, os.W_OK):
        p.error(f"{option} {path} cannot be written ({existing} is not writable): name a folder you can write")


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
    p.add_argument("--mixed-precision", choices=sorted(HALF), default=None,
                   help="all-gather and compute in this dtype, reduce gradients in fp32 (ours, torch); "
                        "fp16 adds loss scaling")
    p.add_argument("--prefetch", action="store_true",
                   help="gather the next unit while this one computes, in forward and backward (ours, torch)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each TransformerEncoderLayer's forward in backward instead of keeping "
                        "its activations")
    p.add_argument("--accumulate", type=positive_int, default=1, metavar="K",
                   help="split each rank's slice of the batch into K micro-batches, gradients synced on the "
                        "last only (the global batch and the losses stay those of K=1)")
    args = p.parse_args(argv)
    _writable_file(p, "--json", args.json)
    _writable_folder(p, "--checkpoint", args.checkpoint)
    if args.batch_size > TRAIN_IMAGES:
        p.error(f"--batch-size {args.batch_size} is larger than the training set ({TRAIN_IMAGES} images): "
                f"use at most {TRAIN_IMAGES}")
    if args.engine == "ddp" and args.mixed_precision:
        p.error(f"--mixed-precision {args.mixed_precision} needs a sharded engine: DDP (the course's, as torch's "
                "DistributedDataParallel) has no parameter-dtype policy. Use --engine ours or --engine torch "
                "(FSDP's MixedPrecision, fully_shard's MixedPrecisionPolicy)")
    if args.engine == "ddp" and args.prefetch:
        p.error("--prefetch: DDP keeps the whole model on every rank and gathers nothing, so there is nothing to "
                "prefetch. Use --engine ours or --engine torch, or leave out --prefetch")
    if args.batch_size % args.accumulate:
        p.error(f"--accumulate {args.accumulate}: the global batch {args.batch_size} does not split into "
                f"{args.accumulate} equal micro-batches per rank: use a --batch-size that is a multiple of "
                f"{args.accumulate} times the number of processes")
    return args


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
    if world is not None and world.isdigit() and (args.batch_size // int(world)) % args.accumulate:
        n, k, local = int(world), args.accumulate, args.batch_size // int(world)
        fail(f"each rank's slice of the batch ({args.batch_size} / {n} = {local}) does not split into {k} "
             f"equal micro-batches (--accumulate {k}): use a multiple of {n * k}, "
             f"e.g. --batch-size {max(n * k, args.batch_size // (n * k) * (n * k))}, or another --accumulate")
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
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # backward without sync


@contextlib.contextmanager
def without_gradient_sync(module: Any) -> Iterator[None]:
    """fully_shard's `set_requires_gradient_sync(False)` for a block: its backward keeps the unsharded gradients
    and accumulates into them; the first backward after the block reduce-scatters them (FSDP2's accumulation)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing of every TransformerEncoderLayer: its forward saves only its inputs, and backward
    recomputes it (torch.utils.checkpoint, non-reentrant). torch's composable `checkpoint` registers this as the
    layer's forward hooks, so names, state_dict keys and the class that FSDP wraps stay the same; applied before
    wrapping or sharding, as torch's FSDP2 tests and torchtitan do, so each unit's gather runs inside the region."""
    from torch.distributed._composable import checkpoint

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            checkpoint(module)


def meta_model(config: TransformerConfig) -> TransformerClassifier:
    with torch.device("meta"):
        return TransformerClassifier(config)  # shapes only, no storage


def build_engine(args: argparse.Namespace, ctx: RankContext, config: TransformerConfig) -> Engine:
    if args.meta_init:
        model = meta_model(config)  # no rank ever holds the whole model
    else:
        model = init_weights(TransformerClassifier(config), args.seed).to(ctx.device)  # drawn on the CPU
    if args.checkpoint_activations:
        checkpoint_layers(model)
    half = HALF[args.mixed_precision] if args.mixed_precision else None
    if args.engine == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from fsdp_course.engines.torch_fsdp import count_collectives, full_state_dict, shard_with_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else None
        shard_with_fully_shard(model, ctx, seed=args.seed, mp_policy=policy, prefetch=int(args.prefetch))
        return Engine(model, list(model.parameters()), lambda: full_state_dict(model), [model],
                      lambda: count_collectives(ctx), lambda: without_gradient_sync(model))
    if args.engine == "ours":
        from fsdp_course.fsdp.api import FSDP
        from fsdp_course.fsdp.policy import MixedPrecision

        # on the meta device, each rank fills its shards one piece at a time (fsdp.py, meta_init.py)
        init = (lambda m: materialize(m, args.seed)) if args.meta_init else None
        # the root stays gathered from forward to backward, as fully_shard's root does: the same traffic
        engine: Any = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer}, init=init,
                           reshard_root_after_forward=False, prefetch=int(args.prefetch),
                           mp_policy=MixedPrecision(param_dtype=half, reduce_dtype=torch.float32) if half else None)
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
    return Engine(engine, list(engine.parameters()), state, [engine, *tracked], no_sync=engine.no_sync)


class LossScaling:
    """fp16's loss scaling (Micikevicius et al., arXiv:1710.03740, 3.2) with a scaler whose found-inf decision is
    global: `fsdp_course.ShardedGradScaler(ctx)` for ours, torch's `ShardedGradScaler` for fully_shard (its
    `_amp_foreach_non_finite_check_and_unscale_` runs on the DTensor gradients, and it all-reduces the flag over
    the process group; torch warns once that it wraps the (1,)-shaped found-inf flag as a replicated DTensor, and
    the flag is still set: tests/test_train_features.py plants an inf on one rank's shard and sees every rank skip).
    Both: initial scale 2**16, halved after a skipped step, doubled after 2000 clean ones."""

    def __init__(self, engine: str, ctx: RankContext, init_scale: float = 2.0**16) -> None:
        if engine == "torch":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

            self.scaler: Any = TorchScaler(device=ctx.device.type, init_scale=init_scale, process_group=ctx.group)
        else:
            from fsdp_course.fsdp.grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(ctx, init_scale=init_scale)
        self.torch = engine == "torch"

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def get_scale(self) -> float:
        return float(self.scaler.get_scale())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, step unless some rank's gradients hold an inf or NaN, update the scale; whether it stepped."""
        before = self.get_scale()
        stepped = self.scaler.step(optimizer)
        self.scaler.update()
        # torch's step returns the optimizer's step() (None): a skipped step is the one after which the scale fell
        return self.get_scale() >= before if self.torch else bool(stepped)


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


def micro_steps(engine: Engine, x: torch.Tensor, y: torch.Tensor, k: int, scaling: LossScaling | None,
                tracker: Any = None) -> torch.Tensor:
    """Forward and backward of this rank's slice in k equal micro-batches; returns the slice's mean loss.

    Each micro-batch's mean loss is divided by k, so the accumulated gradient is the slice's mean gradient, as one
    backward of the whole slice gives; the gradients are synchronized only in the last backward. The logits are
    cast to fp32 before the loss (a no-op without mixed precision), so the softmax is not computed in half.
    MemTracker refuses a second forward of the model in one tracked region unless its per-module statistics are
    reset (its own error message says so); the peak it reports spans the whole step all the same."""
    loss = torch.zeros((), device=x.device)
    for m, (xm, ym) in enumerate(zip(x.tensor_split(k), y.tensor_split(k), strict=True)):
        if tracker is not None and m > 0:
            tracker.reset_mod_stats()
        with contextlib.nullcontext() if m == k - 1 else engine.no_sync():
            micro = F.cross_entropy(engine.model(xm).float(), ym)
            if k > 1:
                micro = micro / k
            (scaling.scale(micro) if scaling is not None else micro).backward()
        loss = loss + micro.detach()
    return loss


def train(args: argparse.Namespace, ctx: RankContext) -> dict[str, Any]:
    from tqdm import tqdm

    config = CONFIGS[args.config]()
    engine = build_engine(args, ctx, config)
    optimizer = torch.optim.AdamW(engine.params, lr=args.lr)
    x_train, y_train, x_test, y_test = train_test_split_digits("tokens", seed=0)
    local = args.batch_size // ctx.world_size
    scaling = LossScaling(args.engine, ctx) if args.mixed_precision == "fp16" else None
    skipped: list[int] = []
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
            loss = micro_steps(engine, x, y, args.accumulate, scaling, tracker)
            if scaling is None:
                optimizer.step()
            elif not scaling.step(optimizer):
                skipped.append(step)
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
        "mixed_precision": args.mixed_precision, "prefetch": args.prefetch,
        "checkpoint_activations": args.checkpoint_activations, "accumulate": args.accumulate,
        "skipped_steps": skipped, "loss_scale": scaling.get_scale() if scaling else None,
        "losses": losses, "final_loss": losses[-1], "accuracy": acc,
        "step_times_s": times, "median_step_s": statistics.median(times) if times else None,
        "bytes_sent_per_step": statistics.median(sent),
        "peak_rss_bytes": [int(v) for v in per_rank[:, 0]], "peak_live_bytes": [int(v) for v in per_rank[:, 1]],
    }
    if args.checkpoint is not None:
        summary["checkpoint_error"] = save_checkpoint(args, ctx, engine, summary)
    return summary


def save_checkpoint(args: argparse.Namespace, ctx: RankContext, engine: Engine, summary: dict[str, Any]) -> str | None:
    """The full model, keyed as TransformerClassifier.state_dict(), whichever engine trained it. Returns why rank 0
    could not write it (the report and --json are written all the same), or None."""
    state = engine.full_state_dict()  # a collective: every rank
    if ctx.rank != 0:
        return None
    try:
        args.checkpoint.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in state.items()}, args.checkpoint / "model.pt")
        meta = {k: summary[k] for k in ("engine", "config", "world_size", "steps", "final_loss", "accuracy")}
        (args.checkpoint / "meta.json").write_text(json.dumps({**meta, "seed": args.seed}, indent=1))
    except (OSError, RuntimeError) as exc:  # torch.save raises RuntimeError for a path it cannot open
        return f"the checkpoint could not be written to {args.checkpoint} ({type(exc).__name__}: {exc})"
    return None


def features(s: dict[str, Any]) -> str:
    """The run's options beyond the engine, one line of the report."""
    precision = f"mixed precision {s['mixed_precision']} (fp32 reduce)" if s["mixed_precision"] else "fp32"
    line = (f"{precision}  prefetch={'on' if s['prefetch'] else 'off'}  "
            f"activation checkpointing={'on' if s['checkpoint_activations'] else 'off'}  "
            f"micro-batches per step={s['accumulate']}")
    if s["loss_scale"] is not None:
        skipped = s["skipped_steps"]  # indices into losses; the log counts steps from 1
        line += (f"  loss scaling: {len(skipped)} of {s['steps']} steps skipped"
                 f"{' (step ' + ', '.join(str(i + 1) for i in skipped) + ')' if skipped else ''}, "
                 f"final scale {s['loss_scale']:g}")
    return line


def report(summary: dict[str, Any]) -> str:
    s = summary
    median = ("n/a (too few steps: the warm-up and the memory-tracked steps are not timed; use --steps 3 or more)"
              if s["median_step_s"] is None else f"{1e3 * s['median_step_s']:.1f} ms")
    lines = [f"summary: engine={s['engine']} config={s['config']} params={s['params']:,} world={s['world_size']} "
             f"steps={s['steps']} batch={s['batch_size']} meta_init={s['meta_init']} device={s['device']}",
             f"  final loss {s['final_loss']:.6f}   held-out accuracy {100 * s['accuracy']:.1f}%",
             f"  {features(s)}",
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
        failed = summary.pop("checkpoint_error", None)  # not a field of the summary: said, then the exit status
        if ctx.rank == 0:
            print(report(summary), flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(summary, indent=1))
            if failed:
                print(f"fsdp_course.train: error: {failed}; the summary above is complete", file=sys.stderr,
                      flush=True)
        ctx.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
        if failed:
            raise SystemExit(1)
    except Diverged as err:
        if ctx.rank == 0:  # before the barrier: torchrun stops the other ranks once one has exited
            print(f"fsdp_course.train: error: {err}", file=sys.stderr, flush=True)
        ctx.barrier()
        raise SystemExit(1) from None
    finally:
        ctx.close()


if __name__ == "__main__":
    main()

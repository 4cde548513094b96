"""The five collectives of the course, as thin layers over a real `torch.distributed` process group.

Each function takes the rank context explicitly (no global default group: ranks may be threads),
checks its input with a message that says what to do, lets the simulator's monitor compare the
call across ranks, runs the real collective on `ctx.group` (Gloo on CPU, NCCL on GPUs), and records
it in `ctx.ledger`. These are the low-level calls the article makes through JavaCPP:
`ProcessGroupGloo.broadcast(TensorVector, BroadcastOptions)`, `allreduce`, `allgather`,
`reduce_scatter(..., ReduceScatterOptions)`, with Python lists instead of TensorVector; for
all_gather the one-tensor form (`_allgather_base`, what `all_gather_single` calls: no list of views),
for reduce_scatter the one-tensor form on small tensors only (measured below `reduce_scatter`).

Gloo needs equal-sized chunks for all_gather and reduce_scatter, so callers pad (see flat_param).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fsdp_course.runtime.monitor import CollectiveHang, Signature, WorldMonitor

__all__ = ["CollectiveWork", "P2PWork", "all_gather", "all_reduce", "barrier", "broadcast", "irecv", "isend", "recv",
           "reduce_scatter", "send"]

class Rank(Protocol):
    """What a collective needs from its rank (`context.RankContext` is the implementation; typed here so that this
    module does not import the context that imports it)."""

    rank: int
    world_size: int
    group: Any  # a torch.distributed ProcessGroup
    device: torch.device

    @property
    def monitor(self) -> WorldMonitor | None: ...

    def begin_collective(self, op: str, tensors: list[torch.Tensor], extra: str = "") -> Signature: ...

    def end_collective(self, sig: Signature, payload_bytes: int, src: int = 0, *, end: float | None = None
                       ) -> None: ...


class CollectiveWork:
    """A collective started with `async_op=True`: the call returned at once, Gloo runs it on its own threads while
    this rank computes. `wait()` blocks until it is done and returns its output (what the call would have returned).

    The ledger records it at `wait()`, with the time it started and the time Gloo completed it (a callback on the
    work's future; a work without a future, such as Gloo's one-tensor reduce-scatter, ends when waited), so a
    timeline shows the communication where it really ran, overlapping compute.
    Wait before touching the output, and on every rank: the next collective's result may depend on it.
    """

    def __init__(self, ctx: Rank, sig: Signature, work: Any, payload_bytes: int, output: torch.Tensor,
                 finish: Callable[[], None] | None = None) -> None:
        self._ctx, self._sig, self._work, self._payload = ctx, sig, work, payload_bytes
        self._finish = finish
        self.output = output
        self._waited = False
        # The callback runs on Gloo's thread and must not hold `self` (and through it the group): a work dropped
        # unwaited would then destroy its process group on Gloo's own thread, which aborts the process.
        self._completed: list[float | None] = [None]
        done = self._completed
        try:  # Gloo's all-gather has a future; its one-tensor reduce-scatter has none: then the end is the wait
            work.get_future().add_done_callback(lambda _: done.__setitem__(0, time.perf_counter()))
        except RuntimeError:
            pass

    @property
    def completed_at(self) -> float | None:
        """time.perf_counter() when Gloo completed the collective (None: not yet, or no future to tell)."""
        return self._completed[0]

    @property
    def op(self) -> str:
        return self._sig.op

    def is_completed(self) -> bool:
        return self._waited or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if not self._waited:
            self._work.wait()
            if self._finish is not None:
                self._finish()
            self._waited = True
            self._ctx.end_collective(self._sig, self._payload, end=self.completed_at or time.perf_counter())
        return self.output


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_tensor(ctx: Rank, op: str, tensor: object, name: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != ctx.device.type:
        raise ValueError(f"{op}: {name} is on {tensor.device}, but this rank's group works on {ctx.device}: "
                         f"move it with .to(ctx.device)")
    if tensor.layout != torch.strided:  # sparse: is_contiguous() is False (COO) or raises (CSR)
        raise ValueError(f"{op}: {name} is sparse ({tensor.layout}); collectives take dense tensors: "
                         "call .to_dense() first")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous: call .contiguous() first")
    return tensor


def _output(ctx: Rank, op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
            ) -> torch.Tensor:
    """The caller's `out` checked against the shape and dtype the collective writes, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check_tensor(ctx, op, out, "out")
    if tuple(out.shape) != shape or out.dtype != like.dtype:
        raise ValueError(f"{op}: out must have shape {shape} and dtype {like.dtype}, "
                         f"got {tuple(out.shape)} and {out.dtype}")
    return out


def _check_op(op_name: str, op: str, tensor: torch.Tensor) -> None:
    allowed = ("sum", "mean") if op_name == "reduce_scatter" else tuple(_REDUCE_OPS)
    if op not in allowed:
        raise ValueError(f"{op_name}: op must be one of {', '.join(map(repr, allowed))}, got {op!r}")
    if op == "mean" and not tensor.is_floating_point():
        raise TypeError(f"{op_name}: op='mean' needs a floating-point tensor, got {tensor.dtype}")


def broadcast(ctx: Rank, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy `tensor` from rank `src` into `tensor` on every rank (in place); returns it."""
    _check_tensor(ctx, "broadcast", tensor)
    if not 0 <= src < ctx.world_size:
        raise ValueError(f"broadcast: src must be a rank in 0..{ctx.world_size - 1}, got {src}")
    sig = ctx.begin_collective("broadcast", [tensor], f"src={src}")
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    ctx.group.broadcast([tensor], opts).wait()
    ctx.end_collective(sig, tensor.numel() * tensor.element_size(), src)
    return tensor


_HALF = (torch.float16, torch.bfloat16)


def all_reduce(ctx: Rank, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` over all ranks with `op` ("sum", "mean" or "max"), in place; returns it.

    NaN and inf come out as one process's `torch.stack(...).sum(0)` / `.mean(0)` / `.amax(0)` would give them:
    Gloo's MAX keeps a NaN only when it happens to come first, so "max" carries a NaN mask beside the values (one
    call of twice the size). "mean" of float16/bfloat16 sums in float32 and rounds once at the end, so a mean that
    fits is not lost to an overflowing sum. The ledger records the logical payload (the tensor in its own dtype),
    as for every collective, not these implementation bytes.
    """
    _check_tensor(ctx, "all_reduce", tensor)
    _check_op("all_reduce", op, tensor)
    sig = ctx.begin_collective("all_reduce", [tensor], f"op={op}")
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    if op == "max" and tensor.is_floating_point():
        nan = tensor.isnan()
        both = torch.cat([tensor.masked_fill(nan, float("-inf")).reshape(-1), nan.to(tensor.dtype).reshape(-1)])
        ctx.group.allreduce([both], opts).wait()
        values, any_nan = both.chunk(2)
        tensor.copy_(values.masked_fill(any_nan > 0, float("nan")).view_as(tensor))
    elif op == "mean" and tensor.dtype in _HALF:
        wide = tensor.float()
        ctx.group.allreduce([wide], opts).wait()
        tensor.copy_(wide.div_(ctx.world_size))
    else:
        ctx.group.allreduce([tensor], opts).wait()
        if op == "mean":
            tensor.div_(ctx.world_size)
    ctx.end_collective(sig, tensor.numel() * tensor.element_size())
    return tensor


def all_gather(ctx: Rank, tensor: torch.Tensor, out: torch.Tensor | None = None, *,
               async_op: bool = False) -> Any:
    """Concatenate every rank's `tensor` along dim 0, in rank order, on every rank.

    Returns a tensor of shape (world_size * tensor.shape[0], *tensor.shape[1:]); pass `out` to
    gather into a buffer you own (FSDP does, to free it afterwards). `async_op=True` returns a
    `CollectiveWork` at once: its `wait()` returns that tensor (FSDP's prefetch issues it so).
    """
    _check_tensor(ctx, "all_gather", tensor)
    if tensor.dim() == 0:
        raise ValueError("all_gather: tensor must have at least one dimension: use tensor.reshape(1)")
    n = ctx.world_size
    shape = (n * tensor.shape[0], *tensor.shape[1:])
    out = _output(ctx, "all_gather", out, shape, tensor)
    sig = ctx.begin_collective("all_gather", [tensor])
    # the one-tensor form, straight into out (ProcessGroup.all_gather_single's backend call; a bare
    # ProcessGroupGloo, as the simulator's ranks hold, has only this underscored name for it)
    work = ctx.group._allgather_base(out, tensor)
    if async_op:
        return CollectiveWork(ctx, sig, work, out.numel() * out.element_size(), out)
    work.wait()
    ctx.end_collective(sig, out.numel() * out.element_size())
    return out


# Gloo's two reduce-scatters, measured here (4 processes, 2 cores, median of 20-60 calls):
#   elements        12,704   262,144   1,048,576   4,194,304   10,240,000
#   list form       17 ms    20 ms     28 ms       51 ms       127 ms     (Gloo's reduce-scatter)
#   one-tensor form 5.4 ms   7.3 ms    14 ms       49 ms       121 ms     (an all-reduce of a full copy)
# The one-tensor form is 2-3x faster while latency dominates, but holds a second full-size buffer while it
# runs (torch's MemTracker: +1 unit gradient), which at the article's size put FSDP's peak 11% above
# fully_shard's. So on the CPU small tensors take the fast form, large ones the lean one (NCCL's
# one-tensor form is its native reduce-scatter: always that one on GPUs).
ONE_TENSOR_REDUCE_SCATTER_BELOW = 1 << 20


def reduce_scatter(ctx: Rank, tensor: torch.Tensor, op: str = "sum",
                   out: torch.Tensor | None = None, *, async_op: bool = False) -> Any:
    """Reduce `tensor` over all ranks, then give rank r the r-th of `world_size` equal chunks (dim 0).

    `tensor.shape[0]` must divide by the world size (Gloo needs equal chunks: pad first).
    `async_op=True` returns a `CollectiveWork` whose `wait()` returns the chunk; keep `tensor` alive
    and unchanged until then.
    """
    _check_tensor(ctx, "reduce_scatter", tensor)
    _check_op("reduce_scatter", op, tensor)
    n = ctx.world_size
    if tensor.dim() == 0 or tensor.shape[0] % n:
        raise ValueError(f"reduce_scatter: the first dimension ({tuple(tensor.shape)}) must divide by the "
                         f"world size {n}: pad the tensor to a multiple of {n} first")
    shape = (tensor.shape[0] // n, *tensor.shape[1:])
    out = _output(ctx, "reduce_scatter", out, shape, tensor)
    sig = ctx.begin_collective("reduce_scatter", [tensor], f"op={op}")
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    final, wide = out, op == "mean" and tensor.dtype in _HALF  # a half mean sums in float32 (see all_reduce)
    if wide:
        tensor, out = tensor.float(), torch.empty(shape, dtype=torch.float32, device=tensor.device)
    if tensor.numel() < ONE_TENSOR_REDUCE_SCATTER_BELOW or tensor.device.type != "cpu":  # NCCL: native
        work = ctx.group._reduce_scatter_base(out, tensor, opts)
    else:
        work = ctx.group.reduce_scatter([out], [list(tensor.chunk(n))], opts)

    def finish() -> None:
        if op == "mean":
            out.div_(n)
        if wide:
            final.copy_(out)

    payload = final.numel() * n * final.element_size()  # the logical payload, in the caller's dtype
    if async_op:
        return CollectiveWork(ctx, sig, work, payload, final, finish)
    work.wait()
    finish()
    ctx.end_collective(sig, payload)
    return final


def barrier(ctx: Rank) -> None:
    """Wait until every rank has reached this point."""
    sig = ctx.begin_collective("barrier", [])
    ctx.group.barrier().wait()
    ctx.end_collective(sig, 0)


# -- point to point: the ring exercise's send / recv, watched by the referee ----------------------------------------
class P2PWork:
    """A started send or recv (`isend` / `irecv`). `wait()` blocks until it completes; if Gloo's timeout ends the
    wait, the error says what every rank was doing, and names a deadlock when every rank waits in a send."""

    def __init__(self, ctx: Rank, work: Any, what: str) -> None:
        self._ctx, self._work, self.what = ctx, work, what

    def wait(self) -> None:
        monitor = self._ctx.monitor
        if monitor is not None:
            monitor.p2p_waiting(self._ctx.rank, self.what)
        try:  # Gloo's send/recv wait with the group's connect timeout unless given one (context.gloo_group)
            self._work.wait(datetime.timedelta(seconds=monitor.timeout)) if monitor else self._work.wait()
        except RuntimeError as exc:
            if monitor is None:
                raise
            diagnosis = monitor.p2p_diagnosis(self._ctx.rank)
            raise CollectiveHang(f"rank {self._ctx.rank}: {self.what} failed: {diagnosis}") from exc
        if monitor is not None:
            monitor.p2p_done(self._ctx.rank, self.what)


def _p2p(ctx: Rank, op: str, tensor: torch.Tensor, peer: int, tag: int) -> str:
    _check_tensor(ctx, op, tensor)
    if not 0 <= peer < ctx.world_size or peer == ctx.rank:
        raise ValueError(f"{op}: the peer must be another rank in 0..{ctx.world_size - 1}, got {peer} "
                         f"(this is rank {ctx.rank})")
    direction = "to" if op == "send" else "from"
    return f"{op} {direction} rank {peer} (tag {tag}, shape {tuple(tensor.shape)}, {_dtype_name(tensor)})"


def isend(ctx: Rank, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PWork:
    """Start sending `tensor` to rank `dst`; wait on the result before changing `tensor`."""
    what = _p2p(ctx, "send", tensor, dst, tag)
    return P2PWork(ctx, ctx.group.send([tensor], dst, tag), what)


def irecv(ctx: Rank, tensor: torch.Tensor, src: int, tag: int = 0) -> P2PWork:
    """Start receiving into `tensor` from rank `src` (the sender's shape, dtype and tag must match)."""
    what = _p2p(ctx, "recv", tensor, src, tag)
    return P2PWork(ctx, ctx.group.recv([tensor], src, tag), what)


def send(ctx: Rank, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    """Send `tensor` to rank `dst` and wait until rank `dst` has received it."""
    isend(ctx, tensor, dst, tag).wait()


def recv(ctx: Rank, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receive into `tensor` from rank `src`; returns it."""
    irecv(ctx, tensor, src, tag).wait()
    return tensor

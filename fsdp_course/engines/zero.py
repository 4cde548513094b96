"""ZeRO stages 1 and 2 from scratch: the steps between DDP and FSDP (ZeRO, arXiv:1910.02054).

Every rank still holds all the parameters (so forward and backward are DDP's), but the optimizer
works on one equal chunk of them only. Usage (the engine builds and owns the optimizer):

    engine = ZeRO1(model, ctx, lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss_fn(engine(x_local), y_local).backward()
    engine.step()          # average the gradient of my chunk, update my chunk, all-gather parameters
    engine.zero_grad()

`optimizer_factory` receives this rank's shards: 1-D `nn.Parameter`s, one per bucket (below), that
are views of the flat parameter buffers. Any elementwise torch.optim optimizer (SGD, Adam, AdamW,
...) then does on the chunk exactly what it would do on the whole model; `engine.optimizer` is it.
Its state (Adam's two moments) exists for the chunk only: the saving of ZeRO's stage 1, "P_os".

Layout: the trainable parameters are laid end to end in flat buffers (`flat_param.py`), padded to
a multiple of the world size N, and the model's parameters become views of them, so the all-gather
writes straight into the model. Rank r owns the r-th of N equal chunks (its "shard").

ZeRO1 (P_os): gradients accumulate into one full flat gradient buffer per dtype (`p.grad` are its
  views), as in DDP. `step()` reduce-scatters it (op="mean"): this rank receives the average of its
  own chunk, written back over that chunk. Steps its chunk, then all-gathers the parameters.
ZeRO2 (P_os+g): gradients are reduce-scattered during backward, bucket by bucket (about
  `bucket_numel` elements each, in the order the gradients become ready), and the full gradients
  of a bucket are dropped as soon as it is reduced: only this rank's averaged chunk (4 Psi / N
  bytes) stays. The full gradient never exists at once, which lowers the peak too. Buckets are
  reduced strictly in order (so every rank issues the same collectives), and the order is a guess:
  reverse registration order. Where the guess is off, gradients wait for their bucket's turn, and
  the measured peak shows it (a pre-norm Transformer layer registers norm1 last but uses it first,
  so its bucket completes only at the end of the layer's backward). PyTorch's DDP rebuilds its
  buckets after the first step in the order rank 0 observed.

Traffic: the ZeRO paper (section 7.2.1) notes that an all-reduce *is* a reduce-scatter followed by an
all-gather. DDP all-reduces gradients (2 Psi (N-1)/N per rank); ZeRO-1 and ZeRO-2 reduce-scatter
gradients (Psi (N-1)/N) and all-gather parameters (Psi (N-1)/N): the same 2 Psi (N-1)/N, with Psi
the padded size. All-reducing the gradients in ZeRO-1 and then all-gathering would cost 3 Psi; the
full averaged gradient is not needed, only this rank's chunk of it. So in ZeRO-1, `p.grad` keeps
the *local* (not averaged) gradient outside this rank's chunk: what distinguishes ZeRO-1 from
ZeRO-2 is memory (the full gradient buffer kept alive), not traffic.

Memory per rank, fp32 AdamW (`memory.zero_formula`): ZeRO-1 4 Psi params + 4 Psi grads +
8 Psi / N optimizer = 8 Psi + 8 Psi/N; ZeRO-2 4 Psi + 4 Psi/N + 8 Psi/N = 4 Psi + 12 Psi/N.
Limits: one param group (per-parameter options such as no weight decay for biases are lost), and
optimizers that look at a whole tensor (LAMB's trust ratio) would see the chunk instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_course.engines.ddp import broadcast_module
from fsdp_course.fsdp.flat_param import FlatGrads, FlatParamLayout, flatten_params
from fsdp_course.hooks import queue_after_backward
from fsdp_course.memory import optimizer_tensors, record_event
from fsdp_course.runtime.context import RankContext

__all__ = ["OptimizerFactory", "ShardedBucket", "ZeRO1", "ZeRO2", "bucket_parameters"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ShardedBucket:
    """Some trainable parameters as one padded flat buffer; this rank owns one equal chunk of it."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], ctx: RankContext) -> None:
        self.rank = ctx.rank
        self.params = [p for _, p in named]
        self.layout: FlatParamLayout
        self.layout, self.flat_param = flatten_params(named, ctx.world_size)  # (padded_numel,)
        with torch.no_grad():
            for p, view in zip(self.params, self.layout.unflatten(self.flat_param), strict=True):
                p.data = view  # the model now computes with views of the flat buffer: no second copy
        self.shard = nn.Parameter(self.layout.shard(self.flat_param, ctx.rank))  # (padded // N,) a view

    @property
    def names(self) -> list[str]:
        return self.layout.names


class _ZeRO(nn.Module):
    """What ZeRO-1 and ZeRO-2 share: buckets, the sharded optimizer, `step()` and the all-gather."""

    stage = 0

    def __init__(self, module: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory,
                 groups: list[list[tuple[str, nn.Parameter]]]) -> None:
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self.memory_recorder = None
        self.buckets = [ShardedBucket(group, ctx) for group in groups]
        self.optimizer = optimizer_factory([b.shard for b in self.buckets])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def reduce_gradients(self) -> None:
        """Leave the averaged gradient of this rank's chunk in each `bucket.shard.grad`."""

    def step(self) -> None:
        """Update this rank's chunk with the optimizer, then all-gather the full parameters."""
        self.reduce_gradients()
        self.optimizer.step()  # touches only this rank's chunk: 1/N of the optimizer state exists
        record_event(self, "optimizer step")
        for b in self.buckets:
            # The input is a copy: it must not alias the output chunk it is gathered into.
            self.ctx.all_gather(b.shard.detach().clone(), out=b.flat_param)  # (padded_numel,)
        record_event(self, "all_gather parameters")

    def zero_grad(self) -> None:
        raise NotImplementedError

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category (see fsdp_course.memory)."""
        return {
            "params": [b.flat_param for b in self.buckets] + list(self.module.parameters()),
            "grads": self._grad_tensors(),
            "sharded_grads": [b.shard.grad for b in self.buckets if b.shard.grad is not None],
            "buffers": list(self.module.buffers()),
            "optimizer": optimizer_tensors(self.optimizer),
        }


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class ZeRO1(_ZeRO):
    """ZeRO stage 1: optimizer state sharded; full gradients accumulate locally, reduced in `step()`."""

    stage = 1

    def __init__(self, module: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory) -> None:
        broadcast_module(module, ctx)
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for name, p in _trainable(module):
            by_dtype.setdefault(p.dtype, []).append((name, p))
        super().__init__(module, ctx, optimizer_factory, list(by_dtype.values()))
        # per bucket, the full gradient kept alive (`p.grad` are its views); the shard's .grad is my chunk of it
        self.flat_grads = [FlatGrads(b.layout, b.params) for b in self.buckets]
        for b, grads in zip(self.buckets, self.flat_grads, strict=True):
            b.shard.grad = b.layout.shard(grads.flat, ctx.rank)  # (padded // N,) a view of my chunk

    def reduce_gradients(self) -> None:
        for b, grads in zip(self.buckets, self.flat_grads, strict=True):
            grads.collect()
            averaged = self.ctx.reduce_scatter(grads.flat, op="mean")  # (padded // N,) my chunk, averaged
            b.shard.grad = b.layout.shard(grads.flat, b.rank)  # (padded // N,) a view of my chunk
            b.shard.grad.copy_(averaged)  # written over my chunk of the local gradient
        record_event(self, "reduce_scatter gradients")

    def zero_grad(self) -> None:
        for grads in self.flat_grads:
            grads.zero_()


class ZeRO2(_ZeRO):
    """ZeRO stage 2: optimizer state and gradients sharded; gradients reduce-scattered during backward."""

    stage = 2

    def __init__(self, module: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory,
                 *, bucket_numel: int = 4096) -> None:
        broadcast_module(module, ctx)
        super().__init__(module, ctx, optimizer_factory, bucket_parameters(_trainable(module), bucket_numel))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._waiting = [len(b.params) for b in self.buckets]  # gradients not ready yet, per bucket
        self._next = 0  # buckets are reduced strictly in order, so every rank issues the same collectives
        self._callback_queued = False
        self._in_flight: torch.Tensor | None = None
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._reset_backward()  # a backward that raised never finished: start afresh
        return self.module(*args, **kwargs)

    def _reset_backward(self) -> None:
        self._waiting = [len(b.params) for b in self.buckets]
        self._next = 0
        self._callback_queued = False

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_after_backward(self._finish_backward)
        self._waiting[self._bucket_of[id(param)]] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._reduce_bucket(self._next)
            self._next += 1

    def _finish_backward(self) -> None:
        """Buckets with a parameter that got no gradient this time are reduced now, with zeros."""
        for i in range(self._next, len(self.buckets)):
            self._reduce_bucket(i)
        self._reset_backward()

    def _reduce_bucket(self, i: int) -> None:
        b = self.buckets[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        self._in_flight = b.layout.flatten(grads)  # (padded_numel,) this bucket's local gradient
        averaged = self.ctx.reduce_scatter(self._in_flight, op="mean")  # (padded // N,) my chunk
        record_event(self, f"reduce_scatter {b.names[0]}")  # full gradients of the bucket still alive
        b.shard.grad = averaged if b.shard.grad is None else b.shard.grad.add_(averaged)
        self._in_flight = None
        for p in b.params:
            p.grad = None  # the full gradient is gone: only my averaged chunk remains

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.shard.grad = None
            for p in b.params:
                p.grad = None

    def _grad_tensors(self) -> list[torch.Tensor]:
        return super()._grad_tensors() + ([self._in_flight] if self._in_flight is not None else [])


def bucket_parameters(named: list[tuple[str, nn.Parameter]],
                       bucket_numel: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Group parameters in reverse order (about the order backward produces gradients), one dtype per bucket.

    A bucket takes parameters until it holds `bucket_numel` elements; a larger parameter gets its own.
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named):
        if not buckets or size + p.numel() > bucket_numel or buckets[-1][0][1].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += p.numel()
    return buckets

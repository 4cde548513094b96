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
  `bucket_numel` elements each), and a bucket's full gradient is dropped as soon as it is reduced:
  only this rank's averaged chunk (4 Psi / N bytes) stays. Buckets are reduced strictly in order (so
  every rank issues the same collectives), so their order must be the order in which the backward
  pass makes gradients ready. At construction that order is a guess (reverse registration order),
  which a pre-norm Transformer layer breaks: it registers norm1 last but uses it first, so norm1's
  gradient comes last. So, as PyTorch's DDP does (torch/nn/parallel/distributed.py: by default one
  bucket for everything in the first iteration, `compute_bucket_size_limits`; buckets rebuilt in the order
  gradients became ready before the second, `_rebuild_buckets`, with rank 0's order taken by every
  rank, reducer.cpp's `sync_bucket_indices`), the first backward only records the order and keeps
  its gradients (ZeRO-1's memory, once); at its end every rank takes rank 0's order (a broadcast),
  the buckets are rebuilt in it (new flat buffers; the optimizer, which has no state yet, gets the new
  shards) and reduce-scattered. From then on, gradients are copied into their bucket's flat gradient
  as they arrive (`p.grad` becomes a view of it: DDP's gradient_as_bucket_view), and the
  reduce-scatter reads that buffer: no flattened copy. The peak is then 4 Psi + 12 Psi / N plus the
  flat gradient of the one bucket being filled or reduced (and, for the moment of a copy, the fresh
  gradient autograd hands over); tests/test_zero.py measures it, and checks the rebuilt order against
  torch's DDP on the same ranks.

Traffic: the ZeRO paper notes that an all-reduce *is* a reduce-scatter followed by an all-gather
(section 7.1), and that P_os and P_os+g therefore add no communication (section 7.2.1). DDP
all-reduces gradients (2 Psi (N-1)/N per rank); ZeRO-1 and ZeRO-2 reduce-scatter gradients
(Psi (N-1)/N) and all-gather parameters (Psi (N-1)/N): the same 2 Psi (N-1)/N, with Psi the padded
size (ZeRO-2 adds, once, the broadcast of rank 0's order). All-reducing the gradients in ZeRO-1 and
then all-gathering would cost 3 Psi; the full averaged gradient is not needed, only this rank's
chunk of it. So in ZeRO-1, `p.grad` keeps the *local* (not averaged) gradient outside this rank's
chunk: what distinguishes ZeRO-1 from ZeRO-2 is memory (the full gradient buffer kept alive), not
traffic.

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
from fsdp_course.holders import holds
from fsdp_course.hooks import queue_after_backward, weak_method
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

    @holds()
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

    @holds()
    def __init__(self, module: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory,
                 *, bucket_numel: int = 4096) -> None:
        broadcast_module(module, ctx)
        named = _trainable(module)
        # the first guess of the order gradients become ready in: reverse registration order
        super().__init__(module, ctx, optimizer_factory, bucket_parameters(list(reversed(named)), bucket_numel))
        if len(self.optimizer.param_groups) != 1:
            raise ValueError("ZeRO2 supports one param group: optimizer_factory must not split the shards")
        self.bucket_numel = bucket_numel
        self.rebuilt = False  # True once the buckets follow the order gradients became ready in
        self._named = named
        self._index = {id(p): i for i, (_, p) in enumerate(named)}
        self._ready: list[int] = []  # indices into `named`, in the order their gradients became ready
        self._callback_queued = False
        self._init_bucket_state()
        for _, p in named:
            p.register_post_accumulate_grad_hook(weak_method(self._on_gradient_ready))  # no cycle: hooks.py

    def _init_bucket_state(self) -> None:
        self._bucket_of = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._grad_flats: list[torch.Tensor | None] = [None] * len(self.buckets)  # a bucket's gradient, if any
        self._grad_views: list[list[torch.Tensor]] = [[] for _ in self.buckets]  # its views, `p.grad`
        self._reset_backward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._callback_queued:  # a backward that raised never finished: drop what it left
            for b in self.buckets:
                for p in b.params:
                    p.grad = None
            self._grad_flats = [None] * len(self.buckets)
            self._grad_views = [[] for _ in self.buckets]
            self._ready = []
            self._reset_backward()
        return self.module(*args, **kwargs)

    def _reset_backward(self) -> None:
        self._waiting = [len(b.params) for b in self.buckets]  # gradients not ready yet, per bucket
        self._next = 0  # buckets are reduced strictly in order, so every rank issues the same collectives
        self._callback_queued = False

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_after_backward(self._finish_backward)
        if not self.rebuilt:  # the first backward learns the order and keeps the gradient
            self._ready.append(self._index[id(param)])
            return
        i, j = self._bucket_of[id(param)]
        self._into_bucket(i, j, param)
        self._waiting[i] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._reduce_bucket(self._next)
            self._next += 1

    def _into_bucket(self, i: int, j: int, param: nn.Parameter) -> None:
        """Move `param`'s gradient into its place in bucket i's flat gradient; `param.grad` becomes a view of it.

        The flat gradient is allocated when the bucket's first gradient arrives (zeros: the padding, and the
        parameters that get no gradient). For the moment of the copy the gradient autograd produced is alive
        beside its place, as when DDP adds it into its bucket view (gradient_as_bucket_view). A bucket that is
        one parameter needing no padding needs no copy at all: the gradient autograd produced is the bucket.
        """
        layout = self.buckets[i].layout
        grad = param.grad
        if self._grad_flats[i] is None and len(layout.infos) == 1 and layout.padded_numel == param.numel() \
                and grad is not None and grad.is_contiguous():
            self._grad_flats[i], self._grad_views[i] = grad.view(-1), [grad]  # (padded_numel,) no copy
            return
        if self._grad_flats[i] is None:
            flat = torch.zeros(layout.padded_numel, dtype=layout.dtype,
                               device=param.device)  # (padded_numel,) bucket i's local gradient
            self._grad_flats[i], self._grad_views[i] = flat, layout.unflatten(flat)
        view = self._grad_views[i][j]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view  # the tensor autograd allocated is freed here

    def _finish_backward(self) -> None:
        """After the first backward: rebuild the buckets, reduce everything. Later: reduce what is left."""
        if not self.rebuilt:
            self._rebuild_buckets()
            for i, b in enumerate(self.buckets):  # the first backward's gradients, in the new buckets
                for j, p in enumerate(b.params):
                    self._into_bucket(i, j, p)
        for i in range(self._next, len(self.buckets)):  # buckets with a parameter that got no gradient: zeros
            self._reduce_bucket(i)
        self._reset_backward()

    def _rebuild_buckets(self) -> None:
        """Buckets in the order the first backward made gradients ready, as rank 0 saw it (DDP's rebuild)."""
        if self.optimizer.state:
            raise RuntimeError("ZeRO2 rebuilds its buckets at the end of the first backward, which must come "
                               "before the first optimizer step")
        seen = set(self._ready)
        never = [i for i in reversed(range(len(self._named))) if i not in seen]  # no gradient: last, as guessed
        order = torch.tensor(self._ready + never, dtype=torch.int64)  # (number of parameters,)
        self.ctx.broadcast(order, src=0)  # every rank must cut the same buckets: rank 0's order
        groups = bucket_parameters([self._named[i] for i in order.tolist()], self.bucket_numel)
        self.buckets = [ShardedBucket(group, self.ctx) for group in groups]  # the parameters move into new flats
        self.optimizer.param_groups[0]["params"] = [b.shard for b in self.buckets]  # no state yet: nothing lost
        self.rebuilt = True
        self._ready = []
        self._init_bucket_state()

    def _reduce_bucket(self, i: int) -> None:
        b = self.buckets[i]
        flat = self._grad_flats[i]
        if flat is None:  # no parameter of this bucket got a gradient on this rank
            flat = self._grad_flats[i] = torch.zeros(b.layout.padded_numel, dtype=b.layout.dtype)
        averaged = self.ctx.reduce_scatter(flat, op="mean")  # (padded // N,) my chunk, straight from the bucket
        b.shard.grad = averaged if b.shard.grad is None else b.shard.grad.add_(averaged)
        record_event(self, f"reduce_scatter {b.names[0]}")  # the bucket's gradient still alive, beside my chunk
        for p in b.params:
            p.grad = None  # the full gradient is gone: only my averaged chunk remains
        self._grad_flats[i], self._grad_views[i] = None, []

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.shard.grad = None
            for p in b.params:
                p.grad = None

    def _grad_tensors(self) -> list[torch.Tensor]:
        return super()._grad_tensors() + [f for f in self._grad_flats if f is not None]


def bucket_parameters(named: list[tuple[str, nn.Parameter]],
                      bucket_numel: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Group parameters into buckets in the given order (the order their gradients are expected), one dtype each.

    A bucket takes parameters until it holds `bucket_numel` elements; a larger parameter gets its own.
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in named:
        if not buckets or size + p.numel() > bucket_numel or buckets[-1][0][1].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += p.numel()
    return buckets

"""Distributed Data Parallel from scratch: every rank holds the whole model, gradients are averaged.

The first step of the course's ladder DDP -> ZeRO-1 -> ZeRO-2 -> FSDP (ZeRO, arXiv:1910.02054,
section 2 and figure 1: "data parallelism" replicates all model states on every rank). Usage:

    model = copy.deepcopy(base)                    # every rank builds the same architecture
    ddp = DDP(model, ctx)                          # rank 0's initial parameters and buffers win
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loss_fn(ddp(x_local), y_local).backward()      # gradients are averaged over the ranks here
    opt.step(); opt.zero_grad()

What `DDP` does, and where:
  - construction: broadcast every parameter and buffer from rank 0 (`broadcast_module`), so the
    replicas start equal even when the ranks were seeded differently;
  - during backward: a post-accumulate-grad hook on each trainable parameter; the first one to fire
    queues a callback with autograd's engine, which runs once when the whole backward is done;
  - end of backward (`_finish_backward`): the gradients live in one flat buffer per dtype (each
    `p.grad` is a view of it, like PyTorch's `gradient_as_bucket_view=True`); one all-reduce with
    op="mean" averages it. Per step that is one all-reduce of Psi elements: 2 Psi (N-1)/N per rank
    under the ring model, ZeRO's baseline (section 7);
  - `no_sync()`: backward passes inside it only accumulate locally; the first backward after it
    averages everything accumulated (gradient accumulation without extra traffic).

PyTorch's DDP overlaps communication with backward by reducing ~25 MB buckets as they fill; one
bucket at the end is simpler to read and moves exactly the same bytes.
A parameter that got no gradient on this rank contributes zeros (other ranks may have used it).
Memory per rank with fp32 AdamW: parameters 4 Psi + gradients 4 Psi + Adam's two moments 8 Psi
= 16 Psi (`memory.zero_formula(psi, n, "ddp")`); see `memory_tensors()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fsdp_course.fsdp.flat_param import FlatGrads, FlatParamLayout
from fsdp_course.holders import holds
from fsdp_course.hooks import queue_after_backward, weak_method
from fsdp_course.memory import record_event
from fsdp_course.runtime.context import RankContext

__all__ = ["DDP", "broadcast_module"]


def broadcast_module(module: nn.Module, ctx: RankContext, src: int = 0) -> None:
    """Overwrite every parameter and buffer of `module` with rank `src`'s values (in place).

    One broadcast per dtype: the tensors are packed into one flat buffer and unpacked again
    (a collective has a fixed cost, so one large call beats many small ones).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*module.parameters(), *module.buffers()]:  # tied parameters come once
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = ctx.broadcast(torch.cat([t.reshape(-1) for t in tensors]), src)  # (numel,)
            for t, values in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(values.view_as(t))


class DDP(nn.Module):
    """Data parallel wrapper: same model on every rank, gradients averaged by one all-reduce per step.

    `parameters()` / `named_parameters()` are the wrapped module's own (same names), so an optimizer
    built on them works; `ddp(x)` runs the module's forward.
    """

    @holds()
    def __init__(self, module: nn.Module, ctx: RankContext) -> None:
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.timeline: list[tuple[str, dict[str, int]]] = []  # filled when a memory recorder is attached
        self.memory_recorder = None
        self.require_gradient_sync = True
        self._callback_queued = False
        broadcast_module(module, ctx)
        trainable = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.grad_buffers = [FlatGrads(FlatParamLayout.build([(str(i), p) for i, p in enumerate(params)], 1), params)
                             for params in by_dtype.values()]
        for p in trainable:
            p.register_post_accumulate_grad_hook(weak_method(self._on_gradient_ready))  # no cycle: hooks.py

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._callback_queued = False  # a backward that raised never ran its callback: start afresh
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under their own names (no "module." prefix)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate local gradients; the next one outside averages them."""
        previous, self.require_gradient_sync = self.require_gradient_sync, False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if self.require_gradient_sync and not self._callback_queued:
            self._callback_queued = True
            queue_after_backward(self._finish_backward)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for buffer in self.grad_buffers:
            buffer.collect()
            self.ctx.all_reduce(buffer.flat, op="mean")  # (numel,) every gradient, averaged in place
        record_event(self, "all_reduce gradients")

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category (see fsdp_course.memory): everything, in full."""
        return {
            "params": list(self.module.parameters()),
            "grads": [b.flat for b in self.grad_buffers]
                     + [p.grad for p in self.module.parameters() if p.grad is not None],
            "buffers": list(self.module.buffers()),
        }

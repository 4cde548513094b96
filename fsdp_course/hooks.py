"""Autograd hooks that every engine uses: "backward has finished" and "this output's gradient arrived".

Kept below the engines (DDP, ZeRO, FSDP all import it; none imports another engine for it). Both are the
mechanisms PyTorch's own DDP and FSDP use: autograd's engine runs queued callbacks once a backward call has
finished (`Variable._execution_engine.queue_callback`, which torch/distributed/fsdp/_fully_shard/_fsdp_state.py
uses for its root's final callback), and a tensor hook runs when the gradient of that tensor is ready
(FSDP2's pre-backward hook, `FSDPState._register_pre_backward_hook`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["queue_after_backward", "register_grad_hooks", "weak_method"]


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward pass that is running now has finished (call it from a hook).

    A backward that raises drops its queued callbacks: an engine that queued one must notice on its next forward.
    """
    Variable._execution_engine.queue_callback(callback)


def register_grad_hooks(outputs: Any, fn: Callable[[], None]) -> None:
    """Call fn() when the gradient of any tensor in `outputs` (nested tuples/lists/dicts) arrives."""
    if isinstance(outputs, torch.Tensor):
        if outputs.requires_grad:
            outputs.register_hook(lambda grad: fn())
    elif isinstance(outputs, (tuple, list)):
        for o in outputs:
            register_grad_hooks(o, fn)
    elif isinstance(outputs, dict):
        for o in outputs.values():
            register_grad_hooks(o, fn)


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (a bound method) as a function that holds its object weakly, for a hook on a tensor the object owns.

    An engine that registers `param.register_post_accumulate_grad_hook(self._on_gradient_ready)` on its own
    parameters makes a cycle (engine -> parameter -> hook -> engine) that runs through autograd's C++ hook list,
    which Python's garbage collector cannot see: the engine, its model and its process group (with Gloo's threads)
    would live until the interpreter exits. Once the object is gone the hook does nothing.
    """
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call

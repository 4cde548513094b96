"""What the FSDP files share: the two state enums, the placeholder a sharded parameter leaves behind, and the
autograd function that runs a unit's post-backward when the gradient of its inputs arrives.

Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_common.py (`TrainingState`) and _fsdp_param.py
(`ShardedState`); `RegisterPostBackward` is FSDP2's `RegisterPostBackwardFunction` (_fsdp_param_group.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Any

import torch
from torch.overrides import resolve_name

__all__ = ["RegisterPostBackward", "ShardedAway", "ShardedState", "TrainingState", "sharded_away"]


class ShardedState(Enum):
    SHARDED = auto()  # only the local shard exists
    UNSHARDED = auto()  # the whole flat parameter is gathered


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # from the arrival of the output's gradient; a forward recomputed now reuses the gather
    POST_BACKWARD = auto()


class ShardedAway(torch.Tensor):
    """A placeholder tensor: metadata (shape, dtype, device) works, any computation raises `note`."""

    _METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "ndim", "dim", "size",
                           "numel", "is_floating_point"})
    note: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        parts = (resolve_name(func) or "").split(".")
        if len(parts) >= 3 and parts[:2] == ["torch", "Tensor"] and parts[2] in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        note = next((a.note for a in args if isinstance(a, ShardedAway)), "sharded by FSDP")
        raise RuntimeError(note)

    def __repr__(self) -> str:  # printing must not raise
        return f"ShardedAway({self.note})"


def sharded_away(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, note: str,
                 device: torch.device | str = "cpu") -> ShardedAway:
    base = torch.zeros((), dtype=dtype, device=device).expand(shape)  # 1 element of storage, any shape
    t = torch.Tensor._make_subclass(ShardedAway, base)
    t.note = note
    return t


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs `callback()` when their gradient arrives, which is after every
    node of the unit's backward that leads to them: the unit's frozen weights are no longer needed then."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)

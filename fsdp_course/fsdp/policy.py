"""What FSDP is told about precision and placement: `MixedPrecision` and `OffloadPolicy`, the course's
`MixedPrecisionPolicy` and `CPUOffloadPolicy`.

Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_api.py (`MixedPrecisionPolicy`, the same four fields with the
same meaning; `CPUOffloadPolicy`) and `_cast_fp_tensor` of _fsdp_common.py. Mixed precision as in Micikevicius et
al., "Mixed Precision Training" (arXiv:1710.03740): fp32 master weights, half-precision compute, fp32 (or scaled)
gradients; ZeRO (arXiv:1910.02054, section 3) counts its memory as 2 + 2 + 12 bytes per parameter.

With `FSDP(..., mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`:
  - the shard (what the optimizer steps) stays in the model's dtype, fp32: it is the master copy, so the
    optimizer's state and update are fp32 and nothing else keeps an fp32 copy;
  - unshard casts the shard to `param_dtype` and all-gathers that: half the bytes of an fp32 gather;
  - forward and backward compute in `param_dtype` (the module's attributes are `param_dtype` views), with
    floating-point inputs cast to it at each unit's entry (`cast_forward_inputs`);
  - the unsharded gradient (`param_dtype`) is cast to `reduce_dtype` and reduce-scattered in it, then added to
    the shard's fp32 `.grad`; under `set_requires_gradient_sync(False)` gradients accumulate in `reduce_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["MixedPrecision", "OffloadPolicy", "cast_floating"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes of FSDP's all-gather and compute (`param_dtype`), of its gradient reduction (`reduce_dtype`,
    default: `param_dtype`) and of each unit's outputs (`output_dtype`, default: left as computed). None keeps the
    parameters' own dtype. Field for field torch's `MixedPrecisionPolicy`."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise TypeError(f"MixedPrecision: {name} must be a floating-point torch.dtype such as "
                                f"torch.bfloat16 or torch.float32 (or None), got {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):  # a string such as 'no' would be true
            raise TypeError(f"MixedPrecision: cast_forward_inputs must be True or False, got "
                            f"{self.cast_forward_inputs!r}")

    def gather_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the all-gather and of the unsharded parameters."""
        return self.param_dtype or shard_dtype

    def grad_reduce_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient is reduced in (as FSDP2: reduce_dtype, else param_dtype, else the shard's)."""
        return self.reduce_dtype or self.param_dtype or shard_dtype


@dataclass(frozen=True)
class OffloadPolicy:
    """FSDP's CPU offload (the name mirrors torch's `CPUOffloadPolicy`): `FSDP(..., offload_policy=OffloadPolicy())`.

    Sharded parameters, their gradients and the optimizer state live on the host; each all-gather's input is the
    host shard copied to the device, each reduce-scattered gradient chunk is copied back to the host, and the
    optimizer steps there (the copies: flat_param.py). torch's `pin_memory` (page-locked host memory for
    asynchronous copies) has no field here: pinning needs an accelerator, and these copies are synchronous."""


def cast_floating(dtype: torch.dtype | None, tree: Any) -> Any:
    """Every floating-point tensor in `tree` (args, kwargs, outputs) cast to `dtype`; the rest untouched."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.dtype != dtype else x, tree)

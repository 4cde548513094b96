"""PyTorch's own FSDP (`fully_shard`, "FSDP2") set up the way the course's FSDP is, for side-by-side runs.

`shard_with_fully_shard(model, ctx)` applies `torch.distributed.fsdp.fully_shard` bottom-up, as its
docs ask: one FSDP unit per `nn.TransformerEncoderLayer`, then the root (embeddings, final norm,
head), the same units as `FSDP(model, ctx, wrap={nn.TransformerEncoderLayer})`. Where the course's
FSDP keeps one flat parameter per unit, `fully_shard` keeps each parameter as a `DTensor` sharded
on dim 0 (FSDPParam), gathers a unit's parameters in one all-gather (FSDPParamGroup.unshard) and
reduce-scatters its gradients in one collective: the design of the FSDP paper (arXiv:2304.11277),
rebuilt in FSDP2 around DTensor. Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html

`mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` goes to every
`fully_shard` call (fully_shard's mixed precision: fp32 sharded parameters, all-gather and compute in
`param_dtype`, gradients reduce-scattered in `reduce_dtype`). `prefetch=k` sets explicit prefetching,
k units ahead, as the docs of `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` show:
each layer unit prefetches the next k in forward and the previous k in backward, and the root (which
runs first: it holds the embeddings) the first k in forward, as the course's `FSDP(..., prefetch=k)` does.
On CPU FSDP2 has no streams and blocks on every all-gather unless `_set_unshard_async_op(True)` is set
(private; its docstring: "you must use explicit prefetching ... to still get overlap"): with prefetch it is.

A model built on the meta device is sharded first and materialized after (`to_empty`), one piece
at a time from `meta_init.materialize`, so no rank ever holds the whole model.

`count_collectives(ctx)` makes `fully_shard`'s collectives visible in the course's traffic ledger
(`ctx.ledger`, ring cost model), so bytes per step compare with the course's engines.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_course.fsdp.meta_init import materialize
from fsdp_course.runtime.context import RankContext

__all__ = ["count_collectives", "full_state_dict", "shard_with_fully_shard", "watch_collectives"]


def shard_with_fully_shard(model: nn.Module, ctx: RankContext, *, seed: int | None = None,
                           unit: type[nn.Module] = nn.TransformerEncoderLayer,
                           mp_policy: MixedPrecisionPolicy | None = None, prefetch: int = 0) -> nn.Module:
    """Shard `model` in place with fully_shard (one unit per `unit` instance, plus the root); returns it.

    A model on the meta device is then materialized piece by piece from `seed` (meta_init); a real
    model must already hold the same values on every rank (fully_shard does not broadcast).
    `mp_policy` (torch's MixedPrecisionPolicy) applies to every unit and the root; `prefetch=k` makes each
    unit prefetch the all-gathers of the next k units in forward and of the previous k in backward.
    """
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be the number of units to gather ahead (0, 1, 2 ...), got {prefetch!r}")
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and seed is None:
        raise ValueError("a model on the meta device needs the seed to materialize its weights")
    template = None
    if on_meta:  # a second meta copy to materialize from: fully_shard turns the model's params into DTensors
        if not hasattr(model, "config"):
            raise TypeError(f"cannot rebuild {type(model).__name__} on the meta device: it needs a .config")
        with torch.device("meta"):
            template = type(model)(model.config)
    policy = mp_policy or MixedPrecisionPolicy()  # fully_shard's default: no casts
    units = [module for module in model.modules() if isinstance(module, unit)]
    for module in units:
        fully_shard(module, mesh=mesh, mp_policy=policy)  # one FSDPParamGroup: one all-gather, one reduce-scatter
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: whatever no unit owns
    if prefetch:
        sharded = [m for m in units if isinstance(m, FSDPModule)]  # fully_shard changed each one's class
        root: Any = model  # an FSDPModule now too
        root.set_modules_to_forward_prefetch(sharded[:prefetch])  # the root runs first: it starts the chain
        for i, module in enumerate(sharded):
            module.set_modules_to_forward_prefetch(sharded[i + 1 : i + 1 + prefetch])
            module.set_modules_to_backward_prefetch(sharded[max(0, i - prefetch) : i][::-1])
        if ctx.device.type == "cpu":
            # without streams, fully_shard waits for every all-gather it issues, prefetched ones included
            # (unshard_async_op defaults to False): the documented-private switch issues them async, so a
            # prefetched gather runs while the current unit computes, as the course's prefetch does
            root._set_unshard_async_op(True)
    if template is not None:
        model.to_empty(device=ctx.device)  # allocates the local shards only
        _load_pieces(model, template, seed, mesh)  # type: ignore[arg-type]  (seed checked above)
    return model


@torch.no_grad()
def _load_pieces(model: nn.Module, template: nn.Module, seed: int, mesh: DeviceMesh) -> None:
    params = dict(model.named_parameters())
    done = set()
    # one piece at a time, drawn on the CPU (a GPU's RNG would give other values than init_weights)
    for _, full in materialize(template, seed, device="cpu"):
        for name, value in full.items():
            param = params[name]
            # src_data_rank=None: every rank computed the same values, so each keeps its chunk, no comm
            value = value.to(param.device)
            param.copy_(distribute_tensor(value, mesh, param.placements, src_data_rank=None))
            done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise RuntimeError(f"meta-device parameters left uninitialized: {missing}")


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors keyed as the unwrapped model's state_dict(), on every rank (a collective)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


# -- the ledger for fully_shard's collectives ------------------------------------------------------
# torch.distributed's name: (the course's op, the argument that holds the full, unsharded tensor)
_COUNTED = {"all_gather_single": ("all_gather", "output_tensor"),
            "all_gather_into_tensor": ("all_gather", "output_tensor"),
            "reduce_scatter_single": ("reduce_scatter", "input"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
            "all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor")}


@contextlib.contextmanager
def watch_collectives(seen: Callable[[str, torch.Tensor, dict[str, Any]], None]) -> Iterator[None]:
    """While active, every torch.distributed collective above calls `seen(op, full_tensor, arguments)` once it has
    run: the course's name of the op, the full tensor, and all its arguments by name (defaults included)."""
    originals: dict[str, Callable[..., Any]] = {name: getattr(dist, name) for name in _COUNTED
                                                if hasattr(dist, name)}

    def watched(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op, full = _COUNTED[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            seen(op, bound.arguments[full], bound.arguments)
            return result
        return call

    for name, fn in originals.items():
        setattr(dist, name, watched(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def count_collectives(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
    """While active, every torch.distributed collective above is also recorded in `ctx.ledger`."""
    def record(op: str, t: torch.Tensor, arguments: dict[str, Any]) -> None:
        sig = ctx.begin_collective(op, [t])
        ctx.end_collective(sig, t.numel() * t.element_size(), arguments.get("src") or 0)

    return watch_collectives(record)

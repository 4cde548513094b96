"""The flat parameter: many parameters laid end to end in one padded 1-D buffer, cut into equal shards.

This is the Python version of the article's `shardParameters` / `flattenParams` / `unflattenParams`
(its Java FSDP trainer), and of what the PyTorch FSDP paper (arXiv:2304.11277, section 3.2.1,
"FlatParameter") calls a FlatParameter: the parameters of one FSDP unit are flattened and
concatenated into one 1-D tensor, padded at the end so that it divides evenly by the world size,
and rank r keeps the r-th equal chunk.  ZeRO (arXiv:1910.02054) partitions its fp32 state the same
way; the DDP / ZeRO-1 / ZeRO-2 engines use this module too.

Three pieces: `FlatParamLayout` (where each parameter lives: flatten, pad, shard, unflatten), `FlatParamHandle`
(one FSDP unit's flat parameter: the local shard and the unsharded buffer it allocates, frees and cuts into views;
it issues no collective, the unit does) and `FlatGrads` (DDP's and ZeRO-1's flat gradient buffer, `p.grad` its
views). The words are in the glossary of fsdp_course/fsdp/__init__.py.

CPU offload (`OffloadPolicy`, policy.py; torch's `CPUOffloadPolicy`: torch/distributed/fsdp/_fully_shard/_fsdp_api.py
and _fsdp_param.py): the shard, its gradient and the optimizer state live in host memory. `all_gather_input()` copies
the host shard into a fresh device tensor before the all-gather (torch: `sharded_param_data.to(device)` in
`FSDPParam.all_gather_inputs`), and `grad_to_host()` copies the reduce-scattered gradient chunk into a fresh host
tensor (torch: `new_sharded_grad.to(cpu)` in `foreach_reduce`); the optimizer then steps on the host. On a CPU-only
machine both pools are CPU memory: the copies are still real copies (distinct storages), counted in a
`CopyCounter` (bytes host-to-device and device-to-host), and the memory tracker files the shards, their gradients
and the optimizer state under the "host" pool.

Why pad: the article computes `shardSize = ceil(total / worldSize)` and lets the last rank keep a
shorter slice, but its AllGather / ReduceScatter need equal chunks (Gloo does too), so any model
whose size does not divide by the world size breaks.  Here the buffer is padded with zeros to
`padded_numel = ceil(numel / N) * N`; the padding is never read by the model and its gradient is 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_course.fsdp.common import sharded_away


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of `world_size` that is >= `numel` (the article forgot this step)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return -(-numel // world_size) * world_size


def shard_range(padded: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s shard in a flat buffer of `padded` elements (a multiple of world_size)."""
    if padded % world_size:
        raise ValueError(f"{padded} elements do not split into {world_size} equal shards: pad first")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    size = padded // world_size
    return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives inside the flat buffer."""

    name: str  # e.g. "layers.0.linear.weight" (the first name, if the parameter is tied)
    offset: int  # first element inside the flat buffer
    numel: int
    shape: torch.Size
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard."""

    name: str
    param_start: int  # first element, counted inside the flattened parameter
    param_end: int
    shard_offset: int  # where that piece starts inside the rank's shard


@dataclass(frozen=True)
class FlatParamLayout:
    """Metadata of one flat parameter: enough to flatten, shard and unflatten it again."""

    infos: tuple[ParamInfo, ...]
    numel: int  # sum of the parameters' numel
    padded_numel: int  # numel rounded up to a multiple of world_size
    world_size: int
    dtype: torch.dtype

    @classmethod
    def build(
        cls, named_tensors: Sequence[tuple[str, torch.Tensor]], world_size: int
    ) -> FlatParamLayout:
        """Lay `named_tensors` end to end in the given order.

        The same tensor object under several names (tied weights) is stored once, and its later
        names become `aliases`.  All tensors must share one dtype: a flat buffer has one dtype.
        """
        check_same_dtype(named_tensors)
        infos: list[ParamInfo] = []
        first_index: dict[int, int] = {}  # id(tensor) -> index in infos
        offset = 0
        for name, t in named_tensors:
            if id(t) in first_index:  # tied: one copy, one gradient
                i = first_index[id(t)]
                info = infos[i]
                infos[i] = ParamInfo(info.name, info.offset, info.numel, info.shape,
                                     info.aliases + (name,))
                continue
            first_index[id(t)] = len(infos)
            infos.append(ParamInfo(name, offset, t.numel(), t.shape))
            offset += t.numel()
        dtype = named_tensors[0][1].dtype if named_tensors else torch.float32
        return cls(tuple(infos), offset, padded_numel(offset, world_size), world_size, dtype)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def names(self) -> list[str]:
        return [info.name for info in self.infos]

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.padded_numel, self.world_size, rank)

    def flatten(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """Concatenate one tensor per `infos` entry (same order) and pad with zeros."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype)  # (padded_numel,)
        tensors = list(tensors)
        if len(tensors) != len(self.infos):
            raise ValueError(f"expected {len(self.infos)} tensors, got {len(tensors)}")
        for info, t in zip(self.infos, tensors, strict=True):
            if t.shape != info.shape:
                raise ValueError(f"{info.name}: shape {tuple(t.shape)} != {tuple(info.shape)}")
            flat[info.offset : info.offset + info.numel].copy_(t.reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a full (gathered) flat buffer with the original shapes; no copy."""
        if flat.shape != (self.padded_numel,):
            raise ValueError(f"flat buffer has shape {tuple(flat.shape)}, "
                             f"expected ({self.padded_numel},)")
        # one split (not one slice per parameter): in backward, autograd then builds a single
        # (padded_numel,) gradient for the whole flat buffer instead of one per parameter
        sizes = [i.numel for i in self.infos] + [self.padded_numel - self.numel]
        pieces = flat.split(sizes)  # the last piece is the padding
        return [piece.view(i.shape) for piece, i in zip(pieces, self.infos, strict=False)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of a full flat buffer, as a view."""
        start, end = self.shard_range(rank)
        return flat[start:end]  # (padded_numel // world_size,) local shard

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Which parts of which parameters `rank` owns (a parameter may straddle two shards)."""
        start, end = self.shard_range(rank)
        out = []
        for info in self.infos:
            lo, hi = max(start, info.offset), min(end, info.offset + info.numel)
            if lo < hi:
                out.append(ShardPiece(info.name, lo - info.offset, hi - info.offset, lo - start))
        return out

    def to_json(self) -> dict:
        """Plain-data description (for checkpoint metadata)."""
        return {
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "world_size": self.world_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "params": [
                {"name": i.name, "offset": i.offset, "numel": i.numel,
                 "shape": list(i.shape), "aliases": list(i.aliases)}
                for i in self.infos
            ],
        }


def check_same_dtype(named_tensors: Sequence[tuple[str, torch.Tensor]], where: str = "") -> None:
    """Raise a TypeError naming the parameters of each dtype when they are mixed."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append(name)
    if len(by_dtype) > 1:
        listing = "; ".join(
            f"{dtype}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
            for dtype, names in by_dtype.items()
        )
        raise TypeError(
            f"one flat parameter holds one dtype, but {where or 'these parameters'} mix "
            f"{len(by_dtype)} dtypes ({listing}). Cast the model to one dtype (e.g. model.float()) "
            "or put the differing modules in their own FSDP unit (wrap=...)."
        )


def flatten_params(
    named_params: Sequence[tuple[str, torch.Tensor]], world_size: int
) -> tuple[FlatParamLayout, torch.Tensor]:
    """The article's `flattenParams` plus padding: (layout, flat buffer of shape (padded_numel,))."""
    layout = FlatParamLayout.build(named_params, world_size)
    unique = {id(t): t for _, t in named_params}.values()  # tied tensors once, in first-seen order
    with torch.no_grad():
        flat = layout.flatten(t.detach() for t in unique)  # (padded_numel,)
    return layout, flat


def shard_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]], world_size: int, rank: int
) -> tuple[FlatParamLayout, torch.Tensor]:
    """The article's `shardParameters`, fixed: flatten, pad, keep this rank's equal chunk (a copy)."""
    layout, flat = flatten_params(named_params, world_size)
    local = layout.shard(flat, rank).clone()  # (padded_numel // world_size,) local shard
    return layout, local


@dataclass
class CopyCounter:
    """Copies between host and device memory: how many, and their bytes (`reset()` at the start of a step)."""

    h2d: int = 0  # copies host -> device (a shard before its all-gather)
    d2h: int = 0  # copies device -> host (a reduce-scattered gradient chunk)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    shapes: list[tuple[str, int]] = field(default_factory=list)  # ("h2d" | "d2h", numel) per copy, in order

    def count(self, direction: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if direction == "h2d":
            self.h2d, self.h2d_bytes = self.h2d + 1, self.h2d_bytes + nbytes
        else:
            self.d2h, self.d2h_bytes = self.d2h + 1, self.d2h_bytes + nbytes
        self.shapes.append((direction, t.numel()))

    def reset(self) -> None:
        self.h2d = self.d2h = self.h2d_bytes = self.d2h_bytes = 0
        self.shapes.clear()


def copy_to(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t` in a fresh storage (the other pool's memory): what `.to(device)` does across devices."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    out.copy_(t)
    return out


class FlatParamHandle:
    """One flat parameter of an FSDP unit: its layout, this rank's `shard` and the `unsharded` buffer.

    It only allocates, frees and exposes views; the unit (param_group.py) issues the collectives that fill the
    buffer and reduce its gradient. `unsharded` is a leaf that requires grad when the parameters do: the views'
    gradients add up in `unsharded.grad`, the unit's whole flat gradient.
    """

    def __init__(self, layout: FlatParamLayout, shard: nn.Parameter,
                 locations: list[list[tuple[nn.Module, str]]], compute_dtype: torch.dtype | None = None,
                 offload: CopyCounter | None = None) -> None:
        self.layout = layout
        self.offload = offload  # CPU offload: the shard is on the host, copies go through (and are counted in) it
        self.shard = shard  # (padded_numel // world_size,) the local shard, an nn.Parameter the optimizer steps
        self.requires_grad = shard.requires_grad
        # mixed precision: the unsharded buffer, its views and its gradient are in compute_dtype, the shard is not
        self.compute_dtype = compute_dtype or layout.dtype
        self.accumulated: torch.Tensor | None = None  # unreduced gradient kept in reduce_dtype (no_sync + mp)
        self.unsharded = torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=shard.device)
        self.unsharded.untyped_storage().resize_(0)  # (padded_numel,) no storage while sharded
        self.unsharded.requires_grad_(self.requires_grad)
        self.locations = locations  # per parameter: every (module, attribute) that names it (tied weights)
        self.placeholders = [
            sharded_away(info.shape, self.compute_dtype,
                         f"'{info.name}' is sharded by FSDP: outside its unit's forward/backward only "
                         "the local shard exists. Read full values with fsdp.full_state_dict() "
                         "(on every rank) or inside forward.")
            for info in layout.infos
        ]

    def all_gather_input(self) -> torch.Tensor:
        """What this rank contributes to the all-gather: its shard, cast to the compute dtype (mixed precision).

        With offload, the host shard is first copied into a fresh device tensor (counted host -> device)."""
        shard = self.shard.detach()
        if self.offload is not None:
            shard = copy_to(shard)  # (padded_numel // N,) on the device, freed once the all-gather has read it
            self.offload.count("h2d", shard)
        return shard if shard.dtype == self.compute_dtype else shard.to(self.compute_dtype)

    def grad_to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """The reduce-scattered gradient chunk where the shard lives: with offload, a fresh host copy (counted
        device -> host); without, `grad` itself."""
        if self.offload is None:
            return grad
        host = copy_to(grad)  # (padded_numel // N,) on the host, beside the shard the optimizer steps
        self.offload.count("d2h", host)
        return host

    @property
    def is_unsharded(self) -> bool:
        return self.unsharded.untyped_storage().nbytes() > 0

    def alloc(self) -> torch.Tensor:
        """Give the unsharded buffer its storage back; returns what an all-gather should write into.

        `.data`: writing there does not bump the version counter that autograd checks on the views it saved."""
        self.unsharded.untyped_storage().resize_(self.unsharded.numel() * self.unsharded.element_size())
        return self.unsharded.data

    def free(self) -> None:
        """Return the unsharded buffer's memory now (not at garbage collection); the module sees placeholders."""
        self.unsharded.untyped_storage().resize_(0)
        self.set_attributes(self.placeholders)

    def use_unsharded_views(self) -> None:
        """Point the module's attributes at fresh views of the unsharded buffer (their grad_fn leads to it)."""
        self.set_attributes(self.layout.unflatten(self.unsharded))

    def set_attributes(self, tensors: list[torch.Tensor]) -> None:
        for places, t in zip(self.locations, tensors, strict=True):
            for module, attr in places:
                setattr(module, attr, t)


class FlatGrads:
    """The gradients of some parameters in one flat buffer, each `p.grad` a view of it (DDP's bucket with
    `gradient_as_bucket_view=True`; ZeRO-1's full gradient). `collect()` puts the views back after an optimizer's
    `zero_grad()` set `p.grad = None`, keeping what autograd accumulated meanwhile."""

    def __init__(self, layout: FlatParamLayout, params: Sequence[nn.Parameter]) -> None:
        self.layout = layout
        self.params = list(params)
        self.flat = torch.zeros(layout.padded_numel, dtype=layout.dtype,
                                device=self.params[0].device)  # (padded_numel,)
        self.views = layout.unflatten(self.flat)
        self.collect()

    def collect(self) -> None:
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:  # unused since it was last reset: its gradient is zero
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # autograd allocated a fresh tensor
                view.copy_(p.grad)
            p.grad = view

    def zero_(self) -> None:
        self.flat.zero_()
        self.collect()

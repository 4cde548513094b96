"""Per-parameter sharding on dim 0: the layout of PyTorch's FSDP2 (`fully_shard`), beside the flat parameter.

`flat_param.py` is FSDP1's layout (and the article's, and the FSDP paper's FlatParameter, arXiv:2304.11277,
section 3.2.1): a unit's parameters end to end in one buffer, padded once, cut into N equal chunks. FSDP2
keeps every parameter as its own tensor and cuts each one on dim 0 (a DTensor with placement `Shard(0)`).
This module does the same on the course's `RankContext`, following torch's code:

- Sharding (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `FSDPParam._init_sharded_param`): the
  parameter is split with `torch.chunk` on dim 0 into N chunks (`_chunk_with_empty` in _fsdp_common.py
  adds empty ones when torch.chunk returns fewer): chunk r holds rows [r * c, min((r + 1) * c, dim0)) with
  c = ceil(dim0 / N), so the last ranks may hold fewer rows, or none. Every rank stores its chunk padded
  with zero rows to the size of chunk 0 ("0th always padded"): `padded_sharded_param_size` =
  (c, *shape[1:]). The optimizer sees the unpadded rows (the DTensor's local tensor is a narrow of the
  padded one). The padding is per parameter: N * c - dim0 rows, fewer than N rows each.
- All-gather (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): `foreach_all_gather` copies
  each parameter's padded chunk, flattened, into one flat buffer (copy-in, `all_gather_copy_in`: the
  input is this rank's slice of the output buffer), runs one all-gather for the whole unit, and
  `foreach_all_gather_copy_out` views the output as (N, input_numel), splits it along dim 1 per
  parameter (`split_with_sizes_copy`) into each parameter's own (N * c, *shape[1:]) buffer (its
  "all-gather output"); the unsharded parameter is its first dim0 rows (`init_unsharded_param`).
- Reduce-scatter (the same file, `foreach_reduce` and `foreach_reduce_scatter_copy_in`): every gradient,
  padded on dim 0, is cut into N chunks and the chunks are laid rank-major (`chunk_cat`), so that one
  reduce-scatter leaves each rank the gradient of exactly its padded chunks.

Usage, inside `run_ranks` (names as in `flat_param.py`):

    layout = PerParamLayout.build(list(module.named_parameters()), ctx.world_size)
    local = layout.shard([p for _, p in module.named_parameters()], ctx.rank)   # padded chunks, copies
    full = all_gather_params(ctx, layout, local)                                 # one collective per unit
    grads = reduce_scatter_grads(ctx, layout, [p.grad for p in ...], op="mean")  # padded chunks of the mean
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_course.runtime.context import RankContext

__all__ = ["DimZeroShard", "PerParamLayout", "all_gather_params", "dim0_chunk_rows", "reduce_scatter_grads"]


def dim0_chunk_rows(dim0: int, world_size: int) -> int:
    """Rows of every rank's padded chunk: ceil(dim0 / N), the size of torch.chunk's first chunk."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return -(-dim0 // world_size)


@dataclass(frozen=True)
class DimZeroShard:
    """How one parameter is cut on dim 0 over `world_size` ranks."""

    name: str
    shape: torch.Size
    world_size: int

    @property
    def rows(self) -> int:
        """Rows per rank after padding: ceil(dim0 / N)."""
        return dim0_chunk_rows(self.shape[0], self.world_size)

    @property
    def row_numel(self) -> int:
        """Elements in one row (the product of the other dimensions)."""
        return self.shape[1:].numel()

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def padded_shape(self) -> torch.Size:
        """Shape of every rank's padded chunk: FSDPParam.padded_sharded_param_size."""
        return torch.Size([self.rows, *self.shape[1:]])

    @property
    def padded_numel(self) -> int:
        """Elements of one padded chunk (what each rank contributes to the all-gather for this parameter)."""
        return self.padded_shape.numel()

    @property
    def padding(self) -> int:
        """Zero elements added for this parameter over all ranks: (N * c - dim0) rows."""
        return self.world_size * self.padded_numel - self.numel

    def row_range(self, rank: int) -> tuple[int, int]:
        """[start, end) rows of the parameter that `rank` holds (empty for the last ranks of a short dim 0)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        start = min(rank * self.rows, self.shape[0])
        return start, min(start + self.rows, self.shape[0])

    def local_rows(self, rank: int) -> int:
        """Rows of real data in `rank`'s chunk (the rest of its padded chunk is zeros)."""
        start, end = self.row_range(rank)
        return end - start


@dataclass(frozen=True)
class PerParamLayout:
    """One unit's parameters, each sharded on dim 0 (FSDP2); enough to copy in, gather and copy out."""

    specs: tuple[DimZeroShard, ...]
    world_size: int
    dtype: torch.dtype

    @classmethod
    def build(cls, named_tensors: Sequence[tuple[str, torch.Tensor]], world_size: int) -> PerParamLayout:
        """Describe `named_tensors` sharded on dim 0 (one dtype: the unit's all-gather is one flat buffer)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not named_tensors:
            raise ValueError("nothing to shard: no parameters")
        dtypes = {t.dtype for _, t in named_tensors}
        if len(dtypes) > 1:
            raise TypeError(f"one all-gather buffer holds one dtype, these parameters mix {sorted(map(str, dtypes))}")
        for name, t in named_tensors:
            if t.dim() == 0:
                raise ValueError(f"{name}: a 0-dim tensor has no dim 0 to shard (fully_shard refuses it too)")
        specs = tuple(DimZeroShard(name, t.shape, world_size) for name, t in named_tensors)
        return cls(specs, world_size, named_tensors[0][1].dtype)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def numel(self) -> int:
        """Elements of the parameters themselves."""
        return sum(s.numel for s in self.specs)

    @property
    def input_numel(self) -> int:
        """Elements each rank puts into the unit's all-gather: the sum of its padded chunks."""
        return sum(s.padded_numel for s in self.specs)

    @property
    def padded_numel(self) -> int:
        """Elements the all-gather delivers: N * input_numel (the parameters plus every parameter's padding)."""
        return self.world_size * self.input_numel

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def offsets(self) -> list[int]:
        """Where each parameter's padded chunk starts inside one rank's all-gather input."""
        out, offset = [], 0
        for s in self.specs:
            out.append(offset)
            offset += s.padded_numel
        return out

    def shard(self, tensors: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """Rank `rank`'s padded chunk of each tensor, shape `padded_shape` (new tensors: FSDPParam's
        `_sharded_param_data`, before `.view(-1)`)."""
        if len(tensors) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} tensors, got {len(tensors)}")
        out = []
        for spec, t in zip(self.specs, tensors, strict=True):
            if t.shape != spec.shape:
                raise ValueError(f"{spec.name}: shape {tuple(t.shape)} != {tuple(spec.shape)}")
            start, end = spec.row_range(rank)
            padded = t.new_zeros(spec.padded_shape)  # (c, *shape[1:])
            padded[: end - start].copy_(t.detach()[start:end])
            out.append(padded)
        return out

    def unpadded(self, padded_chunks: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """The real rows of each padded chunk, as views: what the DTensor's local tensor holds."""
        return [c[: spec.local_rows(rank)] for spec, c in zip(self.specs, padded_chunks, strict=True)]

    def copy_in(self, padded_chunks: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Copy each padded chunk, flattened, end to end into `out` (input_numel,): the all-gather input."""
        for chunk, piece in zip(padded_chunks, out.split([s.padded_numel for s in self.specs]), strict=True):
            piece.copy_(chunk.reshape(-1))

    def copy_out(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full tensor out of the all-gather output (padded_numel,): rank-major, so viewed as
        (N, input_numel) it holds every rank's chunks side by side; one column block per parameter is copied
        into that parameter's own (N * c, *shape[1:]) buffer, and the parameter is its first dim0 rows."""
        if gathered.shape != (self.padded_numel,):
            raise ValueError(f"all-gather output has shape {tuple(gathered.shape)}, expected ({self.padded_numel},)")
        by_rank = gathered.view(self.world_size, self.input_numel)  # (N, input_numel)
        out = []
        for spec, offset in zip(self.specs, self.offsets(), strict=True):
            buffer = gathered.new_empty(self.world_size * spec.padded_numel)  # the parameter's all-gather output
            buffer.view(self.world_size, spec.padded_numel).copy_(by_rank[:, offset: offset + spec.padded_numel])
            padded_full = buffer.view(self.world_size * spec.rows, *spec.shape[1:])  # (N * c, *shape[1:])
            out.append(padded_full[: spec.shape[0]])  # a view: the padding rows stay behind it
        return out

    def chunk_cat(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The reduce-scatter input (padded_numel,): every gradient padded on dim 0, cut into N chunks, the
        chunks laid rank-major (torch's `chunk_cat` in foreach_reduce_scatter_copy_in)."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=grads[0].device)
        by_rank = flat.view(self.world_size, self.input_numel)  # (N, input_numel)
        for spec, g, offset in zip(self.specs, grads, self.offsets(), strict=True):
            if g.shape != spec.shape:
                raise ValueError(f"{spec.name}: gradient shape {tuple(g.shape)} != {tuple(spec.shape)}")
            chunks = by_rank[:, offset: offset + spec.padded_numel].view(self.world_size, *spec.padded_shape)
            for rank in range(self.world_size):  # chunk r of the gradient goes to row r; padding rows stay zero
                start, end = spec.row_range(rank)
                chunks[rank, : end - start].copy_(g[start:end])
        return flat


def all_gather_params(ctx: RankContext, layout: PerParamLayout,
                      padded_chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One all-gather for a unit sharded per parameter: copy-in, `ctx.all_gather`, copy-out (FSDP2's
    foreach_all_gather and foreach_all_gather_copy_out). Returns the full parameters, in layout order."""
    output = padded_chunks[0].new_empty(layout.padded_numel)  # (N * input_numel,) the all-gather output
    n = layout.input_numel
    all_gather_input = output[ctx.rank * n: (ctx.rank + 1) * n]  # this rank's slice of it, as torch does
    layout.copy_in(padded_chunks, all_gather_input)
    ctx.all_gather(all_gather_input, out=output)
    return layout.copy_out(output)


def reduce_scatter_grads(ctx: RankContext, layout: PerParamLayout, grads: Sequence[torch.Tensor], *,
                         op: str = "mean") -> list[torch.Tensor]:
    """One reduce-scatter for a unit sharded per parameter: this rank's padded chunk of each reduced gradient
    (shape `padded_shape`, views of the reduce-scatter output; zero rows where the parameter has none)."""
    reduced = ctx.reduce_scatter(layout.chunk_cat(grads), op=op)  # (input_numel,)
    pieces = reduced.split([s.padded_numel for s in layout.specs])
    return [piece.view(spec.padded_shape) for piece, spec in zip(pieces, layout.specs, strict=True)]

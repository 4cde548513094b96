"""The two layouts of a unit as text tables (lesson 05): FSDP2's dim-0 chunks per parameter, and both layouts side
by side at several world sizes. `FlatParamLayout` is the flat parameter (flat_param.py), `PerParamLayout` FSDP2's
per-parameter sharding (per_param.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.fsdp.per_param import PerParamLayout

__all__ = ["layouts_table", "per_param_table"]


def per_param_table(layout: PerParamLayout) -> str:
    """One line per parameter: its shape, what each rank stores (the padded chunk), the rows each rank holds, and
    its padding in elements."""
    n = layout.world_size
    lines = [f"{'parameter':<16} {'shape':<7}  each rank stores  rows held by ranks 0..{n - 1}         padding"]
    for spec in layout.specs:
        held = " ".join(f"[{a}, {b})" for a, b in map(spec.row_range, range(n)))
        lines.append(f"{spec.name:<16} {str(tuple(spec.shape)):<7}  {str(tuple(spec.padded_shape)):<16}  "
                     f"{held:<32} {spec.padding}")
    return "\n".join(lines)


def layouts_table(named_params: Sequence[tuple[str, torch.Tensor]], world_sizes: Iterable[int],
                  bytes_per_element: int = 4) -> str:
    """For every world size N, both layouts of `named_params`: elements per rank, elements of padding, and the
    all-gather's output in bytes (N times what one rank puts in)."""
    lines = [" N  layout              per rank  padding  all-gather output"]
    for n in world_sizes:
        flat, per_param = FlatParamLayout.build(list(named_params), n), PerParamLayout.build(named_params, n)
        for name, per_rank, padding in (("flat (FSDP1)", flat.shard_numel, flat.padded_numel - flat.numel),
                                        ("per param (FSDP2)", per_param.input_numel, per_param.padding)):
            lines.append(f"{n:>2}  {name:<18} {per_rank:>9} {padding:>8} {bytes_per_element * n * per_rank:>12} bytes")
    return "\n".join(lines)

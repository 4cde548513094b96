"""The sharding maps: which rank owns which part of a unit's parameters, in the two layouts FSDP has used.

`plot_sharding` draws the FlatParameter of the PyTorch FSDP paper (arXiv:2304.11277, section 3.2.1) and of
FSDP1, as `flat_param.py` builds it: the parameters end to end, padded with zeros to a multiple of the world
size N, cut into N equal shards (ZeRO's partitioning, arXiv:1910.02054, section 5). The original
parameters' boundaries and names are marked; the padding is hatched.

`plot_per_param_sharding` draws FSDP2's layout (`fully_shard`, torch/distributed/fsdp/_fully_shard/
_fsdp_param.py), as `per_param.py` computes it: one bar per parameter, cut on dim 0 into N chunks of
ceil(dim0 / N) rows; the rows a rank pads its chunk with are hatched, so the padding shows per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from matplotlib.figure import Figure

from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.fsdp.per_param import DimZeroShard
from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.viz.style import format_bytes, new_figure, rank_color

T = catalogue("viz.sharding")  # fsdp_course/i18n/catalogues/viz.sharding.yml


def _as_layout(flat: Any) -> Any:
    """An FSDP unit -> its handle -> the handle's layout; anything else is returned as it is."""
    if hasattr(flat, "handles"):
        if len(flat.handles) != 1:
            raise ValueError(f"this unit has {len(flat.handles)} flat parameters: pass one, unit.handles[i]")
        flat = flat.handles[0]
    return flat.layout if hasattr(flat, "layout") and not hasattr(flat, "infos") else flat


def _layout_entries(flat: Any, numels: Sequence[int] | None, world_size: int | None,
                    padded: int | None) -> tuple[list[tuple[str, int, int]], int, int]:
    """(name, offset, numel) entries, padded numel and world size, from a layout-like object or plain data."""
    if hasattr(flat, "infos"):  # FlatParamLayout (duck-typed)
        entries = [(i.name, int(i.offset), int(i.numel)) for i in flat.infos]
        world_size, padded = int(flat.world_size), int(flat.padded_numel)
    else:
        items = list(flat)
        if world_size is None:
            raise ValueError("plain data needs world_size: plot_sharding(names, numels, world_size)")
        if items and all(isinstance(x, str) for x in items):
            if numels is None or len(numels) != len(items):
                raise ValueError(f"need one numel per name: {len(items)} names, "
                                 f"{'no' if numels is None else len(numels)} numels")
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            entries = [(n, o, int(k)) for n, o, k in zip(items, offsets, numels, strict=True)]
        else:
            try:
                entries = [(str(n), int(o), int(k)) for n, o, k in items]
            except (TypeError, ValueError) as e:
                raise ValueError("plain data is names + numels, or (name, offset, numel) tuples") from e
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    end = 0
    for name, offset, numel in entries:
        if numel < 0 or offset < end:
            raise ValueError(f"parameter {name!r} (offset {offset}, numel {numel}) overlaps the one before it "
                             "or has a negative size")
        end = offset + numel
    if not entries or end == 0:
        raise ValueError("the flat parameter is empty: nothing to draw")
    padded = padded_numel(end, world_size) if padded is None else padded
    if padded < end or padded % world_size:
        raise ValueError(f"padded_numel {padded} must be >= numel {end} and a multiple of world_size {world_size}")
    return entries, padded, world_size


def _dodge(xs: list[float], gap: float, lo: float, hi: float) -> list[float]:
    """Move label positions apart by at least `gap`, keeping them inside [lo, hi] when possible."""
    out = list(xs)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    for i in range(len(out) - 1, -1, -1):
        limit = hi if i == len(out) - 1 else out[i + 1] - gap
        out[i] = max(lo, min(out[i], limit)) if i == 0 else min(out[i], limit)
    return out


def _dotted_prefix(names: list[str]) -> str:
    """The module path all names share ("encoder.layers.0."), or "" (also for a single name)."""
    if len(names) < 2:
        return ""
    parts = [name.split(".")[:-1] for name in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return "".join(f"{p}." for p in common)


def plot_sharding(flat: Any, numels: Sequence[int] | None = None, world_size: int | None = None, *,
                  padded_numel: int | None = None, title: str | Message | None = None,
                  element_size: int | None = None) -> Figure:
    """The flat parameter as a bar: which rank owns which elements, where each parameter starts, the padding.

    `flat`: a FlatParamLayout (anything with `.infos`, `.padded_numel`, `.world_size`), an object with a
    `.layout` (FlatParamHandle, ZeRO bucket), an FSDP unit with one flat parameter, or plain data:
    `plot_sharding(names, numels, world_size)` or `plot_sharding([(name, offset, numel)], world_size=N)`.
    """
    layout = _as_layout(flat)
    entries, padded, n = _layout_entries(layout, numels, world_size, padded_numel)
    numel = entries[-1][1] + entries[-1][2]
    shard = padded // n
    if element_size is None:
        element_size = getattr(getattr(layout, "dtype", None), "itemsize", 4)
    fig, axes = new_figure(size=(10, 3.2))
    ax = axes[0, 0]
    for r in range(n):
        ax.barh(0, shard, left=r * shard, height=0.8, color=rank_color(r), edgecolor="white",
                label=f"rank {r}", gid=f"rank{r}")
        if n <= 16:
            ax.text((r + 0.5) * shard, 0, f"[{r * shard}, {(r + 1) * shard})", ha="center", va="center",
                    fontsize=7, color="white")
    for i, (name, offset, k) in enumerate(entries):
        ax.barh(1, k, left=offset, height=0.8, color=("#d9d9d9", "#f2f2f2")[i % 2], edgecolor="black",
                linewidth=0.6, gid=f"param:{name}")
    if padded > numel:
        for y in (0, 1):
            ax.barh(y, padded - numel, left=numel, height=0.8, color="none", edgecolor="black",
                    hatch="///", linewidth=0.6, gid="padding", label=text(T("padding")) if y == 1 else None)
    ax.vlines([o for _, o, _ in entries] + [numel], -0.45, 1.45, colors="black", linewidth=0.8)
    mids = [o + k / 2 for _, o, k in entries]
    xs = _dodge(mids, gap=padded * min(0.018, 1 / len(entries)), lo=0, hi=padded)
    for mid, x in zip(mids, xs, strict=True):  # leader lines from each parameter to its name on top
        ax.plot([mid, x], [1.4, 1.9], color="grey", linewidth=0.5)
    common = _dotted_prefix([name for name, _, _ in entries])  # "encoder.layers.0." said once, in the title
    names = ax.secondary_xaxis("top")
    names.set_xticks(xs, [name[len(common):] for name, _, _ in entries], rotation=50, ha="left", fontsize=7,
                     rotation_mode="anchor")
    names.tick_params(length=0)
    ax.set_xlim(0, padded)
    ax.set_ylim(-0.5, 1.9)
    ax.set_yticks([0, 1], [text(T("owner_rank")), text(T("parameters"))])
    ax.set_xlabel(text(T("elements", numel=numel, pad=padded - numel, n=n, shard=shard,
                         size=format_bytes(shard * element_size))))
    unit = getattr(flat, "label", None) if isinstance(getattr(flat, "label", None), str) else None
    named = f" {common}*" if common else ""
    default = (T("unit_title", unit=unit, count=len(entries), common=named, n=n) if unit else
               T("flat_title", count=len(entries), common=named, n=n))
    ax.set_title(text(title or default), fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8)
    return fig


def _per_param_specs(layout: Any, shapes: Sequence[Sequence[int]] | None,
                     world_size: int | None) -> tuple[list[DimZeroShard], int]:
    """DimZeroShard entries and the world size, from a PerParamLayout (anything with `.specs`) or plain data."""
    if hasattr(layout, "specs"):
        specs = list(layout.specs)
        return specs, int(specs[0].world_size) if specs else int(getattr(layout, "world_size", 1))
    names = list(layout)
    if world_size is None:
        raise ValueError("plain data needs world_size: plot_per_param_sharding(names, shapes, world_size)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if shapes is None or len(shapes) != len(names):
        raise ValueError(f"need one shape per name: {len(names)} names, "
                         f"{'no' if shapes is None else len(shapes)} shapes")
    specs = []
    for name, shape in zip(names, shapes, strict=True):
        if len(shape) == 0 or shape[0] < 1:
            raise ValueError(f"parameter {name!r} of shape {tuple(shape)} has no rows on dim 0 to shard")
        specs.append(DimZeroShard(str(name), torch.Size(shape), world_size))
    return specs, world_size


def plot_per_param_sharding(layout: Any, shapes: Sequence[Sequence[int]] | None = None,
                            world_size: int | None = None, *, title: str | Message | None = None,
                            element_size: int | None = None) -> Figure:
    """Per-parameter sharding (FSDP2): one bar per parameter, its dim 0 cut into N chunks of ceil(dim0 / N) rows.

    Each bar is scaled to its own padded dim 0 (N * ceil(dim0 / N) rows), so that small parameters stay visible;
    the rows written in each rank's segment are the parameter's rows that rank holds, and the hatched part is the
    zero rows it pads its chunk with. `layout`: a PerParamLayout (anything with `.specs` of DimZeroShard), or plain
    data: `plot_per_param_sharding(names, shapes, world_size)`.
    """
    specs, n = _per_param_specs(layout, shapes, world_size)
    if not specs:
        raise ValueError("no parameters: nothing to draw")
    if element_size is None:
        element_size = getattr(getattr(layout, "dtype", None), "itemsize", 4)
    fig, axes = new_figure(size=(10, 0.42 * len(specs) + 1.4))
    ax = axes[0, 0]
    padding_labelled = False
    for y, spec in enumerate(specs):
        for r in range(n):
            real = spec.local_rows(r) / spec.rows  # the share of rank r's chunk that holds real rows
            ax.barh(y, real / n, left=r / n, height=0.8, color=rank_color(r), edgecolor="white",
                    gid=f"rank{r}:{spec.name}", label=f"rank {r}" if y == 0 else None)
            if real < 1:
                ax.barh(y, (1 - real) / n, left=(r + real) / n, height=0.8, color="none", edgecolor="black",
                        hatch="///", linewidth=0.6, gid=f"padding:{spec.name}",
                        label=None if padding_labelled else text(T("padding")))
                padding_labelled = True
            start, end = spec.row_range(r)
            if n <= 8 and end > start:
                ax.text((r + real / 2) / n, y, f"[{start}, {end})", ha="center", va="center", fontsize=7,
                        color="white")
    common = _dotted_prefix([spec.name for spec in specs])
    ax.set_yticks(range(len(specs)), [f"{spec.name[len(common):]} {tuple(spec.shape)}" for spec in specs],
                  fontsize=7)
    sizes = ax.secondary_yaxis("right")  # what each rank holds of each parameter, and its padding
    sizes.set_yticks(range(len(specs)), [text(T("per_rank_pad", shape=tuple(spec.padded_shape), pad=spec.padding)
                                              if spec.padding else T("per_rank", shape=tuple(spec.padded_shape)))
                                         for spec in specs], fontsize=7)
    sizes.tick_params(length=0)
    ax.set_ylim(len(specs) - 0.5, -0.5)  # the first parameter on top
    ax.set_xlim(0, 1)
    ax.set_xticks([r / n for r in range(n + 1)], [f"{r}/{n}" for r in range(n + 1)], fontsize=7)
    per_rank = sum(spec.padded_numel for spec in specs)
    padding = sum(spec.padding for spec in specs)
    numel = sum(spec.numel for spec in specs)
    ax.set_xlabel(text(T("dim0", n=n, numel=numel, pad=padding, per_rank=per_rank,
                         size=format_bytes(per_rank * element_size))))
    named = f" {common}*" if common else ""
    ax.set_title(text(title or T("dim0_title", count=len(specs), common=named, n=n)), fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8)
    return fig

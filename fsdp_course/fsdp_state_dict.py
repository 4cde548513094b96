"""Checkpoints of an FSDP model: full (any world size) and sharded (one file per rank + metadata).

PyTorch FSDP (arXiv:2304.11277, section 3.2 and the `StateDictType` API) offers the same two:
- a FULL state dict: gather every flat parameter, cut it back into the original tensors, keyed
  exactly like the unwrapped module's `state_dict()`; loads into any world size;
- a SHARDED state dict: each rank writes only its shard (no communication, no full copy anywhere),
  plus metadata describing the layout; it loads back only into the same layout and world size.

All functions take the FSDP object; `full_state_dict` is a collective (call it on every rank).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fsdp_course.fsdp import FSDP

FORMAT = "fsdp_course.sharded/1"
METADATA = "metadata.json"


def rank_file(rank: int) -> str:
    return f"shard_rank{rank}.pt"


@torch.no_grad()
def full_state_dict(fsdp: FSDP) -> dict[str, torch.Tensor]:
    """Full parameters and buffers, keyed as the wrapped module's state_dict(), on every rank."""
    values: dict[str, torch.Tensor] = {}
    for h in fsdp.handles:
        full = fsdp.ctx.all_gather(h.shard.detach())  # (padded_numel,)
        for info, view in zip(h.layout.infos, h.layout.unflatten(full), strict=True):
            tensor = view.clone()
            for name in (info.name, *info.aliases):  # tied: one tensor under each name
                values[name] = tensor
    for name, buf in fsdp.module.named_buffers(remove_duplicate=False):
        values.setdefault(name, buf.detach().clone())
    return {k: values[k] for k in fsdp.state_dict_keys}


@torch.no_grad()
def load_full_state_dict(fsdp: FSDP, state_dict: dict[str, torch.Tensor]) -> None:
    """The reverse: each rank keeps its own shard of the given full tensors (no communication)."""
    expected = set(fsdp.state_dict_keys)
    missing = [k for k in fsdp.state_dict_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise KeyError(f"state dict does not match the wrapped module: missing {missing}, "
                       f"unexpected {unexpected}")
    for h in fsdp.handles:
        flat = h.layout.flatten(state_dict[info.name] for info in h.layout.infos)  # (padded_numel,)
        h.shard.copy_(h.layout.shard(flat, fsdp.ctx.rank))
    buffers = dict(fsdp.module.named_buffers(remove_duplicate=False))
    for name in fsdp.state_dict_keys:
        if name in buffers:
            buffers[name].copy_(state_dict[name])


def _metadata(fsdp: FSDP) -> dict:
    return {
        "format": FORMAT,
        "world_size": fsdp.ctx.world_size,
        "units": [{"name": u.label, "flat_params": [
            dict(h.layout.to_json(), requires_grad=h.requires_grad) for h in u.handles]}
            for u in fsdp.units],
        "buffers": [name for name, _ in fsdp.module.named_buffers()],
        "files": [rank_file(r) for r in range(fsdp.ctx.world_size)],
    }


@torch.no_grad()
def save_sharded(fsdp: FSDP, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Every rank writes its shards (and optimizer state), rank 0 the metadata; all ranks call it."""
    os.makedirs(directory, exist_ok=True)
    payload = {
        "rank": fsdp.ctx.rank,
        "shards": [h.shard.detach().clone() for h in fsdp.handles],
        "buffers": {n: b.detach().clone() for n, b in fsdp.module.named_buffers()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }
    torch.save(payload, os.path.join(directory, rank_file(fsdp.ctx.rank)))
    if fsdp.ctx.rank == 0:
        with open(os.path.join(directory, METADATA), "w") as f:
            json.dump(_metadata(fsdp), f, indent=1)
    fsdp.ctx.barrier()  # the checkpoint is complete when anyone returns


@torch.no_grad()
def load_sharded(fsdp: FSDP, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what save_sharded wrote, with the same world size and model; clear errors otherwise."""
    meta_path = os.path.join(directory, METADATA)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: not a sharded checkpoint (save_sharded writes "
                                "one metadata.json plus one file per rank)")
    with open(meta_path) as f:
        meta = json.load(f)
    saved_n, n = meta.get("world_size"), fsdp.ctx.world_size
    if saved_n != n:
        raise ValueError(
            f"the checkpoint in {directory} was saved by {saved_n} ranks, this run has {n}: a sharded "
            "checkpoint is cut per world size. Load it with the same world size, or go through a full "
            "state dict (full_state_dict / load_full_state_dict), which fits any world size.")
    mine = _metadata(fsdp)
    if meta["units"] != mine["units"]:
        saved = [u["name"] for u in meta["units"]]
        raise ValueError(f"the checkpoint's layout differs from this model's (units saved: {saved}, "
                         f"here: {[u['name'] for u in mine['units']]}): same model and wrap= needed")
    path = os.path.join(directory, rank_file(fsdp.ctx.rank))
    if not os.path.exists(path):
        present = sorted(f for f in os.listdir(directory) if f.startswith("shard_rank"))
        raise FileNotFoundError(f"rank {fsdp.ctx.rank}'s file {path} is missing (found: {present}); "
                                f"a sharded checkpoint needs all {n} rank files")
    payload = torch.load(path, weights_only=True)
    for h, saved_shard in zip(fsdp.handles, payload["shards"], strict=True):
        h.shard.copy_(saved_shard)
    for name, buf in fsdp.module.named_buffers():
        buf.copy_(payload["buffers"][name])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state: save_sharded(..., optimizer=) to include it")
        optimizer.load_state_dict(payload["optimizer"])

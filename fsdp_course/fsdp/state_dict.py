"""Checkpoints of an FSDP model: full (any world size) and sharded (one file per rank + metadata).

PyTorch FSDP (arXiv:2304.11277, section 3.2 and the `StateDictType` API) offers the same two:
- a FULL state dict: gather every flat parameter, cut it back into the original tensors, keyed
  exactly like the unwrapped module's `state_dict()`; loads into any world size;
- a SHARDED state dict: each rank writes only its shard (no full copy anywhere: the ranks exchange
  only their files' checksums), plus metadata describing the layout and each file's size and sha256;
  it loads back only into the same layout and world size, after every rank has checked its file
  (a bad file raises on every rank, and nothing is loaded anywhere).

All functions take the FSDP object; `full_state_dict`, `save_sharded` and `load_sharded` are
collectives (call them on every rank).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_course.fsdp.flat_param import FlatParamHandle
from fsdp_course.fsdp.param_group import FSDPUnit


class FSDP(Protocol):
    """What a checkpoint needs of the FSDP object (api.FSDP, which imports this module, is the implementation)."""

    module: nn.Module
    ctx: Any
    units: list[FSDPUnit]
    state_dict_keys: list[str]

    @property
    def handles(self) -> list[FlatParamHandle]: ...

FORMAT = "fsdp_course.sharded/2"  # 2: metadata records each file's size and sha256
METADATA = "metadata.json"


def rank_file(rank: int) -> str:
    return f"shard_rank{rank}.pt"


def _refuse_mesh(fsdp: FSDP, what: str) -> None:
    """The sharded format is one file per shard rank: under HSDP every replica holds the same shards and would
    write the same files at once. Every rank has the same mesh, so all raise and none waits."""
    if getattr(fsdp, "mesh", None) is not None:
        raise ValueError(f"{what}: this FSDP runs HSDP (mesh=...), whose replicas would all write the same shard "
                         "files; save fsdp.full_state_dict() (gathered in the shard group) instead and load it with "
                         "load_full_state_dict")


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
    buffers = dict(fsdp.module.named_buffers(remove_duplicate=False))
    wrong = [f"{name}: {tuple(state_dict[name].shape)}, the model's is {tuple(buf.shape)}"
             for name, buf in buffers.items() if name in state_dict and state_dict[name].shape != buf.shape]
    if wrong:  # checked before anything is written (copy_ would broadcast a (1,) into a (3,))
        raise ValueError("state dict shapes do not match the wrapped module: " + "; ".join(wrong))
    flats = [h.layout.flatten(state_dict[info.name] for info in h.layout.infos) for h in fsdp.handles]
    for h, flat in zip(fsdp.handles, flats, strict=True):  # (padded_numel,) each, all built before writing
        h.shard.copy_(h.layout.shard(flat, fsdp.ctx.rank))
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
    }


@torch.no_grad()
def save_sharded(fsdp: FSDP, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Every rank writes its shards (and optimizer state), rank 0 the metadata; all ranks call it.

    The metadata records each rank file's size and sha256, so that load_sharded can tell a truncated,
    corrupted or swapped file from a good one (the ranks all_gather their digests for rank 0).
    """
    _refuse_mesh(fsdp, "save_sharded")
    os.makedirs(directory, exist_ok=True)
    payload = {
        "rank": fsdp.ctx.rank,
        "shards": [h.shard.detach().clone() for h in fsdp.handles],
        "buffers": {n: b.detach().clone() for n, b in fsdp.module.named_buffers()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    device = fsdp.ctx.device  # the group's device: NCCL gathers only CUDA tensors
    try:
        with open(os.path.join(directory, rank_file(fsdp.ctx.rank)), "wb") as f:
            f.write(data)
        size, error = len(data), None
    except OSError as exc:  # a rank that raised here alone would leave the others waiting below
        size, error = -1, exc
    digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.uint8, device=device)  # (32,)
    digests = fsdp.ctx.all_gather(digest).reshape(fsdp.ctx.world_size, 32).cpu()  # every rank's
    sizes = fsdp.ctx.all_gather(torch.tensor([size], device=device)).cpu()  # (world_size,)
    if error is not None:
        raise error
    if (sizes < 0).any():
        bad = [r for r in range(fsdp.ctx.world_size) if sizes[r] < 0]
        raise RuntimeError(f"checkpoint not saved: rank(s) {bad} could not write their file in {directory} "
                           "(see their errors); no metadata.json was written")
    if fsdp.ctx.rank == 0:
        meta = _metadata(fsdp)
        meta["files"] = [{"name": rank_file(r), "bytes": int(sizes[r]), "sha256": bytes(digests[r].tolist()).hex()}
                         for r in range(fsdp.ctx.world_size)]
        with open(os.path.join(directory, METADATA), "w") as f:
            json.dump(meta, f, indent=1)
    fsdp.ctx.barrier()  # the checkpoint is complete when anyone returns


@torch.no_grad()
def load_sharded(fsdp: FSDP, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what save_sharded wrote, with the same world size and model; all ranks call it.

    Every rank first checks everything it will read (the metadata; its file's size, checksum and
    rank; every shape and dtype), then the ranks agree with one all_reduce before anything is
    written: a bad checkpoint raises on every rank (no rank is left waiting) and changes nothing.
    """
    _refuse_mesh(fsdp, "load_sharded")
    try:
        payload, error = _read_checked(fsdp, directory, optimizer), None
    except Exception as exc:  # any: a rank that raised here alone would leave the others waiting below
        payload, error = None, exc
    failed = torch.zeros(fsdp.ctx.world_size, device=fsdp.ctx.device)  # the group's device (NCCL: CUDA)
    failed[fsdp.ctx.rank] = error is not None
    failed = fsdp.ctx.all_reduce(failed).cpu()  # which ranks found a problem
    if error is not None:
        raise error
    if failed.any():
        bad = [r for r in range(fsdp.ctx.world_size) if failed[r]]
        raise RuntimeError(f"nothing loaded: rank(s) {bad} found a problem with the checkpoint in {directory} "
                           "(see their errors); this rank's model and optimizer are unchanged")
    for h, saved_shard in zip(fsdp.handles, payload["shards"], strict=True):
        h.shard.copy_(saved_shard)
    for name, buf in fsdp.module.named_buffers():
        buf.copy_(payload["buffers"][name])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])


def _read_metadata(directory: str) -> dict:
    path = os.path.join(directory, METADATA)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: not a sharded checkpoint (save_sharded writes "
                                "one metadata.json plus one file per rank)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): the file is damaged or cut short; restore the "
                         "checkpoint from a copy or save it again") from None
    keys = ("format", "world_size", "units", "buffers", "files")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not all(k in meta for k in keys):
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{path} is not the metadata of a {FORMAT} checkpoint (format {found!r}, keys "
                         f"{keys} needed): save the checkpoint again with save_sharded")
    return meta


def _read_checked(fsdp: FSDP, directory: str, optimizer: torch.optim.Optimizer | None) -> dict:
    """This rank's payload, after checking it against the metadata and this model; raises otherwise."""
    meta = _read_metadata(directory)
    saved_n, n, rank = meta["world_size"], fsdp.ctx.world_size, fsdp.ctx.rank
    if saved_n != n:
        raise ValueError(
            f"the checkpoint in {directory} was saved by {saved_n} ranks, this run has {n}: a sharded "
            "checkpoint is cut per world size. Load it with the same world size, or go through a full "
            "state dict (full_state_dict / load_full_state_dict), which fits any world size.")
    mine = _metadata(fsdp)
    if meta["units"] != mine["units"]:
        why = _layout_difference(meta["units"], mine["units"])
        raise ValueError(f"the checkpoint's layout differs from this model's: {why}. Load it into the model that "
                         "saved it, wrapped the same way (wrap=)")
    path = os.path.join(directory, rank_file(rank))
    if not os.path.exists(path):
        present = sorted(f for f in os.listdir(directory) if f.startswith("shard_rank"))
        raise FileNotFoundError(f"rank {rank}'s file {path} is missing (found: {present}); "
                                f"a sharded checkpoint needs all {n} rank files")
    with open(path, "rb") as f:
        data = f.read()
    files = meta["files"]
    if len(data) != files[rank]["bytes"]:
        raise ValueError(f"{path} is {len(data)} bytes, save_sharded wrote {files[rank]['bytes']}: the file is "
                         "truncated or incomplete (an interrupted save or copy?); copy it again or save again")
    digest = hashlib.sha256(data).hexdigest()
    if digest != files[rank]["sha256"]:
        owner = [r for r, entry in enumerate(files) if entry["sha256"] == digest]
        if owner:
            raise ValueError(f"{path} holds rank {owner[0]}'s shards, not rank {rank}'s: the rank files were "
                             f"swapped or renamed; give every rank its own file back ({files[owner[0]]['name']})")
        raise ValueError(f"{path} is corrupted: its sha256 differs from the one {METADATA} recorded at save "
                         "time (the bytes changed since); restore it from a copy or save again")
    payload = torch.load(io.BytesIO(data), weights_only=True)
    if payload["rank"] != rank:  # the checksum already vouches for the file: this needs edited metadata too
        raise ValueError(f"{path} holds rank {payload['rank']}'s shards, not rank {rank}'s: the rank files "
                         "were swapped or renamed")
    for i, (h, saved) in enumerate(zip(fsdp.handles, payload["shards"], strict=True)):
        _check_same(path, f"flat parameter {i}", saved, h.shard)
    buffers = dict(fsdp.module.named_buffers())
    if set(payload["buffers"]) != set(buffers):
        raise ValueError(f"{path} holds the buffers {sorted(payload['buffers'])}, this model has "
                         f"{sorted(buffers)}: load into the same model")
    for name, buf in buffers.items():
        _check_same(path, f"buffer '{name}'", payload["buffers"][name], buf)
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state: save_sharded(..., optimizer=) to include it")
        saved_options = {k for g in payload["optimizer"]["param_groups"] for k in g if k != "params"}
        options = {k for g in optimizer.param_groups for k in g if k != "params"}
        if saved_options != options:  # e.g. AdamW's betas vs SGD's momentum: step() would miss its state
            raise ValueError(f"{path}: the saved optimizer had the options {sorted(saved_options - options)}, this "
                             f"{type(optimizer).__name__} has {sorted(options - saved_options)} instead: build the "
                             "optimizer that saved it (same type and options)")
        saved_groups = [len(g["params"]) for g in payload["optimizer"]["param_groups"]]
        groups = [len(g["params"]) for g in optimizer.param_groups]
        if saved_groups != groups:
            raise ValueError(f"{path}: the saved optimizer has parameter groups of sizes {saved_groups}, this one "
                             f"{groups}: build it the same way, over fsdp.parameters()")
    return payload


def _layout_difference(saved: list[dict], here: list[dict]) -> str:
    """The first place two unit lists (the metadata's) differ: a unit's name, or a parameter's name or shape."""
    names = ([u["name"] for u in saved], [u["name"] for u in here])
    if names[0] != names[1]:
        return f"units saved {names[0]}, here {names[1]}"
    for unit, a, b in zip(names[0], saved, here, strict=True):
        for j, (fa, fb) in enumerate(zip(a["flat_params"], b["flat_params"], strict=False)):
            for pa, pb in zip(fa["params"], fb["params"], strict=False):
                if (pa["name"], pa["shape"]) != (pb["name"], pb["shape"]):
                    return (f"in unit {unit or 'root'!r}, {pa['name']} was saved with shape {tuple(pa['shape'])}, "
                            f"here {pb['name']} has {tuple(pb['shape'])}")
            if fa != fb:
                return f"in unit {unit or 'root'!r}, flat parameter {j} holds other parameters or another dtype"
        if len(a["flat_params"]) != len(b["flat_params"]):
            return (f"unit {unit or 'root'!r} has {len(a['flat_params'])} flat parameters saved, "
                    f"{len(b['flat_params'])} here")
    return "the units differ"


def _check_same(path: str, what: str, saved: torch.Tensor, here: torch.Tensor) -> None:
    """Exact shape and dtype: copy_ would broadcast a (1,) into a (3,) and cast silently."""
    if saved.shape != here.shape or saved.dtype != here.dtype:
        raise ValueError(f"{path}: {what} was saved as {saved.dtype} {tuple(saved.shape)}, this model has "
                         f"{here.dtype} {tuple(here.shape)}: load into the same model (same sizes and dtypes)")

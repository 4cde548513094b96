"""Checkpoints PyTorch reads: the course's FSDP through `torch.distributed.checkpoint` (DCP).

state_dict.py saves a full state dict (any world size, but one rank holds everything) or the course's own
sharded format (one file per rank, cut for one world size). PyTorch's FSDP2 (`fully_shard`) saves neither: its
state dict holds every parameter as a DTensor on a 1-D device mesh with placement `Shard(0)` (rank r holds
rows chunk r of `torch.chunk(param, N, dim=0)`: c = ceil(dim0 / N) rows each, the last ranks fewer or none), and
`torch.distributed.checkpoint.save` writes each rank's chunks into its own `.distcp` file plus one `.metadata`
that records every tensor's global shape and which chunk lives where. `torch.distributed.checkpoint.load` fills a
state dict of DTensors laid out for *this* run, reading whatever saved chunks overlap each local chunk: that is
what lets a checkpoint saved at N ranks load at M, and one saved by `fully_shard` load into this FSDP.

This module converts between the two layouts, one flat parameter (one unit) at a time, never the whole model:
  - `model_state_dict(fsdp)`: gather a unit's flat parameter, cut each parameter's dim-0 chunk for this rank, wrap
    it as a DTensor (what `torch.distributed.checkpoint.state_dict.get_model_state_dict` returns for fully_shard),
    free the gathered buffer; buffers stay plain tensors (replicated), as there;
  - `optimizer_state_dict(fsdp, optimizer)`: the same cut for the optimizer state of each flat shard (Adam's
    exp_avg / exp_avg_sq, SGD's momentum_buffer), keyed by parameter name (`get_optimizer_state_dict`'s layout:
    {"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}); a scalar such as Adam's `step` is
    repeated under every parameter of the flat shard;
  - `save(fsdp, optimizer, path)`: `torch.distributed.checkpoint.save({"model": ..., "optim": ...})`;
  - `load(fsdp, optimizer, path)`: build the same layout for this run, `torch.distributed.checkpoint.load` into it,
    then per flat parameter gather the loaded chunks (one all-gather, FSDP2's copy-in / copy-out of per_param.py),
    flatten, and keep this rank's flat shard. Nothing is written into the model or the optimizer before the load
    succeeded everywhere: a bad checkpoint raises `CheckpointError` on every rank and changes nothing.

The top-level keys "model" and "optim" are the ones torch's DCP tutorial uses; a fully_shard model saved as
`dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=path)`
loads with `load`, and what `save` writes loads into fully_shard with `dcp.load` + `set_model_state_dict` /
`set_optimizer_state_dict`. All functions are collectives: call them on every rank. Source followed:
torch/distributed/checkpoint/{state_dict.py, default_planner.py, filesystem.py} (torch 2.13).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_course.fsdp.flat_param import FlatParamHandle, FlatParamLayout
from fsdp_course.fsdp.per_param import DimZeroShard, PerParamLayout, all_gather_params
from fsdp_course.fsdp.state_dict import FORMAT as COURSE_FORMAT
from fsdp_course.fsdp.state_dict import FSDP
from fsdp_course.fsdp.state_dict import METADATA as COURSE_METADATA

__all__ = ["CheckpointError", "MODEL_KEY", "OPTIM_KEY", "device_mesh", "dim0_chunks", "init_optimizer_state",
           "load", "model_state_dict", "optimizer_state_dict", "save"]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
DCP_METADATA = ".metadata"  # torch's FileSystemWriter: one per checkpoint, beside one .distcp file per rank
DIGESTS = "fsdp_course_digests.json"  # save's record of every file's sha256, beside them
LOCK = "fsdp_course_saving.lock"  # there while a save writes into the folder


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model: what is wrong and what to do (DCP's own error, when
    there is one, is the `__cause__`)."""


# -- the layout: one flat parameter <-> per-parameter Shard(0) chunks ---------------------------------------------
def device_mesh(fsdp: FSDP) -> DeviceMesh:
    """The 1-D device mesh over the FSDP's world (its process group), as fully_shard builds by default."""
    if getattr(fsdp, "mesh", None) is not None:  # every rank has the same mesh: all raise, none waits
        raise CheckpointError(
            "DCP checkpoints of an HSDP model (FSDP(..., mesh=...)) are not built here: its parameters would be "
            "(Replicate(), Shard(0)) DTensors on the 2-D mesh. Save fsdp.full_state_dict() instead (it gathers in "
            "the shard group; load it with load_full_state_dict at any world size), or checkpoint a 1-D FSDP")
    if getattr(fsdp.ctx, "simulated", False):  # DeviceMesh.from_group: "'ProcessGroupGloo' object is not iterable"
        raise CheckpointError(
            "DCP checkpoints need real processes: torch.distributed.checkpoint builds a DeviceMesh on a process group "
            "that torch.distributed knows, and the rank threads of run_ranks have private groups. Run this under "
            "torchrun (lessons/19_checkpoints.ipynb shows how), or inside run_ranks save fsdp.save_sharded(path) or "
            "fsdp.full_state_dict()")
    return DeviceMesh.from_group(fsdp.ctx.group, fsdp.ctx.device.type)


def dim0_chunks(layout: FlatParamLayout, flat: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    """Cut a gathered flat parameter `flat` (padded_numel,) into rank `rank`'s dim-0 chunk of each parameter.

    Parameter p of shape (d0, ...) gives rows [r * c, min((r + 1) * c, d0)) with c = ceil(d0 / world_size):
    torch.chunk's r-th chunk, empty (0, ...) when torch.chunk has fewer than world_size chunks. Copies, in
    `layout.infos` order; the flat parameter's padding is dropped (FSDP2 pads each parameter's chunk instead).
    """
    out = []
    for info, view in zip(layout.infos, layout.unflatten(flat), strict=True):
        if view.dim() == 0:
            raise ValueError(f"{info.name}: a 0-dim parameter has no dim 0 to shard (fully_shard refuses it too)")
        start, end = DimZeroShard(info.name, info.shape, world_size).row_range(rank)
        out.append(view[start:end].clone())  # (rows, *shape[1:])
    return out


def _dtensor(local: torch.Tensor, shape: torch.Size, mesh: DeviceMesh) -> DTensor:
    """This rank's dim-0 chunk `local` of a tensor of global `shape`, as fully_shard's DTensor (Shard(0))."""
    stride = torch.empty(shape, device="meta").stride()  # the full tensor's contiguous strides
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _gather_flat(fsdp: FSDP, local: torch.Tensor) -> torch.Tensor:
    """One flat shard (or a state tensor shaped like it) of every rank, end to end: (padded_numel,)."""
    return fsdp.ctx.all_gather(local.detach().contiguous())


def _cut(fsdp: FSDP, h: FlatParamHandle, local: torch.Tensor, mesh: DeviceMesh) -> list[DTensor]:
    """Gather one flat tensor shaped like `h.shard`, cut it into per-parameter DTensors, free the gathered copy."""
    full = _gather_flat(fsdp, local)  # (padded_numel,): one unit's flat parameter, gathered
    chunks = dim0_chunks(h.layout, full, fsdp.ctx.rank, fsdp.ctx.world_size)
    del full
    return [_dtensor(c, info.shape, mesh) for c, info in zip(chunks, h.layout.infos, strict=True)]


def _uncut(fsdp: FSDP, h: FlatParamHandle, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The reverse of `_cut`: this rank's flat shard (shard_numel,) from each parameter's loaded DTensor.

    One all-gather of the unit's padded chunks (FSDP2's copy-in / copy-out, per_param.py) rebuilds the full
    parameters; flattened and padded as `h.layout` says, this rank keeps its contiguous piece."""
    n, rank = fsdp.ctx.world_size, fsdp.ctx.rank
    layout = PerParamLayout.build([(i.name, torch.empty(i.shape, dtype=t.dtype, device="meta"))
                                   for i, t in zip(h.layout.infos, tensors, strict=True)], n)
    padded = []
    for spec, t in zip(layout.specs, tensors, strict=True):
        local = t.to_local() if isinstance(t, DTensor) else t
        chunk = torch.zeros(spec.padded_shape, dtype=local.dtype, device=h.shard.device)  # (c, *shape[1:])
        chunk[: spec.local_rows(rank)].copy_(local)
        padded.append(chunk)
    full = all_gather_params(fsdp.ctx, layout, padded)  # every parameter whole, for this unit only
    flat = h.layout.flatten(full).to(h.shard.device)  # (padded_numel,)
    return h.layout.shard(flat, rank).clone()  # (shard_numel,)


# -- state dicts in fully_shard's layout ----------------------------------------------------------------------------
@torch.no_grad()
def model_state_dict(fsdp: FSDP, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """{name: DTensor Shard(0)} for every parameter, buffers as plain tensors, keyed and ordered as the unwrapped
    module's state_dict(): what get_model_state_dict returns for a fully_shard-ed copy of the module. Built one
    flat parameter at a time (gathered, cut, freed)."""
    mesh = mesh or device_mesh(fsdp)
    values: dict[str, Any] = {}
    for h in fsdp.handles:
        for info, dt in zip(h.layout.infos, _cut(fsdp, h, h.shard, mesh), strict=True):
            for name in (info.name, *info.aliases):  # tied: one tensor under each name
                values[name] = dt
    for name, buf in fsdp.module.named_buffers(remove_duplicate=False):
        values.setdefault(name, buf.detach().clone())
    return {k: values[k] for k in fsdp.state_dict_keys}


def _flat_params_of(fsdp: FSDP, optimizer: torch.optim.Optimizer) -> dict[int, FlatParamHandle]:
    """id(shard) -> handle for every parameter the optimizer holds; raises if one is not this FSDP's."""
    handles = {id(h.shard): h for h in fsdp.handles}
    foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in handles]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not this FSDP's flat shards "
                         f"(shapes {foreign[:4]}): build it after wrapping, on fsdp.parameters()")
    return handles


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has never stepped its state (zeros), as torch's state_dict.py `_init_optim_state`
    does: one step with zero gradients and lr 0, which moves no parameter; then its step counters are set back to 0
    (torch leaves them at 1: Adam's bias correction of every later step would shift). Gradients already there are
    kept."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
        for state in optimizer.state.values():  # the state a first step starts from: no step taken yet
            if "step" in state:
                state["step"] = state["step"].zero_() if isinstance(state["step"], torch.Tensor) else 0
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def _is_flat(value: Any, h: FlatParamHandle) -> bool:
    """A state tensor laid out like the flat shard (exp_avg, momentum_buffer), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.shape == h.shard.shape


def _per_param_state(h: FlatParamHandle, flat_state: dict[str, Any],
                     cut_flat: Callable[[torch.Tensor], list[Any]]) -> dict[str, dict[str, Any]]:
    """One flat parameter's optimizer state as {fqn: {key: value}}: a state tensor laid out like the flat shard is cut
    by `cut_flat` into one value per parameter, a scalar (`step`) copied to each; parameters with no state are left
    out."""
    per_param: list[dict[str, Any]] = [{} for _ in h.layout.infos]
    for key in sorted(flat_state):
        value = flat_state[key]
        cut = cut_flat(value) if _is_flat(value, h) else [
            value.clone() if isinstance(value, torch.Tensor) else value for _ in h.layout.infos]
        for d, v in zip(per_param, cut, strict=True):
            d[key] = v
    return {info.name: d for info, d in zip(h.layout.infos, per_param, strict=True) if d}


def _param_groups(optimizer: torch.optim.Optimizer, handles: dict[int, FlatParamHandle]) -> list[dict[str, Any]]:
    """The optimizer's param_groups with each flat shard replaced by the names of the parameters it holds."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [i.name for p in g["params"] for i in handles[id(p)].layout.infos]}
            for g in optimizer.param_groups]


@torch.no_grad()
def optimizer_state_dict(fsdp: FSDP, optimizer: torch.optim.Optimizer,
                         mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The optimizer's state in get_optimizer_state_dict's layout for fully_shard: {"state": {fqn: {key: DTensor
    Shard(0) for a state tensor shaped like the parameter, a copy for a scalar such as `step`}}, "param_groups":
    [{hyperparameters..., "params": [fqn, ...]}]}. An optimizer that never stepped is given its zero state first
    (as torch does)."""
    mesh = mesh or device_mesh(fsdp)
    handles = _flat_params_of(fsdp, optimizer)
    fresh = not optimizer.state
    init_optimizer_state(optimizer)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    state: dict[str, dict[str, Any]] = {}
    try:
        for h in fsdp.handles:  # every rank in the same order: the gathers are collectives
            flat_state = optimizer.state.get(h.shard, {}) if id(h.shard) in held else {}
            state.update(_per_param_state(h, flat_state, lambda value, h=h: _cut(fsdp, h, value, mesh)))
    finally:
        if fresh:  # copies were taken: the optimizer is left as it was, its first step builds its own state
            optimizer.state.clear()
    groups = _param_groups(optimizer, handles)
    return {"state": state, "param_groups": groups}


# -- save / load ----------------------------------------------------------------------------------------------------
def _state(fsdp: FSDP, optimizer: torch.optim.Optimizer | None, mesh: DeviceMesh) -> dict[str, Any]:
    out: dict[str, Any] = {MODEL_KEY: model_state_dict(fsdp, mesh)}
    if optimizer is not None:
        out[OPTIM_KEY] = optimizer_state_dict(fsdp, optimizer, mesh)
    return out


def _agree(fsdp: FSDP, ok: bool) -> list[bool]:
    """Every rank's `ok`, by one all-gather on the raw group (bookkeeping: outside the ledger)."""
    mine = torch.tensor([float(ok)], device=fsdp.ctx.device)
    every = [torch.empty_like(mine) for _ in range(fsdp.ctx.world_size)]
    fsdp.ctx.group.allgather([every], [mine]).wait()
    return [bool(t.item()) for t in every]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(fsdp: FSDP, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> Metadata:
    """Write a DCP checkpoint of the model (and the optimizer) into the directory `path`: one `.distcp` file per
    rank with its chunks and one `.metadata` (torch.distributed.checkpoint.save). All ranks call it.

    Beside them rank 0 records every file's sha256 (`DIGESTS`): `load` then names a file that another save or a
    copy put there. While it saves, a lock file (`LOCK`) keeps a second job from saving into the same folder."""
    path = os.fspath(path)
    state = _state(fsdp, optimizer, device_mesh(fsdp))
    lock, locked = os.path.join(path, LOCK), True
    if fsdp.ctx.rank == 0:
        os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
        except FileExistsError:
            locked = False
    if not _agree(fsdp, locked)[0]:
        raise CheckpointError(f"another save is writing into {path} ({LOCK} is there): two jobs saving into one "
                              "folder overwrite each other's files. Save each job into its own folder; if no save is "
                              f"running (one that crashed left it), delete {lock}")
    try:
        metadata = torch_dcp.save(state, checkpoint_id=path, process_group=fsdp.ctx.group)
        if fsdp.ctx.rank == 0:
            files = sorted({sd.relative_path for sd in metadata.storage_data.values()} | {DCP_METADATA})
            digests = {name: _sha256(os.path.join(path, name)) for name in files}
            tmp = os.path.join(path, DIGESTS + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"sha256": digests}, f, indent=1)
            os.replace(tmp, os.path.join(path, DIGESTS))
    finally:
        if fsdp.ctx.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
    _agree(fsdp, True)  # the digests are written before any rank returns
    return metadata


def _check_digests(path: str, metadata: Metadata) -> None:
    """Every file the save recorded must be the one it wrote: a .distcp from another save of the same model (a
    partial copy, a crashed overwrite) would load without a word into values that equal neither save. A truncated
    or missing file is left to the load, which names it (`_damaged_files`), unless it holds another file's bytes."""
    damaged = _damaged_files(path, metadata)
    try:
        with open(os.path.join(path, DIGESTS)) as f:
            recorded = json.load(f)["sha256"]
    except FileNotFoundError:
        return  # saved by torch.distributed.checkpoint itself (fully_shard): nothing recorded to check
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{os.path.join(path, DIGESTS)} cannot be read ({type(exc).__name__}): restore the "
                              "checkpoint from a copy or save it again") from exc
    actual = {name: _sha256(os.path.join(path, name)) for name in recorded if os.path.exists(os.path.join(path, name))}
    problems = []
    for name, sha in recorded.items():
        if name not in actual or actual[name] == sha:
            continue  # a missing file: the load names it
        was = [other for other, s in recorded.items() if s == actual[name] and other != name]
        if was:
            problems.append(f"{name} holds what {was[0]} held (the files were swapped or renamed)")
        elif not any(d.startswith(f"{name} ") for d in damaged):  # truncated: the load names it
            problems.append(f"{name} is not the file this save wrote (its sha256 differs from the one recorded: it "
                            "comes from another save, or it was changed since)")
    if problems:
        raise CheckpointError(f"the checkpoint in {path} is not one save's files: {'; '.join(problems)}. Nothing was "
                              "loaded. Restore all its files from one save (or save again)")


def _flat_keys(tree: Any, prefix: str) -> dict[str, Any]:
    """DCP's flattened keys of a state dict (dicts joined by ".", a list of dicts by index): "model.0.weight",
    "optim.state.0.weight.exp_avg", "optim.param_groups.0.lr" (torch's _traverse.traverse_state_dict)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat_keys(v, f"{prefix}.{k}"))
        return out
    if isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flat_keys(v, f"{prefix}.{i}"))
        return out
    return {prefix: tree}


def _read_metadata(path: str) -> Metadata:
    """The checkpoint's .metadata, or a CheckpointError that says what the directory is instead."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory: a DCP checkpoint is a directory with a {DCP_METADATA} "
                              "file and one .distcp file per saving rank (save(fsdp, optimizer, path) writes one)")
    try:
        return torch_dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} holds no {DCP_METADATA}: not a DCP checkpoint. "
                              + _what_else(path, "this run")) from exc
    except Exception as exc:  # unpickling a damaged .metadata
        raise CheckpointError(f"{os.path.join(path, DCP_METADATA)} cannot be read ({type(exc).__name__}: {exc}): "
                              "the file is damaged or cut short; restore the checkpoint from a copy or save it "
                              "again") from exc


def _what_else(path: str, here: str) -> str:
    """Say what a directory without .metadata is (the course's own sharded format, cut for one world size)."""
    course = os.path.join(path, COURSE_METADATA)
    try:
        with open(course) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and meta.get("format") == COURSE_FORMAT:
        return (f"It is the course's own sharded format ({COURSE_FORMAT}, written by save_sharded at world size "
                f"{meta.get('world_size')}): each file holds one rank's piece of the flat parameters, cut for "
                f"exactly {meta.get('world_size')} ranks, with no record of where each parameter's rows are, so it "
                "cannot be resharded. Load it with load_sharded at that world size, then save(fsdp, optimizer, "
                f"path) writes a DCP checkpoint that {here} can load.")
    found = sorted(os.listdir(path))[:8]
    return f"Found {found}; save one with save(fsdp, optimizer, path) or torch.distributed.checkpoint.save."


def _wrong_shapes(metadata: Metadata, target: dict[str, Any]) -> list[str]:
    """Every parameter whose saved global shape differs from this model's."""
    saved = metadata.state_dict_metadata
    out = []
    for key, value in _flat_keys(target[MODEL_KEY], MODEL_KEY).items():
        md = saved.get(key)
        if isinstance(md, TensorStorageMetadata) and isinstance(value, torch.Tensor) and md.size != value.shape:
            out.append(f"{key[len(MODEL_KEY) + 1:]}: saved {tuple(md.size)}, this model {tuple(value.shape)}")
    return out


def _names(keys: list[str], top: str) -> str:
    names = [k[len(top) + 1:] for k in keys]
    return f"{names[:6]}{' ...' if len(names) > 6 else ''} ({len(names)})"


def _check_against_metadata(path: str, metadata: Metadata, target: dict[str, Any]) -> None:
    """Before anything is read: the checkpoint's own metadata must hold exactly what this model (and optimizer)
    needs, at this model's sizes, in files as long as it says. DCP reads only the keys it is asked for, so a key this
    model lacks would otherwise be dropped without a word. Any other error of DCP's load passes unchanged."""
    saved = metadata.state_dict_metadata
    wanted = {k[1:] for k in _flat_keys(target, "")}  # drop the leading "."
    missing = sorted(wanted - set(saved))
    model = [k for k in missing if k.startswith(f"{MODEL_KEY}.")]
    if model:
        raise CheckpointError(f"the checkpoint in {path} lacks parameters or buffers this model has: "
                              f"{_names(model, MODEL_KEY)}. It was saved from another model (or with other names): "
                              "load it into the model that saved it")
    if missing and not any(k.startswith(f"{OPTIM_KEY}.") for k in saved):
        raise CheckpointError(f"the checkpoint in {path} holds no optimizer state: load it with optimizer=None, or "
                              "save the optimizer with it")
    if missing:
        saved_keys = sorted({k.rsplit(".", 1)[1] for k in saved if k.startswith(f"{OPTIM_KEY}.state.")})
        raise CheckpointError(f"the checkpoint in {path} lacks optimizer state this optimizer needs: "
                              f"{_names(missing, OPTIM_KEY)}; its state has the keys {saved_keys}. Build the optimizer "
                              "that saved it (same type and options)")
    for top in target:
        extra = sorted(k for k in saved if k.startswith(f"{top}.") and k not in wanted)
        if extra and top == MODEL_KEY:
            raise CheckpointError(
                f"the checkpoint in {path} holds parameters or buffers this model does not have: "
                f"{_names(extra, top)}. It was saved from another model (or with other names): load it into that "
                "model, or rename its keys first")
        if extra and top == OPTIM_KEY:
            raise CheckpointError(
                f"the checkpoint in {path} holds optimizer state this optimizer does not have: {_names(extra, top)}. "
                "Build the optimizer that saved it (same type, options and parameter groups)")
    wrong = _wrong_shapes(metadata, target)
    if wrong:
        raise CheckpointError(f"the checkpoint in {path} was saved from a model of other sizes "
                              f"({'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}): load it into a model "
                              "built with the same sizes")
    damaged = _damaged_files(path, metadata)
    if damaged:
        raise CheckpointError(f"the checkpoint in {path} is damaged: {'; '.join(damaged)}. An interrupted save or "
                              "copy? Copy the checkpoint again or save it again")


def _damaged_files(path: str, metadata: Metadata) -> list[str]:
    """Each data file shorter than the items the metadata says it holds (a truncated .distcp), or missing."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            out.append(f"{name} is missing")
        elif os.path.getsize(file) < end:
            out.append(f"{name} is {os.path.getsize(file)} bytes, its items end at byte {end} (truncated)")
    return out


def _target(fsdp: FSDP, optimizer: torch.optim.Optimizer | None, mesh: DeviceMesh) -> dict[str, Any]:
    """What load() asks DCP to fill: this run's layout, with values to be overwritten (no collective: the chunks
    are allocated empty, of the shapes model_state_dict would give)."""
    n, rank = fsdp.ctx.world_size, fsdp.ctx.rank

    def empty_like(h: FlatParamHandle, value: torch.Tensor) -> list[DTensor]:
        out = []
        for info in h.layout.infos:
            start, end = DimZeroShard(info.name, info.shape, n).row_range(rank)
            local = torch.zeros((end - start, *info.shape[1:]), dtype=value.dtype, device=value.device)
            out.append(_dtensor(local, info.shape, mesh))
        return out

    values: dict[str, Any] = {}
    for h in fsdp.handles:
        for info, dt in zip(h.layout.infos, empty_like(h, h.shard), strict=True):
            for name in (info.name, *info.aliases):
                values[name] = dt
    for name, buf in fsdp.module.named_buffers(remove_duplicate=False):
        values.setdefault(name, buf.detach().clone())
    target: dict[str, Any] = {MODEL_KEY: {k: values[k] for k in fsdp.state_dict_keys}}
    if optimizer is None:
        return target
    handles = _flat_params_of(fsdp, optimizer)
    init_optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            h = handles[id(p)]
            state.update(_per_param_state(h, optimizer.state.get(p, {}), lambda value, h=h: empty_like(h, value)))
    groups = _param_groups(optimizer, handles)
    target[OPTIM_KEY] = {"state": state, "param_groups": groups}
    return target


@torch.no_grad()
def load(fsdp: FSDP, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Load a DCP checkpoint (saved by `save` at any world size, or by fully_shard with get_state_dict and
    torch.distributed.checkpoint.save) into this FSDP's flat shards (and the optimizer's state). All ranks call it.

    DCP reads, for every parameter, the saved chunks that overlap this rank's dim-0 chunk (resharding); then each
    flat parameter is rebuilt from its parameters' chunks (one all-gather per flat parameter) and this rank keeps
    its flat shard. A checkpoint that does not fit raises CheckpointError on every rank, and nothing changes."""
    path = os.fspath(path)
    mesh = device_mesh(fsdp)
    metadata = _read_metadata(path)
    _check_digests(path, metadata)
    fresh = optimizer is not None and not optimizer.state  # _target gives it a zero state; undone on failure
    try:
        target = _target(fsdp, optimizer, mesh)
        _check_against_metadata(path, metadata, target)  # what does not fit is named before anything is read
        torch_dcp.load(target, checkpoint_id=path, process_group=fsdp.ctx.group)
        groups = _check_optimizer(fsdp, optimizer, target[OPTIM_KEY], path) if optimizer is not None else []
    except BaseException:
        if fresh:
            optimizer.state.clear()  # type: ignore[union-attr]  (fresh implies an optimizer)
        raise
    model = target[MODEL_KEY]
    for h in fsdp.handles:  # one flat parameter at a time, every rank in the same order
        h.shard.copy_(_uncut(fsdp, h, [model[info.name] for info in h.layout.infos]))
    buffers = dict(fsdp.module.named_buffers(remove_duplicate=False))
    for name in fsdp.state_dict_keys:
        if name in buffers:
            buffers[name].copy_(model[name])
    if optimizer is not None:
        _load_optimizer(fsdp, optimizer, target[OPTIM_KEY], groups)


def _held(fsdp: FSDP, optimizer: torch.optim.Optimizer) -> list[FlatParamHandle]:
    """The flat parameters the optimizer steps, in unit order (the same on every rank: the gathers are collectives)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [h for h in fsdp.handles if id(h.shard) in held]


def _check_optimizer(fsdp: FSDP, optimizer: torch.optim.Optimizer, loaded: dict[str, Any],
                     path: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Before writing: a scalar state (step) must agree over each flat parameter's parameters, and every saved
    parameter group must match one of this optimizer's (by its parameter names). Returns (group, saved group)."""
    handles = _flat_params_of(fsdp, optimizer)
    for h in _held(fsdp, optimizer):
        flat_state = optimizer.state.get(h.shard, {})
        for key in sorted(k for k in flat_state if not _is_flat(flat_state[k], h)):
            values = [loaded["state"][info.name][key] for info in h.layout.infos]
            if any(not _same(v, values[0]) for v in values[1:]):
                seen: dict[Any, list[str]] = {}
                for name, v in zip(h.layout.names, values, strict=True):
                    seen.setdefault(_show(v), []).append(name)
                listing = "; ".join(f"{key} {v}: {names[:3]}{' ...' if len(names) > 3 else ''} ({len(names)})"
                                    for v, names in seen.items())
                raise CheckpointError(
                    f"the checkpoint in {path} holds different '{key}' values for parameters that share one flat "
                    f"parameter here ({listing}). This FSDP keeps one optimizer state per flat parameter; load the "
                    "checkpoint into fully_shard, or wrap so that these parameters are in different units")
    by_names = {tuple(sorted(i.name for p in g["params"] for i in handles[id(p)].layout.infos)): g
                for g in optimizer.param_groups}
    pairs = []
    for saved_group in loaded["param_groups"]:
        group = by_names.get(tuple(sorted(saved_group["params"])))
        if group is None:
            raise CheckpointError(f"the checkpoint in {path} has a parameter group of {len(saved_group['params'])} "
                                  "parameters that matches none of this optimizer's groups: build the optimizer "
                                  "with the same parameter groups")
        pairs.append((group, saved_group))
    return pairs


def _load_optimizer(fsdp: FSDP, optimizer: torch.optim.Optimizer, loaded: dict[str, Any],
                    groups: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for h in _held(fsdp, optimizer):
        flat_state = optimizer.state.get(h.shard, {})
        for key in sorted(flat_state):
            values = [loaded["state"][info.name][key] for info in h.layout.infos]
            if _is_flat(flat_state[key], h):
                flat_state[key].copy_(_uncut(fsdp, h, values))
            elif isinstance(flat_state[key], torch.Tensor):  # one scalar for the flat parameter (checked equal)
                flat_state[key].copy_(values[0])
            else:
                flat_state[key] = values[0]
    for group, saved_group in groups:
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _show(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


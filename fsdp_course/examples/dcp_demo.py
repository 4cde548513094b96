"""Lesson 19: DCP checkpoints of the course's FSDP and of `fully_shard`, saved at 2 ranks and loaded at 3 and back.

`torchrun --nproc-per-node 2 -m fsdp_course.examples.dcp_demo save CKPT`, then `--nproc-per-node 3 ... load CKPT`:
rank 0 writes CKPT/save2.json and CKPT/load3.json (what each phase found); the checkpoints stay in CKPT."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_course.engines.torch_fsdp import full_state_dict as torch_full_state_dict
from fsdp_course.engines.torch_fsdp import shard_with_fully_shard
from fsdp_course.fsdp import dcp
from fsdp_course.fsdp.api import FSDP
from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.context import RankContext

KINDS = ("ours", "torch")  # the course's FSDP, fully_shard


def engine(kind: str, ctx: RankContext, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial values on every rank
    model = TransformerClassifier(TransformerConfig.tiny())
    if kind == "ours":
        model = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer})
    else:
        model = shard_with_fully_shard(model, ctx)  # fully_shard per layer, then the root
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, ctx: RankContext) -> float:
    """Global batch i of 12 samples, this rank on its equal slice; returns the global batch's loss."""
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randint(0, 17, (12, 64), generator=g), torch.randint(0, 10, (12,), generator=g)
    rows = slice(ctx.rank * 12 // ctx.world_size, (ctx.rank + 1) * 12 // ctx.world_size)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    return ctx.all_reduce(loss.detach().reshape(1))[0].item() / ctx.world_size


def save(kind: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    if kind == "ours":
        dcp.save(model, opt, path)
    else:  # fully_shard: torch's own state dicts and torch's own save
        msd, osd = get_state_dict(model, opt)
        torch_dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(kind: str, model: nn.Module, opt: torch.optim.Optimizer, path: str, ctx: RankContext) -> None:
    if kind == "ours":
        dcp.load(model, opt, path)
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        torch_dcp.load(state, checkpoint_id=path, process_group=ctx.group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Parameters and optimizer state as full tensors (collectives: every rank calls it)."""
    if kind == "ours":
        params, osd = model.full_state_dict(), dcp.optimizer_state_dict(model, opt)
    else:
        params, osd = torch_full_state_dict(model), get_optimizer_state_dict(model, opt)
    state = {f"{name}.{key}": (v.full_tensor() if isinstance(v, DTensor) else v.clone())
             for name, s in osd["state"].items() for key, v in s.items()}
    return params, state


def equal_count(got: dict, want: dict) -> list[int]:
    """[how many of `want`'s tensors `got` holds bit for bit, how many there are]."""
    return [sum(torch.equal(got[k], v) for k, v in want.items()), len(want)]


def gap(a: dict, b: dict) -> float:
    """|a - b| / |b| over all tensors (the global norm)."""
    def norm(ts: Any) -> torch.Tensor:
        return sum(t.double().pow(2).sum() for t in ts) ** 0.5
    return (norm(a[k] - b[k] for k in b) / norm(b.values())).item()


def save_phase(world: RankContext, ckpt: str) -> dict[str, Any]:
    """Train both engines 3 steps, compare their state dicts, save both; the 4th step is the run that never stopped."""
    models = {kind: engine(kind, world) for kind in KINDS}
    for i in range(3):
        for model, opt in models.values():
            step(model, opt, i, world)
    ours, theirs = dcp.model_state_dict(models["ours"][0]), get_model_state_dict(models["torch"][0])
    report: dict[str, Any] = {"same_keys": list(ours) == list(theirs), "layout": {}}
    for k, v in ours.items():  # rank 0's chunk of each entry, in both engines
        a, b = v.to_local(), theirs[k].to_local()
        relative = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        report["layout"][k] = [list(v.shape), repr(v.placements), list(a.shape), list(b.shape),
                               repr(theirs[k].placements), relative]
    for kind, (model, opt) in models.items():
        save(kind, model, opt, f"{ckpt}/{kind}{world.world_size}")
        saved = full(kind, model, opt)
        loss4 = step(model, opt, 3, world)
        after4 = full(kind, model, opt)[0]
        if world.rank == 0:
            torch.save({"saved": saved, "loss4": loss4, "after4": after4}, f"{ckpt}/{kind}{world.world_size}.pt")
    models["ours"][0].save_sharded(f"{ckpt}/course{world.world_size}", models["ours"][1])  # the course's own format
    return report


def load_phase(world: RankContext, ckpt: str) -> dict[str, Any]:
    """Load the N = 2 checkpoints here (N = 3) into both engines, save again, load that at N = 2; two bad ones."""
    report: dict[str, Any] = {}
    refs = {kind: torch.load(f"{ckpt}/{kind}2.pt") for kind in KINDS}
    for source, into in [("ours", "ours"), ("ours", "torch"), ("torch", "ours")]:
        model, opt = engine(into, world, seed=1)  # other initial values: the load must replace them all
        load(into, model, opt, f"{ckpt}/{source}2", world)
        (params, state), ref = full(into, model, opt), refs[source]
        case = report[f"{source} N=2 -> {into} N={world.world_size}"] = {
            "params": equal_count(params, ref["saved"][0]), "optim": equal_count(state, ref["saved"][1])}
        if (source, into) == ("ours", "ours"):
            save("ours", model, opt, f"{ckpt}/ours{world.world_size}")  # saved again at N = 3
            ours3 = full("ours", model, opt)
        case["loss4"] = abs(step(model, opt, 3, world) - ref["loss4"]) / abs(ref["loss4"])
        case["params4"] = gap(full(into, model, opt)[0], ref["after4"])
    pair = dist.new_group([0, 1])  # 3 -> 2: ranks 0 and 1 of this job form a world of their own
    if world.rank < 2:
        ctx2 = RankContext(world.rank, 2, pair, device=world.device)
        for into in KINDS:
            model, opt = engine(into, ctx2, seed=2)
            load(into, model, opt, f"{ckpt}/ours{world.world_size}", ctx2)
            params, state = full(into, model, opt)
            report[f"ours N={world.world_size} -> {into} N=2"] = {
                "params": equal_count(params, ours3[0]), "optim": equal_count(state, ours3[1])}
    world.barrier()
    if world.rank == 0:  # a copy whose first data file lost its second half (an interrupted copy)
        shutil.copytree(f"{ckpt}/ours2", f"{ckpt}/cut")
        with open(f"{ckpt}/cut/__0_0.distcp", "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    world.barrier()
    for case in ("cut", "course2"):
        model, opt = engine("ours", world, seed=1)
        before = model.full_state_dict()
        try:
            dcp.load(model, opt, f"{ckpt}/{case}")
        except dcp.CheckpointError as exc:
            report[case] = {"message": str(exc), "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
                            "unchanged": all(torch.equal(v, before[k]) for k, v in model.full_state_dict().items())}
    return report


def main(phase: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    world = RankContext.from_env(timeout=60)  # RANK, WORLD_SIZE, MASTER_*: from torchrun
    report = (save_phase if phase == "save" else load_phase)(world, ckpt)
    if world.rank == 0:
        with open(f"{ckpt}/{phase}{world.world_size}.json", "w") as f:
            json.dump(report, f)
    world.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
    world.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # and leave at once: in about 1 run in 10 on a loaded machine, one rank of the 3-process load aborted in the
    # interpreter's shutdown, after its last Python line ("terminate called without an active exception": a C++
    # thread still joinable when its owner was destroyed); nothing is left to clean up once the group is destroyed
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Lesson 11, Try this: `fully_shard`'s settings (reshard_after_forward, the units, the mesh), measured per rank.

`torchrun --nproc-per-node N -m fsdp_course.examples.fully_shard_settings SETTINGS_JSON OUT`, SETTINGS_JSON a list
of [reshard_after_forward, [class names]]: each rank writes OUT/rank{r}.json, one result per setting."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_course.data import digits_tokens
from fsdp_course.engines.torch_fsdp import count_collectives
from fsdp_course.fsdp.meta_init import init_weights
from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.context import RankContext


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages behind the tensors, each storage once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def shard(model: nn.Module, mesh: object, reshard: bool | None, wrap: Iterable[str]) -> None:
    """fully_shard on every module of the classes `wrap` (bottom-up, as its documentation asks), then the root."""
    classes = tuple(getattr(nn, name) for name in wrap)
    for module in reversed(list(model.modules())):
        if module is not model and isinstance(module, classes):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)  # the root: what no unit took


def unit_sizes(wrap: Iterable[str], n: int) -> dict[str, int]:
    """The units `shard` makes for `wrap`, the root last: elements after dim-0 padding to a multiple of n."""
    with torch.device("meta"):  # shapes only
        model = TransformerClassifier(TransformerConfig.small())
    classes = tuple(getattr(nn, name) for name in wrap)
    padded = lambda p: -(-p.shape[0] // n) * n * p[0].numel()  # noqa: E731  (rows rounded up) x (row size)
    sizes, taken = {}, set()
    for name, module in reversed(list(model.named_modules())):
        if module is not model and isinstance(module, classes):
            mine = [p for p in module.parameters() if id(p) not in taken]
            taken |= {id(p) for p in mine}
            sizes[name] = sum(padded(p) for p in mine)
    sizes = dict(reversed(sizes.items()))  # in the model's order
    sizes["root"] = sum(padded(p) for p in model.parameters() if id(p) not in taken)
    return sizes


def main(settings_json: str, out: str) -> None:
    settings = json.loads(settings_json)
    ctx = RankContext.from_env(timeout=60)             # RANK, WORLD_SIZE, MASTER_*: from torchrun
    mesh = init_device_mesh("cpu", (ctx.world_size,))  # 1-D: every rank keeps one shard of every parameter
    tokens, labels = digits_tokens()
    b = 32 // ctx.world_size                           # this rank's slice of a global batch of 32
    x, y = tokens[ctx.rank * b:(ctx.rank + 1) * b], labels[ctx.rank * b:(ctx.rank + 1) * b]
    results = []
    for reshard, wrap in settings:
        model = init_weights(TransformerClassifier(TransformerConfig.small()), 0)  # the same values on every rank
        shard(model, mesh, reshard, wrap)
        shards = storage_bytes(p.to_local() for p in model.parameters())  # every parameter is a DTensor now
        ctx.ledger.clear()
        with count_collectives(ctx):                   # fully_shard's collectives, in the course's ledger
            ctx.ledger.mark("forward")
            loss = F.cross_entropy(model(x), y)
            held = storage_bytes(p for p in model.parameters() if not isinstance(p, DTensor))  # still gathered
            ctx.ledger.mark("backward")
            loss.backward()
        gathered_after = storage_bytes(p for p in model.parameters() if not isinstance(p, DTensor))
        results.append({"shards": shards, "held": held, "held_after_backward": gathered_after,
                        **{phase: ctx.ledger.total(label=phase)[0] for phase in ("forward", "backward")},
                        **{f"{phase}_ops": [r.op for r in ctx.ledger.select(label=phase)]
                           for phase in ("forward", "backward")}})
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(results, f)
    ctx.barrier()
    ctx.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Claims the lessons make about PyTorch itself, checked against torch in real processes under torchrun.

Every claim runs in the 2 processes of the suite's "pair" launch (tests/phases.py: Gloo, CPU); each process writes
what it found to `rank{R}.json` (a file, not stdout: two processes' long lines interleave in one pipe), and each
test asserts on what both ranks reported for its claim.

- `fully_shard` broadcasts nothing at construction (lessons 00 and 06). torch/distributed/fsdp/_fully_shard/
  _fully_shard.py and _fsdp_init.py issue no collective (`_move_states_to_device` only moves tensors), and
  `FSDPParam._init_sharded_param` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) keeps
  `_chunk_with_empty(param_data, shard_world_size, dim=shard_dim)[shard_rank]`: this rank's chunk of its OWN
  tensor. Seeded with their ranks, two processes therefore hold a weight whose rows 0..k-1 are rank 0's
  initialization and the rest rank 1's; with one seed everywhere it is that one initialization. FSDP1 broadcasts
  only with `sync_module_states=True` (torch/distributed/fsdp/_init_utils.py, `_sync_module_params_and_buffers`);
  `fully_shard` has no such argument. A model built on the meta device and initialized after `to_empty` with
  `reset_parameters()` is no fix on a CPU mesh: DTensor's random ops are only supported on CUDA-like devices
  (`is_rng_supported_mesh`, torch/distributed/tensor/_random.py), so each rank fills its chunk from its own
  generator, and one seed everywhere gives every rank the same rows.
- DDP's buckets (lesson 02). torch/nn/parallel/distributed.py: with the default `gradient_as_bucket_view=False`
  the Reducer copies each gradient into a flat all-reduce bucket and back, so the buckets live beside the
  gradients, 4 more bytes per float32 parameter; with `True` every `p.grad` is a view into its bucket. Measured
  with torch's MemTracker (torch/distributed/_tools/mem_tracker.py, which needs a process of its own: it hooks
  modules globally) and by the storages of the buckets a communication hook sees. DDP's constructor broadcasts
  rank 0's parameters (`init_sync=True`, `_sync_module_states`).
- An optimizer built before `fully_shard` trains nothing, silently (lesson 10, pitfall 5.4): `fully_shard` replaces
  every parameter with a DTensor one (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `FSDPParam`), so the
  optimizer's tensors get no gradient and `step()` skips them; built after it, from `model.parameters()`, it trains.
- The article's `AutoWrapPolicy.TRANSFORMER_BASED` names nothing in torch's FSDP (lesson 10, pitfall 5.3): its
  policies are `ModuleWrapPolicy` and `transformer_auto_wrap_policy` (torch/distributed/fsdp/wrap.py), and the C++
  library's bindings, what the article's JavaCPP wraps, hold Gloo and no FSDP. A Gloo device can be given a network
  interface instead of a hostname (`ProcessGroupGloo.create_device(interface=...)`).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from phases import launched
from torch import nn

HERE = Path(__file__)
ROWS, COLS = 6, 4  # nn.Linear(COLS, ROWS).weight: (6, 4), two chunks of 3 rows on 2 ranks


def seeded_linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(COLS, ROWS)


def seeded_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


# -- what runs inside each torchrun process --------------------------------------------------------------------


def claim_fully_shard_init(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for name, seed in (("per_rank_seed", rank), ("one_seed", 0)):
        model = seeded_linear(seed)  # this process's own initialization
        fully_shard(model, mesh=mesh)
        out[name] = {"local": model.weight.to_local().tolist(), "full": model.weight.full_tensor().tolist()}
    for name, seed in (("meta_per_rank_seed", rank), ("meta_one_seed", 0)):
        with torch.device("meta"):
            model = nn.Linear(COLS, ROWS)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        model.reset_parameters()  # on DTensor parameters
        out[name] = {"full": model.weight.full_tensor().tolist()}
    return out


def claim_ddp_buckets(rank: int) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    def hook(seen, bucket):  # unannotated: DDP compares annotations with dist.GradBucket, and ours are strings
        seen.append(bucket.buffer())  # the flat bucket the Reducer all-reduces
        return default_hooks.allreduce_hook(None, bucket)  # None: the default process group

    rank0 = [p.detach() for p in seeded_mlp(0).parameters()]  # what rank 0 builds
    own = [p.detach() for p in seeded_mlp(rank).parameters()]
    out: dict[str, Any] = {"own_init_is_rank0s": all(torch.equal(p, q) for p, q in zip(own, rank0, strict=True))}
    for flag in (False, True):
        model = seeded_mlp(rank)  # per-rank seeds: DDP's constructor must make them equal
        buckets: list[torch.Tensor] = []
        tracker = MemTracker()
        with tracker:  # entered before DDP exists: the buckets it allocates are tracked too
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=flag)
            synced = [p.detach().clone() for p in model.parameters()]  # right after the constructor
            ddp.register_comm_hook(buckets, hook)
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
            ddp(x).square().mean().backward()
            live = tracker.get_tracker_snapshot("current")
        params = list(model.parameters())
        bucket_storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in buckets}
        grad_storages = {p.grad.untyped_storage().data_ptr() for p in params}
        out[str(flag)] = {
            "psi": sum(p.numel() for p in params),
            "live_bytes": sum(v.get("Total", 0) for v in live.values()),
            "bucket_bytes": sum(bucket_storages.values()),
            "grads_in_buckets": grad_storages <= set(bucket_storages),
            "grads_beside_buckets": not grad_storages & set(bucket_storages),
            "synced_to_rank0": all(torch.equal(p, q) for p, q in zip(synced, rank0, strict=True)),
            "grad_sum": sum(p.grad.double().sum().item() for p in params),
        }
    return out


def claim_optimizer_before_fully_shard(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    y = torch.arange(16) % 10
    out: dict[str, Any] = {}
    for order in ("before", "after"):
        model = seeded_mlp(0)
        if order == "before":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # the model's own tensors
            original = list(model.parameters())
        fully_shard(model, mesh=mesh)
        if order == "after":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # fully_shard's DTensor parameters
        else:
            out["kept_the_originals"] = not any(p is q for p in model.parameters() for q in original)
        losses = []
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # raises nothing either way
            optimizer.zero_grad()
            losses.append(loss.item())
        out[order] = losses
    return out


CLAIMS = {"fully_shard_init": claim_fully_shard_init, "ddp_buckets": claim_ddp_buckets,
          "optimizer_before_fully_shard": claim_optimizer_before_fully_shard}


def phase(out: Path) -> None:  # in each process of the "pair" launch (tests/phases.py), the world joined
    import torch.distributed as dist

    result = {claim: check(dist.get_rank()) for claim, check in CLAIMS.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


# -- the tests: launch, then assert ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = launched(tmp_path_factory, "torch_claims")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_fully_shard_keeps_each_ranks_own_chunk_and_broadcasts_nothing(reports: list[dict[str, Any]]) -> None:
    ranks = [r["fully_shard_init"] for r in reports]
    init = [seeded_linear(r).weight.detach() for r in range(2)]  # what each process built before fully_shard
    half = ROWS // 2
    stitched = torch.cat([init[0][:half], init[1][half:]])
    for rank, out in enumerate(ranks):
        local = torch.tensor(out["per_rank_seed"]["local"])
        assert torch.equal(local, init[rank][rank * half:(rank + 1) * half]), "each rank keeps a chunk of its own"
        full = torch.tensor(out["per_rank_seed"]["full"])
        assert torch.equal(full, stitched), "full_tensor(): rank 0's rows, then rank 1's rows"
        assert not torch.equal(full, init[0]) and not torch.equal(full, init[1]), "neither rank's initialization"
        assert torch.equal(torch.tensor(out["one_seed"]["full"]), init[0]), "one seed everywhere: that one init"
        # meta device + reset_parameters on a CPU mesh: every rank draws its own chunk from its own generator
        meta_one = torch.tensor(out["meta_one_seed"]["full"])
        assert torch.equal(meta_one[:half], meta_one[half:]), "one seed: both chunks are the same numbers"
        meta_per_rank = torch.tensor(out["meta_per_rank_seed"]["full"])
        assert not torch.equal(meta_per_rank[:half], meta_per_rank[half:])
    assert ranks[0]["per_rank_seed"]["full"] == ranks[1]["per_rank_seed"]["full"], "both ranks gather the same"


def test_only_fsdp1_has_an_option_to_broadcast_at_init() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    assert "sync_module_states" in inspect.signature(FullyShardedDataParallel.__init__).parameters
    assert "sync_module_states" not in inspect.signature(fully_shard).parameters


def test_ddp_default_keeps_buckets_beside_the_gradients(reports: list[dict[str, Any]]) -> None:
    ranks = [r["ddp_buckets"] for r in reports]
    for out in ranks:
        off, on = out["False"], out["True"]
        psi = off["psi"]
        assert off["bucket_bytes"] == on["bucket_bytes"] == 4 * psi, "the buckets hold every float32 gradient"
        assert off["grads_beside_buckets"] and not off["grads_in_buckets"], "False: gradients are separate tensors"
        assert on["grads_in_buckets"], "True: every p.grad is a view into a bucket"
        assert off["live_bytes"] - on["live_bytes"] == 4 * psi, "MemTracker: the default holds 4 bytes x Ψ more"
        assert off["grad_sum"] == on["grad_sum"], "the same averaged gradients either way"
        assert off["synced_to_rank0"] and on["synced_to_rank0"], "DDP's constructor broadcast rank 0's parameters"
    assert not ranks[1]["own_init_is_rank0s"], "rank 1 had built other values"
    assert ranks[0]["False"]["grad_sum"] == ranks[1]["False"]["grad_sum"], "both ranks hold the averaged gradient"



def test_an_optimizer_built_before_fully_shard_trains_nothing(reports: list[dict[str, Any]]) -> None:
    for out in (r["optimizer_before_fully_shard"] for r in reports):
        assert out["kept_the_originals"], "fully_shard replaced every parameter the optimizer holds"
        assert len(set(out["before"])) == 1, "built before: no error, and the loss never moves"
        assert out["after"][0] == out["before"][0] and out["after"][2] < out["after"][1] < out["after"][0], \
            "built after, from model.parameters(): the same first loss, then it falls"


def test_the_articles_wrap_policy_exists_nowhere_in_torch() -> None:
    # lesson 10: `auto_wrap_policy().put(AutoWrapPolicy.TRANSFORMER_BASED)` names nothing in PyTorch's FSDP (Python),
    # and libtorch, what JavaCPP wraps, has no FSDP at all: its bindings hold Gloo, not FSDP
    import importlib
    import pkgutil

    import torch.distributed.fsdp as fsdp

    found = pkgutil.walk_packages(fsdp.__path__, "torch.distributed.fsdp.")
    modules = [fsdp] + [importlib.import_module(m.name) for m in found]
    names = {name for module in modules for name in dir(module)}
    assert len(modules) > 10 and {"ModuleWrapPolicy", "transformer_auto_wrap_policy", "fully_shard"} <= names
    assert not {"AutoWrapPolicy", "TRANSFORMER_BASED"} & names
    assert hasattr(fsdp.wrap, "ModuleWrapPolicy")
    bindings = torch._C._distributed_c10d
    assert hasattr(bindings, "ProcessGroupGloo") and hasattr(bindings.ProcessGroupGloo, "create_device")
    assert not [n for n in dir(bindings) + dir(torch._C) if "fsdp" in n.lower() or "fullyshard" in n.lower()]


def test_a_gloo_device_can_name_a_network_interface() -> None:
    # lesson 10's fix for the device pinned to 127.0.0.1: create_device(interface=...) instead of a hostname
    import socket

    import torch.distributed as dist

    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is None:
        pytest.skip("this machine names no loopback interface lo*")
    assert dist.ProcessGroupGloo.create_device(interface=loopback) is not None

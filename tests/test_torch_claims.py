"""Claims the lessons make about PyTorch itself, checked against torch in real processes under torchrun.

Every claim runs in the 2 processes of the suite's "pair" launch (tests/phases.py: Gloo, CPU), HSDP's in the 4 of
the "four" launch; each process writes what it found to `rank{R}.json` (a file, not stdout: processes' long lines
interleave in one pipe), and each test asserts on what every rank reported for its claim. Collectives are observed
by wrapping `torch.distributed`'s functions (`issued`), the order of the backward by an identity on each weight.

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
- A unit whose forward inputs need no gradient (token ids, data) gets no post-backward hook (lesson 11): FSDP2
  attaches it to those inputs (`FSDPParamGroup._register_post_backward_hook`), so its reduce-scatter waits for the
  root's final callback, after the whole backward; `set_unshard_in_backward(False)` spares an embedding's re-gather.
- `fully_shard` on a 2-D mesh (lesson 16): all-gathers and AVG reduce-scatters in the shard group, the root
  gathered once per step, then an AVG all-reduce of each reduced shard in the replicate group (`foreach_reduce`,
  torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); `set_requires_all_reduce(False)` keeps the
  reduce-scatters of a microbatch and defers the all-reduce to the last one.
- Loss scaling under `fully_shard` (lesson 13): an inf in one rank's shard makes torch's `ShardedGradScaler` (one
  all-reduce of the flag, op SUM) and the plain `GradScaler` (none: DTensor reduces the flag of its own check,
  `found_inf_reduce_handler` in torch/distributed/tensor/_dispatch.py) skip the step on every rank.
- Frozen and trainable parameters in one `fully_shard` group (lesson 17): their dtypes must agree among the
  trainable ones only; a frozen bf16 weight beside trainable fp32 ones trains, two trainable dtypes are refused.
- `CPUOffloadPolicy` (lesson 18) pins the host shards by default, and pinning needs an accelerator: on a CPU-only
  machine `fully_shard` raises while sharding; unpinned it runs, and its all-gather reads the host shard itself.
- Prefetch and recomputation (lessons 14 and 15): by default `fully_shard` prefetches the next unit's all-gather in the
  backward and in the forward only when told (`set_modules_to_forward_prefetch`); every unshard passes
  `async_op=False` unless `_set_unshard_async_op(True)`; a checkpoint around several units recomputes them with no
  extra all-gather; `checkpoint` replays dropout's masks.
- Attention (lessons 15, 17): `scaled_dot_product_attention`'s fused CPU kernel saves no tokens x tokens matrix for
  the backward, its math fallback does; `nn.MultiheadAttention` has one `in_proj_weight` only when queries, keys
  and values share one embedding size.
- The article's `AutoWrapPolicy.TRANSFORMER_BASED` names nothing in torch's FSDP (lesson 10, pitfall 5.3): its
  policies are `ModuleWrapPolicy` and `transformer_auto_wrap_policy` (torch/distributed/fsdp/wrap.py), and the C++
  library's bindings, what the article's JavaCPP wraps, hold Gloo and no FSDP. A Gloo device can be given a network
  interface instead of a hostname (`ProcessGroupGloo.create_device(interface=...)`).
"""

from __future__ import annotations

import contextlib
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


def issued(events: list[Any]) -> contextlib.AbstractContextManager[None]:
    """While active, each collective torch.distributed runs is appended to `events` as [op, its group's ranks, the
    numel of the full tensor, the reduce op]."""
    import torch.distributed as dist

    from fsdp_course.engines.torch_fsdp import watch_collectives

    def seen(op: str, full: torch.Tensor, arguments: dict[str, Any]) -> None:
        group = arguments.get("group") or dist.group.WORLD
        events.append([op, dist.get_process_group_ranks(group), full.numel(), str(arguments.get("op"))])

    return watch_collectives(seen)


class Tap(torch.autograd.Function):
    """Identity on a weight; its backward notes in `events` that the weight's gradient has been computed."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, events: list[Any], name: str) -> torch.Tensor:
        ctx.events, ctx.name = events, name
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.events.append(["computed", ctx.name])
        return grad, None, None


class Tapped(nn.Linear):
    def __init__(self, n_in: int, n_out: int, events: list[Any], name: str) -> None:
        super().__init__(n_in, n_out)
        self.events, self.name = events, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, Tap.apply(self.weight, self.events, self.name), self.bias)


class TwoBranches(nn.Module):  # A(x) + B(x): after one branch's backward the other's still runs
    def __init__(self, events: list[Any]) -> None:
        super().__init__()
        self.a, self.b = Tapped(8, 4, events, "a"), Tapped(8, 4, events, "b")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def claim_unit_without_input_gradients(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for needs_grad in (False, True):  # the units' forward input: token-like data, or an activation
        events: list[Any] = []
        torch.manual_seed(0)
        model = TwoBranches(events)
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_(needs_grad)
        loss = model(x).square().mean()
        with issued(events):
            loss.backward()
        out[str(needs_grad)] = [e[:2] for e in events if e[0] in ("computed", "reduce_scatter")]
    grads = {}  # an embedding unit told not to unshard in the backward: gathered once per step
    for unshard_in_backward in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model[0].set_unshard_in_backward(unshard_in_backward)
        tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(rank))
        with issued(events := []):
            model(tokens).square().mean().backward()
        out[f"embedding_gathers_{unshard_in_backward}"] = sum(1 for e in events if e[0] == "all_gather")
        grads[unshard_in_backward] = model[0].weight.grad.full_tensor()
    out["embedding_same_gradient"] = torch.equal(grads[True], grads[False])
    return out


def claim_scalers_under_fully_shard(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = init_device_mesh("cpu", (2,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    out: dict[str, Any] = {}
    for name, make in (("GradScaler", lambda: torch.amp.GradScaler("cpu")),
                       ("ShardedGradScaler", lambda: ShardedGradScaler("cpu"))):
        model = seeded_mlp(0)
        fully_shard(model[0], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = make()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
        scaler.scale(model(x).float().square().mean()).backward()
        if rank == 1:  # an overflow in rank 1's shard only
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        with issued(events := []):
            scaler.step(opt)
        scaler.update()
        out[name] = {"stepped": any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(),
                                                                                     strict=True)),
                     "scale": scaler.get_scale(), "all_reduces": [e[3] for e in events if e[0] == "all_reduce"]}
    return out


class MixedDtypes(nn.Module):  # one fp32 and one bf16 weight in one unit
    def __init__(self, bf16_trains: bool) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 8))
        self.b = nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16), requires_grad=bf16_trains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a.T + (x.bfloat16() @ self.b.T).float()


def claim_dtype_among_trainable_only(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for bf16_trains in (False, True):
        torch.manual_seed(0)
        model = fully_shard(MixedDtypes(bf16_trains), mesh=mesh)
        try:
            model(torch.randn(2, 8)).square().mean().backward()
            out[str(bf16_trains)] = {"raised": None, "grads": [p.grad is not None for p in (model.a, model.b)]}
        except Exception as exc:  # noqa: BLE001  (the type is the claim)
            out[str(bf16_trains)] = {"raised": type(exc).__name__}
    return out


def claim_cpu_offload_policy(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {"accelerator": torch.accelerator.is_available(),
                           "pins_by_default": CPUOffloadPolicy().pin_memory}
    try:
        fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh=mesh, offload_policy=CPUOffloadPolicy())
        out["default"] = "ran"
    except RuntimeError as exc:
        out["default"] = type(exc).__name__
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    model(torch.randn(2, 4)).sum().backward()
    fsdp_param = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]  # private: only to see the storages
    out["all_gather_input_is_the_shard"] = (fsdp_param.all_gather_inputs[0].untyped_storage().data_ptr()
                                            == fsdp_param._sharded_param_data.untyped_storage().data_ptr())
    out["devices"] = sorted({f"{p.device.type}/{p.grad.device.type}" for p in model.parameters()})
    return out


class Chain(nn.Module):  # three units of distinct sizes, a forward hook and a weight Tap on each
    def __init__(self, events: list[Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Tapped(n_in, n_out, events, str(i))
                                    for i, (n_in, n_out) in enumerate(((8, 8), (8, 6), (6, 4))))
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(lambda *_, i=i: events.append(["forward", str(i)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def claim_prefetch(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for mode in ("default", "explicit forward", "async"):
        events: list[Any] = []
        torch.manual_seed(0)
        model = Chain(events)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mode == "explicit forward":
            model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
        if mode == "async":
            model._set_unshard_async_op(True)

        def seen(op: str, full: torch.Tensor, arguments: dict[str, Any], events: list[Any] = events) -> None:
            if op == "all_gather":  # which unit, by its size, and whether the call returned before the data came
                events.append(["all_gather", {72: "0", 54: "1", 28: "2"}[full.numel()], arguments["async_op"]])

        from fsdp_course.engines.torch_fsdp import watch_collectives
        with watch_collectives(seen):
            loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).square().mean()
            events.append(["backward"])
            loss.backward()
        out[mode] = events
    return out


class Checkpointed(nn.Module):  # three Linear units inside one activation checkpoint, or not
    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.layers, self.checkpoint = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 6), nn.Linear(6, 4)), checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self.layers, x, use_reentrant=False)
        return self.layers(x)


def claim_checkpoint_around_units(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    grads: dict[bool, list[torch.Tensor]] = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = Checkpointed(checkpoint)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs = []
        for layer in model.layers:
            layer.register_forward_hook(lambda *_, runs=runs: runs.append(1))
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
        with issued(events := []):
            model(x).square().mean().backward()
        out[str(checkpoint)] = {"gathers": sum(1 for e in events if e[0] == "all_gather"), "forwards": len(runs)}
        grads[checkpoint] = [p.grad.full_tensor() for p in model.parameters()]
    out["same_gradients"] = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))
    return out


def claim_accumulation_switches(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for switch in ("no sync", "keep gathered after backward"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
        if switch == "no sync":
            model.set_requires_gradient_sync(False)
        else:
            model.set_reshard_after_backward(False)
        counts = []
        for micro in range(2):
            if switch == "no sync" and micro == 1:
                model.set_requires_gradient_sync(True)
            with issued(events := []):
                model(x).square().mean().backward()
            counts.append({op: sum(1 for e in events if e[0] == op) for op in ("all_gather", "reduce_scatter")})
        out[switch] = counts
    return out


def claim_hsdp_collectives(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))  # the last Linear: the root's own
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    out: dict[str, Any] = {"unit": sum(p.numel() for p in nn.Linear(8, 6).parameters()),
                           "root": sum(p.numel() for p in nn.Linear(6, 4).parameters())}
    model = build()
    with issued(events := []):  # one step
        model(batches[0]).square().mean().backward()
    out["step"] = events
    grads = {}
    for mode in ("every", "last"):  # two microbatches: all-reduce after each, or only after the last
        model = build()
        events = []
        for i, x in enumerate(batches):
            if mode == "last":
                model.set_requires_all_reduce(i == len(batches) - 1)
            with issued(events):
                model(x).square().mean().backward()
        out[mode] = events
        grads[mode] = [p.grad.full_tensor() for p in model.parameters()]
    out["accumulated_gap"] = max((a - b).abs().max().item() for a, b in zip(*grads.values(), strict=True))
    return out


def phase_hsdp(out: Path) -> None:  # in each process of the "four" launch (tests/phases.py): a 2 x 2 mesh
    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(claim_hsdp_collectives(dist.get_rank())))


CLAIMS = {"fully_shard_init": claim_fully_shard_init, "ddp_buckets": claim_ddp_buckets,
          "optimizer_before_fully_shard": claim_optimizer_before_fully_shard,
          "unit_without_input_gradients": claim_unit_without_input_gradients,
          "scalers_under_fully_shard": claim_scalers_under_fully_shard,
          "dtype_among_trainable_only": claim_dtype_among_trainable_only,
          "cpu_offload_policy": claim_cpu_offload_policy, "prefetch": claim_prefetch,
          "checkpoint_around_units": claim_checkpoint_around_units,
          "accumulation_switches": claim_accumulation_switches}


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


def test_the_articles_allgather_options_has_no_torch_distributed_name() -> None:
    # lesson A1: the article's `new AllgatherOptions()` is a C++ class torch.distributed does not re-export
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions

    assert not hasattr(dist, "AllgatherOptions") and hasattr(AllgatherOptions(), "timeout")


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


def test_a_unit_whose_inputs_need_no_gradient_reduces_after_the_whole_backward(reports: list[dict[str, Any]]) -> None:
    # lesson 11: FSDP2 hooks a unit's post-backward to its forward inputs that require a gradient; with none (token
    # ids, data), the unit's reduce-scatter waits for the root's final callback, after every gradient is computed
    for out in (r["unit_without_input_gradients"] for r in reports):
        data, activation = out["False"], out["True"]
        last_compute = max(i for i, e in enumerate(data) if e[0] == "computed")
        first_reduce = min(i for i, e in enumerate(data) if e[0] == "reduce_scatter")
        assert len(data) == 4 and first_reduce > last_compute, f"no reduce-scatter overlaps the backward: {data}"
        assert activation[1][0] == "reduce_scatter" and activation[2][0] == "computed", \
            f"inputs with a gradient: one unit reduces while the other still computes: {activation}"
        assert out["embedding_gathers_True"] == 3 and out["embedding_gathers_False"] == 2, \
            "set_unshard_in_backward(False): the embedding is gathered for its forward only"
        assert out["embedding_same_gradient"], "and its gradient is the same"


@pytest.fixture(scope="module")
def hsdp_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = launched(tmp_path_factory, "torch_claims_hsdp")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_fully_shard_on_a_2d_mesh_gathers_in_rows_and_all_reduces_the_shard_in_columns(
        hsdp_reports: list[dict[str, Any]]) -> None:
    # lesson 16: init_device_mesh("cpu", (2, 2)); per step the shard group (a row) all-gathers the unit twice and
    # the root once (the root is not resharded after the forward), reduce-scatters each with AVG, and the
    # replicate group (a column) all-reduces each reduced shard with AVG
    for rank, out in enumerate(hsdp_reports):
        unit, root = out["unit"], out["root"]
        row, column = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        step = out["step"]
        assert {tuple(e[1]) for e in step if e[0] != "all_reduce"} == {tuple(row)}
        assert {tuple(e[1]) for e in step if e[0] == "all_reduce"} == {tuple(column)}
        assert sorted(e[2] for e in step if e[0] == "all_gather") == sorted([unit, unit, root]), \
            "gathered: (3Ψ - Ψ_root) over 3 collectives per unit"
        assert sorted(e[2] for e in step if e[0] == "reduce_scatter") == sorted([unit, root])
        assert sorted(e[2] for e in step if e[0] == "all_reduce") == sorted([unit // 2, root // 2]), "Ψ/S each"
        assert {e[3] for e in step if e[0] != "all_gather"} == {"RedOpType.AVG"}


def test_set_requires_all_reduce_false_skips_the_replicate_all_reduce_until_the_last_microbatch(
        hsdp_reports: list[dict[str, Any]]) -> None:
    # lesson 16: FSDP2's HSDP gradient accumulation, reduce-scatter every microbatch, all-reduce once
    for out in hsdp_reports:
        count = {mode: {op: sum(1 for e in out[mode] if e[0] == op) for op in ("reduce_scatter", "all_reduce")}
                 for mode in ("every", "last")}
        assert count["every"] == {"reduce_scatter": 4, "all_reduce": 4}, count
        assert count["last"] == {"reduce_scatter": 4, "all_reduce": 2}, count
        assert out["accumulated_gap"] < 1e-6, "the same accumulated gradient"


def test_sdpa_saves_a_tokens_by_tokens_matrix_only_in_its_math_fallback() -> None:
    # lesson 15: the fused CPU kernel saves the output and one log-sum-exp per row; the math fallback the
    # probabilities, tokens x tokens per head
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens = 16
    q, k, v = (torch.randn(1, 2, tokens, 8, requires_grad=True) for _ in range(3))

    def saved_shapes() -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            nn.functional.scaled_dot_product_attention(q, k, v)
        return shapes

    fused = saved_shapes()
    with sdpa_kernel(SDPBackend.MATH):
        math = saved_shapes()
    assert (1, 2, tokens) in fused and not [s for s in fused if s[-2:] == (tokens, tokens)], fused
    assert [s for s in math if s[-2:] == (tokens, tokens)], math


def test_multihead_attention_keeps_one_in_proj_weight_only_for_one_embedding_size() -> None:
    # lesson 17: q, k and v in one bare parameter when they share the embedding size; three with kdim/vdim
    assert "in_proj_weight" in dict(nn.MultiheadAttention(8, 2).named_parameters())
    names = dict(nn.MultiheadAttention(8, 2, kdim=4, vdim=4).named_parameters())
    assert "in_proj_weight" not in names and {"q_proj_weight", "k_proj_weight", "v_proj_weight"} <= set(names)


def test_one_ranks_inf_makes_both_scalers_skip_on_every_rank_under_fully_shard(reports: list[dict[str, Any]]) -> None:
    # lesson 13: an inf in one rank's shard of a DTensor gradient; torch's ShardedGradScaler all-reduces its
    # found-inf flag (op SUM, one call), the plain GradScaler issues none and still skips everywhere, because
    # DTensor reduces the flag of its own check over the mesh (found_inf_reduce_handler)
    for out in (r["scalers_under_fully_shard"] for r in reports):
        for name in ("GradScaler", "ShardedGradScaler"):
            assert not out[name]["stepped"] and out[name]["scale"] == 2.0**15, (name, out[name])
        assert out["ShardedGradScaler"]["all_reduces"] == ["RedOpType.SUM"], out["ShardedGradScaler"]
        assert out["GradScaler"]["all_reduces"] == [], out["GradScaler"]


def test_fully_shard_checks_the_dtype_among_trainable_parameters_only(reports: list[dict[str, Any]]) -> None:
    # lesson 17: one group may hold a frozen bf16 weight beside trainable fp32 ones; two trainable dtypes are refused
    # at the first forward (FSDPParamGroup._init_mp_dtypes)
    for out in (r["dtype_among_trainable_only"] for r in reports):
        assert out["False"] == {"raised": None, "grads": [True, False]}, out["False"]
        assert out["True"] == {"raised": "AssertionError"}, out["True"]


def test_cpu_offload_policy_pins_by_default_and_pinning_needs_an_accelerator(reports: list[dict[str, Any]]) -> None:
    # lesson 18: CPUOffloadPolicy() pins the host shards, which fails while sharding on a machine without an
    # accelerator; with pin_memory=False it runs, and on a CPU "device" the all-gather reads the host shard itself
    for out in (r["cpu_offload_policy"] for r in reports):
        assert out["pins_by_default"] is True
        assert out["default"] == ("ran" if out["accelerator"] else "RuntimeError"), out
        assert out["devices"] == ["cpu/cpu"] and out["all_gather_input_is_the_shard"], out


def test_fully_shard_prefetches_the_backward_by_default_and_the_forward_only_when_told(
        reports: list[dict[str, Any]]) -> None:
    # lesson 14: three units; all-gathers named by unit, against each unit's forward and weight-gradient events
    for out in (r["prefetch"] for r in reports):
        default, explicit, issued_async = out["default"], out["explicit forward"], out["async"]

        def at(events: list[Any], *event: str) -> int:
            return next(i for i, e in enumerate(events) if e[:len(event)] == list(event))

        back = at(default, "backward")
        assert at(default, "forward", "0") < at(default, "all_gather", "1"), "forward: no prefetch by default"
        assert at(explicit, "all_gather", "1") < at(explicit, "forward", "0"), \
            "set_modules_to_forward_prefetch: unit 1 gathered before unit 0's forward ends"
        after = default[back:]
        assert at(after, "all_gather", "1") < at(after, "computed", "2"), \
            "backward: unit 1's all-gather issued while unit 2's backward still runs (default prefetch)"
        assert {e[2] for e in default if e[0] == "all_gather"} == {False}, "unshard_async_op defaults to False"
        assert {e[2] for e in issued_async if e[0] == "all_gather"} == {True}, "_set_unshard_async_op(True)"


def test_a_checkpoint_around_several_units_recomputes_without_another_all_gather(
        reports: list[dict[str, Any]]) -> None:
    # lesson 15: the recomputation inside the backward finds the units its pre-backward gathered
    for out in (r["checkpoint_around_units"] for r in reports):
        assert out["False"] == {"gathers": 6, "forwards": 3}, out["False"]
        assert out["True"]["gathers"] == 6 and out["True"]["forwards"] > 3, out["True"]
        assert out["same_gradients"], "the same gradients, bit for bit"


def test_checkpoint_replays_the_random_masks_of_its_forward() -> None:
    # lesson 15: preserve_rng_state=True (the default) saves and restores the RNG, so dropout's recomputed masks
    # are the forward's and the gradient is that of the run without checkpointing
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    x = torch.randn(4, 8)

    def grads(checkpoint: bool) -> list[torch.Tensor]:
        layer.zero_grad()
        torch.manual_seed(7)
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpoint else layer(x)
        out.square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True), strict=True))


def test_fully_shards_accumulation_switches_skip_the_reduce_scatter_or_the_next_all_gathers(
        reports: list[dict[str, Any]]) -> None:
    # lesson 15: two Linear units, two micro-batches
    for out in (r["accumulation_switches"] for r in reports):
        no_sync, kept = out["no sync"], out["keep gathered after backward"]
        assert no_sync == [{"all_gather": 4, "reduce_scatter": 0}, {"all_gather": 4, "reduce_scatter": 2}], no_sync
        assert kept[0] == {"all_gather": 4, "reduce_scatter": 2}, kept
        assert kept[1] == {"all_gather": 2, "reduce_scatter": 2}, "set_reshard_after_backward(False): no re-gather " \
            f"before the next forward, only the backward's: {kept}"

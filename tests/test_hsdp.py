"""HSDP: FSDP with `mesh=ctx.mesh(replicate=R, shard=S)`, sharded in each row of the mesh, replicated across rows.

- The mesh: init_device_mesh's order (rank = r*S + s; rows are shard groups, columns replicate groups), real Gloo
  subgroups (an all-gather in the shard group concatenates the row's ranks), bad shapes raise ValueError, and a
  mismatched subgroup collective is reported by the referee instead of hanging.
- Equivalence with one process on the same global batch (the engines' harness, tolerance 1e-5 as test_fsdp.py)
  at 2x2, 2x3, 3x2, 1x4 and 4x1, with models whose flat parameters need padding at S = 2 and 3, under SGD
  (elementwise) and AdamW (global norm); the replicas of a shard stay bitwise equal.
- The ledger: per step, intra-group 3 Psi (S-1)/S and inter-group 2 (Psi/S)(R-1)/R bytes, exactly (Psi: padded
  flat parameters, bytes).
- Memory per rank after an AdamW step: 16 Psi/S (fp32 shard, its gradient, two moments) plus AdamW's 4-byte step
  counter per flat parameter, from memory.measure.
- no_sync issues neither reduce-scatter nor all-reduce, and the accumulated step equals one process; mixed
  precision (bf16 gather, fp32 reduce) equals one process doing the same slices; clipping's global norm is right.
- Under torchrun (one launch, 4 processes, Gloo): ours with mesh (2, 2) against
  `fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))`: the same losses within test_train.py's 1e-5, the same
  mesh layout, and fully_shard's parameters are DTensors placed (Replicate(), Shard(0)).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from phases import launched
from torch import nn

from fsdp_course.engines.equivalence import (
    ADAMW,
    SGD,
    Case,
    Trace,
    Trainee,
    check_equivalence,
    digits_batches,
    local_slice,
    one_process,
)
from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.policy import MixedPrecision
from fsdp_course.memory import measure, total_bytes
from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig
from fsdp_course.runtime.mesh import hsdp_traffic_formula, mesh_groups
from fsdp_course.runtime.monitor import CollectiveMismatch
from fsdp_course.runtime.simulate import RankError, run_ranks

STEPS, TOL = 4, 1e-5  # test_fsdp.py's tolerance
TOL_TORCH = 1e-5  # test_train.py's, ours against fully_shard


def models() -> tuple[MLP, TransformerClassifier]:
    """MLP([64, 33, 10]): 2145 and 340 elements per layer, padded at S = 2 (2145) and S = 3 (340); a tiny Transformer.
    Built once under seed 0, outside the rank threads (they share the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP([64, 33, 10]), TransformerClassifier(TransformerConfig.tiny())


MLP_MODEL, TRANSFORMER = models()
WRAP = {MLP: {nn.Linear}, TransformerClassifier: {nn.TransformerEncoderLayer}}


def cases(kinds: tuple[str, ...] = ("mlp", "transformer")) -> list[Case]:
    out = []
    for kind in kinds:
        model, data = (MLP_MODEL, "vectors") if kind == "mlp" else (TRANSFORMER, "tokens")
        batches = digits_batches(data, STEPS, 12, token_stride=4 if kind == "transformer" else 1)  # 12: N = 4, 6
        out += [Case(f"{kind}/sgd", model, SGD, batches, "elementwise"),
                Case(f"{kind}/adamw", model, ADAMW, batches, "global_norm")]
    return out


def hsdp(replicate: int, shard: int, **kwargs: Any):
    def make(model: nn.Module, ctx: Any, optimizer_factory: Any) -> Trainee:
        mesh = ctx.mesh(replicate=replicate, shard=shard)
        return Trainee.fsdp(FSDP(model, ctx, wrap=WRAP[type(model)], mesh=mesh, **kwargs), optimizer_factory)
    return make


# -- the mesh ----------------------------------------------------------------------------------------------------
def test_mesh_groups_are_rows_and_columns_of_real_subgroups() -> None:
    def fn(ctx):
        mesh = ctx.mesh(replicate=2, shard=3)
        row = mesh.shard.all_gather(torch.tensor([float(ctx.rank)]))  # in rank order of the shard group
        column = mesh.replicate.all_gather(torch.tensor([float(ctx.rank)]))
        return mesh.coordinate, row.tolist(), column.tolist(), mesh.shard.rank, mesh.replicate.rank, mesh.traffic()

    out = run_ranks(fn, 6)
    assert mesh_groups(2, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    for rank, (coord, row, column, s, r, traffic) in enumerate(out):
        assert coord == divmod(rank, 3) == (r, s)
        assert row == [float(x) for x in mesh_groups(2, 3)[0][rank // 3]]
        assert column == [float(x) for x in mesh_groups(2, 3)[1][rank % 3]]
        assert traffic == {"intra": 2 / 3 * 12, "inter": 1 / 2 * 8}  # all-gather of 3 x 4 bytes, of 2 x 4 bytes


def test_bad_mesh_arguments_raise_value_errors_saying_what_to_pass() -> None:
    def fn(ctx):
        said = []
        for args in [(2, 3), (0, 4), (-2, -2), (3, 1)]:
            with pytest.raises(ValueError) as err:
                ctx.mesh(*args)
            said.append(str(err.value))
        with pytest.raises(TypeError):
            ctx.mesh(2.0, 2)
        return said

    said = run_ranks(fn, 4)[0]
    assert "replicate x shard must equal the world size 4, got 2 x 3 = 6" in said[0]
    assert "replicate must be a positive number of ranks, got 0" in said[1]
    assert "replicate must be a positive number of ranks, got -2" in said[2]
    assert all("pass one of: replicate=1, shard=4, replicate=2, shard=2, replicate=4, shard=1" in s for s in said)


def test_ranks_asking_for_different_meshes_fail_at_once_on_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(lambda ctx: ctx.mesh(1, 4) if ctx.rank == 0 else ctx.mesh(2, 2), 4, timeout=10)
    assert time.monotonic() - start < 5  # not the timeout twice over, as groups the others never build would take
    assert "ranks 0, 1, 2, 3 failed with ValueError: mesh: the ranks asked for different meshes (replicate, shard): " \
           "rank 0 (1, 4), rank 1 (2, 2), rank 2 (2, 2), rank 3 (2, 2)" in str(err.value)


def test_a_mismatched_subgroup_collective_is_reported_not_hung() -> None:
    def fn(ctx):
        mesh = ctx.mesh(2, 2)
        mesh.replicate.all_reduce(torch.ones(3 if ctx.rank == 3 else 2))

    with pytest.raises(RankError) as err:
        run_ranks(fn, 4, timeout=10)
    assert {1, 3} <= set(err.value.failures)  # the column [1, 3]; the other column completes
    assert all(isinstance(e, CollectiveMismatch) for e in err.value.failures.values())
    assert "collective mismatch in the replicate group [1, 3]" in str(err.value)
    assert "rank 1 (world rank 3): all_reduce #1 (shapes [(3,)]" in str(err.value)


def test_a_subgroup_collective_a_peer_never_joins_is_reported_at_once() -> None:
    def fn(ctx):
        mesh = ctx.mesh(2, 2)
        if ctx.rank != 3:  # rank 3 returns: its column partner, rank 1, would wait in the all-reduce
            mesh.replicate.all_reduce(torch.ones(2))

    with pytest.raises(RankError) as err:
        run_ranks(fn, 4, timeout=20)
    assert set(err.value.failures) == {1}
    assert "all_reduce #1 of the replicate group [1, 3] can never complete: rank(s) 1 ended" in str(err.value)
    assert "rank 1 (world rank 3): finished" in str(err.value)


# -- equivalence with one process ---------------------------------------------------------------------------------
def assert_replicas_equal(traces: list[Trace], replicate: int, shard: int) -> None:
    """Ranks in one column (the same shard) hold bitwise equal parameters after every step."""
    for step in range(STEPS):
        for s in range(shard):
            first = traces[s].params[step]
            for r in range(1, replicate):
                other = traces[r * shard + s].params[step]
                assert first.keys() == other.keys()
                for name in first:
                    for (a0, a1, a), (b0, b1, b) in zip(first[name], other[name], strict=True):
                        assert (a0, a1) == (b0, b1) and torch.equal(a, b), f"step {step + 1}, {name}, column {s}"


@pytest.mark.parametrize(("replicate", "shard", "kinds"), [
    (2, 2, ("mlp", "transformer")), (2, 3, ("mlp", "transformer")), (3, 2, ("mlp",)), (1, 4, ("mlp",)),
    (4, 1, ("mlp",)),
])
def test_hsdp_equals_one_process(replicate: int, shard: int, kinds: tuple[str, ...]) -> None:
    chosen = cases(kinds)
    results = check_equivalence(chosen, hsdp(replicate, shard), replicate * shard, tol=TOL, timeout=60)
    for result in results.values():
        assert_replicas_equal(result.traces, replicate, shard)


def test_the_replicate_all_reduce_is_needed() -> None:
    """Planted: without the all-reduce across replicas (mesh given, replicate group dropped), the gradient is the
    mean over one row's slices only, and the harness catches it."""
    def make(model, ctx, optimizer_factory):
        fsdp = FSDP(model, ctx, wrap={nn.Linear}, mesh=ctx.mesh(2, 2))
        for unit in fsdp.units:
            unit.replicate = None
        return Trainee.fsdp(fsdp, optimizer_factory)

    with pytest.raises(AssertionError, match="averaged gradient"):
        check_equivalence(cases(("mlp",))[:1], make, 4, tol=TOL, timeout=60)


def test_every_rank_starts_from_rank_0s_values() -> None:
    """Each rank perturbs its own copy before wrapping: after FSDP(..., mesh=...) every rank holds rank 0's values
    (the initial broadcast spans the whole world, not one shard group)."""
    def fn(ctx):
        model = copy.deepcopy(MLP_MODEL)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(ctx.rank)
        fsdp = FSDP(model, ctx, wrap={nn.Linear}, mesh=ctx.mesh(2, 2))
        return fsdp.full_state_dict()

    for state in run_ranks(fn, 4):
        for name, value in MLP_MODEL.state_dict().items():
            assert torch.equal(state[name], value), name


def test_sharded_checkpoints_refuse_hsdp_clearly(tmp_path: Path) -> None:
    """The sharded formats are one file (one chunk) per shard rank: replicas would write the same files at once. Both
    refuse an HSDP model on every rank, saying what to use instead; full_state_dict works (above)."""
    from fsdp_course.fsdp import dcp

    def fn(ctx):
        fsdp = FSDP(copy.deepcopy(MLP_MODEL), ctx, wrap={nn.Linear}, mesh=ctx.mesh(2, 2))
        errors = []
        for call in (lambda: fsdp.save_sharded(str(tmp_path / "own")), lambda: fsdp.load_sharded(str(tmp_path)),
                     lambda: dcp.device_mesh(fsdp)):
            with pytest.raises((ValueError, dcp.CheckpointError)) as info:
                call()
            errors.append(str(info.value))
        return errors

    for errors in run_ranks(fn, 4):
        assert all("full_state_dict" in e and "HSDP" in e for e in errors), errors
    assert not (tmp_path / "own").exists(), "nothing written"


# -- the ledger and memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("replicate", "shard"), [(2, 2), (2, 3), (3, 2)])
def test_ledger_bytes_and_memory_per_rank_equal_the_formulas(replicate: int, shard: int) -> None:
    batches = digits_batches("vectors", 2, 12)

    def fn(ctx):
        mesh = ctx.mesh(replicate, shard)
        fsdp = FSDP(copy.deepcopy(MLP_MODEL), ctx, wrap={nn.Linear}, mesh=mesh)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
        per_step, memory = [], []
        for batch in batches:
            mesh.clear()
            x, y = local_slice(batch, ctx.rank, ctx.world_size)
            F.cross_entropy(fsdp(x), y).backward()
            opt.step()
            per_step.append((mesh.traffic(), mesh.shard.ledger.summary(), mesh.replicate.ledger.summary()))
            memory.append(total_bytes(measure(fsdp, opt)))
            opt.zero_grad()
        padded = [h.layout.padded_numel for h in fsdp.handles]
        return per_step, memory, padded

    out = run_ranks(fn, replicate * shard, timeout=60)
    numels = [layer.weight.numel() + layer.bias.numel() for layer in MLP_MODEL.layers]  # one unit each
    for per_step, memory, padded in out:
        assert padded == [-(-n // shard) * shard for n in numels]
        assert sum(padded) > sum(numels) or shard == 1  # padding is counted: Psi is the padded size
        psi = 4 * sum(padded)  # fp32 bytes
        formula = hsdp_traffic_formula(psi, replicate, shard)
        for traffic, intra, inter in per_step:
            assert traffic["intra"] == pytest.approx(formula["intra"], rel=1e-12, abs=0)
            assert traffic["inter"] == pytest.approx(formula["inter"], rel=1e-12, abs=0)
            assert formula["inter"] == 2 * (psi / shard) * (replicate - 1) / replicate
            units = len(padded)
            assert intra["all_gather"]["calls"] == 2 * units and intra["reduce_scatter"]["calls"] == units
            assert set(inter) == {"all_reduce"} and inter["all_reduce"]["calls"] == units
        # fp32 shard + gradient + AdamW's two moments: 16 Psi/S bytes, plus one 4-byte step counter per flat param
        assert memory == [16 * sum(padded) // shard + 4 * len(padded)] * len(batches)


# -- options: no_sync, mixed precision, clipping ----------------------------------------------------------------
def test_no_sync_reduces_nothing_and_the_accumulated_step_equals_one_process() -> None:
    base = MLP_MODEL
    [batch] = digits_batches("vectors", 1, 24)
    halves = [(batch[0][:12], batch[1][:12]), (batch[0][12:], batch[1][12:])]
    reference = copy.deepcopy(base)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in halves:
        (F.cross_entropy(reference(x), y) / 2).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
    opt_ref.step()

    def fn(ctx):
        mesh = ctx.mesh(2, 2)
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, mesh=mesh)
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        with fsdp.no_sync():
            x, y = local_slice(halves[0], ctx.rank, 4)
            (F.cross_entropy(fsdp(x), y) / 2).backward()
        during = {"shard": mesh.shard.ledger.summary(), "replicate": mesh.replicate.ledger.summary()}
        x, y = local_slice(halves[1], ctx.rank, 4)
        (F.cross_entropy(fsdp(x), y) / 2).backward()
        after = mesh.replicate.ledger.summary()
        grads = fsdp.full_grads()
        opt.step()
        return during, after, grads, fsdp.full_state_dict()

    for during, after, grads, state in run_ranks(fn, 4, timeout=60):
        assert set(during["shard"]) == {"all_gather"} and during["replicate"] == {}  # no reduce-scatter, all-reduce
        assert after["all_reduce"]["calls"] == len(base.layers)
        for name, g in expected.items():
            assert (grads[name] - g).norm() <= TOL * g.norm(), name
        for name, p in reference.state_dict().items():
            assert (state[name] - p).abs().max() <= TOL * p.abs().max(), name


def test_mixed_precision_bf16_equals_one_process_on_the_same_slices() -> None:
    chosen = cases(("mlp",))
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    references = [one_process(c.model, c.batches, c.optimizer_factory, slices=4, param_dtype=torch.bfloat16)
                  for c in chosen]
    results = check_equivalence(chosen, hsdp(2, 2, mp_policy=policy, prefetch=1), 4, references=references,
                                tol=TOL, timeout=60)
    for result in results.values():
        assert_replicas_equal(result.traces, 2, 2)


def test_clipping_uses_the_global_norm() -> None:
    [batch] = digits_batches("vectors", 1, 12)
    reference = copy.deepcopy(MLP_MODEL)
    F.cross_entropy(reference(batch[0]), batch[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    clipped = {n: p.grad for n, p in reference.named_parameters()}

    def fn(ctx):
        fsdp = FSDP(copy.deepcopy(MLP_MODEL), ctx, wrap={nn.Linear}, mesh=ctx.mesh(2, 3))
        x, y = local_slice(batch, ctx.rank, 6)
        F.cross_entropy(fsdp(x), y).backward()
        return fsdp.clip_grad_norm_(0.1).item(), fsdp.full_grads()

    for norm, grads in run_ranks(fn, 6, timeout=60):
        assert norm == pytest.approx(expected.item(), rel=TOL)  # not sqrt(R) times it: replicas counted once
        for name, g in clipped.items():
            assert (grads[name] - g).norm() <= TOL * g.norm(), name


# -- against fully_shard on a 2-D mesh, under torchrun ------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = launched(tmp_path_factory, "hsdp")  # in_torchrun below, in the "four" launch (tests/phases.py)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_torchrun_mesh_layout_is_init_device_meshs(torchrun_run: list[dict[str, Any]]) -> None:
    rows, columns = mesh_groups(2, 2)
    for rank, r in enumerate(torchrun_run):
        assert r["device_mesh"] == rows  # init_device_mesh("cpu", (2, 2)).mesh: arange(4).view(2, 2)
        assert r["torch_shard_group"] == r["our_shard_group"] == rows[rank // 2]
        assert r["torch_replicate_group"] == r["our_replicate_group"] == columns[rank % 2]


def test_torchrun_fully_shard_on_a_2d_mesh_places_replicate_shard(torchrun_run: list[dict[str, Any]]) -> None:
    for r in torchrun_run:
        assert r["dtensor"] and set(r["placements"]) == {"(Replicate(), Shard(dim=0))"}, r["placements"]


def test_torchrun_ours_matches_fully_shard_hsdp(torchrun_run: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(torchrun_run):
        ours, theirs = r["ours"], r["torch"]
        assert len(ours) == len(theirs) == STEPS + 2
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert abs(a - b) <= TOL_TORCH * abs(b), f"rank {rank}, step {step}: ours {a!r}, fully_shard {b!r}"
        # the intra/inter split of our ledger, under real processes too
        assert r["traffic"]["inter"] > 0 and r["traffic"]["intra"] > 0


def in_torchrun(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_course.runtime.context import RankContext

    torch.set_num_threads(1)
    ctx = RankContext.from_env(backend="gloo", timeout=60)
    batches = digits_batches("tokens", STEPS + 2, 16, token_stride=4)
    report: dict[str, Any] = {}

    def run(model: nn.Module, params: Any, clip: Any) -> list[float]:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        losses = []
        for batch in batches:
            x, y = local_slice(batch, ctx.rank, ctx.world_size)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            clip()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    mesh = ctx.mesh(replicate=2, shard=2)
    ours = FSDP(copy.deepcopy(TRANSFORMER), ctx, wrap={nn.TransformerEncoderLayer}, mesh=mesh)
    report["ours"] = run(ours, ours.parameters(), lambda: ours.clip_grad_norm_(1.0))
    report["traffic"] = mesh.traffic()
    report["our_shard_group"] = mesh.shard.ledger.ranks
    report["our_replicate_group"] = mesh.replicate.ledger.ranks

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    report["device_mesh"] = device_mesh.mesh.tolist()
    report["torch_shard_group"] = dist.get_process_group_ranks(device_mesh.get_group("shard"))
    report["torch_replicate_group"] = dist.get_process_group_ranks(device_mesh.get_group("replicate"))
    theirs = copy.deepcopy(TRANSFORMER)  # every process built the same values (seed 0): fully_shard broadcasts none
    for layer in theirs.modules():
        if isinstance(layer, nn.TransformerEncoderLayer):
            fully_shard(layer, mesh=device_mesh)
    fully_shard(theirs, mesh=device_mesh)
    params = list(theirs.parameters())
    report["dtensor"] = all(isinstance(p, DTensor) for p in params)
    report["placements"] = sorted({str(p.placements) for p in params})
    report["torch"] = run(theirs, params, lambda: torch.nn.utils.clip_grad_norm_(params, 1.0))
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(report))
    ctx.close()


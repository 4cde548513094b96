"""Tests for fsdp_course.fsdp.per_param: FSDP2's dim-0 sharding, checked against torch's own formula, against
what `fully_shard` stores and gathers (run on the same simulated ranks), and against the full tensors."""

import copy
import json
from pathlib import Path

import pytest
import torch
from phases import launched
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty, _get_dim0_padded_size

from fsdp_course.engines.torch_fsdp import count_collectives
from fsdp_course.fsdp.per_param import PerParamLayout, all_gather_params, dim0_chunk_rows, reduce_scatter_grads
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.simulate import run_ranks

SHAPES = [(5, 3), (5,), (2, 5), (2,), (7, 3), (1, 4), (13,), (4, 4), (64, 8)]


class Uneven(nn.Module):
    """Parameters whose dim 0 divides by none of 2, 3, 4 (5, 7, 13 rows), or is smaller than N (2, 1 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.up = nn.Linear(3, 5)
        self.down = nn.Linear(5, 2)
        self.tiny = nn.Parameter(torch.randn(1, 4))
        self.odd = nn.Parameter(torch.randn(13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(x)))).sum() + (self.tiny.sum() + self.odd.sum()) * x.numel()


def build_uneven() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Uneven()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_padded_chunk_is_torchs(shape, n):
    """ceil(dim0 / N) rows per rank, as torch computes it in two places: the size of torch.chunk's first chunk
    (_fsdp_param.py: "0th always padded") and _get_dim0_padded_size (_fsdp_collectives.py's reduce-scatter)."""
    t = torch.zeros(shape)
    spec = PerParamLayout.build([("p", t)], n).specs[0]
    chunks = _chunk_with_empty(t, n, dim=0)
    assert spec.padded_shape == chunks[0].shape == torch.Size([dim0_chunk_rows(shape[0], n), *shape[1:]])
    assert n * spec.rows == _get_dim0_padded_size(t.shape, n)[0]
    assert [spec.local_rows(r) for r in range(n)] == [c.shape[0] if c.numel() else 0 for c in chunks]
    assert spec.padding == (n * spec.rows - shape[0]) * spec.row_numel and 0 <= spec.padding < n * spec.row_numel


def compare_with_fully_shard(ctx: RankContext) -> dict:
    """On one rank of a real world (torchrun): fully_shard the model as one unit and compare, parameter by
    parameter, what it stores and what its all-gather moves and gives with this module's layout."""
    base = build_uneven()
    named = list(base.named_parameters())
    layout = PerParamLayout.build(named, ctx.world_size)
    ours = layout.shard([p for _, p in named], ctx.rank)
    model = copy.deepcopy(base)
    fully_shard(model, mesh=DeviceMesh.from_group(ctx.group, ctx.device.type))
    by_id = {id(fp.sharded_param): fp for fp in model._get_fsdp_state()._fsdp_param_group.fsdp_params}
    theirs = {n: by_id[id(p)] for n, p in model.named_parameters()}  # FSDPParam of each parameter
    out = {
        "padded_shape": all(theirs[s.name].padded_sharded_param_size == s.padded_shape for s in layout.specs),
        "padded_chunk": all(torch.equal(theirs[s.name]._sharded_param_data, c.reshape(-1))
                            for s, c in zip(layout.specs, ours, strict=True)),
        "dtensor_local": all(torch.equal(theirs[s.name].sharded_param.to_local(), u)
                             for s, u in zip(layout.specs, layout.unpadded(ours, ctx.rank), strict=True)),
    }
    with count_collectives(ctx):
        model.unshard()  # FSDPModule.unshard: fully_shard's own all-gather of the unit
    [theirs_gather] = [r for r in ctx.ledger.records if r.op == "all_gather"]
    gathered = dict(model.named_parameters())
    mark = len(ctx.ledger.records)
    full = all_gather_params(ctx, layout, ours)
    [ours_gather] = ctx.ledger.records[mark:]
    out["all_gather_bytes"] = [theirs_gather.payload_bytes, ours_gather.payload_bytes, 4 * layout.padded_numel]
    out["full"] = all(torch.equal(gathered[n].detach(), p.detach()) and torch.equal(f, p.detach())
                      for (n, p), f in zip(named, full, strict=True))
    return out


def phase(out: Path) -> None:  # in each process of the "three" launch (tests/phases.py)
    ctx = RankContext.from_env(timeout=60)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(compare_with_fully_shard(ctx)))
    ctx.close()


def test_local_chunks_and_gathered_parameters_match_fully_shard(tmp_path_factory: pytest.TempPathFactory) -> None:
    """torch's fully_shard under torchrun, 3 processes (no parameter's dim 0 divides by 3; two are shorter than 3):
    its padded local chunk of every parameter, the DTensor's local tensor, the bytes of its all-gather and the
    unsharded parameters are what this module computes."""
    out = launched(tmp_path_factory, "per_param")
    for rank in range(3):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert all(result[k] for k in ("padded_shape", "padded_chunk", "dtensor_local", "full")), (rank, result)
        assert len(set(result["all_gather_bytes"])) == 1, (rank, result)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_all_gather_gives_the_full_tensors(world_size):
    torch.manual_seed(1)
    named = [(f"p{i}", torch.randn(shape)) for i, shape in enumerate(SHAPES)]

    def fn(ctx):
        layout = PerParamLayout.build(named, ctx.world_size)
        local = layout.shard([t for _, t in named], ctx.rank)
        mark = len(ctx.ledger.records)
        full = all_gather_params(ctx, layout, local)
        calls = [r.op for r in ctx.ledger.records[mark:]]
        return full, calls, [c.numel() for c in local], layout

    for rank, (full, calls, local_numels, layout) in enumerate(run_ranks(fn, world_size)):
        assert calls == ["all_gather"], (rank, calls)
        assert sum(local_numels) == layout.input_numel == layout.padded_numel // world_size
        for (name, t), f in zip(named, full, strict=True):
            assert f.shape == t.shape and torch.equal(f, t), (rank, name)
        assert layout.padding == sum(s.padding for s in layout.specs) > 0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_leaves_each_rank_the_mean_of_its_rows(world_size):
    named = [(f"p{i}", torch.zeros(shape)) for i, shape in enumerate(SHAPES)]

    def fn(ctx):
        layout = PerParamLayout.build(named, ctx.world_size)
        grads = [torch.randn(t.shape, generator=ctx.generator) for _, t in named]
        return grads, reduce_scatter_grads(ctx, layout, grads, op="mean"), layout

    results = run_ranks(fn, world_size)
    mean = [torch.stack([r[0][i] for r in results]).mean(0) for i in range(len(named))]
    for rank, (_, chunks, layout) in enumerate(results):
        for spec, chunk, m in zip(layout.specs, chunks, mean, strict=True):
            start, end = spec.row_range(rank)
            assert chunk.shape == spec.padded_shape
            assert torch.allclose(chunk[: end - start], m[start:end], atol=1e-6), (rank, spec.name)
            assert not chunk[end - start:].any(), (rank, spec.name, "the padding rows got a gradient")


def test_bad_input():
    with pytest.raises(ValueError, match="0-dim"):
        PerParamLayout.build([("s", torch.tensor(1.0))], 2)
    with pytest.raises(TypeError, match="one dtype"):
        PerParamLayout.build([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.float64))], 2)
    with pytest.raises(ValueError, match="no parameters"):
        PerParamLayout.build([], 2)
    layout = PerParamLayout.build([("a", torch.zeros(3, 2))], 2)
    with pytest.raises(ValueError, match="shape"):
        layout.shard([torch.zeros(2, 3)], 0)
    with pytest.raises(ValueError, match="rank 2"):
        layout.specs[0].row_range(2)
    with pytest.raises(ValueError, match="all-gather output"):
        layout.copy_out(torch.zeros(5))
    with pytest.raises(ValueError, match="world_size"):
        dim0_chunk_rows(3, 0)
    with pytest.raises(ValueError, match="world_size"):
        PerParamLayout.build([("a", torch.zeros(3))], 0)

"""Tests for fsdp_course.fsdp.flat_param: padding, shard ranges, tied weights, round trips."""

import pytest
import torch

from fsdp_course.fsdp.flat_param import (
    FlatParamLayout,
    flatten_params,
    padded_numel,
    shard_parameters,
    shard_range,
)


def _named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("numel,world,expected", [(0, 3, 0), (10, 1, 10), (10, 2, 10),
                                                  (10, 3, 12), (10, 4, 12), (1, 4, 4)])
def test_padded_numel(numel, world, expected):
    assert padded_numel(numel, world) == expected


def test_shard_range_covers_buffer_without_overlap():
    ranges = [shard_range(12, 4, r) for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="pad first"):
        shard_range(10, 4, 0)
    with pytest.raises(ValueError, match="rank 4"):
        shard_range(12, 4, 4)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_round_trip_through_shards(world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    named = _named(model)
    shards = [shard_parameters(named, world, r) for r in range(world)]
    layout = shards[0][0]
    assert layout.numel == sum(p.numel() for _, p in named) == 26
    assert layout.padded_numel % world == 0 and layout.padded_numel - layout.numel < world
    for _, local in shards:
        assert local.shape == (layout.shard_numel,)
    full = torch.cat([local for _, local in shards])  # what an all-gather returns
    assert torch.equal(full[layout.numel:], torch.zeros(layout.padded_numel - layout.numel))
    for (name, p), view in zip(named, layout.unflatten(full), strict=True):
        assert view.shape == p.shape, name
        assert torch.equal(view, p.detach()), name


def test_unflatten_returns_views_not_copies():
    layout, flat = flatten_params([("a", torch.ones(2, 2)), ("b", torch.ones(3))], 2)
    a, b = layout.unflatten(flat)
    flat.zero_()
    assert a.sum() == 0 and b.sum() == 0
    assert a.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_tied_parameters_stored_once_with_aliases():
    emb = torch.nn.Embedding(7, 4)
    head = torch.nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    layout = FlatParamLayout.build(_named(model), 2)
    assert layout.numel == 28
    assert [i.name for i in layout.infos] == ["emb.weight"]
    assert layout.infos[0].aliases == ("head.weight",)


def test_pieces_map_each_shard_back_to_parameters():
    layout = FlatParamLayout.build([("a", torch.zeros(5)), ("b", torch.zeros(2, 2))], 4)
    assert layout.padded_numel == 12 and layout.shard_numel == 3
    pieces = {r: [(p.name, p.param_start, p.param_end, p.shard_offset) for p in layout.pieces(r)]
              for r in range(4)}
    assert pieces == {0: [("a", 0, 3, 0)], 1: [("a", 3, 5, 0), ("b", 0, 1, 2)],
                      2: [("b", 1, 4, 0)], 3: []}  # rank 3 holds only padding


def test_mixed_dtypes_name_the_parameters():
    with pytest.raises(TypeError, match=r"torch.float64: b.*cast|torch.float64: b"):
        FlatParamLayout.build([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.float64))], 2)


def test_flatten_checks_shapes():
    layout = FlatParamLayout.build([("a", torch.zeros(2, 3))], 2)
    with pytest.raises(ValueError, match="a: shape"):
        layout.flatten([torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="expected \\(6,\\)"):
        layout.unflatten(torch.zeros(7))


def test_to_json_is_plain_data():
    import json

    layout = FlatParamLayout.build([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))], 4)
    data = json.loads(json.dumps(layout.to_json()))
    assert data["padded_numel"] == 12 and data["dtype"] == "float32"
    assert data["params"][1] == {"name": "b", "offset": 6, "numel": 3, "shape": [3], "aliases": []}

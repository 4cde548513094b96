"""The checker of exercise 19 (a unit's flat parameter cut into Shard(0) rows) passes the reference solution and fails
planted mistakes with the diagnosis that names them: each planted function is the reference with one thing wrong, as
a learner would get it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference_solutions import fails, load, passes

from fsdp_course.classroom.checks import check_dim0_chunks
from fsdp_course.fsdp import dcp
from fsdp_course.i18n.messages import Message

CHECKPOINTS = load("19_checkpoints")


def rows(d0: int, n: int, rank: int, per_rank: int) -> slice:
    start = min(rank * per_rank, d0)
    return slice(start, start + per_rank)


def floor_rows(layout, flat, rank, world_size):  # d0 // N rows per rank: the last rows are lost
    return [p[rows(i.shape[0], world_size, rank, i.shape[0] // world_size)].clone()
            for i, p in zip(layout.infos, layout.unflatten(flat), strict=True)]


def tensor_split(layout, flat, rank, world_size):  # torch.tensor_split spreads the remainder: not torch.chunk's cut
    return [torch.tensor_split(p, world_size, dim=0)[rank].clone() for p in layout.unflatten(flat)]


def plain_chunk(layout, flat, rank, world_size):  # torch.chunk's r-th chunk, forgetting that it may give fewer
    return [torch.chunk(p, world_size, dim=0)[rank].clone() for p in layout.unflatten(flat)]


def flat_pieces(layout, flat, rank, world_size):  # each parameter's elements in this rank's flat shard
    shard = layout.shard(flat, rank)
    out = []
    for info in layout.infos:
        piece = next((p for p in layout.pieces(rank) if p.name == info.name), None)
        out.append(shard[piece.shard_offset: piece.shard_offset + piece.param_end - piece.param_start].clone()
                   if piece else flat[:0].clone())
    return out


def flat_shard_first(layout, flat, rank, world_size):  # flat cut into N pieces, each parameter read from this piece
    shard = flat.chunk(world_size)[rank]
    out = []
    for info in layout.infos:
        d0, row = info.shape[0], info.numel // info.shape[0]
        k = max(0, min(-(-d0 // world_size), d0 - rank * -(-d0 // world_size)))
        out.append(shard[: k * row].reshape(k, *info.shape[1:]).clone())
    return out


def flattened(layout, flat, rank, world_size):  # the right rows, flattened to 1-D
    return [c.reshape(-1) for c in CHECKPOINTS["dim0_chunks"](layout, flat, rank, world_size)]


def ignores_offset(layout, flat, rank, world_size):  # every parameter read from the start of flat
    out = []
    for info in layout.infos:
        p = flat[: info.numel].view(info.shape)
        c = -(-info.shape[0] // world_size)
        out.append(p[rows(info.shape[0], world_size, rank, c)].clone())
    return out


def views(layout, flat, rank, world_size):  # no clone: views of the gathered buffer
    out = []
    for info, p in zip(layout.infos, layout.unflatten(flat), strict=True):
        c = -(-info.shape[0] // world_size)
        out.append(p[rows(info.shape[0], world_size, rank, c)])
    return out


def returns_dict(layout, flat, rank, world_size):
    return dict(zip(layout.names, CHECKPOINTS["dim0_chunks"](layout, flat, rank, world_size), strict=True))


def with_padding(layout, flat, rank, world_size):  # the padding at the end of flat as one more "parameter"
    return [*CHECKPOINTS["dim0_chunks"](layout, flat, rank, world_size), flat[layout.numel:].clone()]


def scalar_rows(layout, flat, rank, world_size):  # p[rank] of a 1-D parameter: one element, not a row range
    return [p[min(rank, p.shape[0] - 1)].clone() if p.dim() == 1 else c
            for p, c in zip(layout.unflatten(flat), CHECKPOINTS["dim0_chunks"](layout, flat, rank, world_size),
                            strict=True)]


def stub(layout, flat, rank, world_size):
    raise NotImplementedError()


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_dim0_chunks, CHECKPOINTS["dim0_chunks"], capsys=capsys)
    assert "(world sizes 1, 2, 3, 4, 5)" in out


def test_the_course_s_own_cut_passes(capsys: pytest.CaptureFixture[str]) -> None:
    passes(check_dim0_chunks, dcp.dim0_chunks, capsys=capsys)


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (floor_rows, "dcp.ceil_rows", {"d0": 17, "n": 2, "rows": 9}),
    (tensor_split, "dcp.ceil_rows", {"d0": 17, "n": 4, "rows": 5}),
    (plain_chunk, "dcp.fewer_chunks", {"name": "fc.weight", "d0": 3, "n": 4, "c": 1,
                                       "chunks": Message("dcp.chunks", {"k": 3}), "rank": 3}),
    (flattened, "dcp.keep_rows", {"rows": 17}),
    (ignores_offset, "dcp.ignored_offset", {"first": 0, "last": 11, "name": "fc.weight", "offset": 68, "start": 68,
                                            "end": 79}),
    (views, "dcp.copy", {}),
    (returns_dict, "dcp.not_list", {"kind": "dict"}),
    (with_padding, "dcp.count", {"got": 4, "expected": 3}),
    (scalar_rows, "dcp.row_range", {"rows": 3}),
])
def test_planted_mistakes_are_named(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_dim0_chunks, fn, says=says, fields=fields, capsys=capsys)


def test_flat_shard_pieces_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    # at one rank a flat piece is the whole parameter, flattened (the shape hint); from two ranks on it is no row cut
    fails(check_dim0_chunks, flat_pieces, says="dcp.keep_rows", fields={"rows": 17}, capsys=capsys)
    fails(check_dim0_chunks, flat_pieces, world_sizes=(2, 3), says="dcp.dim0", capsys=capsys)


def test_a_flat_shard_instead_of_rows_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_dim0_chunks, flat_shard_first, world_sizes=(2,), says="dcp.flat_shard", capsys=capsys)


def test_where_it_failed_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_dim0_chunks, plain_chunk, says="dcp.fewer_chunks", capsys=capsys)
    assert "FAILED at world size 4, rank 3, unit 'embedding and head'" in out, out  # fc's 3 rows on 4 ranks
    out = fails(check_dim0_chunks, ignores_offset, says="dcp.other_values",
                fields={"name": "fc.weight", "shape": (3, 4)}, capsys=capsys)
    assert "FAILED at world size 1, rank 0, unit 'embedding and head'" in out, out


def test_the_short_parameter_named_is_the_failing_one(capsys: pytest.CaptureFixture[str]) -> None:
    """The hint's example is the case that failed: on the MLP unit alone, 'gate' (2 rows) at 3 ranks, rank 2."""
    from fsdp_course.classroom.checks import dcp as checks_dcp

    units = dict(checks_dcp.UNITS)
    try:
        del checks_dcp.UNITS["embedding and head"]
        out = fails(check_dim0_chunks, plain_chunk, capsys=capsys, says="dcp.fewer_chunks",
                    fields={"name": "gate", "d0": 2, "n": 3, "c": 1, "chunks": Message("dcp.chunks", {"k": 2}),
                            "rank": 2})
    finally:
        checks_dcp.UNITS.clear()
        checks_dcp.UNITS.update(units)
    assert "FAILED at world size 3, rank 2, unit 'an MLP layer'" in out, out


def test_a_run_of_other_flat_elements_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    def next_rank_rows(layout, flat, rank, world_size):  # the rows of rank + 1 (wrapping): one run, the wrong one
        return CHECKPOINTS["dim0_chunks"](layout, flat, (rank + 1) % world_size, world_size)

    fails(check_dim0_chunks, next_rank_rows, capsys=capsys, world_sizes=(3,),  # 17 rows: 6, 6, 5
          says="dcp.other_run", fields={"first": 24, "last": 47, "name": "embedding.weight", "start": 0, "end": 23})


def test_the_stub_gives_one_short_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_dim0_chunks(stub)


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_dim0_chunks\(dim0_chunks\)"):
        check_dim0_chunks("dim0_chunks")

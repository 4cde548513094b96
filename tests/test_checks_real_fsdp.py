"""The checker of exercise 11 (the course's units with fully_shard, trained under torchrun) passes the reference
solution and fails planted mistakes with the diagnosis that names them: each planted function is the reference with
one thing wrong, as a learner would get it. The order and the units are read in this process; a mistake only a real
run shows (fully_shard called under another name, another option) is run by the checker's own per-process code in
one phase of the suite's launches (tests/phases.py), and judged by the checker; the reference runs the whole check,
its own torchrun launch included."""

from __future__ import annotations

import inspect
import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from phases import launched
from reference_solutions import fails, load, passes
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_course.classroom.checks import check_fully_shard_units, real_fsdp
from fsdp_course.runtime.context import RankContext

REAL = load("11_real_fsdp")


def root_first(model, mesh):  # top-down: the root takes every parameter
    fully_shard(model, mesh=mesh)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    return model


def no_root(model, mesh):  # the embeddings, final norm and head are no unit
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    return model


def first_layer_only(model, mesh):  # one layer forgotten
    fully_shard(model.encoder.layers[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def embeddings_too(model, mesh):  # more units than the course's
    for module in (*model.encoder.layers, model.embedding):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def no_root_by_private_path(model, mesh):  # fully_shard reached another way: only the real run tells
    from torch.distributed.fsdp._fully_shard import _fully_shard

    for layer in model.encoder.layers:
        _fully_shard.fully_shard(layer, mesh=mesh)
    return model


def no_root_by_attribute(model, mesh):  # torch.distributed.fsdp.fully_shard is recorded too
    import torch.distributed.fsdp as fsdp

    for layer in model.encoder.layers:
        fsdp.fully_shard(layer, mesh=mesh)
    return model


def root_resharded(model, mesh):  # the course's default root: gathered again in the backward
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def bf16(model, mesh):  # right units, but computing in bfloat16: the losses move
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def bf16_unimported(model, mesh):  # MixedPrecisionPolicy from the notebook's imports: not in torchrun's processes
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def stub(model, mesh):
    raise NotImplementedError()


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_fully_shard_units, REAL["shard_like_course"], capsys=capsys)
    assert "3 FSDP states; 5 all-gathers and 3 reduce-scatters per step under torchrun" in out


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (root_first, "real_fsdp.root_first", {"calls": ["root", "encoder.layers.0", "encoder.layers.1"],
                                          "after": "encoder.layers.0, encoder.layers.1"}),
    (no_root, "real_fsdp.root_missing", {"units": ["encoder.layers.0", "encoder.layers.1"]}),
    (first_layer_only, "real_fsdp.layer_missing", {"n": 2, "units": ["encoder.layers.0", "root"], "expected": 3,
                                                   "missing": "encoder.layers.1"}),
    (embeddings_too, "real_fsdp.extra_units", {"n": 4, "expected": 3, "extra": ["embedding"]}),
    (no_root_by_attribute, "real_fsdp.root_missing", {}),
])
def test_planted_in_this_process(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_fully_shard_units, fn, says=says, fields=fields, capsys=capsys)
    assert "FAILED at fully_shard's calls, recorded in this process" in out


UNDER_TORCHRUN = [
    (no_root_by_private_path, "real_fsdp.fsdp_states", {"got": 2, "expected": 3}),
    (bf16_unimported, "real_fsdp.import_inside", {}),
    (root_resharded, "real_fsdp.all_gathers", {"per_step": 6, "expected": 5}),
    (bf16, "real_fsdp.loss_differs", {}),
]


def phase(out: Path) -> None:
    """In each process of the suite's "pair" launch (tests/phases.py): what the checker's own torchrun processes run
    (`run_in_process`, the source alone), for every planted function, one after another."""
    ctx = RankContext.from_env()
    for fn, *_ in UNDER_TORCHRUN:
        report = real_fsdp.run_in_process(textwrap.dedent(inspect.getsource(fn)), fn.__name__, ctx)
        (out / f"{fn.__name__}_rank{ctx.rank}.json").write_text(json.dumps(report))
    ctx.close()


@pytest.mark.parametrize(("fn", "says", "fields"), UNDER_TORCHRUN)
def test_planted_under_torchrun(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str],
                                tmp_path_factory: pytest.TempPathFactory) -> None:
    out = launched(tmp_path_factory, "fully_shard_planted")
    runs = [json.loads((out / f"{fn.__name__}_rank{r}.json").read_text()) for r in range(real_fsdp.WORLD_SIZE)]

    def check_fully_shard_units(fn: Callable) -> None:  # the checker, its launch replayed from the phase's runs
        real_fsdp._check(fn, lambda *_: runs)

    out = fails(check_fully_shard_units, fn, says=says, fields=fields, capsys=capsys)
    assert "FAILED at world size 2, torchrun" in out


def test_the_stub_gives_one_short_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_fully_shard_units(stub)


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_fully_shard_units\(shard_like_course\)"):
        check_fully_shard_units("shard_like_course")

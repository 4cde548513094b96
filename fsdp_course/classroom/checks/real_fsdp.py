"""Checker of exercise 11: the course's units with PyTorch's `fully_shard`, trained under torchrun.

Cites PyTorch's fully_shard (torch/distributed/fsdp/_fully_shard/).
Design notes: docs/CLASSROOM.md, "Checkers", `real_fsdp.py`.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import CheckFailure, hints, require_callable, say_passed
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.launch import start_torchrun, torchrun_command

__all__ = ["STEPS", "TOL", "check_fully_shard_units", "course_losses"]

STEPS = 3
GLOBAL_BATCH = 16
TOL = 1e-5
WORLD_SIZE = 2
TORCHRUN_TIMEOUT = 240.0
LAYERS = ("encoder.layers.0", "encoder.layers.1")
EXPECTED_UNITS = [*LAYERS, "root"]  # in the order fully_shard must be applied

T = catalogue("real_fsdp")  # fsdp_course/i18n/catalogues/real_fsdp.yml


def _model() -> nn.Module:
    from fsdp_course.fsdp.meta_init import init_weights
    from fsdp_course.models import TransformerClassifier, TransformerConfig

    return init_weights(TransformerClassifier(TransformerConfig.small()), 0)  # the same values in every process


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from fsdp_course.data import digits_tokens
    from fsdp_course.sampler import global_batch, rank_slice

    tokens, labels = digits_tokens()
    mine = rank_slice(global_batch(len(tokens), GLOBAL_BATCH, step), rank, world_size)
    return tokens[mine], labels[mine]


def _train(model: nn.Module, ctx: RankContext) -> list[torch.Tensor]:
    """`STEPS` AdamW steps of a sharded model on this rank's slice of each global batch: this rank's losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # our FSDP's parameters() are its shards
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, ctx.rank, ctx.world_size)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def course_losses(world_size: int = WORLD_SIZE) -> list[float]:
    """The course's FSDP, one unit per layer, root kept gathered as fully_shard keeps it: loss per step, mean over
    the ranks."""
    from fsdp_course.fsdp import FSDP
    from fsdp_course.runtime.simulate import run_ranks

    model = _model()

    def body(ctx: RankContext) -> list[float]:
        import copy

        fsdp = FSDP(copy.deepcopy(model), ctx, wrap={nn.TransformerEncoderLayer}, reshard_root_after_forward=False)
        return [ctx.all_reduce(loss.clone(), op="mean").item() for loss in _train(fsdp, ctx)]

    return run_ranks(body, world_size)[0]


def _unit_name(model: nn.Module, module: nn.Module) -> str:
    if module is model:
        return "root"
    return next((name for name, m in model.named_modules() if m is module), type(module).__name__)


def _structure(check: str, name: str, fn: Callable[..., Any]) -> list[str]:
    """Run `fn` on the model with `fully_shard` replaced by a recorder that shards nothing: in the learner's namespace
    and as `torch.distributed.fsdp.fully_shard`. A function that reaches fully_shard another way records nothing
    (then the torchrun run judges it)."""
    import torch.distributed.fsdp as torch_fsdp

    from fsdp_course.classroom.checks._common import learner_frames, not_implemented

    model = _model()
    calls: list[str] = []
    namespace = getattr(fn, "__globals__", {})
    real = torch_fsdp.fully_shard

    def recording_fully_shard(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        calls.append(_unit_name(model, module))
        return module

    patched = namespace.get("fully_shard") is real
    if patched:
        namespace["fully_shard"] = recording_fully_shard
    torch_fsdp.fully_shard = recording_fully_shard  # type: ignore[assignment]
    try:
        fn(model, None)
    except NotImplementedError:
        raise not_implemented(name) from None
    except Exception as exc:  # noqa: BLE001  (reported, or left to the torchrun run)
        if calls:
            CheckFailure(check, "fully_shard's calls, recorded in this process",
                         COMMON("learner_raised", name=name, kind=type(exc).__name__, text=str(exc)), _hint(exc),
                         learner_frames(exc)).fail()
    finally:
        torch_fsdp.fully_shard = real
        if patched:
            namespace["fully_shard"] = real
    return calls


def check_fully_shard_units(fn: Callable[[nn.Module, Any], Any]) -> None:
    """Check `fn(model, mesh)`: fully_shard on every encoder layer, then on the model; trained under torchrun, the
    losses equal the course's FSDP with the same units."""
    _check(fn, _torchrun)


def _check(fn: Callable[[nn.Module, Any], Any], launch: Callable[[str, Callable, str], list[dict[str, Any]]]
           ) -> None:
    """The check, with `launch(check, fn, name)` giving every process's report (the test suite replays runs made in
    its own launch)."""
    check = "check_fully_shard_units"
    name = require_callable(check, fn, "shard_like_course")
    where = "fully_shard's calls, recorded in this process"
    calls = _structure(check, name, fn)
    if calls:  # else (fully_shard under another name) torchrun's run tells
        _judge_structure(check, where, calls)
    runs = launch(check, fn, name)  # what every torchrun process reported (`run_in_process`)
    _judge_run(check, runs)
    ours = course_losses()
    theirs = [sum(r["losses"][s] for r in runs) / len(runs) for s in range(STEPS)]
    gaps = [abs(a - b) / abs(b) for a, b in zip(theirs, ours, strict=True)]
    if not all(gap <= TOL for gap in gaps):  # a NaN loss is never within the tolerance
        step = next(s for s, gap in enumerate(gaps) if not gap <= TOL)  # the first step that differs
        CheckFailure(check, f"world size {WORLD_SIZE}, torchrun, step {step}",
                     T("loss_differs", theirs=theirs[step], ours=ours[step], gap=gaps[step], tol=TOL),
                     T("exact_units"),
                     [f"losses, fully_shard: {[round(v, 6) for v in theirs]}",
                      f"losses, course FSDP: {[round(v, 6) for v in ours]}"]).fail()
    say_passed(check, [WORLD_SIZE],
        T("passed", units=", ".join(EXPECTED_UNITS), states=runs[0]["units"], gathers=runs[0]["all_gathers"] // STEPS,
          scatters=runs[0]["reduce_scatters"] // STEPS),
        T("losses", tol=TOL),
        *(T("step_below", step=step, theirs=a, ours=b) if gap < TOL else
          T("step_gap", step=step, theirs=a, ours=b, gap=gap)
          for step, (a, b, gap) in enumerate(zip(theirs, ours, gaps, strict=True))))


_hint = hints((NameError, T("import_inside")), ("is not defined", T("import_inside")),
              ("Invariant encountered", T("layers_first")))


def _judge_structure(check: str, where: str, calls: list[str]) -> None:
    units = list(dict.fromkeys(calls))
    if "root" in calls and calls.index("root") < len(calls) - 1:
        CheckFailure(check, where, T("root_first", calls=calls, after=", ".join(calls[calls.index("root") + 1:])),
                     T("bottom_up")).fail()
    if "root" not in units:
        CheckFailure(check, where, T("root_missing", units=units), T("finish_root")).fail()
    missing = [u for u in LAYERS if u not in units]
    if missing:
        CheckFailure(check, where, T("layer_missing", n=len(units), units=units, expected=len(EXPECTED_UNITS),
                                     missing=", ".join(missing)), T("every_layer")).fail()
    extra = [u for u in units if u not in EXPECTED_UNITS]
    if extra:
        CheckFailure(check, where, T("extra_units", n=len(units), expected=len(EXPECTED_UNITS), extra=extra),
                     T("only_course_units")).fail()


# What each torchrun process runs: the learner's source in a namespace holding only these imports, then
# `run_in_process`; its report goes to rank{r}.json in the launch's folder.
_IMPORTS = """\
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
"""
_SCRIPT = """\
import json, os, sys
from fsdp_course.classroom.checks.real_fsdp import run_in_process
from fsdp_course.runtime.context import RankContext

ctx = RankContext.from_env()
report = run_in_process(sys.argv[1], sys.argv[2], ctx)
with open(os.path.join(sys.argv[3], f"rank{ctx.rank}.json"), "w") as f:
    json.dump(report, f)
"""


def run_in_process(source: str, name: str, ctx: RankContext) -> dict[str, Any]:
    """In one process of a real world: define `name` from `source` among `_IMPORTS` alone (what a fresh process
    has), shard the small Transformer with it and train `STEPS` AdamW steps on this rank's slice; the units, losses
    and collectives it saw, or the error it raised."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    from fsdp_course.engines.torch_fsdp import count_collectives

    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    try:
        namespace: dict[str, Any] = {}
        exec(_IMPORTS + source, namespace)  # noqa: S102  (the learner's own function, as a fresh process runs it)
        model = _model()
        namespace[name](model, DeviceMesh.from_group(ctx.group, "cpu"))
        report["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        ctx.ledger.clear()
        with count_collectives(ctx):
            losses = [loss.item() for loss in _train(model, ctx)]
        ops = [r.op for r in ctx.ledger.records]
        report.update(losses=losses, all_gathers=ops.count("all_gather"), reduce_scatters=ops.count("reduce_scatter"))
    except Exception as exc:  # noqa: BLE001  (reported to the checker, which names it)
        report["error"] = f"{type(exc).__name__}: {exc}"
    return report


def _torchrun(check: str, fn: Callable[..., Any], name: str) -> list[dict[str, Any]]:
    where = f"world size {WORLD_SIZE}, torchrun"
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        CheckFailure(check, where, T("no_source", name=name), T("define_it")).fail()
    with tempfile.TemporaryDirectory(prefix="fsdp_course_fully_shard_") as tmp:
        script = os.path.join(tmp, "fully_shard_under_torchrun.py")
        Path(script).write_text(_SCRIPT)
        cmd = torchrun_command(script, WORLD_SIZE, source, fn.__name__, tmp)
        proc = start_torchrun(cmd, env={**os.environ, "TMPDIR": tmp}, cwd=tmp, what=check)
        try:
            _, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            CheckFailure(check, where, T("timeout", timeout=TORCHRUN_TIMEOUT), T("only_fully_shard", name=name)
                         ).fail()
        runs = []
        for rank in range(WORLD_SIZE):
            path = Path(tmp, f"rank{rank}.json")
            if not path.exists():
                CheckFailure(check, where, T("reported_nothing", rank=rank, code=proc.returncode),
                             T("fresh_process", name=name), stderr.strip().splitlines()[-6:]).fail()
            runs.append(json.loads(path.read_text()))
    return runs


def _judge_run(check: str, runs: list[dict[str, Any]]) -> None:
    where = f"world size {WORLD_SIZE}, torchrun"
    for rank, run in enumerate(runs):
        if "error" in run:
            CheckFailure(check, f"{where}, rank {rank}", T("process_raised", error=run["error"]),
                         T("in_fresh_process", hint=_hint(RuntimeError(run["error"])))).fail()
    if runs[0]["units"] != len(EXPECTED_UNITS):
        CheckFailure(check, where, T("fsdp_states", got=runs[0]["units"], expected=len(EXPECTED_UNITS)),
                     T("layers_then_model")).fail()
    per_step = runs[0]["all_gathers"] / STEPS
    expected = 1 + 2 * len(LAYERS)  # the root once, every layer in forward and again in backward
    if per_step != expected:
        CheckFailure(check, where, T("all_gathers", per_step=per_step, expected=expected), T("default_reshard")).fail()

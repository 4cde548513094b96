"""Checker of exercise 11: the course's units with PyTorch's `fully_shard`, trained under torchrun.

The learner writes `shard_like_course(model, mesh)`: apply `torch.distributed.fsdp.fully_shard` to the same units as
`FSDP(model, ctx, wrap={nn.TransformerEncoderLayer})`, bottom-up as fully_shard's docs ask: every
`nn.TransformerEncoderLayer` first, then the model itself (the root: embeddings, final norm, head), each with
`mesh=mesh` (what `fsdp_course/engines/torch_fsdp.py`'s `shard_with_fully_shard` does).

The check has two parts:

1. In this process: the learner's function on the small Transformer (mesh None), with `fully_shard` replaced in its
   namespace by a recorder that shards nothing: which modules it was applied to, in which order. Diagnosed by name:
   the root sharded before the layers (fully_shard then fails inside torch), the root not sharded, a layer
   missing, other modules made units.
2. One torchrun launch of 2 processes: each runs the learner's function (its source, shipped like the checkpoint
   checker's), trains `STEPS` AdamW steps on its half of each global batch with `count_collectives` on, and reports
   its losses and collectives. The losses (mean over the ranks) are compared with the course's
   `FSDP(..., reshard_root_after_forward=False)` in threads, at `TOL`; the all-gathers per step must be the
   course's units': the root once (fully_shard keeps it gathered from forward to backward), every layer twice.
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

from fsdp_course.classroom.checks._common import CheckFailure, exception_hint, require_callable, say
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.i18n.messages import Message, catalogue
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

T = catalogue("real_fsdp", {
    "loss_differs": ("fully_shard's loss {theirs:.6f} differs from the course's FSDP's {ours:.6f} by {gap:.1e} "
                     "(relative), above {tol:g}",
                     "fully_shard 的损失 {theirs:.6f} 与课程 FSDP 的损失 {ours:.6f} 的相对差为 {gap:.1e}，"
                     "超过了 {tol:g}"),
    "exact_units": ("shard exactly the course's units, each with mesh=mesh and no other options",
                    "只分片课程的这些单元，每个都用 mesh=mesh，不加其他选项"),
    "import_inside": ("the function runs in fresh processes, where only torch, nn and fully_shard are imported: import "
                      "anything else it uses inside the function",
                      "函数在全新的进程中运行，那里只导入了 torch、nn 和 fully_shard："
                      "它用到的其他东西要在函数内部导入"),
    "layers_first": ("fully_shard the layers first and the model last: applied to the model first, the root unit takes "
                     "every parameter, and the layers' fully_shard then finds no parameter of their own",
                     "先对各层调用 fully_shard，最后才是模型：如果先用在模型上，根单元会拿走所有参数，"
                     "之后各层的 fully_shard 就找不到属于自己的参数了"),
    "root_first": ("fully_shard was applied in the order {calls}: the root before {after}",
                   "fully_shard 的调用顺序是 {calls}：根单元排在 {after} 之前"),
    "bottom_up": ("bottom-up, as fully_shard's docs ask: every layer first, then fully_shard(model) last; the root "
                  "sharded first would take every parameter into one unit",
                  "按 fully_shard 文档的要求自底向上：先对每一层调用 fully_shard，最后才是 fully_shard(model)；"
                  "如果先分片根模块，它会把所有参数都放进同一个单元"),
    "root_missing": ("the model itself is not sharded: fully_shard was applied to {units} only",
                     "模型本身没有分片：fully_shard 只用在了 {units} 上"),
    "finish_root": ("finish with fully_shard(model, mesh=mesh): the root unit holds what no layer owns (embeddings, "
                    "final norm, head); without it those parameters are neither sharded nor averaged over the ranks, "
                    "and the replicas drift apart",
                    "最后调用 fully_shard(model, mesh=mesh)：根单元持有不属于任何层的参数（嵌入、最后的 norm、"
                    "分类头）；没有它，这些参数既不分片，也不在各 rank 间平均，各副本会逐渐分叉"),
    "layer_missing": ("{n} units ({units}), expected {expected}: {missing} not a unit of its own",
                      "{n} 个单元（{units}），应为 {expected} 个：{missing} 不是一个独立的单元"),
    "every_layer": ("call fully_shard(layer, mesh=mesh) for every layer in model.encoder.layers before the model",
                    "在模型之前，对 model.encoder.layers 中的每一层调用 fully_shard(layer, mesh=mesh)"),
    "extra_units": ("{n} units, expected {expected}: {extra} made units as well",
                    "{n} 个单元，应为 {expected} 个：{extra} 也被做成了单元"),
    "only_course_units": ("the course's units are the encoder layers and the root, nothing else",
                          "课程的单元是各编码器层和根单元，没有别的"),
    "no_source": ("the source of {name} cannot be found", "找不到 {name} 的源代码"),
    "define_it": ("define it in a notebook cell or a .py file: torchrun's processes run its source",
                  "在 notebook 的单元格或 .py 文件里定义它：torchrun 的进程运行的是它的源代码"),
    "timeout": ("torchrun did not finish within {timeout:g} s", "torchrun 没有在 {timeout:g} 秒内结束"),
    "only_fully_shard": ("{name} must only call fully_shard", "{name} 只能调用 fully_shard"),
    "reported_nothing": ("rank {rank}'s process reported nothing (torchrun exit code {code})",
                         "rank {rank} 的进程什么也没有报告（torchrun 退出码 {code}）"),
    "fresh_process": ("{name} runs in a fresh process: it may use only its arguments, torch and fully_shard",
                      "{name} 在一个全新的进程里运行：只能使用它的参数、torch 和 fully_shard"),
    "process_raised": ("the process raised {error}", "该进程抛出了 {error}"),
    "in_fresh_process": ("{hint} (the function runs in a fresh process: it may use only its arguments, torch and "
                         "fully_shard)",
                         "{hint}（函数在一个全新的进程里运行：只能使用它的参数、torch 和 fully_shard）"),
    "fsdp_states": ("{got} FSDP states under torchrun, expected {expected}: one per encoder layer and the root",
                    "torchrun 下有 {got} 个 FSDP 状态，应为 {expected} 个：每个编码器层一个，再加根单元"),
    "layers_then_model": ("fully_shard(layer, mesh=mesh) for every layer, then fully_shard(model, mesh=mesh)",
                          "对每一层调用 fully_shard(layer, mesh=mesh)，然后调用 fully_shard(model, mesh=mesh)"),
    "all_gathers": ("{per_step:g} all-gathers per step, expected {expected}: the root once and every layer twice",
                    "每步 {per_step:g} 次全聚合，应为 {expected} 次：根单元一次，每一层两次"),
    "default_reshard": ("shard every layer, then the model, with the default reshard_after_forward (the root stays "
                        "gathered, the layers are gathered again in the backward)",
                        "先分片每一层，再分片模型，使用默认的 reshard_after_forward（根单元保持全聚合，"
                        "各层在反向时再全聚合一次）"),
    # what passed
    "passed": ("  fully_shard on {units}, in that order: {states} FSDP states; {gathers} all-gathers and {scatters} "
               "reduce-scatters per step under torchrun",
               "  按 {units} 的顺序调用 fully_shard：{states} 个 FSDP 状态；在 torchrun 下每步 {gathers} 次全聚合、"
               "{scatters} 次归约分散"),
    "losses": ("  step  loss, fully_shard  loss, course FSDP  relative difference (below {tol:g})",
               "  步骤  fully_shard 损失    课程 FSDP 损失  相对差（低于 {tol:g}）"),
    "step_below": ("  {step:>4}  {theirs:>16.4f}  {ours:>16.4f}  below 1e-5",
                   "  {step:>4}  {theirs:>16.4f}  {ours:>16.4f}  低于 1e-5"),
    "step_gap": ("  {step:>4}  {theirs:>16.4f}  {ours:>16.4f}  {gap:.1e}",
                 "  {step:>4}  {theirs:>16.4f}  {ours:>16.4f}  {gap:.1e}（未低于上限）"),
})


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


def _structure(check: str, name: str, fn: Callable[..., Any]) -> dict[str, Any]:
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
    return {"calls": calls, "recorded": bool(calls), "units": list(dict.fromkeys(calls))}


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
    report = _structure(check, name, fn)
    if report["recorded"]:  # else (fully_shard under another name) torchrun's run tells
        _judge_structure(check, where, report)
    _verdict(check, launch(check, fn, name))


def _verdict(check: str, runs: list[dict[str, Any]]) -> None:
    """Judge what every torchrun process reported (`run_in_process`), then print what passed."""
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
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=WORLD_SIZE)),
        T("passed", units=", ".join(EXPECTED_UNITS), states=runs[0]["units"], gathers=runs[0]["all_gathers"] // STEPS,
          scatters=runs[0]["reduce_scatters"] // STEPS),
        T("losses", tol=TOL),
        *(T("step_below", step=step, theirs=a, ours=b) if gap < TOL else
          T("step_gap", step=step, theirs=a, ours=b, gap=gap)
          for step, (a, b, gap) in enumerate(zip(theirs, ours, gaps, strict=True))))


def _hint(exc: BaseException) -> Message:
    if isinstance(exc, NameError) or "is not defined" in str(exc):
        return T("import_inside")
    if "Invariant encountered" in str(exc):
        return T("layers_first")
    return exception_hint(exc)


def _judge_structure(check: str, where: str, report: dict[str, Any]) -> None:
    calls, units = report["calls"], report["units"]
    if report["recorded"] and "root" in calls and calls.index("root") < len(calls) - 1:
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
